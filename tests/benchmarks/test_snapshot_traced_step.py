"""The traced course-transformer step against a real GPU's snapshot of the same step (issue 13).

Expected values: the real GPU's, read from the snapshot (512-byte-rounded requested peak and the
exact peak reserved of S001, a CS336 fwd + cross-entropy + bwd step on a real GPU, and of S026, a
full step with torch's AdamW). Each trace takes about 10 s: both run in the slow subset.
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO_DIR

BENCH = REPO_DIR / "benchmarks"
sys.path.insert(0, str(BENCH))

import snapshot_traced_step as bench  # noqa: E402


@pytest.mark.slow
def test_traced_step_matches_the_real_gpu() -> None:
    pytest.importorskip("torch")
    if not (bench.DEFAULT_CORPUS / "S001.pickle").is_file():
        pytest.skip("snapshot corpus not available")
    (case,) = [c for c in bench.CASES if c.id == "S001"]
    row = bench.run_case(case, bench.DEFAULT_CORPUS)
    assert abs(row["traced_alloc"] - row["real_alloc"]) <= 0.02 * row["real_alloc"]
    assert abs(row["traced_res"] - row["real_res"]) <= 0.03 * row["real_res"]


@pytest.mark.slow  # traces the 2.7B course model's 32 layers (~13 s); the lazy optimizer states
# are checked by hand in tests/test_schedule.py, the trace against real steps in test_real_cpu.py
def test_foreach_adamw_step_reserves_what_the_real_gpu_did() -> None:
    # S026: the course's 2.7B model, bf16 autocast, torch's foreach AdamW; its reserved peak is
    # set by the optimizer step after a first step created the states lazily (Note [Lazy
    # optimizer states]: 76.9 GiB, +5.7 %, when the replay allocated them with the weights).
    # Expected: the real GPU's allocated and reserved peaks, read from the snapshot.
    pytest.importorskip("torch")
    if not (bench.DEFAULT_CORPUS / "S026.pickle").is_file():
        pytest.skip("snapshot corpus not available")
    (case,) = [c for c in bench.CASES if c.id == "S026"]
    row = bench.run_case(case, bench.DEFAULT_CORPUS)
    assert abs(row["traced_alloc"] - row["real_alloc"]) <= 0.02 * row["real_alloc"]
    assert abs(row["traced_res"] - row["real_res"]) <= 0.03 * row["real_res"]
