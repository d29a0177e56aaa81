"""TrainingConfig refuses bad types, ranges and combinations with a SpecError naming the field;
check_training_for_model refuses settings the model cannot take (issue 17's fuzzing findings)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import (
    TrainingConfig,
    check_training_for_model,
    pipeline_sizes,
    zero_stage_from,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lora_dropout": "0.1"}, "lora_dropout"),  # was a TypeError from the comparison
        ({"lora_dropout": float("nan")}, "lora_dropout"),
        ({"dropout": "no"}, "dropout"),  # was accepted, and kept dropout on
        ({"compile": 1}, "compile"),
        ({"zero_stage": 2.0}, "zero_stage"),  # 2.0 == 2 let a float through
        ({"zero_stage": True}, "zero_stage"),
        ({"micro_batch_size": 2.0}, "micro_batch_size"),
        ({"micro_batch_size": 2**31}, "micro_batch_size"),
        ({"lora_rank": 10**12}, "lora_rank"),  # was a MemoryError in the trace engine
        ({"lora_rank": 10**400}, "lora_rank"),  # was an OverflowError
        ({"seq_len": None}, "seq_len"),
        ({"precision": ["bf16-mixed"]}, "precision"),
        ({"lora_targets": "qv"}, "lora_targets"),  # a string would be read letter by letter
        ({"lora_rank": 8, "lora_targets": ()}, "lora_targets"),
        (
            {"optimizer_in_backward": True, "gradient_accumulation_steps": 4},
            "optimizer_in_backward",
        ),
        (  # was an internal ScheduleError from the formulas' step schedule
            {
                "optimizer_in_backward": True,
                "pipeline_parallel_size": 2,
                "pipeline_schedule": "gpipe",
            },
            "optimizer_in_backward",
        ),
        ({"seq_len": 1024, "context_parallel_size": 4096}, "context_parallel_size"),
        ({"seq_len": 1000, "context_parallel_size": 3}, "context_parallel_size"),
    ],
)
def test_bad_settings_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as info:
        TrainingConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_good_combinations_still_pass() -> None:
    TrainingConfig(optimizer_in_backward=True, gradient_accumulation_steps=1)
    TrainingConfig(seq_len=4096, context_parallel_size=8, zero_stage=3)
    TrainingConfig(lora_rank=8, lora_dropout=0)  # an int probability is fine
    TrainingConfig(micro_batch_size=2**31 - 1)


def test_fsdp_and_a_different_zero_stage_conflict() -> None:
    assert zero_stage_from(0, "full-shard") == 3
    assert zero_stage_from(3, "full-shard") == 3
    # SHARD_GRAD_OP, commonly called ZeRO-2, is modelled as stage 3 without resharding
    assert zero_stage_from(2, "shard-grad-op") == 3
    with pytest.raises(SpecError, match="fsdp: full-shard shards like ZeRO stage 3 but"):
        zero_stage_from(1, "full-shard")


def test_pipeline_sizes_leave_every_stage_a_layer() -> None:
    # L = 32, ceil split: p = 9 gives 4 layers per stage and 32 - 8 * 4 = 0 for the last;
    # p = 12 gives 3 and 32 - 11 * 3 = -1 (the -1 layers the fuzzer saw); p = 16 gives 2, 2.
    assert pipeline_sizes(32) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32]
    assert pipeline_sizes(1) == [1]


@pytest.mark.parametrize("p", [9, 12, 31])
def test_pipeline_size_leaving_a_stage_empty_is_refused(p: int) -> None:
    model = load_model_spec("llama-3.1-8b")
    with pytest.raises(SpecError, match=r"allowed: 1-8, 11, 16, 32") as info:
        check_training_for_model(model, TrainingConfig(pipeline_parallel_size=p))
    assert info.value.field == "pipeline_parallel_size"


def test_interleaved_chunks_need_a_layer_each() -> None:
    model = load_model_spec("tiny-llama-test")  # 2 layers
    assert model.num_layers == 2
    t = TrainingConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved-1f1b")
    with pytest.raises(SpecError, match="2 stages x 2 chunks need at least 4 layers"):
        check_training_for_model(model, t)  # the default of 2 chunks per rank
    check_training_for_model(model, dataclasses.replace(t, virtual_pipeline_stages=1))


def test_learned_positions_bound_the_sequence() -> None:
    gpt2 = load_model_spec("gpt2")  # n_positions 1024
    check_training_for_model(gpt2, TrainingConfig(seq_len=1024))
    with pytest.raises(SpecError, match="seq_len: 4096 is longer than gpt2's 1024"):
        check_training_for_model(gpt2, TrainingConfig(seq_len=4096))
    # rotary models may run past their context (long-context fine-tuning)
    llama = load_model_spec("llama-2-7b")  # 4096 positions
    check_training_for_model(llama, TrainingConfig(seq_len=8192))


def test_lora_targets_must_exist_in_the_model() -> None:
    vit = load_model_spec("vit-large-patch16-224")
    with pytest.raises(SpecError, match="has no 'lm_head' linear"):
        check_training_for_model(vit, TrainingConfig(lora_rank=8, lora_targets=("lm_head",)))
    gpt2 = load_model_spec("gpt2")  # GELU MLP: no gate projection
    with pytest.raises(SpecError, match="has no 'gate' linear"):
        check_training_for_model(gpt2, TrainingConfig(lora_rank=8, lora_targets=("q", "gate")))
    check_training_for_model(gpt2, TrainingConfig(lora_rank=8, lora_targets=("q", "lm_head")))


def test_replace_revalidates() -> None:
    with pytest.raises(SpecError, match="micro_batch_size"):
        dataclasses.replace(TrainingConfig(), micro_batch_size=0)


def _wrong_type(field: dataclasses.Field[object]) -> object:
    """A value of a type the field's annotation does not allow."""
    import typing

    hint = typing.get_type_hints(TrainingConfig)[field.name]
    allowed = set(typing.get_args(hint)) | {hint}
    if bool in allowed or hint == (bool | None):
        return "yes"  # a string is no flag
    if int in allowed or float in allowed:
        return 2.5 if int in allowed else "0.1"  # 2.5 is no count, "0.1" is no number
    if any(typing.get_origin(a) is tuple for a in allowed):
        return "q,v"  # a string would be read letter by letter
    return 2.10  # a float is no name nor version: "2.10" would be read as 2.1


@pytest.mark.parametrize("field", dataclasses.fields(TrainingConfig), ids=lambda f: f.name)
def test_every_field_refuses_a_wrong_type_naming_itself(field: dataclasses.Field[object]) -> None:
    # frames / text_seq_len took any string, the versions any number (issue 29)
    with pytest.raises(SpecError) as info:
        TrainingConfig(**{field.name: _wrong_type(field)})  # type: ignore[arg-type]
    assert info.value.field == field.name
    message = str(info.value)
    assert "\n" not in message and ("allowed" in message or "must be" in message), message


@pytest.mark.parametrize("field", dataclasses.fields(TrainingConfig), ids=lambda f: f.name)
def test_none_is_taken_only_where_the_field_means_a_default_by_it(
    field: dataclasses.Field[object],
) -> None:
    # None is a value only where the annotation has it (optimizer_implementation=None: the
    # framework's default for the torch version; STYLE.md "absence is None in the type")
    import types
    import typing

    if field.name == "precision":
        # None is the framework's default, resolved when the config is made so every reader
        # sees a name (TrainingConfig.precision): a plain PyTorch loop's is bf16-mixed
        assert TrainingConfig(precision=None).precision == "bf16-mixed"  # type: ignore[arg-type]
        assert TrainingConfig(precision=None, framework="torchtune").precision == "bf16-true"  # type: ignore[arg-type]
        return
    resolved = {
        "optimizer": ("adamw", "adamw-8bit"),
        "activation_checkpointing": ("none", "full"),
        "lora_targets": (("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")),
        # none saved under every framework: the web page's unticked group
        "lora_modules_to_save": ((), ()),
        # torch's default for the release, a current one here (Note [zero_grad's default by
        # release]; tests/specs/test_zero_grad_default.py has the older ones)
        "zero_grad_set_to_none": (True, True),
    }
    if field.name in resolved:
        # the same: the framework's default (FrameworkConventions.default_optimizer /
        # default_activation_checkpointing, default_lora_targets; Unsloth's notebooks'
        # adamw_8bit and "unsloth" mode, get_peft_model's seven target_modules)
        plain, unsloth = resolved[field.name]
        assert getattr(TrainingConfig(**{field.name: None}), field.name) == plain
        made = TrainingConfig(**{field.name: None, "framework": "unsloth"})
        assert getattr(made, field.name) == unsloth
        return
    hint = typing.get_type_hints(TrainingConfig)[field.name]
    if type(None) in typing.get_args(hint) or (
        isinstance(hint, types.UnionType) and type(None) in hint.__args__
    ):
        assert getattr(TrainingConfig(**{field.name: None}), field.name) is None
        return
    with pytest.raises(SpecError) as info:
        TrainingConfig(**{field.name: None})  # type: ignore[arg-type]
    assert info.value.field == field.name and "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["frames", "text_seq_len"])
def test_only_a_resolution_may_be_text(field: str) -> None:
    # frames="zzz" and text_seq_len="" were accepted: the text branch was meant for resolution
    for text in ("zzz", "", "81"):
        with pytest.raises(SpecError, match=f"{field}: must be a positive integer"):
            TrainingConfig(**{field: text})  # type: ignore[arg-type]
    assert TrainingConfig(resolution="480x832").resolution == "480x832"


def test_versions_must_be_text() -> None:
    with pytest.raises(SpecError, match="torch_version: must be a version string like '2.5'"):
        TrainingConfig(torch_version=2.10)  # type: ignore[arg-type]
    assert TrainingConfig(torch_version="2.10").torch_version == "2.10"


def test_all_linear_is_the_models_own_linears(invoke: Invoke) -> None:
    # peft's all-linear (tuners_utils.py INCLUDE_LINEAR_LAYERS_SHORTHAND): every nn.Linear but
    # the output head. phi-2 (modeling_phi.py): q_proj, k_proj, v_proj, dense, fc1, fc2 -- no
    # gate; Llama: q, k, v, o, gate_proj, up_proj, down_proj.
    import json

    args = ["estimate", "phi-2", "--lora-rank", "8", "--lora-targets", "all-linear"]
    r = invoke(*args, "-s", "128", "--json")
    out = json.loads(r.stdout)
    assert out["config"]["lora_targets"] == ["q", "k", "v", "o", "up", "down"]
    # r (in + out) per adapted linear, h = 2560, i = 10240, 32 layers:
    # 4 x 8 (2560 + 2560) + 2 x 8 (2560 + 10240) = 368,640 per layer
    assert out["num_trainable_parameters"] == 32 * (4 * 8 * 5120 + 2 * 8 * 12800)
    r = invoke(*args[:4], "--set", "lora-targets=all-linear", "--json")
    assert json.loads(r.stdout)["config"]["lora_targets"][-2:] == ["up", "down"]
    from trainmem.cli.options import parse_lora_targets

    llama = load_model_spec("llama-2-7b")
    assert parse_lora_targets("all-linear", llama) == ("q", "k", "v", "o", "gate", "up", "down")
    # an explicit gate on phi-2 is still refused: the model has none
    r = invoke(*args[:4], "--lora-targets", "q,gate", exit_code=2)
    assert "phi-2 has no 'gate' linear" in r.stderr


@pytest.mark.parametrize(
    ("typed", "precision"),
    [("bf16", "bf16-mixed"), ("16", "16-mixed"), ("fp16", "16-mixed"), ("32", "32-true")],
)
def test_short_precision_names_are_lightnings(typed: str, precision: str) -> None:
    # lightning/fabric/connector.py _convert_precision_to_unified_args maps these
    assert TrainingConfig(precision=typed).precision == precision


def test_peft_module_names_are_accepted() -> None:
    # peft LoraConfig(target_modules=["q_proj", "v_proj"]) on a Llama model
    t = TrainingConfig(lora_rank=16, lora_targets=("q_proj", "v_proj", "q"))
    assert t.lora_targets == ("q", "v")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_pipeline_refuses_zero_2_and_3(stage: int) -> None:
    # deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
    # parallelism" (an assert in PipelineEngine.__init__, 0.16.4 to 0.19.8)
    with pytest.raises(SpecError, match="zero_stage: .* incompatible with pipeline"):
        TrainingConfig(
            framework="deepspeed",
            pipeline_parallel_size=2,
            zero_stage=stage,
            data_parallel_size=2,
            gradient_accumulation_steps=2,
        )
    TrainingConfig(
        framework="deepspeed",
        pipeline_parallel_size=2,
        zero_stage=1,
        data_parallel_size=2,
        gradient_accumulation_steps=2,
    )


def test_a_nightly_version_is_refused_with_the_release_to_give() -> None:
    with pytest.raises(SpecError, match=r"a 2\.1 nightly: usually 2\.0") as info:
        TrainingConfig(torch_version="2.1.0.dev20230623")
    assert info.value.field == "torch_version"
    with pytest.raises(SpecError, match="not a version") as other:
        TrainingConfig(torch_version="2.x")
    assert "nightly" not in str(other.value)


@pytest.mark.parametrize(
    ("name", "named"),
    [("torchtitan", "fsdp2"), ("TRL", "trl"), ("llamafactory", "llama-factory")],
)
def test_a_framework_known_by_another_name_is_named_in_the_error(name: str, named: str) -> None:
    """torchtitan's conventions are ``fsdp2`` here (specs/assumptions.py); a user typing the
    project's own name is told which value to pass, not only the list."""
    with pytest.raises(SpecError) as err:
        TrainingConfig(framework=name)
    assert err.value.field == "framework"
    assert f"is --framework {named}" in str(err.value)
