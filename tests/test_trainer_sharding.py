"""The HF Trainer shards through DeepSpeed or accelerate's FSDP: ``--framework hf-trainer``
with a ZeRO stage is DeepSpeed's run (it was the formulas' generic ZeRO, which the generic
path refused: "does not model framework=hf-trainer"), with ``--fsdp`` accelerate's FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Invoke, InvokeJson
from trainmem.specs.training import trainer_sharding_framework

WHISPER = Path(__file__).parent / "models" / "whisper.json"


@pytest.mark.parametrize(
    ("framework", "zero_stage", "fsdp", "expected"),
    [
        ("hf-trainer", 2, None, "deepspeed"),
        ("hf-trainer", 3, None, "deepspeed"),
        ("hf-trainer", 3, "full-shard", "accelerate-fsdp"),
        ("hf-trainer", 0, None, None),
        ("pytorch-amp", 2, None, None),
        ("deepspeed", 2, None, None),
    ],
)
def test_which_framework_shards(
    framework: str, zero_stage: int, fsdp: str | None, expected: str | None
) -> None:
    assert trainer_sharding_framework(framework, zero_stage, fsdp) == expected


def test_the_cli_estimates_deepspeeds_run(invoke: Invoke, invoke_json: InvokeJson) -> None:
    run = ("llama-3.2-1b", "-b", "1", "-s", "512", "--data-parallel-size", "2", "--zero-stage")
    trainer = invoke_json("estimate", *run, "2", "--framework", "hf-trainer")
    deepspeed = invoke_json("estimate", *run, "2", "--framework", "deepspeed")
    assert trainer["config"]["framework"] == "deepspeed"
    assert trainer["peak"] == deepspeed["peak"]
    text = invoke("estimate", *run, "2", "--framework", "hf-trainer").stdout
    assert "the Trainer shards through DeepSpeed" in " ".join(text.split())


def test_the_web_page_does_the_same() -> None:
    from trainmem.web.form import default_values, training_config

    values = {
        **default_values(),
        "framework": "hf-trainer",
        "zero_stage": 3,
        "data_parallel_size": 2,
    }
    assert training_config(values, default_seq_len=512).framework == "deepspeed"


def test_a_model_without_formulas_runs_on_the_generic_path(invoke_json: InvokeJson) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = invoke_json(
        "estimate", WHISPER, "--framework", "hf-trainer", "--zero-stage", "2",
        "--data-parallel-size", "2", "-b", "2", "-s", "16",
    )  # fmt: skip
    assert out["engine"] == "generic"
    assert out["peak"]["allocated_bytes"] > 0
