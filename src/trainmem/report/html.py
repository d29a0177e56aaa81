"""One self-contained HTML report of an estimate: the peak, the breakdown table, the timeline
plot, the per-module tables, the configuration, and optionally a comparison with other
configurations.

The file opens offline: the plots are embedded as base64 PNG (``data:`` URIs), the style sheet is
inline, and there is no script and no external link. Sizes are shown in GiB (2^30 bytes) next to
the exact bytes.
"""

from __future__ import annotations

import base64
import html
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainmem.breakdown import BREAKDOWN_KEYS, MemoryEstimate
from trainmem.errors import SpecError
from trainmem.report.modules import activation_rows, gib_fine, peak_rows
from trainmem.report.table import BREAKDOWN_LABELS

__all__ = ["comparison_labels", "render_html", "write_html"]

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.7em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f5f5f5; } tr.total td { font-weight: bold; background: #fafafa; }
img { max-width: 100%; height: auto; } .fits { color: #1a7f37; } .nofit { color: #b00020; }
.note { color: #555; font-size: 0.9em; } code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: set[int]) -> str:
    """An HTML table; columns in ``numeric`` are right-aligned."""
    out = ["<table>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        cells = "".join(
            f'<td class="num">{_e(v)}</td>' if i in numeric else f"<td>{_e(v)}</td>"
            for i, v in enumerate(row)
        )
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _png_data_uri(draw: Any) -> str:
    """Call ``draw(path)`` with a temporary ``.png`` path and return the file as a data URI."""
    with tempfile.TemporaryDirectory(prefix="trainmem-") as tmp:
        path = Path(tmp) / "plot.png"
        draw(path)
        data = path.read_bytes()
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def comparison_labels(estimates: Sequence[MemoryEstimate]) -> list[str]:
    """One label per estimate from the settings that differ between them
    (``"activation_checkpointing=full"``); ``"#1"``, ``"#2"``... when none differ."""
    keys = sorted({k for e in estimates for k in e.config})
    differing = [k for k in keys if len({repr(e.config.get(k)) for e in estimates}) > 1]
    if len({e.engine for e in estimates}) > 1:
        differing.append("engine")
    if len({e.gpu_name for e in estimates}) > 1:
        differing.append("gpu")
    labels = []
    for i, e in enumerate(estimates, 1):
        extra = {"engine": e.engine, "gpu": e.gpu_name}
        parts = [f"{k}={extra[k] if k in extra else e.config.get(k)}" for k in differing]
        labels.append(", ".join(parts) if parts else f"#{i}")
    return labels


def _breakdown_section(est: MemoryEstimate) -> str:
    b = est.breakdown
    total = b.device_total_bytes
    rows: list[list[Any]] = []
    for key in BREAKDOWN_KEYS:
        value = getattr(b, key)
        share = f"{100 * value / total:.1f}%" if total else "-"
        rows.append([BREAKDOWN_LABELS[key], gib_fine(value), share, f"{value:,}"])
    rows += [
        [
            "peak allocated (max_memory_allocated)",
            gib_fine(b.allocated_bytes),
            "",
            f"{b.allocated_bytes:,}",
        ],
        [
            "peak reserved (max_memory_reserved)",
            gib_fine(b.reserved_bytes),
            "",
            f"{b.reserved_bytes:,}",
        ],
        ["device total (nvidia-smi)", gib_fine(total), "", f"{total:,}"],
    ]
    if est.gpu_capacity_bytes is not None:
        rows.append(
            [
                f"{est.gpu_name} usable capacity",
                gib_fine(est.gpu_capacity_bytes),
                "",
                f"{est.gpu_capacity_bytes:,}",
            ]
        )
    return _table(["memory", "GiB", "share", "bytes"], rows, numeric={1, 2, 3})


def _verdict(est: MemoryEstimate) -> str:
    if est.fits is None:
        return "<p>No GPU given: no fit verdict (pass <code>--gpu</code>).</p>"
    margin = (est.gpu_capacity_bytes or 0) - est.breakdown.device_total_bytes
    cls, word = ("fits", "fits") if est.fits else ("nofit", "does not fit")
    return (
        f'<p class="{cls}"><b>{_e(word)}</b> on {_e(est.gpu_name)} '
        f"({'+' if margin >= 0 else '-'}{_e(gib_fine(abs(margin)))} GiB margin).</p>"
    )


def _modules_section(est: MemoryEstimate, top: int) -> str:
    acts = activation_rows(est, top=top)
    peak = peak_rows(est, top=top)
    if not acts and not peak:
        return '<p class="note">No allocation timeline: no per-module tables.</p>'
    parts = ["<h3>Activations live at the end of the forward pass, by module</h3>"]
    parts.append(
        _table(
            ["module", "GiB", "share", "bytes"],
            [
                [
                    r["module"],
                    gib_fine(r["activation_bytes"]),
                    f"{100 * r['share']:.1f}%",
                    f"{r['activation_bytes']:,}",
                ]
                for r in acts
            ],
            numeric={1, 2, 3},
        )
    )
    parts.append("<h3>Live at the peak, by module and category</h3>")
    parts.append(
        _table(
            ["module", "category", "GiB", "share", "bytes"],
            [
                [
                    r["module"],
                    r["category"],
                    gib_fine(r["bytes"]),
                    f"{100 * r['share']:.1f}%",
                    f"{r['bytes']:,}",
                ]
                for r in peak
            ],
            numeric={2, 3, 4},
        )
    )
    return "\n".join(parts)


def _comparison_section(
    estimates: Sequence[MemoryEstimate], labels: Sequence[str], with_plot: bool
) -> str:
    from trainmem.report.plots import plot_breakdown

    parts = ["<h2>Comparison</h2>"]
    if with_plot:
        uri = _png_data_uri(lambda p: plot_breakdown(estimates, labels, p))
        parts.append(f'<img alt="breakdown comparison" src="{uri}">')
    header = [
        "configuration",
        *(BREAKDOWN_LABELS[k] for k in BREAKDOWN_KEYS),
        "allocated GiB",
        "reserved GiB",
        "device total GiB",
        "peak phase",
        "fits",
    ]
    rows = []
    for label, e in zip(labels, estimates, strict=True):
        b = e.breakdown
        rows.append(
            [
                label,
                *(gib_fine(getattr(b, k)) for k in BREAKDOWN_KEYS),
                gib_fine(b.allocated_bytes),
                gib_fine(b.reserved_bytes),
                gib_fine(b.device_total_bytes),
                e.peak_phase,
                "-" if e.fits is None else ("yes" if e.fits else "no"),
            ]
        )
    parts.append(_table(header, rows, numeric=set(range(1, len(header) - 2))))
    return "\n".join(parts)


def render_html(
    est: MemoryEstimate,
    extra_estimates: Sequence[MemoryEstimate] | None = None,
    *,
    labels: Sequence[str] | None = None,
    plots: bool = True,
    alloc_conf: str = "",
    top: int = 10,
) -> str:
    """The report as one HTML string (see :func:`write_html`).

    Args:
        est: the main estimate.
        extra_estimates: other configurations to compare with ``est`` (a bar chart and a table).
        labels: one label per estimate, ``est`` first; default :func:`comparison_labels`.
        plots: embed the plots (needs matplotlib); False gives tables only.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the reserved outline of the timeline.
        top: rows of each per-module table.

    Returns:
        The HTML document.

    Raises:
        SpecError: ``labels`` of the wrong length.
        ImportError: ``plots`` and matplotlib is not installed.
    """
    estimates = [est, *(extra_estimates or [])]
    if labels is None:
        labels = comparison_labels(estimates)
    if len(labels) != len(estimates):
        raise SpecError(
            "labels", f"{len(estimates)} estimates need as many labels, got {len(labels)}"
        )
    title = f"{est.model_name}: peak GPU memory of one training step ({est.engine} engine)"
    b = est.breakdown
    body = [f"<h1>{_e(title)}</h1>"]
    body.append(
        f"<p>Peak allocated <b>{_e(gib_fine(b.allocated_bytes))} GiB</b>, reserved "
        f"<b>{_e(gib_fine(b.reserved_bytes))} GiB</b>, device total "
        f"<b>{_e(gib_fine(b.device_total_bytes))} GiB</b> (GiB = 2^30 bytes). "
        f"The peak falls in the <b>{_e(est.peak_phase)}</b>: {_e(est.peak_reason)}.</p>"
    )
    body.append(_verdict(est))
    body.append("<h2>Breakdown at the peak</h2>")
    body.append(_breakdown_section(est))
    if plots and est.timeline is not None and len(est.timeline):
        from trainmem.report.plots import plot_timeline

        uri = _png_data_uri(lambda p: plot_timeline(est, p, alloc_conf=alloc_conf))
        body.append("<h2>Memory over one training step</h2>")
        body.append(f'<img alt="timeline of one training step" src="{uri}">')
    if extra_estimates:
        body.append(_comparison_section(estimates, labels, plots))
    body.append("<h2>Per-module memory</h2>")
    body.append(_modules_section(est, top))
    body.append("<h2>Configuration</h2>")
    config_rows: list[list[Any]] = [["model", est.model_name], ["engine", est.engine]]
    config_rows += [[k, v] for k, v in est.config.items()]
    config_rows += [
        ["num_parameters", f"{est.num_parameters:,}"],
        ["num_trainable_parameters", f"{est.num_trainable_parameters:,}"],
        ["gpu", est.gpu_name or "-"],
    ]
    body.append(_table(["setting", "value"], config_rows, numeric=set()))
    if est.notes:
        body.append(
            "<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in est.notes) + "</ul>"
        )
    body.append(
        '<p class="note">Generated by trainmem; predicted, not measured. '
        "Sizes in GiB (2^30 bytes); exact bytes in the tables.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_html(
    est: MemoryEstimate,
    path: str | Path,
    extra_estimates: Sequence[MemoryEstimate] | None = None,
    *,
    labels: Sequence[str] | None = None,
    plots: bool = True,
    alloc_conf: str = "",
) -> None:
    """Write one self-contained HTML report (no external assets; opens offline).

    It holds the peak and the fit verdict, the breakdown table (GiB and bytes), the timeline
    plot (base64 PNG), the comparison with ``extra_estimates`` (stacked bars and a table), the
    per-module tables and every resolved setting.

    Args:
        est: the main estimate.
        path: the ``.html`` file to write.
        extra_estimates: other configurations to compare with ``est``.
        labels: one label per estimate, ``est`` first; default :func:`comparison_labels`.
        plots: embed the plots (needs matplotlib).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the reserved outline of the timeline.

    Raises:
        SpecError: the file cannot be written, or ``labels`` has the wrong length.
        ImportError: ``plots`` and matplotlib is not installed.
    """
    text = render_html(est, extra_estimates, labels=labels, plots=plots, alloc_conf=alloc_conf)
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise SpecError("html", f"cannot write {path}: {exc.strerror or exc}") from exc
