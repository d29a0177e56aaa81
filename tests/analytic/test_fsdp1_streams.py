"""FSDP1's side streams (FrameworkConventions.fsdp_collective_streams): torch/distributed/fsdp/
_runtime_utils.py (torch 2.2 .. 2.5) allocates the unsharded flat parameter in ``_unshard`` under
``stream(unshard_stream)`` and the reduce-scatter output, kept as the sharded gradient, in
``_post_backward_hook`` under ``stream(state._post_backward_stream)``; the caching allocator
pools blocks per stream, so those bytes are reserved apart from the default stream's."""

from __future__ import annotations

import pytest

from trainmem.analytic.schedule import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM
from trainmem.analytic.transforms.base import PRE_UNSHARD_STREAM
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

# Llama-2-7B: one decoder layer = 4 * 4096^2 (q, k, v, o) + 3 * 4096 * 11008 (gate, up, down)
# + 2 * 4096 (norms) = 202,383,360 parameters; the model 6,738,415,616
LAYER = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
MODEL = 6_738_415_616


def _allocs(framework: str) -> list[object]:
    training = TrainingConfig(
        framework=framework,
        zero_stage=3,
        data_parallel_size=4,
        precision="bf16-true",
        seq_len=512,
        micro_batch_size=2,
        activation_checkpointing="full",
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    return [ev for ev in sched.events() if ev.action == "alloc"]


@pytest.mark.parametrize("framework", ["torchtune", "litgpt"])
def test_fsdp1_gradients_on_the_post_backward_stream(framework: str) -> None:
    step = _allocs(framework)
    rs = [ev for ev in step if ev.stream == REDUCE_SCATTER_STREAM]  # type: ignore[attr-defined]
    assert {ev.category for ev in rs} == {MemoryCategory.GRADIENT}  # type: ignore[attr-defined]
    # bf16 sharded gradients of every parameter over 4 ranks: 2 * 6,738,415,616 / 4 bytes per
    # step (the warm-up step and the measured one), + padding of each flat parameter under 1%
    per_step = sum(ev.size_bytes for ev in rs) / 2  # type: ignore[attr-defined]
    assert 2 * MODEL / 4 <= per_step < 2 * MODEL / 4 * 1.01
    # the prefetched unit's unsharded flat parameter on the unshard stream: 2 B * 202,383,360
    ag = {ev.size_bytes for ev in step if ev.stream == ALL_GATHER_STREAM}  # type: ignore[attr-defined]
    assert ag == {2 * LAYER}


def test_frameworks_without_fsdp_streams_stay_on_the_default_stream() -> None:
    assert {ev.stream for ev in _allocs("hf-trainer")} == {0}  # type: ignore[attr-defined]


def test_fsdp_qlora_runs_the_same_fsdp1_streams() -> None:
    # Answer.AI fsdp_qlora's train.py wraps with torch's FSDP1 (torch 2.2 _runtime_utils.py): the
    # same unshard and post-backward streams as torchtune's FSDP1 recipes (commit 60e975b)
    streams = {ev.stream for ev in _allocs("fsdp-qlora")}  # type: ignore[attr-defined]
    assert streams == {0, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM}


def test_fsdp_qlora_cpu_offload_copies_the_largest_shard_on_the_pre_unshard_stream() -> None:
    # Note [FSDP1 offloaded shard copy]: torch 2.2 _flat_param.py ``pre_unshard`` copies an
    # offloaded unit's local shard to the GPU (``flat_param_to(self.device)``) under
    # ``stream(pre_unshard_stream)`` (_runtime_utils.py ``_unshard``). Llama-2-7B's root unit
    # (embedding and head 32000 x 4096 each, final norm 4096; bf16, no mixed precision) is the
    # largest: 2 B * (2 * 32000 * 4096 + 4096) / 2 ranks = 262,148,096 bytes per micro-batch;
    # a layer's frozen NF4 weights are 101,203,968 B unsharded, less.
    def allocs(offload: str) -> list[object]:
        training = TrainingConfig(
            framework="fsdp-qlora",
            zero_stage=3,
            data_parallel_size=2,
            precision="bf16-true",
            seq_len=256,
            micro_batch_size=1,
            activation_checkpointing="full",
            offload=offload,
            quantize_base="nf4-dq",
            lora_rank=8,
        )
        sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
        return [ev for ev in sched.events() if ev.action == "alloc"]

    copies = [ev for ev in allocs("optimizer+params") if ev.stream == PRE_UNSHARD_STREAM]  # type: ignore[attr-defined]
    assert [ev.size_bytes for ev in copies] == [262_148_096] * 2  # type: ignore[attr-defined]
    assert not [ev for ev in allocs("none") if ev.stream == PRE_UNSHARD_STREAM]  # type: ignore[attr-defined]
