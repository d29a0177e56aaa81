"""The accuracy benchmark's plumbing (benchmarks/validate.py, benchmarks/dev_rows.py).

No network and no peers: the peers run only from the benchmark script, in their own venv.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO_DIR

BENCH = REPO_DIR / "benchmarks"
sys.path.insert(0, str(BENCH))

import validate  # noqa: E402
from dev_rows import ROWS  # noqa: E402

from trainmem.breakdown import MemoryBreakdown  # noqa: E402
from trainmem.specs.hf import model_spec_from_hf  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

needs_csv = pytest.mark.skipif(
    not validate.DEFAULT_CSV.exists(), reason="shared/validation/dev_measurements.csv not beside"
)


@needs_csv
def test_mapping_covers_every_csv_row_and_nothing_else() -> None:
    ids = [row["id"] for row in validate.load_rows()]
    assert len(ids) == len(set(ids))
    assert set(ROWS) == set(ids)


@needs_csv
def test_every_entry_is_settings_or_a_reason() -> None:
    for row in validate.load_rows():
        entry = validate.resolve_entry(row)
        if isinstance(entry, str):
            assert len(entry) > 20, f"{row['id']}: a reason, not a placeholder"
            continue
        TrainingConfig(**entry["training"])  # validates every field
        model_spec_from_hf(validate.hf_config(entry), name=entry["preset"])
        assert entry["metric"] in ("allocated", "reserved", "device_total")


@needs_csv
def test_metric_per_row_follows_the_metric_column() -> None:
    for row in validate.load_rows():
        entry = validate.resolve_entry(row)
        if isinstance(entry, str):
            continue
        text = row["metric"].lower()
        if "max_memory_allocated" in text:
            assert entry["metric"] == "allocated", row["id"]
        elif "max_memory_reserved" in text:
            assert entry["metric"] == "reserved", row["id"]
        else:
            assert entry["metric"] == "device_total", row["id"]
    by_id = {row["id"]: validate.resolve_entry(row) for row in validate.load_rows()}
    assert by_id["GT001"]["metric"] == "device_total"  # type: ignore[index]
    assert by_id["GT071"]["metric"] == "device_total"  # type: ignore[index]
    assert by_id["GT084"]["metric"] == "allocated"  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("torch.cuda.max_memory_allocated()/1e9 ('Memory used')", "allocated"),
        ("torch.cuda.max_memory_reserved() in GiB", "reserved"),
        ("NVML used memory after trainer.train() (nvidia-smi-style total)", "device_total"),
        ("total GPU memory (nvidia-smi style)", "device_total"),
    ],
)
def test_metric_key(text: str, key: str) -> None:
    assert validate.metric_key(text) == key


def test_pick_metric_compares_like_with_like() -> None:
    b = MemoryBreakdown(
        parameters=10,
        gradients=20,
        optimizer_states=30,
        activations=40,
        temporary=0,
        fragmentation=5,
        cuda_context=1000,
    )
    assert validate.pick_metric(b, "allocated") == 100
    assert validate.pick_metric(b, "reserved") == 105
    assert validate.pick_metric(b, "device_total") == 1105
    # A row's own era context replaces the default.
    assert validate.pick_metric(b, "device_total", cuda_context_bytes=7) == 112


def test_summary_statistics() -> None:
    errors = {"a": -0.2, "b": -0.05, "c": 0.0, "d": 0.1, "e": 0.3}
    s = validate.summarize(errors)
    assert s["n"] == 5
    assert s["median_abs"] == pytest.approx(0.1)
    assert s["p90_abs"] == pytest.approx(0.3)
    assert s["under"] == 1
    assert s["worst_under"] == ("a", -0.2)
    assert validate.summarize({}) == {"n": 0}


def test_trace_limits_are_the_trace_engines_own_refusals() -> None:
    # what the trace engine runs (LoRA through peft, FSDP2) is traced; what it refuses is named
    assert validate.trace_limits(TrainingConfig()) is None
    assert validate.trace_limits(TrainingConfig(lora_rank=8)) is None
    assert validate.trace_limits(TrainingConfig(data_parallel_size=2, zero_stage=3)) is None
    # a quantized base is traced (trainmem.trace.quantized), peft's fp32 upcast of a 16-bit
    # model included
    assert validate.trace_limits(TrainingConfig(lora_rank=8, quantize_base="nf4")) is None
    bf16 = TrainingConfig(lora_rank=8, quantize_base="nf4", precision="bf16-true")
    assert validate.trace_limits(bf16) is None
    # beside a matmul that saves its input (int8) it is not
    why = validate.trace_limits(
        TrainingConfig(lora_rank=8, quantize_base="int8", precision="bf16-true")
    )
    assert why is not None and "quantize_base=int8" in why
    # offload outside DeepSpeed is a rule applied to the traced step (trainmem.traced_options)
    assert validate.trace_limits(TrainingConfig(offload="optimizer")) is None
    # and so is DeepSpeed's offload at every ZeRO stage (trainmem's DeepSpeed transforms on the
    # traced step)
    for stage in (2, 3):
        offloaded = TrainingConfig(
            framework="deepspeed", data_parallel_size=2, zero_stage=stage, offload="optimizer"
        )
        assert validate.trace_limits(offloaded) is None


def test_rules_of_thumb_refuse_what_they_cannot_express() -> None:
    full = TrainingConfig(precision="16-mixed")
    assert validate.rule_limits(full, "ZeRO paper (Rajbhandari et al. 2020)") is None
    fp32 = TrainingConfig(precision="32-true")
    assert validate.rule_limits(fp32, "ZeRO paper (Rajbhandari et al. 2020)") is not None
    assert validate.rule_limits(fp32, "'model memory' rule (P=4)") is None
    assert validate.rule_limits(TrainingConfig(lora_rank=8), "'model memory' rule (P=2)")
    assert validate.rule_limits(TrainingConfig(optimizer="adafactor"), "GPT-2 calculator")


def test_uncertainty_table_groups_errors_by_kind() -> None:
    rows = [{"id": "GT001"}, {"id": "GT084"}]
    tool = validate.Tool("trainmem analytic", predicted={"GT001": 90, "GT084": 120})
    table = validate.uncertainty_table([tool], rows, {"GT001": 100.0, "GT084": 100.0})
    analytic = table["engines"]["analytic"]
    assert analytic["all"]["n"] == 2
    assert analytic["all"]["min"] == pytest.approx(-0.1)
    assert analytic["method=full"] == {
        "n": 1,
        "min": -0.1,
        "p10": -0.1,
        "median": -0.1,
        "p90": -0.1,
        "max": -0.1,
    }
    assert analytic["method=lora"]["max"] == pytest.approx(0.2)


needs_dev2 = pytest.mark.skipif(
    not validate.DEV2_ARGS.exists(), reason="shared/validation/dev_measurements_2* not beside"
)


@needs_dev2
def test_dev2_rows_join_the_args_with_the_csv() -> None:
    rows = validate.load_dev2()
    assert len(rows) == 154
    assert len({r.id for r in rows}) == 154
    for row in rows:
        # every row is either rebuildable (args, a metric) or carries the reason it is not
        assert (row.args is None) == (row.reason is not None), row.id
        if row.args is not None:
            assert row.metric in ("allocated", "reserved", "device_total"), row.id
            assert all(Path(a).exists() for a in validate.cli_args(row) if a.endswith(".json"))
        assert row.measured > 0 and row.framework


def test_dev2_metric_of_reads_the_cli_json() -> None:
    answer = {
        "peak": {"allocated_bytes": 10, "reserved_bytes": 12, "device_total_bytes": 15},
        "breakdown_bytes": {"cuda_context": 3},
        "per_rank": [
            {"pipeline_stage": 0, "allocated_bytes": 10, "reserved_bytes": 12, "oom": False},
            {"pipeline_stage": 1, "allocated_bytes": 7, "reserved_bytes": 8, "oom": False},
        ],
    }
    assert validate.metric_of(answer, "allocated") == 10
    assert validate.metric_of(answer, "device_total") == 15
    # only the last pipeline stage was logged: its figure, not the worst rank's
    assert validate.metric_of(answer, "allocated", "last_stage") == 7
    assert validate.metric_of(answer, "device_total", "last_stage") == 11
    # an out-of-memory verdict has no reserved figure
    oom = {**answer, "peak": {**answer["peak"], "reserved_bytes": None}}
    assert validate.metric_of(oom, "reserved") is None
    assert validate._without_gpu(["m", "--gpu", "A100", "--json"]) == ["m", "--json"]


def test_dev2_row_runs_through_the_cli_and_refusals_are_named() -> None:
    row = validate.Dev2Row(
        id="X1",
        model="gpt2",
        framework="plain",
        metric="allocated",
        measured=10**9,
        args=["gpt2", "--micro-batch-size", "1", "--seq-len", "128"],
    )
    res = validate.run_dev2_row(row)
    assert res.refused is None and res.predicted and res.engine == "analytic"
    bad = validate.Dev2Row(
        **{**row.__dict__, "args": ["gpt2", "--lora-rank", "8", "--lora-targets", "gate"]}
    )
    refused = validate.run_dev2_row(bad)
    assert refused.predicted is None and refused.refused and "lora" in refused.refused
    results = {"X1": res, "X2": refused}
    rows = [row, validate.Dev2Row(**{**bad.__dict__, "id": "X2"})]
    errors = validate.dev2_errors(rows, results)
    summary = validate.dev2_summary(rows, results, errors)
    assert summary["n"] == 1 and len(summary["refused"]) == 1 and summary["oom"] == []
    lines = validate.dev2_lines(rows, results, {"GT001": 0.01}, 1)
    assert any(line.startswith("| X1 | gpt2 |") for line in lines)
    assert any("refused" in line for line in lines if line.startswith("| X2"))


def test_dev2_section_replaces_itself_before_other_sections(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# top\n\n<!-- other:begin (x) -->\nother\n<!-- other:end -->\n")
    validate.write_dev2_section(["## dev 2", "one"], path)
    validate.write_dev2_section(["## dev 2", "two"], path)
    text = path.read_text()
    assert text.count(validate.DEV2_BEGIN) == 1 and "two" in text and "one" not in text
    assert text.index(validate.DEV2_END) < text.index("<!-- other:begin")


@needs_dev2
def test_dev2_amendments_name_their_source_and_run_through_the_cli() -> None:
    from dev2_causes import AMENDMENTS, CAUSES

    rows = {r.id: r for r in validate.load_dev2()}
    assert set(AMENDMENTS) <= set(rows) and set(CAUSES) <= set(rows)
    for rid, (flags, why) in AMENDMENTS.items():
        assert rows[rid].amend == flags and rows[rid].args is not None
        assert flags[0].startswith("--") and len(why) > 40, rid
    # a config amendment runs a derived config.json; the as-read arguments keep the original
    dino = rows["GT167"]
    assert dino.config == {"image_size": 224}
    derived = json.loads(Path(validate.cli_args(dino)[0]).read_text())
    assert derived["image_size"] == 224 and derived["model_type"] == "dinov2"
    assert validate.cli_args(dino, amended=False)[0].endswith("dinov2-giant/config.json")
    # an amended row is run twice: as the jsonl reads it, and with the source's flags
    res = validate.run_dev2_row(rows["GT115"])
    assert res.as_read is not None and res.as_read.predicted and res.predicted
    assert res.predicted != res.as_read.predicted


def test_dev2_amendment_repeating_a_flag_wins_over_the_reading() -> None:
    """GT030's jsonl reads ``--seq-len 512 --gradient-accumulation-steps 64`` (the April 2024
    config); its amendment (its figure is of March 2024, untruncated alpaca-cleaned, no
    accumulation) repeats both flags, and the run must use the amendment's."""
    rows = {r.id: r for r in validate.load_dev2()}
    row = rows["GT030"]
    assert row.args is not None
    read = row.args
    assert read[read.index("--seq-len") + 1] == "512"
    assert read[read.index("--gradient-accumulation-steps") + 1] == "64"
    res = validate.run_dev2_row(row, with_as_read=False)
    assert res.config is not None
    assert res.config["seq_len"] == 1585
    assert res.config["gradient_accumulation_steps"] == 1
