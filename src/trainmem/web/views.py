"""HTML fragments of the page: verdict, breakdown, per-rank, uncertainty, per-module tables,
``fit`` suggestions, ``plan``, comparison, messages.

Sizes are shown in GiB (2^30 bytes) with two decimals; every size cell carries the exact byte
count in its ``title`` (shown on hover) and in ``data-bytes``. All text is escaped.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from trainmem.breakdown import BREAKDOWN_KEYS
from trainmem.report.plots import CATEGORY_COLORS
from trainmem.report.table import BREAKDOWN_LABELS, gib
from trainmem.specs.assumptions import precision_text, versions_text
from trainmem.web.compute import Numbers


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def size_cell(n_bytes: int | None, *, signed: bool = False) -> str:
    """``<td>`` with GiB shown and exact bytes on hover (``title``) and in ``data-bytes``."""
    if n_bytes is None:
        return "<td>-</td>"
    sign = ("+" if n_bytes >= 0 else "-") if signed else ("-" if n_bytes < 0 else "")
    return (
        f'<td class="num" title="{n_bytes:,} bytes" data-bytes="{n_bytes}">'
        f"{sign}{gib(abs(n_bytes))}</td>"
    )


def _table(table_id: str, header: Sequence[str], rows: Sequence[str], caption: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    cap = f"<caption>{_e(caption)}</caption>" if caption else ""
    return (
        f'<table class="tm" id="{table_id}">{cap}<thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def verdict_html(n: Numbers) -> str:
    """The verdict (fits / tight / does not fit) with its margin, the device total and where
    the peak falls; an out-of-memory in the simulated allocator is said as such (a step that
    cannot run has no device total)."""
    gpu = n.gpu_name
    needs = n.allocated_bytes + n.cuda_context_bytes
    usable = "" if n.capacity_bytes is None else f" of {gib(n.capacity_bytes)} GiB usable"
    if n.device_total_bytes is not None:
        detail = f"device total {gib(n.device_total_bytes)} GiB{usable}"
    else:
        fragmentation = n.capacity_bytes is not None and needs <= n.capacity_bytes
        detail = (
            f"peak allocated + CUDA context {gib(needs)} GiB{usable}; the caching allocator "
            "runs out of memory"
            + (" (fragmentation: no free block large enough)" if fragmentation else "")
            + ", so there is no reserved figure"
        )
    if n.verdict is None or n.capacity_bytes is None:
        total = n.device_total_bytes if n.device_total_bytes is not None else needs
        head = f"Needs {gib(total)} GiB per GPU (no GPU chosen: no verdict)"
        cls = "none"
    elif n.verdict == "fits" and n.margin_bytes is not None:
        head = f"Fits on {gpu}: {gib(n.margin_bytes)} GiB to spare"
        cls = "fits"
    elif n.verdict == "tight" and n.margin_bytes is not None:
        head = (
            f"Tight on {gpu}: {gib(n.margin_bytes)} GiB to spare, but the uncertainty band's "
            "high end is above the capacity"
        )
        cls = "tight"
    elif n.margin_bytes is None:
        head = f"Does not fit on {gpu}: out of memory in the caching allocator"
        cls = "nofit"
    else:
        head = f"Does not fit on {gpu}: {gib(-n.margin_bytes)} GiB short"
        cls = "nofit"
    trainable = (
        "all trainable"
        if n.num_trainable_parameters == n.num_parameters
        else f"{n.num_trainable_parameters:,} trainable"
    )
    return (
        f'<div class="verdict {cls}" id="verdict" data-fits="{_e(n.fits)}" '
        f'data-verdict="{_e(n.verdict)}" data-device-total-bytes="{_e(n.device_total_bytes)}">'
        f'<div class="head">{_e(head)}</div>'
        f"<div>{_e(n.model)}: {n.num_parameters:,} parameters ({_e(trainable)}); "
        f"{_e(detail)}. The peak falls in the <b>{_e(n.phase)}</b>: {_e(n.reason)}.</div></div>"
    )


def breakdown_html(n: Numbers) -> str:
    """Bytes per category at the peak, then the three peaks and the GPU's capacity."""
    # Out of memory: no device total; shares are of peak allocated + the CUDA context.
    total = n.device_total_bytes
    whole = total if total is not None else n.allocated_bytes + n.cuda_context_bytes
    rows = []
    for key in BREAKDOWN_KEYS:
        value = n.breakdown_bytes[key]
        share = f"{100 * value / whole:.1f}%" if whole else "-"
        rows.append(
            f'<tr data-key="{key}"><td>{_e(BREAKDOWN_LABELS[key])}</td>'
            f'{size_cell(value)}<td class="num">{share}</td></tr>'
        )
    for key, label, peak in (
        ("allocated", "peak allocated (max_memory_allocated)", n.allocated_bytes),
        ("reserved", "peak reserved (max_memory_reserved)", n.reserved_bytes),
        ("device_total", "device total (nvidia-smi)", total),
        ("capacity", f"{n.gpu_name} usable capacity", n.capacity_bytes),
    ):
        if peak is not None:
            rows.append(
                f'<tr class="sum" data-key="{key}"><td>{_e(label)}</td>{size_cell(peak)}'
                "<td></td></tr>"
            )
        elif n.oom is not None and key in ("reserved", "device_total"):
            rows.append(
                f'<tr class="sum" data-key="{key}"><td>{_e(label)}</td><td>OOM</td>'
                "<td>out of memory</td></tr>"
            )
    load = n.load_phase or {}
    if load:  # Note [The load phase]: loading the model has its own peak and cache
        rows.append(
            '<tr class="sum" data-key="load_allocated"><td>loading: peak allocated</td>'
            f"{size_cell(load.get('peak_allocated_bytes'))}<td></td></tr>"
        )
        if load.get("oom"):
            rows.append(
                '<tr class="sum" data-key="load_reserved"><td>loading: reserved</td>'
                "<td>OOM</td><td>out of memory</td></tr>"
            )
        elif load.get("max_memory_reserved") is not None:
            rows.append(
                '<tr class="sum" data-key="load_reserved"><td>loading: reserved (kept by the '
                f"step)</td>{size_cell(load['max_memory_reserved'])}<td></td></tr>"
            )
    return _table(
        "breakdown",
        ["memory at the peak", "GiB", "share"],
        rows,
        "GiB = 2^30 bytes; hover a size for the exact bytes",
    )


def per_rank_html(n: Numbers) -> str:
    """One row per pipeline stage (``details["per_rank"]``); empty for a single stage."""
    if len(n.per_rank) < 2:
        return ""
    rows = [
        f"<tr><td>{_e(r.get('pipeline_stage', i))}</td><td>{_e(r.get('num_layers', '-'))}</td>"
        f"<td>{_e(r.get('micro_batches_in_flight', '-'))}</td>"
        f"{size_cell(r.get('allocated_bytes'))}<td>{_e(r.get('peak_phase', '-'))}</td></tr>"
        for i, r in enumerate(n.per_rank)
    ]
    return "<h4>Per pipeline stage</h4>" + _table(
        "per-rank",
        ["stage", "layers", "micro-batches in flight", "peak allocated GiB", "peak in"],
        rows,
        "the verdict is for the stage with the largest peak",
    )


def band_html(b: dict[str, Any] | None) -> str:
    """The low / expected / high device total and the settings least sure of."""
    if not b:
        return ""
    least = "".join(f"<li>{_e(x)}</li>" for x in b.get("least_sure_of", []))
    return (
        '<div id="band"><b>Uncertainty</b> (device total, from the benchmark\'s errors): '
        + _table(
            "band-table",
            ["low", "expected", "high"],
            [f"<tr>{size_cell(b['low'])}{size_cell(b['expected'])}{size_cell(b['high'])}</tr>"],
        )
        + (f"least sure of:<ul>{least}</ul>" if least else "")
        + "</div>"
    )


def modules_html(activations: list[dict[str, Any]], at_peak: list[dict[str, Any]]) -> str:
    """The two per-module tables of :mod:`trainmem.report.modules`."""
    if not activations and not at_peak:
        return "<p>No per-module data for this estimate.</p>"
    acts = [
        f"<tr><td>{_e(r['module'])}</td>{size_cell(r['activation_bytes'])}"
        f'<td class="num">{100 * r.get("share", 0):.1f}%</td></tr>'
        for r in activations
    ]
    peak = [
        f"<tr><td>{_e(r['module'])}</td><td>{_e(r['category'])}</td>{size_cell(r['bytes'])}"
        f'<td class="num">{100 * r.get("share", 0):.1f}%</td></tr>'
        for r in at_peak
    ]
    return (
        "<h4>Activations by module (end of the forward pass)</h4>"
        + _table("modules-activations", ["module", "GiB", "share"], acts)
        + "<h4>Live at the peak</h4>"
        + _table("modules-peak", ["module", "category", "GiB", "share"], peak)
    )


def fixes_html(rows: list[dict[str, Any]], n: Numbers | None) -> str:
    """``trainmem fit``: the ranked changes that make a run fit."""
    if n is None or n.fits is None:
        return "<p>Choose a GPU to get suggestions.</p>"
    if n.fits:
        return "<p>It fits: nothing to change.</p>"
    if not rows:
        return "<p>No single change or pair of changes in trainmem's table makes it fit.</p>"
    body = []
    for i, r in enumerate(rows, 1):
        settings = ", ".join(f"{k}: {v['from']} -> {v['to']}" for k, v in r["settings"].items())
        body.append(
            f"<tr><td>{i}</td><td>{_e(r['change'])}</td><td>{_e(settings)}</td>"
            f"{size_cell(r['saved_bytes'])}{size_cell(r['device_total_bytes'])}"
            f"{size_cell(r['margin_bytes'], signed=True)}<td>{_e(r['cost'])}</td></tr>"
        )
    return _table(
        "fixes",
        ["#", "change", "settings", "saved GiB", "total GiB", "margin GiB", "cost"],
        body,
        "cheapest first (trainmem fit)",
    )


def plan_html(rows: list[dict[str, Any]]) -> str:
    """``trainmem plan``: the largest micro-batch size and sequence length that fit."""
    if not rows:
        return "<p>Choose a GPU to plan.</p>"
    body = []
    for r in rows:
        peak = r.get("peak") or {}
        value = "nothing fits" if r["value"] is None else f"{r['value']:,}"
        if r["value"] is not None and r.get("step", 1) > 1:  # as the CLI's "fixed:" line
            value += f" (multiples of {r['step']} tokens)"
        body.append(
            f'<tr data-dimension="{_e(r["dimension"])}"><td>{_e(r["dimension"])}</td>'
            f"<td>{_e(value)}</td>{size_cell(peak.get('device_total_bytes'))}"
            f"{size_cell(r.get('margin_bytes'), signed=True)}<td>{_e(r['reason'])}</td></tr>"
        )
    return _table(
        "plan",
        ["largest", "value", "total GiB", "margin GiB", "why"],
        body,
        "every other setting as chosen (trainmem plan)",
    )


def compare_html(labels: Sequence[str], columns: Sequence[Numbers]) -> str:
    """Two to four configurations side by side: one column each, one row per category."""
    if len(columns) < 2:
        return (
            f"<p>{len(columns)} configuration(s) pinned. Pin two to four configurations "
            "(set the options, then press <b>Pin this configuration</b>) to compare them.</p>"
        )
    head = ["", *(f"#{i}: {label}" for i, label in enumerate(labels, 1))]
    rows = []
    for key in BREAKDOWN_KEYS:
        cells = "".join(size_cell(c.breakdown_bytes[key]) for c in columns)
        rows.append(f"<tr><td>{_e(BREAKDOWN_LABELS[key])}</td>{cells}</tr>")
    for label, attr in (
        ("peak allocated", "allocated_bytes"),
        ("peak reserved", "reserved_bytes"),
        ("device total", "device_total_bytes"),
    ):
        cells = "".join(size_cell(getattr(c, attr)) for c in columns)
        rows.append(f'<tr class="sum"><td>{label}</td>{cells}</tr>')
    rows.append(
        "<tr><td>margin</td>"
        + "".join(size_cell(c.margin_bytes, signed=True) for c in columns)
        + "</tr>"
    )
    rows.append("<tr><td>peak in</td>" + "".join(f"<td>{_e(c.phase)}</td>" for c in columns))
    verdicts = "".join(f"<td>{_e(c.verdict or '-')}</td>" for c in columns)
    rows.append(f"<tr><td>verdict</td>{verdicts}</tr>")
    return _table("compare", head, rows, "GiB = 2^30 bytes; hover for exact bytes")


def assumed_html(n: Numbers) -> str:
    """What the estimate assumed: the framework's conventions and the library versions."""
    a = n.assumed
    if not a:
        return ""
    loop = f"loop: {a['loop']}; " if a.get("loop") else ""
    return (
        f'<div class="tm-info" id="assumed">Assumed: <b>--framework {_e(a["framework"])}</b> '
        f"({_e(a.get('framework_means', ''))}); {_e(precision_text(a))}{_e(loop)}"
        f"{_e(versions_text(a))}. Change it "
        "under <i>Framework</i> if you train with another stack.</div>"
    )


def legend_html() -> str:
    """The timeline's legend: one swatch per memory category (the colours of
    :data:`trainmem.report.plots.CATEGORY_COLORS`) and the black total line."""
    items = [(BREAKDOWN_LABELS.get(k, k), c) for k, c in CATEGORY_COLORS.items()]
    items.append(("total (peak allocated at its top)", "#000000"))
    spans = "".join(
        f'<span class="tm-key"><span class="tm-swatch" style="background:{c}"></span>'
        f"{_e(label)}</span>"
        for label, c in items
    )
    return f'<div class="tm-legend" id="timeline-legend">{spans}</div>'


def result_html(n: Numbers, band: dict[str, Any] | None, extra_notes: Sequence[str] = ()) -> str:
    """The verdict above the breakdown, the band and the per-stage table side by side, then the
    notes (``extra_notes`` first: e.g. that the framework matters)."""
    return (
        verdict_html(n)
        + assumed_html(n)
        + '<div class="tm-grid"><div>'
        + breakdown_html(n)
        + "</div><div>"
        + band_html(band)
        + per_rank_html(n)
        + "</div></div>"
        + notes_html([*extra_notes, *n.notes])
    )


def notes_html(notes: Sequence[str]) -> str:
    """The estimate's notes as a list."""
    if not notes:
        return ""
    return "<ul class='notes'>" + "".join(f"<li>{_e(x)}</li>" for x in notes) + "</ul>"


def info_html(text: str) -> str:
    """One line of information (e.g. what an uploaded file set)."""
    return f'<div class="tm-info">{_e(text)}</div>'


def message_html(messages: Sequence[str]) -> str:
    """Problems with the input, one line each, in a box the user cannot miss; "" for none."""
    if not messages:
        return ""
    return (
        '<div class="tm-error" id="error" role="alert">'
        + "<br>".join(_e(m) for m in messages)
        + "</div>"
    )
