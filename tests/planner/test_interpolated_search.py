"""Note [Interpolated probes]: the searches aimed by interpolating the closed-form total give
the answers of bisection (the search before issue 28's change) and of a scan of every value,
over many configurations; only the number of closed-form estimates drops."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

import trainmem.planner.search as search
from trainmem.estimate import resolve_model
from trainmem.planner.evaluate import fast_estimate, fits, simulated_estimate
from trainmem.planner.search import largest_true, max_micro_batch_size, max_seq_len, toward
from trainmem.specs.hardware import get_gpu
from trainmem.specs.training import TrainingConfig, derived


def _aims(rng: random.Random) -> list[Callable[[int, int], int] | None]:
    """Bisection, and aims good and bad: always just above the last true, always just below
    the first false, anywhere, outside the bracket (clamped by the search)."""
    return [
        None,
        lambda good, bad: good + 1,
        lambda good, bad: bad - 1,
        lambda good, bad: rng.randint(good - 5, bad + 5),
        lambda good, bad: -(10**9),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_any_aim_ends_where_bisection_and_a_scan_end(seed: int) -> None:
    rng = random.Random(seed)
    lo = rng.randint(1, 50)
    hi = lo + rng.randint(0, 5000)
    threshold = rng.randint(lo - 3, hi + 3)  # below lo: nothing holds; at or above hi: all do

    def pred(n: int) -> bool:
        assert lo <= n <= hi  # the search never asks outside its range
        return n <= threshold

    scan = max((n for n in range(lo, hi + 1) if pred(n)), default=None)
    for aim in _aims(rng):
        assert largest_true(pred, lo, hi, aim) == scan


def test_the_aim_costs_at_most_three_times_bisection() -> None:
    # an aim that never halves the bracket is overruled by a midpoint every third probe
    for threshold in (1, 2, 3, 100, 1023, 5000, 65_537):
        calls = [0, 0]
        for k, aim in enumerate((None, lambda good, bad: good + 1)):

            def pred(n: int, k: int = k, t: int = threshold, c: list[int] = calls) -> bool:
                c[k] += 1
                return n <= t

            assert largest_true(pred, 1, 1 << 20, aim) == threshold
        assert calls[1] <= 3 * calls[0]


def test_toward_interpolates_the_line() -> None:
    totals = {10: 1000, 20: 2000}
    aim = toward(totals.__getitem__, 1500.0)
    assert aim(10, 20) == 15
    assert toward({10: 7, 20: 7}.__getitem__, 1500.0)(10, 20) == 15  # flat: the midpoint


CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("gpt2", "T4", {"seq_len": 1024}),
    ("gpt2", "RTX-4090", {"seq_len": 512, "precision": "32-true", "attention": "eager"}),
    ("llama-3.2-1b", "A100-40GB", {"seq_len": 2048}),
    ("llama-3.2-1b", "RTX-4090", {"precision": "bf16-true", "activation_checkpointing": "full"}),
    ("llama-3.2-3b", "A100-80GB", {"precision": "bf16-true", "seq_len": 4096}),
    ("llama-3.2-3b", "H100-80GB", {"seq_len": 2048, "zero_stage": 2, "data_parallel_size": 8}),
    ("llama-3.1-8b", "H100-80GB", {"seq_len": 8192, "zero_stage": 3, "data_parallel_size": 8}),
    ("llama-3.1-8b", "A100-80GB", {"zero_stage": 1, "data_parallel_size": 4}),
    ("gemma-3-1b", "L4", {"seq_len": 3000, "precision": "16-mixed"}),
    ("phi-2", "A100-40GB", {"activation_checkpointing": "full", "precision": "bf16-mixed"}),
    ("mistral-7b-v0.1", "H100-80GB", {"zero_stage": 3, "data_parallel_size": 16}),
    ("qwen1.5-moe-a2.7b", "H100-80GB", {"precision": "bf16-true", "seq_len": 1024}),
    ("tinyllama-1.1b", "RTX-4090", {"seq_len": 777, "optimizer": "sgd"}),
    ("starcoder2-3b", "A100-80GB", {"precision": "bf16-true", "zero_stage": 2}),
]


def _fast_fits(
    model: str, training: TrainingConfig, gpu: str, field: str, step: int
) -> tuple[Callable[[int], Any], dict[int, Any], int]:
    spec, gpu_spec = resolve_model(model), get_gpu(gpu)
    cache: dict[int, Any] = {}

    def fast(u: int) -> Any:
        if u not in cache:
            cache[u] = fast_estimate(spec, derived(training, **{field: u * step}), gpu_spec)
        return cache[u]

    return fast, cache, gpu_spec.memory_bytes


@pytest.mark.parametrize(("model", "gpu", "settings"), CONFIGS)
def test_the_closed_form_search_matches_bisection_and_a_scan(
    model: str, gpu: str, settings: dict[str, Any]
) -> None:
    training = TrainingConfig(**settings)
    for field, step, hi in (("micro_batch_size", 1, 1 << 20), ("seq_len", 256, None)):
        fast, cache, capacity = _fast_fits(model, training, gpu, field, step)
        if hi is None:
            hi = resolve_model(model).max_position_embeddings // step

        def pred(u: int, fast: Callable[[int], Any] = fast) -> bool:
            return bool(fits(fast(u)))

        def total(u: int, fast: Callable[[int], Any] = fast) -> int:
            return int(fast(u).breakdown.device_total_bytes)

        aimed = largest_true(pred, 1, hi, toward(total, capacity))
        aimed_calls = len(cache)
        cache.clear()
        bisected = largest_true(pred, 1, hi)
        assert aimed == bisected
        assert aimed_calls <= len(cache)
        # a scan of every value up to past the answer: the predicate is monotone there
        top = min(hi, 2 * (aimed or 1) + 2)
        scan = [pred(u) for u in range(1, top + 1)]
        assert scan == [u <= (aimed or 0) for u in range(1, top + 1)]
        if aimed is not None and 4 <= aimed < hi:
            assert aimed_calls < len(cache)  # the point of it: fewer closed forms


# the full searches (closed form, then the allocator replays below its answer) on both probe
# orders: the same answers, reasons and replayed configurations
@pytest.mark.parametrize(("model", "gpu", "settings"), CONFIGS[::3])
def test_plan_answers_are_those_of_bisection(
    monkeypatch: pytest.MonkeyPatch, model: str, gpu: str, settings: dict[str, Any]
) -> None:
    training = TrainingConfig(**settings)
    simulated, fast = simulated_estimate, fast_estimate
    runs: list[tuple[list[dict[str, Any]], list[tuple[int, int]], int]] = []
    for aimed in (True, False):
        replayed: list[tuple[int, int]] = []
        made = [0]

        def sim(m: Any, t: TrainingConfig, g: Any, seen: list[Any] = replayed, **kw: Any) -> Any:
            seen.append((t.micro_batch_size, t.seq_len))
            return simulated(m, t, g, **kw)

        def count(*a: Any, calls: list[int] = made, **kw: Any) -> Any:
            calls[0] += 1
            return fast(*a, **kw)

        monkeypatch.setattr(search, "simulated_estimate", sim)
        monkeypatch.setattr(search, "fast_estimate", count)
        if not aimed:  # the probes before Note [Interpolated probes]: bisection
            monkeypatch.setattr(search, "toward", lambda total, limit: None)
        answers = [
            max_micro_batch_size(model, training, gpu).to_dict(),
            max_seq_len(model, training, gpu, multiple_of=8).to_dict(),
        ]
        runs.append((answers, replayed, made[0]))
    (aimed_answers, aimed_replays, aimed_closed), (answers, replays, closed) = runs
    assert aimed_answers == answers
    assert aimed_replays == replays
    assert aimed_closed <= closed
    if any((a["value"] or 0) >= 4 and a["limited_by"] == "memory" for a in answers):
        assert aimed_closed < closed
