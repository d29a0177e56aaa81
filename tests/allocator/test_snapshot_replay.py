"""Replaying real GPU memory snapshots through the simulator, from the rebuilt starting state.

The expected numbers of the corpus tests are the real GPU's: the peak reserved bytes and the
final segments recorded in each pickle (``segment_alloc`` / ``segment_free`` entries and the
final ``segments``), an independent measurement of the allocator. The corpus is read from
../shared/validation/snapshots (never copied into the repository); those tests skip without it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from conftest import SHARED_DIR, Invoke
from trainmem.allocator.caching import CachingAllocatorSim
from trainmem.allocator.snapshot import (
    SnapshotError,
    loads_snapshot,
    read_snapshot,
    snapshot_stats,
)
from trainmem.allocator.snapshot_replay import replay_snapshot, start_segments

MiB = 1_048_576
CORPUS = SHARED_DIR / "validation" / "snapshots"
#: The smallest files of the corpus (each under 700 KB, together about 1 s): a cold linear layer,
#: naive attention, compiled attention after warm-up, a final state only, a warm fwd+bwd, and
#: two inference runs that hit the free-and-retry path near a 24 GB card's capacity.
FAST = ["S059", "S012", "S046", "S061", "S001", "S054", "S055"]


def corpus_file(name: str) -> Path:
    path = CORPUS / f"{name}.pickle"
    if not path.is_file():
        pytest.skip(f"snapshot corpus not available at {CORPUS}")
    return path


@pytest.mark.parametrize("name", FAST)
def test_replay_reproduces_the_real_gpu(name: str) -> None:
    snap = read_snapshot(corpus_file(name))
    r = replay_snapshot(snap)
    real_peak = snapshot_stats(snap, r.device)["peak_reserved_bytes"]
    assert abs(r.simulated["peak_reserved_bytes"] - real_peak) <= 0.02 * real_peak
    final = sorted(s["total_size"] for s in snap["segments"] if s.get("device", 0) == r.device)
    assert r.simulated["segment_sizes"] == final


def test_retry_path_needs_the_capacity() -> None:
    """S054 frees 17 cached segments inside one malloc (the frames say
    DeviceCachingAllocator::malloc): with unlimited capacity the simulator keeps them and
    over-reserves; with the capacity the trace implies it frees them and matches."""
    snap = read_snapshot(corpus_file("S054"))
    real = snapshot_stats(snap)["peak_reserved_bytes"]
    free = replay_snapshot(snap, infer_capacity=False)
    assert free.simulated["peak_reserved_bytes"] > 1.05 * real
    r = replay_snapshot(snap)
    assert r.capacity_source == "trace"
    assert r.real["num_alloc_retries"] == r.simulated["num_alloc_retries"] == 1
    assert r.simulated["peak_reserved_bytes"] == real


# ------------------------------------------------------------------ hand-built snapshots


def seg(address: int, total: int, blocks: list[tuple[int, str, int]]) -> dict[str, Any]:
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "stream": 0,
        "segment_type": "small" if total <= 2 * MiB else "large",
        "blocks": [{"size": s, "state": st, "requested_size": r} for s, st, r in blocks],
    }


def ev(action: str, addr: int, size: int, **extra: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, **extra}


A = 0x7F0000000000


def test_starting_state_is_rebuilt_backwards() -> None:
    """A 20 MiB segment holding a 4 MiB block allocated before the trace (freed in it) and a
    segment the trace allocates: at the start only the first exists, with the 4 MiB block."""
    snap = {
        "segments": [
            seg(A, 20 * MiB, [(20 * MiB, "inactive", 0)]),
            seg(
                A + 64 * MiB,
                20 * MiB,
                [(6 * MiB, "active_allocated", 6 * MiB), (14 * MiB, "inactive", 0)],
            ),
        ],  # fmt: skip
        "device_traces": [
            [
                ev("free_requested", A, 4 * MiB),
                ev("free_completed", A, 4 * MiB),
                ev("segment_alloc", A + 64 * MiB, 20 * MiB),
                ev("alloc", A + 64 * MiB, 6 * MiB),
            ]
        ],
    }
    segments, unplaced = start_segments(snap, 0, CachingAllocatorSim())
    assert unplaced == 0
    assert [(s.address, s.size, s.live) for s in segments] == [
        (A, 20 * MiB, ((A, 4 * MiB, 4 * MiB),))
    ]
    r = replay_snapshot(snap)
    # Start: 20 MiB reserved. The 6 MiB request fits the 16 MiB free block of the first segment;
    # this made-up trace calls cudaMalloc instead (as a second stream would). The replay keeps
    # the simulator's own decision and reports where it departs from the real trace.
    assert r.real["peak_reserved_bytes"] == 40 * MiB
    assert r.simulated["peak_reserved_bytes"] == 20 * MiB
    assert r.first_address_divergence == 3


def test_empty_cache_is_replayed_and_told_apart_from_a_retry() -> None:
    """A 40 MiB segment is freed, then a 50 MiB one allocated. Frames naming emptyCache make
    the free an empty_cache call, replayed as one. Without frames, 40 + 50 MiB exceeds the real
    peak (50 MiB): the free can be the malloc's free-and-retry after a failed cudaMalloc, and
    the capacity that implies (90 MiB - 1 B) makes the simulator free and retry too."""
    name = "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()"
    empty_frames = [{"name": name, "filename": "", "line": 0}]
    for frames in (empty_frames, None):
        extra = {"frames": frames} if frames else {}
        snap = {
            "segments": [seg(A + 64 * MiB, 50 * MiB, [(50 * MiB, "active_allocated", 50 * MiB)])],
            "device_traces": [
                [
                    ev("segment_alloc", A, 40 * MiB),
                    ev("alloc", A, 40 * MiB),
                    ev("free_requested", A, 40 * MiB),
                    ev("free_completed", A, 40 * MiB),
                    ev("segment_free", A, 40 * MiB, **extra),
                    ev("segment_alloc", A + 64 * MiB, 50 * MiB),
                    ev("alloc", A + 64 * MiB, 50 * MiB),
                ]
            ],
        }
        r = replay_snapshot(snap)
        if frames:
            assert r.real["num_empty_cache"] == r.simulated["num_empty_cache"] == 1
            assert r.capacity_bytes is None
        else:
            assert r.real["num_empty_cache"] == r.simulated["num_empty_cache"] == 0
            assert r.capacity_bytes == 90 * MiB - 1 and r.capacity_source == "trace"
            assert r.real["num_alloc_retries"] == r.simulated["num_alloc_retries"] == 1
        # Either way the 40 MiB segment goes back to CUDA (kept, 90 MiB would be reserved).
        assert r.simulated["final_reserved_bytes"] == 50 * MiB
        assert r.simulated["peak_reserved_bytes"] == r.real["peak_reserved_bytes"] == 50 * MiB


def test_unsplit_tail_is_learnt() -> None:
    """A 1.25 MiB block allocated before the trace sat in a 1.875 MiB hole: the 0.625 MiB
    remainder (<= 1 MiB) stayed attached (should_split). The real allocator puts the next 10 MiB
    request at 1.875 MiB, where its free block began; the estimate (round_size: 1.25 MiB) would
    put it at 1.25 MiB. The replay learns the block's real size from that misplaced alloc."""
    base = A
    tail_end = 0x1E0000  # 1.875 MiB
    snap = {
        "segments": [
            seg(
                base,
                20 * MiB,
                [
                    (tail_end, "active_allocated", 1310720),
                    (10 * MiB, "active_allocated", 10 * MiB),
                    (20 * MiB - tail_end - 10 * MiB, "inactive", 0),
                ],
            ),
        ],  # fmt: skip
        "device_traces": [[ev("alloc", base + tail_end, 10 * MiB)]],
    }
    # The first block is live at the end and never allocated in the trace: its size is exact.
    r = replay_snapshot(snap)
    assert r.first_address_divergence is None
    # Now the block is freed in the trace after the alloc: its size must be learnt.
    snap["segments"][0]["blocks"] = [
        {"size": tail_end, "state": "inactive", "requested_size": 0},
        {"size": 10 * MiB, "state": "active_allocated", "requested_size": 10 * MiB},
        {"size": 20 * MiB - tail_end - 10 * MiB, "state": "inactive", "requested_size": 0},
    ]
    snap["device_traces"][0] += [
        ev("free_requested", base, 1310720),
        ev("free_completed", base, 1310720),
    ]
    assert replay_snapshot(snap, max_refinements=0).first_address_divergence == 0
    assert replay_snapshot(snap).first_address_divergence is None


# ------------------------------------------------------------------ malformed files

GOOD_SEG = {"device": 0, "address": A, "total_size": 2 * MiB, "stream": 0, "blocks": []}


def bad(**changes: Any) -> dict[str, Any]:
    s = dict(GOOD_SEG)
    s.update(changes)
    return {"segments": [s], "device_traces": [[ev("alloc", A, 512)]]}


SHARED_SEG = dict(GOOD_SEG)
MALFORMED: dict[str, tuple[Any, str]] = {
    "segment is an int": ({"segments": [3], "device_traces": []}, "segments[0]"),
    "missing total_size": (
        {"segments": [{"address": A, "blocks": []}], "device_traces": []},
        "segments[0].total_size",
    ),
    "total_size a string": (bad(total_size="2097152"), "segments[0].total_size"),
    "total_size inf": (bad(total_size=float("inf")), "segments[0].total_size"),
    "total_size NaN": (bad(total_size=float("nan")), "segments[0].total_size"),
    "total_size negative": (bad(total_size=-1), "segments[0].total_size"),
    "address beyond 64 bits": (bad(address=2**70), "segments[0].address"),
    "blocks not a list": (bad(blocks={"size": 512}), "segments[0].blocks"),
    "block size a string": (
        bad(blocks=[{"size": "512", "state": "inactive"}]),
        "segments[0].blocks[0].size",
    ),  # fmt: skip
    "trace entry an int": ({"segments": [], "device_traces": [[7]]}, "device_traces[0][0]"),
    "trace entry lacks addr": (
        {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]},
        "device_traces[0][0].addr",
    ),
    "trace size a float": (
        {"segments": [], "device_traces": [[ev("alloc", A, 512.0)]]},
        "device_traces[0][0].size",
    ),
    "device_traces not a list": ({"segments": [], "device_traces": {"0": []}}, "device_traces"),
    "allocator settings a list": (
        {"segments": [], "device_traces": [], "allocator_settings": ["expandable_segments"]},
        "allocator_settings",
    ),
    "memo bomb": ({"segments": [SHARED_SEG] * 10_000, "device_traces": []}, "segments[1]"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_snapshot_names_the_field(case: str) -> None:
    obj, field = MALFORMED[case]
    with pytest.raises(SnapshotError, match=f"field {field.replace('[', '.').replace(']', '.')}"):
        loads_snapshot(pickle.dumps(obj, protocol=4))


def test_memo_bomb_pickle_is_small() -> None:
    """The shared-reference case really is a memo bomb: 10,000 segments in a few kB."""
    assert len(pickle.dumps(MALFORMED["memo bomb"][0], protocol=4)) < 30_000


# ------------------------------------------------------------------ CLI


def test_cli_json_keys(invoke: Invoke) -> None:
    path = corpus_file("S012")
    res = invoke("replay-snapshot", str(path), "--json")
    out = json.loads(res.stdout)
    keys = {"peak_allocated_bytes", "peak_reserved_bytes", "num_segments"}
    assert set(out["real"]) == keys and set(out["simulated"]) == keys
    # S012 (naive attention from an empty cache): nine segments, 3.52 GiB reserved on the GPU.
    assert out["real"]["num_segments"] == 9
    assert out["simulated"]["peak_reserved_bytes"] == out["real"]["peak_reserved_bytes"]


def test_cli_table_runs_with_a_gpu(invoke: Invoke) -> None:
    res = invoke("replay-snapshot", str(corpus_file("S059")), "--gpu", "A100-80GB")
    assert "peak reserved" in res.stdout


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x80\x04\x95",  # truncated
        pickle.dumps(bad(total_size="x"), protocol=4),
        pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": 1}]]}),
        pickle.dumps({"segments": [SHARED_SEG] * 100, "device_traces": []}),
    ],
    ids=["empty", "truncated", "string-size", "no-addr", "memo-bomb"],
)
def test_cli_bad_file_exits_2_with_one_line(invoke: Invoke, tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / "bad.pickle"
    path.write_bytes(payload)
    res = invoke("replay-snapshot", str(path), exit_code=2)
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ")


def test_cli_refuses_a_fifo(invoke: Invoke, tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    res = invoke("replay-snapshot", str(fifo), exit_code=2)
    assert "not a regular file" in res.stderr


# ------------------------------------------------------------------ stream comparison helpers


def test_phases_and_sources_from_recorded_stacks() -> None:
    from trainmem.allocator.stream_compare import phase_summary, real_allocations

    torch_frame = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1}
    fwd = [{"filename": "/home/u/proj/model.py", "line": 54, "name": "forward"}, torch_frame]
    bwd = [{"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(x)"}]
    opt = [{"filename": "C:\\proj\\cs336_basics\\optimizer.py", "line": 77, "name": "step"}]
    trace = [
        ev("alloc", A, 1000, frames=fwd),
        ev("alloc", A + 1024, 2 * MiB, frames=bwd),
        ev("free_completed", A, 1000),
        ev("alloc", A + 4 * MiB, 600, frames=opt),
        ev("alloc", A + 8 * MiB, 512, frames=[]),  # another thread without Python: backward
    ]
    recs = real_allocations(trace)
    assert [(r.phase, r.source) for r in recs] == [
        ("forward", "model.py:54 forward"),
        ("backward", ""),
        ("optimizer", "optimizer.py:77 step"),
        ("backward", ""),
    ]
    summary = phase_summary(trace)
    # Rounded: 1024, 2 MiB, 1024 (600 B), 512; live before the optimizer: 2 MiB after the free.
    assert summary["forward"] == {
        "num_allocs": 1,
        "allocated_bytes": 1024,
        "peak_live_delta_bytes": 1024,
    }
    assert summary["backward"]["allocated_bytes"] == 2 * MiB + 512
    assert summary["optimizer"]["peak_live_delta_bytes"] == 2 * MiB + 1024


def test_first_divergence_and_alignment() -> None:
    from trainmem.allocator.stream_compare import align_sizes, first_divergence

    real = [1000, 4096, 8 * MiB, 512, 300]
    pred = [1024, 4096, 8 * MiB, 7 * MiB, 512, 300]  # 1000 and 1024 round to the same block
    assert first_divergence(real, pred) == {
        "index": 3,
        "real_bytes": 512,
        "predicted_bytes": 7 * MiB,
    }
    assert first_divergence(real, real) is None
    al = align_sizes(real, pred)
    assert (al["matched"], al["real_only"], al["predicted_only"]) == (5, 0, 1)
    assert al["differences"] == [
        {"real": [3, 3], "predicted": [3, 4], "real_bytes": 0, "predicted_bytes": 7 * MiB}
    ]


# ------------------------------------------------------------------ found by fuzzing the replay


def test_expandable_range_holds_a_request_beyond_the_device_once_capacity_is_lifted() -> None:
    """A 2 MiB device: the 20 MiB virtual range (9/8 of it, in 20 MiB pages) cannot hold a
    40 MiB request; the request fails on capacity, and after the replay lifts the capacity it
    must be served (it used to trip an assertion)."""
    from trainmem.allocator.caching import OutOfMemoryError
    from trainmem.allocator.config import AllocatorConfig

    sim = CachingAllocatorSim(2 * MiB, AllocatorConfig.from_string("expandable_segments:True"))
    with pytest.raises(OutOfMemoryError):
        sim.malloc(40 * MiB, 7)
    sim.capacity_bytes = None
    sim.free(sim.malloc(40 * MiB, 7))
    sim.check_invariants()
    assert sim.max_memory_reserved == 40 * MiB


def test_oversize_release_never_frees_part_of_a_segment() -> None:
    """release_available_cached_blocks frees whole oversize segments only: a split remainder of
    an adopted segment stays (freeing it left its neighbour merging with a vanished block)."""
    from trainmem.allocator.caching import OutOfMemoryError
    from trainmem.allocator.config import AllocatorConfig

    sim = CachingAllocatorSim(60 * MiB, AllocatorConfig.from_string("max_split_size_mb:20"))
    (h,) = sim.adopt_segment(A, 60 * MiB, 0, small=False, live=[(A, 512, 512)])
    with pytest.raises(OutOfMemoryError):
        sim.malloc(30 * MiB)  # oversize; the 60 MiB - 512 B remainder is split, so kept
    assert sim.memory_reserved == 60 * MiB
    sim.free(h)
    sim.check_invariants()
