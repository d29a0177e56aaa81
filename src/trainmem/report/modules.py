"""Per-module tables: which modules hold the activations, and what is live at the peak.

Both tables are computed from the estimate's :class:`~trainmem.timeline.Timeline`, so they work
the same for both engines: the analytic engine names modules ``embedding``, ``layers.<i>``,
``head``, ``loss``, ``cublas``; the trace engine records the dotted path of the ``nn.Module``
that was running (``transformer.h.3.mlp.act``), which :func:`module_group` shortens.

* **Activations by module**: the activation (and input) bytes live when the last forward pass of
  the steady-state step ends, per allocating module, the largest first. This is the activation
  footprint the backward pass starts from.
* **At the peak**: every block live at the event that sets the plotted peak
  (:func:`trainmem.report.plots.timeline_series`), per (module, category), the largest first.

All sizes are live requested bytes (``int``, no 512 B rounding); the rows are JSON-able dicts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from trainmem.breakdown import MemoryCategory, MemoryEstimate
from trainmem.timeline import AllocEvent, Timeline, module_group
from trainmem.units import GiB

__all__ = [
    "activation_rows",
    "gib_fine",
    "module_group",
    "module_tables",
    "peak_rows",
]

_ACTIVATION_CATEGORIES = (MemoryCategory.ACTIVATION, MemoryCategory.INPUT)


def _live_after(events: Sequence[AllocEvent], stop: int) -> list[AllocEvent]:
    """The alloc events of blocks still live after ``events[stop - 1]``."""
    live: dict[int, AllocEvent] = {}
    for ev in events[:stop]:
        if ev.action == "alloc":
            live[ev.block_id] = ev
        else:
            live.pop(ev.block_id, None)
    return list(live.values())


def _timeline(est: MemoryEstimate) -> Timeline | None:
    tl = est.timeline
    return tl if isinstance(tl, Timeline) and tl.events else None


def activation_rows(
    est: MemoryEstimate, *, top: int = 10, depth: int | None = None
) -> list[dict[str, Any]]:
    """Top modules by activation bytes live at the end of the last forward pass.

    Args:
        est: an estimate with a timeline.
        top: at most this many rows (the rest are summed in a final ``(other modules)`` row).
        depth: group module paths to this many components (:func:`module_group`); None keeps
            the full path.

    Returns:
        ``[{"module", "activation_bytes", "share"}]``, the largest first; ``share`` is the
        fraction of all activation bytes live at that moment. Empty without a timeline.
    """
    tl = _timeline(est)
    if tl is None:
        return []
    from trainmem.report.plots import window_start

    start = window_start(tl)
    last_forward = max(
        (i for i in range(start, len(tl.events)) if tl.events[i].phase == "forward"), default=None
    )
    if last_forward is None:
        return []
    by_module: dict[str, int] = defaultdict(int)
    for ev in _live_after(tl.events, last_forward + 1):
        if ev.category in _ACTIVATION_CATEGORIES:
            by_module[module_group(ev.module, depth)] += ev.size_bytes
    return _top(
        [{"module": m, "activation_bytes": n} for m, n in by_module.items()],
        "activation_bytes",
        top,
    )


def peak_rows(est: MemoryEstimate, *, top: int = 10, depth: int | None = 3) -> list[dict[str, Any]]:
    """Top (module, category) pairs by bytes live at the peak of the steady-state step.

    Args:
        est: an estimate with a timeline.
        top: at most this many rows (the rest summed in ``(other modules)``).
        depth: group module paths to this many components; None keeps the full path.

    Returns:
        ``[{"module", "category", "bytes", "share"}]``, the largest first; ``share`` is the
        fraction of the peak's live bytes. Empty without a timeline.
    """
    tl = _timeline(est)
    if tl is None:
        return []
    from trainmem.report.plots import timeline_series

    data = timeline_series(tl, reserved=False)
    stop = data.start + data.peak_position
    by_pair: dict[tuple[str, str], int] = defaultdict(int)
    for ev in _live_after(tl.events, stop):
        by_pair[(module_group(ev.module, depth), ev.category.value)] += ev.size_bytes
    return _top(
        [{"module": m, "category": c, "bytes": n} for (m, c), n in by_pair.items()],
        "bytes",
        top,
    )


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in text.split("."))


def _top(rows: list[dict[str, Any]], key: str, top: int) -> list[dict[str, Any]]:
    """The ``top`` largest rows by ``key`` with their share of the total, then the rest summed."""
    total = sum(r[key] for r in rows)
    rows = sorted((r for r in rows if r[key]), key=lambda r: (-r[key], _natural(r["module"])))
    head, rest = rows[:top], rows[top:]
    if rest:
        other: dict[str, Any] = {k: "" for k in head[0]}
        other.update({"module": f"(other {len(rest)})", key: sum(r[key] for r in rest)})
        head.append(other)
    for r in head:
        r["share"] = round(r[key] / total, 4) if total else 0.0
    return head


def module_tables(est: MemoryEstimate, *, top: int = 10) -> tuple[Table, Table]:
    """The two per-module tables as rich Tables (sizes in GiB = 2^30 bytes).

    Args:
        est: an estimate with a timeline.
        top: rows per table before the ``(other ...)`` row.

    Returns:
        ``(activations table, peak table)``.
    """
    acts = Table(
        title="activations at the end of the forward, by module",
        caption="GiB = 2^30 bytes",
    )
    acts.add_column("module", style="bold")
    acts.add_column("GiB", justify="right")
    acts.add_column("share", justify="right")
    for r in activation_rows(est, top=top):
        acts.add_row(r["module"], gib_fine(r["activation_bytes"]), f"{100 * r['share']:.1f}%")
    peak = Table(
        title="live at the peak, by module and category",
        caption="GiB = 2^30 bytes",
    )
    peak.add_column("module", style="bold")
    peak.add_column("category")
    peak.add_column("GiB", justify="right")
    peak.add_column("share", justify="right")
    for r in peak_rows(est, top=top):
        peak.add_row(r["module"], r["category"], gib_fine(r["bytes"]), f"{100 * r['share']:.1f}%")
    return acts, peak


def gib_fine(n_bytes: int) -> str:
    """GiB with enough digits for small models (``"12.34"``, ``"0.00123"``, ``"<0.0001"``)."""
    value = n_bytes / GiB
    if value >= 1 or value == 0:
        return f"{value:,.2f}"
    return f"{value:#.3g}" if value >= 1e-4 else "<0.0001"
