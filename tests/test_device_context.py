"""Memory beside the caching allocator is counted once, by the driver, for every engine: the
CUDA context (the user's figure wins over the default) and the NCCL communicators (NCCL
``cudaMalloc``s them outside the allocator). Expected figures: the measured communicator sizes
of NVIDIA/nccl issue #964 (544 MB for a two-rank group, 688 MB above two ranks, nvidia-smi
MiB), one communicator per parallel dimension of size > 1."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

MiB = 2**20


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_user_context_and_nccl_communicators_on_every_engine(engine: str) -> None:
    if engine == "trace":
        pytest.importorskip("transformers")
    training = TrainingConfig(
        micro_batch_size=1, seq_len=32, data_parallel_size=2, zero_stage=3, framework="fsdp2"
    )
    user_context = 1000 * MiB
    est = estimate(
        "tiny-llama-test",
        training,
        engine=engine,
        cuda_context_bytes=user_context,
        simulate_allocator=False,
    )
    assert est.breakdown.cuda_context == user_context + 544 * MiB
    assert est.details["outside_allocator_bytes"] == {"nccl_communicator/data": 544 * MiB}


def test_trace_engine_counts_a_tensor_parallel_communicator_like_the_analytic_one() -> None:
    pytest.importorskip("transformers")
    training = TrainingConfig(
        micro_batch_size=1,
        seq_len=32,
        data_parallel_size=4,
        zero_stage=3,
        framework="fsdp2",
        tensor_parallel_size=2,
    )
    got = {
        engine: estimate(
            "tiny-llama-test", training, engine=engine, simulate_allocator=False
        ).breakdown.cuda_context
        for engine in ("analytic", "trace")
    }
    # default context 500 MiB + a 4-rank data-parallel group (688) + a 2-rank TP pair (544)
    assert got == {e: (500 + 688 + 544) * MiB for e in got}


@pytest.mark.parametrize(
    ("torch_version", "context_mib"), [("1.10", 1343), ("1.13", 500), (None, 500)]
)
def test_the_default_context_follows_lazy_module_loading(
    torch_version: str | None, context_mib: int
) -> None:
    # PyTorch sets CUDA_MODULE_LOADING=LAZY from 1.13 (PR #86509): the measured 500 MiB stack;
    # before, the eager-loading 1343 MiB of the torch 1.10 era (HF perf_train_gpu_one docs);
    # a user's figure wins over both
    training = TrainingConfig(micro_batch_size=1, seq_len=32, torch_version=torch_version)
    est = estimate("tiny-llama-test", training, engine="analytic", simulate_allocator=False)
    assert est.breakdown.cuda_context == context_mib * MiB
    given = estimate(
        "tiny-llama-test",
        training,
        engine="analytic",
        cuda_context_bytes=700 * MiB,
        simulate_allocator=False,
    )
    assert given.breakdown.cuda_context == 700 * MiB
