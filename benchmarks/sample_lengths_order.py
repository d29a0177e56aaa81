"""Lengths drawn from a dataset's statistics (``--sample-lengths``, Note [Lengths from a
dataset's statistics]): which order, how many steps, and what they do to the rows that pad each
batch to its longest sample (helper lengths, session 26).

Rows: dev set 2's torchtune alpaca rows at 512 (GT028-GT036 reserved, GT172-GT173 allocated:
``alpaca_cleaned_dataset``, ``padded_collate``, ``max_seq_len`` truncates) with
``alpaca-cleaned``; litgpt's Alpaca2k rows (GT097-GT113, allocated, truncated at 512) with
``alpaca-cleaned`` as the nearest shipped statistics (Alpaca2k is 2,000 Alpaca samples; no
source states its token counts); and ms-swift's Qwen-1 benchmark cells
(published_probe_swift.py: ``cls-fudan-news-zh``, ``--long-samples delete``).

Per row: every step at ``--seq-len`` (what the defaults give), then the shipped draw
(:data:`~trainmem.specs.sample_lengths.SAMPLED_STEPS` steps, shuffled with seed 0), then the
same quantiles under other orders (ascending, descending, shuffled with seeds 1-4) and other
step counts (16, 63): the spread over orders is the figure's uncertainty from the order alone.

Run: ``python benchmarks/sample_lengths_order.py [--rows dev|swift|all] [--quick]``
(``--quick``: the shipped draw only; ``--start K``: ms-swift's cells from the K-th). Prints a
markdown table and a summary per group.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

from validate import _invoke_estimate, cli_args, load_dev2, metric_of

from trainmem.specs.sample_lengths import SAMPLED_STEPS, Order, sampled_seq_lens

TORCHTUNE = ["GT028", "GT029", "GT030", "GT031", "GT032", "GT033", "GT034", "GT035", "GT036"]
TORCHTUNE_ALLOCATED = ["GT172", "GT173"]
LITGPT = [f"GT{n:03d}" for n in range(97, 114)]

#: (label, steps, order, seed) of each variant after the shipped one
VARIANTS: list[tuple[str, int, Order, int]] = [
    ("ascending", SAMPLED_STEPS, "ascending", 0),
    ("descending", SAMPLED_STEPS, "descending", 0),
    *[(f"seed {s}", SAMPLED_STEPS, "shuffled", s) for s in range(1, 5)],
    ("16 steps", 16, "shuffled", 0),
    ("63 steps", 63, "shuffled", 0),
]


def _last(args: list[str], flag: str, default: int) -> int:
    """The value of the last ``flag`` in ``args`` (a later flag wins, as the CLI reads it)."""
    value = default
    for i, a in enumerate(args[:-1]):
        if a == flag:
            value = int(args[i + 1])
    return value


def _figure(args: list[str], metric: str) -> float | None:
    answer, error = _invoke_estimate(args)
    if answer is None:
        print(f"  refused: {error}", file=sys.stderr)
        return None
    value = metric_of(answer, metric)
    return None if value is None else value / 1e9


def study(
    label: str,
    args: list[str],
    metric: str,
    measured_gb: float,
    dataset: str,
    long: str,
    quick: bool,
) -> tuple[float, float, list[float]] | None:
    """Print one row: measured, fixed-length error, shipped draw's error, the variants'."""
    fixed = _figure(args, metric)
    shipped = _figure([*args, "--sample-lengths", dataset, "--long-samples", long], metric)
    if fixed is None or shipped is None:
        print(f"| {label} | {metric} | {measured_gb:.2f} | refused | | |")
        return None
    seq_len = _last(args, "--seq-len", 1024)
    b = _last(args, "--micro-batch-size", 1)
    errors: list[float] = []
    for _, steps, order, seed in [] if quick else VARIANTS:
        lengths = sampled_seq_lens(dataset, seq_len, b, long, steps=steps, order=order, seed=seed)  # type: ignore[arg-type]
        value = _figure([*args, "--earlier-seq-lens", ",".join(map(str, lengths))], metric)
        errors.append(float("nan") if value is None else 100 * (value - measured_gb) / measured_gb)
    e_fixed = 100 * (fixed - measured_gb) / measured_gb
    e_shipped = 100 * (shipped - measured_gb) / measured_gb
    shown = " | ".join(f"{e:+.1f}" for e in errors)
    print(
        f"| {label} | {metric} | {measured_gb:.2f} | {fixed:.2f} ({e_fixed:+.1f}%) | "
        f"{shipped:.2f} ({e_shipped:+.1f}%) | {shown} |",
        flush=True,
    )
    return e_fixed, e_shipped, errors


def _header(quick: bool) -> None:
    cols = "" if quick else " | ".join(v[0] for v in VARIANTS)
    print(
        "| row | metric | measured GB | every step at --seq-len GB | "
        f"--sample-lengths (shipped) GB | {cols} |"
    )
    print("|---" * (6 + (0 if quick else len(VARIANTS))) + "|")


def _summary(name: str, results: list[tuple[float, float, list[float]]]) -> None:
    if not results:
        return
    fixed = sorted(abs(r[0]) for r in results)
    shipped = sorted(abs(r[1]) for r in results)
    spread = [max([r[1], *r[2]]) - min([r[1], *r[2]]) for r in results if r[2]]
    line = (
        f"{name}: {len(results)} rows; median |error| every step at --seq-len "
        f"{median(fixed):.1f}%, with --sample-lengths {median(shipped):.1f}%"
    )
    if spread:
        line += f"; spread over orders and step counts: median {median(spread):.1f} points, "
        line += f"max {max(spread):.1f}"
    print(line)


def dev_rows(quick: bool) -> None:
    rows = {r.id: r for r in load_dev2()}
    _header(quick)
    groups = {"torchtune reserved": TORCHTUNE, "torchtune allocated": TORCHTUNE_ALLOCATED}
    groups["litgpt allocated"] = LITGPT
    out: dict[str, list[tuple[float, float, list[float]]]] = {}
    for name, ids in groups.items():
        out[name] = []
        for rid in ids:
            row = rows[rid]
            res = study(
                rid, cli_args(row), row.metric, row.measured / 1e9, "alpaca-cleaned", "truncate",
                quick or name != "torchtune reserved",
            )  # fmt: skip
            if res is not None:
                out[name].append(res)
    for name, results in out.items():
        _summary(name, results)


def swift_cells(quick: bool, start: int = 0) -> None:
    import published_probe_swift as swift
    from published_probe import write_inputs

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_inputs(Path(tmp))
        _header(quick)
        results = []
        for _table, method, model, max_length, batch, cell in swift.ROWS[start:]:
            args = swift.row_args(method, model, max_length, batch, paths)
            label = f"{method} {model} {max_length} b{batch}"
            # Benchmark.md's GiB as GB, so the table's errors are relative to the cell
            res = study(
                label, args, "reserved", cell * 2**30 / 1e9, "cls-fudan-news-zh", "delete", quick
            )
            if res is not None:
                results.append(res)
        _summary("ms-swift cells", results)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", choices=("dev", "swift", "all"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--start", type=int, default=0, help="the first ms-swift cell (0-34)")
    ns = parser.parse_args()
    if ns.rows in ("dev", "all"):
        dev_rows(ns.quick)
    if ns.rows in ("swift", "all"):
        swift_cells(ns.quick, ns.start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
