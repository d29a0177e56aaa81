"""FSDP under the HF Trainer stacks LLaMA-Factory and axolotl: accelerate's FSDP plugin
(``accelerate-fsdp``, FSDP1, unless the accelerate / axolotl config asks for version 2), with the
preset's own YAML defaults carried over (``fsdp_preset_defaults``).

Sources (the tags the presets model): LLaMA-Factory v0.9.5 shards with ``accelerate launch
--config_file examples/accelerate/fsdp_config.yaml`` (``distributed_type: FSDP``,
``fsdp_sharding_strategy: FULL_SHARD``, no ``fsdp_version``: accelerate's default 1) or
``fsdp2_config.yaml`` (``fsdp_version: 2``); its checkpointing stays on and reentrant
(model_args.py:145-150) and LoRA on all linears (finetuning_args.py:81-82) whatever the
sharding. axolotl v0.18.0: ``fsdp_version`` 1 unless given (utils/schemas/validation.py:882-887),
``gradient_checkpointing_kwargs = {"use_reentrant": True}`` when checkpointing with no kwargs,
no ``unfrozen_parameters`` and no ``rl`` (utils/config/__init__.py:377-383), a given
``use_reentrant`` passed through (core/builders/base.py:599-611)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.cli.options import training_from_options
from trainmem.errors import SpecError
from trainmem.specs.trainer_configs import read_axolotl_config

MODEL = "tiny-llama-test"
SEVEN = ("q", "k", "v", "o", "gate", "up", "down")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_llama_factory_fsdp_flag_is_accelerate_fsdp1_with_its_defaults() -> None:
    t = training_from_options(
        MODEL,
        {
            "framework": "llama-factory",
            "fsdp": "full-shard",
            "lora_rank": 4,
            "data_parallel_size": 2,
        },
    )
    assert (t.framework, t.zero_stage) == ("accelerate-fsdp", 3)
    # LLaMA-Factory's defaults survive the sharding
    assert t.activation_checkpointing == "full"
    assert t.checkpoint_reentrant is True
    assert t.lora_targets == SEVEN


def test_explicit_settings_win_over_the_carried_defaults() -> None:
    t = training_from_options(
        MODEL,
        {
            "framework": "llama-factory",
            "fsdp": "full-shard",
            "lora_rank": 4,
            "data_parallel_size": 2,
            "activation_checkpointing": "none",
            "lora_targets": "q,v",
        },
    )
    assert t.framework == "accelerate-fsdp"
    assert t.activation_checkpointing == "none"
    assert t.lora_targets == ("q", "v")


def test_axolotl_fsdp_flag_is_accelerate_fsdp_and_hf_trainer_unchanged() -> None:
    ax = training_from_options(
        MODEL,
        {
            "framework": "axolotl",
            "fsdp": "shard-grad-op",
            "data_parallel_size": 2,
            "activation_checkpointing": "full",
        },
    )
    assert (ax.framework, ax.reshard_after_forward) == ("accelerate-fsdp", False)
    assert ax.checkpoint_reentrant is True  # axolotl's use_reentrant True
    hf = training_from_options(
        MODEL,
        {
            "framework": "hf-trainer",
            "fsdp": "shard-grad-op",
            "data_parallel_size": 2,
            "activation_checkpointing": "full",
        },
    )
    assert hf.framework == "accelerate-fsdp"
    assert hf.checkpoint_reentrant is None  # transformers' own default, as before


def test_llama_factory_with_its_fsdp2_accelerate_config(tmp_path: Path) -> None:
    # examples/accelerate/fsdp2_config.yaml (v0.9.5), the keys trainmem reads
    text = (
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: false\n"
        "  fsdp_reshard_after_forward: true\n"
    )
    notes: list[str] = []
    t = training_from_options(
        MODEL,
        {
            "framework": "llama-factory",
            "lora_rank": 4,
            "accelerate_config": _write(tmp_path, "fsdp2.yaml", text),
        },
        notes=notes,
    )
    assert t.framework == "fsdp2"
    assert (t.activation_checkpointing, t.checkpoint_reentrant, t.lora_targets) == (
        "full",
        True,
        SEVEN,
    )
    assert not any("wins over" in n for n in notes)


def test_axolotl_config_is_the_axolotl_preset(tmp_path: Path) -> None:
    out = read_axolotl_config(_write(tmp_path, "a.yml", "gradient_checkpointing: true\n"))
    assert out["framework"] == "axolotl"
    assert out["checkpoint_reentrant"] is True


def test_axolotl_config_fsdp_keeps_the_reentrant_checkpoint(tmp_path: Path) -> None:
    text = "gradient_checkpointing: true\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
    out = read_axolotl_config(_write(tmp_path, "a.yml", text))
    assert out["framework"] == "accelerate-fsdp"  # fsdp_version 1 unless given
    assert out["checkpoint_reentrant"] is True
    text = (
        "gradient_checkpointing: true\nfsdp_version: 2\nfsdp_config:\n"
        "  reshard_after_forward: true\n"
    )
    assert read_axolotl_config(_write(tmp_path, "b.yml", text))["framework"] == "fsdp2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "gradient_checkpointing: true\n"
            "gradient_checkpointing_kwargs:\n  use_reentrant: false\n",
            False,
        ),
        ("gradient_checkpointing: true\ngradient_checkpointing_kwargs: {}\n", None),
        ("gradient_checkpointing: true\nunfrozen_parameters: ['^lm_head']\n", None),
        ("gradient_checkpointing: false\n", None),
    ],
)
def test_axolotl_reentrant_only_where_axolotl_sets_it(
    tmp_path: Path, text: str, expected: bool | None
) -> None:
    out = read_axolotl_config(_write(tmp_path, "a.yml", text))
    assert out.get("checkpoint_reentrant") is expected


def test_axolotl_bad_use_reentrant_names_the_field(tmp_path: Path) -> None:
    text = "gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: maybe\n"
    with pytest.raises(SpecError, match="use_reentrant") as e:
        read_axolotl_config(_write(tmp_path, "a.yml", text))
    assert "true" in str(e.value) and "false" in str(e.value)


def test_a_zero_stage_under_a_preset_is_deepspeed_with_the_presets_defaults() -> None:
    # LLaMA-Factory shards through DeepSpeed with ``deepspeed: examples/deepspeed/
    # ds_z3_config.json`` in the same YAML: its checkpointing and LoRA targets stay
    t = training_from_options(
        MODEL,
        {"framework": "llama-factory", "zero_stage": 3, "lora_rank": 4, "data_parallel_size": 2},
    )
    assert t.framework == "deepspeed"
    assert (t.activation_checkpointing, t.checkpoint_reentrant, t.lora_targets) == (
        "full",
        True,
        SEVEN,
    )


def test_the_web_page_shards_a_preset_as_the_cli_does() -> None:
    from trainmem.web.form import default_values, training_config

    values = {
        **default_values(),
        "framework": "llama-factory",
        "zero_stage": 3,
        "lora_rank": 4,
        "data_parallel_size": 2,
    }
    t = training_config(values, default_seq_len=64)
    cli = training_from_options(
        MODEL,
        {"framework": "llama-factory", "zero_stage": 3, "lora_rank": 4, "data_parallel_size": 2},
    )
    assert t.framework == cli.framework == "deepspeed"
    assert (t.activation_checkpointing, t.checkpoint_reentrant, t.lora_targets) == (
        cli.activation_checkpointing,
        cli.checkpoint_reentrant,
        cli.lora_targets,
    )


def test_axolotl_fused_adamw_on_an_old_torch_survives_the_sharding() -> None:
    # adamw_torch_fused whatever the torch (axolotl v0.18.0 utils/schemas/training.py:122-123);
    # the Trainer's own default is fused only from torch 2.8 (foreach on 2.7)
    values = {"fsdp": "full-shard", "data_parallel_size": 2, "torch_version": "2.7"}
    ax = training_from_options(MODEL, {"framework": "axolotl", **values})
    hf = training_from_options(MODEL, {"framework": "hf-trainer", **values})
    assert ax.framework == hf.framework == "accelerate-fsdp"
    assert ax.optimizer_implementation == "fused"
    assert hf.optimizer_implementation in (None, "foreach")
    given = training_from_options(MODEL, {"framework": "axolotl", "optimizer": "sgd", **values})
    assert given.optimizer_implementation != "fused"
