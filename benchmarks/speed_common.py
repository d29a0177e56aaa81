"""Shared by the speed benchmarks (``analytic_speed.py``, ``planner_speed.py``,
``cli_speed.py``): the machine's description, CPU-time measurement, the median of several
runs, and the budget check that sets the exit status.

Every benchmark times distinct inputs (a configuration is never evaluated twice, so no cache
answers for it), reports process CPU seconds (a loaded machine stretches wall time, not CPU
time) as the median of several runs, and exits 1 when a budget is missed.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def machine() -> str:
    """One line naming the machine: CPUs available (``nproc``), the CPU model
    (``/proc/cpuinfo``), Python."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"machine: nproc {cpus}, {model}, Python {platform.python_version()}"


def cpu_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of one call of ``fn``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def child_cpu_seconds(
    argv: Sequence[str], env: dict[str, str] | None = None
) -> tuple[float, float]:
    """(CPU seconds, user + system, of the child process; wall seconds) of running ``argv``
    to completion (``resource.getrusage(RUSAGE_CHILDREN)`` before and after).

    Raises:
        RuntimeError: the command failed (its stderr in the message).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, env=env)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0,):
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-400:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


@dataclass
class Check:
    """One timed figure against its budget (CPU seconds: smaller is better)."""

    name: str
    cpu_runs: list[float]
    wall_runs: list[float]
    budget_seconds: float | None
    detail: str = ""
    unit: str = "s"
    """``s`` or ``ms`` (the figures and the budget are seconds either way)."""

    @property
    def cpu(self) -> float:
        """Median CPU seconds over the runs."""
        return statistics.median(self.cpu_runs)

    @property
    def ok(self) -> bool:
        """Whether the median is within the budget (no budget: reported only)."""
        return self.budget_seconds is None or self.cpu <= self.budget_seconds

    def line(self) -> str:
        """One line: the figure, its runs, the budget and the verdict."""
        k = 1e3 if self.unit == "ms" else 1.0
        runs = ", ".join(f"{k * x:.3f}" for x in self.cpu_runs)
        wall = k * statistics.median(self.wall_runs)
        budget = (
            "no budget (reported only)"
            if self.budget_seconds is None
            else f"budget {k * self.budget_seconds:g} {self.unit}: "
            + ("ok" if self.ok else "OVER BUDGET")
        )
        return (
            f"{self.name}: {k * self.cpu:.3f} {self.unit} CPU, median of {len(self.cpu_runs)} "
            f"runs [{runs}] (wall {wall:.3f} {self.unit}){self.detail}; {budget}"
        )


def report(checks: Sequence[Check]) -> int:
    """Print the machine and every check; the exit status: 0 if every budget holds, else 1."""
    print(machine())
    for c in checks:
        print(c.line())
    over = [c.name for c in checks if not c.ok]
    if over:
        print(f"over budget: {', '.join(over)}")
    return 1 if over else 0
