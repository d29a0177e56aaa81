"""Speed of the planner's inner loop (issue 28): a sweep of 10,000 distinct analytic
configurations of llama-3.1-8b (closed form, ``simulate_allocator=False``) within 2 CPU seconds
(at least 5,000 configurations per CPU second); the two searches of ``trainmem plan``
(llama-3.2-1b, A100-80GB) are reported with the number of allocator replays and of
closed-form estimates they ran.

Run: ``python benchmarks/planner_speed.py [RUNS]``. Each run sweeps a grid no other run
sweeps (the sequence lengths are shifted by the run's index), so every timed configuration is
new to the process; the median of the runs' CPU seconds is checked against the budget, and the
exit status is 1 when it is over. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import sys
from functools import partial

from speed_common import Check, cpu_seconds, report

import trainmem.planner.search as search
from trainmem.planner import sweep
from trainmem.specs.training import TrainingConfig

SWEEP_BUDGET_SECONDS = 2.0
"""10,000 configurations at 5,000 per CPU second (issue 28)."""


def grid(run: int) -> dict[str, list[object]]:
    """10,000 configurations; run ``run``'s sequence lengths are its own."""
    return {
        "micro_batch_size": list(range(1, 26)),  # 25
        "seq_len": [128 * k + run for k in range(1, 41)],  # 40
        "precision": ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"],  # 5
        "activation_checkpointing": ["none", "full"],  # 2
    }


def sweep_grid(over: dict[str, list[object]]) -> None:
    """The sweep of llama-3.1-8b on an H100 over ``over`` (10,000 rows)."""
    rows = sweep("llama-3.1-8b", TrainingConfig(), "H100-80GB", over)
    assert len(rows) == 10_000


def main(runs: int = 3) -> int:
    """Time the sweep ``runs`` times and the two searches once; print and check."""
    sweep("gpt2", TrainingConfig(), "H100-80GB", {"micro_batch_size": [1]})  # imports, presets
    cpu, wall = [], []
    for run in range(runs):
        c, w = cpu_seconds(partial(sweep_grid, grid(run)))
        cpu.append(c)
        wall.append(w)
    median = sorted(cpu)[len(cpu) // 2]
    checks = [
        Check(
            "sweep: 10,000 distinct llama-3.1-8b configurations, closed form",
            cpu,
            wall,
            SWEEP_BUDGET_SECONDS,
            f", {10_000 / median:,.0f} configurations per CPU second",
        )
    ]
    replays, closed = [0], [0]
    simulated, fast = search.simulated_estimate, search.fast_estimate

    def counted(*args: object, **kwargs: object) -> object:
        replays[0] += 1
        return simulated(*args, **kwargs)  # type: ignore[arg-type]

    def counted_fast(*args: object, **kwargs: object) -> object:
        closed[0] += 1
        return fast(*args, **kwargs)  # type: ignore[arg-type]

    search.simulated_estimate = counted  # type: ignore[assignment]
    search.fast_estimate = counted_fast  # type: ignore[assignment]
    # the second: batches padded to their longest sample, lengths from a dataset's statistics
    # (Note [Lengths from a dataset's statistics]): each replay runs the drawn steps too
    for name, sample_lengths in (
        ("", None),
        (", --sample-lengths alpaca-cleaned", "alpaca-cleaned"),
    ):
        training = TrainingConfig(
            seq_len=2048, activation_checkpointing="full", sample_lengths=sample_lengths
        )
        found: list[int | None] = []
        replays[0] = closed[0] = 0

        def plan(training: TrainingConfig = training, found: list[int | None] = found) -> None:
            found.append(search.max_micro_batch_size("llama-3.2-1b", training, "A100-80GB").value)
            found.append(search.max_seq_len("llama-3.2-1b", training, "A100-80GB").value)

        c, w = cpu_seconds(plan)
        checks.append(
            Check(
                f"plan searches (llama-3.2-1b, A100-80GB, in process{name})",
                [c],
                [w],
                None,
                f", micro_batch_size={found[0]}, seq_len={found[1]}, {replays[0]} allocator "
                f"replays, {closed[0]} closed forms",
            )
        )
    search.simulated_estimate = simulated  # type: ignore[assignment]
    search.fast_estimate = fast  # type: ignore[assignment]
    return report(checks)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
