"""Replay a real memory snapshot's trace through the simulator, from the real starting state.

A snapshot written by ``torch.cuda.memory._dump_snapshot`` records every ``alloc`` /
``free_completed`` of the recorded window and what the real allocator did with CUDA
(``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap`` / ``oom``). Most
recordings start after warm-up steps, so the allocator already held cached segments. This module
rebuilds the allocator state at the first trace entry (Note [Rebuilding the starting state]),
installs it in a :class:`~trainmem.allocator.caching.CachingAllocatorSim`, feeds it the same
requests (Note [What the replay takes from the trace]) and reports the real and simulated peaks,
final segments and retries side by side. It is the allocator's validation against real GPUs
(``benchmarks/snapshot_replay.py``) and the ``trainmem replay-snapshot`` command.

Note [Rebuilding the starting state]
    Segments: the final ``segments`` of the device, minus those ``segment_alloc``-ed in the trace,
    plus those ``segment_free``-d in it (walked backwards, as MemoryViz's "Allocator State
    History" does; spec 6.6). Expandable segments: the final mapped ranges minus the trace's
    ``segment_map`` ranges plus its ``segment_unmap`` ranges, in one virtual range per (stream,
    pool) starting at the lowest mapped address. Live blocks at the start: blocks active at the
    end that the trace never allocated (exact address and block size), and blocks the trace frees
    without having allocated them (exact address and requested size; the block size is
    ``round_size`` of the request, plus the gap to the next live block or the segment end when
    that gap is at most 1 MiB in the large pool, the tail ``should_split`` leaves unsplit). Free
    space between live blocks is one free block per gap: the allocator merges free neighbours.

Note [What the replay takes from the trace]
    Requests only: ``alloc`` (requested size, stream) becomes ``malloc``, ``free_completed`` the
    ``free`` of that block (the moment it really returned to the pool; with ``record_stream``
    that is after ``free_requested``). Every ``segment_*`` decision is the simulator's own, except
    a group of ``segment_free`` entries that cannot come from a failed ``cudaMalloc``: that is a
    ``torch.cuda.empty_cache()`` call, which the program made, and it is replayed as one.
    The C++ frames recorded with the first ``segment_free`` of a group say which it is
    (``NativeCachingAllocator::emptyCache`` or ``DeviceCachingAllocator::malloc``). Without frames,
    a group is the free-and-retry path of ``malloc`` (spec 3.4) when it is directly followed by
    the ``segment_alloc`` of that ``malloc`` and the real reserved bytes plus that segment would
    exceed the real peak reserved (a ``cudaMalloc`` of that size could have failed only then);
    otherwise it is ``empty_cache``. The retry path needs the
    device's capacity: from ``--gpu`` if given, else inferred from the trace as the largest
    value under which the real ``cudaMalloc`` failed where it did (each retry group: real
    reserved + the new segment, minus one byte; each ``oom`` entry: real reserved +
    ``device_free`` of that moment). Without retries or OOMs the capacity is unlimited. An
    ``oom`` entry is replayed as a ``malloc`` of its rounded size that is expected to fail; if the
    simulator serves it, the block is freed again at once.

Note [Learning unsplit tails]
    A block the trace frees without having allocated it has a known address and requested size
    but an unknown block size: ``should_split`` leaves a large-pool remainder of at most 1 MiB
    attached to the block, and the neighbour that made the remainder small may be gone before the
    trace starts. When the replay's first misplaced ``alloc`` lands, in the real trace, at most
    1 MiB past the estimated end of such a block, with nothing allocated in between, the real
    free block began there, so the gap was that block's tail: the replay learns the larger size
    and starts again (at most ``max_refinements`` times, one block each).

Note [Real segment addresses]
    Addresses decide only one thing in the allocator: the tie between equal-sized free blocks
    (lowest address first, spec 2.3). Where the real trace shows the ``segment_alloc`` of the
    ``malloc`` being replayed and the simulator also calls ``cudaMalloc`` for the same size, the
    simulator's segment gets the real address (unless a segment it still holds is in the way);
    otherwise it gets an invented one. Rebuilt starting segments keep their real addresses.

Source: spec ../shared/specs/cuda-caching-allocator.md sections 3.4, 6.5, 6.6;
torch/utils/viz/MemoryViz.js (``annotate_snapshot``: the backward walk);
c10/cuda/CUDACachingAllocator.cpp (``malloc``: ``release_cached_blocks`` then
``alloc_block(params, true)``; ``emptyCache``; ``record_trace`` of ``SEGMENT_FREE``).

Known limitations:
    - a block freed in the trace but allocated before it gets ``round_size`` of its request (the
      real block may hold an unsplit tail the trace cannot show);
    - the capacity inferred from retries is an upper bound of the real one (the simulator fails
      at the same points only if its state matches the real one there);
    - garbage collection (``garbage_collection_threshold``) and CUDA-graph private pools are not
      replayed from the trace (none of the corpus uses them);
    - real ``max_memory_allocated`` is not in a snapshot: the real peak allocated reported is the
      512-byte-rounded requested peak, a lower bound (see :func:`snapshot_stats`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainmem.allocator.caching import CachingAllocatorSim, OutOfMemoryError
from trainmem.allocator.config import AllocatorConfig
from trainmem.allocator.constants import (
    DEFAULT_VIRTUAL_DEVICE_BYTES,
    EXPANDABLE_VIRTUAL_DEN,
    EXPANDABLE_VIRTUAL_NUM,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
)
from trainmem.allocator.snapshot import SnapshotError, snapshot_stats

_UP = ("segment_alloc", "segment_map")
_DOWN = ("segment_free", "segment_unmap")


@dataclass(frozen=True, slots=True)
class StartSegment:
    """One segment as it stood at the first trace entry. Bytes and addresses are ints.

    Attributes:
        address: first byte (of the virtual range for an expandable segment).
        size: bytes (the whole virtual range for an expandable segment).
        stream: owning stream.
        small: small pool (2 MiB segments) or large pool.
        live: ``(address, block_bytes, requested_bytes)`` of the blocks allocated at the start.
        mapped: the mapped ``(address, bytes)`` ranges of an expandable segment, else None.
    """

    address: int
    size: int
    stream: int
    small: bool
    live: tuple[tuple[int, int, int], ...]
    mapped: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class SnapshotReplay:
    """Real versus simulated numbers of one device of a snapshot. Bytes throughout.

    Attributes:
        device: the device replayed.
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` the simulator ran with.
        capacity_bytes: the capacity given to the simulator (None = unlimited).
        capacity_source: ``"gpu"``, ``"trace"`` (inferred, Note [What the replay takes from the
            trace]) or ``"unlimited"``.
        real: ``peak_allocated_bytes`` (512-rounded requested peak, a lower bound),
            ``peak_reserved_bytes``, ``initial_reserved_bytes``, ``final_reserved_bytes``,
            ``num_segments`` and ``segment_sizes`` (final, sorted), ``num_alloc_retries``
            (retry groups and OOMs visible in the trace: a lower bound), ``num_ooms``,
            ``num_empty_cache`` (``empty_cache`` calls found in the trace).
        simulated: the same keys from the simulator (``num_empty_cache`` = calls replayed).
        num_events: trace entries of the device.
        unplaced_blocks: live-at-start blocks that did not fit the rebuilt segments (dropped).
        first_segment_divergence: index of the first trace entry after which the simulator's
            reserved bytes differ from the real ones, or None if they never do.
        first_address_divergence: index of the first ``alloc`` entry the simulator served at
            another address than the real allocator (Note [Real segment addresses]: addresses
            are comparable), or None.
        num_allocs: ``alloc`` entries replayed.
        num_allocs_at_real_address: of those, how many the simulator placed where the real
            allocator did (block for block agreement, the strictest check of the replay).
        notes: what the replay had to approximate, one sentence each.
    """

    device: int
    alloc_conf: str
    capacity_bytes: int | None
    capacity_source: str
    real: dict[str, Any]
    simulated: dict[str, Any]
    num_events: int
    unplaced_blocks: int = 0
    first_segment_divergence: int | None = None
    first_address_divergence: int | None = None
    num_allocs: int = 0
    num_allocs_at_real_address: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def reserved_relative_error(self) -> float | None:
        """(simulated - real) / real peak reserved; None when the real peak is 0."""
        real = self.real["peak_reserved_bytes"]
        return (self.simulated["peak_reserved_bytes"] - real) / real if real else None


def busiest_device(snapshot: Mapping[str, Any]) -> int:
    """The device with the most trace entries (with none: the most segment bytes; else 0)."""
    traces = snapshot.get("device_traces", [])
    if any(traces):
        return max(range(len(traces)), key=lambda d: (len(traces[d]), -d))
    per: dict[int, int] = {}
    for s in snapshot["segments"]:
        per[s.get("device", 0)] = per.get(s.get("device", 0), 0) + s["total_size"]
    return max(per, key=lambda d: (per[d], -d)) if per else 0


def snapshot_alloc_conf(snapshot: Mapping[str, Any]) -> str:
    """The snapshot's own ``PYTORCH_CUDA_ALLOC_CONF`` ('' when absent: older files lack it)."""
    settings = snapshot.get("allocator_settings") or {}
    return str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")


def _entries(snapshot: Mapping[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces", [])
    return traces[device] if device < len(traces) else []


def _subtract(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo))
        if b > hi:
            out.append((hi, b))
    return out


def _add(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*_subtract(ranges, lo, hi), (lo, hi)]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def start_segments(
    snapshot: Mapping[str, Any],
    device: int,
    sim: CachingAllocatorSim,
    *,
    device_total_bytes: int | None = None,
    block_sizes: Mapping[int, int] | None = None,
) -> tuple[list[StartSegment], int]:
    """The segments and live blocks at the first trace entry (Note [Rebuilding the starting state]).

    Args:
        snapshot: a validated snapshot dict (:func:`~trainmem.allocator.snapshot.read_snapshot`).
        device: device ordinal.
        sim: the simulator the state is meant for (its ``round_size`` and large page size).
        device_total_bytes: GPU memory, for the size of an expandable virtual range.
        block_sizes: block sizes (bytes) learnt for blocks the trace frees without having
            allocated them, by address (Note [Learning unsplit tails]); others are estimated.

    Returns:
        ``(segments, unplaced)``: the segments by address and the number of live-at-start
        blocks that fit no rebuilt segment (left out).
    """
    entries = _entries(snapshot, device)
    final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    # Ordinary segments: addr -> (size, stream, small); expandable: (stream, small) -> ranges.
    plain: dict[int, tuple[int, int, bool]] = {}
    exp: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    exp_low: dict[tuple[int, bool], int] = {}
    for s in final:
        small = s.get("segment_type", "large" if s["total_size"] > K_SMALL_BUFFER else "small")
        key = (int(s.get("stream", 0)), small == "small")
        if s.get("is_expandable"):
            exp[key] = _add(exp.get(key, []), s["address"], s["address"] + s["total_size"])
            exp_low[key] = min(exp_low.get(key, s["address"]), s["address"])
        else:
            plain[s["address"]] = (s["total_size"], key[0], key[1])
    for e in reversed(entries):
        action = e["action"]
        if action == "segment_alloc":
            plain.pop(e["addr"], None)
        elif action == "segment_free":
            plain[e["addr"]] = (e["size"], int(e.get("stream", 0)), e["size"] <= K_SMALL_BUFFER)
        elif action in ("segment_map", "segment_unmap"):
            stream = int(e.get("stream", 0))
            # The pool of a mapped range: large pages are 20 MiB; a small-pool range maps 2 MiB
            # pages. Prefer the pool whose virtual range already holds the address.
            key = (stream, e["size"] % sim.config.large_segment_size_bytes != 0)
            for cand in ((stream, False), (stream, True)):
                if any(a <= e["addr"] < b for a, b in exp.get(cand, [])):
                    key = cand
            lo, hi = e["addr"], e["addr"] + e["size"]
            exp_low[key] = min(exp_low.get(key, lo), lo)
            if action == "segment_map":
                exp[key] = _subtract(exp.get(key, []), lo, hi)
            else:
                exp[key] = _add(exp.get(key, []), lo, hi)
    # Live blocks at the start.
    live_now: dict[int, int] = {}
    pre: dict[int, tuple[int, int | None]] = {}  # addr -> (requested, exact block size or None)
    for e in entries:
        action = e["action"]
        if action == "alloc":
            live_now[e["addr"]] = e["size"]
        elif action == "free_completed":
            if live_now.pop(e["addr"], None) is None and e["addr"] not in pre:
                pre[e["addr"]] = (e["size"], None)
    for s in final:
        addr = s["address"]
        for b in s.get("blocks", []):
            state = b.get("state")
            if state in ("active_allocated", "active_pending_free", "active_awaiting_free"):
                if addr not in live_now and addr not in pre:
                    pre[addr] = (int(b.get("requested_size", b["size"])), b["size"])
            addr += b["size"]
    # Containers: (lo, hi, key) of every start segment or mapped range.
    containers: list[tuple[int, int, Any]] = [
        (a, a + size, ("plain", a)) for a, (size, _, _) in plain.items()
    ]
    for key, ranges in exp.items():
        containers += [(a, b, ("exp", key)) for a, b in ranges]
    containers.sort()
    bounds = [c[0] for c in containers]

    placed: dict[Any, list[tuple[int, int, int]]] = {}
    unplaced = 0
    addrs = sorted(pre)
    for n, addr in enumerate(addrs):
        req, exact = pre[addr]
        i = bisect_right(bounds, addr) - 1
        if i < 0 or addr >= containers[i][1]:
            unplaced += 1
            continue
        lo, hi, key = containers[i]
        small = plain[key[1]][2] if key[0] == "plain" else key[1][1]
        if exact is not None:
            size = exact
        elif block_sizes is not None and addr in block_sizes:
            size = block_sizes[addr]
        else:
            size = sim.round_size(req)
            nxt = addrs[n + 1] if n + 1 < len(addrs) and addrs[n + 1] < hi else hi
            gap = nxt - (addr + size)
            if not small and 0 < gap <= K_SMALL_SIZE:
                size += gap
        if addr + size > hi:
            unplaced += 1
            continue
        prev = placed.setdefault(key, [])
        if prev and prev[-1][0] + prev[-1][1] > addr:
            unplaced += 1
            continue
        prev.append((addr, size, req))
    out: list[StartSegment] = []
    for a, (size, stream, small) in plain.items():
        out.append(StartSegment(a, size, stream, small, tuple(placed.get(("plain", a), []))))
    total = device_total_bytes or DEFAULT_VIRTUAL_DEVICE_BYTES
    for key, ranges in exp.items():
        if not ranges:
            continue
        page = K_SMALL_BUFFER if key[1] else sim.config.large_segment_size_bytes
        pages = -(-(total * EXPANDABLE_VIRTUAL_NUM) // (EXPANDABLE_VIRTUAL_DEN * page))
        base = exp_low[key]
        vsize = max(page * pages, -(-(ranges[-1][1] - base) // page) * page)
        # The virtual range cannot reach into the next segment or range of another kind.
        later = [c[0] for c in containers if c[0] > base and c[2] != ("exp", key)]
        later += [exp_low[k] for k in exp if k != key and exp_low[k] > base]
        if later:
            vsize = max(min(vsize, (min(later) - base) // page * page), ranges[-1][1] - base)
        out.append(
            StartSegment(
                base,
                vsize,
                key[0],
                key[1],
                tuple(placed.get(("exp", key), [])),
                tuple((a, b - a) for a, b in ranges),
            )
        )
    out.sort(key=lambda s: s.address)
    return out, unplaced


def _release_caller(entry: Mapping[str, Any]) -> str | None:
    """Who freed a segment, from the C++ frames recorded with it (``context="all"``).

    Returns:
        ``"empty_cache"`` (``NativeCachingAllocator::emptyCache``), ``"malloc"``
        (``DeviceCachingAllocator::malloc``: the free-and-retry path or garbage collection), or
        None when the entry has no frames that say.
    """
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return None
    for f in frames:
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str):
            continue
        if "emptyCache" in name or name == "empty_cache":
            return "empty_cache"
        if "CachingAllocator" in name and "::malloc(" in name:
            return "malloc"
    return None


def _classify_releases(
    entries: list[dict[str, Any]], start_reserved: int, peak_reserved: int
) -> tuple[list[bool], list[int]]:
    """Mark each trace entry that starts an ``empty_cache`` group; collect retry upper bounds.

    Returns:
        ``(empty_cache_at, capacity_bounds)``: per entry, True where an ``empty_cache`` call
        begins; and one capacity upper bound (bytes) per retry group or ``oom`` entry.
    """
    n = len(entries)
    marks = [False] * n
    bounds: list[int] = []
    reserved = start_reserved
    i = 0
    while i < n:
        e = entries[i]
        action = e["action"]
        if action in _DOWN:
            j = i
            before = reserved
            while j < n and entries[j]["action"] in _DOWN:
                reserved -= entries[j]["size"]
                j += 1
            nxt = entries[j] if j < n else None
            caller = _release_caller(e)
            if caller is None:
                retry = (
                    nxt is not None
                    and nxt["action"] in _UP
                    and before + nxt["size"] > peak_reserved
                )
            else:
                retry = caller == "malloc"
            if retry and nxt is not None and nxt["action"] in _UP:
                bounds.append(before + nxt["size"] - 1)
            elif retry or (nxt is not None and nxt["action"] == "oom"):
                pass  # an OOM entry follows and gives the bound
            else:
                marks[i] = True
            i = j
            continue
        if action in _UP:
            reserved += e["size"]
        elif action == "oom" and "device_free" in e:
            bounds.append(reserved + e["device_free"])
        i += 1
    return marks, bounds


def replay_snapshot(
    snapshot: Mapping[str, Any],
    *,
    device: int | None = None,
    alloc_conf: str | None = None,
    capacity_bytes: int | None = None,
    device_total_bytes: int | None = None,
    infer_capacity: bool = True,
    max_refinements: int = 32,
    real_addresses: bool = True,
) -> SnapshotReplay:
    """Replay a real snapshot's trace through the simulator from the rebuilt starting state.

    Args:
        snapshot: a validated snapshot dict (:func:`~trainmem.allocator.snapshot.read_snapshot`).
        device: device ordinal; default :func:`busiest_device`.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the simulator; default the snapshot's own.
        capacity_bytes: bytes the allocator may obtain from CUDA (GPU total minus the CUDA
            context, :func:`trainmem.allocator.device.allocator_capacity_bytes`); default:
            inferred from the trace's retries and OOMs when it has any, else unlimited.
        device_total_bytes: GPU total memory (sizes the expandable virtual range).
        infer_capacity: infer the capacity from the trace when ``capacity_bytes`` is None.
        max_refinements: replays allowed to learn unsplit tails (Note [Learning unsplit tails]);
            0 keeps the estimated sizes.
        real_addresses: give new segments the real addresses (Note [Real segment addresses]);
            False invents them (the simulator's default, for comparison).

    Returns:
        The real and simulated numbers side by side.

    Raises:
        SpecError: ``alloc_conf`` is not a valid ``PYTORCH_CUDA_ALLOC_CONF``.
        UnsupportedError: ``alloc_conf`` selects ``backend:cudaMallocAsync``.
        SnapshotError: the trace contradicts itself (e.g. two live blocks at one address).

    Source: Note [Rebuilding the starting state], Note [What the replay takes from the trace].
    """
    if device is None:
        device = busiest_device(snapshot)
    conf = snapshot_alloc_conf(snapshot) if alloc_conf is None else alloc_conf
    config = AllocatorConfig.from_string(conf)
    learnt: dict[int, int] = {}
    for _ in range(max_refinements):
        outcome = _replay_once(
            snapshot,
            device,
            conf,
            config,
            capacity_bytes,
            device_total_bytes,
            infer_capacity,
            learnt,
            real_addresses,
            learn=True,
        )
        if isinstance(outcome, SnapshotReplay):
            return outcome
        learnt[outcome[0]] = outcome[1]
    result = _replay_once(
        snapshot,
        device,
        conf,
        config,
        capacity_bytes,
        device_total_bytes,
        infer_capacity,
        learnt,
        real_addresses,
    )
    assert isinstance(result, SnapshotReplay)
    return result


def _unsplit_tail(
    entry: Mapping[str, Any],
    sim: CachingAllocatorSim,
    seeded: dict[int, tuple[int, int]],
    placed: int,
) -> tuple[int, int] | None:
    """A larger size for an estimated live-at-start block, learnt from a misplaced ``alloc``.

    See Note [Learning unsplit tails]. ``seeded`` maps the address of each estimated block to
    ``(block_bytes, end of its segment)``; ``placed`` is the simulator's block for ``entry``.
    Returns ``(address, block_bytes)`` or None.
    """
    real = entry["addr"]
    before = [a for a in seeded if a < real <= seeded[a][1]]
    if not before:
        return None
    addr = max(before)
    size, _ = seeded[addr]
    if real - addr <= size or real - addr - size > K_SMALL_SIZE:
        return None
    # Nothing the simulator holds may lie between the block's estimated end and the address.
    for b in sim.all_blocks():
        if addr + size <= b.ptr < real and b.allocated and b.ptr != placed:
            return None
    return addr, real - addr


def _replay_once(
    snapshot: Mapping[str, Any],
    device: int,
    conf: str,
    config: AllocatorConfig,
    capacity_bytes: int | None,
    device_total_bytes: int | None,
    infer_capacity: bool,
    learnt: Mapping[int, int],
    real_addresses: bool,
    *,
    learn: bool = False,
) -> SnapshotReplay | tuple[int, int]:
    """One replay. With ``learn``, stop at the first misplaced alloc if :func:`_unsplit_tail`
    learns a block size there, and return it."""
    entries = _entries(snapshot, device)
    stats = snapshot_stats(snapshot, device)
    sim = CachingAllocatorSim(None, config, device_total_bytes=device_total_bytes, device=device)
    segments, unplaced = start_segments(
        snapshot, device, sim, device_total_bytes=device_total_bytes, block_sizes=learnt
    )
    estimated = _estimated_blocks(snapshot, device)
    seeded = {
        a: (b, seg.address + seg.size) for seg in segments for a, b, _ in seg.live if a in estimated
    }
    handles: dict[int, int] = {}
    start_reserved = 0
    for seg in segments:
        try:
            hs = sim.adopt_segment(
                seg.address,
                seg.size,
                seg.stream,
                small=seg.small,
                live=list(seg.live),
                expandable_mapped=list(seg.mapped) if seg.mapped is not None else None,
            )
        except ValueError as err:
            raise SnapshotError(f"snapshot segment at {seg.address:#x}: {err}") from None
        for (addr, _, _), h in zip(seg.live, hs, strict=True):
            handles[addr] = h
        start_reserved += sum(m[1] for m in seg.mapped) if seg.mapped is not None else seg.size
    empty_cache_at, bounds = _classify_releases(
        entries, start_reserved, stats["peak_reserved_bytes"]
    )
    source = "gpu" if capacity_bytes is not None else "unlimited"
    if capacity_bytes is None and infer_capacity and bounds:
        capacity_bytes = max(min(bounds), stats["peak_reserved_bytes"])
        source = "trace"
    sim.capacity_bytes = capacity_bytes
    if sim.device_total_bytes is None:
        sim.device_total_bytes = capacity_bytes
    notes: list[str] = []
    real_reserved = start_reserved
    divergence: int | None = None
    first_address_divergence: int | None = None
    num_allocs = num_allocs_at_real_address = 0
    sim_ooms_unlifted = 0
    num_empty_cache = 0
    reserved_stat = sim.stats.reserved_bytes[0]
    # Real cudaMalloc addresses of the current malloc (See Note [Real segment addresses]).
    pending_segments: list[tuple[int, int]] = []

    def real_address(size: int) -> int | None:
        for k, (seg_size, addr) in enumerate(pending_segments):
            # A new expandable virtual range starts where its first pages get mapped.
            if seg_size == size or (seg_size < 0 and -seg_size < size):
                del pending_segments[k]
                return addr
        return None

    if real_addresses:
        sim.address_hint = real_address
    for i, e in enumerate(entries):
        action = e["action"]
        if action == "segment_alloc":
            pending_segments.append((e["size"], e["addr"]))
        elif action == "segment_map":
            pending_segments.append((-e["size"], e["addr"]))
        elif action not in _UP and action not in _DOWN:
            if action != "alloc" and action != "oom":
                pending_segments.clear()
        if empty_cache_at[i]:
            sim.empty_cache()
            num_empty_cache += 1
        if action == "alloc":
            stream = int(e.get("stream", 0))
            try:
                h = sim.malloc(e["size"], stream)
            except OutOfMemoryError:
                sim_ooms_unlifted += 1
                sim.capacity_bytes = None  # the real run went on: so does the replay
                h = sim.malloc(e["size"], stream)
                sim.capacity_bytes = capacity_bytes
            if e["addr"] in handles:
                raise SnapshotError(
                    f"snapshot field device_traces[{device}][{i}].addr: {e['addr']:#x} is "
                    "allocated while a block there is live"
                )
            handles[e["addr"]] = h
            num_allocs += 1
            num_allocs_at_real_address += h == e["addr"]
            if first_address_divergence is None and h != e["addr"]:
                first_address_divergence = i
                tail = _unsplit_tail(e, sim, seeded, h) if learn else None
                if tail is not None and tail[0] not in learnt:
                    return tail
        elif action == "free_completed":
            sim.free(handles.pop(e["addr"], 0))  # 0: a block the trace never showed
        elif action == "oom" and capacity_bytes is not None:
            try:
                h = sim.malloc(max(int(e.get("size", 0)), 1), int(e.get("stream", 0)))
            except OutOfMemoryError:
                pass
            else:
                sim.free(h)
                notes.append(f"entry {i}: the real allocator ran out of memory, the simulator not")
        if action in ("alloc", "oom"):
            pending_segments.clear()
        if action in _UP:
            real_reserved += e["size"]
        elif action in _DOWN:
            real_reserved -= e["size"]
        # Segment entries come before the alloc of their malloc: compare at the other entries.
        if divergence is None and action not in _UP and action not in _DOWN:
            if reserved_stat.current != real_reserved:
                divergence = i
    if unplaced:
        notes.append(f"{unplaced} block(s) live at the start fit no rebuilt segment (left out)")
    if sim_ooms_unlifted:
        notes.append(
            f"{sim_ooms_unlifted} request(s) the real GPU served ran out of memory in the "
            "simulator (capacity lifted for them)"
        )
    final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    real_retries = len(bounds)
    sim_stats = sim.memory_stats()
    sim_segments = sim.segments()
    real = {
        "peak_allocated_bytes": stats["peak_requested_rounded_bytes"],
        "peak_reserved_bytes": stats["peak_reserved_bytes"],
        "initial_reserved_bytes": start_reserved,
        "final_reserved_bytes": stats["final_reserved_bytes"],
        "num_segments": len(final),
        "segment_sizes": sorted(s["total_size"] for s in final),
        "num_alloc_retries": real_retries,
        "num_ooms": stats["num_ooms"],
        "num_empty_cache": sum(empty_cache_at),
    }
    simulated = {
        "peak_allocated_bytes": sim.max_memory_allocated,
        "peak_reserved_bytes": sim.max_memory_reserved,
        "initial_reserved_bytes": start_reserved,
        "final_reserved_bytes": sim.memory_reserved,
        "num_segments": len(sim_segments),
        "segment_sizes": sorted(sum(b.size for b in seg) for seg in sim_segments),
        "num_alloc_retries": sim_stats["num_alloc_retries"],
        "num_ooms": sim_stats["num_ooms"],
        "num_empty_cache": num_empty_cache,
    }
    replay = SnapshotReplay(
        device=device,
        alloc_conf=conf,
        capacity_bytes=capacity_bytes,
        capacity_source=source,
        real=real,
        simulated=simulated,
        num_events=len(entries),
        unplaced_blocks=unplaced,
        first_segment_divergence=divergence,
        first_address_divergence=first_address_divergence,
        num_allocs=num_allocs,
        num_allocs_at_real_address=num_allocs_at_real_address,
        notes=notes,
    )
    return replay


def _estimated_blocks(snapshot: Mapping[str, Any], device: int) -> set[int]:
    """Addresses of live-at-start blocks whose size the trace does not give (freed in it)."""
    live: set[int] = set()
    out: set[int] = set()
    for e in _entries(snapshot, device):
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in live:
            out.add(e["addr"])
        elif e["action"] == "free_completed":
            live.discard(e["addr"])
    return out
