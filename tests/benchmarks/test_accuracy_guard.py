"""CI guard on accuracy (issue 17): the analytic side of the dev benchmark against the published
measurements in ../shared/validation/dev_measurements.csv, with thresholds written next to the
figures they guard. A change that makes the memory model worse on these rows fails here.

Current figures (benchmarks/RESULTS.md): 33 of 35 rows scored, median |error| 1.8%,
p90 10.7%, worst under-estimate GT004 -13.6%. The lit-gpt FSDP + LoRA rows GT092-GT095 moved from
-60.4 / -53.7 / -73.5 / -27.0% to +1.7 / +5.2 / +1.4 / +14.1% when FSDP1's flat-parameter
gradients under ``no_sync`` accumulation were modelled (Notes [FSDP gradient accumulation under
no_sync] and [Flat-parameter gradients in backward] in analytic/schedule.py); no other row
changed. Re-recorded at main c21fc20 (session 8): GT077 +3.3 -> +0.6% and GT092-GT094 under
1 point better, moved by earlier sessions' rules (not re-recorded then); median |error|
2.2 -> 1.8%; the training KV cache rule of that session moves no dev row. Thresholds allow
rounding noise only;
they tighten when the model is fixed, never loosen to let a row pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import validate  # noqa: E402

#: signed error per scored row at the commit that wrote this table (benchmarks/validate.py); a row
#: may improve freely but not get worse by more than ROW_SLACK (absolute error, percentage points)
RECORDED = {
    "GT001": -0.0872,
    "GT002": -0.0503,
    "GT003": +0.0180,
    "GT004": -0.1364,
    "GT005": -0.0131,
    "GT006": -0.0787,
    "GT007": +0.0397,
    "GT008": -0.0899,
    "GT009": -0.0012,
    "GT071": +0.0465,
    "GT072": +0.0718,
    "GT073": -0.0132,
    "GT074": +0.0278,
    "GT075": +0.1447,
    "GT076": +0.0031,
    "GT077": +0.0058,
    "GT078": +0.0070,
    "GT079": +0.0067,
    "GT080": +0.0059,
    "GT081": -0.0031,
    "GT082": +0.0074,
    "GT083": +0.0092,
    "GT084": -0.0008,
    "GT085": -0.0216,
    "GT086": -0.0223,
    "GT087": -0.0008,
    "GT088": -0.0024,
    "GT089": -0.0223,
    "GT092": +0.0146,
    "GT093": +0.0430,
    "GT094": +0.0125,
    "GT095": +0.1411,
    "GT096": -0.1071,
}
ROW_SLACK = 0.01
MIN_ROWS_SCORED = 33
MAX_MEDIAN_ABS = 0.019
MAX_P90_ABS = 0.11
MIN_WORST_SIGNED = -0.14


@pytest.mark.skipif(not validate.DEFAULT_CSV.exists(), reason="../shared is not beside the repo")
def test_analytic_accuracy_does_not_regress() -> None:
    rows = validate.load_rows()
    measured = {r["id"]: float(r["measured_gb"]) * 1e9 for r in rows if r.get("measured_gb")}
    tool = validate.run_trainmem(rows, "analytic", validate.DEFAULT_CSV)
    errors = validate.signed_errors(tool, measured)
    summary = validate.summarize(errors)
    assert summary["n"] >= MIN_ROWS_SCORED, tool.not_run
    assert summary["median_abs"] <= MAX_MEDIAN_ABS, summary
    assert summary["p90_abs"] <= MAX_P90_ABS, summary
    assert min(errors.values()) >= MIN_WORST_SIGNED, summary
    worse = {
        rid: (round(RECORDED[rid], 4), round(e, 4))
        for rid, e in errors.items()
        if rid in RECORDED and abs(e) > abs(RECORDED[rid]) + ROW_SLACK
    }
    assert not worse, f"rows whose error grew (recorded, now): {worse}"
