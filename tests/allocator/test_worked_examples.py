"""The worked examples E1-E11 of ../shared/specs/cuda-caching-allocator.md section 8.

Every expected number below is copied from the spec's tables (derived there by hand from
c10/cuda/CUDACachingAllocator.cpp), never from this simulator's output. Columns: A =
allocated_bytes, R = reserved_bytes, Req = requested_bytes, IS = inactive_split_bytes / count,
Seg = segment count (all ``.all.current``).
"""

from __future__ import annotations

import pytest

from trainmem.allocator.caching import CachingAllocatorSim, OutOfMemoryError
from trainmem.allocator.config import AllocatorConfig

MiB = 1_048_576


def cur(sim: CachingAllocatorSim, name: str) -> int:
    return sim.memory_stats()[f"{name}.all.current"]


def state(sim: CachingAllocatorSim) -> tuple[int, int, int, int, int, int]:
    """(A, R, Req, IS bytes, IS count, Seg)."""
    return (
        cur(sim, "allocated_bytes"),
        cur(sim, "reserved_bytes"),
        cur(sim, "requested_bytes"),
        cur(sim, "inactive_split_bytes"),
        cur(sim, "inactive_split"),
        cur(sim, "segment"),
    )


def make(alloc_conf: str = "", capacity_bytes: int | None = None) -> CachingAllocatorSim:
    return CachingAllocatorSim(capacity_bytes, AllocatorConfig.from_string(alloc_conf))


def test_e1_small_pool() -> None:
    sim = make()
    a = sim.malloc(1)
    assert state(sim) == (512, 2_097_152, 1, 2_096_640, 1, 1)
    b = sim.malloc(1000)
    assert state(sim) == (1_536, 2_097_152, 1_001, 2_095_616, 1, 1)
    c = sim.malloc(1_048_576)
    assert state(sim) == (1_050_112, 2_097_152, 1_049_577, 1_047_040, 1, 1)
    d = sim.malloc(1_048_576)
    assert state(sim) == (2_098_688, 4_194_304, 2_098_153, 2_095_616, 2, 2)
    sim.free(a)
    assert state(sim) == (2_098_176, 4_194_304, 2_098_152, 2_096_128, 3, 2)
    sim.free(b)
    assert state(sim) == (2_097_152, 4_194_304, 2_097_152, 2_097_152, 3, 2)
    sim.empty_cache()
    assert state(sim) == (2_097_152, 4_194_304, 2_097_152, 2_097_152, 3, 2)
    sim.free(c)
    assert state(sim) == (1_048_576, 4_194_304, 1_048_576, 1_048_576, 1, 2)
    sim.empty_cache()
    assert state(sim) == (1_048_576, 2_097_152, 1_048_576, 1_048_576, 1, 1)
    sim.free(d)
    sim.empty_cache()
    assert state(sim) == (0, 0, 0, 0, 0, 0)
    assert sim.max_memory_allocated == 2_098_688
    assert sim.max_memory_reserved == 4_194_304
    # Everything here is in the small pool.
    stats = sim.memory_stats()
    assert stats["reserved_bytes.small_pool.peak"] == 4_194_304
    assert stats["reserved_bytes.large_pool.peak"] == 0


def test_e2_medium_requests_share_a_20mib_segment() -> None:
    sim = make()
    a = sim.malloc(1_048_577)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (1_049_088, 20_971_520, 19_922_432, 1)
    b = sim.malloc(8_388_608)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (9_437_696, 20_971_520, 11_533_824, 1)
    c = sim.malloc(10_485_760)
    A, R, Req, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (20_971_520, 20_971_520, 0, 0)
    assert Req == 19_922_945
    assert sim.block_size_of(c) == 11_533_824  # unsplit: remainder 1,048,064 <= 1 MiB
    sim.free(b)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (12_582_912, 20_971_520, 8_388_608, 1)
    sim.free(a)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (11_533_824, 20_971_520, 9_437_696, 1)
    sim.free(c)
    sim.empty_cache()
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (0, 0, 0, 0)
    assert sim.memory_stats()["segment.large_pool.peak"] == 1


def test_e3_large_requests_and_the_exactly_1mib_rule() -> None:
    sim = make()
    a = sim.malloc(10_485_760)
    assert (cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes"), cur(sim, "segment")) == (
        10_485_760,
        10_485_760,
        1,
    )
    b = sim.malloc(11_534_337)
    assert (cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes"), cur(sim, "segment")) == (
        23_068_672,
        23_068_672,
        2,
    )
    assert sim.block_size_of(b) == 12_582_912
    sim.free(a)
    assert (cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes"), cur(sim, "segment")) == (
        12_582_912,
        23_068_672,
        2,
    )
    c = sim.malloc(9_437_184)
    assert (cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes"), cur(sim, "segment")) == (
        23_068_672,
        23_068_672,
        2,
    )
    assert sim.block_size_of(c) == 10_485_760  # remainder exactly 1 MiB: not split
    sim.free(c)
    d = sim.malloc(8_388_608)
    assert (cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes"), cur(sim, "segment")) == (
        20_971_520,
        23_068_672,
        2,
    )
    assert sim.block_size_of(d) == 8_388_608
    assert (cur(sim, "inactive_split_bytes"), cur(sim, "inactive_split")) == (2_097_152, 1)


def test_e4_fragmentation_forces_a_new_segment() -> None:
    sim = make()
    a, b, c = (sim.malloc(6 * MiB) for _ in range(3))
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (18_874_368, 20_971_520, 2_097_152, 1)
    sim.free(a)
    sim.free(c)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (6_291_456, 20_971_520, 14_680_064, 2)
    sim.malloc(10 * MiB)
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (16_777_216, 31_457_280, 14_680_064, 2)
    sim.empty_cache()
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (16_777_216, 31_457_280, 14_680_064, 2)
    sim.free(b)
    sim.empty_cache()
    A, R, _, IS, ISn, _ = state(sim)
    assert (A, R, IS, ISn) == (10_485_760, 10_485_760, 0, 0)
    assert sim.max_memory_reserved == 31_457_280
    assert sim.max_memory_allocated == 18_874_368


@pytest.mark.parametrize(
    ("alloc_conf", "expected_a", "expected_b", "expected_c"),
    [
        ("", (104_857_600, 104_857_600), (106_954_752, 211_812_352), (106_954_752, 211_812_352)),
        (
            "expandable_segments:True",
            (104_857_600, 104_857_600),
            (105_906_176, 125_829_120),
            (106_954_752, 125_829_120),
        ),
    ],
)
def test_e5_growing_request(
    alloc_conf: str,
    expected_a: tuple[int, int],
    expected_b: tuple[int, int],
    expected_c: tuple[int, int],
) -> None:
    sim = make(alloc_conf)

    def a_r() -> tuple[int, int]:
        return cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes")

    a = sim.malloc(100 * MiB)
    assert a_r() == expected_a
    sim.free(a)
    b = sim.malloc(101 * MiB)
    assert a_r() == expected_b
    sim.free(b)
    c = sim.malloc(102 * MiB)
    assert a_r() == expected_c
    assert sim.max_memory_reserved == expected_b[1]
    if alloc_conf:
        assert sim.memory_stats()["segment.all.peak"] == 0  # mappings are not segments
    sim.free(c)
    sim.empty_cache()
    assert a_r() == (0, 0)


def test_e6_max_split_size_default() -> None:
    sim = make()
    a = sim.malloc(200 * MiB)
    sim.free(a)
    assert cur(sim, "reserved_bytes") == 200 * MiB
    b = sim.malloc(50 * MiB)
    assert sim.block_size_of(b) == 50 * MiB
    assert cur(sim, "reserved_bytes") == 200 * MiB
    sim.free(b)
    c = sim.malloc(190 * MiB)
    assert sim.block_size_of(c) == 190 * MiB
    assert cur(sim, "reserved_bytes") == 200 * MiB
    sim.free(c)
    d = sim.malloc(170 * MiB)
    assert sim.block_size_of(d) == 170 * MiB
    assert cur(sim, "reserved_bytes") == 200 * MiB


def test_e6_max_split_size_100() -> None:
    sim = make("max_split_size_mb:100")
    a = sim.malloc(200 * MiB)
    sim.free(a)
    assert cur(sim, "reserved_bytes") == 200 * MiB
    b = sim.malloc(50 * MiB)  # rule A: 50 < 100 and the 200 MiB block is oversize
    assert sim.block_size_of(b) == 50 * MiB
    assert cur(sim, "reserved_bytes") == 250 * MiB
    sim.free(b)
    c = sim.malloc(190 * MiB)  # rule B passes: 200 < 190 + 20; oversize blocks never split
    assert sim.block_size_of(c) == 200 * MiB
    assert cur(sim, "allocated_bytes") == 200 * MiB
    assert cur(sim, "reserved_bytes") == 250 * MiB
    sim.free(c)
    d = sim.malloc(170 * MiB)  # rule B refuses: 200 >= 170 + 20
    assert sim.block_size_of(d) == 170 * MiB
    assert cur(sim, "reserved_bytes") == 420 * MiB
    stats = sim.memory_stats()
    assert stats["max_split_size"] == 100 * MiB
    assert stats["oversize_segments.current"] == 2  # the 200 and 170 MiB segments
    assert stats["oversize_allocations.current"] == 1


@pytest.mark.parametrize(
    ("request_bytes", "with_div4", "default"),
    [
        (1, 512, 512),
        (513, 1024, 1024),
        (1200, 1536, 1536),
        (1_300_000, 1_310_720, 1_300_480),
        (734_003_201, 805_306_368, 734_003_712),
    ],
)
def test_e7_rounding_single_value(request_bytes: int, with_div4: int, default: int) -> None:
    assert make("roundup_power2_divisions:4").round_size(request_bytes) == with_div4
    assert make().round_size(request_bytes) == default


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (100 * MiB + 1, 104_858_112),
        (700 * MiB, 768 * MiB),
        (1500 * MiB, 1536 * MiB),
        (3000 * MiB, 3072 * MiB),
        (1100 * MiB, 1280 * MiB),
    ],
)
def test_e7_rounding_list(request_bytes: int, expected: int) -> None:
    sim = make("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert sim.round_size(request_bytes) == expected


def test_e7_rounding_list_before_2_9_overwrites_last_bucket() -> None:
    config = AllocatorConfig.from_string(
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", torch_version=(2, 8)
    )
    assert CachingAllocatorSim(None, config).round_size(1100 * MiB) == 1152 * MiB


def test_e8_flush_and_retry_then_oom() -> None:
    sim = make(capacity_bytes=80 * MiB)
    x1 = sim.malloc(30 * MiB)
    sim.malloc(30 * MiB)
    assert cur(sim, "reserved_bytes") == 60 * MiB
    sim.free(x1)
    assert cur(sim, "reserved_bytes") == 60 * MiB
    sim.malloc(40 * MiB)
    assert cur(sim, "reserved_bytes") == 70 * MiB
    assert cur(sim, "allocated_bytes") == 70 * MiB
    assert sim.memory_stats()["num_alloc_retries"] == 1
    with pytest.raises(OutOfMemoryError) as info:
        sim.malloc(20 * MiB)
    stats = sim.memory_stats()
    assert stats["num_alloc_retries"] == 2
    assert stats["num_ooms"] == 1
    message = str(info.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 20.00 MiB.")
    assert (
        "Of the allocated memory 70.00 MiB is allocated by PyTorch, and 0 bytes is reserved by "
        "PyTorch but unallocated." in message
    )


def test_e8_small_request_prints_segment_size() -> None:
    sim = make(capacity_bytes=80 * MiB)
    sim.malloc(70 * MiB)
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 20\.00 MiB\."):
        sim.malloc(5 * MiB)


def test_e9_expandable_page_growth_and_partial_unmap() -> None:
    sim = make("expandable_segments:True")

    def a_r() -> tuple[int, int]:
        return cur(sim, "allocated_bytes"), cur(sim, "reserved_bytes")

    a = sim.malloc(5 * MiB)
    assert a_r() == (5_242_880, 20_971_520)
    b = sim.malloc(30 * MiB)
    assert a_r() == (36_700_160, 41_943_040)
    assert b - a == 5 * MiB  # b is placed right after a, at offset 5 MiB
    c = sim.malloc(1000)
    assert a_r() == (36_701_184, 44_040_192)
    sim.free(b)
    assert a_r() == (5_243_904, 44_040_192)
    sim.empty_cache()
    assert a_r() == (5_243_904, 23_068_672)
    sim.free(a)
    sim.empty_cache()
    assert a_r() == (1_024, 2_097_152)
    assert c != 0


def test_e9_expandable_tail_preference() -> None:
    sim = make("expandable_segments:True")
    x30 = sim.malloc(30 * MiB)
    sim.malloc(10 * MiB)
    sim.malloc(15 * MiB)
    assert cur(sim, "reserved_bytes") == 60 * MiB
    sim.free(x30)
    y = sim.malloc(4 * MiB)
    assert y == x30  # offset 0, inside the interior hole, not in the 5 MiB tail
    assert cur(sim, "allocated_bytes") == 29 * MiB
    assert cur(sim, "reserved_bytes") == 60 * MiB


def test_e10a_release_available_frees_one_oversize_block() -> None:
    sim = make("max_split_size_mb:100", capacity_bytes=300 * MiB)
    a = sim.malloc(200 * MiB)
    sim.free(a)
    sim.malloc(150 * MiB)
    assert cur(sim, "reserved_bytes") == 150 * MiB
    assert sim.memory_stats()["num_alloc_retries"] == 0


@pytest.mark.parametrize(("alloc_conf", "retries"), [("max_split_size_mb:100", 0), ("", 1)])
def test_e10b_release_available_frees_several(alloc_conf: str, retries: int) -> None:
    sim = make(alloc_conf, capacity_bytes=300 * MiB)
    x, y = sim.malloc(120 * MiB), sim.malloc(120 * MiB)
    sim.free(x)
    sim.free(y)
    assert cur(sim, "reserved_bytes") == 240 * MiB
    sim.malloc(200 * MiB)
    assert cur(sim, "reserved_bytes") == 200 * MiB
    assert sim.memory_stats()["num_alloc_retries"] == retries


def test_e11_streams_do_not_share_cached_memory() -> None:
    sim = make()
    a = sim.malloc(4 * MiB, stream=1)
    sim.free(a)
    sim.malloc(4 * MiB, stream=2)
    assert cur(sim, "reserved_bytes") == 40 * MiB
    assert cur(sim, "allocated_bytes") == 4 * MiB


def test_e11_record_stream_delays_the_free() -> None:
    sim = make()
    a = sim.malloc(4 * MiB, stream=1)
    sim.record_stream(a, 2)
    sim.free(a)
    assert cur(sim, "allocated_bytes") == 0
    assert cur(sim, "active_bytes") == 4 * MiB
    assert [b.ptr for b in sim.pending_blocks()] == [a]
    # Default completion-lag model: the event completes at the next malloc (spec 2.8).
    sim.malloc(512, stream=1)
    assert cur(sim, "active_bytes") == 512
    assert sim.pending_blocks() == []
