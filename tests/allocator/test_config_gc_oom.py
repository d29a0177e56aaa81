"""PYTORCH_CUDA_ALLOC_CONF parsing, the garbage collector, the memory-fraction cap, format_size
and the OOM message. Expected values derived by hand from spec sections 1.5, 3.1, 3.3 and 3.5."""

from __future__ import annotations

import pytest

from trainmem.allocator import CachingAllocatorSim, OutOfMemoryError, format_size
from trainmem.allocator.config import AllocatorConfig
from trainmem.errors import SpecError, UnsupportedError

MiB = 1_048_576


def test_defaults_and_whitespace() -> None:
    cfg = AllocatorConfig.from_string(" max_split_size_mb : 100 , expandable_segments:True ")
    assert cfg.max_split_size_bytes == 100 * MiB and cfg.expandable_segments
    assert AllocatorConfig.from_string("") == AllocatorConfig(alloc_conf="")
    cfg = AllocatorConfig.from_string("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # Key K sets bucket log2(K); the first key fills the buckets below; '>' the ones after (2.9+).
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert cfg.roundup_power2_divisions_dict()["1024"] == 4


def test_no_effect_options_are_accepted_and_listed() -> None:
    cfg = AllocatorConfig.from_string("release_lock_on_cudamalloc:True,backend:native")
    assert cfg.ignored_options == ("release_lock_on_cudamalloc",)


@pytest.mark.parametrize(
    "conf",
    [
        "max_split_size_mb:10",
        "max_split_size_mb:abc",
        "max_non_split_rounding_mb:5",
        "garbage_collection_threshold:1.0",
        "garbage_collection_threshold:0",
        "per_process_memory_fraction:1.5",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[100:2]",
        "roundup_power2_divisions:[>:2]",
        "expandable_segments:yes",
        "large_segment_size_mb:10",
        "not_an_option:1",
        "max_split_size_mb",
        "roundup_power2_divisions:[1:2",
        "backend:other",
    ],
)
def test_bad_values_raise_spec_error(conf: str) -> None:
    with pytest.raises(SpecError):
        AllocatorConfig.from_string(conf)


def test_cuda_malloc_async_is_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="cudaMallocAsync"):
        AllocatorConfig.from_string("backend:cudaMallocAsync")


def test_large_segment_size_changes_medium_segments() -> None:
    sim = CachingAllocatorSim(config=AllocatorConfig.from_string("large_segment_size_mb:32"))
    sim.malloc(5 * MiB)  # 1-10 MiB request: one large_segment_size segment
    assert sim.memory_reserved == 32 * MiB


def _gc_sequence(sim: CachingAllocatorSim) -> None:
    """x = 30 MiB and y = 20 MiB, both freed; y is reused twice (young), then a 45 MiB miss."""
    x, y = sim.malloc(30 * MiB), sim.malloc(20 * MiB)
    sim.free(x)
    sim.free(y)
    for _ in range(2):
        sim.free(sim.malloc(20 * MiB))  # exact reuse of y: y's age restarts
    sim.malloc(45 * MiB)  # rounds to a 46 MiB segment


def test_garbage_collector_releases_old_blocks_first() -> None:
    # allowed = 0.8 * 100 MiB = 80 MiB; GC limit = 0.5 * 80 = 40 MiB. At the 45 MiB miss
    # reserved = 50 > 40, target 10; ages: x = 5 - 2 = 3, y = 5 - 4 = 1, mean 2: x goes (30 MiB
    # >= 10), y stays. Then 20 + 46 = 66 <= 80: no retry.
    conf = "per_process_memory_fraction:0.8,garbage_collection_threshold:0.5"
    sim = CachingAllocatorSim(
        config=AllocatorConfig.from_string(conf), device_total_bytes=100 * MiB
    )
    _gc_sequence(sim)
    stats = sim.memory_stats()
    assert sim.memory_reserved == 66 * MiB
    assert stats["segment.all.current"] == 2
    assert stats["num_alloc_retries"] == 0


@pytest.mark.parametrize(
    ("conf", "capacity"),
    [
        ("per_process_memory_fraction:0.8", None),  # cap, no GC
        ("garbage_collection_threshold:0.5", 80 * MiB),  # GC needs a fraction: off
    ],
)
def test_without_gc_the_cap_forces_a_full_flush(conf: str, capacity: int | None) -> None:
    # 50 + 46 > 80: cudaMalloc fails, release_cached_blocks frees x and y, retry succeeds.
    sim = CachingAllocatorSim(
        capacity, AllocatorConfig.from_string(conf), device_total_bytes=100 * MiB
    )
    _gc_sequence(sim)
    assert sim.memory_reserved == 46 * MiB
    assert sim.memory_stats()["num_alloc_retries"] == 1


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (MiB, "1024.00 KiB"),
        (MiB + 1, "1.00 MiB"),
        (1024 * MiB, "1024.00 MiB"),
        (1024 * MiB + 1, "1.00 GiB"),
        (int(79.15 * 1024 * MiB), "79.15 GiB"),
    ],
)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text


def test_oom_message_with_context_and_fraction() -> None:
    # Device of 100 MiB with 20 MiB outside PyTorch (capacity 80 MiB), fraction 0.9 (90 MiB).
    sim = CachingAllocatorSim(
        80 * MiB,
        AllocatorConfig.from_string("per_process_memory_fraction:0.9"),
        device_total_bytes=100 * MiB,
    )
    sim.malloc(70 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        sim.malloc(20 * MiB)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "100.00 MiB of which 10.00 MiB is free. Including non-PyTorch memory, this process has "
        "90.00 MiB memory in use. 90.00 MiB allowed; Of the allocated memory 70.00 MiB is "
        "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved "
        "but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    assert info.value.size_bytes == 20 * MiB and info.value.alloc_size_bytes == 20 * MiB


def test_zero_and_negative_sizes() -> None:
    sim = CachingAllocatorSim()
    assert sim.malloc(0) == 0
    sim.free(0)
    assert sim.memory_reserved == 0
    with pytest.raises(ValueError):
        sim.malloc(-1)
    with pytest.raises(ValueError):
        sim.free(12345)


def test_reset_peak_memory_stats() -> None:
    sim = CachingAllocatorSim()
    sim.free(sim.malloc(30 * MiB))
    sim.reset_peak_memory_stats()
    assert sim.max_memory_allocated == 0
    assert sim.max_memory_reserved == 30 * MiB
