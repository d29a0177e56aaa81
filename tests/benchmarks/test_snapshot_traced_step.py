"""The traced course-transformer step against a real GPU's snapshot of the same step (issue 13).

Expected values: the real GPU's, read from the snapshot (512-byte-rounded requested peak and the
exact peak reserved of S001, a CS336 fwd + cross-entropy + bwd step on a real GPU). Slow: the
trace takes about 10 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
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
