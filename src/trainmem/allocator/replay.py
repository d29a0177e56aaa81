"""Replay a :class:`~trainmem.timeline.Timeline` through the caching-allocator simulator.

This is the allocator's entry point for the rest of trainmem: both engines hand it the same
``Timeline`` (STYLE.md section 1) and get back what ``torch.cuda`` would report after the step:
``max_memory_allocated``, ``max_memory_reserved``, the full ``memory_stats()`` dict, whether the
step runs out of memory on the given capacity, and PyTorch's out-of-memory message.

Note [Out of memory during a replay]
    A real run stops at the first out-of-memory error. The replay records it (``oom``,
    ``oom_message``, ``oom_event_index``) and, by default (``continue_after_oom=True``), lifts the
    capacity limit and goes on, so that ``max_memory_allocated`` / ``max_memory_reserved`` still
    say how much the whole step needs. With ``continue_after_oom=False`` the replay stops where the
    real run would and the result describes the state at the failure.

Source: ``DeviceCachingAllocator::malloc`` / ``free`` in c10/cuda/CUDACachingAllocator.cpp
(https://github.com/pytorch/pytorch/blob/eb42ad6eca0ce61e7c581212b4bf32f991425571/c10/cuda/CUDACachingAllocator.cpp)
via :mod:`trainmem.allocator.caching`; spec ../shared/specs/cuda-caching-allocator.md sections 2-5.

Known limitations:
    - the memory outside the allocator (CUDA context, NCCL) is not part of the replay; subtract
      it from the device total before passing ``capacity_bytes``
      (see :mod:`trainmem.allocator.device`);
    - one device; cross-stream frees complete at the next ``malloc`` (Note [Cross-stream frees]).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from trainmem.allocator.caching import CachingAllocatorSim, OutOfMemoryError
from trainmem.allocator.config import AllocatorConfig
from trainmem.breakdown import MemoryCategory
from trainmem.errors import TimelineError
from trainmem.timeline import AllocEvent, EventFields, EventRecord, Timeline

_CATEGORY_VALUES = {id(c): c.value for c in MemoryCategory}
"""``category.value`` by the member's id: an Enum's ``value`` is a descriptor call, about
0.5 us, once per replayed allocation."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What ``torch.cuda`` would report after the replayed timeline. Bytes throughout.

    Attributes:
        max_memory_allocated: peak of ``allocated_bytes.all`` (``torch.cuda.max_memory_allocated``):
            block sizes, so including 512-byte rounding and unsplit large-pool tails.
        max_memory_reserved: peak of ``reserved_bytes.all`` (``torch.cuda.max_memory_reserved``).
        memory_stats: ``torch.cuda.memory_stats()`` at the end of the replay, torch's key names.
        reserved_at_allocated_peak_bytes: ``reserved_bytes.all.current`` when the allocated peak
            was first reached.
        allocated_at_reserved_peak_bytes: ``allocated_bytes.all.current`` when the reserved peak
            was first reached.
        fragmentation_bytes: reserved minus allocated at the reserved peak, the cached memory the
            step holds but does not use (spec section 5.1).
        peak_allocated_event_index: index of the event that set ``max_memory_allocated``; None if
            nothing was allocated.
        peak_reserved_event_index: index of the event that set ``max_memory_reserved``; None if
            nothing was reserved.
        allocated_by_category_at_peak: block bytes per ``MemoryCategory`` value live at the
            allocated peak; sums to ``max_memory_allocated``.
        oom: True if a ``malloc`` failed on ``capacity_bytes`` after the flush-and-retry path.
        oom_message: PyTorch's ``CUDA out of memory. Tried to allocate ...`` text of the first
            failure; None without one.
        oom_event_index: index of the event that failed first; None without one.
        num_events: events replayed (fewer than the timeline's if it stopped at an OOM).
        capacity_bytes: the capacity the replay started with (None = unlimited).
        snapshot: ``torch.cuda.memory._snapshot()``-style dict when ``record_history=True``
            (see :mod:`trainmem.allocator.snapshot`), else None.
        load_max_allocated / load_max_reserved: ``max_memory_allocated`` /
            ``max_memory_reserved`` over the events of phase ``"load"`` (loading the model,
            replayed first; Note [The load phase] in trainmem.schedule); 0 without them.
        oom_phase: the phase of the event that failed first; None without one.
    """

    max_memory_allocated: int
    max_memory_reserved: int
    memory_stats: dict[str, int]
    reserved_at_allocated_peak_bytes: int
    allocated_at_reserved_peak_bytes: int
    fragmentation_bytes: int
    peak_allocated_event_index: int | None
    peak_reserved_event_index: int | None
    allocated_by_category_at_peak: dict[str, int]
    oom: bool
    oom_message: str | None
    oom_event_index: int | None
    num_events: int
    capacity_bytes: int | None
    snapshot: dict[str, Any] | None = field(default=None, repr=False)
    load_max_allocated: int = 0
    load_max_reserved: int = 0
    oom_phase: str | None = None

    @property
    def fits(self) -> bool:
        """True if the step ran without an out-of-memory error."""
        return not self.oom


def _as_record(ev: Any) -> EventFields:
    """The fields of ``ev`` (an :class:`~trainmem.timeline.AllocEvent`, or any object with its
    fields) as a tuple, in :class:`~trainmem.timeline.EventRecord`'s order."""
    return (ev.action, ev.block_id, ev.size_bytes, ev.category, ev.phase, ev.module, ev.stream)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back on after it if it was on.

    Note [No cyclic collection during a replay]
        A replay creates a container object per event and per block (the event tuples, the
        simulator's blocks and their sorted keys), so CPython's generational collector runs
        a young-generation pass every 700 net container allocations and an older one every
        tenth of those (``gc.get_threshold()`` = (700, 10, 10)), and each pass walks what the
        replay made and finds nothing to free: the blocks of a segment link to each other
        and all live until the replay ends. About a tenth of a replay's time went to those
        passes (the searches of ``trainmem plan``, issue 28). Reference counting still frees
        everything acyclic at once; the simulator's linked blocks are collected at the next
        pass after the replay. ``timeit`` turns the collector off in the same way while it
        times (https://docs.python.org/3/library/timeit.html, "By default, timeit()
        temporarily turns off garbage collection during the timing"; ``gc.disable``,
        https://docs.python.org/3/library/gc.html). Nothing a replay computes depends on
        when garbage is collected.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_timeline(
    timeline: Timeline | Iterable[AllocEvent | EventRecord | EventFields],
    *,
    capacity_bytes: int | None,
    alloc_conf: str = "",
    device_total_bytes: int | None = None,
    continue_after_oom: bool = True,
    record_history: bool = False,
    torch_version: tuple[int, int] = (2, 9),
    device: int = 0,
    full_stats: bool = True,
) -> ReplayResult:
    """Replay ``timeline`` through a fresh simulated caching allocator.

    Args:
        timeline: ordered alloc/free events (a Timeline or any iterable of them:
            AllocEvents, EventRecords or tuples of their fields in EventRecord's order,
            consumed lazily: a replay that stops at an out-of-memory error reads no further);
            ``size_bytes`` are requested (unrounded) bytes and a
            free names the ``block_id`` of a live alloc.
        capacity_bytes: bytes the allocator may obtain from CUDA: the device's ``total_memory``
            minus the CUDA context and any other memory outside PyTorch
            (:func:`trainmem.allocator.device.allocator_capacity_bytes`). None is unlimited.
        alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` string (``"expandable_segments:True"``, ...).
        device_total_bytes: the GPU's ``total_memory``, printed as "total capacity" in the OOM
            message and used by ``per_process_memory_fraction``; defaults to ``capacity_bytes``.
        continue_after_oom: see Note [Out of memory during a replay].
        record_history: also return a memory snapshot dict (slower; needed for
            :func:`trainmem.allocator.snapshot.write_snapshot`).
        torch_version: (major, minor) of the PyTorch modelled; only changes the parsing of a
            ``roundup_power2_divisions`` list (spec section 1.2).
        device: device ordinal printed in the OOM message and the snapshot.
        full_stats: False keeps only the statistics the peaks need, and ``memory_stats``
            holds those keys only (Note [Lean statistics] in ``caching.py``; about a third
            faster).

    Returns:
        The peaks, final stats and out-of-memory verdict.

    Raises:
        TimelineError: a free of a ``block_id`` that is not live, or an alloc of a live one.
        SpecError: ``alloc_conf`` has an unknown option or a bad value.
        UnsupportedError: ``alloc_conf`` selects ``backend:cudaMallocAsync``.

    Source: spec sections 2-5; ``malloc``/``free`` of c10/cuda/CUDACachingAllocator.cpp.
    """
    with _cyclic_gc_paused():  # Note [No cyclic collection during a replay]
        return _replay(
            timeline,
            capacity_bytes=capacity_bytes,
            alloc_conf=alloc_conf,
            device_total_bytes=device_total_bytes,
            continue_after_oom=continue_after_oom,
            record_history=record_history,
            torch_version=torch_version,
            device=device,
            full_stats=full_stats,
        )


def _replay(
    timeline: Timeline | Iterable[AllocEvent | EventRecord | EventFields],
    *,
    capacity_bytes: int | None,
    alloc_conf: str,
    device_total_bytes: int | None,
    continue_after_oom: bool,
    record_history: bool,
    torch_version: tuple[int, int],
    device: int,
    full_stats: bool,
) -> ReplayResult:
    """:func:`replay_timeline`'s replay, with the collector as the caller left it."""
    config = AllocatorConfig.from_string(alloc_conf, torch_version=torch_version)
    sim = CachingAllocatorSim(
        capacity_bytes,
        config,
        device_total_bytes=device_total_bytes,
        record_history=record_history,
        device=device,
        full_stats=full_stats,
    )
    allocated_stat = sim.stats.allocated_bytes[0]
    reserved_stat = sim.stats.reserved_bytes[0]
    malloc = sim.malloc
    free = sim.free
    live: dict[int, tuple[int, str, int]] = {}  # block_id -> (handle, category, block bytes)
    by_category: dict[str, int] = {}
    peak_by_category: dict[str, int] = {}
    peak_allocated = peak_reserved = 0
    reserved_at_allocated_peak = allocated_at_reserved_peak = 0
    peak_allocated_index: int | None = None
    peak_reserved_index: int | None = None
    oom_message: str | None = None
    oom_index: int | None = None
    oom_phase: str | None = None
    load_allocated = load_reserved = 0
    events = timeline.events if isinstance(timeline, Timeline) else timeline
    values = _CATEGORY_VALUES
    blocks = sim.allocated_blocks
    # NB: the planner's hot loop (every probe replays thousands of events): a tuple of an
    # event's fields (a schedule's, Note [Plain event tuples]) or an EventRecord is unpacked
    # at once, and the split by category at the allocated peak is copied once per
    # climb (at the first free after it), not at every allocation that raises the peak
    rising = False
    i = -1
    for i, event in enumerate(events):  # noqa: B007 (i is read after the loop)
        action, block_id, size_bytes, cat, phase, module, stream = (
            event if type(event) is tuple or type(event) is EventRecord else _as_record(event)
        )
        if action == "alloc":
            if block_id in live:
                raise TimelineError(
                    f"event {i}: block_id {block_id} allocated again while live", event_index=i
                )
            category = values.get(id(cat)) or cat.value
            frames = (  # shown as the allocation's stack in MemoryViz
                [{"filename": module or "<trainmem>", "line": 0, "name": phase}]
                if record_history
                else None
            )
            try:
                handle = malloc(size_bytes, stream, category=category, frames=frames)
            except OutOfMemoryError as err:
                if oom_message is None:
                    oom_message, oom_index, oom_phase = str(err), i, phase
                if not continue_after_oom:
                    num_events = i  # the failed event is not replayed
                    break
                sim.capacity_bytes = None  # See Note [Out of memory during a replay]
                handle = malloc(size_bytes, stream, category=category, frames=frames)
            size = blocks[handle].size if handle else 0
            live[block_id] = (handle, category, size)
            by_category[category] = by_category.get(category, 0) + size
            allocated = allocated_stat.current
            if allocated > peak_allocated:
                peak_allocated, peak_allocated_index = allocated, i
                reserved_at_allocated_peak = reserved_stat.current
                rising = True
            reserved = reserved_stat.current
            if reserved > peak_reserved:
                peak_reserved, peak_reserved_index = reserved, i
                allocated_at_reserved_peak = allocated
            if phase == "load":
                load_allocated = max(load_allocated, allocated)
                load_reserved = max(load_reserved, reserved)
        else:
            entry = live.pop(block_id, None)
            if entry is None:
                raise TimelineError(
                    f"event {i}: free of block_id {block_id}, which is not live", event_index=i
                )
            if rising:
                peak_by_category, rising = by_category.copy(), False
            handle, category, size = entry
            free(handle)
            by_category[category] -= size
    else:
        num_events = i + 1
    peak_by_category = by_category.copy() if rising else peak_by_category
    snapshot = None
    if record_history:
        from trainmem.allocator.snapshot import snapshot_of

        snapshot = snapshot_of(sim)
    return ReplayResult(
        max_memory_allocated=sim.max_memory_allocated,
        max_memory_reserved=sim.max_memory_reserved,
        memory_stats=sim.memory_stats(),
        reserved_at_allocated_peak_bytes=reserved_at_allocated_peak,
        allocated_at_reserved_peak_bytes=allocated_at_reserved_peak,
        fragmentation_bytes=peak_reserved - allocated_at_reserved_peak,
        peak_allocated_event_index=peak_allocated_index,
        peak_reserved_event_index=peak_reserved_index,
        allocated_by_category_at_peak={k: v for k, v in peak_by_category.items() if v},
        oom=oom_message is not None,
        oom_message=oom_message,
        oom_event_index=oom_index,
        num_events=num_events,
        capacity_bytes=capacity_bytes,
        snapshot=snapshot,
        load_max_allocated=load_allocated,
        load_max_reserved=load_reserved,
        oom_phase=oom_phase,
    )
