"""The web calculator without a browser: the option list, the URL codec, the CLI command, the
uploads and the handlers' error paths (no gradio needed)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke, InvokeJson
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.hf import PRESETS_DIR
from trainmem.specs.training import TrainingConfig
from trainmem.web import handlers as h
from trainmem.web.compute import numbers, resolve_request, run
from trainmem.web.form import (
    GROUPS,
    MODEL_DEFAULT,
    cli_command,
    default_values,
    field,
    from_query,
    to_query,
    training_config,
)
from trainmem.web.uploads import MAX_UPLOAD_BYTES, accelerate_from_upload, model_from_upload

GiB = 2**30


def test_every_training_setting_is_on_the_page_once() -> None:
    listed = [name for names in GROUPS.values() for name in names]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(TrainingConfig))
    assert len(listed) == len(set(listed))


def test_option_kinds_follow_the_dataclass() -> None:
    assert field("micro_batch_size").kind == "int"
    assert field("lora_dropout").kind == "float"
    assert field("dropout").kind == "bool"
    assert field("precision").choices == (
        "32-true",
        "16-mixed",
        "bf16-mixed",
        "16-true",
        "bf16-true",
        "fp8-mixed",
    )
    assert field("lora_targets").kind == "multi"
    with pytest.raises(SpecError, match="not a training setting"):
        field("learning_rate")


def test_defaults_are_the_clis() -> None:
    # trainmem estimate gpt2 with no option: seq_len = min(n_positions = 1024, 4096)
    training = training_config(default_values(), default_seq_len=1024)
    assert training == TrainingConfig(seq_len=1024)


SETTINGS: list[dict[str, Any]] = [
    {"model": "gpt2", "micro_batch_size": 4, "precision": "bf16-true"},
    {
        "model": "llama-3.2-1b",
        "seq_len": 2048,
        "activation_checkpointing": "full",
        "dropout": False,
        "zero_grad_set_to_none": False,
        "lora_rank": 16,
        "lora_targets": ("q", "k", "v", "o"),
        "quantize_base": "nf4",
        "alloc_conf": "expandable_segments:True",
    },
    {
        "model": "llama-3.1-8b",
        "gpu": "A100-80GB",
        "data_parallel_size": 8,
        "zero_stage": 3,
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "pipeline_parallel_size": 4,
        "pipeline_schedule": "interleaved-1f1b",
        "virtual_pipeline_stages": 4,
        "framework": "megatron",
    },
    # attention left to the model: transformers runs BLOOM eager only (no SDPA class)
    {"model": "bloomz-7b1", "seq_len": 512},
    # peft's DoRA with an EMA copy: the formulas (issue 26), the same on the page and the CLI
    {"model": "llama-3.2-1b", "lora_rank": 16, "lora_variant": "dora", "ema": True},
    # QDoRA: peft's DoRA over a bitsandbytes 4-bit base, modelled since session 19
    {"model": "llama-3.2-1b", "lora_rank": 16, "lora_variant": "dora", "quantize_base": "nf4"},
]


@pytest.mark.parametrize("changes", SETTINGS, ids=lambda c: c["model"])
def test_link_reproduces_the_state(changes: dict[str, Any]) -> None:
    values = {**default_values(), **changes}
    pinned = {**default_values(), "model": "gpt2", "attention": "eager"}
    query = to_query(values, [pinned])
    assert from_query(query) == (values, [pinned], [])


def test_attention_defaults_to_the_models_own() -> None:
    """BLOOM has no SDPA attention in transformers (modeling_bloom.py has only the eager
    BloomAttention): left to the model the page runs eager, as the CLI does; an explicit
    sdpa is refused with the field named, not silently replaced."""
    values = {**default_values(), "model": "bloomz-7b1", "seq_len": 512}
    assert resolve_request(values).training.attention == "eager"
    assert resolve_request({**values, "model": "gpt2"}).training.attention == "sdpa"
    widgets = h.widget_values(values)
    assert widgets[h.INPUT_NAMES.index("attention")] == MODEL_DEFAULT
    assert h.collect(widgets) == values
    with pytest.raises(SpecError, match="attention"):
        run(resolve_request({**values, "attention": "sdpa"}))


def test_an_empty_text_box_of_an_unset_setting_is_unset() -> None:
    # a shown text box reports "" where a collapsed one reports None: both leave a setting
    # whose default is None unset, so the command line does not gain --earlier-seq-lens ''
    widgets = h.widget_values(default_values())
    widgets[h.INPUT_NAMES.index("earlier_seq_lens")] = ""
    values = h.collect(widgets)
    assert values["earlier_seq_lens"] is None
    assert "earlier" not in cli_command(values)
    widgets[h.INPUT_NAMES.index("earlier_seq_lens")] = "128,256"
    assert "--earlier-seq-lens 128,256" in cli_command(h.collect(widgets))


def test_the_page_takes_a_dataset_s_lengths() -> None:
    # the page's sample-lengths box reaches the estimate: its assumed lengths name the dataset
    widgets = h.widget_values(default_values())
    widgets[h.INPUT_NAMES.index("sample_lengths")] = ""
    assert h.collect(widgets)["sample_lengths"] is None
    widgets[h.INPUT_NAMES.index("sample_lengths")] = "alpaca-cleaned"
    widgets[h.INPUT_NAMES.index("long_samples")] = "delete"
    values = h.collect(widgets)
    command = cli_command(values)
    assert "--sample-lengths alpaca-cleaned" in command and "--long-samples delete" in command
    est = run(resolve_request({**values, "model": "gpt2", "seq_len": 256}))
    assert "alpaca-cleaned" in est.details["assumed"]["lengths"]


def test_a_broken_link_opens_with_a_message() -> None:
    values, pins, problems = from_query("micro-batch-size=four&colour=red&precision=bf16-true")
    assert values["micro_batch_size"] == 1 and values["precision"] == "bf16-true"
    assert pins == []
    assert problems == [
        "link: micro_batch_size: must be an integer, got 'four'",
        "link: unknown setting 'colour' ignored",
    ]


@pytest.mark.parametrize("changes", SETTINGS, ids=lambda c: c["model"])
def test_cli_box_runs_the_same_estimate(invoke_json: InvokeJson, changes: dict[str, Any]) -> None:
    """The command in the CLI box, run by the CLI, gives the page's numbers exactly."""
    values = {**default_values(), **changes}
    command = cli_command(values)
    words = shlex.split(command)
    assert words[:2] == ["trainmem", "estimate"]
    cli = invoke_json(*words[1:])
    est = run(resolve_request(values))
    # every setting, not only those that cost memory (through JSON: tuples become lists)
    assert json.loads(json.dumps(est.to_dict()["config"], default=str)) == cli["config"]
    page = numbers(est)
    assert page.breakdown_bytes == cli["breakdown_bytes"]
    assert page.device_total_bytes == cli["peak"]["device_total_bytes"]
    assert page.fits == cli["fits"]
    assert page.per_rank == cli["per_rank"]


def test_numbers_reads_the_estimate() -> None:
    est = estimate("gpt2", TrainingConfig(micro_batch_size=2, seq_len=512), gpu="T4")
    n = numbers(est)
    b = est.breakdown
    assert n.breakdown_bytes["activations"] == b.activations
    assert n.allocated_bytes == b.allocated_bytes
    assert n.device_total_bytes == b.device_total_bytes
    assert n.margin_bytes == est.gpu_capacity_bytes - b.device_total_bytes  # type: ignore[operator]
    assert n.fits is est.fits


def test_model_field_refuses_server_paths() -> None:
    with pytest.raises(SpecError, match="not a preset"):
        resolve_request({**default_values(), "model": "/etc/passwd"})


# --- uploads ---------------------------------------------------------------------------


def test_uploaded_config_is_the_same_model_as_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text((PRESETS_DIR / "gpt2.json").read_text(), encoding="utf-8")
    spec, _ = model_from_upload(str(path))
    training = TrainingConfig(seq_len=1024)
    assert estimate(spec, training).breakdown == estimate("gpt2", training).breakdown


def test_uploaded_config_without_formulas_runs_the_generic_path(
    tmp_path: Path, models_dir: Path
) -> None:
    # Mamba has no formula family: the upload is kept as a path and the page's estimate (the
    # default engine, auto) runs it through the generic path instead of refusing it (8 tokens:
    # transformers' reference selective scan, without mamba_ssm, loops over the sequence)
    path = tmp_path / "config.json"
    path.write_text((models_dir / "mamba.json").read_text(), "utf-8")
    model, config = model_from_upload(str(path))
    assert model == str(path) and config["model_type"] == "mamba"
    req = resolve_request({**default_values(), "seq_len": 8, "micro_batch_size": 1}, model)
    assert req.model_arg == "config.json"
    assert estimate(req.model, req.training).engine == "generic"


def test_uploads_are_size_limited_and_data_only(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    big.write_text(" " * (MAX_UPLOAD_BYTES + 1) + "{}", encoding="utf-8")
    with pytest.raises(SpecError, match="the limit is 1 MiB"):
        model_from_upload(str(big))
    array = tmp_path / "list.json"
    array.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(SpecError, match="holds a JSON list, expected an object"):
        model_from_upload(str(array))
    nested = tmp_path / "accelerate.yaml"
    nested.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: /etc/x.json\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError, match="upload that ds_config.json"):
        accelerate_from_upload(str(nested))
    tagged = tmp_path / "evil.yaml"
    tagged.write_text("!!python/object/apply:os.system ['true']\n", encoding="utf-8")
    with pytest.raises(SpecError, match="not valid YAML"):
        accelerate_from_upload(str(tagged))


def test_ds_config_upload_sets_the_widgets(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": "auto",
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        ),
        encoding="utf-8",
    )
    raw = h.widget_values(default_values())
    *widgets, note = h.apply_framework_file("deepspeed", str(ds), *raw)
    values = h.collect(widgets)
    assert values["micro_batch_size"] == 2
    assert values["zero_stage"] == 2
    assert values["offload"] == "optimizer"
    assert values["framework"] == "deepspeed"
    assert values["gradient_accumulation_steps"] == 1  # "auto" is left to the Trainer
    assert "ds_config.json: set" in note


# --- handlers: errors are one line in the page ------------------------------------------


def _update(**changes: Any) -> dict[str, str]:
    raw = h.widget_values({**default_values(), "model": "gpt2", **changes})
    return dict(zip(h.ESTIMATE_OUTPUTS, h.update([], None, *raw), strict=True))


def test_bad_size_is_a_message_not_a_traceback() -> None:
    out = _update(micro_batch_size=-3)
    assert "micro_batch_size: must be a positive integer, got -3" in out["message"]
    assert "Traceback" not in out["message"]
    assert out["cli"].endswith("--micro-batch-size -3")
    assert "No estimate" in out["result"]
    fine = _update(micro_batch_size=2)
    assert fine["message"] == ""
    assert 'id="breakdown"' in fine["result"]


def test_broken_config_upload_is_a_message(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", ', encoding="utf-8")
    raw = h.widget_values(default_values())
    out = dict(zip(h.ESTIMATE_OUTPUTS, h.update([], str(broken), *raw), strict=True))
    assert "config.json: config.json is not valid JSON (line 1, column 25" in out["message"]


def test_unexpected_errors_are_one_line(caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> str:
        raise ZeroDivisionError("division by zero")

    assert h._guard(boom, lambda m: m) == (
        "unexpected error (ZeroDivisionError): division by zero; please report it"
    )
    assert "unexpected error in the web calculator" in caplog.text


def test_breakdown_cells_carry_exact_bytes() -> None:
    out = _update(micro_batch_size=2)
    est = estimate("gpt2", TrainingConfig(micro_batch_size=2, seq_len=1024), gpu="H100-80GB")
    activations = est.breakdown.activations
    cell = f'title="{activations:,} bytes" data-bytes="{activations}">{activations / GiB:,.2f}<'
    assert cell in out["result"]


def test_compare_pins_up_to_four() -> None:
    pins: list[dict[str, Any]] = []
    for checkpointing in ("none", "selective", "full"):
        raw = h.widget_values(
            {**default_values(), "model": "gpt2", "activation_checkpointing": checkpointing}
        )
        pins, view, message = h.pin(pins, None, *raw)
        assert message == ""
    assert view.count("<th>") == 4  # a blank corner and three configurations
    assert "activation_checkpointing=selective" in view
    raw = h.widget_values({**default_values(), "model": "gpt2"})
    pins, _, _ = h.pin(pins, None, *raw)
    pins, _, message = h.pin(pins, None, *raw)
    assert len(pins) == 4 and "at most 4 configurations" in message


def test_pipeline_stages_are_shown() -> None:
    out = _update(model="llama-3.2-1b", pipeline_parallel_size=4, seq_len=1024)
    training = TrainingConfig(seq_len=1024, pipeline_parallel_size=4)
    per_rank = estimate("llama-3.2-1b", training, gpu="H100-80GB").to_dict()["per_rank"]
    # 16 layers over 4 stages; the engine reports the distinct ones (first: embedding, last: head)
    assert [r["pipeline_stage"] for r in per_rank] == [0, 3]
    assert 'id="per-rank"' in out["result"]
    for row in per_rank:
        assert f'data-bytes="{row["allocated_bytes"]}"' in out["result"]


def test_handlers_need_neither_gradio_nor_torch_nor_the_cli() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from trainmem.web import handlers as h\n"
        "raw = h.widget_values({**h.default_values(), 'model': 'gpt2'})\n"
        "assert h.update([], None, *raw)[-1] == ''\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('gradio', 'torch')]\n"
        "bad += [m for m in sys.modules if m.startswith('trainmem.cli')]  # web never imports cli\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_without_gradio_names_the_extra(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ImportError
    result = invoke("serve", "--port", "7", exit_code=2)
    assert "pip install 'trainmem[web]'" in result.output


def test_long_gradient_accumulation_and_pipelines_answer() -> None:
    # the step schedule replays repeated micro-batches as one segment: 1024 of them answer
    out = _update(model="llama-3.2-1b", gradient_accumulation_steps=1024)
    assert out["message"] == ""
    piped = _update(model="llama-3.2-1b", gradient_accumulation_steps=8, pipeline_parallel_size=4)
    assert piped["message"] == ""
    raw = h.widget_values(
        {**default_values(), "model": "llama-3.2-1b", "pipeline_parallel_size": 4}
    )
    assert "No step timeline" not in str(h.details(h.PICTURE_TAB, None, *raw)[2])


def test_slow_details_only_on_their_tab() -> None:
    raw = h.widget_values({**default_values(), "model": "gpt2"})
    interactive, picture, _ = h.details("", None, *raw)
    assert picture is None and len(interactive) > 0
    _, picture, _ = h.details(h.PICTURE_TAB, None, *raw)
    assert picture is not None and Path(picture).read_bytes().startswith(b"\x89PNG")
    assert h.fit_and_plan("", None, *raw) == ("", "")
    fixes, plan = h.fit_and_plan(h.FIT_TAB, None, *raw)
    assert "It fits" in fixes and 'data-dimension="micro_batch_size"' in plan


def test_a_trainer_config_upload_sets_the_widgets(tmp_path: Path, examples_dir: Path) -> None:
    from trainmem.web.uploads import trainer_config_from_upload

    raw = h.widget_values(default_values())
    *widgets, note = h.apply_framework_file(
        "trainer", str(examples_dir / "axolotl-qlora.yml"), *raw
    )
    values = h.collect(widgets)
    # examples/axolotl-qlora.yml: micro_batch_size 2, lora_r 32, qlora -> nf4 double-quantized
    # the upload selects the axolotl preset (framework axolotl, read by read_axolotl_config)
    assert (values["micro_batch_size"], values["lora_rank"]) == (2, 32)
    assert (values["quantize_base"], values["framework"]) == ("nf4-dq", "axolotl")
    assert "axolotl-qlora.yml: set" in note and "lora_targets=q+k+v+o+gate+up+down" in note
    # a torchtune recipe is told apart by its _component_ entries, a .json is TrainingArguments
    settings, _ = trainer_config_from_upload(
        str(examples_dir / "torchtune-lora-single-device.yaml")
    )
    assert settings["framework"] == "torchtune"
    settings, _ = trainer_config_from_upload(str(examples_dir / "sft-config.json"))
    assert settings["micro_batch_size"] == 4
    assert settings["framework"] == "trl"  # an SFTConfig is TRL's SFTTrainer, as on the CLI
    named = tmp_path / "axolotl.yml"
    named.write_text("deepspeed: deepspeed_configs/zero3.json\n", encoding="utf-8")
    with pytest.raises(SpecError, match="upload that ds_config.json in the DeepSpeed box"):
        trainer_config_from_upload(str(named))
    *_, note = h.apply_framework_file("trainer", str(named), *raw)
    assert "upload that ds_config.json" in note


def test_engine_and_a_gpu_capacity_as_on_the_cli(invoke_json: InvokeJson) -> None:
    # the page takes --engine and a --gpu capacity as `trainmem estimate` does (issue 26: "the
    # web page and the CLI accept the same models and options")
    values = {**default_values(), "model": "gpt2", "seq_len": 256}
    values.update(engine="analytic", gpu="24GiB")
    req = resolve_request(values)
    assert (req.engine, req.gpu) == ("analytic", "24GiB")
    words = shlex.split(cli_command(values))
    assert words[3:7] == ["--gpu", "24GiB", "--engine", "analytic"]
    est = run(req)
    cli = invoke_json(*words[1:])
    assert est.gpu_capacity_bytes == cli["gpu"]["capacity_bytes"] == 24 * GiB
    assert numbers(est).breakdown_bytes == cli["breakdown_bytes"]
    assert from_query(to_query(values))[0]["engine"] == "analytic"
    with pytest.raises(SpecError, match="engine: unknown value 'fast'"):
        resolve_request({**values, "engine": "fast"})


@pytest.mark.slow  # a trace; the fast representative is the test above
def test_a_traced_engine_on_an_uploaded_config(invoke_json: InvokeJson, models_dir: Path) -> None:
    # under a traced engine an uploaded config.json is passed as its path (the traced paths
    # build the model from the file), as the CLI's argument
    config = str(models_dir / "formula" / "qwen2.json")
    values = {**default_values(), "seq_len": 64, "micro_batch_size": 2, "engine": "generic"}
    req = h.request_of(config, values)
    assert (req.model, req.engine) == (config, "generic")
    est = run(req)
    cli = invoke_json(*shlex.split(cli_command(values, config))[1:])
    assert est.engine == cli["engine"] == "generic"
    assert numbers(est).breakdown_bytes == cli["breakdown_bytes"]
