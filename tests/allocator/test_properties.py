"""Property tests: random malloc/free/empty_cache sequences keep the allocator's invariants.

Invariants (STYLE.md section 7 and spec section 10): reserved >= allocated, every block size is a
multiple of 512, live blocks never overlap, blocks tile their segments, the stats equal the sums
over blocks, and freeing everything brings allocated (and, after ``empty_cache``, reserved) back
to 0. ``CachingAllocatorSim.check_invariants`` checks the block-level ones after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmem.allocator.caching import CachingAllocatorSim, OutOfMemoryError
from trainmem.allocator.config import AllocatorConfig

MiB = 1_048_576

CONFIGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:20",
    "max_split_size_mb:40,max_non_split_rounding_mb:30",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,4:4,>:8],expandable_segments:True",
]

sizes = st.one_of(
    st.integers(1, 2 * MiB),  # small pool and the 1 MiB boundary
    st.integers(1 * MiB, 12 * MiB),  # 20 MiB segments, split thresholds
    st.integers(10 * MiB, 80 * MiB),  # own segments, oversize with max_split 20/40
    st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB, 20 * MiB, 21 * MiB]),
)

op = st.one_of(
    st.tuples(st.just("malloc"), sizes, st.sampled_from([0, 0, 0, 7])),
    st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("record_stream"), st.integers(0, 10_000), st.just(3)),
    st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
)


def _run(
    alloc_conf: str, capacity_bytes: int | None, ops: list[tuple[str, int, int]]
) -> CachingAllocatorSim:
    sim = CachingAllocatorSim(capacity_bytes, AllocatorConfig.from_string(alloc_conf))
    live: list[tuple[int, int]] = []  # (handle, requested bytes)
    expandable = "expandable" in alloc_conf
    for name, arg, stream in ops:
        if name == "malloc":
            try:
                handle = sim.malloc(arg, stream)
            except OutOfMemoryError:
                assert capacity_bytes is not None
                assert sim.memory_reserved <= capacity_bytes
            else:
                live.append((handle, arg))
                block = sim.block_size_of(handle)
                rounded = sim.round_size(arg)
                assert block >= rounded and block % 512 == 0
                if block < sim.config.max_split_size_bytes and rounded > 1 * MiB:
                    # Large-pool tail: at most 1 MiB (or < 512 B with expandable segments).
                    assert block - rounded <= (511 if expandable else 1 * MiB)
                elif rounded <= 1 * MiB:
                    assert block - rounded < 512
        elif name in ("free", "record_stream") and live:
            handle, _ = live[arg % len(live)]
            if name == "free":
                live.remove((handle, _))
                sim.free(handle)
            else:
                sim.record_stream(handle, stream)
        elif name == "empty_cache":
            sim.empty_cache()
        sim.check_invariants()
        stats = sim.memory_stats()
        assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
        assert stats["active_bytes.all.current"] >= stats["allocated_bytes.all.current"]
        assert (
            stats["inactive_split_bytes.all.current"]
            <= stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
        )
        assert stats["allocation.all.current"] == len(live)
        if capacity_bytes is not None:
            assert stats["reserved_bytes.all.peak"] <= capacity_bytes
        # Live blocks never overlap.
        spans = sorted((b.ptr, b.ptr + b.size) for b in sim.live_blocks())
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start
    for handle, _ in live:
        sim.free(handle)
    sim.check_invariants()
    assert sim.memory_allocated == 0
    sim.empty_cache()
    sim.check_invariants()
    stats = sim.memory_stats()
    for key in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes"):
        assert stats[f"{key}.all.current"] == 0, key
    for key in ("allocation", "active", "segment", "inactive_split"):
        assert stats[f"{key}.all.current"] == 0, key
    assert stats["allocated_bytes.all.peak"] <= stats["reserved_bytes.all.peak"]
    # Accumulated counters balance once everything is released.
    for key in ("allocated_bytes", "reserved_bytes", "requested_bytes", "segment"):
        assert stats[f"{key}.all.allocated"] == stats[f"{key}.all.freed"], key
    return sim


@pytest.mark.parametrize("alloc_conf", CONFIGS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=100))
def test_random_sequences_unlimited(alloc_conf: str, ops: list[tuple[str, int, int]]) -> None:
    _run(alloc_conf, None, ops)


@pytest.mark.parametrize("alloc_conf", CONFIGS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=100), capacity_mib=st.integers(40, 200))
def test_random_sequences_with_capacity(
    alloc_conf: str, ops: list[tuple[str, int, int]], capacity_mib: int
) -> None:
    _run(alloc_conf, capacity_mib * MiB, ops)


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 2**36), divisions=st.sampled_from([0, 1, 2, 4, 8, 16]))
def test_round_size_is_a_multiple_of_512_and_covers_the_request(size: int, divisions: int) -> None:
    conf = f"roundup_power2_divisions:{divisions}" if divisions else ""
    sim = CachingAllocatorSim(None, AllocatorConfig.from_string(conf))
    rounded = sim.round_size(size)
    assert rounded >= size and rounded % 512 == 0
    assert rounded - size < max(512, size // max(divisions, 1))
