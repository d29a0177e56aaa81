"""The token embedding and the output head as FSDP units of their own (Note [FSDP embedding
and head units]; torchtune's ``custom_sharded_layers: ['tok_embeddings', 'output']``,
recipes/configs/llama3_1/70B_full.yaml @30b8519e): each gathered around its own forward and
backward on the all-gather stream, the root left with the final norm."""

from __future__ import annotations

import dataclasses

import pytest

from trainmem.analytic.schedule import ALL_GATHER_STREAM
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

# Llama-2-7B: embedding and head 32,000 x 4,096 each, bf16: 262,144,000 B; final norm 8,192 B
VOCAB_BYTES = 2 * 32_000 * 4_096
NORM_BYTES = 2 * 4_096

BASE = TrainingConfig(
    framework="torchtune",
    zero_stage=3,
    data_parallel_size=4,
    precision="bf16-true",
    seq_len=256,
    micro_batch_size=1,
    activation_checkpointing="full",
)


def _step_allocs(training: TrainingConfig, model: str = "llama-2-7b") -> list[tuple[int, str, int]]:
    """(size, module, stream) of the measured step's allocations (the schedule's ``step``)."""
    sched = estimate(model, training, simulate_allocator=False).schedules[0]
    step = dataclasses.replace(sched, setup=(), load=())
    return [(ev.size_bytes, ev.module, ev.stream) for ev in step.events() if ev.action == "alloc"]


def test_root_keeps_the_norm_and_each_unit_is_gathered_twice() -> None:
    before = _step_allocs(BASE)
    after = _step_allocs(dataclasses.replace(BASE, fsdp_embedding_head_units=True))
    # the root's gather: embedding + norm + head without the units, the norm with them
    assert (2 * VOCAB_BYTES + NORM_BYTES, "(model)", 0) in before
    assert (NORM_BYTES, "(model)", 0) in after
    assert not any(size == 2 * VOCAB_BYTES + NORM_BYTES for size, _, _ in after)
    # forward and backward: the embedding's and the head's gathers on the all-gather stream
    units = [(m, s) for size, m, s in after if size == VOCAB_BYTES and s == ALL_GATHER_STREAM]
    assert (
        sorted(units) == [("embedding", ALL_GATHER_STREAM)] * 2 + [("head", ALL_GATHER_STREAM)] * 2
    )


def test_a_frozen_embedding_is_not_gathered_in_backward() -> None:
    # FSDP2's pre-backward hook sits on outputs that require grad: under LoRA the embedding's
    # output does not, so only its forward gather remains
    lora = dataclasses.replace(BASE, fsdp_embedding_head_units=True, lora_rank=8)
    units = [
        m for size, m, s in _step_allocs(lora) if size == VOCAB_BYTES and s == ALL_GATHER_STREAM
    ]
    assert sorted(units) == ["embedding", "head", "head"]


def test_the_head_backward_peak_loses_the_embedding() -> None:
    # Llama-3.1-70B on 8 ranks as 70B_full.yaml runs it (compiled chunked loss, CPU offload):
    # the peak is in the head's backward,
    # where the root held the embedding's 128,256 x 8,192 x 2 B = 2,101,346,304 B gathered
    # beside the head's; as units of their own only the head's is gathered there
    training = dataclasses.replace(
        BASE,
        data_parallel_size=8,
        seq_len=2048,
        micro_batch_size=2,
        chunked_cross_entropy=8,
        compile=True,
        offload="optimizer+params",
    )
    peaks = [
        estimate("llama-3.1-70b", t, simulate_allocator=False).schedules[0].peak()
        for t in (training, dataclasses.replace(training, fsdp_embedding_head_units=True))
    ]
    assert peaks[0].module == peaks[1].module == "head"
    assert peaks[0].peak_bytes - peaks[1].peak_bytes == 2 * 128_256 * 8_192


@pytest.mark.parametrize(
    ("model", "framework", "message"),
    [("llama-3.2-1b", "torchtune", "tied"), ("llama-2-7b", "fsdp2", "post-backward")],
)
def test_refused_where_not_modelled(model: str, framework: str, message: str) -> None:
    training = dataclasses.replace(BASE, framework=framework, fsdp_embedding_head_units=True)
    with pytest.raises(UnsupportedError, match=message):
        estimate(model, training, engine="analytic", simulate_allocator=False)


def test_the_trace_engine_refuses_it() -> None:
    # the trace wraps the layers and the root only (trace/fsdp.py)
    from trainmem.estimate import trace_unsupported_settings

    training = dataclasses.replace(BASE, framework="fsdp2", fsdp_embedding_head_units=True)
    assert "fsdp_embedding_head_units=True" in trace_unsupported_settings(training)
