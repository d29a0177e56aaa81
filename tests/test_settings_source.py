"""One source of the training settings (issue 25, "config by concern"): every TrainingConfig
field has one CLI option and one web input with the same name, default, allowed values and help,
all read from the field and its ``Setting``, or is deliberately left to ``--set`` with a reason;
the allowed values are the ones TrainingConfig itself accepts."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import typer
from rich.markup import escape

from trainmem.cli import app
from trainmem.cli.options import parse_set
from trainmem.errors import SpecError
from trainmem.specs.groups import FIELD_GROUPS
from trainmem.specs.settings import Setting, help_text, kind_of, setting_of
from trainmem.specs.training import (
    CONCERNS,
    EmaConfig,
    OptimizerConfig,
    ParallelismConfig,
    PeftConfig,
    PrecisionConfig,
    ShardingConfig,
    TrainingConfig,
)
from trainmem.web import form

FIELDS = dataclasses.fields(TrainingConfig)
NAMES = [f.name for f in FIELDS]


@pytest.fixture(scope="module")
def estimate_options() -> dict[str, Any]:
    """``trainmem estimate``'s options as click holds them (typer vendors its own click)."""
    command: Any = typer.main.get_command(app)
    params = command.commands["estimate"].params
    return {p.name: p for p in params if p.param_type_name == "option"}


def test_training_config_is_its_concerns() -> None:
    by_concern = [f.name for concern in CONCERNS for f in dataclasses.fields(concern)]
    assert by_concern == NAMES  # each field in exactly one concern, in concern order
    assert all(issubclass(TrainingConfig, concern) for concern in CONCERNS)


def test_each_concern_checks_its_own_fields_and_training_config_the_combinations() -> None:
    # a concern alone refuses what its own fields cannot be (the messages TrainingConfig gives)
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (PeftConfig, {"quantize_base": "nf4"}, "quantize_base: a quantized base is frozen"),
        (ShardingConfig, {"offload": "optimizer+params"}, "offload: optimizer+params needs"),
        (ParallelismConfig, {"sequence_parallel": True}, "sequence_parallel: needs tensor"),
        (EmaConfig, {"ema_device": "cpu"}, "ema_device: 'cpu' needs ema"),
        (OptimizerConfig, {"optimizer": "sgd", "optimizer_implementation": "cs336"}, "cs336"),
    ]
    for concern, kwargs, message in cases:
        with pytest.raises(SpecError, match=re.escape(message)):
            concern(**kwargs)
        with pytest.raises(SpecError, match=re.escape(message)):
            TrainingConfig(**kwargs)
    assert PrecisionConfig(precision="bf16").precision == "bf16-mixed"  # aliases, as a whole
    # a pair of concerns is TrainingConfig's to refuse: each side alone is fine
    EmaConfig(ema=True)
    ShardingConfig(offload="optimizer")
    with pytest.raises(SpecError, match="ema: is modelled for unsharded weights"):
        TrainingConfig(ema=True, offload="optimizer")


@pytest.mark.parametrize("field", FIELDS, ids=NAMES)
def test_every_field_has_one_option_or_a_reason(
    field: dataclasses.Field[Any], estimate_options: dict[str, Any]
) -> None:
    s = setting_of(field)
    assert s.help.strip() and "\n" not in s.help
    if s.no_option:  # given by --set (or a config file) only
        assert field.name not in estimate_options
        assert "--set" in s.no_option or "--deepspeed-config" in s.no_option
        shown = "+".join(field.default) if isinstance(field.default, tuple) else field.default
        key = field.name.replace("_", "-")
        value = "true" if isinstance(field.default, bool) or field.default is None else shown
        assert field.name in parse_set(f"{key}={value}")
        return
    option = estimate_options[field.name]
    flag = "--" + field.name.replace("_", "-")
    assert option.opts[0] == flag
    assert [o for o in option.opts[1:] if not o.startswith("--")] == ([s.short] if s.short else [])
    assert option.secondary_opts == ([s.off_flag] if s.off_flag else [])
    default = None if s.defer else field.default
    if isinstance(default, tuple):
        default = ",".join(default)  # --lora-targets q,v
    assert option.default == default
    assert option.help == escape(help_text(field))
    for choice in s.choices:
        assert str(choice) in help_text(field)
    panel = next(p for p, names in FIELD_GROUPS.items() if field.name in names)
    assert getattr(option, "rich_help_panel", None) == panel


@pytest.mark.parametrize("field", FIELDS, ids=NAMES)
def test_every_field_has_one_web_input_of_the_same_source(field: dataclasses.Field[Any]) -> None:
    s = setting_of(field)
    listed = [name for names in form.GROUPS.values() for name in names]
    assert listed.count(field.name) == 1
    widget = form.field(field.name)
    assert widget.help == help_text(field, choices=False)  # the input lists the choices
    model_choice = s.choices and s.defer == "model"  # attention: "model default" first
    expected = (form.MODEL_DEFAULT, *s.choices) if model_choice else s.choices
    if field.name == "lora_targets":  # and the CLI's --lora-targets all-linear (issue 26)
        expected = (*expected, form.ALL_LINEAR)
    if widget.kind == "tristate":  # true / false / None: the framework's and the release's
        expected = ("default", "true", "false")
    assert widget.choices == expected
    assert form.DEFAULTS[field.name] == (None if s.defer == "model" else field.default)
    # the page's command spells a setting without an option as --set
    if s.no_option:
        assert field.name in form._NO_FLAG
    assert form._NEGATIVE_FLAG.get(field.name, "") == s.off_flag


def _refusal(name: str, value: object) -> SpecError:
    with pytest.raises(SpecError) as info:
        TrainingConfig(**{name: value})
    return info.value


@pytest.mark.parametrize(
    "field", [f for f in FIELDS if setting_of(f).choices], ids=lambda f: f.name
)
def test_the_allowed_values_offered_are_the_ones_training_config_takes(
    field: dataclasses.Field[Any],
) -> None:
    s: Setting = setting_of(field)
    wrong: object = ("no-such-value",) if kind_of(field) == "multi" else "no-such-value"
    error = _refusal(field.name, wrong)
    assert error.field == field.name
    allowed = re.search(r"allowed: (.*)$", str(error))
    assert allowed is not None, str(error)
    assert allowed.group(1).split(", ") == [str(c) for c in s.choices]


def test_an_option_for_a_field_without_one_would_be_caught(
    estimate_options: dict[str, Any],
) -> None:
    # the deliberate exceptions: DeepSpeed's ds_config settings, FSDP's resharding and its
    # embedding and head units (a recipe's custom_sharded_layers), the
    # interleaved schedule's chunks, the attention mask, peft's k-bit preparation and the load
    # phase (see each Setting.no_option)
    without = {f.name for f in FIELDS if setting_of(f).no_option}
    assert without == {
        "grad_accum_dtype",
        "padding_mask",
        "virtual_pipeline_stages",
        "reshard_after_forward",
        "fsdp_embedding_head_units",
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "overlap_comm",
        "prepare_kbit_training",
        "load_phase",
        "checkpoint_reentrant",
    }
    assert not without & estimate_options.keys()
    others = set(estimate_options) - set(NAMES)  # options that set no field of their own
    assert others >= {"fsdp", "lora_alpha", "settings", "deepspeed_config"}


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("torch_version", "2.10", "2.10"),  # a number box made it 2.1
        ("reduce_bucket_size", "500000000", 500_000_000),  # was refused as text
        ("reduce_bucket_size", "auto", "auto"),
        ("resolution", "480x832", "480x832"),
        ("resolution", "1024", 1024),
    ],
)
def test_the_page_reads_a_text_setting_as_set_does(name: str, text: str, value: object) -> None:
    assert form.field(name).kind == "str"
    assert form.coerce(name, text) == value
    assert parse_set(f"{name.replace('_', '-')}={text}")[name] == value
    TrainingConfig(**{name: form.coerce(name, text)})  # and TrainingConfig takes it


@pytest.mark.parametrize(
    "name",
    ["zero_grad_set_to_none", "checkpoint_reentrant", "overlap_comm", "prepare_kbit_training"],
)
def test_a_three_valued_flag_is_a_dropdown_read_as_set_reads_it(name: str) -> None:
    # True, False, or None: the framework's / the release's default (a text box before
    # session 28); each choice means what `--set NAME=true|false` or no option means
    assert form.field(name).kind == "tristate"
    dashed = name.replace("_", "-")
    for text, value in (("true", True), ("false", False)):
        assert form.coerce(name, text) is value
        assert parse_set(f"{dashed}={text}")[name] is value
    assert form.coerce(name, "default") is None
    assert form.DEFAULTS[name] is None
    with pytest.raises(SpecError, match=name):
        form.coerce(name, "maybe")
