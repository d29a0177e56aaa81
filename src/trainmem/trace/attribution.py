"""Turn a recorded step into a Timeline, the breakdown at its peak, and per-module tables.

Pure Python over :class:`~trainmem.trace.recorder.Block` records (no torch calls). Top-level
breakdown folds buffers into parameters and inputs into activations
(``trainmem.breakdown.BREAKDOWN_KEYS``); the detailed per-category dict keeps them apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainmem.breakdown import BREAKDOWN_KEYS, MemoryBreakdown, MemoryCategory, fold_category
from trainmem.timeline import AllocEvent, Timeline, module_group

__all__ = ["PeakReport", "analyse", "module_group"]

_PHASE_OF = {"init": "forward", "zero_grad": "optimizer"}


@dataclass
class PeakReport:
    """The recorded step summarised.

    Attributes:
        timeline: events (init blocks first) with final categories.
        peak_bytes: peak live requested bytes.
        peak_index: index in ``timeline.events`` of the event that set the peak.
        by_category_bytes: live bytes per :class:`MemoryCategory` value at the peak.
        breakdown: folded :class:`MemoryBreakdown` at the peak (no fragmentation/context).
        peak_phase: ``forward`` / ``backward`` / ``optimizer``.
        peak_op / peak_module: the op and module whose allocation set the peak.
        phase_peaks_bytes: the highest live bytes seen in each phase.
        activation_bytes_by_module: live activation bytes at the end of the (last) forward,
            per allocating module.
        peak_contributors: [(module, category, bytes)] live at the peak, largest first.
    """

    timeline: Timeline
    peak_bytes: int
    peak_index: int
    by_category_bytes: dict[str, int]
    breakdown: MemoryBreakdown
    peak_phase: str
    peak_op: str
    peak_module: str
    phase_peaks_bytes: dict[str, int]
    activation_bytes_by_module: dict[str, int]
    peak_contributors: list[tuple[str, str, int]]


def analyse(
    raw_events: list[Any], extra_blocks: Sequence[tuple[str, int, MemoryCategory]] = ()
) -> PeakReport:
    """Summarise the recorder's ordered events.

    Args:
        raw_events: ``StorageRecorder.events`` (``RawEvent`` with a final ``block.category``).
        extra_blocks: ``(module, size_bytes, category)`` allocations live for the whole step
            that no tensor represents (the cuBLAS workspace), added as ``init`` events first.

    Returns:
        The :class:`PeakReport`.
    """
    events: list[AllocEvent] = []
    next_id = -1
    for module, size, cat in extra_blocks:
        events.append(AllocEvent("alloc", next_id, size, cat, "init", module))
        next_id -= 1
    for ev in raw_events:
        b = ev.block
        events.append(
            AllocEvent(
                ev.action,
                b.block_id,
                b.size_bytes,
                b.category or MemoryCategory.TEMPORARY,
                ev.phase,
                b.module,
                b.stream,
            )
        )
    live = 0
    peak, peak_at = 0, -1
    phase_peaks: dict[str, int] = defaultdict(int)
    for i, ev in enumerate(events):
        live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
        phase_peaks[ev.phase] = max(phase_peaks[ev.phase], live)
        if live > peak:
            peak, peak_at = live, i
    fixed = events
    timeline = Timeline(events=fixed)

    # Live set at the peak.
    live_blocks: dict[int, AllocEvent] = {}
    for ev in fixed[: peak_at + 1]:
        if ev.action == "alloc":
            live_blocks[ev.block_id] = ev
        else:
            live_blocks.pop(ev.block_id, None)
    by_cat: dict[str, int] = {c.value: 0 for c in MemoryCategory}
    folded = {k: 0 for k in BREAKDOWN_KEYS[:5]}  # the tensor categories
    contrib: dict[tuple[str, str], int] = defaultdict(int)
    for ev in live_blocks.values():
        by_cat[ev.category.value] += ev.size_bytes
        folded[fold_category(ev.category)] += ev.size_bytes
        contrib[(module_group(ev.module), ev.category.value)] += ev.size_bytes
    breakdown = MemoryBreakdown(
        parameters=folded["parameters"],
        gradients=folded["gradients"],
        optimizer_states=folded["optimizer_states"],
        activations=folded["activations"],
        temporary=folded["temporary"],
    )
    peak_ev = fixed[peak_at] if peak_at >= 0 else None
    peak_block_op = ""
    if peak_ev is not None and peak_at >= len(extra_blocks):
        peak_block_op = raw_events[peak_at - len(extra_blocks)].block.op
    phase = _PHASE_OF.get(peak_ev.phase, peak_ev.phase) if peak_ev else "forward"

    # Activations live when the last forward pass ends (the largest activation footprint).
    acts: dict[str, int] = defaultdict(int)
    for b in _blocks_live_at_last_forward_end(raw_events):
        if b.category in (MemoryCategory.ACTIVATION, MemoryCategory.INPUT):
            acts[b.module or "(model)"] += b.size_bytes
    contributors = sorted(((m, c, n) for (m, c), n in contrib.items()), key=lambda x: -x[2])
    return PeakReport(
        timeline=timeline,
        peak_bytes=peak,
        peak_index=peak_at,
        by_category_bytes=by_cat,
        breakdown=breakdown,
        peak_phase=phase,
        peak_op=peak_block_op,
        peak_module=peak_ev.module if peak_ev else "",
        phase_peaks_bytes=dict(phase_peaks),
        activation_bytes_by_module=dict(sorted(acts.items(), key=lambda kv: -kv[1])),
        peak_contributors=contributors,
    )


def _blocks_live_at_last_forward_end(raw_events: list[Any]) -> list[Any]:
    live: dict[int, Any] = {}
    snapshot: list[Any] = []
    in_forward = False
    for ev in raw_events:
        b = ev.block
        if ev.action == "alloc":
            if ev.phase == "forward":
                in_forward = True
            elif in_forward and ev.phase != "forward":
                snapshot = list(live.values())
                in_forward = False
            live[b.block_id] = b
        else:
            live.pop(b.block_id, None)
    if in_forward:
        snapshot = list(live.values())
    return snapshot
