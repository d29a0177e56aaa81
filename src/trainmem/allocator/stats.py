"""Allocator statistics named exactly like ``torch.cuda.memory_stats()`` keys.

Each array stat has ``{all,small_pool,large_pool}`` x ``{current,peak,allocated,freed}``; the
``all`` entry is updated together with the pool entry, as ``for_each_selected_stat_type`` does in
CUDACachingAllocator.cpp. Peaks are updated on every increase (``peak = max(peak, current)``).

Source: ../shared/specs/cuda-caching-allocator.md section 5.1; ``increase_stat`` /
``decrease_stat`` in c10/cuda/CUDACachingAllocator.cpp
(https://github.com/pytorch/pytorch/blob/eb42ad6eca0ce61e7c581212b4bf32f991425571/c10/cuda/CUDACachingAllocator.cpp).
"""

from __future__ import annotations

from functools import cache

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


_FIELDS: tuple[str, ...] = ("current", "peak", "allocated", "freed")


@cache
def _keys(prefixes: tuple[str, ...] | None) -> tuple[tuple[str, str, int | None, str], ...]:
    """``(key, stat name, stat type index or None, field or "")`` of every ``memory_stats()``
    key that starts with one of ``prefixes`` (None: all), in sorted key order: the names are
    built once, not at every :meth:`DeviceStats.as_dict` (the planner's replays ask for the
    statistics once each)."""
    rows: list[tuple[str, str, int | None, str]] = [
        (f"{name}.{type_name}.{field}", name, index, field)
        for name in ARRAY_STATS
        for index, type_name in enumerate(STAT_TYPE_NAMES)
        for field in _FIELDS
    ]
    rows += [(f"{name}.{field}", name, None, field) for name in SINGLE_STATS for field in _FIELDS]
    rows += [(name, name, None, "") for name in (*SCALAR_STATS, "max_split_size")]
    return tuple(sorted(row for row in rows if prefixes is None or row[0].startswith(prefixes)))


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

    def as_dict(
        self, max_split_size: int, prefixes: tuple[str, ...] | None = None
    ) -> dict[str, int]:
        """Flatten to ``torch.cuda.memory_stats()`` keys, sorted as torch sorts them.

        Args:
            max_split_size: the ``max_split_size`` entry, -1 when unlimited (SIZE_MAX as int64).
            prefixes: keep only the keys that start with one of these (None: every key).

        Returns:
            ``{"allocated_bytes.all.current": ..., "num_ooms": ..., ...}``.
        """
        out: dict[str, int] = {}
        for key, name, index, field in _keys(prefixes):
            if not field:  # a scalar counter
                out[key] = max_split_size if name == "max_split_size" else getattr(self, name)
            elif index is None:
                out[key] = getattr(getattr(self, name), field)
            else:
                out[key] = getattr(getattr(self, name)[index], field)
        return out

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
