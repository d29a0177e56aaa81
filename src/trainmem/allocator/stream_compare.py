"""Compare a real snapshot's allocation stream with a predicted one (a Timeline).

Helpers for ``trainmem compare-snapshot`` and the traced-step validation: the real stream as
records with a step phase and a source line read off the recorded stacks
(:func:`real_allocations`), per-phase totals of either stream (:func:`phase_summary`,
:func:`timeline_phase_summary`), and where two streams first differ
(:func:`first_divergence`, :func:`align_sizes`).

Note [Phases from recorded stacks]
    A snapshot has no phases, but its frames tell them: allocations made on the autograd
    engine's device thread (``torch::autograd::Engine::thread_main`` / ``evaluate_function``)
    are the backward; allocations under a Python ``step`` of an optimizer file
    (``torch/optim/*.py`` or any ``*optim*.py``) the optimizer step; under ``zero_grad`` the
    zero_grad; anything else with frames the forward (which includes the loss). An entry without
    frames in a trace whose other entries have them was made on a thread without Python and
    without a C++ stack (Windows records Python frames only): the autograd engine's, so the
    backward. Without any frames (``_record_memory_history(stacks=None)``) the phase is
    ``"unknown"``.

Source: spec ../shared/specs/cuda-caching-allocator.md section 6.5 (trace entries, frames);
torch/csrc/autograd/engine.cpp (``Engine::thread_main``); torch/optim/optimizer.py.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainmem.allocator.caching import round_size_default
from trainmem.allocator.replay import replay_timeline
from trainmem.allocator.snapshot import read_snapshot, snapshot_stats, timeline_from_snapshot
from trainmem.errors import TrainmemError
from trainmem.timeline import Timeline


@dataclass(frozen=True, slots=True)
class RealAllocation:
    """One ``alloc`` entry of a real trace.

    Attributes:
        index: position of the entry in the device's trace.
        size_bytes: requested bytes.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"``, ``"zero_grad"`` or ``"unknown"``
            (Note [Phases from recorded stacks]).
        source: innermost Python frame outside torch (``"model.py:54 forward"``), or "".
    """

    index: int
    size_bytes: int
    phase: str
    source: str


def _frames(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return []
    return [f for f in frames if isinstance(f, Mapping)]


def phase_of(frames: Sequence[Mapping[str, Any]], *, trace_has_frames: bool = False) -> str:
    """The step phase of an allocation from its stack (Note [Phases from recorded stacks]).

    Args:
        frames: the entry's recorded stack.
        trace_has_frames: other entries of the trace have frames.
    """
    if not frames:
        return "backward" if trace_has_frames else "unknown"
    for f in frames:
        name = str(f.get("name", ""))
        if "autograd::Engine::" in name:
            return "backward"
    for f in frames:
        name = str(f.get("name", ""))
        filename = str(f.get("filename", ""))
        if name == "zero_grad":
            return "zero_grad"
        if name == "step" and ("optim" in filename.rsplit("/", 1)[-1] or "/optim/" in filename):
            return "optimizer"
    return "forward"


def source_of(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost Python frame outside torch and site-packages, as ``file:line name``."""
    for f in frames:
        filename = str(f.get("filename", ""))
        posix = filename.replace("\\", "/")
        if not posix.endswith(".py") or "site-packages" in posix or "/torch/" in posix:
            continue
        base = filename.replace("\\", "/").rsplit("/", 1)[-1]
        return f"{base}:{f.get('line', 0)} {f.get('name', '')}"
    return ""


def real_allocations(entries: Iterable[Mapping[str, Any]]) -> list[RealAllocation]:
    """The ``alloc`` entries of one device's trace, with phase and source.

    Args:
        entries: ``snapshot["device_traces"][device]`` of a validated snapshot.

    Returns:
        One record per ``alloc`` entry, in trace order.
    """
    entries = list(entries)
    has = any(_frames(e) for e in entries)
    out: list[RealAllocation] = []
    for i, e in enumerate(entries):
        if e.get("action") == "alloc":
            frames = _frames(e)
            phase = phase_of(frames, trace_has_frames=has)
            out.append(RealAllocation(i, int(e["size"]), phase, source_of(frames)))
    return out


def phase_summary(entries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per phase of a real trace: allocations, bytes allocated and the live-bytes peak.

    Args:
        entries: one device's trace entries.

    Returns:
        ``{phase: {"num_allocs", "allocated_bytes", "peak_live_delta_bytes"}}`` in order of first
        appearance; bytes are 512-rounded requests; ``peak_live_delta_bytes`` is the highest live
        bytes reached inside the phase relative to the live bytes at the trace's start (the
        blocks live before the recording are unknown to the trace, a constant offset).
    """
    out: dict[str, dict[str, int]] = {}
    has = any(_frames(e) for e in entries)
    live = 0
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            phase = phase_of(_frames(e), trace_has_frames=has)
            size = round_size_default(int(e["size"]))
            row = out.setdefault(
                phase, {"num_allocs": 0, "allocated_bytes": 0, "peak_live_delta_bytes": live}
            )
            row["num_allocs"] += 1
            row["allocated_bytes"] += size
            live += size
            row["peak_live_delta_bytes"] = max(row["peak_live_delta_bytes"], live)
        elif action == "free_completed":
            live -= round_size_default(int(e["size"]))
    return out


def timeline_phase_summary(timeline: Timeline) -> dict[str, dict[str, int]]:
    """:func:`phase_summary` of a predicted Timeline (its events carry their phase).

    Returns:
        The same keys; ``peak_live_delta_bytes`` relative to the live bytes at the timeline's
        start.
    """
    out: dict[str, dict[str, int]] = {}
    live = 0
    for ev in timeline.events:
        size = round_size_default(ev.size_bytes)
        if ev.action == "alloc":
            row = out.setdefault(
                ev.phase, {"num_allocs": 0, "allocated_bytes": 0, "peak_live_delta_bytes": live}
            )
            row["num_allocs"] += 1
            row["allocated_bytes"] += size
            live += size
            row["peak_live_delta_bytes"] = max(row["peak_live_delta_bytes"], live)
        else:
            live -= size
    return out


def first_divergence(real: Sequence[int], predicted: Sequence[int]) -> dict[str, Any] | None:
    """The first position where two allocation-size streams differ after 512-byte rounding.

    Args:
        real: requested sizes of the real ``alloc`` entries, in order.
        predicted: requested sizes of the predicted allocations, in order.

    Returns:
        None if the rounded streams are equal, else ``{"index", "real_bytes",
        "predicted_bytes"}`` (a missing side is None).
    """
    for i in range(max(len(real), len(predicted))):
        a = round_size_default(real[i]) if i < len(real) else None
        b = round_size_default(predicted[i]) if i < len(predicted) else None
        if a != b:
            return {
                "index": i,
                "real_bytes": real[i] if i < len(real) else None,
                "predicted_bytes": predicted[i] if i < len(predicted) else None,
            }
    return None


def align_sizes(real: Sequence[int], predicted: Sequence[int]) -> dict[str, Any]:
    """Align two allocation-size streams (difflib's longest matching blocks on rounded sizes).

    Args:
        real: requested sizes of the real allocations, in order.
        predicted: requested sizes of the predicted allocations, in order.

    Returns:
        ``{"matched", "real_only", "predicted_only", "ratio", "differences"}``: allocations
        paired with an equal-size one, counts on each side left unpaired, difflib's similarity
        ratio, and up to 20 differing stretches as ``{"real": [start, end], "predicted":
        [start, end], "real_bytes", "predicted_bytes"}`` (index ranges and their rounded sums).
    """
    a = [round_size_default(x) for x in real]
    b = [round_size_default(x) for x in predicted]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    diffs: list[dict[str, Any]] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or len(diffs) >= 20:
            continue
        diffs.append(
            {
                "real": [i1, i2],
                "predicted": [j1, j2],
                "real_bytes": sum(a[i1:i2]),
                "predicted_bytes": sum(b[j1:j2]),
            }
        )
    return {
        "matched": matched,
        "real_only": len(a) - matched,
        "predicted_only": len(b) - matched,
        "ratio": matcher.ratio(),
        "differences": diffs,
    }


def compare_snapshot(
    path: str | os.PathLike[str],
    prediction: Any,
    *,
    timeline: Timeline | None = None,
    device: int = 0,
    replay: bool = True,
) -> dict[str, Any]:
    """Compare a real snapshot with a prediction: peaks, per phase, and the first point where
    the real and predicted allocation streams differ.

    Args:
        path: snapshot file recorded with ``torch.cuda.memory._dump_snapshot``.
        prediction: a :class:`~trainmem.allocator.replay.ReplayResult` or a mapping with
            ``max_memory_allocated`` and ``max_memory_reserved`` (bytes).
        timeline: the predicted step's events (``MemoryEstimate.timeline``) for the per-phase
            and stream comparison; None compares the peaks only.
        device: device ordinal in the snapshot.
        replay: also replay the snapshot's own trace through the simulator, with the snapshot's
            ``PYTORCH_CUDA_ALLOC_CONF``, to separate allocator error from timeline error.

    Returns:
        ``{"measured": snapshot_stats(...), "predicted": {"max_memory_allocated": ...,
        "max_memory_reserved": ...}, "reserved_error_bytes": predicted - measured peak reserved,
        "reserved_relative_error": that / measured (None if measured is 0),
        "allocated_error_bytes": predicted allocated - measured rounded requested peak,
        "replayed": {"max_memory_allocated", "max_memory_reserved", "alloc_conf"} (or
        {"error", "alloc_conf"} if the trace cannot be replayed) or None,
        "phases": {"real": phase_summary(...), "predicted": timeline_phase_summary(...)},
        "first_divergence": first_divergence(real, predicted sizes), "alignment":
        align_sizes(...)}`` (the last three only with ``timeline``; the predicted stream is the
        steady-state step's allocations).

    Raises:
        SnapshotError: unsafe file or not a snapshot.
        OSError: the file cannot be read.
    """
    snapshot = read_snapshot(path)
    measured = snapshot_stats(snapshot, device)
    if isinstance(prediction, Mapping):
        pred_alloc = int(prediction["max_memory_allocated"])
        pred_res = int(prediction["max_memory_reserved"])
    else:
        pred_alloc = int(prediction.max_memory_allocated)
        pred_res = int(prediction.max_memory_reserved)
    res_err = pred_res - measured["peak_reserved_bytes"]
    replayed: dict[str, Any] | None = None
    if replay:
        settings = snapshot.get("allocator_settings") or {}
        conf = str(settings.get("PYTORCH_CUDA_ALLOC_CONF", "") or "")
        try:
            r = replay_timeline(
                timeline_from_snapshot(snapshot, device), capacity_bytes=None, alloc_conf=conf
            )
        except (TrainmemError, ValueError) as err:  # an option we do not model, a torn trace
            replayed = {"error": f"{type(err).__name__}: {err}", "alloc_conf": conf}
        else:
            replayed = {
                "max_memory_allocated": r.max_memory_allocated,
                "max_memory_reserved": r.max_memory_reserved,
                "alloc_conf": conf,
            }
    streams: dict[str, Any] = {}
    if timeline is not None:
        traces = snapshot.get("device_traces") or []
        entries = list(traces[device]) if device < len(traces) else []
        real = [int(e["size"]) for e in entries if e.get("action") == "alloc"]
        steady = timeline.events[max(timeline.steady_state_start, 0) :]
        predicted = [ev.size_bytes for ev in steady if ev.action == "alloc"]
        streams = {
            "phases": {
                "real": phase_summary(entries),
                "predicted": timeline_phase_summary(timeline),
            },
            "first_divergence": first_divergence(real, predicted),
            "alignment": align_sizes(real, predicted),
        }
    return {
        **streams,
        "measured": measured,
        "predicted": {"max_memory_allocated": pred_alloc, "max_memory_reserved": pred_res},
        "reserved_error_bytes": res_err,
        "reserved_relative_error": (
            res_err / measured["peak_reserved_bytes"] if measured["peak_reserved_bytes"] else None
        ),
        "allocated_error_bytes": pred_alloc - measured["peak_requested_rounded_bytes"],
        "replayed": replayed,
    }
