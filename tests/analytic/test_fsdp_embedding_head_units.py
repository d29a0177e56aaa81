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


def test_at_the_chunked_heads_weight_gradient_peak() -> None:
    # Llama-3.1-70B on 8 ranks as 70B_full.yaml runs it (compiled chunked loss, CPU offload).
    # When the next chunk's head weight gradient and its sum are made (2 x V h x 2 B), alive:
    # the head unit's gathered weight (V h x 2 B, all-gather stream) and its unsharded
    # gradient so far (V h x 2 B), not the root's gathered embedding (V = 128,256, h = 8,192)
    vh2 = 2 * 128_256 * 8_192
    training = dataclasses.replace(
        BASE,
        data_parallel_size=8,
        seq_len=2048,
        micro_batch_size=2,
        chunked_cross_entropy=8,
        compile=True,
        offload="optimizer+params",
        fsdp_embedding_head_units=True,
    )
    sched = estimate("llama-3.1-70b", training, simulate_allocator=False).schedules[0]
    live: dict[int, tuple[int, str, int]] = {}
    for ev in sched.events():  # the setup's events too: the step frees what they made
        if ev.action == "free":
            live.pop(ev.block_id, None)
            continue
        if ev.size_bytes == 2 * vh2 and ev.module == "head":
            break
        live[ev.block_id] = (ev.size_bytes, ev.module, ev.stream)
    head = sorted(v for v in live.values() if v[1] == "head" and v[0] == vh2)
    assert head == [(vh2, "head", 0), (vh2, "head", ALL_GATHER_STREAM)]
    assert not any(v[0] >= vh2 for v in live.values() if v[1] in ("(model)", "embedding"))


def test_a_trained_unit_reduces_its_unsharded_gradient() -> None:
    # per step and unit (full fine-tuning, 4 ranks): the unsharded gradient and the
    # reduce-scatter input (V h x 2 B each, default stream), then this rank's shard (a quarter)
    allocs = _step_allocs(dataclasses.replace(BASE, fsdp_embedding_head_units=True))
    for unit in ("head", "embedding"):
        # two gathers (forward, backward) on the all-gather stream, two on the default one
        streams = sorted(s for size, m, s in allocs if m == unit and size == VOCAB_BYTES)
        assert streams == [0, 0, ALL_GATHER_STREAM, ALL_GATHER_STREAM]
        assert any(m == unit and size == VOCAB_BYTES // 4 for size, m, _ in allocs)


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


def test_without_fsdp_the_setting_warns() -> None:
    # no FSDP unit to make: the option has no effect, and says so
    from trainmem.estimate import setting_warnings

    alone = TrainingConfig(fsdp_embedding_head_units=True)
    assert any("fsdp_embedding_head_units" in n for n in setting_warnings("gpt2", alone))
    sharded = dataclasses.replace(BASE, fsdp_embedding_head_units=True)
    assert not any("fsdp_embedding_head_units" in n for n in setting_warnings("gpt2", sharded))


def test_an_optimizer_in_backward_steps_the_units_shards() -> None:
    # the units' shards are made in their post-backward, before the optimizer in backward
    # steps and frees them (torchtune's optimizer_in_bwd, 0.4+): both in the backward
    training = dataclasses.replace(BASE, fsdp_embedding_head_units=True, optimizer_in_backward=True)
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    step = dataclasses.replace(sched, setup=(), load=())
    made: dict[int, str] = {}
    freed = []
    for ev in step.events():
        if ev.action == "alloc" and ev.size_bytes == VOCAB_BYTES // 4:
            made[ev.block_id] = ev.module
        elif ev.action == "free" and ev.block_id in made:
            freed.append((made.pop(ev.block_id), ev.phase))
    assert sorted(freed) == [("embedding", "backward"), ("head", "backward")]
    assert not made
