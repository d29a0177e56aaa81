"""The planner: what fits a GPU, and the cheapest change that makes a run fit.

* :func:`max_micro_batch_size`, :func:`max_seq_len`: search on the monotone analytic estimate,
  answer confirmed with the allocator simulator (``search.py``); :func:`plan_gpus`: both for
  every catalog GPU, with the fewest GPUs of each kind for a sharded run (:func:`fewest_gpus`).
* :func:`fixes`: ranked changes from the table :data:`CHANGES` (``fixes.py``).
* :func:`sweep`: estimates over a grid (``sweep.py``), a :class:`Sweep` of rows; renderers in
  ``render.py``.
* ``commands.py``: the ``plan``, ``fit`` and ``sweep`` CLI commands (``register(app)``).

All sizes are bytes (``int``).
"""

from __future__ import annotations

from trainmem.planner.fixes import CHANGES, Change, Fix, fixes
from trainmem.planner.search import (
    GpuPlan,
    PlanResult,
    fewest_gpus,
    max_micro_batch_size,
    max_seq_len,
    plan_gpus,
)
from trainmem.planner.sweep import Sweep, SweepRow, parse_over, sweep

__all__ = [
    "CHANGES",
    "Change",
    "Fix",
    "GpuPlan",
    "PlanResult",
    "Sweep",
    "SweepRow",
    "fewest_gpus",
    "fixes",
    "max_micro_batch_size",
    "max_seq_len",
    "parse_over",
    "plan_gpus",
    "sweep",
]
