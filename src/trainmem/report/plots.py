"""Pictures of memory (matplotlib, the ``plot`` extra, imported lazily): the timeline of one
steady-state training step and stacked bars comparing configurations.

Every axis is in GiB (2^30 bytes) and says so. Figures are drawn on a bare
:class:`matplotlib.figure.Figure` (no pyplot, no global state, the Agg renderer for PNG) under
matplotlib's ``default`` style, so the output does not depend on the user's rcParams and a golden
image stays comparable. The format follows the file's suffix: ``.png`` or ``.svg``.

Note [Timeline window]
    Both engines attach a :class:`~trainmem.timeline.Timeline`. The analytic engine replays two
    steps from an empty device and sets ``steady_state_start`` to the first event of the second
    step; the trace engine registers the storages that exist before the recorded step (weights,
    optimizer states, micro-batches, the cuBLAS workspace) as ``init`` alloc events at the head of
    the list and leaves ``steady_state_start`` at 0. The plotted window starts at the first event
    at or after ``steady_state_start`` whose phase is not ``init``; everything before it is the
    state carried into the step, drawn at x = 0.

Known limitations:
    - live bytes are requested sizes (no 512 B rounding); the reserved outline comes from the
      allocator simulator and so includes the rounding and the cached free blocks;
    - the CUDA context is outside the allocator and outside the timeline: the capacity line is
      drawn at the GPU's usable capacity minus the estimate's CUDA context, the limit the
      allocator itself sees (:func:`trainmem.allocator.device.allocator_capacity_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmem.breakdown import MemoryEstimate, fold_category
from trainmem.errors import SpecError
from trainmem.timeline import AllocEvent, Timeline
from trainmem.units import GiB

__all__ = [
    "CATEGORY_COLORS",
    "CATEGORY_LABELS",
    "STACK_ORDER",
    "TimelineSeries",
    "check_format",
    "plot_breakdown",
    "plot_timeline",
    "timeline_series",
]

#: Breakdown keys bottom to top: what lives across steps first, what lives for an instant last.
STACK_ORDER: tuple[str, ...] = (
    "parameters",
    "optimizer_states",
    "gradients",
    "activations",
    "temporary",
    "fragmentation",
    "cuda_context",
)
#: Tensor categories that appear in a timeline (fragmentation and context do not).
TIMELINE_KEYS: tuple[str, ...] = STACK_ORDER[:5]

CATEGORY_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "optimizer_states": "optimizer states",
    "gradients": "gradients",
    "activations": "activations",
    "temporary": "temporary buffers",
    "fragmentation": "fragmentation",
    "cuda_context": "CUDA context",
}
#: One colour per category, shared by every picture (matplotlib's tab10 entries).
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#1f77b4",
    "optimizer_states": "#2ca02c",
    "gradients": "#ff7f0e",
    "activations": "#d62728",
    "temporary": "#9467bd",
    "fragmentation": "#c7c7c7",
    "cuda_context": "#7f7f7f",
}
_PHASE_COLORS: dict[str, str] = {
    "load": "#f7f2e4",
    "init": "#f2f2f2",
    "forward": "#e3eefa",
    "backward": "#fbe9dc",
    "optimizer": "#e4f4e0",
    "zero_grad": "#eeeeee",
}
_FORMATS = (".png", ".svg")
# SVG text stays text (searchable, selectable); a fixed hash salt gives stable element ids.
_RC: dict[str, Any] = {
    "svg.fonttype": "none",
    "svg.hashsalt": "trainmem",
    # every text is literal: a model path or label with "$...$" is not TeX math
    "text.parse_math": False,
}


@dataclass(frozen=True, slots=True)
class TimelineSeries:
    """Live bytes by category over the steady-state step: what :func:`plot_timeline` draws.

    Position ``x = 0`` is the state carried into the step; ``x = i + 1`` is the state after
    ``events[start + i]``. Bytes throughout.

    Attributes:
        start: index in ``timeline.events`` of the first plotted event (Note [Timeline window]).
        live_bytes: breakdown key (:data:`TIMELINE_KEYS`) -> live requested bytes per position.
        total_bytes: sum over categories per position.
        phases: phase of each plotted event (``len(phases) == len(total_bytes) - 1``).
        events: the plotted events.
        peak_position: first position with the largest total.
        peak_bytes: that total, live requested bytes.
        reserved_bytes: the simulator's ``reserved_bytes.all.current`` per position, or None.
    """

    start: int
    live_bytes: dict[str, list[int]]
    total_bytes: list[int]
    phases: list[str]
    events: list[AllocEvent]
    peak_position: int
    peak_bytes: int
    reserved_bytes: list[int] | None

    @property
    def peak_event(self) -> AllocEvent | None:
        """The event that set the peak; None if the peak is the carried-in state."""
        return self.events[self.peak_position - 1] if self.peak_position > 0 else None


def window_start(timeline: Timeline) -> int:
    """Index of the first plotted event. See Note [Timeline window]."""
    events = timeline.events
    i = max(timeline.steady_state_start, 0)
    while i < len(events) and events[i].phase == "init":
        i += 1
    return i


def reserved_trace(timeline: Timeline, alloc_conf: str = "") -> list[int]:
    """``reserved_bytes.all.current`` after each event of ``timeline``, from a fresh
    :class:`~trainmem.allocator.caching.CachingAllocatorSim` with no capacity limit.

    Args:
        timeline: the events, replayed from the first.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the simulator.

    Returns:
        Reserved bytes after each event (``len(timeline.events)`` values).
    """
    from trainmem.allocator.caching import CachingAllocatorSim
    from trainmem.allocator.config import AllocatorConfig

    sim = CachingAllocatorSim(None, AllocatorConfig.from_string(alloc_conf))
    reserved = sim.stats.reserved_bytes[0]
    handles: dict[int, int] = {}
    out: list[int] = []
    for ev in timeline.events:
        if ev.action == "alloc":
            handles[ev.block_id] = sim.malloc(ev.size_bytes, ev.stream)
        else:
            handle = handles.pop(ev.block_id, None)
            if handle:
                sim.free(handle)
        out.append(reserved.current)
    return out


def timeline_series(
    timeline: Timeline, *, reserved: bool = True, alloc_conf: str = ""
) -> TimelineSeries:
    """Live bytes by category over the steady-state step of ``timeline``.

    Args:
        timeline: an engine's timeline (``MemoryEstimate.timeline``).
        reserved: also replay the timeline through the allocator simulator for reserved bytes.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for that replay.

    Returns:
        The :class:`TimelineSeries`.
    """
    events = timeline.events
    start = window_start(timeline)
    live = dict.fromkeys(TIMELINE_KEYS, 0)
    for ev in events[:start]:
        live[fold_category(ev.category)] += (
            ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
        )
    series: dict[str, list[int]] = {k: [v] for k, v in live.items()}
    total = [sum(live.values())]
    for ev in events[start:]:
        key = fold_category(ev.category)
        live[key] += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
        for k, v in live.items():
            series[k].append(v)
        total.append(total[-1] + (ev.size_bytes if ev.action == "alloc" else -ev.size_bytes))
    peak_position = max(range(len(total)), key=total.__getitem__)
    reserved_bytes = None
    if reserved and events:
        trace = reserved_trace(timeline, alloc_conf)
        reserved_bytes = [trace[start - 1] if start > 0 else 0, *trace[start:]]
    return TimelineSeries(
        start=start,
        live_bytes=series,
        total_bytes=total,
        phases=[ev.phase for ev in events[start:]],
        events=list(events[start:]),
        peak_position=peak_position,
        peak_bytes=total[peak_position],
        reserved_bytes=reserved_bytes,
    )


def _matplotlib() -> Any:
    """``matplotlib`` itself, or an ImportError naming the extra."""
    try:
        import matplotlib
        import matplotlib.style
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError("plots need matplotlib: pip install 'trainmem[plot]'") from exc
    return matplotlib


def check_format(path: str | Path) -> str:
    """``"png"`` or ``"svg"`` from the file's suffix; anything else is a SpecError."""
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise SpecError("plot", f"{str(path)!r}: use a .png or .svg file name")
    return suffix[1:]


def _save(fig: Any, path: str | Path, fmt: str, dpi: int) -> None:
    # No date or software version in the file, so two runs give the same bytes.
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    try:
        fig.savefig(path, format=fmt, dpi=dpi, metadata=metadata)
    except OSError as exc:
        raise SpecError("plot", f"cannot write {path}: {exc.strerror or exc}") from exc


def _phase_runs(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Maximal runs ``(phase, first, last)`` of equal phases, over event indices."""
    runs: list[tuple[str, int, int]] = []
    for i, phase in enumerate(phases):
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], i)
        else:
            runs.append((phase, i, i))
    return runs


def _event_text(ev: AllocEvent | None) -> str:
    if ev is None:
        return "state carried into the step"
    where = f" in {ev.module}" if ev.module else ""
    return f"{ev.action} of {CATEGORY_LABELS[fold_category(ev.category)]}{where} ({ev.phase})"


def _subtitle(est: MemoryEstimate, width: int = 120) -> str:
    """The resolved settings (``report.table.config_line``), wrapped to ``width`` characters."""
    import textwrap

    from trainmem.report.table import config_line

    return "\n".join(textwrap.wrap(config_line(est), width=width, break_on_hyphens=False))


def format_gib(n_bytes: int | float) -> str:
    """Bytes as GiB: two decimals from 1 GiB up, three significant digits below
    (``"25.74 GiB"``, ``"0.0200 GiB"``)."""
    value = n_bytes / GiB
    return f"{value:.2f} GiB" if abs(value) >= 1 or value == 0 else f"{value:#.3g} GiB"


def _legend(ax: Any, stacked: Sequence[Any], others: Sequence[Any]) -> None:
    """Legend outside the axes on the right: the ``stacked`` artists (drawn bottom to top) listed
    top first, as they appear in the stack, then ``others``."""
    handles = [*list(stacked)[::-1], *others]
    ax.legend(
        handles,
        [h.get_label() for h in handles],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
        frameon=False,
    )


def plot_timeline(
    est: MemoryEstimate,
    path: str | Path,
    *,
    reserved: bool = True,
    alloc_conf: str = "",
    show_capacity: bool = True,
    dpi: int = 110,
    figsize: tuple[float, float] = (11.0, 5.5),
) -> TimelineSeries:
    """Stacked area of live bytes by category over the events of one steady-state step.

    Phases are shaded and labelled, the peak is marked with the event that set it and its value
    in GiB, the allocator's reserved memory is drawn as an outline, and the GPU's usable
    capacity minus the CUDA context as a line when the estimate has a GPU.

    Args:
        est: an estimate with a timeline (both engines attach one; the analytic engine only
            with its allocator simulation on, the default).
        path: ``.png`` or ``.svg`` file to write.
        reserved: draw the simulator's reserved bytes (replays the whole timeline once).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for that replay (the estimate does not keep it).
        show_capacity: draw the capacity line when ``est.gpu_capacity_bytes`` is known.
        dpi: PNG resolution, dots per inch.
        figsize: figure size in inches.

    Returns:
        The data drawn (bytes), for tests and the HTML report.

    Raises:
        SpecError: no timeline on ``est``, an empty one, or a suffix other than png/svg.
        ImportError: matplotlib is not installed.
    """
    fmt = check_format(path)
    timeline = est.timeline
    if not isinstance(timeline, Timeline) or not timeline.events:
        raise SpecError(
            "plot",
            "this estimate carries no allocation timeline (run with the allocator "
            "simulator on, or --engine trace)",
        )
    data = timeline_series(timeline, reserved=reserved, alloc_conf=alloc_conf)
    mpl = _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(data.total_bytes)
    x = list(range(n))
    with mpl.style.context("default"), mpl.rc_context(_RC):
        fig = Figure(figsize=figsize, layout="constrained")
        ax = fig.add_subplot()
        for phase, first, last in _phase_runs(data.phases):
            # event i is drawn between positions i and i + 1
            ax.axvspan(first, last + 1, color=_PHASE_COLORS.get(phase, "#f2f2f2"), lw=0, zorder=0)
        for phase, first, last in _phase_runs(data.phases):
            label = phase.replace("_", " ")
            share = (last + 1 - first) / n
            # ~0.95% of the axes width per character at 9 pt on the default 11-inch figure
            rotation = 0 if share >= 0.0095 * (len(label) + 2) else 90 if share >= 0.012 else None
            if rotation is not None:
                ax.text(
                    (first + last + 1) / 2,
                    0.985,
                    label,
                    transform=ax.get_xaxis_transform(),
                    ha="center",
                    va="top",
                    fontsize=9,
                    color="#444444",
                    rotation=rotation,
                )
        keys = [k for k in TIMELINE_KEYS if any(data.live_bytes[k])]
        others: list[Any] = []
        areas = ax.stackplot(
            x,
            [[v / GiB for v in data.live_bytes[k]] for k in keys],
            labels=[CATEGORY_LABELS[k] for k in keys],
            colors=[CATEGORY_COLORS[k] for k in keys],
            step="post",
            lw=0,
            zorder=2,
        )
        if data.reserved_bytes is not None:
            others += ax.step(
                x,
                [v / GiB for v in data.reserved_bytes],
                where="post",
                color="black",
                lw=1.0,
                label="reserved (allocator simulator)",
                zorder=3,
            )
        top = max(data.total_bytes + (data.reserved_bytes or []))
        capacity = None
        if show_capacity and est.gpu_capacity_bytes is not None:
            capacity = max(est.gpu_capacity_bytes - est.breakdown.cuda_context, 0)
            others.append(
                ax.axhline(
                    capacity / GiB,
                    color="#b00020",
                    ls="--",
                    lw=1.2,
                    zorder=3,
                    label=f"{est.gpu_name}: {est.gpu_capacity_bytes / GiB:.1f} GiB usable "
                    f"- {est.breakdown.cuda_context / GiB:.2f} GiB CUDA context",
                )
            )
            top = max(top, capacity)
        peak_gib = data.peak_bytes / GiB
        px = data.peak_position
        ax.plot([px], [peak_gib], marker="v", color="black", ms=7, zorder=4, ls="none")
        left = px > 0.55 * n
        ax.annotate(
            f"peak {format_gib(data.peak_bytes)}\n{_event_text(data.peak_event)}",
            xy=(px, peak_gib),
            xytext=(-12 if left else 12, -4),
            textcoords="offset points",
            ha="right" if left else "left",
            va="top",
            fontsize=9,
            zorder=5,
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#888888", "alpha": 0.9},
        )
        ax.set_xlim(0, n)
        ax.set_ylim(0, top / GiB * 1.12 if top else 1.0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("allocation events of one steady-state step (x = 0: state carried in)")
        ax.set_ylabel("live memory (GiB = 2^30 bytes)")
        fig.suptitle(
            f"{est.model_name}: memory over one training step ({est.engine} engine)\n"
            f"{_subtitle(est)}",
            fontsize=10,
        )
        ax.grid(axis="y", color="#dddddd", lw=0.6, zorder=1)
        ax.set_axisbelow(True)
        from matplotlib.patches import Patch

        shades = [
            Patch(
                color=_PHASE_COLORS.get(phase, "#f2f2f2"), label=f"{phase.replace('_', ' ')} phase"
            )
            for phase in dict.fromkeys(data.phases)
        ]
        _legend(ax, areas, [*others, *shades])
        _save(fig, path, fmt, dpi)
    return data


def _wrap_label(text: str, width: int = 20) -> str:
    """A bar label on several lines: one assignment per line; a long ``key=value`` is broken
    after the ``=`` and the key at its hyphens."""
    import textwrap

    lines: list[str] = []
    for part in text.replace(";", " ").replace(", ", " ").split():
        key, sep, value = part.partition("=")
        if len(part) <= width or not sep:
            lines.append(part)
            continue
        lines += textwrap.wrap(key + sep, width=width, break_long_words=False) or [key + sep]
        lines.append(value)
    return "\n".join(lines)


def plot_breakdown(
    estimates: Sequence[MemoryEstimate],
    labels: Sequence[str],
    path: str | Path,
    *,
    title: str | None = None,
    dpi: int = 110,
) -> None:
    """Stacked bars of the peak breakdown, one bar per estimate, with the device total on top.

    Each bar stacks every category of ``MemoryEstimate.breakdown`` (parameters to CUDA context,
    bytes shown in GiB), so its height is the device total nvidia-smi would show. GPU
    capacities, when the estimates have them, are drawn as a dashed line.

    Args:
        estimates: the configurations to compare.
        labels: one label per estimate (the x tick text).
        path: ``.png`` or ``.svg`` file to write.
        title: figure title; default names the model(s).
        dpi: PNG resolution, dots per inch.

    Raises:
        SpecError: no estimates, a label count that does not match, or a bad suffix.
        ImportError: matplotlib is not installed.
    """
    fmt = check_format(path)
    if not estimates or len(labels) != len(estimates):
        raise SpecError(
            "plot", f"{len(estimates)} estimates need as many labels, got {len(labels)}"
        )
    mpl = _matplotlib()
    from matplotlib.figure import Figure

    names = sorted({e.model_name for e in estimates})
    width = max(6.0, 1.6 * len(estimates) + 3.5)
    with mpl.style.context("default"), mpl.rc_context(_RC):
        fig = Figure(figsize=(width, 5.5), layout="constrained")
        ax = fig.add_subplot()
        x = list(range(len(estimates)))
        bottom = [0.0] * len(estimates)
        stacked = [k for k in STACK_ORDER if any(getattr(e.breakdown, k) for e in estimates)]
        bars: list[Any] = []
        lines: list[Any] = []
        for key in stacked:
            values = [getattr(e.breakdown, key) / GiB for e in estimates]
            bars.append(
                ax.bar(
                    x,
                    values,
                    bottom=bottom,
                    color=CATEGORY_COLORS[key],
                    label=CATEGORY_LABELS[key],
                    width=0.6,
                    zorder=2,
                )
            )
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for xi, e, height in zip(x, estimates, bottom, strict=True):
            ax.annotate(
                f"{e.breakdown.device_total_bytes / GiB:.2f}",
                (xi, height),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
        top = max(bottom)
        capacities = {(e.gpu_name, e.gpu_capacity_bytes) for e in estimates if e.gpu_capacity_bytes}
        for name, cap in sorted(capacities, key=lambda t: t[1] or 0):
            assert cap is not None
            lines.append(
                ax.axhline(
                    cap / GiB,
                    color="#b00020",
                    ls="--",
                    lw=1.2,
                    zorder=3,
                    label=f"{name} usable capacity ({cap / GiB:.1f} GiB)",
                )
            )
            top = max(top, cap / GiB)
        ax.set_ylim(0, top * 1.12 if top else 1.0)
        ax.set_xticks(x, [_wrap_label(t) for t in labels], fontsize=9)
        ax.set_ylabel("memory at the peak (GiB = 2^30 bytes)")
        ax.set_title(
            title
            or f"{', '.join(names)}: peak memory of one training step (bar top: device total)",
            fontsize=10,
        )
        ax.grid(axis="y", color="#dddddd", lw=0.6, zorder=1)
        ax.set_axisbelow(True)
        _legend(ax, bars, lines)
        _save(fig, path, fmt, dpi)
