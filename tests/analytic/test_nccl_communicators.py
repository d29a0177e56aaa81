"""NCCL communicator memory per GPU generation, and ``--nccl-buffer-bytes`` (issue 29, item
11): one A100 measurement (688 MiB, NVIDIA/nccl #964) stood for every GPU, while H100 runs
report 1.0-1.6 GB (NVIDIA/nccl #1685: 1.06 GB on 8 x H100; #864: about 1.6 GB). A figure the
user measured always wins."""

from __future__ import annotations

import json

import pytest

from conftest import Invoke
from trainmem import TrainingConfig
from trainmem.analytic.buffers import (
    NCCL_COMMUNICATOR_BYTES,
    NCCL_HOPPER_COMMUNICATOR_BYTES,
    NCCL_PAIR_COMMUNICATOR_BYTES,
    nccl_communicator_bytes,
)
from trainmem.errors import SpecError
from trainmem.specs.hardware import get_gpu

PARALLEL = TrainingConfig(data_parallel_size=8, tensor_parallel_size=2)


def test_a100_keeps_its_measurement() -> None:
    sizes = nccl_communicator_bytes(PARALLEL, get_gpu("A100-80GB"))
    assert sizes == {"data": NCCL_COMMUNICATOR_BYTES, "tensor": NCCL_PAIR_COMMUNICATOR_BYTES}
    assert nccl_communicator_bytes(PARALLEL) == sizes  # no GPU given: the same figures


@pytest.mark.parametrize("gpu", ["H100-80GB", "H200", "GH200"])
def test_hopper_takes_the_h100_measurement(gpu: str) -> None:
    sizes = nccl_communicator_bytes(PARALLEL, get_gpu(gpu))
    assert sizes == {
        "data": NCCL_HOPPER_COMMUNICATOR_BYTES,
        "tensor": NCCL_HOPPER_COMMUNICATOR_BYTES,
    }
    assert 1_000_000_000 <= NCCL_HOPPER_COMMUNICATOR_BYTES <= 1_600_000_000


@pytest.mark.parametrize("gpu", ["A100-80GB", "H100-80GB"])
def test_an_explicit_size_wins_on_every_gpu(gpu: str) -> None:
    given = TrainingConfig(data_parallel_size=8, pipeline_parallel_size=2, nccl_buffer_bytes=123)
    sizes = nccl_communicator_bytes(given, get_gpu(gpu))
    assert sizes == {"data": 123, "pipeline": 123}


def test_the_cli_flag_reaches_the_device_total(invoke: Invoke) -> None:
    args = ["estimate", "gpt2", "--data-parallel-size", "8", "--gpu", "H100-80GB", "--json"]
    default = json.loads(invoke(*args).stdout)
    given = json.loads(invoke(*args, "--nccl-buffer-bytes", "1000").stdout)
    context = default["breakdown_bytes"]["cuda_context"] - given["breakdown_bytes"]["cuda_context"]
    assert context == NCCL_HOPPER_COMMUNICATOR_BYTES - 1000
    assert any("--nccl-buffer-bytes" in note for note in given["notes"])


@pytest.mark.parametrize("value", [-1, 2**41, 1.5, True, "1GB"])
def test_a_bad_size_is_a_spec_error(value: object) -> None:
    with pytest.raises(SpecError, match="nccl_buffer_bytes: .*allowed: bytes per communicator"):
        TrainingConfig(nccl_buffer_bytes=value)  # type: ignore[arg-type]


# Note [NCCL without peer access]: GeForce boards over PCIe have no peer access, so NCCL's shm
# transport keeps every connection's buffers in host shared memory (src/transport/shm.cc).
@pytest.mark.parametrize("gpu", ["RTX-3090", "RTX-4090", "RTX-5090"])
def test_geforce_boards_hold_no_communicator_on_the_device(gpu: str) -> None:
    assert not get_gpu(gpu).peer_access
    assert nccl_communicator_bytes(PARALLEL, get_gpu(gpu)) == {}
    given = TrainingConfig(data_parallel_size=2, nccl_buffer_bytes=123)  # an NVLink bridge
    assert nccl_communicator_bytes(given, get_gpu(gpu)) == {"data": 123}


@pytest.mark.parametrize("gpu", ["A100-80GB", "L40S", "RTX-A6000", "H100-80GB"])
def test_boards_with_peer_access_keep_their_communicators(gpu: str) -> None:
    assert get_gpu(gpu).peer_access
    assert nccl_communicator_bytes(PARALLEL, get_gpu(gpu))


def test_a_measured_reserved_figure_fits_the_replay_capacity() -> None:
    """fsdp_qlora benchmarks_03_2024.md: 2 x RTX 3090 (no NVLink), Yi-34B QLoRA with CPU
    offload, 22.98 GiB max_memory_reserved per rank (dev row GT128). A real run's reserved
    memory never exceeds what cudaMalloc could give it, so the replay's capacity (total_memory
    less the CUDA context and the communicators) must be at least that: 23.69 GiB less the
    500 MiB default context = 25,436,943,811 - 524,288,000 = 24,912,655,811 B; with the A100's
    544 MiB pair communicator it was 24,342,230,467 B, below the measured 24,674,587,116 B."""
    from trainmem.allocator.device import allocator_capacity_bytes
    from trainmem.analytic.buffers import device_context

    gpu = get_gpu("RTX-3090")
    pair = TrainingConfig(data_parallel_size=2, zero_stage=3)
    context, outside, notes = device_context(pair, None, gpu=gpu)
    assert outside == {}
    assert any("host shared memory" in note for note in notes)
    capacity = allocator_capacity_bytes(gpu, context_bytes=context)
    assert capacity == 25_436_943_811 - 524_288_000
    assert capacity >= round(22.98 * 2**30)
