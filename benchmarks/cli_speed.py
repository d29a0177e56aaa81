"""``trainmem`` end to end as a user runs it (a new process each time, its CPU time read with
``resource.getrusage(RUSAGE_CHILDREN)``): ``plan`` and ``fit`` within 0.5 s, ``--help`` within
0.25 s, an analytic ``estimate`` (with the allocator replay, the default) within 0.4 s
(issue 28).

Run: ``python benchmarks/cli_speed.py [RUNS]``; the median over the runs of each command's CPU
seconds is checked against its budget and the exit status is 1 when one is over. Each run is a
fresh process, so nothing is cached between runs but Python's compiled bytecode, as after
``pip install`` (which compiles it): the children write and read it under a temporary
``PYTHONPYCACHEPREFIX``, whatever ``PYTHONDONTWRITEBYTECODE`` says. ``--help`` in the
environment as given is reported beside (with ``PYTHONDONTWRITEBYTECODE`` set and no bytecode
in the checkout, every trainmem module is compiled from source in every process: about 0.15 s
more). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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
    checks = []
    with tempfile.TemporaryDirectory(prefix="trainmem-pycache-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        for _, args, _ in COMMANDS:  # bytecode of every module the commands import written
            child_cpu_seconds([*base, *args], env)
        for label, args, budget in COMMANDS:
            cpu, wall = [], []
            for _ in range(runs):
                c, w = child_cpu_seconds([*base, *args], env)
                cpu.append(c)
                wall.append(w)
            checks.append(Check(f"trainmem {label}", cpu, wall, budget))
    cpu, wall = [], []
    for _ in range(runs):  # the environment as given (its bytecode setting, its caches)
        c, w = child_cpu_seconds([*base, "--help"])
        cpu.append(c)
        wall.append(w)
    how = "PYTHONDONTWRITEBYTECODE set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "as is"
    checks.append(Check(f"trainmem --help, the environment {how}", cpu, wall, None))
    return report(checks)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
