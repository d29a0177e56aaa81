"""Accuracy benchmark: trainmem and its peers against published peak-memory measurements.

Usage::

    python benchmarks/validate.py                    # analytic + trace, table to stdout
    python benchmarks/validate.py --peers            # + peers (makes benchmarks/.peers-venv)
    python benchmarks/validate.py --write-results    # everything; writes RESULTS.md, the plot
                                                     # and src/trainmem/data/uncertainty.json

Every row of ``shared/validation/dev_measurements.csv`` is expressed as a trainmem configuration
by ``dev_rows.py`` (one entry per row: settings, or the reason it cannot be expressed), run
through each engine and compared on the metric the row reports (``max_memory_allocated``,
``max_memory_reserved`` or an nvidia-smi style device total). Per tool: the signed error per
row, the median and 90th-percentile absolute error, and the share of rows under-estimated by
more than 10% (an under-estimate is an OOM for the user).

The trace engine runs each row in its own subprocess with a time limit; rows whose settings it
does not model are "not run" with the reason. Peers (accelerate ``estimate-memory``, DeepSpeed's
ZeRO estimators, llm-analysis) run in ``benchmarks/.peers-venv`` through one adapter each in
``benchmarks/peers/``; the published rules of thumb (``trainmem formulas``) run here. A peer's
figure is compared as it is given: it is that tool's answer to "how much memory does this need".
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dev_rows import ROWS  # noqa: E402

from trainmem.analytic.formulas import rules_of_thumb  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.hf import load_hf_config, model_spec_from_hf  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.uncertainty import configuration_kinds  # noqa: E402

REPO = HERE.parent
# ``../shared`` beside the clone, or TRAINMEM_SHARED (a git worktree elsewhere reads the same data).
SHARED = Path(os.environ.get("TRAINMEM_SHARED", REPO.parent / "shared"))
DEFAULT_CSV = SHARED / "validation/dev_measurements.csv"
DEV2_CSV = SHARED / "validation/dev_measurements_2.csv"
DEV2_ARGS = SHARED / "validation/dev_measurements_2_args.jsonl"
PEERS_DIR = HERE / "peers"
PEERS_VENV = HERE / ".peers-venv"
RESULTS_MD = HERE / "RESULTS.md"
PLOT_PNG = HERE / "results_predicted_vs_measured.png"
UNCERTAINTY_JSON = REPO / "src/trainmem/data/uncertainty.json"

TRACE_TIMEOUT_S = 300
"""Per-row limit for the trace engine (CPU, fake tensors); a row over it is "not run"."""

UNDER_THRESHOLD = 0.10
"""The issue's dangerous direction: predicted below measured by more than this share."""

PEER_ADAPTERS = {
    "accelerate": "accelerate_adapter.py",
    "deepspeed": "deepspeed_adapter.py",
    "llm-analysis": "llm_analysis_adapter.py",
}

RULES = {
    "ZeRO paper (Rajbhandari et al. 2020)": "rule: ZeRO paper",
    "Korthikanti et al. 2022 + 16 B/param": "rule: Korthikanti + 16 B/param",
    "'model memory' rule": "rule: model memory",
    "GPT-2 calculator": "rule: GPT-2 calculator",
}
"""``rules_of_thumb`` names (prefix) -> tool column name."""


@dataclass
class Tool:
    """One column of the benchmark: predictions per row id, or the reason there is none."""

    name: str
    version: str = ""
    predicted: dict[str, int] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --- rows -------------------------------------------------------------------------------------


def metric_key(metric_text: str) -> str:
    """Which prediction a row's ``metric`` column is compared with.

    Args:
        metric_text: the CSV's ``metric`` column.

    Returns:
        ``allocated``, ``reserved`` or ``device_total``.
    """
    text = metric_text.lower()
    if "max_memory_allocated" in text:
        return "allocated"
    if "max_memory_reserved" in text:
        return "reserved"
    return "device_total"


def load_rows(path: Path = DEFAULT_CSV) -> list[dict[str, str]]:
    """The CSV rows, in file order."""
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def resolve_entry(row: dict[str, str]) -> dict[str, Any] | str:
    """The row's mapping with its metric filled in, or the reason it is not expressible."""
    entry = ROWS.get(row["id"], "no mapping in benchmarks/dev_rows.py")
    if isinstance(entry, str):
        return entry
    return {**entry, "metric": entry.get("metric") or metric_key(row["metric"])}


def hf_config(entry: dict[str, Any]) -> dict[str, Any]:
    """The row's HF config.json dict (shipped preset plus the row's overrides)."""
    return {**load_hf_config(entry["preset"]), **entry.get("config_overrides", {})}


def training_of(entry: dict[str, Any]) -> TrainingConfig:
    """The row's TrainingConfig."""
    return TrainingConfig(**entry["training"])


# --- trainmem ---------------------------------------------------------------------------------


def pick_metric(breakdown: Any, metric: str, cuda_context_bytes: int | None = None) -> int:
    """The breakdown's figure on the row's metric; a row's own CUDA context replaces the default.

    Args:
        breakdown: a :class:`~trainmem.breakdown.MemoryBreakdown`.
        metric: ``allocated``, ``reserved`` or ``device_total``.
        cuda_context_bytes: the row's era context, if the mapping gives one.

    Returns:
        Bytes.
    """
    if metric == "allocated":
        return int(breakdown.allocated_bytes)
    if metric == "reserved":
        return int(breakdown.reserved_bytes)
    context = breakdown.cuda_context if cuda_context_bytes is None else cuda_context_bytes
    return int(breakdown.reserved_bytes + context)


def predict(entry: dict[str, Any], engine: str) -> int:
    """Predicted bytes for one expressible row, on the row's own metric. The traced engines
    build the model from a config file, so they get the row's config (preset plus overrides,
    e.g. BERT's sequence-classification head) written to a temporary config.json."""
    context = entry.get("cuda_context_bytes")
    if engine == "analytic":
        spec = model_spec_from_hf(hf_config(entry), name=entry["preset"])
        est = estimate(spec, training_of(entry), engine=engine, cuda_context_bytes=context)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(hf_config(entry)))
            est = estimate(str(path), training_of(entry), engine=engine, cuda_context_bytes=context)
    return pick_metric(est.breakdown, entry["metric"], context)


def trace_limits(training: TrainingConfig) -> str | None:
    """Why the trace engine cannot run a row's settings, or None: the engine's own refusals
    (:func:`trainmem.estimate.trace_unsupported_settings`: quantized bases, offload, DeepSpeed
    and FSDP1 layouts...), so a setting the trace has learned (LoRA through peft, FSDP2) is
    traced here too."""
    from trainmem.estimate import trace_unsupported_settings

    missing = trace_unsupported_settings(training)
    if missing:
        return "trace engine does not model " + ", ".join(missing)
    return None


def _trace_one(row_id: str, csv_path: Path, timeout_s: float) -> tuple[str, int | None, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--csv", str(csv_path)]
    cmd += ["--trace-row", row_id]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return row_id, None, f"over the {timeout_s:.0f} s limit on CPU"
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "predicted_bytes" in answer:
        return row_id, int(answer["predicted_bytes"]), f"{time.monotonic() - start:.1f} s"
    err = answer.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return row_id, None, f"failed: {err[:200]}"


def run_trainmem(
    rows: list[dict[str, str]], engine: str, csv_path: Path, timeout_s: float = TRACE_TIMEOUT_S
) -> Tool:
    """trainmem on every row with one engine (trace rows in subprocesses, 4 at a time)."""
    tool = Tool(f"trainmem {engine}", version=_version("trainmem"))
    pending: list[str] = []
    for row in rows:
        entry = resolve_entry(row)
        if isinstance(entry, str):
            tool.not_run[row["id"]] = entry
            continue
        if engine == "analytic":
            tool.predicted[row["id"]] = predict(entry, "analytic")
            continue
        why = trace_limits(training_of(entry))
        if why:
            tool.not_run[row["id"]] = why
        else:
            pending.append(row["id"])
    if pending:
        with ThreadPoolExecutor(max_workers=4) as pool:
            done = pool.map(lambda rid: _trace_one(rid, csv_path, timeout_s), pending)
            for rid, value, what in done:
                if value is None:
                    tool.not_run[rid] = what
                else:
                    tool.predicted[rid] = value
    return tool


# --- rules of thumb (trainmem formulas) ---------------------------------------------------------


def rule_limits(training: TrainingConfig, rule: str) -> str | None:
    """Why a published rule of thumb cannot express a row, or None.

    Every rule counts full fine-tuning with Adam on one GPU; the ZeRO paper and Korthikanti's
    16 B/param are mixed-precision Adam by construction.
    """
    kinds = configuration_kinds(training)
    if "method=full" not in kinds:
        return "counts every parameter as trained (no LoRA / QLoRA)"
    if "sharded=yes" in kinds:
        return "no ZeRO/FSDP sharding"
    if training.optimizer not in ("adam", "adamw"):
        return f"assumes Adam; the row uses {training.optimizer}"
    mixed_only = rule.startswith(("ZeRO paper", "Korthikanti"))
    if mixed_only and training.precision not in ("16-mixed", "bf16-mixed"):
        return f"mixed-precision Adam (16 B/param) by construction; the row is {training.precision}"
    return None


def run_rules(rows: list[dict[str, str]]) -> list[Tool]:
    """The published rules of thumb from ``trainmem formulas``, one tool each."""
    tools = {name: Tool(name, version=_version("trainmem")) for name in RULES.values()}
    for row in rows:
        entry = resolve_entry(row)
        if isinstance(entry, str):
            for tool in tools.values():
                tool.not_run[row["id"]] = f"row not mapped, no settings to pass on ({entry})"
            continue
        training = training_of(entry)
        spec = model_spec_from_hf(hf_config(entry), name=entry["preset"])
        for rule_name, total, what in rules_of_thumb(spec, training):
            column = next(col for prefix, col in RULES.items() if rule_name.startswith(prefix))
            why = rule_limits(training, rule_name)
            if why is None and total is None:
                why = what
            if why:
                tools[column].not_run[row["id"]] = why
            else:
                tools[column].predicted[row["id"]] = int(total or 0)
    return list(tools.values())


# --- peers --------------------------------------------------------------------------------------


def ensure_peers_venv(venv: Path = PEERS_VENV, *, upgrade: bool = False) -> Path:
    """Make (or upgrade) the peers' virtual environment with ``peers/setup_venv.sh``.

    Returns:
        The venv's python.
    """
    python = venv / "bin" / "python"
    if upgrade or not python.exists():
        subprocess.run(["bash", str(PEERS_DIR / "setup_venv.sh"), str(venv)], check=True)
    return python


def peer_requests(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The JSON requests the adapters read: config.json dict, training fields, metric."""
    out = []
    for row in rows:
        entry = resolve_entry(row)
        if isinstance(entry, str):
            continue
        training = {k: list(v) if isinstance(v, tuple) else v for k, v in entry["training"].items()}
        out.append(
            {
                "id": row["id"],
                "config": hf_config(entry),
                "training": training,
                "metric": entry["metric"],
            }
        )
    return out


def run_peer(name: str, python: Path, rows: list[dict[str, str]], timeout_s: float = 900) -> Tool:
    """One peer adapter in the peers' venv; rows trainmem cannot express are not sent."""
    tool = Tool(name)
    requests = peer_requests(rows)
    sent = {r["id"] for r in requests}
    for row in rows:
        if row["id"] not in sent:
            tool.not_run[row["id"]] = (
                f"row not mapped, no settings to pass on ({ROWS.get(row['id'], 'no mapping')})"
            )
    cmd = [str(python), str(PEERS_DIR / PEER_ADAPTERS[name])]
    try:
        proc = subprocess.run(
            cmd,
            input=json.dumps(requests),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        answer = json.loads(proc.stdout)
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        for rid in sent:
            tool.not_run[rid] = f"adapter failed: {type(exc).__name__}"
        return tool
    tool.name, tool.version, tool.notes = answer["tool"], answer["version"], answer["notes"]
    for rid, res in answer["results"].items():
        if "predicted_bytes" in res:
            tool.predicted[rid] = int(res["predicted_bytes"])
        else:
            tool.not_run[rid] = res.get("cannot_express") or f"error: {res.get('error')}"
    return tool


# --- statistics ---------------------------------------------------------------------------------


def signed_errors(tool: Tool, measured: dict[str, float]) -> dict[str, float]:
    """``(predicted - measured) / measured`` per row the tool predicted."""
    return {rid: (p - measured[rid]) / measured[rid] for rid, p in tool.predicted.items()}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..1)."""
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def summarize(errors: dict[str, float]) -> dict[str, Any]:
    """Median and p90 absolute error, under-estimates by more than 10%, worst under-estimate."""
    if not errors:
        return {"n": 0}
    abs_err = sorted(abs(e) for e in errors.values())
    worst_id = min(errors, key=lambda rid: errors[rid])
    return {
        "n": len(errors),
        "median_abs": statistics.median(abs_err),
        "p90_abs": percentile(abs_err, 0.9),
        "under": sum(e < -UNDER_THRESHOLD for e in errors.values()),
        "worst_under": (worst_id, errors[worst_id]) if errors[worst_id] < 0 else None,
    }


def spread(values: list[float]) -> dict[str, Any]:
    """Signed-error statistics of one kind of configuration, for the uncertainty table."""
    v = sorted(values)
    return {
        "n": len(v),
        "min": round(v[0], 4),
        "p10": round(percentile(v, 0.1), 4),
        "median": round(statistics.median(v), 4),
        "p90": round(percentile(v, 0.9), 4),
        "max": round(v[-1], 4),
    }


def with_dev2_errors(
    table: dict[str, Any],
    dev1_tool: Tool,
    rows: list[dict[str, str]],
    measured: dict[str, float],
    dev2_rows: list[Dev2Row],
    dev2_results: dict[str, Dev2Result],
) -> dict[str, Any]:
    """``table`` with its ``analytic`` engine's spreads recomputed over both development sets:
    dev set 1's analytic errors and every dev-2 row the analytic engine answered, each grouped by
    the kinds of configuration of its resolved settings. The other engines' entries are kept."""
    by_kind: dict[str, list[float]] = {}
    errors = signed_errors(dev1_tool, measured)
    for row in rows:
        if row["id"] in errors:
            entry = resolve_entry(row)
            assert isinstance(entry, dict)
            kinds = configuration_kinds(training_of(entry))
            for kind in ("all", *kinds):
                by_kind.setdefault(kind, []).append(errors[row["id"]])
    dev2 = dev2_errors(dev2_rows, dev2_results)
    for row_id, error in dev2.items():
        res = dev2_results[row_id]
        if res.engine != "analytic" or not res.config:
            continue
        for kind in ("all", *configuration_kinds(res.config)):
            by_kind.setdefault(kind, []).append(error)
    out = dict(table)
    out["engines"] = {
        **table["engines"],
        "analytic": {k: spread(v) for k, v in sorted(by_kind.items())},
    }
    # the dev set 1 table's own dataset after the prefix, once: a table this function wrote
    # before already starts with it (each --dev2 --write-results used to add it again)
    prefix = "shared/validation/dev_measurements.csv + dev_measurements_2.csv (analytic engine); "
    rest = str(table.get("dataset", ""))
    while rest.startswith(prefix):
        rest = rest[len(prefix) :]
    out["dataset"] = prefix + rest
    out["date"] = datetime.date.today().isoformat()
    return out


def uncertainty_table(
    tools: list[Tool], rows: list[dict[str, str]], measured: dict[str, float]
) -> dict[str, Any]:
    """Per engine and kind of configuration, the spread of trainmem's signed errors."""
    engines: dict[str, Any] = {}
    for tool in tools:
        if not tool.name.startswith("trainmem ") or not tool.predicted:
            continue
        errors = signed_errors(tool, measured)
        by_kind: dict[str, list[float]] = {"all": list(errors.values())}
        for row in rows:
            if row["id"] not in errors:
                continue
            entry = resolve_entry(row)
            assert isinstance(entry, dict)
            for kind in configuration_kinds(training_of(entry)):
                by_kind.setdefault(kind, []).append(errors[row["id"]])
        engines[tool.name.split()[1]] = {k: spread(v) for k, v in sorted(by_kind.items())}
    return {
        "schema_version": 1,
        "generated_by": "python benchmarks/validate.py --write-results",
        "dataset": "shared/validation/dev_measurements.csv",
        "date": datetime.date.today().isoformat(),
        "trainmem_version": _version("trainmem"),
        "error": "(predicted - measured) / measured, on each row's own metric",
        "engines": engines,
    }


# --- dev set 2: the published stacks, through the real command line ----------------------------

DEV2_BEGIN = "<!-- dev-set-2:begin (benchmarks/validate.py --dev2 --write-results) -->"
DEV2_END = "<!-- dev-set-2:end -->"

CAUSE_THRESHOLD = 0.05
"""Rows whose |error| is above this share get a named cause (or "unexplained") in the table."""

SLOW_ROW_S = 10.0
"""A dev-2 row slower than this is named in the summary (the trace / generic paths)."""

DEV2_PATH_ARGS = {"configs/": "configs/{}/config.json"}
"""``configs/NAME`` in an args list is ``configs/NAME/config.json`` beside the jsonl."""


@dataclass
class Dev2Row:
    """One line of ``dev_measurements_2_args.jsonl`` joined with its CSV row.

    Attributes:
        id: row id (``GT011``...).
        model: the model argument (preset or ``configs/NAME``), else the CSV's model.
        framework: the CSV's framework, shortened to its name.
        metric: ``allocated``, ``reserved`` or ``device_total`` (``-`` when refused).
        measured: measured bytes.
        args: ``trainmem estimate`` arguments, None when the source cannot be rebuilt.
        reason: why the row cannot be rebuilt (the jsonl's ``reason``), else None.
        rank: ``last_stage`` when only the last pipeline stage was logged, else None.
        amend: arguments added where the source says more than the jsonl's reading
            (``dev2_causes.AMENDMENTS``: "the source wins"), else empty.
        config: config.json keys the source sets differently from the model's published
            config (``dev2_causes.CONFIG_AMENDMENTS``), else empty.
    """

    id: str
    model: str
    framework: str
    metric: str
    measured: int
    args: list[str] | None
    reason: str | None = None
    rank: str | None = None
    amend: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def amended(self) -> bool:
        """Whether the source amends the jsonl's reading of this row."""
        return bool(self.amend or self.config)


@dataclass
class Dev2Result:
    """trainmem's answer for one dev-2 row.

    Attributes:
        predicted: bytes on the row's metric (and rank), None when trainmem refused the row.
        refused: trainmem's one-line error, when it refused.
        engine: the engine ``--engine auto`` chose.
        oom: the predicted verdict for a run that completed: the simulated allocator ran out of
            memory on the row's ``--gpu`` (the figure is then the replay without a capacity).
        seconds: wall time of the row.
        as_read: for an amended row, the same answer on the jsonl's arguments alone.
        config: the estimate's resolved settings (``config`` of the JSON), for the kinds of
            configuration the uncertainty band groups errors by.
    """

    predicted: int | None = None
    refused: str | None = None
    engine: str = ""
    config: dict[str, Any] | None = None
    oom: bool = False
    seconds: float = 0.0
    as_read: Dev2Result | None = None


def _framework_name(text: str) -> str:
    """The CSV's framework column up to its first parenthesis or comma."""
    for sep in (" (", ", ", " @"):
        text = text.split(sep)[0]
    return text.strip()


def load_dev2(args_path: Path = DEV2_ARGS, csv_path: Path = DEV2_CSV) -> list[Dev2Row]:
    """The dev-2 rows in file order: the jsonl's reading of each source joined with the CSV,
    and the amendments ``dev2_causes.AMENDMENTS`` makes where the source says more."""
    from dev2_causes import AMENDMENTS, CONFIG_AMENDMENTS

    with csv_path.open(newline="") as fh:
        by_id = {r["id"]: r for r in csv.DictReader(fh)}
    rows = []
    for line in args_path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        csv_row = by_id.get(item["id"], {})
        args = item.get("args")
        rows.append(
            Dev2Row(
                id=item["id"],
                model=args[0] if args else csv_row.get("model", "-").split(" ")[0],
                framework=_framework_name(csv_row.get("framework", "-")),
                metric=item.get("metric", "-"),
                measured=int(item["measured_bytes"]),
                args=list(args) if args else None,
                reason=item.get("reason"),
                rank=item.get("rank"),
                amend=list(AMENDMENTS[item["id"]][0]) if item["id"] in AMENDMENTS else [],
                config=dict(CONFIG_AMENDMENTS.get(item["id"], ({}, ""))[0]),
            )
        )
    return rows


def cli_args(row: Dev2Row, base: Path = DEV2_ARGS.parent, *, amended: bool = True) -> list[str]:
    """The row's ``trainmem estimate`` arguments, ``configs/NAME`` made a config.json path, with
    the row's amendments (a later flag wins over the jsonl's; a config amendment is the model's
    config.json with the source's keys, written to a temporary folder) unless
    ``amended=False``."""
    assert row.args is not None
    args = [str(base / a / "config.json") if a.startswith("configs/") else a for a in row.args]
    if not amended:
        return args
    if row.config:
        published = Path(args[0])
        base_config = (
            json.loads(published.read_text()) if published.is_file() else load_hf_config(args[0])
        )
        config = {**base_config, **row.config}
        path = Path(tempfile.gettempdir()) / "trainmem-dev2-configs" / row.id / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
        args[0] = str(path)
    return args + row.amend


def _without_gpu(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in ("--gpu", "-g"):
            skip = True
        elif not a.startswith("--gpu="):
            out.append(a)
    return out


def metric_of(answer: dict[str, Any], metric: str, rank: str | None = None) -> int | None:
    """The figure ``trainmem estimate --json`` gives on a row's metric.

    Args:
        answer: the parsed ``--json`` output.
        metric: ``allocated``, ``reserved`` or ``device_total``.
        rank: ``last_stage``: the last pipeline stage's figure (``per_rank``), not the worst
            rank's.

    Returns:
        Bytes, or None when the answer has no such figure (an out-of-memory verdict).
    """
    peak = answer["peak"]
    per_rank = answer.get("per_rank") or []
    if rank == "last_stage" and per_rank:
        last = max(per_rank, key=lambda r: r.get("pipeline_stage", 0))
        if metric == "allocated":
            return int(last["allocated_bytes"])
        reserved = last.get("reserved_bytes")
        if reserved is None or last.get("oom"):
            return None
        context = answer["breakdown_bytes"].get("cuda_context", 0)
        return int(reserved) + (int(context) if metric == "device_total" else 0)
    value = peak.get(f"{metric}_bytes")
    return None if value is None else int(value)


def _invoke_estimate(args: list[str]) -> tuple[dict[str, Any] | None, str]:
    """``trainmem estimate ARGS --json`` in this process (the CLI's own option parsing):
    the parsed answer, or None and the command's error line."""
    from typer.testing import CliRunner

    from trainmem.cli.app import app

    result = CliRunner().invoke(app, ["estimate", *args, "--json"])
    if result.exit_code == 0:
        return json.loads(result.stdout), ""
    text = (result.stderr if result.stderr_bytes is not None else "") or result.output or ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if lines:
        return None, lines[-1].removeprefix("error: ")
    return None, f"{type(result.exception).__name__}: {result.exception}"


def run_dev2_row(row: Dev2Row, *, amended: bool = True, with_as_read: bool = True) -> Dev2Result:
    """One dev-2 row through ``trainmem estimate`` as its user would run it (``--engine auto``).
    A completed run the simulated allocator puts out of memory on the row's GPU counts as a
    predicted OOM; its figure is then the same run replayed without a capacity. An amended row
    is run on the jsonl's arguments alone too (``as_read``) unless ``with_as_read=False``."""
    as_read = None
    if amended and row.amended and with_as_read:
        as_read = run_dev2_row(row, amended=False)
    start = time.monotonic()
    args = cli_args(row, amended=amended)
    answer, error = _invoke_estimate(args)
    if answer is None:
        return Dev2Result(refused=error, seconds=time.monotonic() - start, as_read=as_read)
    oom = answer["peak"].get("oom") is not None or answer.get("fits") is False
    value = metric_of(answer, row.metric, row.rank)
    if value is None:
        unlimited, error = _invoke_estimate(_without_gpu(args))
        if unlimited is not None:
            value = metric_of(unlimited, row.metric, row.rank)
    return Dev2Result(
        predicted=value,
        refused=None if value is not None else (error or "no figure on the row's metric"),
        engine=str(answer.get("engine", "")),
        config=dict(answer.get("config") or {}),
        oom=oom,
        seconds=time.monotonic() - start,
        as_read=as_read,
    )


def run_dev2(rows: list[Dev2Row], *, with_as_read: bool = True) -> dict[str, Dev2Result]:
    """Every rebuildable dev-2 row (rows with a ``reason`` are not run)."""
    return {
        row.id: run_dev2_row(row, with_as_read=with_as_read) for row in rows if row.args is not None
    }


def dev2_errors(rows: list[Dev2Row], results: dict[str, Dev2Result]) -> dict[str, float]:
    """Signed error per dev-2 row trainmem predicted."""
    out = {}
    for row in rows:
        res = results.get(row.id)
        if res is not None and res.predicted is not None:
            out[row.id] = (res.predicted - row.measured) / row.measured
    return out


def cause_of(row_id: str, error: float, oom: bool) -> str:
    """The row's named cause (``dev2_causes.CAUSES``) when it needs one, else ``""``."""
    from dev2_causes import CAUSES

    if abs(error) <= CAUSE_THRESHOLD and not oom:
        return ""
    return CAUSES.get(row_id, "unexplained")


def dev2_summary(
    rows: list[Dev2Row], results: dict[str, Dev2Result], errors: dict[str, float]
) -> dict[str, Any]:
    """The issue's figures on dev set 2: rows run and refused (reasons grouped), median and p90
    |error|, under-estimates by >10%, completed runs predicted OOM, wall time."""
    refused: dict[str, list[str]] = {}
    for row in rows:
        res = results.get(row.id)
        if row.reason is not None:
            refused.setdefault(f"not rebuildable from the source: {row.reason}", []).append(row.id)
        elif res is not None and res.predicted is None:
            refused.setdefault(f"trainmem refused: {res.refused}", []).append(row.id)
    timed = sorted(results.items(), key=lambda kv: -kv[1].seconds)
    return {
        **summarize(errors),
        "rows": len(rows),
        "refused": refused,
        "oom": sorted(rid for rid, r in results.items() if r.oom),
        "seconds": sum(r.seconds for r in results.values()),
        "slow": [(rid, r.seconds, r.engine) for rid, r in timed if r.seconds > SLOW_ROW_S],
        "engines": {e: sum(r.engine == e for r in results.values()) for e in _engines(results)},
    }


def _engines(results: dict[str, Dev2Result]) -> list[str]:
    return sorted({r.engine for r in results.values() if r.engine})


def _bars(s: dict[str, Any], oom: int) -> list[str]:
    """Issue 24's bars against a summary."""

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    return [
        f"median |error| <= 4%: **{met(s['median_abs'] <= 0.04)}** ({100 * s['median_abs']:.1f}%)",
        f"p90 |error| <= 12%: **{met(s['p90_abs'] <= 0.12)}** ({100 * s['p90_abs']:.1f}%)",
        f"none under-estimated by > 10%: **{met(s['under'] == 0)}** ({s['under']})",
        f"no completed run predicted OOM: **{met(oom == 0)}** ({oom})",
    ]


def as_read_results(results: dict[str, Dev2Result]) -> dict[str, Dev2Result]:
    """Each row's answer on the jsonl's arguments alone (an amended row's ``as_read``)."""
    return {rid: r.as_read or r for rid, r in results.items()}


def _amendment(row: Dev2Row) -> str:
    parts = [" ".join(row.amend)] if row.amend else []
    parts += [f"config {k}={v}" for k, v in row.config.items()]
    return "; ".join(parts)


def _as_read_note(row: Dev2Row, res: Dev2Result) -> str:
    if not row.amended or res.as_read is None:
        return ""
    before = res.as_read
    if before.predicted is None:
        return f"amended `{_amendment(row)}` (as read: refused)"
    err = (before.predicted - row.measured) / row.measured
    return f"amended `{_amendment(row)}` (as read: {_pct(err)}{' OOM' if before.oom else ''})"


def dev2_lines(
    rows: list[Dev2Row],
    results: dict[str, Dev2Result],
    dev1_errors: dict[str, float],
    dev1_rows: int,
) -> list[str]:
    """The dev-2 section of RESULTS.md (markdown lines, without its markers)."""
    errors = dev2_errors(rows, results)
    s = dev2_summary(rows, results, errors)
    read = as_read_results(results)
    s_read = dev2_summary(rows, read, dev2_errors(rows, read))
    out = [
        "## Dev set 2: the published stacks, as their users run them (issue 24)",
        "",
        f"Generated {datetime.date.today().isoformat()} by `python benchmarks/validate.py --dev2 "
        f"--write-results` at commit `{_git_commit()}`.",
        "",
        "Rows: `shared/validation/dev_measurements_2.csv` with `dev_measurements_2_args.jsonl` "
        "(one reading of each source as `trainmem estimate` arguments). Each row runs "
        "`trainmem estimate ARGS --json` in-process (the CLI's own option parsing, "
        "`--engine auto`) and is compared on the row's metric. Error = (predicted - measured) / "
        "measured; negative is an under-estimate. `OOM`: the simulated allocator runs out of "
        "memory on the row's `--gpu` for a run that completed (the figure is the replay "
        "without a capacity). Cause: for |error| > 5% or a predicted OOM, the mechanism named "
        "from the row's notes and source (`benchmarks/dev2_causes.py`), else `unexplained`. "
        'Where the source says more than the reading (the README: "the source wins"), '
        "`dev2_causes.AMENDMENTS` adds the flags that say it, with the source cited; the "
        "as-read error of those rows is kept beside their cause, and the summary gives both.",
        "",
        "| id | model | framework | metric | measured GB | predicted GB | error | cause |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        res = results.get(row.id)
        metric = row.metric + (f" ({row.rank})" if row.rank else "")
        if res is None or res.predicted is None:
            why = "not rebuildable" if row.reason else f"refused: {res.refused if res else '-'}"
            out.append(
                f"| {row.id} | {row.model} | {row.framework} | {metric} | "
                f"{row.measured / 1e9:.2f} | - | - | {why} |"
            )
            continue
        err = errors[row.id]
        pred = f"{res.predicted / 1e9:.2f}" + (" OOM" if res.oom else "")
        cause = "; ".join(c for c in (cause_of(row.id, err, res.oom), _as_read_note(row, res)) if c)
        out.append(
            f"| {row.id} | {row.model} | {row.framework} | {metric} | {row.measured / 1e9:.2f} "
            f"| {pred} | {_pct(err)} | {cause} |"
        )
    combined = {**dev1_errors, **errors}
    c = summarize(combined)
    out += ["", "### Summary", ""]
    out += _summary_lines("dev set 2", s, len(rows))
    by_id = {row.id: row for row in rows}
    amended = sorted(rid for rid in results if by_id[rid].amended)
    if amended:
        out.append(
            f"- as read (the jsonl's arguments alone, without the amendments of "
            f"{_id_ranges(amended)}): median |error| {100 * s_read['median_abs']:.1f}%, p90 "
            f"{100 * s_read['p90_abs']:.1f}%, under-estimated by >10%: {s_read['under']}, "
            f"completed runs predicted OOM: {len(s_read['oom'])}"
        )
        for why, ids in _grouped_amendments([by_id[rid] for rid in amended]).items():
            out.append(f"  - amended {_id_ranges(ids)}: {why}")
    n_refused_1 = dev1_rows - len(dev1_errors)
    out += [
        "",
        f"- combined with dev set 1 (analytic engine, `benchmarks/dev_rows.py`): "
        f"{c['n']}/{dev1_rows + len(rows)} rows run ({n_refused_1} of dev set 1 refused), "
        f"median |error| {100 * c['median_abs']:.1f}%, p90 {100 * c['p90_abs']:.1f}%, "
        f"under-estimated by >10%: {c['under']}, completed runs predicted OOM: {len(s['oom'])} "
        "(dev set 1 gives no GPU to its runs).",
    ]
    out += ["", "Issue 24's bars (dev set 2; not expected to be met yet):", ""]
    out += [f"- {b}" for b in _bars(s, len(s["oom"]))]
    out += ["", f"Combined {dev1_rows + len(rows)} rows:", ""]
    out += [f"- {b}" for b in _bars(c, len(s["oom"]))]
    return out


def _grouped_amendments(rows: list[Dev2Row]) -> dict[str, list[str]]:
    from dev2_causes import AMENDMENTS, CONFIG_AMENDMENTS

    grouped: dict[str, list[str]] = {}
    for row in rows:
        whys = [AMENDMENTS[row.id][1]] if row.id in AMENDMENTS else []
        whys += [CONFIG_AMENDMENTS[row.id][1]] if row.id in CONFIG_AMENDMENTS else []
        grouped.setdefault(f"`{_amendment(row)}`: {'; '.join(whys)}", []).append(row.id)
    return grouped


def _summary_lines(name: str, s: dict[str, Any], total: int) -> list[str]:
    engines = ", ".join(f"{k} {v}" for k, v in s["engines"].items())
    lines = [
        f"- {name}: rows run {s['n']}/{total} ({engines}); refused {total - s['n']}:",
    ]
    for why, ids in s["refused"].items():
        lines.append(f"  - {', '.join(ids)}: {why}")
    slow = ", ".join(f"{rid} {sec:.0f} s ({eng})" for rid, sec, eng in s["slow"]) or "none"
    lines += [
        f"- median |error| {100 * s['median_abs']:.1f}%, p90 |error| {100 * s['p90_abs']:.1f}%",
        f"- under-estimated by >10%: {s['under']}/{s['n']}",
        f"- completed runs predicted OOM: {len(s['oom'])}"
        + (f" ({', '.join(s['oom'])})" if s["oom"] else ""),
        f"- wall time {s['seconds']:.0f} s on this machine's CPU (amended rows run twice); rows "
        f"over {SLOW_ROW_S:.0f} s: {slow}",
    ]
    return lines


def write_dev2_section(lines: list[str], path: Path = RESULTS_MD) -> None:
    """Replace the dev-2 section of RESULTS.md (between its markers), or insert it before the
    first section another benchmark owns."""
    block = "\n".join([DEV2_BEGIN, *lines, DEV2_END]) + "\n"
    text = path.read_text() if path.exists() else ""
    start, end = text.find(DEV2_BEGIN), text.find(DEV2_END)
    if start >= 0 and end > start:
        text = text[:start] + block + text[end + len(DEV2_END) :].lstrip("\n")
    else:
        match = re.search(r"^<!-- [\w-]+:begin", text, flags=re.MULTILINE)
        at = match.start() if match else len(text)
        text = text[:at].rstrip("\n") + "\n\n" + block + text[at:]
    path.write_text(text)


def print_dev2(rows: list[Dev2Row], results: dict[str, Dev2Result]) -> None:
    """Dev-2 per-row table and summary on stdout."""
    errors = dev2_errors(rows, results)
    print(f"{'id':6} {'model':24} {'metric':12} {'measured GB':>11} {'predicted':>12} {'error':>8}")
    for row in rows:
        res = results.get(row.id)
        if res is None or res.predicted is None:
            why = row.reason or (res.refused if res else "")
            print(
                f"{row.id:6} {row.model[:24]:24} {row.metric:12} {row.measured / 1e9:11.2f} "
                f"{'not run':>12} {why[:60]}"
            )
            continue
        pred = f"{res.predicted / 1e9:.2f}" + (" OOM" if res.oom else "")
        err = errors[row.id]
        print(
            f"{row.id:6} {row.model[:24]:24} {row.metric:12} {row.measured / 1e9:11.2f} "
            f"{pred:>12} {_pct(err):>8} {cause_of(row.id, err, res.oom)}"
        )
    print()
    print("\n".join(_summary_lines("dev set 2", dev2_summary(rows, results, errors), len(rows))))
    read = as_read_results(results)
    r = dev2_summary(rows, read, dev2_errors(rows, read))
    print(
        f"- as read (no amendments): median |error| {100 * r['median_abs']:.1f}%, p90 "
        f"{100 * r['p90_abs']:.1f}%, under-estimated by >10%: {r['under']}, completed runs "
        f"predicted OOM: {len(r['oom'])}"
    )


# --- output -------------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return f"{package}=={version(package)}"
    except PackageNotFoundError:
        return f"{package} (not installed)"


def _git_commit() -> str:
    proc = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    commit = proc.stdout.strip() or "unknown"
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{commit} + uncommitted changes in src/" if dirty else commit


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def print_table(tools: list[Tool], rows: list[dict[str, str]], measured: dict[str, float]) -> None:
    """Per-row table and per-tool summary on stdout."""
    head = f"{'id':6} {'model':24} {'metric':12} {'measured GB':>11}"
    for tool in tools:
        head += f" | {tool.name[:22]:>22}"
    print(head)
    for row in rows:
        rid = row["id"]
        entry = resolve_entry(row)
        model = entry["preset"] if isinstance(entry, dict) else "-"
        metric = entry["metric"] if isinstance(entry, dict) else "-"
        line = f"{rid:6} {model[:24]:24} {metric:12} {measured[rid] / 1e9:11.2f}"
        for tool in tools:
            if rid in tool.predicted:
                p = tool.predicted[rid]
                cell = f"{p / 1e9:.2f} ({_pct((p - measured[rid]) / measured[rid])})"
            else:
                cell = "not run"
            line += f" | {cell:>22}"
        print(line)
    print()
    for tool in tools:
        s = summarize(signed_errors(tool, measured))
        if s["n"]:
            print(
                f"{tool.name:34} {s['n']:2} rows: median |error| {100 * s['median_abs']:.1f}%, "
                f"p90 {100 * s['p90_abs']:.1f}%, under-estimated by >10%: {s['under']}/{s['n']}"
            )
        else:
            print(f"{tool.name:34}  0 rows")
    for tool in tools:
        reasons = _grouped_reasons(tool)
        if reasons:
            print(f"\n{tool.name}: not run on")
            for why, ids in reasons.items():
                print(f"  {_id_ranges(ids)}: {why}")


def _grouped_reasons(tool: Tool) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for rid, why in sorted(tool.not_run.items()):
        grouped.setdefault(why, []).append(rid)
    return grouped


def _id_ranges(ids: list[str]) -> str:
    return ", ".join(ids) if len(ids) <= 4 else f"{', '.join(ids[:3])}, ... ({len(ids)} rows)"


def _describe(entry: dict[str, Any]) -> str:
    t = entry["training"]
    parts = [f"b{t.get('micro_batch_size', 1)}", f"s{t['seq_len']}", t.get("precision", "")]
    if t.get("gradient_accumulation_steps", 1) > 1:
        parts.append(f"GA{t['gradient_accumulation_steps']}")
    if t.get("optimizer", "adamw") != "adamw":
        parts.append(t["optimizer"])
    if t.get("activation_checkpointing", "none") != "none":
        parts.append("AC")
    if t.get("quantize_base", "none") != "none":
        parts.append(f"QLoRA {t['quantize_base']}")
    elif t.get("lora_rank"):
        parts.append(f"LoRA r{t['lora_rank']}")
    if t.get("zero_stage"):
        parts.append(f"ZeRO-{t['zero_stage']} x{t.get('data_parallel_size', 1)}")
    parts.append(t.get("attention", "sdpa"))
    return " ".join(p for p in parts if p)


def write_plot(tools: list[Tool], measured: dict[str, float], path: Path = PLOT_PNG) -> None:
    """Log-log predicted vs measured, one panel per tool, y = x and +-10% lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in tools if t.predicted]
    cols = 3
    nrows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 4.0 * nrows), squeeze=False)
    lo, hi = 0.5, 200.0
    for ax, tool in zip(axes.flat, shown, strict=False):
        ids = sorted(tool.predicted)
        x = [measured[rid] / 1e9 for rid in ids]
        y = [tool.predicted[rid] / 1e9 for rid in ids]
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
        ax.plot([lo, hi], [0.9 * lo, 0.9 * hi], "k:", lw=0.8, label="-10%")
        ax.plot([lo, hi], [1.1 * lo, 1.1 * hi], "k:", lw=0.8)
        under = [(a, b) for a, b in zip(x, y, strict=True) if b < 0.9 * a]
        ok = [(a, b) for a, b in zip(x, y, strict=True) if b >= 0.9 * a]
        if ok:
            ax.scatter(*zip(*ok, strict=True), s=18, c="tab:blue", label="within / over")
        if under:
            ax.scatter(*zip(*under, strict=True), s=18, c="tab:red", label="under by >10%")
        s = summarize(signed_errors(tool, measured))
        ax.set_title(
            f"{tool.name}\n{s['n']} rows, median |err| {100 * s['median_abs']:.0f}%", fontsize=9
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured (GB)", fontsize=8)
        ax.set_ylabel("predicted (GB)", fontsize=8)
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle("Predicted vs measured peak GPU memory, dev set (log-log)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results_md(
    tools: list[Tool],
    rows: list[dict[str, str]],
    measured: dict[str, float],
    path: Path = RESULTS_MD,
) -> None:
    """RESULTS.md: versions, summary per tool, the bar, per-row table, reasons, plot."""
    today = datetime.date.today().isoformat()
    versions = sorted({t.version for t in tools if t.version} | {_version("torch")})
    out = [
        "# Accuracy benchmark: predicted vs measured peak GPU memory",
        "",
        f"Generated {today} by `python benchmarks/validate.py --write-results` at commit "
        f"`{_git_commit()}` (Python {platform.python_version()}). Do not edit by hand.",
        "",
        "Versions: " + ", ".join(f"`{v}`" for v in versions) + ".",
        "",
        "Rows: `shared/validation/dev_measurements.csv` (published measurements, see its "
        "README); each mapped to trainmem settings in `benchmarks/dev_rows.py`. Error = "
        "(predicted - measured) / measured on the row's own metric (allocated, reserved or "
        "device total); negative is an under-estimate, the dangerous direction. Peers' figures "
        "are compared as the tools give them (none adds a CUDA context or allocator cache).",
        "",
        "## Summary",
        "",
        "| tool | rows run | median abs error | p90 abs error | under-estimated by >10% "
        "| worst under-estimate |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for tool in tools:
        s = summarize(signed_errors(tool, measured))
        if not s["n"]:
            out.append(f"| {tool.name} | 0 | - | - | - | - |")
            continue
        worst = f"{s['worst_under'][0]} {_pct(s['worst_under'][1])}" if s["worst_under"] else "-"
        out.append(
            f"| {tool.name} | {s['n']}/{len(rows)} | {100 * s['median_abs']:.1f}% | "
            f"{100 * s['p90_abs']:.1f}% | {s['under']}/{s['n']} ({100 * s['under'] / s['n']:.0f}%) "
            f"| {worst} |"
        )
    analytic = next((t for t in tools if t.name == "trainmem analytic"), None)
    if analytic is not None:
        errs = signed_errors(analytic, measured)
        s = summarize(errs)
        over15 = sorted(rid for rid, e in errs.items() if e < -0.15)
        med_ok = s["n"] and s["median_abs"] < 0.10
        out += [
            "",
            "Bar (issue 7): trainmem's median absolute error below 10%: "
            f"**{'met' if med_ok else 'not met'}** ({100 * s.get('median_abs', 0):.1f}%); "
            "no row under-estimated by more than 15%: "
            f"**{'met' if not over15 else 'not met'}**"
            + (f" ({', '.join(over15)})" if over15 else "")
            + ".",
        ]
    out += [
        "",
        "![predicted vs measured](results_predicted_vs_measured.png)",
        "",
        "## Per row",
        "",
        "Predicted GB (error). `-`: not run; the reasons follow the table.",
        "",
    ]
    header = (
        "| id | model | settings | metric | measured GB | "
        + " | ".join(t.name for t in tools)
        + " |"
    )
    out += [header, "|" + "---|" * 5 + "---:|" * len(tools)]
    for row in rows:
        rid = row["id"]
        entry = resolve_entry(row)
        if isinstance(entry, dict):
            model, settings, metric = entry["preset"], _describe(entry), entry["metric"]
        else:
            model, settings, metric = row["model"].split(" ")[0], "-", metric_key(row["metric"])
        cells = []
        for tool in tools:
            if rid in tool.predicted:
                p = tool.predicted[rid]
                cells.append(f"{p / 1e9:.2f} ({_pct((p - measured[rid]) / measured[rid])})")
            else:
                cells.append("-")
        out.append(
            f"| {rid} | {model} | {settings} | {metric} | {measured[rid] / 1e9:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    out += ["", "## Not run, and why", ""]
    for tool in tools:
        reasons = _grouped_reasons(tool)
        notes = "".join(f" Note: {n}." for n in tool.notes)
        if not reasons and not notes:
            continue
        out.append(f"- **{tool.name}** ({tool.version}).{notes}")
        for why, ids in reasons.items():
            out.append(f"  - {', '.join(ids)}: {why}")
    out.append("")
    # marked sections (``<!-- name:begin ... -->`` to ``<!-- name:end -->``: dev set 2, the
    # snapshot and torchtitan benchmarks) stay
    kept = ""
    if path.exists():
        previous = path.read_text()
        match = re.search(r"^<!-- [\w-]+:begin", previous, flags=re.MULTILINE)
        if match:
            kept = "\n" + previous[match.start() :].rstrip() + "\n"
    path.write_text("\n".join(out).rstrip() + "\n" + kept)


# --- main ---------------------------------------------------------------------------------------


def _trace_row_main(csv_path: Path, row_id: str) -> int:
    """Subprocess entry: one row through the trace engine, JSON on the last stdout line."""
    row = next(r for r in load_rows(csv_path) if r["id"] == row_id)
    entry = resolve_entry(row)
    assert isinstance(entry, dict)
    try:
        answer: dict[str, Any] = {"predicted_bytes": predict(entry, "trace")}
    except Exception as exc:  # noqa: BLE001 - reported as "not run" with the reason
        answer = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    print(json.dumps(answer))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--no-trace", action="store_true", help="analytic engine only")
    parser.add_argument("--peers", action="store_true", help="run the peers (makes their venv)")
    parser.add_argument(
        "--upgrade-peers",
        action="store_true",
        help="re-run peers/setup_venv.sh (latest releases) before running them",
    )
    parser.add_argument(
        "--write-results",
        action="store_true",
        help="run everything; write RESULTS.md, the plot, uncertainty.json",
    )
    parser.add_argument(
        "--dev2",
        action="store_true",
        help="dev set 2 only (trainmem estimate per row; with --write-results, its section)",
    )
    parser.add_argument("--trace-timeout", type=float, default=TRACE_TIMEOUT_S)
    parser.add_argument("--trace-row", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace_row:
        return _trace_row_main(args.csv, args.trace_row)
    rows = load_rows(args.csv)
    measured = {row["id"]: float(row["measured_gb"]) * 1e9 for row in rows}
    tools = [run_trainmem(rows, "analytic", args.csv)]
    if args.dev2 or args.write_results:
        dev2_rows = load_dev2()
        dev2_results = run_dev2(dev2_rows)
        print_dev2(dev2_rows, dev2_results)
        if args.write_results:
            dev1 = signed_errors(tools[0], measured)
            write_dev2_section(dev2_lines(dev2_rows, dev2_results, dev1, len(rows)))
            print(f"\nwrote the dev set 2 section of {RESULTS_MD}")
            stored = json.loads(UNCERTAINTY_JSON.read_text())
            merged = with_dev2_errors(stored, tools[0], rows, measured, dev2_rows, dev2_results)
            UNCERTAINTY_JSON.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
            print(f"wrote the analytic engine's error spreads of both sets to {UNCERTAINTY_JSON}")
        if args.dev2:
            return 0
        print()
    if args.write_results or not args.no_trace:
        tools.append(run_trainmem(rows, "trace", args.csv, args.trace_timeout))
    if args.write_results or args.peers or args.upgrade_peers:
        python = ensure_peers_venv(upgrade=args.upgrade_peers)
        for name in PEER_ADAPTERS:
            tools.append(run_peer(name, python, rows))
    tools += run_rules(rows)
    print_table(tools, rows, measured)
    if args.write_results:
        write_plot(tools, measured)
        write_results_md(tools, rows, measured)
        UNCERTAINTY_JSON.parent.mkdir(parents=True, exist_ok=True)
        table = uncertainty_table(tools, rows, measured)
        table = with_dev2_errors(table, tools[0], rows, measured, dev2_rows, dev2_results)
        UNCERTAINTY_JSON.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"\nwrote {RESULTS_MD}, {PLOT_PNG}, {UNCERTAINTY_JSON}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
