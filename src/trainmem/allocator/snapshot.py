"""PyTorch memory snapshots: write a simulated run as one, read a real one safely, compare.

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns and
``torch.cuda.memory._dump_snapshot(path)`` pickles: ``segments`` (the allocator state at the end,
each segment with its blocks) and ``device_traces`` (one list of trace entries per device:
``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``,
``segment_map``, ``segment_unmap``, ``oom``), plus ``allocator_settings``. The files written here
open in pytorch.org/memory_viz and in ``python -m torch.cuda._memory_viz``.

Note [Snapshot constraints]
    From torch/utils/viz/MemoryViz.js (spec section 6.7): pickle protocol 2-4 with only dict,
    list, tuple, str, int, float, bool and None; "Allocator State History" replays the trace
    *backwards* from ``segments``, so the final state must be the one the trace leads to; blocks
    tile their segment and their address is the segment address plus the earlier block sizes;
    when any entry has a ``category``, one of them must be ``"unknown"`` (a typo in the viewer
    otherwise throws). Trace ``size`` is the requested size for alloc/free entries and the segment
    size for segment entries.

Note [Reading untrusted snapshots]
    A snapshot file may come from anyone, and unpickling can run arbitrary code through
    ``find_class`` (any importable callable) and ``persistent_load``. :func:`read_snapshot` uses an
    unpickler that refuses both, so only the opcodes that build plain containers, numbers,
    strings, bytes, booleans and None can succeed.

Source: ../shared/specs/cuda-caching-allocator.md section 6; torch/cuda/memory.py ``_snapshot``
and ``_dump_snapshot``; torch/csrc/cuda/Module.cpp (the dict builder); torch/cuda/_memory_viz.py;
torch/utils/viz/MemoryViz.js (``annotate_snapshot``, ``MemoryView``, ``process_alloc_data``).

Known limitations:
    - the measured ``max_memory_allocated`` cannot be read from a snapshot: trace entries carry the
      requested size, not the block size. :func:`snapshot_stats` reports the requested-bytes peak
      and its 512-byte-rounded version (a lower bound of ``max_memory_allocated``), the exact peak
      reserved, and the exact final allocated and reserved bytes.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Mapping
from typing import Any

from trainmem.allocator.caching import CachingAllocatorSim, round_size_default
from trainmem.allocator.constants import MAX_SPLIT_SIZE_UNLIMITED
from trainmem.breakdown import MemoryCategory
from trainmem.errors import SnapshotError as SnapshotError
from trainmem.specs.bounds import describe_int
from trainmem.timeline import AllocEvent, Timeline

#: Pickle protocol of ``_dump_snapshot`` (default on Python >= 3.8); MemoryViz rejects 5.
SNAPSHOT_PICKLE_PROTOCOL = 4

_SEGMENT_ACTIONS_UP = ("segment_alloc", "segment_map")
_SEGMENT_ACTIONS_DOWN = ("segment_free", "segment_unmap")


# ---------------------------------------------------------------------------------------- write


def snapshot_of(sim: CachingAllocatorSim) -> dict[str, Any]:
    """The simulator's state and history as ``torch.cuda.memory._snapshot()`` would return them.

    Args:
        sim: a simulator, normally built with ``record_history=True`` (otherwise
            ``device_traces`` holds an empty list and only the final state is exported).

    Returns:
        ``{"segments": [...], "device_traces": [[...]] * (device + 1), "allocator_settings": {...},
        "external_annotations": []}`` built from plain builtins only. See
        Note [Snapshot constraints].

    Source: torch/csrc/cuda/Module.cpp ``_cuda_memorySnapshot``; spec section 6.2-6.5.
    """
    pending = {id(b) for b in sim.pending_blocks()}
    segments: list[dict[str, Any]] = []
    for seg_blocks in sim.segments():
        first = seg_blocks[0]
        blocks: list[dict[str, Any]] = []
        allocated = active = requested = 0
        for b in seg_blocks:
            if b.allocated:
                state = "active_allocated"
                allocated += b.size
            elif id(b) in pending:
                state = "active_pending_free"
            else:
                state = "inactive"
            if state != "inactive":
                active += b.size
                requested += b.requested_size
            blocks.append(
                {
                    "address": b.ptr,
                    "size": b.size,
                    "requested_size": b.requested_size if state != "inactive" else 0,
                    "state": state,
                    "frames": list(b.frames or []) if state != "inactive" else [],
                }
            )
        segments.append(
            {
                "device": sim.device,
                "address": first.ptr,
                "total_size": sum(b.size for b in seg_blocks),
                "allocated_size": allocated,
                "active_size": active,
                "requested_size": requested,
                "stream": first.stream,
                "segment_type": "small" if first.pool.is_small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": first.expandable is not None,
                "frames": [],
                "blocks": blocks,
            }
        )
    traces: list[list[dict[str, Any]]] = [[] for _ in range(sim.device + 1)]
    traces[sim.device] = [dict(e) for e in (sim.trace or [])]
    cfg = sim.config
    max_split = cfg.max_split_size_bytes
    settings = {
        "PYTORCH_CUDA_ALLOC_CONF": cfg.alloc_conf,
        "max_split_size": -1 if max_split == MAX_SPLIT_SIZE_UNLIMITED else max_split,
        "garbage_collection_threshold": cfg.garbage_collection_threshold,
        "expandable_segments": cfg.expandable_segments,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": cfg.roundup_power2_divisions_dict(),
    }
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": settings,
        "external_annotations": [],
    }


def write_snapshot(path: str | os.PathLike[str], snapshot: Mapping[str, Any]) -> None:
    """Pickle a snapshot dict as ``torch.cuda.memory._dump_snapshot`` does (protocol 4).

    Args:
        path: output file, conventionally ``*.pickle``.
        snapshot: from :func:`snapshot_of` or ``ReplayResult.snapshot``.

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "wb") as f:
        pickle.dump(dict(snapshot), f, protocol=SNAPSHOT_PICKLE_PROTOCOL)


# ----------------------------------------------------------------------------------------- read


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickler that builds only plain data. See Note [Reading untrusted snapshots]."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"refusing to load {module}.{name}: a memory snapshot holds only dicts, lists, "
            "tuples, strings and numbers, and this file asks to build other objects"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("refusing to load a persistent id: not a memory snapshot")


def loads_snapshot(data: bytes) -> dict[str, Any]:
    """Unpickle snapshot bytes with the restricted unpickler and check the top-level shape.

    Args:
        data: the pickle bytes.

    Returns:
        The snapshot dict; a 1.13-era bare list of segments is wrapped as
        ``{"segments": [...], "device_traces": []}``.

    Raises:
        SnapshotError: the pickle asks for any class or callable, is corrupt, or is not a
            snapshot (no ``segments`` list).
    """
    try:
        obj = _PlainDataUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as err:  # corrupt or truncated pickles raise many types
        raise SnapshotError(f"not a readable pickle: {type(err).__name__}: {err}") from None
    if isinstance(obj, list):
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise SnapshotError(
            "not a memory snapshot: expected a dict with a 'segments' list, as written by "
            "torch.cuda.memory._dump_snapshot"
        )
    obj.setdefault("device_traces", [])
    validate_snapshot(obj)
    return obj


#: Largest snapshot file read (bytes, 2 GiB = 2^31): a guard against endless device files.
MAX_SNAPSHOT_BYTES = 2**31
#: Largest value an address, size or stream may take (C++ int64 / uintptr_t limits).
_MAX_INT = 2**64 - 1
#: Trace actions whose entries name a block or segment by ``addr`` with a byte ``size``.
_ADDRESSED_ACTIONS = frozenset(
    {
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
    }
)


def _check_int(value: Any, field: str, *, lo: int = 0, hi: int = _MAX_INT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        # no repr of a container: one nested 200,000 deep overflows repr's recursion
        shown = repr(value)[:40] if isinstance(value, str | float | bool | None) else None
        raise SnapshotError(
            f"snapshot field {field}: expected an integer, got {shown or type(value).__name__}"
        )
    if not lo <= value <= hi:
        raise SnapshotError(
            f"snapshot field {field}: {describe_int(value)} is outside [{lo}, {hi}]"
        )


def _check_unique(obj: object, seen: set[int], field: str) -> None:
    # A pickle can reference one object many times (memo); a real snapshot never does for
    # these containers, and walking shared ones multiplies the work (a "memo bomb").
    if id(obj) in seen:
        raise SnapshotError(
            f"snapshot field {field}: the same object appears more than once (a shared "
            "reference, not a memory snapshot)"
        )
    seen.add(id(obj))


def validate_snapshot(snapshot: Mapping[str, Any]) -> None:
    """Check the structure every reader in trainmem relies on; the one place it is checked.

    Checked: ``segments`` is a list of dicts whose ``address`` and ``total_size`` are integers
    (``device``, ``stream`` too when present) and whose ``blocks`` is a list of dicts with integer
    ``size`` (and ``requested_size``, ``address`` when present) and a string ``state``;
    ``device_traces`` is a list of lists of dicts with a string ``action``, integer ``addr`` and
    ``size`` for the alloc/free/segment actions, integer ``size`` for ``oom``;
    ``allocator_settings`` is a dict when present. Floats (inf, NaN), strings and bools are
    refused where an integer belongs; no container may be shared between two places (a
    memo-bomb pickle).

    Args:
        snapshot: an unpickled snapshot dict.

    Raises:
        SnapshotError: naming the first bad field, e.g. ``segments[3].total_size``.
    """
    seen: set[int] = set()
    segments = snapshot.get("segments")
    if not isinstance(segments, list):
        raise SnapshotError("snapshot field segments: expected a list of segment dicts")
    _check_unique(segments, seen, "segments")
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise SnapshotError(
                f"snapshot field {where}: expected a dict, got {type(seg).__name__}"
            )
        _check_unique(seg, seen, where)
        for key in ("address", "total_size"):
            if key not in seg:
                raise SnapshotError(f"snapshot field {where}.{key}: missing")
            _check_int(seg[key], f"{where}.{key}")
        if "device" in seg:
            _check_int(seg["device"], f"{where}.device", hi=2**15)
        if "stream" in seg:
            _check_int(seg["stream"], f"{where}.stream", lo=-(2**63))
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            raise SnapshotError(
                f"snapshot field {where}.blocks: expected a list, got {type(blocks).__name__}"
            )
        _check_unique(blocks, seen, f"{where}.blocks")
        for j, block in enumerate(blocks):
            bwhere = f"{where}.blocks[{j}]"
            if not isinstance(block, dict):
                raise SnapshotError(
                    f"snapshot field {bwhere}: expected a dict, got {type(block).__name__}"
                )
            _check_unique(block, seen, bwhere)
            if "size" not in block:
                raise SnapshotError(f"snapshot field {bwhere}.size: missing")
            _check_int(block["size"], f"{bwhere}.size")
            for key in ("requested_size", "address"):
                if key in block:
                    _check_int(block[key], f"{bwhere}.{key}")
            if not isinstance(block.get("state", ""), str):
                raise SnapshotError(f"snapshot field {bwhere}.state: expected a string")
    traces = snapshot.get("device_traces", [])
    if not isinstance(traces, list):
        raise SnapshotError("snapshot field device_traces: expected a list (one list per device)")
    _check_unique(traces, seen, "device_traces")
    for d, entries in enumerate(traces):
        dwhere = f"device_traces[{d}]"
        if not isinstance(entries, list):
            raise SnapshotError(
                f"snapshot field {dwhere}: expected a list, got {type(entries).__name__}"
            )
        _check_unique(entries, seen, dwhere)
        for k, entry in enumerate(entries):
            ewhere = f"{dwhere}[{k}]"
            if not isinstance(entry, dict):
                raise SnapshotError(
                    f"snapshot field {ewhere}: expected a dict, got {type(entry).__name__}"
                )
            _check_unique(entry, seen, ewhere)
            action = entry.get("action")
            if not isinstance(action, str):
                raise SnapshotError(f"snapshot field {ewhere}.action: expected a string")
            if action in _ADDRESSED_ACTIONS:
                for key in ("addr", "size"):
                    if key not in entry:
                        raise SnapshotError(f"snapshot field {ewhere}.{key}: missing ({action})")
                    _check_int(entry[key], f"{ewhere}.{key}")
            elif "size" in entry:  # oom, snapshot, user_defined and actions to come
                _check_int(entry["size"], f"{ewhere}.size")
            if action == "oom":
                if "device_free" in entry:
                    _check_int(entry["device_free"], f"{ewhere}.device_free")
            if "stream" in entry:
                _check_int(entry["stream"], f"{ewhere}.stream", lo=-(2**63))
    settings = snapshot.get("allocator_settings")
    if settings is not None and not isinstance(settings, dict):
        raise SnapshotError(
            f"snapshot field allocator_settings: expected a dict, got {type(settings).__name__}"
        )
    if isinstance(settings, dict):
        conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
        if conf is not None and not isinstance(conf, str):
            raise SnapshotError(
                "snapshot field allocator_settings.PYTORCH_CUDA_ALLOC_CONF: expected a string"
            )


def read_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a snapshot file safely (see :func:`loads_snapshot`).

    Args:
        path: a file written by ``torch.cuda.memory._dump_snapshot`` or :func:`write_snapshot`.

    Returns:
        The snapshot dict.

    Raises:
        SnapshotError: unsafe or not a snapshot.
        OSError: the file cannot be read.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, a device never end
        raise SnapshotError(f"{os.fspath(path)!s}: not a regular file (a snapshot is a file)")
    with open(path, "rb") as f:
        data = f.read(MAX_SNAPSHOT_BYTES + 1)
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"{os.fspath(path)!s}: larger than {MAX_SNAPSHOT_BYTES} bytes")
    return loads_snapshot(data)


# -------------------------------------------------------------------------------------- analyse


def snapshot_stats(snapshot: Mapping[str, Any], device: int = 0) -> dict[str, int]:
    """Measured numbers of one device of a snapshot, the trace replayed from its start.

    The state before the first trace entry is rebuilt backwards from the final ``segments``
    (a ring buffer may have dropped the beginning of the run, spec section 6.6).

    Args:
        snapshot: a snapshot dict.
        device: device ordinal.

    Returns:
        Bytes: ``peak_reserved_bytes`` (exact: running sum of segment_alloc/map minus
        segment_free/unmap), ``peak_requested_bytes`` (live requested bytes, what MemoryViz's
        "Active Memory Timeline" plots), ``peak_requested_rounded_bytes`` (the same rounded to
        512 B per allocation, a lower bound of ``max_memory_allocated``), ``final_reserved_bytes``,
        ``final_allocated_bytes`` (block sizes of active_allocated blocks), and counts
        ``num_trace_entries``, ``num_segments``, ``num_ooms``.
    """
    segs = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    final_reserved = sum(int(s["total_size"]) for s in segs)
    final_allocated = final_requested = final_rounded = 0
    for s in segs:
        for b in s.get("blocks", []):
            if b.get("state") == "active_allocated":
                final_allocated += int(b["size"])
            if b.get("state") in ("active_allocated", "active_pending_free"):
                req = int(b.get("requested_size", b["size"]))
                final_requested += req
                final_rounded += round_size_default(req)
    traces = snapshot.get("device_traces", [])
    entries: list[dict[str, Any]] = traces[device] if device < len(traces) else []
    # One pass of running deltas from the (unknown) start; the start is the final state minus the
    # total delta, and each peak is the start plus the highest running delta (at least 0).
    res = req = rnd = 0
    top_res = top_req = top_rnd = 0
    num_ooms = 0
    for e in entries:
        action, size = e.get("action"), int(e.get("size", 0))
        if action in _SEGMENT_ACTIONS_UP:
            res += size
            top_res = max(top_res, res)
        elif action in _SEGMENT_ACTIONS_DOWN:
            res -= size
        elif action == "alloc":
            req += size
            rnd += round_size_default(size)
            top_req, top_rnd = max(top_req, req), max(top_rnd, rnd)
        elif action == "free_completed":
            req -= size
            rnd -= round_size_default(size)
        elif action == "oom":
            num_ooms += 1
    peak_res = final_reserved - res + top_res
    peak_req = final_requested - req + top_req
    peak_round = final_rounded - rnd + top_rnd
    return {
        "peak_reserved_bytes": peak_res,
        "peak_requested_bytes": peak_req,
        "peak_requested_rounded_bytes": peak_round,
        "final_reserved_bytes": final_reserved,
        "final_allocated_bytes": final_allocated,
        "num_trace_entries": len(entries),
        "num_segments": len(segs),
        "num_ooms": num_ooms,
    }


def _category(value: Any) -> MemoryCategory:
    try:
        return MemoryCategory(value)
    except ValueError:
        return MemoryCategory.TEMPORARY  # NB: real snapshots carry no trainmem category


def timeline_from_snapshot(snapshot: Mapping[str, Any], device: int = 0) -> Timeline:
    """The allocation stream of a snapshot's trace, to replay through the simulator.

    ``alloc`` entries become allocs and ``free_completed`` entries frees (spec section 6.6).
    Blocks that were live before the trace began (freed in the trace without being allocated
    in it, or active in the final state without an alloc in the trace) become ``"init"``
    allocations at the start, in address order.

    Args:
        snapshot: a snapshot dict.
        device: device ordinal.

    Returns:
        A timeline whose sizes are the requested bytes of the trace. Categories are the entries'
        ``category`` where it is a :class:`MemoryCategory` value, else TEMPORARY.
    """
    traces = snapshot.get("device_traces", [])
    entries: list[dict[str, Any]] = traces[device] if device < len(traces) else []
    body: list[AllocEvent] = []
    live: dict[int, tuple[int, int, MemoryCategory, int]] = {}  # addr -> id, size, cat, stream
    pre_existing: dict[int, tuple[int, int, MemoryCategory, int]] = {}
    next_id = 0
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            next_id += 1
            info = (next_id, int(e["size"]), _category(e.get("category")), int(e.get("stream", 0)))
            live[int(e["addr"])] = info
            body.append(AllocEvent("alloc", info[0], info[1], info[2], "forward", "", info[3]))
        elif action == "free_completed":
            addr = int(e["addr"])
            info_or_none = live.pop(addr, None)
            if info_or_none is None:
                next_id += 1
                cat = _category(e.get("category"))
                info_or_none = (next_id, int(e["size"]), cat, int(e.get("stream", 0)))
                pre_existing[addr] = info_or_none
            block_id, size, cat, stream = info_or_none
            body.append(AllocEvent("free", block_id, size, cat, "forward", "", stream))
    allocated_in_trace = set(live)
    for s in snapshot["segments"]:
        if s.get("device", 0) != device:
            continue
        addr = int(s["address"])
        for b in s.get("blocks", []):
            if b.get("state") in ("active_allocated", "active_pending_free") and (
                addr not in allocated_in_trace and addr not in pre_existing
            ):
                next_id += 1
                size = int(b.get("requested_size", b["size"]))
                stream = int(s.get("stream", 0))
                pre_existing[addr] = (next_id, size, MemoryCategory.TEMPORARY, stream)
            addr += int(b["size"])
    init = [
        AllocEvent("alloc", block_id, size, cat, "init", "", stream)
        for _, (block_id, size, cat, stream) in sorted(pre_existing.items())
    ]
    return Timeline(events=init + body, name="snapshot trace")
