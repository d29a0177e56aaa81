"""The command line end to end: JSON keys, tables, and one clear line for every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke

BREAKDOWN = {
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "temporary",
    "fragmentation",
    "cuda_context",
}


def test_estimate_json_has_the_documented_keys(invoke: Invoke) -> None:
    r = invoke("estimate", "llama-3.2-1b", "--gpu", "A100-40GB", "--json")
    d = json.loads(r.stdout)
    assert set(d["breakdown_bytes"]) == BREAKDOWN
    assert all(isinstance(v, int) for v in d["breakdown_bytes"].values())
    assert d["num_parameters"] == d["num_trainable_parameters"] == 1_235_814_400
    peak = d["peak"]
    assert peak["allocated_bytes"] <= peak["reserved_bytes"] <= peak["device_total_bytes"]
    assert d["gpu"]["capacity_bytes"] > 0 and isinstance(d["fits"], bool)
    # defaults are resolved and reported: llama-3.2's 131072 context capped at 4096
    assert d["config"]["seq_len"] == 4096
    assert d["config"]["precision"] == "bf16-mixed" and d["config"]["attention"] == "sdpa"
    assert d["schema_version"] == 4
    states = d["model_states_bytes"]
    assert set(states) == {"parameters", "gradients", "optimizer_states"}
    # llama-3.2-1b, bf16-mixed AdamW: fp32 weights (4 B), fp32 gradients (4 B), two fp32 moments
    assert states["parameters"] == 4 * 1_235_814_400
    assert states["gradients"] == 4 * 1_235_814_400
    assert states["optimizer_states"] == 8 * 1_235_814_400
    assert "oom" in peak
    assert d["rank_map"]["world_size"] == 1 and len(d["per_rank"]) == 1


def test_estimate_table_states_gib_and_verdict(invoke: Invoke) -> None:
    r = invoke("estimate", "gpt2", "-b", "4", "--gpu", "T4")
    assert "GiB = 2^30 bytes" in r.stdout
    assert "max_memory_allocated" in r.stdout and "T4" in r.stdout
    assert "micro_batch_size=4" in r.stdout
    # the phase is said once: "peak falls in the backward: backward: ..." read as a stutter
    line = next(x for x in r.stdout.splitlines() if x.startswith("peak falls in the "))
    phase = line.removeprefix("peak falls in the ").split(":")[0]
    assert phase in ("forward", "backward", "optimizer")
    assert not line.split(": ", 1)[1].startswith(phase), line


def test_estimate_of_a_user_config_file(invoke: Invoke, tmp_path: Path) -> None:
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = invoke("estimate", str(tmp_path), "--json")
    # embed 256000 + lm_head 256000 + 2 * (q 65536 + k,v 2*32768 + o 65536 + 3*256*688
    # + 2 norms 512) + final norm 256
    layer = 65536 + 2 * 32768 + 65536 + 3 * 256 * 688 + 512
    assert json.loads(r.stdout)["num_parameters"] == 2 * 256000 + 2 * layer + 256


def test_models_and_gpus_list(invoke: Invoke) -> None:
    r = invoke("models")
    assert "llama-3.1-405b" in r.stdout
    r = invoke("gpus", "--json")
    names = {g["name"] for g in json.loads(r.stdout)}
    assert {"H100-80GB", "A100-40GB", "T4", "MI250"} <= names


def test_formulas_side_by_side(invoke: Invoke) -> None:
    r = invoke("formulas", "gpt2", "-b", "8", "-s", "1024", "-p", "32-true")
    for name in ("ZeRO paper", "model memory", "GPT-2 calculator", "Korthikanti", "trainmem"):
        assert name in r.stdout


def bad(tmp_path: Path, content: str) -> str:
    p = tmp_path / "config.json"
    p.write_text(content)
    return str(p)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "lama-2-7b"], "llama-2-7b"),  # suggests the close preset name
        (["estimate", "gpt2", "--precision", "fp17"], "bf16-mixed"),  # lists allowed values
        (["estimate", "gpt2", "--optimizer", "adamx"], "adamw-8bit"),
        (["estimate", "gpt2", "--gpu", "A1000"], "A100"),
        (["estimate", "gpt2", "--micro-batch-size", "0"], "micro_batch_size"),
        (["estimate", "gpt2", "--seq-len", "-5"], "seq_len"),
        (["estimate", "gpt2", "--activation-checkpointing", "some"], "selective"),
        (["estimate", "gpt2", "--engine", "magic"], "analytic"),
    ],
)
def test_bad_options_get_one_clear_line(invoke: Invoke, args: list[str], needle: str) -> None:
    r = invoke(*args, exit_code=2)
    assert "Traceback" not in r.output
    assert r.stderr.startswith("error: ") and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", "not valid JSON"),
        ('{"hidden_size": 64}', "model_type"),
        ('{"model_type": "t5", "d_model": 512}', "t5"),
        (
            '{"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3, '
            '"num_hidden_layers": 2, "intermediate_size": 10, "vocab_size": 10}',
            "num_attention_heads",
        ),
        (
            '{"model_type": "gpt2", "n_embd": 0, "n_head": 1, "n_layer": 1, "vocab_size": 10}',
            "n_embd",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, '
            '"intermediate_size": 10, "vocab_size": 10}',
            "num_hidden_layers",
        ),
    ],
)
def test_bad_config_files_get_one_clear_line(
    invoke: Invoke, tmp_path: Path, content: str, field: str
) -> None:
    r = invoke("estimate", bad(tmp_path, content), exit_code=2)
    assert "Traceback" not in r.output
    assert r.stderr.startswith("error: ") and field in r.stderr


def test_plan_accepts_any_setting_through_set(invoke: Invoke) -> None:
    # Tensor parallelism over 4 ranks splits weights, states and most activations, so the
    # largest micro-batch per rank can only grow.
    def planned(*extra: str) -> int:
        r = invoke("plan", "llama-3.2-1b", "--gpu", "A100-40GB", "-s", "2048", "--json", *extra)
        rows = json.loads(r.stdout)["results"]
        return next(row for row in rows if row["dimension"] == "micro_batch_size")["value"] or 0

    assert planned("--set", "tensor-parallel-size=4") > planned()
    bad = invoke("plan", "gpt2", "--gpu", "T4", "--set", "warp-speed=9", exit_code=2)
    assert bad.stderr.startswith("error: ")


def test_estimate_prints_per_module_tables(invoke: Invoke) -> None:
    r = invoke("estimate", "tiny-llama-test", "-s", "64", "--modules", "3")
    assert "by module" in r.stdout and "layers.0" in r.stdout
    r = invoke("estimate", "tiny-llama-test", "-s", "64", "--modules", "3", "--json")
    modules = json.loads(r.stdout)["details"]["modules"]
    # the top rows of the activation table are real module names with positive bytes
    assert modules["activations"] and all(row for row in modules["activations"])


def test_trace_engine_runs_a_family_the_analytic_engine_does_not_model(
    invoke: Invoke, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    # OPT: not a formula family (T5, the earlier example, is one since issue 15)
    cfg = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 64,
        "ffn_dim": 128,
        "word_embed_proj_dim": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    analytic = invoke("estimate", str(path), "-s", "32", "--engine", "analytic", exit_code=2)
    assert "--engine trace" in analytic.stderr
    auto = invoke("estimate", str(path), "-s", "32", "--json")  # the default: the generic path
    assert json.loads(auto.stdout)["engine"] == "generic"
    traced = invoke("estimate", str(path), "-s", "32", "--engine", "trace", "--json")
    d = json.loads(traced.stdout)
    # the trace counts every parameter exactly once and keeps 16 bytes per parameter of AMP
    # AdamW states
    assert d["breakdown_bytes"]["optimizer_states"] == 2 * d["breakdown_bytes"]["parameters"]
    assert d["peak"]["allocated_bytes"] > d["breakdown_bytes"]["parameters"]


def test_a_run_that_does_not_fit_points_to_fit(invoke: Invoke) -> None:
    # llama-3.1-8b with AdamW in AMP needs 16 bytes x 8.03e9 parameters of model states alone,
    # far over a T4's 16 GB
    r = invoke("estimate", "llama-3.1-8b", "-s", "512", "--gpu", "T4")
    assert "does not fit" in r.stdout and "trainmem fit llama-3.1-8b --gpu T4" in r.stdout


def test_negative_module_rows_are_refused(invoke: Invoke) -> None:
    r = invoke("estimate", "gpt2", "--modules", "-2", exit_code=2)
    assert r.stderr.startswith("error: modules:")


def test_fit_refuses_a_non_positive_limit(invoke: Invoke) -> None:
    r = invoke("fit", "gpt2", "--gpu", "T4", "-b", "64", "--limit", "-1", exit_code=2)
    assert r.stderr.startswith("error: limit:")


def test_eager_only_family_takes_eager_attention_unless_asked_otherwise(invoke: Invoke) -> None:
    # transformers' BloomForCausalLM has no SDPA path: without --attention the estimate runs the
    # attention transformers would run (eager); an explicit --attention sdpa is refused, naming
    # the field
    r = invoke("estimate", "bloomz-7b1", "-b", "1", "-s", "256", "--json")
    assert json.loads(r.stdout)["config"]["attention"] == "eager"
    r = invoke("estimate", "bloomz-7b1", "-b", "1", "-s", "256", "--attention", "sdpa", exit_code=2)
    assert "attention" in r.output


def test_pipeline_parallel_defaults_to_one_micro_batch_per_stage(invoke: Invoke) -> None:
    """torch's Schedule1F1B refuses fewer micro-batches than stages (schedules.py: "Number of
    microbatches must be greater than or equal to the number of stages"); without
    --gradient-accumulation-steps the CLI runs the fewest it accepts; an explicit count wins."""

    def micro_batches(*extra: str) -> int:
        args = ["estimate", "llama-3.2-1b", "--seq-len", "512", *extra, "--json"]
        return int(json.loads(invoke(*args).stdout)["config"]["gradient_accumulation_steps"])

    assert micro_batches("--pipeline-parallel-size", "4") == 4
    assert micro_batches("--pipeline-parallel-size", "4", "--gradient-accumulation-steps", "8") == 8
    explicit_one = ["--gradient-accumulation-steps", "1", "--pipeline-schedule", "gpipe"]
    assert micro_batches("--pipeline-parallel-size", "4", *explicit_one) == 1
    assert micro_batches() == 1
    refused = invoke(
        "estimate", "llama-3.2-1b", "--pipeline-parallel-size", "4",
        "--gradient-accumulation-steps", "2", "--framework", "fsdp2",
        "--data-parallel-size", "2", "--fsdp", "full-shard", exit_code=2,
    )  # fmt: skip
    assert "gradient_accumulation_steps" in refused.output


def test_the_table_shows_every_rank_that_differs(invoke: Invoke) -> None:
    """Pipeline stages differ (stage 0 holds more micro-batches in flight, the last one the
    logits): the text output lists each with the JSON's bytes."""
    args = ["estimate", "llama-3.2-1b", "--seq-len", "512", "--pipeline-parallel-size", "2"]
    ranks = json.loads(invoke(*args, "--json").stdout)["per_rank"]
    assert [r["pipeline_stage"] for r in ranks] == [0, 1]
    text = invoke(*args).output
    assert "per rank" in text
    for r in ranks:
        assert f"{r['allocated_bytes'] / 2**30:,.2f}" in text
