"""The estimate says which framework it assumed, and says so loudly when another common
framework would move the answer by more than 10% (issue 27: "one flag halves the answer")."""

from __future__ import annotations

import json

from conftest import Invoke
from trainmem.planner.sensitivity import framework_sensitivity
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


def test_fsdp_without_mixed_precision_differs_from_accelerates() -> None:
    # Plain FSDP with autocast gathers fp32 weights and keeps the fp32 residual stream;
    # accelerate's FSDP sets MixedPrecision(param_dtype=bf16) (accelerate/utils/dataclasses.py
    # FullyShardedDataParallelPlugin), so its gathered units and activations are half as wide:
    # its peak must be lower, and by more than 10%.
    spec = load_model_spec("mistral-7b-v0.1")
    training = TrainingConfig(micro_batch_size=4, seq_len=2048, zero_stage=3, data_parallel_size=8)
    rows = {r["framework"]: r for r in framework_sensitivity(spec, training, None)}
    assert "accelerate-fsdp" in rows
    assert rows["accelerate-fsdp"]["change"] < -0.10


def test_the_json_reports_what_was_assumed(invoke: Invoke) -> None:
    result = invoke("estimate", "llama-3.2-1b", "-s", "512", "--json")
    assumed = json.loads(result.stdout)["details"]["assumed"]
    assert assumed["framework"] == "pytorch-amp"
    assert assumed["torch"] == "2.8 (default)"
    explicit = invoke("estimate", "llama-3.2-1b", "-s", "512", "--torch-version", "2.4", "--json")
    assert json.loads(explicit.stdout)["details"]["assumed"]["torch"] == "2.4"


def test_the_cli_prints_the_assumption_and_the_framework_note(invoke: Invoke) -> None:
    args = ["estimate", "mistral-7b-v0.1", "--fsdp", "full-shard", "--data-parallel-size", "8"]
    result = invoke(*args, "-b", "4", "-s", "2048")
    text = " ".join(result.output.split())
    assert "assumed: --framework pytorch-amp" in text
    assert "the framework matters here" in text and "--framework accelerate-fsdp" in text


def test_no_framework_note_when_the_user_chose_the_framework(invoke: Invoke) -> None:
    args = ["estimate", "mistral-7b-v0.1", "--fsdp", "full-shard", "--data-parallel-size", "8"]
    for chosen in (["--framework", "pytorch-amp"], ["--set", "framework=pytorch-amp"]):
        result = invoke(*args, *chosen, "-b", "4", "-s", "2048", "--json")
        notes = json.loads(result.stdout)["notes"]
        assert not any("the framework matters here" in n for n in notes), chosen


def test_the_assumed_loop_is_reported(invoke: Invoke) -> None:
    # what the loop does with the step's tensors, from the loop settings the estimate used
    plain = invoke("estimate", "llama-3.2-1b", "-s", "512", "--json")
    loop = json.loads(plain.stdout)["details"]["assumed"]["loop"]
    assert loop == (
        "one micro-batch per step, the step's outputs dropped after the loss, "
        "zero_grad(set_to_none=True) after the step"
    )
    kept = invoke(
        "estimate", "llama-3.2-1b", "-s", "512", "--keep-logits", "--zero-grad-keep", "--json"
    )
    loop = json.loads(kept.stdout)["details"]["assumed"]["loop"]
    assert "logits held to the end of the step" in loop
    assert "zero_grad() keeps the gradients allocated" in loop
