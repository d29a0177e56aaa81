"""Analytic estimates per CPU second on distinct configurations: the closed form
(``simulate_allocator=False``), built per configuration as one estimate is and ``lean`` as a
sweep's rows are (the planner's inner loop: schedules filled from templates, Note [Schedule
templates] in trainmem/analytic/template.py; recordings included), and the estimate with the
allocator replay (the default of ``trainmem estimate``).

Run: ``python benchmarks/analytic_speed.py [RUNS]``. Every configuration is timed once in the
process (each run has its own micro-batch sizes and sequence lengths), so no cache answers for
it; the median over the runs of the CPU time per configuration is checked against the budget
and the exit status is 1 when one is over. Budget (issue 28): the closed form, built and lean,
at 5,000 configurations per CPU second (0.2 ms each) whatever the depth (identical layers are
one repeated block). The estimate with the replay is reported only (``step_speed.py`` checks
llama-3.1-405b's against issue 11's budget).
"""

from __future__ import annotations

import sys
from functools import partial

from speed_common import Check, cpu_seconds, report

from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

CLOSED_FORM_BUDGET_SECONDS = 0.0002
"""Per configuration: 5,000 per CPU second (issue 28)."""
CLOSED_FORM_CONFIGS = 400
REPLAY_CONFIGS = 3


def configs(model: ModelSpec, run: int, n: int) -> list[TrainingConfig]:
    """``n`` configurations no other run uses: micro-batch sizes 1..n with sequence lengths
    that differ per run (below the model's context length)."""
    top = min(model.max_position_embeddings, 4096)
    span = top // 2
    return [
        TrainingConfig(micro_batch_size=1 + index // span, seq_len=top - index % span)
        for index in range(run * n, (run + 1) * n)
    ]


def estimate_all(
    model: ModelSpec, trainings: list[TrainingConfig], simulate: bool, lean: bool
) -> None:
    """One estimate per configuration."""
    for training in trainings:
        estimate(model, training, engine="analytic", simulate_allocator=simulate, lean=lean)


def main(runs: int = 3) -> int:
    """Time the closed form and the replay on three presets; print and check."""
    checks = []
    for preset in ("gpt2", "llama-3.1-8b", "llama-3.1-405b"):
        model = load_model_spec(preset)
        estimate(model, TrainingConfig(seq_len=64), engine="analytic")  # imports, layout
        for k, (simulate, lean, n, budget) in enumerate(
            (
                (False, False, CLOSED_FORM_CONFIGS, CLOSED_FORM_BUDGET_SECONDS),
                (False, True, CLOSED_FORM_CONFIGS, CLOSED_FORM_BUDGET_SECONDS),
                (True, False, REPLAY_CONFIGS, None),
            )
        ):
            cpu, wall = [], []
            for run in range(runs):
                trainings = configs(model, run + k * runs, n)
                c, w = cpu_seconds(partial(estimate_all, model, trainings, simulate, lean))
                cpu.append(c / n)
                wall.append(w / n)
            what = (
                "with the allocator replay"
                if simulate
                else "closed form, lean (a sweep's rows)"
                if lean
                else "closed form"
            )
            checks.append(
                Check(
                    f"{preset} {what}, per configuration ({n} distinct a run)",
                    cpu,
                    wall,
                    budget,
                    f", {1 / sorted(cpu)[len(cpu) // 2]:,.0f} per CPU second",
                    unit="ms",
                )
            )
    return report(checks)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
