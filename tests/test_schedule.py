"""One description of the step (issue 11): the StepSchedule's fast peak equals its expansion,
the driver's reserved memory is whole segments within the GPU, and every command agrees on
whether a run fits."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.planner.search import max_micro_batch_size
from trainmem.schedule import Op, Repeat, StepSchedule
from trainmem.specs.hardware import get_gpu
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import AllocEvent, EventRecord

MiB = 2**20
SEGMENT = 2 * MiB  # kLargeBuffer / small-pool segment: every segment is a multiple of 2 MiB


def _a(size: int, key: str, cat: Cat = Cat.ACTIVATION) -> Op:
    return Op("alloc", size, cat, "forward", key, "layers.{i}")


def _f(size: int, key: str, cat: Cat = Cat.ACTIVATION) -> Op:
    return Op("free", size, cat, "backward", key, "layers.{i}")


def test_repeat_peak_by_hand() -> None:
    # 3 layers, each saves 10 and holds a transient 5 in forward; backward frees in reverse
    # while a gradient of 4 per layer appears. By hand: forward ends at 30, the highest point is
    # the last layer's transient, 20 + 10 + 5 = 35; backward: 30 - 10 + 4 = 24, ... lower.
    body = (_a(10, "act/{i}"), _a(5, "tmp"), _f(5, "tmp"))
    back = (_a(4, "g/{i}", Cat.GRADIENT), _f(10, "act/{i}"))
    sched = StepSchedule(
        setup=(_a(100, "w", Cat.PARAMETER),), step=(Repeat(body, 3), Repeat(back, 3, reverse=True))
    )
    peak = sched.peak()
    assert peak.peak_bytes == 100 + 35
    assert peak.by_category == {Cat.PARAMETER: 100, Cat.ACTIVATION: 35}
    assert peak.module == "layers.2"  # the last forward layer
    events = sched.expand().events
    assert len(events) == 1 + 3 * 3 + 3 * 2
    # backward runs layer 2 first: its free names the block layer 2's forward allocated
    first_free = next(e for e in events if e.action == "free" and e.size_bytes == 10)
    first_alloc = next(
        e for e in events if e.action == "alloc" and e.block_id == first_free.block_id
    )
    assert first_alloc.module == "layers.2"
    assert sched.category_peak(Cat.GRADIENT) == 12


def _expanded_peak(sched: StepSchedule) -> int:
    timeline = sched.expand()
    live = best = 0
    for k, ev in enumerate(timeline.events):
        live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
        if k >= timeline.steady_state_start:
            best = max(best, live)
    before = sum(
        e.size_bytes if e.action == "alloc" else -e.size_bytes
        for e in timeline.events[: timeline.steady_state_start]
    )
    return max(best, before)


CONFIGS = st.fixed_dictionaries(
    {
        "micro_batch_size": st.integers(1, 4),
        "seq_len": st.sampled_from([16, 64, 128, 512]),
        "precision": st.sampled_from(["32-true", "bf16-mixed", "bf16-true", "16-mixed"]),
        "optimizer": st.sampled_from(["adamw", "sgd", "adafactor", "adamw-8bit", "lion"]),
        "optimizer_implementation": st.sampled_from(["foreach", "fused", "for-loop"]),
        "activation_checkpointing": st.sampled_from(["none", "selective", "full"]),
        "attention": st.sampled_from(["sdpa", "eager"]),
        "gradient_accumulation_steps": st.sampled_from([1, 2, 5]),
        "zero_stage": st.sampled_from([0, 1, 2, 3]),
        "data_parallel_size": st.sampled_from([1, 4]),
        "activation_offloading": st.booleans(),
        "zero_grad_set_to_none": st.booleans(),
        "pipeline_parallel_size": st.sampled_from([1, 2]),
        "lora_rank": st.sampled_from([0, 8]),
    }
)


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(config=CONFIGS, model=st.sampled_from(["tiny-gpt2-test", "gpt2", "llama-3.2-1b"]))
def test_peak_is_the_peak_of_the_expansion(config: dict, model: str) -> None:
    try:
        training = TrainingConfig(**config)
    except Exception:  # combinations TrainingConfig refuses are not schedules
        return
    try:
        est = estimate(model, training, simulate_allocator=False)
    except SpecError:  # nor are settings the model refuses (seq_len past learned positions)
        return
    for sched in est.schedules:
        assert sched.peak().peak_bytes == _expanded_peak(sched)
    assert est.breakdown.allocated_bytes == max(s.peak().peak_bytes for s in est.schedules)


MATRIX = [
    ("gpt2", {"micro_batch_size": 4, "seq_len": 1024}, "A100-40GB"),
    ("llama-3.2-1b", {"seq_len": 2048, "zero_stage": 1, "data_parallel_size": 8}, "A100-40GB"),
    ("llama-3.2-1b", {"seq_len": 2048, "zero_stage": 3, "data_parallel_size": 8}, "L4"),
    (
        "llama-3.2-1b",
        {"micro_batch_size": 4, "seq_len": 4096, "activation_offloading": True},
        "A100-40GB",
    ),
    (
        "llama-3.1-8b",
        {
            "seq_len": 2048,
            "lora_rank": 16,
            "quantize_base": "nf4",
            "activation_checkpointing": "full",
        },
        "L4",
    ),
    (
        "llama-3.1-8b",
        {
            "seq_len": 2048,
            "tensor_parallel_size": 4,
            "sequence_parallel": True,
            "pipeline_parallel_size": 2,
            "gradient_accumulation_steps": 4,
        },
        "H100-80GB",
    ),
    (
        "llama-3.1-8b",
        {"seq_len": 2048, "offload": "optimizer", "zero_stage": 2, "data_parallel_size": 4},
        "A100-40GB",
    ),
    (
        "llama-3.1-70b",
        {
            "micro_batch_size": 16,
            "seq_len": 8192,
            "data_parallel_size": 32,
            "zero_stage": 3,
            "tensor_parallel_size": 8,
        },
        "H100-80GB",
    ),
    ("gpt2", {"optimizer": "sgd-momentum", "optimizer_implementation": "for-loop"}, "T4"),
]


@pytest.mark.parametrize(("model", "settings_", "gpu"), MATRIX)
def test_reserved_is_whole_segments_within_the_gpu(model: str, settings_: dict, gpu: str) -> None:
    est = estimate(model, TrainingConfig(**settings_), gpu=gpu)
    d = est.to_dict()
    capacity = get_gpu(gpu).memory_bytes
    if d["fits"]:
        reserved = d["peak"]["reserved_bytes"]
        assert reserved % SEGMENT == 0
        assert d["peak"]["allocated_bytes"] <= reserved
        assert d["peak"]["device_total_bytes"] <= capacity
        assert d["peak"]["oom"] is None
    else:
        # a step that cannot run has no reserved figure: it says so instead
        assert d["peak"]["reserved_bytes"] is None and d["peak"]["oom"]
        assert "out of memory" in " ".join(d["notes"])


def test_fits_agrees_with_plan() -> None:
    # plan's answer fits (estimate says so), and one more sample does not
    base = TrainingConfig(seq_len=2048)
    plan = max_micro_batch_size("llama-3.2-1b", base, "A100-40GB")
    assert plan.value is not None
    ok = estimate(
        "llama-3.2-1b", dataclasses.replace(base, micro_batch_size=plan.value), gpu="A100-40GB"
    )
    over = estimate(
        "llama-3.2-1b", dataclasses.replace(base, micro_batch_size=plan.value + 1), gpu="A100-40GB"
    )
    assert ok.fits is True and over.fits is False


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_zero(stage: int) -> None:
    # ZeRO paper (Rajbhandari et al. 2020, Fig. 1) with DeepSpeed's fp16 mixed precision: 2 B
    # of 16-bit weights, 2 B of 16-bit gradients and K = 12 B of fp32 master weights + Adam
    # moments per parameter; stage 1 shards K, stage 2 also the gradients, stage 3 everything.
    # (bf16 without ZeRO is DeepSpeed's BF16_Optimizer instead: tests/analytic/test_frameworks.py)
    n_gpus = 8
    training = TrainingConfig(
        seq_len=128,
        framework="deepspeed",
        precision="16-mixed",
        zero_stage=stage,
        data_parallel_size=n_gpus,
    )
    est = estimate("gpt2", training, simulate_allocator=False)
    n = est.num_parameters
    states = est.model_states_bytes
    per_param = {
        0: (2, 2, 12),
        1: (2, 2, 12 / n_gpus),
        2: (2, 2 / n_gpus, 12 / n_gpus),
        3: (2 / n_gpus, 2 / n_gpus, 12 / n_gpus),
    }[stage]
    got = (states["parameters"], states["gradients"], states["optimizer_states"])
    for actual, bytes_per_param in zip(got, per_param, strict=True):
        # per-tensor sharding rounds each tensor up to a multiple of the data-parallel size
        assert actual == pytest.approx(bytes_per_param * n, rel=1e-3)
    assert sum(got) == pytest.approx(sum(per_param) * n, rel=1e-3)


def test_gradient_accumulation_is_one_segment() -> None:
    # 1024 micro-batches cost the schedule one repeated segment, not 1024 copies
    few = estimate(
        "llama-3.2-1b", TrainingConfig(seq_len=512, gradient_accumulation_steps=2), gpu="H100-80GB"
    )
    many = estimate(
        "llama-3.2-1b",
        TrainingConfig(seq_len=512, gradient_accumulation_steps=1024),
        gpu="H100-80GB",
    )
    assert many.schedules[0].num_segments() == few.schedules[0].num_segments()
    assert many.breakdown.allocated_bytes == few.breakdown.allocated_bytes
    assert len(many.timeline) <= 2 * len(few.timeline)


def _op(action: str, size: int, cat: Cat, phase: str, key: str) -> Op:
    return Op(action, size, cat, phase, key)  # type: ignore[arg-type]


def _recorded_step(*, free_init: bool = False) -> StepSchedule:
    """A recorded step as the trace engine hands it over: weights and two optimizer states in
    "init", then a 128 MiB activation, a 64 MiB gradient, a 64 MiB optimizer temporary."""
    init = (
        _op("alloc", 64 * MiB, Cat.PARAMETER, "init", "w"),
        _op("alloc", 64 * MiB, Cat.OPTIMIZER_STATE, "init", "m"),
        _op("alloc", 64 * MiB, Cat.OPTIMIZER_STATE, "init", "v"),
    )
    body = (
        _op("alloc", 128 * MiB, Cat.ACTIVATION, "forward", "a"),
        _op("alloc", 64 * MiB, Cat.GRADIENT, "backward", "g"),
        _op("free", 128 * MiB, Cat.ACTIVATION, "backward", "a"),
        _op("alloc", 64 * MiB, Cat.TEMPORARY, "optimizer", "t"),
        _op("free", 64 * MiB, Cat.TEMPORARY, "optimizer", "t"),
        _op("free", 64 * MiB, Cat.GRADIENT, "zero_grad", "g"),
    )
    if free_init:  # the step frees a block of the state it started from
        body += (_op("free", 64 * MiB, Cat.OPTIMIZER_STATE, "zero_grad", "v"),)
    return StepSchedule(setup=(), step=(*init, *body))


def test_lazy_optimizer_states_by_hand() -> None:
    # Note [Lazy optimizer states]. By the caching allocator's rules (best fit, a free block
    # split for a smaller request, a new segment of the request's size when nothing fits;
    # ../shared/specs/cuda-caching-allocator.md sections 2-3), sizes in MiB:
    # states first: w, m, v (192 reserved), a (+128 = 320), g (+64 = 384), a freed, t takes
    # half of a's block: 384.
    # lazily: w (64), a (+128 = 192), g (+64 = 256), a freed, m and v split a's block, t
    # (+64 = 320), t and g freed; the measured step: a finds no 128 block (two separate 64
    # ones) (+128 = 448), g and t reuse the 64 blocks: 448.
    from trainmem.allocator.replay import replay_timeline

    recorded = _recorded_step()
    lazy = recorded.with_lazy_optimizer_states()
    assert lazy.step == recorded.step[3:]
    assert lazy.peak() == recorded.peak()  # the measured step's peak does not move
    assert recorded.peak().peak_bytes == 384 * MiB
    assert replay_timeline(recorded.expand(), capacity_bytes=None).max_memory_reserved == 384 * MiB
    assert replay_timeline(lazy.expand(), capacity_bytes=None).max_memory_reserved == 448 * MiB


def test_lazy_optimizer_states_left_alone() -> None:
    # a step that frees part of the state it starts from cannot run twice: unchanged
    recorded = _recorded_step(free_init=True)
    assert recorded.with_lazy_optimizer_states() is recorded
    # an analytic schedule (it has its own warm-up in its setup): unchanged
    analytic = StepSchedule(setup=(_a(1, "w", Cat.PARAMETER),), step=(_a(1, "x"), _f(1, "x")))
    assert analytic.with_lazy_optimizer_states() is analytic


def test_replay_events_are_the_events_but_for_module_names() -> None:
    """replay_events(): the events of events() (same order, block ids, sizes, categories,
    phases, streams) with the module names as the schedule holds them, and the same replay."""
    from trainmem.allocator.replay import replay_timeline

    training = TrainingConfig(micro_batch_size=2, seq_len=1024, precision="bf16-true")
    sched = estimate("llama-3.2-1b", training, simulate_allocator=False).schedules[0]
    fresh = estimate("llama-3.2-1b", training, simulate_allocator=False).schedules[0]
    # before anything expanded the schedule; plain tuples (Note [Plain event tuples])
    raw = list(fresh.replay_events())
    assert all(type(r) is tuple and len(r) == len(EventRecord._fields) for r in raw)
    records = [EventRecord(*r) for r in raw]
    events = list(sched.events())
    assert len(records) == len(events) > 1000

    def fields(e: AllocEvent | EventRecord) -> tuple[object, ...]:
        return (e.action, e.block_id, e.size_bytes, e.category, e.phase, e.stream)

    assert [fields(e) for e in records] == [fields(e) for e in events]
    assert not any("{" in e.module for e in events)
    templated = [r.module for r, e in zip(records, events, strict=True) if r.module != e.module]
    assert templated and all("{i" in m for m in templated)
    replays = [replay_timeline(x, capacity_bytes=12 * 2**30) for x in (raw, records, events)]
    assert replays[0] == replays[1] == replays[2]
