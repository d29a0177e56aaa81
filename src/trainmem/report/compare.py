"""CLI pieces for pictures of memory: the ``compare`` command, added to trainmem's typer app by
:func:`register`, and :func:`emit_reports`, which ``trainmem estimate --plot FILE --html FILE``
calls after the estimate.

``cli.py`` calls ``register(app)``; the import of ``trainmem.cli`` is inside the function so that
``trainmem.cli`` can import this module at any point without a cycle. Like
``trainmem.cli.planner``, this module has no ``from __future__ import annotations``: typer
reads the option annotations at registration time, and the aliases are local names of
:func:`register`.
"""

import dataclasses
from pathlib import Path
from typing import Any

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError


def check_output_paths(**paths: str | None) -> None:
    """Refuse every output path that cannot be written before any file is (``--snapshot
    out.pickle --plot bad.bmp`` wrote the pickle, then refused the plot): a ``plot`` suffix
    other than .png / .svg, a folder given as a file, a parent folder that does not exist.

    Args:
        paths: option name (the error's field: ``plot``, ``html``, ``snapshot``) -> path or
            None (not asked for).

    Raises:
        SpecError: the first unusable path, named by its option.
    """
    from trainmem.report.plots import check_format

    for field, path in paths.items():
        if path is None:
            continue
        if field == "plot":
            check_format(path)
        target = Path(path)
        try:
            is_dir, parent_is_dir = target.is_dir(), target.parent.is_dir()
        except OSError as exc:  # a name too long for the file system
            raise SpecError(field, f"cannot write {path[:200]!r}: {exc.strerror or exc}") from None
        if is_dir:
            raise SpecError(field, f"cannot write {path[:200]!r}: it is a folder; give a file name")
        if not parent_is_dir:
            raise SpecError(
                field,
                f"cannot write {path[:200]!r}: {str(target.parent)[:200]!r} is not an existing "
                "folder",
            )


def emit_reports(
    est: MemoryEstimate, *, plot: str | None, html: str | None, alloc_conf: str = ""
) -> list[str]:
    """Write the timeline plot and/or the HTML report of ``est``; return one note per file.

    Args:
        est: the estimate (with its timeline, which both engines attach).
        plot: ``.png`` / ``.svg`` path for :func:`trainmem.report.plots.plot_timeline`, or None.
        html: path for :func:`trainmem.report.html.write_html`, or None.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` of the estimate, for the reserved outline.

    Returns:
        Notes such as ``"timeline plot written to timeline.png"``.

    Raises:
        SpecError: no timeline on ``est``, a bad suffix, or a file that cannot be written.
        ImportError: matplotlib (the ``plot`` extra) is not installed.
    """
    notes: list[str] = []
    if plot is not None:
        from trainmem.report.plots import plot_timeline

        plot_timeline(est, plot, alloc_conf=alloc_conf)
        notes.append(f"timeline plot written to {plot}")
    if html is not None:
        from trainmem.report.html import write_html

        write_html(est, html, alloc_conf=alloc_conf)
        notes.append(f"HTML report written to {html}")
    return notes


_NOT_FIELDS = ("engine", "gpu", "alloc_conf", "fsdp")
"""``--set`` keys that choose how the estimate is made rather than a TrainingConfig field."""


def compare_estimates(
    model: str,
    base: Any,
    sets: list[dict[str, Any]],
    *,
    gpu: str | None,
    engine: str,
    alloc_conf: str,
) -> list[MemoryEstimate]:
    """One estimate per option set: ``base`` (a TrainingConfig) with the set's fields replaced.

    Raises:
        SpecError: an invalid combination (TrainingConfig validates it), an unknown GPU/engine.
    """
    from trainmem.estimate import estimate
    from trainmem.specs.training import fsdp_settings

    out = []
    for overrides in sets:
        fields = {k: v for k, v in overrides.items() if k not in _NOT_FIELDS}
        if "fsdp" in overrides:
            fsdp = fsdp_settings(base.zero_stage, overrides["fsdp"])
            fields.update({k: v for k, v in fsdp.items() if k == "zero_stage" or k not in fields})
        training = dataclasses.replace(base, **fields)
        out.append(
            estimate(
                model,
                training,
                gpu=overrides.get("gpu", gpu),
                engine=overrides.get("engine", engine),
                alloc_conf=overrides.get("alloc_conf", alloc_conf),
            )
        )
    return out


def compare_table(estimates: list[MemoryEstimate], labels: list[str]) -> Any:
    """Rich table: one column per configuration (its label as the header, wrapped rather than
    cut), one row per category in GiB (2^30 bytes), then the peaks, where the peak falls and the
    verdict; a narrow terminal keeps every number whole (two to four configurations fit in 80
    columns)."""
    from rich.table import Table

    from trainmem.breakdown import BREAKDOWN_KEYS
    from trainmem.report.modules import gib_fine
    from trainmem.report.table import BREAKDOWN_LABELS, VERDICT_STYLE

    names = ", ".join(sorted({e.model_name for e in estimates}))
    table = Table(
        title=f"{names}: peak of one training step per configuration",
        caption="GiB = 2^30 bytes; '--json' gives exact bytes",
    )
    table.add_column("GiB", style="bold")
    for i, label in enumerate(labels, 1):
        table.add_column(f"#{i}: {label}", justify="right", overflow="fold")

    def oom_or(e: MemoryEstimate, n_bytes: int) -> str:
        return "OOM" if e.oom_message else gib_fine(n_bytes)

    for key in BREAKDOWN_KEYS:
        table.add_row(
            BREAKDOWN_LABELS[key], *(gib_fine(getattr(e.breakdown, key)) for e in estimates)
        )
    table.add_section()
    table.add_row("peak allocated", *(gib_fine(e.breakdown.allocated_bytes) for e in estimates))
    table.add_row("peak reserved", *(oom_or(e, e.breakdown.reserved_bytes) for e in estimates))
    table.add_row("device total", *(oom_or(e, e.breakdown.device_total_bytes) for e in estimates))
    table.add_row("peak in", *(e.peak_phase for e in estimates))
    table.add_row(
        "verdict",
        *(
            "-" if e.verdict is None else f"[{VERDICT_STYLE.get(e.verdict, 'bold')}]{e.verdict}[/]"
            for e in estimates
        ),
    )
    return table
