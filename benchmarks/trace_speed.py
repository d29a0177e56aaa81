"""``--engine trace`` end to end as a user runs it (issue 28): a llama-3.1-70b FSDP rank
within 10 s of CPU and 1 GB of memory, and issue 14's 405b FSDP x TP x PP proof command
within 60 s for its distinct ranks (the command traces each pipeline stage that differs).

Run: ``python benchmarks/trace_speed.py [RUNS]`` (default 1: each run takes 5-60 s). Each run
is a fresh process that runs the CLI and reports its own CPU seconds (user + system) and
peak resident memory (``resource.getrusage(RUSAGE_SELF)``); the median CPU over the runs and
the largest peak are checked against the budgets and the exit status is 1 when one is over.
The first call of a process pays the torch / transformers imports (3-4 s of CPU here), as a
user's does. Not a test: timings depend on the machine and its load (CPU seconds grow with
the load of a 2-core machine: the 70b rank took 6 s at load 0.7 and 12 s at load 7).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speed_common import Check, report

COMMANDS: tuple[tuple[str, list[str], float, float], ...] = (
    (
        "estimate llama-3.1-70b --engine trace --data-parallel-size 8 --zero-stage 3 -b 1 "
        "-s 4096 --gpu H100-80GB",
        ["estimate", "llama-3.1-70b", "--engine", "trace", "--data-parallel-size", "8"]
        + ["--zero-stage", "3", "-b", "1", "-s", "4096", "--gpu", "H100-80GB"],
        10.0,
        1.0,
    ),
    (
        "estimate llama-3.1-405b --tensor-parallel-size 8 --pipeline-parallel-size 8 "
        "--data-parallel-size 8 --fsdp full-shard --sequence-parallel --compile --precision "
        "fp8-mixed --engine trace",
        ["estimate", "llama-3.1-405b", "--tensor-parallel-size", "8"]
        + ["--pipeline-parallel-size", "8", "--data-parallel-size", "8", "--fsdp"]
        + ["full-shard", "--sequence-parallel", "--compile", "--precision", "fp8-mixed"]
        + ["--engine", "trace"],
        60.0,
        None,
    ),
)
"""(label, arguments, CPU budget in seconds, peak memory budget in GB or None)."""

_CHILD = """
import json, resource, sys
out, args = sys.argv[1], sys.argv[2:]
sys.argv = ["trainmem", *args]
from trainmem.cli import main
try:
    main()
except SystemExit as stop:
    if stop.code not in (None, 0):
        raise
r = resource.getrusage(resource.RUSAGE_SELF)
with open(out, "w") as f:
    json.dump({"cpu": r.ru_utime + r.ru_stime, "maxrss_kib": r.ru_maxrss}, f)
"""


def run_once(args: list[str]) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak resident GB) of one fresh process running the CLI.

    Raises:
        RuntimeError: the command failed (its stderr in the message).
    """
    with tempfile.TemporaryDirectory(prefix="trainmem-trace-speed-") as tmp:
        out = Path(tmp) / "usage.json"
        wall = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(out), *args],
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - wall
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"trainmem {' '.join(args)} failed: {done.stderr[-400:]}")
        usage = json.loads(out.read_text())
    return float(usage["cpu"]), wall, usage["maxrss_kib"] * 1024 / 1e9


def main(runs: int = 1) -> int:
    """Run every command ``runs`` times; print and check."""
    checks = []
    rss_over = []
    for label, args, budget, rss_budget in COMMANDS:
        cpu, wall, rss = [], [], []
        for _ in range(runs):
            c, w, r = run_once(args)
            cpu.append(c)
            wall.append(w)
            rss.append(r)
        peak = max(rss)
        detail = f", peak resident {peak:.2f} GB"
        if rss_budget is not None:
            ok = peak <= rss_budget
            detail += f" (budget {rss_budget:g} GB: {'ok' if ok else 'OVER BUDGET'})"
            if not ok:
                rss_over.append(label)
        checks.append(Check(f"trainmem {label}", cpu, wall, budget, detail=detail))
    status = report(checks)
    if rss_over:
        print(f"over the memory budget: {', '.join(rss_over)}")
    return 1 if status or rss_over else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
