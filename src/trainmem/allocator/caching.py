"""A pure-Python simulation of PyTorch's CUDA caching allocator (``backend:native``).

It turns a stream of ``malloc(size, stream)`` / ``free(handle)`` calls into what
``torch.cuda.memory_stats()`` would report: allocated and reserved bytes with their peaks,
inactive-split fragmentation, retries and out-of-memory errors. No torch, no GPU.

Note [Simulator data model]
    A *segment* is one simulated ``cudaMalloc`` (or one expandable virtual range); its *blocks*
    are a doubly linked list in address order (``prev``/``next``) that tiles it exactly. Free
    blocks live in a pool (small or large) kept as a sorted list of ``(stream, size, ptr)``
    keys (one int each, Note [Pool keys]), so ``bisect`` finds the best fit in O(log n): the
    smallest block of the stream with size >= request, lowest address among equal sizes (spec
    2.3). Unmapped blocks of expandable segments live in a second list ordered by ``(stream,
    ptr)``. Allocated blocks are found by address; the address is the handle ``malloc``
    returns. Addresses are invented: segments are laid out bump-pointer style with a 2 MiB gap,
    so they never overlap and never get reused.

Note [Cross-stream frees]
    A block with ``record_stream`` uses becomes ``active_pending_free`` on free. A simulator
    cannot know when the GPU finishes, so the pending free completes at the start of the next
    ``malloc`` (the default completion-lag model of spec 2.8), or at ``empty_cache`` / the OOM
    path, which synchronize.

Note [Lean statistics]
    Every simulated ``malloc`` and ``free`` moves ten counters of ``memory_stats()``
    (allocation, active, allocated / active / requested bytes, on ``all`` and on the pool, plus
    inactive splits), about a third of the simulator's time, and no decision of the allocator
    reads them. A replay that only needs the peaks and the verdict (the estimate's, run once
    per planner probe: ``trainmem.estimate.finish``) builds the simulator with
    ``full_stats=False``: it keeps ``allocated_bytes.all.current`` / ``.peak``, the reserved
    bytes and segments (moved where segments are made and released, rarely), the oversize and
    scalar counters, and ``memory_stats()`` returns those keys only (:data:`LEAN_STATS`). The
    allocator's blocks, pools and addresses are the same either way, so are the peaks, the
    out-of-memory verdict and its message (``tests/allocator/test_replay.py`` replays golden
    schedules both ways).

Source: ../shared/specs/cuda-caching-allocator.md sections 1-5; the functions of the same names
in c10/cuda/CUDACachingAllocator.cpp
(https://github.com/pytorch/pytorch/blob/eb42ad6eca0ce61e7c581212b4bf32f991425571/c10/cuda/CUDACachingAllocator.cpp).

Known limitations:
    - one device; no private pools (CUDA graphs, MemPool) and no IPC;
    - ``expandable_segments`` cannot be toggled after construction;
    - invented addresses only break ties between equal-sized free blocks (spec 2.3).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from typing import Any

from trainmem.allocator.config import AllocatorConfig
from trainmem.allocator.constants import (
    DEFAULT_VIRTUAL_DEVICE_BYTES,
    EXPANDABLE_VIRTUAL_DEN,
    EXPANDABLE_VIRTUAL_NUM,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    MAX_SPLIT_SIZE_UNLIMITED,
    OOM_DOCS_URL,
)
from trainmem.allocator.stats import LARGE_POOL, SMALL_POOL, DeviceStats, decrease, increase
from trainmem.errors import OutOfMemoryError as OutOfMemoryError
from trainmem.errors import SpecError

#: ``memory_stats()`` keys (prefixes) a simulator with ``full_stats=False`` keeps
#: (Note [Lean statistics]).
LEAN_STATS: tuple[str, ...] = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.",
    "segment.",
    "oversize_",
    "num_",
    "max_split_size",
)

#: First invented segment address (looks like a CUDA device pointer, fits in int64).
_BASE_ADDRESS = 0x7F0000000000
#: Gap between invented segments (bytes), so no two segments are adjacent.
_ADDRESS_GAP = K_SMALL_BUFFER


def format_size(size_bytes: int) -> str:
    """Format bytes as PyTorch's allocator does in its messages (``format_size``).

    Args:
        size_bytes: a byte count.

    Returns:
        ``"N bytes"`` up to 1024, then ``"x.xx KiB"`` up to 1 MiB inclusive, ``"x.xx MiB"`` up to
        1 GiB inclusive, else ``"x.xx GiB"``.

    Source: spec section 3.5 (format_size table).
    """
    if size_bytes <= 1024:
        return f"{size_bytes} bytes"
    if size_bytes <= 1_048_576:
        return f"{size_bytes / 1024:.2f} KiB"
    if size_bytes <= 1_073_741_824:
        return f"{size_bytes / 1_048_576:.2f} MiB"
    return f"{size_bytes / 1_073_741_824:.2f} GiB"


def round_size_default(size: int) -> int:
    """``round_size`` without ``roundup_power2_divisions``: at least 512, a multiple of 512 (bytes).

    Args:
        size: requested bytes.

    Returns:
        ``max(512, ceil(size / 512) * 512)``.

    Source: spec section 1.2 (``round_size``), kMinBlockSize.
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def get_allocation_size(size: int, large_segment_size: int) -> int:
    """Size of a new segment for a rounded request (``get_allocation_size``).

    Args:
        size: rounded request in bytes.
        large_segment_size: segment size for 1-10 MiB requests (kLargeBuffer, 20 MiB by default).

    Returns:
        2 MiB for small requests, ``large_segment_size`` under 10 MiB, else the request rounded
        up to a multiple of 2 MiB (bytes).

    Source: spec section 1.4.
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class _ExpandableSegment:
    """One reserved virtual range whose pages get mapped on demand (spec 4.1)."""

    __slots__ = ("base", "page_size", "size")

    def __init__(self, base: int, page_size: int, size: int) -> None:
        self.base = base
        self.page_size = page_size
        self.size = size


_NO_STREAM_USES: frozenset[int] = frozenset()
"""A block's ``stream_uses`` until ``record_stream`` names another stream (one shared empty
set, not one made per block)."""


class Block:
    """A contiguous piece of a segment (``Block`` in CUDACachingAllocator.cpp)."""

    __slots__ = (
        "ptr",
        "size",
        "requested_size",
        "allocated",
        "prev",
        "next",
        "stream",
        "pool",
        "mapped",
        "expandable",
        "gc_count_base",
        "event_count",
        "stream_uses",
        "category",
        "frames",
    )

    def __init__(
        self,
        ptr: int,
        size: int,
        stream: int,
        pool: BlockPool,
        expandable: _ExpandableSegment | None = None,
        prev: Block | None = None,
        next: Block | None = None,  # noqa: A002 (the field's name)
    ) -> None:
        self.ptr = ptr
        self.size = size
        self.requested_size = 0
        self.allocated = False
        self.prev = prev
        self.next = next
        self.stream = stream
        self.pool = pool
        self.mapped = True
        self.expandable = expandable
        self.gc_count_base = 0
        self.event_count = 0
        self.stream_uses: frozenset[int] | set[int] = _NO_STREAM_USES
        self.category: str | None = None
        self.frames: list[dict[str, Any]] | None = None

    def is_split(self) -> bool:
        """True if the block does not cover its whole segment."""
        return self.prev is not None or self.next is not None


_ADDRESS_BITS = 64
"""Bits of a device address or a block size (both below 2**64, as CUDA's are): the width of the
fields of a pool key (Note [Pool keys])."""
_ADDRESS_MASK = (1 << _ADDRESS_BITS) - 1
_STREAM_SHIFT = 2 * _ADDRESS_BITS


def pool_key(stream: int, size: int, ptr: int) -> int:
    """The pool key of a free block: ``(stream, size, ptr)`` as one int (Note [Pool keys]).

    Note [Pool keys]
        A pool orders its free blocks by (stream, size, address) (``BlockComparatorSize``,
        spec 2.3). The key is ``stream * 2**128 + size * 2**64 + ptr``: with ``size`` and
        ``ptr`` in [0, 2**64), two keys compare as the tuples do (for any int ``stream``), and
        the keys of one stream lie in ``[stream * 2**128, (stream + 1) * 2**128)``. Comparing
        two ints costs about half what comparing two tuples does, and each ``bisect`` of a pool
        compares about log2(n) times: the pools are searched or changed several times per
        simulated ``malloc`` and ``free``. Addresses are checked to stay below 2**64 where a
        segment's range is taken (:meth:`CachingAllocatorSim._occupy`).
    """
    return (stream << _STREAM_SHIFT) + (size << _ADDRESS_BITS) + ptr


def key_fields(key: int) -> tuple[int, int, int]:
    """``(stream, size, ptr)`` of a pool key (Note [Pool keys])."""
    return key >> _STREAM_SHIFT, (key >> _ADDRESS_BITS) & _ADDRESS_MASK, key & _ADDRESS_MASK


class BlockPool:
    """Free blocks of one pool (small or large), ordered by (stream, size, address)."""

    __slots__ = ("is_small", "stat_type", "keys", "free_at", "unmapped", "unmapped_at", "calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.stat_type = SMALL_POOL if is_small else LARGE_POOL
        #: Sorted keys of the free mapped blocks (Note [Pool keys]).
        self.keys: list[int] = []
        self.free_at: dict[int, Block] = {}
        #: Sorted (stream, ptr) of unmapped expandable blocks.
        self.unmapped: list[tuple[int, int]] = []
        self.unmapped_at: dict[int, Block] = {}
        #: get_free_blocks_call_count (block ages for the garbage collector).
        self.calls = 0

    def insert(self, block: Block) -> None:
        """Insert a free mapped block (``insert_into_blocks``)."""
        block.gc_count_base = self.calls
        ptr = block.ptr
        insort(self.keys, (block.stream << _STREAM_SHIFT) + (block.size << _ADDRESS_BITS) + ptr)
        self.free_at[ptr] = block

    def remove(self, block: Block) -> None:
        """Remove a free mapped block; its ptr and size must be those it was inserted with."""
        keys = self.keys
        ptr = block.ptr
        del keys[
            bisect_left(keys, (block.stream << _STREAM_SHIFT) + (block.size << _ADDRESS_BITS) + ptr)
        ]
        del self.free_at[ptr]

    def insert_unmapped(self, block: Block) -> None:
        """Insert an unmapped expandable block."""
        insort(self.unmapped, (block.stream, block.ptr))
        self.unmapped_at[block.ptr] = block

    def remove_unmapped(self, block: Block) -> None:
        """Remove an unmapped expandable block."""
        del self.unmapped[bisect_left(self.unmapped, (block.stream, block.ptr))]
        del self.unmapped_at[block.ptr]


class CachingAllocatorSim:
    """Simulated ``DeviceCachingAllocator`` of one GPU.

    Example:
        >>> sim = CachingAllocatorSim()
        >>> h = sim.malloc(1000)
        >>> sim.memory_stats()["allocated_bytes.all.current"], sim.max_memory_reserved
        (1024, 2097152)
        >>> sim.free(h)

    Args:
        capacity_bytes: bytes the allocator may obtain from CUDA (device total minus CUDA context
            and other non-PyTorch usage). A ``cudaMalloc`` succeeds iff
            ``capacity_bytes - reserved >= segment size`` (spec 3.1). ``None`` is unlimited.
        config: allocator options (``AllocatorConfig.from_string(PYTORCH_CUDA_ALLOC_CONF)``).
        device_total_bytes: ``total_memory`` of the GPU, printed in the OOM message and used for
            the memory-fraction cap and the expandable virtual range; defaults to
            ``capacity_bytes``. The difference is printed as non-PyTorch memory of this process.
        record_history: keep a trace of alloc/free/segment events for a memory snapshot
            (``torch.cuda.memory._record_memory_history``); costs time and memory.
        full_stats: keep every statistic of ``memory_stats()``; False keeps only
            ``allocated_bytes.all``, ``reserved_bytes``, ``segment`` and the scalar counters
            (Note [Lean statistics]).
        device: device ordinal printed in messages and snapshots.

    Source: spec sections 2-5.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        config: AllocatorConfig | None = None,
        *,
        device_total_bytes: int | None = None,
        record_history: bool = False,
        device: int = 0,
        full_stats: bool = True,
    ) -> None:
        self.config = config if config is not None else AllocatorConfig()
        self.capacity_bytes = capacity_bytes
        self.device_total_bytes = (
            device_total_bytes if device_total_bytes is not None else capacity_bytes
        )
        self.device = device
        self.stats = DeviceStats()
        self._allocated_stat = self.stats.allocated_bytes[0]  # ``allocated_bytes.all``
        self.small_pool = BlockPool(is_small=True)
        self.large_pool = BlockPool(is_small=False)
        self._allocated: dict[int, Block] = {}
        self._pending: list[Block] = []
        self._reserved_total = 0  # total_allocated_memory in C++: reserved over all pools
        self._next_address = _BASE_ADDRESS
        self._expandable_segments: list[_ExpandableSegment] = []
        #: Sorted (start, end) of the address ranges of segments and expandable ranges held.
        self._ranges: list[tuple[int, int]] = []
        #: Optional source of segment addresses: ``hint(size)`` returns the address the next
        #: ``cudaMalloc`` of ``size`` bytes should get (e.g. the real one, when replaying a real
        #: trace), or None for an invented one. Addresses only break best-fit ties (spec 2.3).
        self.address_hint: Callable[[int], int | None] | None = None
        self.trace: list[dict[str, Any]] | None = [] if record_history else None
        self._full_stats = full_stats
        self._memory_fraction: float | None = None
        #: The garbage collector runs: a memory fraction is set and a threshold (spec 3.3).
        self._gc_active = False
        if self.config.per_process_memory_fraction < 1.0:
            self.set_per_process_memory_fraction(self.config.per_process_memory_fraction)
        # Hot-path copies of config values.
        cfg = self.config
        self._max_split = cfg.max_split_size_bytes
        self._max_split_set = cfg.max_split_size_is_set
        self._expandable = cfg.expandable_segments
        self._divisions = cfg.roundup_power2_divisions
        self._any_divisions = any(cfg.roundup_power2_divisions)

    # ------------------------------------------------------------------ public API

    @property
    def max_memory_allocated(self) -> int:
        """Peak of ``allocated_bytes.all`` (``torch.cuda.max_memory_allocated``), bytes."""
        return self.stats.allocated_bytes[0].peak

    @property
    def max_memory_reserved(self) -> int:
        """Peak of ``reserved_bytes.all`` (``torch.cuda.max_memory_reserved``), bytes."""
        return self.stats.reserved_bytes[0].peak

    @property
    def memory_allocated(self) -> int:
        """``allocated_bytes.all.current`` (``torch.cuda.memory_allocated``), bytes."""
        return self.stats.allocated_bytes[0].current

    @property
    def memory_reserved(self) -> int:
        """``reserved_bytes.all.current`` (``torch.cuda.memory_reserved``), bytes."""
        return self.stats.reserved_bytes[0].current

    @property
    def allowed_bytes(self) -> int | None:
        """The memory-fraction cap in bytes, or ``None`` when no fraction is set."""
        if self._memory_fraction is None or self.device_total_bytes is None:
            return None
        return int(self._memory_fraction * self.device_total_bytes)

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()`` of the simulated device (spec 5.1); with
        ``full_stats=False`` only the keys kept (Note [Lean statistics])."""
        max_split = -1 if self._max_split == MAX_SPLIT_SIZE_UNLIMITED else self._max_split
        return self.stats.as_dict(max_split, None if self._full_stats else LEAN_STATS)

    def reset_peak_memory_stats(self) -> None:
        """Set every peak to its current value (``torch.cuda.reset_peak_memory_stats``)."""
        self.stats.reset_peak()

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Cap reserved memory at ``fraction * device_total_bytes`` (2.9+ semantics, spec 3.1).

        A fraction of 1.0 removes the cap, which also disables the garbage collector (3.3).

        Args:
            fraction: in (0, 1].

        Raises:
            ValueError: fraction outside (0, 1], or no device total is known.
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if fraction < 1.0 and self.device_total_bytes is None:
            raise SpecError(  # a ValueError too
                "alloc_conf",
                "per_process_memory_fraction caps a fraction of the GPU's memory: name the GPU "
                "(--gpu) so that there is a capacity to take the fraction of",
            )
        self._memory_fraction = fraction if fraction < 1.0 else None
        self._gc_active = (
            self._memory_fraction is not None and self.config.garbage_collection_threshold > 0
        )

    def round_size(self, size: int) -> int:
        """Block size for a request of ``size`` bytes (``round_size``, spec 1.2).

        Args:
            size: requested bytes.

        Returns:
            At least 512 and a multiple of 512 (bytes); with ``roundup_power2_divisions`` the
            next power-of-two division when the bucket's divisions d > 1 and size > 512 * d.
        """
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        if self._any_divisions:
            idx = min(max(size.bit_length() - 1 - 20, 0), 15)
            d = self._divisions[idx]
            if d > 1 and size > K_MIN_BLOCK_SIZE * d:
                if size & (size - 1) == 0:
                    return size
                step = (1 << (size.bit_length() - 1)) // d
                return -(-size // step) * step
        return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE  # round_size_default's

    def malloc(
        self,
        size_bytes: int,
        stream: int = 0,
        *,
        category: str | None = None,
        frames: list[dict[str, Any]] | None = None,
    ) -> int:
        """Allocate ``size_bytes`` on ``stream`` and return a handle (the block address).

        Args:
            size_bytes: requested bytes (``numel * itemsize``). 0 returns the null handle 0 and
                changes nothing, like PyTorch.
            stream: CUDA stream id; cached memory is never shared between streams.
            category: optional label recorded in the trace (snapshot colouring).
            frames: optional stack recorded in the trace and the snapshot, a list of
                ``{"filename", "line", "name"}`` dicts as PyTorch records them.

        Returns:
            An int handle to pass to :meth:`free`.

        Raises:
            OutOfMemoryError: with PyTorch's message, after the flush-and-retry path failed.
            ValueError: a negative size.

        Source: spec section 2.2 (``malloc``), 2.4 to 2.6, 3.
        """
        if size_bytes <= 0:
            if size_bytes == 0:
                return 0
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        if self._pending:
            self._process_events()
        if self._any_divisions:  # NB: else round_size's rounding inline (once per malloc)
            size = self.round_size(size_bytes)
        elif size_bytes < K_MIN_BLOCK_SIZE:
            size = K_MIN_BLOCK_SIZE
        else:
            size = -(-size_bytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE  # round_size's
        pool = self.small_pool if size <= K_SMALL_SIZE else self.large_pool
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = get_allocation_size(size, self.config.large_segment_size_bytes)
            if self._gc_active:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, size, alloc_size, is_retry=False)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size, alloc_size, is_retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, size, alloc_size, is_retry=True)
            if block is None:
                raise self._out_of_memory(size, alloc_size, stream)
        return self._alloc_found_block(block, pool, size, size_bytes, category, frames).ptr

    def free(self, handle: int) -> None:
        """Free the block behind ``handle`` (``free``, spec 2.7).

        ``allocated_bytes`` drops at once; the block goes back to its pool and merges with free
        neighbours, unless ``record_stream`` was called (then it waits, see
        Note [Cross-stream frees]). Memory is never returned to CUDA here.

        Args:
            handle: a value returned by :meth:`malloc`; 0 (a zero-byte allocation) is ignored.

        Raises:
            ValueError: ``handle`` is not a live allocation.
        """
        if handle == 0:
            return
        block = self._allocated.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid device pointer: {handle:#x}")
        block.allocated = False
        if self._full_stats:
            s, st = self.stats, block.pool.stat_type
            decrease(s.allocation, st, 1)
            decrease(s.allocated_bytes, st, block.size)
        else:  # Note [Lean statistics]
            self._allocated_stat.current -= block.size
        if block.size >= self._max_split:
            self.stats.oversize_allocations.decrease(1)
        if self.trace is not None:
            self._record("free_requested", block.ptr, block.requested_size, block.stream, block)
        if block.stream_uses:
            block.event_count = len(block.stream_uses)
            block.stream_uses = _NO_STREAM_USES
            self._pending.append(block)
        else:
            self._free_block(block)

    def record_stream(self, handle: int, stream: int) -> None:
        """Mark the allocation as used on ``stream`` (``Tensor.record_stream``, spec 2.8).

        Args:
            handle: a live allocation.
            stream: the stream that uses it; the allocation stream itself is ignored.

        Raises:
            ValueError: ``handle`` is not a live allocation.
        """
        block = self._allocated.get(handle)
        if block is None:
            raise ValueError(f"invalid device pointer: {handle:#x}")
        if stream != block.stream:
            block.stream_uses = {*block.stream_uses, stream}

    def empty_cache(self) -> None:
        """Release every wholly free segment (and free expandable pages) to CUDA.

        ``torch.cuda.empty_cache()``; it first completes pending cross-stream frees. Segments
        with any block in use stay (spec 3.4).
        """
        self._release_cached_blocks()

    @property
    def allocated_blocks(self) -> dict[int, Block]:
        """The live blocks by handle (the simulator's own dict: read it, never change it)."""
        return self._allocated

    def block_size_of(self, handle: int) -> int:
        """Block size (bytes) behind a live allocation handle."""
        return self._allocated[handle].size

    # ------------------------------------------------------------------ seeding a known state

    def adopt_segment(
        self,
        address: int,
        size: int,
        stream: int = 0,
        *,
        small: bool,
        live: Sequence[tuple[int, int, int]] = (),
        expandable_mapped: list[tuple[int, int]] | None = None,
    ) -> list[int]:
        """Install a segment that already exists (e.g. one read from a real memory snapshot).

        The segment's free space between the ``live`` blocks becomes one free block per gap,
        as the real allocator keeps it (free neighbours are always merged). The stats count
        the segment as reserved and the live blocks as allocated, as if the allocator had
        made them; ``num_device_alloc`` is not counted (the ``cudaMalloc`` happened before).

        Args:
            address: first byte of the segment (a real device pointer is fine).
            size: bytes of the segment (of the whole virtual range for an expandable one).
            stream: the stream that owns it.
            small: True for the small pool (2 MiB segments of blocks <= 1 MiB).
            live: ``(address, block_bytes, requested_bytes)`` of the allocated blocks, inside
                the segment, not overlapping; block sizes multiples of 512.
            expandable_mapped: for an expandable segment, the ``(address, bytes)`` ranges that
                are mapped (each a whole number of pages); the rest of ``size`` is unmapped.
                None for an ordinary ``cudaMalloc`` segment.

        Returns:
            The handles of the ``live`` blocks, in the order given (pass them to :meth:`free`).

        Raises:
            ValueError: live blocks overlap, leave the segment or the mapped ranges, or a size
                is not a positive multiple of 512.
        """
        if size <= 0 or not self._range_is_free(address, size):
            raise ValueError(
                f"segment {address:#x}+{size} is empty, overlaps one already held or leaves the "
                "64-bit address space"
            )
        pool = self.small_pool if small else self.large_pool
        st = pool.stat_type
        s = self.stats
        es: _ExpandableSegment | None = None
        if expandable_mapped is not None:
            page = K_SMALL_BUFFER if small else self.config.large_segment_size_bytes
            es = _ExpandableSegment(address, page, size)
            mapped = sorted(expandable_mapped)
            if size % page or any((a - address) % page or n % page for a, n in mapped):
                raise ValueError(f"expandable ranges are not whole {page}-byte pages")
        else:
            mapped = [(address, size)]
        end = address + size
        # Pieces: (ptr, size, kind) with kind "live", "free" or "unmapped".
        order = sorted(range(len(live)), key=lambda k: live[k][0])
        handles: dict[int, int] = {}
        pieces: list[tuple[int, int, str, int]] = []
        cursor = address
        li = 0
        for m_ptr, m_size in mapped:
            if m_ptr < cursor or m_ptr + m_size > end or m_size <= 0:
                raise ValueError(f"mapped range {m_ptr:#x}+{m_size} outside the segment")
            if m_ptr > cursor:
                pieces.append((cursor, m_ptr - cursor, "unmapped", -1))
            cursor = m_ptr
            m_end = m_ptr + m_size
            while li < len(order) and live[order[li]][0] < m_end:
                k = order[li]
                b_ptr, b_size, _ = live[k]
                if b_ptr < cursor or b_ptr + b_size > m_end or b_size <= 0:
                    raise ValueError(f"live block {b_ptr:#x}+{b_size} overlaps or leaves its range")
                if b_ptr > cursor:
                    pieces.append((cursor, b_ptr - cursor, "free", -1))
                pieces.append((b_ptr, b_size, "live", k))
                cursor = b_ptr + b_size
                li += 1
            if m_end > cursor:
                pieces.append((cursor, m_end - cursor, "free", -1))
            cursor = m_end
        if li < len(order):
            raise ValueError(f"live block {live[order[li]][0]:#x} outside the mapped ranges")
        if cursor < end:
            if es is None:
                raise ValueError("segment size does not match its mapped range")
            pieces.append((cursor, end - cursor, "unmapped", -1))
        blocks: list[Block] = []
        for ptr, psize, _, _ in pieces:
            if psize % K_MIN_BLOCK_SIZE:
                raise ValueError(f"block at {ptr:#x} of {psize} bytes is not a multiple of 512")
            b = Block(ptr, psize, stream, pool, es)
            if blocks:
                b.prev = blocks[-1]
                blocks[-1].next = b
            blocks.append(b)
        split = len(blocks) > 1
        reserved = 0
        for b, (_, _, kind, k) in zip(blocks, pieces, strict=True):
            if kind == "unmapped":
                b.mapped = False
                pool.insert_unmapped(b)
                continue
            reserved += b.size
            if kind == "free":
                pool.insert(b)
                if split and es is None:
                    increase(s.inactive_split, st, 1)
                    increase(s.inactive_split_bytes, st, b.size)
                continue
            b.allocated = True
            b.requested_size = live[k][2]
            self._allocated[b.ptr] = b
            handles[k] = b.ptr
            increase(s.allocation, st, 1)
            increase(s.allocated_bytes, st, b.size)
            increase(s.active, st, 1)
            increase(s.active_bytes, st, b.size)
            increase(s.requested_bytes, st, b.requested_size)
            if b.size >= self._max_split:
                s.oversize_allocations.increase(1)
        if es is None:
            increase(s.segment, st, 1)
            if size >= self._max_split:
                s.oversize_segments.increase(1)
        increase(s.reserved_bytes, st, reserved)
        self._reserved_total += reserved
        if es is not None:
            self._expandable_segments.append(es)
        self._occupy(address, size)
        return [handles[k] for k in range(len(live))]

    # ------------------------------------------------------------------ internals: search

    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        """Best-fit cached block, or None (``get_free_block``, spec 2.3 and 2.4)."""
        if self._gc_active:
            pool.calls += 1
        keys = pool.keys
        base = stream << _STREAM_SHIFT  # Note [Pool keys]
        i = bisect_left(keys, base + (size << _ADDRESS_BITS))
        n = len(keys)
        end = base + (1 << _STREAM_SHIFT)  # the first key of the next stream
        if i == n or keys[i] >= end:
            return None
        block = pool.free_at[keys[i] & _ADDRESS_MASK]
        if block.expandable is not None:
            # Best fit by "expandable size": skip the growable tail for an interior block (4.3).
            while i + 1 < n and keys[i + 1] < end and block.expandable is not None:
                nxt = pool.free_at[keys[i + 1] & _ADDRESS_MASK]
                if _expandable_size(nxt) < _expandable_size(block):
                    i += 1
                    block = nxt
                else:
                    break
        if self._max_split_set:
            # Oversize rule A: do not hand an oversize block to a normal request.
            if size < self._max_split and block.size >= self._max_split:
                return None
            # Oversize rule B: an oversize request reuses a block less than 20 MiB bigger.
            if (
                size >= self._max_split
                and block.size >= size + self.config.max_non_split_rounding_bytes
            ):
                return None
        del keys[i]  # pool.remove(block), at the index found
        del pool.free_at[block.ptr]
        return block

    def _alloc_found_block(
        self,
        block: Block,
        pool: BlockPool,
        size: int,
        orig_size: int,
        category: str | None,
        frames: list[dict[str, Any]] | None,
    ) -> Block:
        """Split if worth it, mark allocated, update stats (``alloc_found_block``, spec 2.6).

        NB: once per simulated ``malloc``: the statistics' locals are read only where the full
        statistics are kept (Note [Lean statistics])."""
        full = self._full_stats
        left = block.size - size  # should_split (spec 2.5), inline: once per malloc
        if (
            left >= K_MIN_BLOCK_SIZE
            if pool.is_small or self._expandable
            else size < self._max_split and left > K_SMALL_SIZE
        ):
            # Carve the allocation from the low end; the remainder stays in the pool.
            remaining = block
            prev = remaining.prev
            if full and remaining.expandable is None:
                s = self.stats
                if prev is not None or remaining.next is not None:  # remaining.is_split()
                    decrease(s.inactive_split_bytes, pool.stat_type, size)
                else:
                    increase(s.inactive_split_bytes, pool.stat_type, left)
                    increase(s.inactive_split, pool.stat_type, 1)
            block = Block(
                remaining.ptr, size, remaining.stream, pool, remaining.expandable, prev, remaining
            )
            if prev is not None:
                prev.next = block
            remaining.prev = block
            remaining.ptr += size
            remaining.size = left
            pool.insert(remaining)
        elif (
            full and block.expandable is None and (block.prev is not None or block.next is not None)
        ):
            s = self.stats
            decrease(s.inactive_split_bytes, pool.stat_type, block.size)
            decrease(s.inactive_split, pool.stat_type, 1)
        block.allocated = True
        block.requested_size = orig_size
        block.category = category
        block.frames = frames
        self._allocated[block.ptr] = block
        bsize = block.size
        if full:
            s, st = self.stats, pool.stat_type
            increase(s.allocation, st, 1)
            increase(s.allocated_bytes, st, bsize)
            increase(s.active, st, 1)
            increase(s.active_bytes, st, bsize)
            increase(s.requested_bytes, st, orig_size)
        else:  # Note [Lean statistics]
            a = self._allocated_stat
            current = a.current = a.current + bsize
            if current > a.peak:
                a.peak = current
        if bsize >= self._max_split:
            self.stats.oversize_allocations.increase(1)
        if self.trace is not None:
            self._record("alloc", block.ptr, orig_size, block.stream, block)
        return block

    # ------------------------------------------------------------------ internals: free

    def _free_block(self, block: Block) -> None:
        """Merge with free neighbours and return to the pool (``free_block``, spec 2.7)."""
        if self.trace is not None:
            self._record("free_completed", block.ptr, block.requested_size, block.stream, block)
        pool = block.pool
        original_size = block.size
        net_blocks = 0
        net_bytes = 0
        # NB: once per simulated free: the two neighbours unrolled, an allocated one never
        # asked to merge (_try_merge_blocks' first test)
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            subsumed = self._try_merge_blocks(block, prev, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        if nxt is not None and not nxt.allocated:
            subsumed = self._try_merge_blocks(block, nxt, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(block)
        if not self._full_stats:  # Note [Lean statistics]
            return
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        st = pool.stat_type
        s = self.stats
        if block.expandable is None:
            # inactive_split excludes expandable segments (their free pages can be unmapped).
            if net_blocks > 0:
                increase(s.inactive_split, st, net_blocks)
            elif net_blocks < 0:
                decrease(s.inactive_split, st, -net_blocks)
            if net_bytes > 0:
                increase(s.inactive_split_bytes, st, net_bytes)
            elif net_bytes < 0:
                decrease(s.inactive_split_bytes, st, -net_bytes)
        decrease(s.active, st, 1)
        decrease(s.active_bytes, st, original_size)
        decrease(s.requested_bytes, st, block.requested_size)

    @staticmethod
    def _try_merge_blocks(dst: Block, src: Block | None, pool: BlockPool) -> int:
        """Absorb ``src`` into ``dst`` if it is free and in the same mapped state; bytes absorbed.

        ``dst`` is never in the pool here. Source: ``try_merge_blocks``.
        """
        if (
            src is None
            or src.allocated
            or src.event_count > 0
            or src.stream_uses
            or dst.mapped != src.mapped
        ):
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _process_events(self) -> None:
        """Complete pending cross-stream frees (see Note [Cross-stream frees])."""
        pending, self._pending = self._pending, []
        for block in pending:
            block.event_count = 0
            self._free_block(block)

    # ------------------------------------------------------------------ internals: segments

    def _reserve_address(self, size: int) -> int:
        hint = self.address_hint(size) if self.address_hint is not None else None
        if hint is not None and self._range_is_free(hint, size):
            self._occupy(hint, size)
            return hint
        ptr = self._next_address
        while not self._range_is_free(ptr, size):  # a hinted or adopted range is in the way:
            # jump past the last range that starts before our end (finitely many ranges)
            i = bisect_left(self._ranges, (ptr + size, ptr + size))
            end = max(e for _, e in self._ranges[:i])
            ptr = -(-end // _ADDRESS_GAP) * _ADDRESS_GAP + _ADDRESS_GAP
        self._next_address = ptr + -(-size // _ADDRESS_GAP) * _ADDRESS_GAP + _ADDRESS_GAP
        self._occupy(ptr, size)
        return ptr

    def _range_is_free(self, ptr: int, size: int) -> bool:
        """True if [ptr, ptr + size) overlaps no segment or expandable range held now and lies
        in a 64-bit address space (Note [Pool keys])."""
        if ptr < 0 or ptr + size > _ADDRESS_MASK + 1:
            return False
        ranges = self._ranges
        i = bisect_left(ranges, (ptr, ptr))
        if i < len(ranges) and ranges[i][0] < ptr + size:
            return False
        return not (i > 0 and ranges[i - 1][1] > ptr)

    def _occupy(self, ptr: int, size: int) -> None:
        if ptr < 0 or ptr + size > _ADDRESS_MASK + 1:  # Note [Pool keys]
            raise ValueError(f"segment {ptr:#x}+{size} is not within a 64-bit address space")
        insort(self._ranges, (ptr, ptr + size))

    def _vacate(self, ptr: int) -> None:
        ranges = self._ranges
        i = bisect_left(ranges, (ptr, ptr))
        if i < len(ranges) and ranges[i][0] == ptr:
            del ranges[i]

    def _alloc_block(
        self, pool: BlockPool, stream: int, size: int, alloc_size: int, *, is_retry: bool
    ) -> Block | None:
        """Obtain new memory from "CUDA" (``alloc_block``, spec 3.1 and 4.4)."""
        s = self.stats
        if is_retry:
            s.num_alloc_retries += 1
        allowed = self.allowed_bytes
        if allowed is not None and self._reserved_total + alloc_size > allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, stream, size)
        if self.capacity_bytes is not None and (
            self._reserved_total + alloc_size > self.capacity_bytes
        ):
            return None
        block = Block(self._reserve_address(alloc_size), alloc_size, stream, pool)
        self._reserved_total += alloc_size
        st = pool.stat_type
        increase(s.segment, st, 1)
        increase(s.reserved_bytes, st, alloc_size)
        if alloc_size >= self._max_split:
            s.oversize_segments.increase(1)
        s.num_device_alloc += 1
        if self.trace is not None:
            self._record("segment_alloc", block.ptr, alloc_size, stream, None)
        return block

    def _release_block(self, block: Block) -> None:
        """cudaFree a whole free non-expandable segment (``release_block``)."""
        pool = block.pool
        pool.remove(block)
        self._vacate(block.ptr)
        s = self.stats
        s.num_device_free += 1
        if self.trace is not None:
            self._record("segment_free", block.ptr, block.size, block.stream, None)
        self._reserved_total -= block.size
        st = pool.stat_type
        decrease(s.segment, st, 1)
        decrease(s.reserved_bytes, st, block.size)
        if block.size >= self._max_split:
            s.oversize_segments.decrease(1)

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        """Free oversize cached blocks, just enough for the request (spec 3.2)."""
        if not self._max_split_set:
            return False
        key_size = max(size, self._max_split)
        keys = pool.keys
        i = bisect_left(keys, pool_key(stream, key_size, 0))
        if i < len(keys) and key_fields(keys[i])[0] == stream:
            block = pool.free_at[keys[i] & _ADDRESS_MASK]
            if block.expandable is None and not block.is_split():
                self._release_block(block)
                return True
        # No single block is large enough: free oversize blocks from the largest downward.
        released = 0
        i -= 1
        while i >= 0 and released < key_size:
            st_, bsize, ptr = key_fields(keys[i])
            if st_ != stream or bsize < self._max_split:
                break
            block = pool.free_at[ptr]
            if block.expandable is None and not block.is_split():
                released += bsize
                self._release_block(block)
            i -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        """Synchronize, then free every whole free segment (``release_cached_blocks``, 3.4)."""
        self.stats.num_sync_all_streams += 1
        if self._pending:
            self._process_events()
        self._release_blocks(self.large_pool)
        self._release_blocks(self.small_pool)

    def _release_blocks(self, pool: BlockPool) -> None:
        to_unmap: list[Block] = []
        for key in list(pool.keys):
            block = pool.free_at[key & _ADDRESS_MASK]
            if block.expandable is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if block.prev is None and block.next is None and not block.mapped:
                # The whole virtual range is unmapped: drop the expandable segment.
                pool.remove_unmapped(block)
                assert block.expandable is not None
                self._expandable_segments.remove(block.expandable)
                self._vacate(block.expandable.base)

    def _garbage_collect(self) -> None:
        """Free old unsplit large cached blocks above the GC threshold (spec 3.3)."""
        allowed = self.allowed_bytes
        assert allowed is not None
        gc_limit = int(self.config.garbage_collection_threshold * allowed)
        if self._reserved_total <= gc_limit:
            return
        target = self._reserved_total - gc_limit
        pool = self.large_pool

        def candidates() -> list[Block]:
            blocks = (pool.free_at[key & _ADDRESS_MASK] for key in pool.keys)
            return [b for b in blocks if not b.is_split() and b.expandable is None]

        blocks = candidates()
        if not blocks:
            return
        total_age = float(sum(pool.calls - b.gc_count_base for b in blocks))
        count = len(blocks)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold = total_age / count
            freed = False
            for block in candidates():
                age = pool.calls - block.gc_count_base
                if age >= threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # ------------------------------------------------------------------ internals: expandable

    def _try_allocate_expandable_block(
        self, pool: BlockPool, stream: int, size: int
    ) -> Block | None:
        """Grow an expandable segment to hold ``size`` bytes (spec 4.4)."""
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped:
            if not self._map_block(candidate, min(candidate.size, size)):
                return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # nxt absorbed the old candidate when it was mapped
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """Lowest-address run of free + unmapped blocks with room for ``size`` (spec 4.4)."""
        unmapped = pool.unmapped
        i = bisect_left(unmapped, (stream, 0))
        while i < len(unmapped) and unmapped[i][0] == stream:
            c = pool.unmapped_at[unmapped[i][1]]
            if _allocatable(c.prev):
                assert c.prev is not None
                c = c.prev
            room = 0
            b: Block | None = c
            while room < size and _allocatable(b):
                assert b is not None
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.is_small else self.config.large_segment_size_bytes
        total = self.device_total_bytes or self.capacity_bytes or DEFAULT_VIRTUAL_DEVICE_BYTES
        num_pages = -(-(total * EXPANDABLE_VIRTUAL_NUM) // (EXPANDABLE_VIRTUAL_DEN * page))
        # A request beyond the device fails on capacity first; if the capacity is lifted (a
        # replay going on after an OOM), the range must still hold it.
        num_pages = max(num_pages, -(-size // page))
        es = _ExpandableSegment(self._reserve_address(page * num_pages), page, page * num_pages)
        self._expandable_segments.append(es)
        block = Block(es.base, es.size, stream, pool, es)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: Block, size: int) -> bool:
        """Map whole pages covering ``size`` bytes at the start of ``to_map`` (``map_block``)."""
        es = to_map.expandable
        assert es is not None and not to_map.mapped and size <= to_map.size
        page = es.page_size
        offset = to_map.ptr - es.base
        mapped = (-(-(offset + size) // page) - offset // page) * page
        if self.capacity_bytes is not None and (
            self._reserved_total + mapped > self.capacity_bytes
        ):
            return False
        pool = to_map.pool
        map_ptr = to_map.ptr
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.ptr + mapped, to_map.size - mapped, to_map.stream, pool, es)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            pool.insert_unmapped(rest)
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._reserved_total += mapped
        s = self.stats
        increase(s.reserved_bytes, pool.stat_type, mapped)
        s.num_device_alloc += 1
        if self.trace is not None:
            self._record("segment_map", map_ptr, mapped, to_map.stream, None)
        return True

    def _unmap_block(self, block: Block) -> None:
        """Unmap every page lying entirely inside free ``block`` (``unmap_block``, spec 4.5)."""
        es = block.expandable
        assert es is not None
        page = es.page_size
        offset = block.ptr - es.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        unmap_ptr = es.base + begin * page
        unmap_size = (end - begin) * page
        before = unmap_ptr - block.ptr
        if before > 0:
            head = Block(block.ptr, before, block.stream, pool, es)
            head.prev = block.prev
            if head.prev is not None:
                head.prev.next = head
            head.next = block
            block.prev = head
            pool.insert(head)
        after = block.size - before - unmap_size
        if after > 0:
            tail = Block(unmap_ptr + unmap_size, after, block.stream, pool, es)
            tail.next = block.next
            if tail.next is not None:
                tail.next.prev = tail
            tail.prev = block
            block.next = tail
            pool.insert(tail)
        block.ptr = unmap_ptr
        block.size = unmap_size
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self._reserved_total -= unmap_size
        s = self.stats
        decrease(s.reserved_bytes, pool.stat_type, unmap_size)
        s.num_device_free += 1
        if self.trace is not None:
            self._record("segment_unmap", unmap_ptr, unmap_size, block.stream, None)

    # ------------------------------------------------------------------ internals: OOM, trace

    def _out_of_memory(self, size: int, alloc_size: int, stream: int) -> OutOfMemoryError:
        """Count the OOM, trace it and build PyTorch's message (spec 3.5, 2.2+ wording)."""
        s = self.stats
        s.num_ooms += 1
        allocated = self.memory_allocated
        reserved = self.memory_reserved
        total = self.device_total_bytes or self.capacity_bytes or 0
        capacity = self.capacity_bytes if self.capacity_bytes is not None else total
        device_free = max(capacity - self._reserved_total, 0)
        if self.trace is not None:
            self.trace.append(
                {"action": "oom", "device_free": device_free, "size": size, "stream": stream}
            )
        proc_info = ""
        if total > capacity:
            # Non-PyTorch usage of this process (CUDA context, ...) = total - capacity.
            in_use = reserved + total - capacity
            proc_info = (
                "Including non-PyTorch memory, this process has "
                f"{format_size(in_use)} memory in use. "
            )
        allowed = self.allowed_bytes
        allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
        message = (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. "
            f"GPU {self.device} has a total capacity of {format_size(total)} "
            f"of which {format_size(device_free)} is free. {proc_info}{allowed_info}"
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, "
            f"and {format_size(reserved - allocated)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
            f"See documentation for Memory Management  ({OOM_DOCS_URL})"
        )
        return OutOfMemoryError(message, size_bytes=size, alloc_size_bytes=alloc_size)

    def _record(self, action: str, addr: int, size: int, stream: int, block: Block | None) -> None:
        assert self.trace is not None
        entry: dict[str, Any] = {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "frames": (block.frames or []) if block is not None else [],
        }
        # MemoryViz needs an "unknown" category whenever categories are used (spec 6.7).
        entry["category"] = (block.category if block is not None else None) or "unknown"
        self.trace.append(entry)

    # ------------------------------------------------------------------ introspection

    def segments(self) -> list[list[Block]]:
        """Blocks of every segment, each list in address order, segments by address.

        An expandable segment is reported as one segment per contiguous mapped range, as
        ``torch.cuda.memory_snapshot()`` does (spec 4.6). Unmapped blocks are left out.
        """
        blocks: list[Block] = list(self._allocated.values())
        blocks += self._pending
        for pool in (self.small_pool, self.large_pool):
            blocks += pool.free_at.values()
        out: list[list[Block]] = []
        for b in blocks:
            if b.prev is not None and b.prev.mapped:
                continue
            seg: list[Block] = []
            cur: Block | None = b
            while cur is not None and cur.mapped:
                seg.append(cur)
                cur = cur.next
            out.append(seg)
        out.sort(key=lambda seg: seg[0].ptr)
        return out

    def all_blocks(self) -> list[Block]:
        """Every block, mapped or not, segment by segment in address order."""
        blocks: list[Block] = list(self._allocated.values())
        blocks += self._pending
        for pool in (self.small_pool, self.large_pool):
            blocks += pool.free_at.values()
            blocks += pool.unmapped_at.values()
        out: list[Block] = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.ptr):
            cur: Block | None = head
            while cur is not None:
                out.append(cur)
                cur = cur.next
        return out

    def check_invariants(self) -> None:
        """Check the simulator's internal consistency (a fuzzing aid, tinygrad style).

        Checks that blocks tile their segments, sizes are multiples of 512 B, no two free mapped
        neighbours were left unmerged, segments never overlap, the pools index exactly the free
        blocks, and the current statistics equal the sums over blocks (spec section 5.1 and 10);
        the statistics only with ``full_stats=True`` (a lean simulator fails that part, Note
        [Lean statistics]).

        Raises:
            AssertionError: naming the first invariant that does not hold.
        """
        blocks = self.all_blocks()
        small, large = self.small_pool.stat_type, self.large_pool.stat_type
        sums = {
            key: [0, 0, 0]
            for key in ("allocated", "active", "requested", "reserved", "split", "split_n")
        }
        sums["segments"] = [0, 0, 0]
        last_end = 0
        for b in blocks:
            st = b.pool.stat_type
            assert b.size > 0 and b.size % K_MIN_BLOCK_SIZE == 0, f"block size {b.size}"
            assert b.ptr >= last_end, f"block at {b.ptr:#x} overlaps the previous one"
            last_end = b.ptr + b.size
            if b.next is not None:
                assert b.next.prev is b and b.next.ptr == b.ptr + b.size, "blocks do not tile"
            if b.prev is None and b.expandable is None:
                seg = 0
                cur: Block | None = b
                while cur is not None:
                    seg += cur.size
                    cur = cur.next
                assert seg % K_SMALL_BUFFER == 0, f"segment size {seg} not a multiple of 2 MiB"
                sums["segments"][st] += 1
            pending = b in self._pending
            free = not b.allocated and not pending
            if b.mapped:
                sums["reserved"][st] += b.size
            if b.allocated:
                sums["allocated"][st] += b.size
            if b.allocated or pending:
                sums["active"][st] += b.size
                sums["requested"][st] += b.requested_size
            if free and b.mapped:
                assert b.pool.free_at.get(b.ptr) is b, "free block missing from its pool"
                nxt = b.next
                assert not (
                    nxt is not None
                    and nxt.mapped
                    and not nxt.allocated
                    and nxt not in self._pending
                ), "two adjacent free blocks were not merged"
                if b.is_split() and b.expandable is None:
                    sums["split"][st] += b.size
                    sums["split_n"][st] += 1
            if not b.mapped:
                assert b.pool.unmapped_at.get(b.ptr) is b, "unmapped block missing from its pool"
        for pool in (self.small_pool, self.large_pool):
            assert pool.keys == sorted(pool.keys), "pool keys out of order"
            assert len(pool.keys) == len(pool.free_at), "pool index out of sync"
            for pool_key_ in pool.keys:
                stream, size, ptr = key_fields(pool_key_)
                b = pool.free_at[ptr]
                assert (b.stream, b.size, b.ptr) == (stream, size, ptr), "stale pool key"
        s = self.stats
        pairs = (
            ("allocated_bytes", "allocated"),
            ("active_bytes", "active"),
            ("requested_bytes", "requested"),
            ("reserved_bytes", "reserved"),
            ("inactive_split_bytes", "split"),
            ("inactive_split", "split_n"),
            ("segment", "segments"),
        )
        for stat_name, key in pairs:
            stat = getattr(s, stat_name)
            for st in (small, large):
                assert stat[st].current == sums[key][st], (
                    f"{stat_name}[{st}] = {stat[st].current}, blocks say {sums[key][st]}"
                )
            assert stat[0].current == stat[small].current + stat[large].current, stat_name
            for x in stat:
                assert x.peak >= x.current, f"{stat_name} peak below current"
        assert s.allocation[0].current == len(self._allocated), "allocation count"
        assert self._reserved_total == s.reserved_bytes[0].current, "reserved total"

    def live_blocks(self) -> list[Block]:
        """Allocated blocks, by address."""
        return sorted(self._allocated.values(), key=lambda b: b.ptr)

    def pending_blocks(self) -> list[Block]:
        """Freed blocks waiting for cross-stream events (``active_pending_free``)."""
        return list(self._pending)


def _expandable_size(block: Block) -> int:
    """Size the block could grow to: itself plus a following unmapped block (spec 4.3)."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _allocatable(block: Block | None) -> bool:
    return (
        block is not None
        and not block.allocated
        and block.event_count == 0
        and not block.stream_uses
    )
