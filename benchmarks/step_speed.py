"""Speed of the one driver (issue 11): estimate with the allocator replay for llama-3.1-405b
(budget 150 ms in-process), ``plan`` and ``fit`` end to end as a user runs them (budget 1 s
each), a 10,000-configuration sweep of the schedule's fast path (budget 5 s).

Run: ``python benchmarks/step_speed.py``; prints one line per figure with its budget and exits 1
when one is over. Process CPU time is reported next to wall time, since a loaded machine
(several jobs on two cores) stretches wall time. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.planner import sweep
from trainmem.specs.training import TrainingConfig

TRAINMEM = [sys.executable, "-m", "trainmem"]
GRID = {
    "micro_batch_size": list(range(1, 26)),  # 25
    "seq_len": [128 * k for k in range(1, 41)],  # 40
    "precision": ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"],  # 5
    "activation_checkpointing": ["none", "full"],  # 2
}


def timed(fn) -> tuple[float, float]:  # noqa: ANN001
    """(wall seconds, process CPU seconds) of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def command_seconds(args: list[str]) -> float:
    """Wall seconds of a CLI command in a fresh interpreter (what a user waits)."""
    t0 = time.perf_counter()
    subprocess.run([*TRAINMEM, *args], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> int:
    over = []
    training = TrainingConfig(micro_batch_size=1, seq_len=4096)
    estimate("llama-3.1-405b", training, gpu="H100-80GB")  # warm the caches (config parsing)
    rows = {
        "estimate llama-3.1-405b (replay)": (
            timed(lambda: estimate("llama-3.1-405b", training, gpu="H100-80GB")),
            0.150,
        ),
        "estimate llama-3.1-405b FSDP x128 + full checkpointing (replay)": (
            timed(
                lambda: estimate(
                    "llama-3.1-405b",
                    TrainingConfig(
                        seq_len=4096,
                        activation_checkpointing="full",
                        data_parallel_size=128,
                        zero_stage=3,
                        framework="fsdp2",
                    ),
                    gpu="H100-80GB",
                )
            ),
            None,
        ),
        "sweep 10,000 configs (fast path)": (
            timed(lambda: sweep("llama-3.1-8b", TrainingConfig(), "H100-80GB", GRID)),
            5.0,
        ),
    }
    for name, ((wall, cpu), budget) in rows.items():
        verdict = "" if budget is None else f" (budget {budget:g} s)"
        print(f"{name}: {wall:.3f} s wall, {cpu:.3f} s CPU{verdict}")
        if budget is not None and cpu > budget:
            over.append(name)
    for args, budget in (
        (["plan", "llama-3.1-8b", "--gpu", "H100-80GB"], 1.0),
        (["fit", "llama-3.1-8b", "--gpu", "A100-40GB", "-b", "4", "-s", "4096"], 1.0),
    ):
        wall = command_seconds(args)
        print(f"trainmem {' '.join(args)}: {wall:.2f} s wall (budget {budget:g} s)")
        if wall > budget:
            over.append(args[0])
    print("over budget: " + (", ".join(over) if over else "none"))
    return 1 if over else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
