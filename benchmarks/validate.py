"""Predicted vs measured peak memory for every dev-set row trainmem can express.

Usage: ``python benchmarks/validate.py [--csv PATH] [--engine analytic|trace]``

Compares each row on the metric it reports (``max_memory_allocated``, ``max_memory_reserved``
or an nvidia-smi style device total), prints the signed error per row, the median and 90th
percentile absolute error, and the share of rows under-estimated by more than 10%; rows that
cannot be expressed yet are listed with the reason (see ``dev_rows.py``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from dev_rows import ROWS  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.hf import load_hf_config, model_spec_from_hf  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "shared/validation/dev_measurements.csv"


def metric_key(metric_text: str) -> str:
    """Which prediction a row's ``metric`` column is compared with."""
    text = metric_text.lower()
    if "max_memory_allocated" in text:
        return "allocated"
    if "max_memory_reserved" in text:
        return "reserved"
    return "device_total"


def predict(entry: dict[str, Any], engine: str) -> int:
    """Predicted bytes for one expressible row, on the row's own metric."""
    config = {**load_hf_config(entry["preset"]), **entry.get("config_overrides", {})}
    spec = model_spec_from_hf(config, name=entry["preset"])
    est = estimate(spec, TrainingConfig(**entry["training"]), engine=engine,
                   cuda_context_bytes=entry.get("cuda_context_bytes"))
    b = est.breakdown
    return {"allocated": b.allocated_bytes, "reserved": b.reserved_bytes,
            "device_total": b.device_total_bytes}[entry["metric"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--engine", default="analytic", choices=("analytic", "trace"))
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(args.csv.open()))
    errors: list[float] = []
    skipped: list[tuple[str, str]] = []
    print(f"{'id':6} {'model':22} {'metric':12} {'measured GB':>11} {'predicted GB':>12} {'error':>7}")
    for row in rows:
        entry = ROWS.get(row["id"], "no mapping in benchmarks/dev_rows.py")
        if isinstance(entry, str):
            skipped.append((row["id"], entry))
            continue
        entry = {**entry, "metric": entry.get("metric") or metric_key(row["metric"])}
        measured = float(row["measured_gb"]) * 1e9
        predicted = predict(entry, args.engine)
        err = (predicted - measured) / measured
        errors.append(err)
        print(f"{row['id']:6} {entry['preset']:22} {entry['metric']:12} {measured / 1e9:11.2f} "
              f"{predicted / 1e9:12.2f} {100 * err:+6.1f}%")
    if errors:
        abs_err = sorted(abs(e) for e in errors)
        p90 = abs_err[min(len(abs_err) - 1, round(0.9 * (len(abs_err) - 1)))]
        under = sum(e < -0.10 for e in errors)
        print(f"\n{len(errors)} rows: median |error| {100 * statistics.median(abs_err):.1f}%, "
              f"p90 |error| {100 * p90:.1f}%, under-estimated by >10%: {under}/{len(errors)}")
    if skipped:
        print(f"\n{len(skipped)} rows not expressible yet:")
        for rid, why in skipped:
            print(f"  {rid}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
