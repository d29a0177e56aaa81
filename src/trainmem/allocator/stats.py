"""Allocator statistics named exactly like ``torch.cuda.memory_stats()`` keys.

Each array stat has ``{all,small_pool,large_pool}`` x ``{current,peak,allocated,freed}``; the
``all`` entry is updated together with the pool entry, as ``for_each_selected_stat_type`` does in
CUDACachingAllocator.cpp. Peaks are updated on every increase (``peak = max(peak, current)``).

Source: ../shared/specs/cuda-caching-allocator.md section 5.1; ``increase_stat`` /
``decrease_stat`` in c10/cuda/CUDACachingAllocator.cpp
(https://github.com/pytorch/pytorch/blob/eb42ad6eca0ce61e7c581212b4bf32f991425571/c10/cuda/CUDACachingAllocator.cpp).
"""

from __future__ import annotations

#: Index of each stat type in a stat array (``StatType`` in c10).
ALL, SMALL_POOL, LARGE_POOL = 0, 1, 2
STAT_TYPE_NAMES: tuple[str, ...] = ("all", "small_pool", "large_pool")

#: Array stats, each one ``[all, small_pool, large_pool]``.
ARRAY_STATS: tuple[str, ...] = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)

#: Plain counters with current/peak/allocated/freed but no pool split.
SINGLE_STATS: tuple[str, ...] = ("oversize_allocations", "oversize_segments")

#: Scalar counters.
SCALAR_STATS: tuple[str, ...] = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)


class Stat:
    """One counter: ``current``, ``peak``, and the cumulative ``allocated`` / ``freed``."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        """Add ``amount`` (bytes or a count) and update the peak."""
        self.current += amount
        if self.current > self.peak:
            self.peak = self.current
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        """Subtract ``amount``; never below zero (PyTorch asserts the same)."""
        self.current -= amount
        assert self.current >= 0, "negative allocator stat (logic error)"
        self.freed += amount


def increase(stat_array: list[Stat], pool_type: int, amount: int) -> None:
    """Increase the ``all`` entry and the ``pool_type`` entry of a stat array."""
    # NB: unrolled (no loop over a tuple): called several times per simulated malloc
    s = stat_array[ALL]
    current = s.current = s.current + amount
    if current > s.peak:
        s.peak = current
    s.allocated += amount
    s = stat_array[pool_type]
    current = s.current = s.current + amount
    if current > s.peak:
        s.peak = current
    s.allocated += amount


def decrease(stat_array: list[Stat], pool_type: int, amount: int) -> None:
    """Decrease the ``all`` entry and the ``pool_type`` entry of a stat array."""
    # NB: unrolled, as :func:`increase`
    s = stat_array[ALL]
    s.current -= amount
    assert s.current >= 0, "negative allocator stat (logic error)"
    s.freed += amount
    s = stat_array[pool_type]
    s.current -= amount
    assert s.current >= 0, "negative allocator stat (logic error)"
    s.freed += amount


class DeviceStats:
    """All statistics of one simulated device (``DeviceStats`` in c10)."""

    def __init__(self) -> None:
        self.allocation = [Stat(), Stat(), Stat()]
        self.segment = [Stat(), Stat(), Stat()]
        self.active = [Stat(), Stat(), Stat()]
        self.inactive_split = [Stat(), Stat(), Stat()]
        self.allocated_bytes = [Stat(), Stat(), Stat()]
        self.reserved_bytes = [Stat(), Stat(), Stat()]
        self.active_bytes = [Stat(), Stat(), Stat()]
        self.inactive_split_bytes = [Stat(), Stat(), Stat()]
        self.requested_bytes = [Stat(), Stat(), Stat()]
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    def as_dict(self, max_split_size: int) -> dict[str, int]:
        """Flatten to ``torch.cuda.memory_stats()`` keys, sorted as torch sorts them.

        Args:
            max_split_size: the ``max_split_size`` entry, -1 when unlimited (SIZE_MAX as int64).

        Returns:
            ``{"allocated_bytes.all.current": ..., "num_ooms": ..., ...}``.
        """
        out: dict[str, int] = {}
        for name in ARRAY_STATS:
            for type_name, s in zip(STAT_TYPE_NAMES, getattr(self, name), strict=True):
                prefix = f"{name}.{type_name}."
                out[prefix + "current"] = s.current
                out[prefix + "peak"] = s.peak
                out[prefix + "allocated"] = s.allocated
                out[prefix + "freed"] = s.freed
        for name in SINGLE_STATS:
            s = getattr(self, name)
            out[f"{name}.current"] = s.current
            out[f"{name}.peak"] = s.peak
            out[f"{name}.allocated"] = s.allocated
            out[f"{name}.freed"] = s.freed
        for name in SCALAR_STATS:
            out[name] = getattr(self, name)
        out["max_split_size"] = max_split_size
        return dict(sorted(out.items()))

    def _all_stats(self) -> list[Stat]:
        stats = [s for name in ARRAY_STATS for s in getattr(self, name)]
        return [*stats, self.oversize_allocations, self.oversize_segments]

    def reset_peak(self) -> None:
        """Set every peak to its current value (``torch.cuda.reset_peak_memory_stats``)."""
        for s in self._all_stats():
            s.peak = s.current

    def reset_accumulated(self) -> None:
        """Zero the allocated/freed counters and the scalars
        (``torch.cuda.reset_accumulated_memory_stats``)."""
        for s in self._all_stats():
            s.allocated = 0
            s.freed = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
