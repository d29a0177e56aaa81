"""Steps of varying length before the measured one (Note [Steps of varying length]): the
setup runs one step per listed length, then one at ``seq_len``; the measured step is at
``seq_len``, and the replay's allocator carries every step's cached blocks."""

from __future__ import annotations

import dataclasses

import pytest

from trainmem.breakdown import MemoryCategory
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

# Llama-2-7B (hidden 4096, 32 layers), LoRA on q, v, full checkpointing, bf16, batch 2: each
# layer's checkpointed input is 2 x L x 4096 x 2 B, 16,384 L bytes at length L
BASE = TrainingConfig(
    micro_batch_size=2,
    seq_len=512,
    precision="bf16-true",
    activation_checkpointing="full",
    lora_rank=8,
    lora_targets=("q", "v"),
    framework="torchtune",
)


def _estimate(lengths: str | None) -> object:
    training = dataclasses.replace(BASE, earlier_seq_lens=lengths)
    return estimate("llama-2-7b", training, engine="analytic")


def _checkpoint_sizes(items: object) -> set[int]:
    """Sizes of the layer inputs the checkpointed layers save, in an event stream."""
    return {
        ev.size_bytes
        for ev in items  # type: ignore[attr-defined]
        if ev.action == "alloc"
        and ev.category == MemoryCategory.ACTIVATION
        and ev.size_bytes % 16_384 == 0
        and ev.module.startswith("layers.")
    }


def test_each_listed_length_runs_one_step_before_the_measured_one() -> None:
    est = _estimate("128,384")
    sched = est.schedules[0]  # type: ignore[attr-defined]
    events = list(sched.events())
    start = sched._cache["steady_state_start"]
    # the setup holds a step at 128 (the warm-up), one at 384, one at 512; the step is at 512
    assert {16_384 * n for n in (128, 384, 512)} <= _checkpoint_sizes(events[:start])
    assert 16_384 * 512 in _checkpoint_sizes(events[start:])
    assert not _checkpoint_sizes(events[start:]) & {16_384 * 128, 16_384 * 384}


def test_the_measured_step_and_its_allocated_peak_are_unchanged() -> None:
    plain, varied = _estimate(None), _estimate("100,300,200")
    assert varied.schedules[0].step == plain.schedules[0].step  # type: ignore[attr-defined]
    assert varied.breakdown.allocated_bytes == plain.breakdown.allocated_bytes  # type: ignore[attr-defined]


def test_rising_lengths_leave_more_reserved_than_one_length() -> None:
    # each longer step's tensors do not fit the shorter step's cached blocks and take new
    # segments beside them (c10/cuda/CUDACachingAllocator.cpp: nothing is released before an
    # allocation fails); the replay keeps every one
    plain, rising = _estimate(None), _estimate(",".join(str(n) for n in range(100, 501, 50)))
    assert rising.breakdown.reserved_bytes > plain.breakdown.reserved_bytes  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", ["", "12,x", "0", "3,-1", "²", ",".join(["8"] * 65)])
def test_bad_lists_are_refused(text: str) -> None:
    with pytest.raises(SpecError, match="earlier_seq_lens"):
        TrainingConfig(earlier_seq_lens=text)


def test_a_length_above_seq_len_counts_as_seq_len_with_a_warning() -> None:
    # the setup's steps at 513 and 512 are the same step at seq_len = 512
    plain, longer = _estimate("512"), _estimate("513")
    assert longer.schedules[0].setup == plain.schedules[0].setup  # type: ignore[attr-defined]
    assert any("above seq_len=512" in n for n in longer.notes)  # type: ignore[attr-defined]
    assert not any("earlier_seq_lens" in n for n in plain.notes)  # type: ignore[attr-defined]


def test_the_traced_paths_trace_each_length() -> None:
    # each listed length is one more traced step (tests/trace/test_traced_options.py), so the
    # setting is no longer refused there
    from trainmem.estimate import trace_unsupported_settings

    assert trace_unsupported_settings(TrainingConfig(earlier_seq_lens="64"), "generic") == []
    assert trace_unsupported_settings(TrainingConfig(earlier_seq_lens="64")) == []


def test_after_steps_takes_the_traced_state_from_the_measured_length() -> None:
    # a traced setup allocates its batch at init (b x s token ids and labels, here 8 B a
    # token); spliced after the earlier lengths' steps the measured step must start from its
    # own length's batch, not the first listed length's (the formulas keep no batch: the
    # default, the first schedule's state, is theirs)
    from trainmem.analytic.varying_lengths import after_steps
    from trainmem.schedule import Op, StepSchedule

    def traced(tokens: int) -> StepSchedule:
        weights = Op("alloc", 1_000, MemoryCategory.PARAMETER, "init", "w")
        batch = Op("alloc", 8 * tokens, MemoryCategory.INPUT, "init", "batch")
        act = Op("alloc", 100 * tokens, MemoryCategory.ACTIVATION, "forward", "a")
        step = (act, act._replace(action="free", phase="backward"))
        return StepSchedule(setup=(weights, batch, *step), step=step)

    short, measured = traced(16), traced(64)
    spliced = after_steps([short], measured, measured_state=True)
    assert spliced.live_before_step()[MemoryCategory.INPUT] == 8 * 64
    assert spliced.peak().peak_bytes == measured.peak().peak_bytes == 1_000 + 8 * 64 + 6_400
    # the warm-up step is the short one, then the measured length's step twice
    acts = [op.size_bytes for op in spliced.setup if op.category is MemoryCategory.ACTIVATION]
    assert acts == [1_600, 1_600, 6_400, 6_400]
    assert after_steps([short], measured).live_before_step()[MemoryCategory.INPUT] == 8 * 16
