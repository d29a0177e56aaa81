"""Speed of the planner's fast path: a sweep of 10,000 analytic configurations (closed form,
``simulate_allocator=False``) must finish in under 5 s on one core (issue 5).

Run: ``python benchmarks/planner_speed.py``; exits 1 when over budget. Not a test: timings
depend on the machine, so the test suite has no timed assertions.
"""

from __future__ import annotations

import sys
import time

from trainmem.planner import max_micro_batch_size, max_seq_len, sweep
from trainmem.specs.training import TrainingConfig

BUDGET_SECONDS = 5.0
GRID = {
    "micro_batch_size": list(range(1, 26)),  # 25
    "seq_len": [128 * k for k in range(1, 41)],  # 40
    "precision": ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"],  # 5
    "activation_checkpointing": ["none", "full"],  # 2
}


def main() -> int:
    """Time the 10,000-row sweep and the two searches; print one line each."""
    n = 1
    for values in GRID.values():
        n *= len(values)
    assert n == 10_000
    t0 = time.perf_counter()
    rows = sweep("llama-3.1-8b", TrainingConfig(), "H100-80GB", GRID)
    sweep_s = time.perf_counter() - t0
    print(
        f"sweep: {len(rows):,} analytic configs in {sweep_s:.2f} s "
        f"({1e3 * sweep_s / len(rows):.3f} ms each; budget {BUDGET_SECONDS:.0f} s)"
    )
    t0 = time.perf_counter()
    training = TrainingConfig(seq_len=2048, activation_checkpointing="full")
    mb = max_micro_batch_size("llama-3.2-1b", training, "A100-80GB")
    sl = max_seq_len("llama-3.2-1b", training, "A100-80GB")
    print(
        f"plan (two searches + simulated boundary): micro_batch_size={mb.value}, "
        f"seq_len={sl.value} in {time.perf_counter() - t0:.2f} s"
    )
    return 0 if sweep_s < BUDGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
