"""``trainmem`` end to end as a user runs it (a new process each time, its CPU time read with
``resource.getrusage(RUSAGE_CHILDREN)``): ``plan`` and ``fit`` within 0.5 s, ``--help`` within
0.25 s, an analytic ``estimate`` (with the allocator replay, the default) within 0.4 s
(issue 28).

Run: ``python benchmarks/cli_speed.py [RUNS]``; the median over the runs of each command's CPU
seconds is checked against its budget and the exit status is 1 when one is over. Each run is a
fresh process, so nothing is cached between runs. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from speed_common import Check, child_cpu_seconds, report

COMMANDS: tuple[tuple[str, list[str], float], ...] = (
    ("--help", ["--help"], 0.25),
    (
        "estimate llama-3.1-8b -b 2 -s 2048 --gpu H100-80GB",
        ["estimate", "llama-3.1-8b", "-b", "2", "-s", "2048", "--gpu", "H100-80GB"],
        0.4,
    ),
    (
        "plan llama-3.2-3b --gpu A100-80GB --precision bf16-true --seq-len 4096",
        ["plan", "llama-3.2-3b", "--gpu", "A100-80GB", "--precision", "bf16-true"]
        + ["--seq-len", "4096"],
        0.5,
    ),
    (
        "fit llama-3.1-8b --gpu RTX-4090 -b 2 -s 2048",
        ["fit", "llama-3.1-8b", "--gpu", "RTX-4090", "-b", "2", "-s", "2048"],
        0.5,
    ),
)
"""(label, arguments, budget in CPU seconds)."""


def trainmem_command() -> list[str]:
    """The installed ``trainmem`` script beside this Python, else ``python -m trainmem``."""
    script = Path(sys.executable).with_name("trainmem")
    if script.exists():
        return [str(script)]
    found = shutil.which("trainmem")
    return [found] if found else [sys.executable, "-m", "trainmem"]


def main(runs: int = 5) -> int:
    """Run every command ``runs`` times; print and check."""
    base = trainmem_command()
    child_cpu_seconds([*base, "--help"])  # compiled bytecode written, files in the page cache
    checks = []
    for label, args, budget in COMMANDS:
        cpu, wall = [], []
        for _ in range(runs):
            c, w = child_cpu_seconds([*base, *args])
            cpu.append(c)
            wall.append(w)
        checks.append(Check(f"trainmem {label}", cpu, wall, budget))
    return report(checks)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
