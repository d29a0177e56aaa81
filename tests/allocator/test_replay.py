"""replay_timeline: Timeline in, torch.cuda-style numbers out. Expected values by hand from the
spec's rules (../shared/specs/cuda-caching-allocator.md sections 1-3)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from trainmem.allocator.replay import replay_timeline
from trainmem.breakdown import MemoryCategory
from trainmem.errors import TimelineError
from trainmem.timeline import AllocEvent, Timeline

MiB = 1_048_576
P, A, T = MemoryCategory.PARAMETER, MemoryCategory.ACTIVATION, MemoryCategory.TEMPORARY


def alloc(block_id: int, size: int, category: MemoryCategory = A) -> AllocEvent:
    return AllocEvent("alloc", block_id, size, category, "forward")


def free(block_id: int, size: int, category: MemoryCategory = A) -> AllocEvent:
    return AllocEvent("free", block_id, size, category, "backward")


def e4_timeline() -> Timeline:
    """Spec example E4: three 6 MiB blocks, free the outer two, then 10 MiB."""
    return Timeline(
        events=[
            alloc(1, 6 * MiB, P),
            alloc(2, 6 * MiB),
            alloc(3, 6 * MiB),
            free(1, 6 * MiB, P),
            free(3, 6 * MiB),
            alloc(4, 10 * MiB, T),
            free(2, 6 * MiB),
        ]
    )


def test_replay_reports_peaks_and_fragmentation() -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=None)
    assert r.max_memory_allocated == 18 * MiB
    assert r.max_memory_reserved == 30 * MiB
    assert r.peak_allocated_event_index == 2
    assert r.reserved_at_allocated_peak_bytes == 20 * MiB
    assert r.peak_reserved_event_index == 5
    assert r.allocated_at_reserved_peak_bytes == 16 * MiB
    assert r.fragmentation_bytes == 14 * MiB
    assert r.allocated_by_category_at_peak == {"parameters": 6 * MiB, "activations": 12 * MiB}
    assert not r.oom and r.fits and r.oom_message is None and r.oom_event_index is None
    assert r.num_events == 7
    assert r.memory_stats["allocated_bytes.all.current"] == 10 * MiB
    assert r.memory_stats["reserved_bytes.all.peak"] == 30 * MiB
    assert r.snapshot is None


def test_replay_oom_where_allocated_bytes_would_fit() -> None:
    # Peak allocated is 18 MiB, but fragmentation needs a second segment: 30 MiB reserved.
    # With 25 MiB of capacity the 10 MiB request fails (20 + 10 > 25, no whole free segment).
    r = replay_timeline(e4_timeline(), capacity_bytes=25 * MiB)
    assert r.oom and not r.fits
    assert r.oom_event_index == 5
    assert r.oom_message is not None
    assert r.oom_message.startswith("CUDA out of memory. Tried to allocate 10.00 MiB. GPU 0 has")
    assert (
        "Of the allocated memory 6.00 MiB is allocated by PyTorch, and 14.00 MiB is reserved"
        in (r.oom_message)
    )
    # Continued past the failure without a limit: the step needs 30 MiB.
    assert r.max_memory_reserved == 30 * MiB
    assert r.num_events == 7
    assert r.memory_stats["num_ooms"] == 1


def test_replay_can_stop_at_the_oom() -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=25 * MiB, continue_after_oom=False)
    assert r.oom and r.oom_event_index == 5 and r.num_events == 5
    assert r.max_memory_reserved == 20 * MiB
    assert r.memory_stats["allocated_bytes.all.current"] == 6 * MiB


def test_replay_reads_alloc_conf() -> None:
    # Spec E5 as a timeline: 100, 101, 102 MiB one after the other.
    events = [alloc(1, 100 * MiB), free(1, 100 * MiB), alloc(2, 101 * MiB), free(2, 101 * MiB)]
    events += [alloc(3, 102 * MiB)]
    assert replay_timeline(Timeline(events=events), capacity_bytes=None).max_memory_reserved == (
        202 * MiB
    )
    r = replay_timeline(
        Timeline(events=events), capacity_bytes=None, alloc_conf="expandable_segments:True"
    )
    assert r.max_memory_reserved == 120 * MiB


def test_zero_byte_allocations_are_ignored() -> None:
    r = replay_timeline(Timeline(events=[alloc(1, 0), free(1, 0)]), capacity_bytes=None)
    assert r.max_memory_allocated == 0 and r.max_memory_reserved == 0
    assert r.peak_allocated_event_index is None and r.peak_reserved_event_index is None


def test_streams_are_passed_through() -> None:
    events = [
        AllocEvent("alloc", 1, 4 * MiB, A, "forward", stream=1),
        AllocEvent("free", 1, 4 * MiB, A, "forward", stream=1),
        AllocEvent("alloc", 2, 4 * MiB, A, "forward", stream=2),
    ]
    assert replay_timeline(Timeline(events=events), capacity_bytes=None).max_memory_reserved == (
        40 * MiB
    )


@pytest.mark.parametrize(
    "events",
    [
        [free(1, 512)],
        [alloc(1, 512), alloc(1, 512)],
        [alloc(1, 512), free(1, 512), free(1, 512)],
    ],
)
def test_bad_timelines_raise(events: list[AllocEvent]) -> None:
    with pytest.raises(TimelineError) as info:
        replay_timeline(Timeline(events=events), capacity_bytes=None)
    assert info.value.event_index == len(events) - 1


def test_allocator_does_not_import_torch() -> None:
    import subprocess

    code = (
        "import sys, trainmem.allocator.replay, trainmem.allocator.snapshot, "
        "trainmem.allocator.device; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "alloc_conf",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:64",
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    ],
)
@pytest.mark.parametrize("capacity_mib", [None, 14_848, 12_288])
def test_lean_statistics_replay_the_same_step(alloc_conf: str, capacity_mib: int | None) -> None:
    # Note [Lean statistics]: the lean simulator skips counters no decision reads, so every
    # figure of the replay but the dropped memory_stats keys is the full simulator's. The step
    # (llama-3.2-1b, bf16-true, b2 s1024) peaks at 13.2 GiB allocated, 14.7 GiB reserved
    # unlimited: at 14.5 GiB it frees its cache and retries (no option set), at 12 GiB it runs
    # out of memory.
    from trainmem.allocator.caching import LEAN_STATS
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    training = TrainingConfig(micro_batch_size=2, seq_len=1024, precision="bf16-true")
    est = estimate("llama-3.2-1b", training, simulate_allocator=False)
    events = list(est.schedules[0].replay_events())
    capacity = None if capacity_mib is None else capacity_mib * MiB
    full_run, lean_run = (
        replay_timeline(
            events,
            capacity_bytes=capacity,
            device_total_bytes=16 * 1024 * MiB,
            alloc_conf=alloc_conf,
            continue_after_oom=False,
            full_stats=full,
        )
        for full in (True, False)
    )
    if capacity_mib == 12_288:
        assert full_run.oom
    elif capacity_mib is not None and not alloc_conf:
        assert full_run.oom or full_run.memory_stats["num_alloc_retries"] > 0
    assert lean_run.memory_stats == {
        k: v for k, v in full_run.memory_stats.items() if k.startswith(LEAN_STATS)
    }
    assert len(lean_run.memory_stats) < len(full_run.memory_stats)
    assert replace(lean_run, memory_stats={}) == replace(full_run, memory_stats={})


@pytest.mark.parametrize("enabled", [True, False])
def test_replay_leaves_the_collector_as_it_found_it(enabled: bool) -> None:
    """Note [No cyclic collection during a replay]: the collector is off while the events are
    read (an event source sees it off) and back in the caller's state afterwards, also when
    the replay raises."""
    import gc

    seen: list[bool] = []

    def events() -> Iterator[AllocEvent]:
        seen.append(gc.isenabled())
        yield alloc(1, 6 * MiB)
        seen.append(gc.isenabled())

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        result = replay_timeline(events(), capacity_bytes=None)
        assert seen == [False, False]
        assert gc.isenabled() is enabled
        with pytest.raises(TimelineError):
            replay_timeline([free(7, MiB)], capacity_bytes=None)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
    assert result.max_memory_allocated == 6 * MiB
