"""Snapshot export/import: format (spec section 6), restricted unpickling, round trips, and
PyTorch's own ``torch.cuda._memory_viz`` consumers (skipped without torch)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from trainmem.allocator.caching import CachingAllocatorSim
from trainmem.allocator.config import AllocatorConfig
from trainmem.allocator.replay import replay_timeline
from trainmem.allocator.snapshot import (
    SnapshotError,
    loads_snapshot,
    read_snapshot,
    snapshot_of,
    snapshot_stats,
    timeline_from_snapshot,
    write_snapshot,
)
from trainmem.allocator.stream_compare import compare_snapshot
from trainmem.breakdown import MemoryCategory
from trainmem.timeline import AllocEvent, Timeline

MiB = 1_048_576
A, P = MemoryCategory.ACTIVATION, MemoryCategory.PARAMETER


def e4_timeline() -> Timeline:
    """Spec E4 plus a small-pool block that stays live: 18 MiB allocated peak, 30 MiB reserved."""
    ev = [
        AllocEvent("alloc", 1, 6 * MiB, P, "init", "model.w1"),
        AllocEvent("alloc", 2, 6 * MiB, A, "forward", "model.l1"),
        AllocEvent("alloc", 3, 6 * MiB, A, "forward", "model.l2"),
        AllocEvent("free", 1, 6 * MiB, P, "forward"),
        AllocEvent("free", 3, 6 * MiB, A, "backward"),
        AllocEvent("alloc", 4, 10 * MiB, A, "backward", "model.l2"),
        AllocEvent("alloc", 5, 1000, A, "backward"),
        AllocEvent("free", 2, 6 * MiB, A, "backward"),
    ]
    return Timeline(events=ev)


def test_exported_state_matches_the_allocator() -> None:
    snap = replay_timeline(e4_timeline(), capacity_bytes=None, record_history=True).snapshot
    assert snap is not None
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    segs = snap["segments"]
    # Final state: the 20 MiB segment (b freed: whole and free), the 10 MiB one, a 2 MiB small one.
    assert sorted(s["total_size"] for s in segs) == [2 * MiB, 10 * MiB, 20 * MiB]
    for s in segs:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        addr = s["address"]
        for b in s["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert s["allocated_size"] == sum(
            b["size"] for b in s["blocks"] if b["state"] == "active_allocated"
        )
    small = next(s for s in segs if s["segment_type"] == "small")
    assert [(b["size"], b["state"], b["requested_size"]) for b in small["blocks"]] == [
        (1024, "active_allocated", 1000),
        (2 * MiB - 1024, "inactive", 0),
    ]
    addresses = sorted((s["address"], s["address"] + s["total_size"]) for s in segs)
    assert all(end <= start for (_, end), (start, _) in zip(addresses, addresses[1:], strict=False))
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == [
        "segment_alloc", "alloc", "alloc", "alloc",
        "free_requested", "free_completed", "free_requested", "free_completed",
        "segment_alloc", "alloc", "segment_alloc", "alloc",
        "free_requested", "free_completed",
    ]  # fmt: skip
    first_alloc = snap["device_traces"][0][1]
    assert first_alloc["size"] == 6 * MiB and first_alloc["category"] == "parameters"
    assert first_alloc["frames"] == [{"filename": "model.w1", "line": 0, "name": "init"}]
    assert snap["device_traces"][0][0]["category"] == "unknown"  # MemoryViz needs one
    assert snap["allocator_settings"]["max_split_size"] == -1


def test_stats_of_our_own_snapshot_equal_the_simulation() -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=None, record_history=True)
    assert r.snapshot is not None
    stats = snapshot_stats(r.snapshot)
    assert stats["peak_reserved_bytes"] == r.max_memory_reserved == 32 * MiB
    assert stats["final_reserved_bytes"] == r.memory_stats["reserved_bytes.all.current"]
    assert stats["final_allocated_bytes"] == r.memory_stats["allocated_bytes.all.current"]
    assert stats["peak_requested_bytes"] == 18 * MiB
    assert stats["peak_requested_rounded_bytes"] == 18 * MiB


def test_file_round_trip_and_replay_of_the_trace(tmp_path: Path) -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=None, record_history=True)
    assert r.snapshot is not None
    path = tmp_path / "sim.pickle"
    write_snapshot(path, r.snapshot)
    with open(path, "rb") as f:
        assert f.read(2) == b"\x80\x04"  # protocol 4
    back = read_snapshot(path)
    assert back == r.snapshot
    # The trace read back is the same allocation stream: replaying it gives the same numbers.
    again = replay_timeline(timeline_from_snapshot(back), capacity_bytes=None)
    assert (again.max_memory_allocated, again.max_memory_reserved) == (
        r.max_memory_allocated,
        r.max_memory_reserved,
    )
    report = compare_snapshot(path, r)
    assert report["reserved_error_bytes"] == 0
    assert report["reserved_relative_error"] == 0.0
    assert report["replayed"]["max_memory_reserved"] == r.max_memory_reserved
    assert report["predicted"] == {
        "max_memory_allocated": r.max_memory_allocated,
        "max_memory_reserved": r.max_memory_reserved,
    }
    off = compare_snapshot(
        path, {"max_memory_allocated": 0, "max_memory_reserved": 16 * MiB}, replay=False
    )
    assert off["reserved_error_bytes"] == -16 * MiB and off["replayed"] is None


def test_truncated_trace_is_rebuilt_backwards_from_the_final_state() -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=None, record_history=True)
    assert r.snapshot is not None
    snap = dict(r.snapshot)
    # A ring buffer that kept only the last 6 entries: from the 10 MiB segment_alloc... onward
    # is entries 8..13; keep 9..13 so the segment already exists at the start.
    snap["device_traces"] = [r.snapshot["device_traces"][0][9:]]
    stats = snapshot_stats(snap)
    assert stats["peak_reserved_bytes"] == 32 * MiB  # 30 MiB at the start, + 2 MiB small segment
    timeline = timeline_from_snapshot(snap)
    init = [e for e in timeline.events if e.phase == "init"]
    # b (freed in the trace) existed before it; so did nothing else still live at the end.
    assert [(e.size_bytes, e.action) for e in init] == [(6 * MiB, "alloc")]
    replay_timeline(timeline, capacity_bytes=None)  # consistent: no TimelineError


def test_pending_free_is_exported_as_active_pending_free() -> None:
    sim = CachingAllocatorSim(record_history=True)
    a = sim.malloc(4 * MiB)
    sim.record_stream(a, 5)
    sim.free(a)
    snap = snapshot_of(sim)
    states = [b["state"] for b in snap["segments"][0]["blocks"]]
    assert states == ["active_pending_free", "inactive"]
    assert [e["action"] for e in snap["device_traces"][0]] == [
        "segment_alloc",
        "alloc",
        "free_requested",
    ]


def test_expandable_segments_are_exported_as_mapped_ranges() -> None:
    sim = CachingAllocatorSim(
        config=AllocatorConfig.from_string("expandable_segments:True"), record_history=True
    )
    a = sim.malloc(5 * MiB)
    sim.malloc(30 * MiB)
    sim.free(a)
    snap = snapshot_of(sim)
    (seg,) = snap["segments"]
    assert seg["is_expandable"] and seg["total_size"] == 40 * MiB
    assert [e["action"] for e in snap["device_traces"][0]].count("segment_map") == 2
    assert snapshot_stats(snap)["peak_reserved_bytes"] == 40 * MiB


def test_oom_is_traced() -> None:
    r = replay_timeline(e4_timeline(), capacity_bytes=25 * MiB, record_history=True)
    assert r.snapshot is not None
    (oom,) = [e for e in r.snapshot["device_traces"][0] if e["action"] == "oom"]
    assert oom["size"] == 10 * MiB and oom["device_free"] == 5 * MiB
    assert snapshot_stats(r.snapshot)["num_ooms"] == 1


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "payload",
    [
        {"segments": [], "device_traces": [[{"frames": Evil()}]]},
        {"segments": [], "x": {1, 2}.__class__},
        {"segments": [], "x": complex(1, 2)},
    ],
    ids=["reduce-callable", "class", "complex"],
)
def test_restricted_unpickler_rejects_objects(payload: object) -> None:
    data = pickle.dumps(payload, protocol=5)
    with pytest.raises(SnapshotError, match="refusing to load"):
        loads_snapshot(data)


def test_restricted_unpickler_rejects_persistent_ids() -> None:
    import io

    class Persisting(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "storage-0" if obj == "tensor" else None

    buf = io.BytesIO()
    Persisting(buf, protocol=2).dump({"segments": [], "x": "tensor"})
    with pytest.raises(SnapshotError, match="persistent id"):
        loads_snapshot(buf.getvalue())


def test_restricted_unpickler_accepts_plain_data_and_legacy_lists() -> None:
    plain = {
        "segments": [{"address": 1, "total_size": 2, "blocks": [], "segment_pool_id": (0, 0)}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "frames": []}]],
        "other": [1.5, None, True, -(2**70), "\u00e9"],
    }
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert loads_snapshot(pickle.dumps(plain, protocol=protocol)) == plain
    # Protocol 4+ (what _dump_snapshot writes) builds bytes and sets with opcodes of their own.
    plain["other"] = [b"bytes", frozenset({1}), {2}]
    for protocol in (4, 5):
        assert loads_snapshot(pickle.dumps(plain, protocol=protocol)) == plain
    assert loads_snapshot(pickle.dumps([])) == {"segments": [], "device_traces": []}


@pytest.mark.parametrize("data", [b"not a pickle", pickle.dumps({"a": 1}), pickle.dumps(3)])
def test_not_a_snapshot(data: bytes) -> None:
    with pytest.raises(SnapshotError):
        loads_snapshot(data)


def test_torch_memory_viz_reads_our_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    r = replay_timeline(e4_timeline(), capacity_bytes=None, record_history=True)
    assert r.snapshot is not None
    summary = _memory_viz.segsum(r.snapshot)  # raises on any accounting mismatch
    assert "segments: 3" in summary
    assert "14 entries" in _memory_viz.trace(r.snapshot)
    path = tmp_path / "sim.pickle"
    write_snapshot(path, r.snapshot)
    # torch's own command line, run as the script it is made to be run as (its ``__main__``
    # takes its own folder off ``sys.path`` for that, torch 2.13 torch/cuda/_memory_viz.py):
    # its argument parser and stock ``pickle.load`` of our file; by path it imports no torch
    # (``-m`` imports the torch package first: about 2.5 s of CPU per run, twice)
    for action in ("trace_plot", "segment_plot"):
        out = tmp_path / f"{action}.html"
        subprocess.run(
            [sys.executable, _memory_viz.__file__, action, str(path), "-o", str(out)],
            check=True,
            capture_output=True,
        )
        assert "add_local_files" in out.read_text()
