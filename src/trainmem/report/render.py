"""Plan, fix and sweep results as rich tables, CSV and JSON.

Tables show GiB (2^30 bytes) and say so; CSV and JSON keep exact bytes. (These renderers belong
with ``report/`` by the import order of STYLE.md sec. 1; they live here until the planner's
output settles.)
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from trainmem.breakdown import MemoryEstimate
from trainmem.estimate import assumed_of
from trainmem.planner.evaluate import margin_bytes
from trainmem.planner.fixes import Fix
from trainmem.planner.search import GpuPlan, PlanResult
from trainmem.planner.sweep import Sweep, SweepRow
from trainmem.report.table import VERDICT_STYLE
from trainmem.units import gib_text

SCHEMA_VERSION = 1
"""Version of the plan / fit / sweep JSON; bump on any key change."""

_CAPTION = "GiB = 2^30 bytes; '--json' gives exact bytes"


def gib(n_bytes: int | float) -> str:
    """Bytes as GiB with two decimals (``"12.34"``; :func:`trainmem.units.gib_text`)."""
    return gib_text(n_bytes)


def _signed_gib(n_bytes: int) -> str:
    return f"{'+' if n_bytes >= 0 else '-'}{gib(abs(n_bytes))}"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "+".join(str(v) for v in value)
    return str(value)


def _was(base: MemoryEstimate, field: str, old: Any) -> str:
    """A fix's old value: a setting left to the framework (None) as the estimate resolved it
    (``optimizer_implementation``: ``foreach``), else ``default``; it printed "None"."""
    if old is not None:
        return _show(old)
    resolved = base.config.get(field)
    return "default" if resolved is None else f"{_show(resolved)} (default)"


def plan_table(model_name: str, results: Sequence[PlanResult]) -> Table:
    """One row per searched dimension: the maximum, its peak, the margin, why it stops."""
    gpu = results[0].gpu if results else None
    title = model_name
    if gpu is not None:
        title = f"{model_name} on {gpu.name} ({gib(gpu.memory_bytes)} GiB usable)"
    table = Table(title=f"{title}: the most that fits", caption=_CAPTION)
    table.add_column("largest", style="bold")
    table.add_column("value", justify="right")
    table.add_column("device total GiB", justify="right")
    table.add_column("margin GiB", justify="right")
    table.add_column("verdict")
    table.add_column("limited by")
    for r in results:
        if r.value is None or r.estimate is None:
            table.add_row(
                r.dimension, "[red]none fits[/]", "-", "-", "[red]does not fit[/]", "nothing fits"
            )
            continue
        v = r.estimate.verdict or "-"
        table.add_row(
            r.dimension,
            str(r.value),
            gib(r.estimate.breakdown.device_total_bytes),
            _signed_gib(margin_bytes(r.estimate)),
            f"[{VERDICT_STYLE.get(v, 'bold')}]{v}[/]",
            r.limited_by.replace("_", " "),
        )
    return table


def plan_json(model_name: str, results: Sequence[PlanResult]) -> str:
    """``{"schema_version", "model", "results": [PlanResult.to_dict(), ...]}``."""
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "model": model_name,
            "results": [r.to_dict() for r in results],
        },
        indent=2,
        default=str,
    )


def _verdict_cell(verdict: str | None) -> str:
    if verdict is None:
        return "-"
    return f"[{VERDICT_STYLE.get(verdict, 'bold')}]{verdict}[/]"


def gpus_table(plan: GpuPlan) -> Table:
    """One row per catalog GPU: usable memory, the largest micro-batch size at the given
    settings with its device total and verdict (the estimate's ``verdict``) and, for a sharded
    run, the fewest GPUs of that kind that fit, with the device total and verdict there."""
    table = Table(title=f"{plan.model_name}: what fits each GPU", caption=_CAPTION)
    table.add_column("GPU", style="bold")
    table.add_column("usable GiB", justify="right")
    table.add_column("largest micro-batch", justify="right")
    table.add_column("device total GiB", justify="right")
    table.add_column("verdict")
    if plan.sharded:
        table.add_column(f"fewest GPUs (ZeRO-{plan.zero_stage})", justify="right")
        table.add_column("device total GiB", justify="right")
        table.add_column("verdict")
    for r in plan.rows:
        cells = [r.gpu.name, gib(r.gpu.memory_bytes)]
        mb = r.micro_batch
        if mb is None:
            cells += ["-", "-", f"[red]{r.error or 'refused'}[/]"]
        elif mb.value is None or mb.estimate is None:
            cells += ["[red]none[/]", "-", _verdict_cell(r.verdict)]
        else:
            total = mb.estimate.breakdown.device_total_bytes
            cells += [str(mb.value), gib(total), _verdict_cell(r.verdict)]
        if plan.sharded:
            sh = r.sharded
            if sh is None:
                cells += ["-", "-", "-"]
            else:
                largest = sh.estimate.config.get("data_parallel_size")
                count = str(sh.data_parallel_size or f"[red]> {largest}[/]")
                total_cell = gib(sh.estimate.breakdown.device_total_bytes)
                cells += [count, total_cell, _verdict_cell(sh.estimate.verdict)]
        table.add_row(*cells)
    return table


def gpus_json(plan: GpuPlan) -> str:
    """``{"schema_version", **GpuPlan.to_dict()}``; bytes throughout."""
    return json.dumps({"schema_version": SCHEMA_VERSION, **plan.to_dict()}, indent=2, default=str)


def fixes_table(base: MemoryEstimate, found: Sequence[Fix]) -> Table:
    """Ranked fixes: what changes, memory saved, device total and margin after, and the cost
    in numbers (:class:`~trainmem.planner.costs.CostFigures`; the words are in the JSON)."""
    table = Table(
        title=f"{base.model_name} on {base.gpu_name}: changes that make it fit, cheapest first",
        caption=_CAPTION
        + "; saved = drop of the peak allocated"
        + (" (each change traced on the generic path)" if base.engine != "analytic" else ""),
    )
    table.add_column("#", justify="right")
    table.add_column("change", style="bold")
    table.add_column("settings")
    table.add_column("saved GiB", justify="right")
    table.add_column("total GiB", justify="right")
    table.add_column("margin GiB", justify="right")
    table.add_column("cost")
    for i, fix in enumerate(found, 1):
        settings = ", ".join(
            f"{k}: {_was(base, k, old)} -> {_show(new)}" for k, (old, new) in fix.settings.items()
        )
        table.add_row(
            str(i),
            fix.name,
            settings,
            gib(fix.saved_bytes),
            gib(fix.estimate.breakdown.device_total_bytes),
            _signed_gib(fix.margin_bytes),
            fix.cost if fix.figures is None else fix.figures.text(),
        )
    return table


def fixes_json(base: MemoryEstimate, found: Sequence[Fix]) -> str:
    """``{"schema_version", "model", "gpu", "fits", "peak", "config", "assumed", "fixes": [...]}``
    (``assumed``: framework, loop and versions, as estimate's ``details.assumed``)."""
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "model": base.model_name,
            "gpu": {"name": base.gpu_name, "capacity_bytes": base.gpu_capacity_bytes},
            "fits": base.fits,
            "peak": base.peak_dict(),
            "config": base.config,
            "assumed": assumed_of(base),
            "fixes": [f.to_dict() for f in found],
        },
        indent=2,
        default=str,
    )


def sweep_table(title: str, rows: Sequence[SweepRow], *, simulated: bool = True) -> Table:
    """One row per grid point: the swept settings, peak figures in GiB, margin and verdict;
    ``simulated=False`` says in the caption that reserved = allocated (no allocator replay)."""
    caption = "GiB = 2^30 bytes; '--format csv|json' gives exact bytes"
    if not simulated:
        caption += (
            "; closed form: reserved = allocated, no fragmentation "
            "(--simulate-allocator replays each row, as estimate does)"
        )
    table = Table(title=title, caption=caption)
    keys = list(rows[0].settings) if rows else []
    for k in keys:
        table.add_column(k, justify="right")
    for col in ("allocated GiB", "reserved GiB", "device total GiB", "margin GiB"):
        table.add_column(col, justify="right")
    table.add_column("peak")
    table.add_column("verdict")
    for r in rows:
        verdict = (
            "-" if r.verdict is None else f"[{VERDICT_STYLE.get(r.verdict, 'bold')}]{r.verdict}[/]"
        )
        table.add_row(
            *(_show(r.settings[k]) for k in keys),
            gib(r.allocated_bytes),
            "OOM" if r.reserved_bytes is None else gib(r.reserved_bytes),
            "OOM" if r.device_total_bytes is None else gib(r.device_total_bytes),
            ("OOM" if r.fits is False else "-")
            if r.margin_bytes is None
            else _signed_gib(r.margin_bytes),
            r.peak_phase,
            verdict,
        )
    return table


def sweep_csv(rows: Sequence[SweepRow]) -> str:
    """CSV with a header: the swept settings, then the figures in bytes; ``fits`` is
    ``true``/``false`` (empty without a GPU)."""
    buf = io.StringIO()
    if not rows:
        return ""
    dicts = [r.to_dict() for r in rows]
    import csv  # NB: here: only --csv output needs it (10 ms of every start-up)

    writer = csv.DictWriter(buf, fieldnames=list(dicts[0]), lineterminator="\n")
    writer.writeheader()
    for d in dicts:
        writer.writerow(
            {
                k: ("" if v is None else str(v).lower() if isinstance(v, bool) else _show(v))
                for k, v in d.items()
            }
        )
    return buf.getvalue()


def sweep_json(result: Sweep) -> str:
    """``{"schema_version", **Sweep.to_dict()}``: the model, GPU, grid, the first point's
    settings and what was assumed (as plan / fit's ``assumed``), the rows under ``"rows"``
    (exact bytes)."""
    return json.dumps(
        {"schema_version": SCHEMA_VERSION, **result.to_dict()}, indent=2, default=list
    )
