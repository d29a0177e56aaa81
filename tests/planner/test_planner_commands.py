"""The plan / fit / sweep commands end to end (registered on trainmem's app here; cli.py
registers them itself once the lead wires ``register(app)`` in)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from conftest import Invoke
from trainmem.cli import app
from trainmem.cli.planner import register

if not {c.name for c in app.registered_commands} & {"plan", "fit", "sweep"}:
    register(app)


def test_plan_json(invoke: Invoke) -> None:
    r = invoke("plan", "gpt2", "--gpu", "T4", "-s", "1024", "--json")
    d = json.loads(r.stdout)
    assert d["schema_version"] == 1 and d["model"] == "gpt2"
    mb, sl = d["results"]
    assert mb["dimension"] == "micro_batch_size" and mb["limited_by"] == "memory"
    # the margin is the GPU's capacity minus the planned run's device total, which fits
    assert 0 <= mb["margin_bytes"] < 15_000_000_000
    assert sl["dimension"] == "seq_len" and sl["value"] == 1024
    assert sl["limited_by"] == "context_length"
    # the granularity the CLI's "fixed:" line states, in the JSON too
    assert (mb["step"], sl["step"]) == (1, 8)


def test_plan_table_and_reasons(invoke: Invoke) -> None:
    r = invoke("plan", "gpt2", "--gpu", "T4", "-s", "1024")
    assert "the most that fits" in r.stdout and "GiB = 2^30 bytes" in r.stdout
    assert "micro_batch_size: micro_batch_size=" in r.stdout


def test_plan_when_nothing_fits(invoke: Invoke) -> None:
    r = invoke("plan", "llama-3.1-405b", "--gpu", "T4")
    assert "none fits" in r.stdout and "weights alone" in r.stdout


def test_fit_lists_fixes(invoke: Invoke) -> None:
    r = invoke("fit", "gpt2", "--gpu", "T4", "-b", "16", "-s", "1024")
    assert "does not fit" in r.stdout and "cheapest first" in r.stdout
    # gpt2's fixes are the formulas' (analytic engine): the caption must not claim a trace
    assert "generic path" not in r.stdout
    d = json.loads(invoke("fit", "gpt2", "--gpu", "T4", "-b", "16", "-s", "1024", "--json").stdout)
    assert d["fits"] is False and d["fixes"]
    assert all(f["margin_bytes"] >= 0 and f["saved_bytes"] > 0 for f in d["fixes"])


def test_fit_when_it_already_fits(invoke: Invoke) -> None:
    r = invoke("fit", "gpt2", "--gpu", "A100-80GB", "-b", "1", "-s", "1024")
    assert "nothing to change" in r.stdout


def test_sweep_csv_and_json(invoke: Invoke) -> None:
    args = ["sweep", "gpt2", "--gpu", "T4", "--over", "micro-batch-size=1,2,4,8"]
    args += ["--over", "seq-len=512,1024"]
    r = invoke(*args, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 8 and rows[0]["micro_batch_size"] == "1"
    r = invoke(*args, "--format", "json")
    data = json.loads(r.stdout)["rows"]
    assert len(data) == 8 and {d["seq_len"] for d in data} == {512, 1024}
    r = invoke(*args)
    assert "sweep" in r.stdout


def test_sweep_json_says_what_was_computed_and_assumed(invoke: Invoke) -> None:
    # issue 26: `sweep --format json` printed a bare list of rows, without the model, the GPU
    # or what was assumed, where estimate / plan / fit report them; each is checked here
    # against `estimate --json` of the same point, the command a user would run to check it
    args = ["sweep", "gpt2", "--gpu", "T4", "-s", "512", "--over", "micro-batch-size=2,4"]
    d = json.loads(invoke(*args, "--format", "json").stdout)
    est = json.loads(
        invoke("estimate", "gpt2", "--gpu", "T4", "-s", "512", "-b", "2", "--json").stdout
    )
    assert d["schema_version"] == 1
    assert (d["model"], d["engine"], d["gpu"]) == (est["model"], est["engine"], est["gpu"])
    assert d["over"] == {"micro_batch_size": [2, 4]}
    assert d["config"] == est["config"]
    assert d["assumed"] == est["details"]["assumed"]
    assert [r["micro_batch_size"] for r in d["rows"]] == [2, 4]
    assert all("assumed" not in r for r in d["rows"])  # the same as the top-level one
    # a swept framework changes what a row assumed: that row says so
    over = ["--over", "framework=pytorch-amp,hf-trainer"]
    d = json.loads(invoke(*args[:-2], *over, "--format", "json").stdout)
    hf = json.loads(
        invoke(
            "estimate", "gpt2", "--gpu", "T4", "-s", "512", "--framework", "hf-trainer", "--json"
        ).stdout
    )
    assert d["assumed"]["framework"] == "pytorch-amp" and "assumed" not in d["rows"][0]
    assert d["rows"][1]["assumed"] == hf["details"]["assumed"]
    # lengths drawn from a dataset's statistics depend on the micro-batch size: each row's own
    lengths = ["--sample-lengths", "alpaca-cleaned"]
    d = json.loads(invoke(*args, *lengths, "--format", "json").stdout)
    est4 = json.loads(
        invoke("estimate", "gpt2", "--gpu", "T4", "-s", "512", "-b", "4", *lengths, "--json").stdout
    )
    assert d["rows"][1]["assumed"]["lengths"] == est4["details"]["assumed"]["lengths"]
    assert d["rows"][1]["assumed"]["lengths"] != d["assumed"]["lengths"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep", "gpt2", "--gpu", "T4", "--over", "batch=1"], "error: over: unknown field"),
        (["sweep", "gpt2", "--over", "seq-len=x"], "error: seq_len: must be an integer"),
        (["sweep", "gpt2", "--over", "seq-len=8", "--format", "xml"], "error: format:"),
        (["sweep", "gpt2", "--over", "precision=fp8"], "error: precision: unknown value"),
        (["plan", "gpt2"], "error: gpu: required"),
        (["fit", "gpt2", "--gpu", "A9000"], "error: gpu: unknown GPU"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(invoke: Invoke, args: list[str], message: str) -> None:
    r = invoke(*args, exit_code=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr


def test_plan_and_fit_take_the_sharding_and_lora_options(invoke: Invoke) -> None:
    args = ["llama-3.1-8b", "--gpu", "A100-80GB", "-s", "2048", "--fsdp", "full-shard"]
    args += ["--data-parallel-size", "8", "--json"]
    r = invoke("plan", *args)
    d = json.loads(r.stdout)
    best = d["results"][0]
    assert best["config"]["zero_stage"] == 3 and best["limited_by"] == "memory"
    # the planned micro-batch fits and one more does not, by the estimate of the same run
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    base = dict(seq_len=2048, zero_stage=3, data_parallel_size=8)
    fits = estimate(
        "llama-3.1-8b", TrainingConfig(micro_batch_size=best["value"], **base), gpu="A100-80GB"
    ).fits
    over = estimate(
        "llama-3.1-8b", TrainingConfig(micro_batch_size=best["value"] + 1, **base), gpu="A100-80GB"
    ).fits
    assert (fits, over) == (True, False)
    r = invoke("fit", "llama-3.2-1b", "--gpu", "T4", "-s", "2048", "--lora-rank", "8", "--json")
    assert json.loads(r.stdout)["config"]["lora_rank"] == 8
