"""axolotl, torchtune and HF TrainingArguments / TRL SFTConfig files as TrainingConfig values.

Every expected value below is read off the file by hand (examples/ and the small files written
here), with the framework's own default where the file says nothing (the sources are named in
:mod:`trainmem.specs.trainer_configs`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES_DIR, Invoke
from trainmem.errors import SpecError
from trainmem.specs.trainer_configs import (
    read_axolotl_config,
    read_torchtune_config,
    read_training_args,
    same_model,
)
from trainmem.specs.training import TrainingConfig


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _estimate(invoke: Invoke, args: list[str], model: str = "llama-3.1-8b") -> dict[str, Any]:
    r = invoke("estimate", model, *args, "--json")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


# --- the shipped examples ------------------------------------------------------------------

AXOLOTL_EXAMPLE = {
    "framework": "axolotl",  # the HF Trainer with axolotl's defaults
    "micro_batch_size": 2,  # micro_batch_size: 2
    "gradient_accumulation_steps": 4,  # gradient_accumulation_steps: 4
    "seq_len": 4096,  # sequence_len: 4096
    "precision": "bf16-true",  # bf16: auto -> torch_dtype bfloat16 + the Trainer's autocast
    "activation_checkpointing": "full",  # gradient_checkpointing: true
    # no gradient_checkpointing_kwargs: axolotl's {"use_reentrant": True}
    # (v0.18.0 utils/config/__init__.py:377-383)
    "checkpoint_reentrant": True,
    "attention": "flash",  # flash_attention: true
    "optimizer": "paged-adamw-8bit",  # optimizer: paged_adamw_8bit
    "lora_rank": 32,  # lora_r: 32
    "lora_dropout": 0.05,  # lora_dropout: 0.05
    "lora_targets": ("q", "k", "v", "o", "gate", "up", "down"),  # lora_target_linear: true
    "quantize_base": "nf4-dq",  # adapter: qlora, load_in_4bit: nf4 + double quant
}

TORCHTUNE_EXAMPLE = {
    "framework": "torchtune",
    "micro_batch_size": 2,  # batch_size: 2
    "gradient_accumulation_steps": 8,
    "precision": "bf16-true",  # dtype: bf16 (the whole model in bf16)
    "activation_checkpointing": "full",  # enable_activation_checkpointing: True
    "optimizer": "adamw",  # torch.optim.AdamW
    "optimizer_implementation": "fused",  # fused: True
    "lora_rank": 8,
    # lora_attn_modules q_proj, v_proj, output_proj + apply_lora_to_mlp (w1, w3, w2)
    "lora_targets": ("q", "v", "o", "gate", "up", "down"),
    "lora_dropout": 0.0,
    "seq_len": 2048,  # tokenizer.max_seq_len
    "chunked_cross_entropy": 8,  # CEWithChunkedOutputLoss(num_output_chunks=8)
}

SFT_EXAMPLE = {
    "framework": "trl",  # SFTConfig keys (max_length): TRL's SFTTrainer
    "micro_batch_size": 4,  # per_device_train_batch_size
    "gradient_accumulation_steps": 8,
    "precision": "bf16-mixed",  # bf16: true, model_init_kwargs null: fp32 weights + autocast
    "activation_checkpointing": "full",  # gradient_checkpointing: true
    "optimizer": "adamw",  # optim: adamw_torch_fused
    "optimizer_implementation": "fused",
    "seq_len": 2048,  # max_length (TRL)
}


def test_the_axolotl_example() -> None:
    notes: list[str] = []
    out = read_axolotl_config(str(EXAMPLES_DIR / "axolotl-qlora.yml"), notes)
    assert out == AXOLOTL_EXAMPLE
    TrainingConfig(**out)
    assert notes[0].startswith("axolotl axolotl-qlora.yml: ")
    assert "sequence_len -> seq_len 4096" in notes[0]
    assert not any("ignored" in n for n in notes)


def test_the_torchtune_example() -> None:
    notes: list[str] = []
    out = read_torchtune_config(str(EXAMPLES_DIR / "torchtune-lora-single-device.yaml"), notes)
    assert out == TORCHTUNE_EXAMPLE
    TrainingConfig(**out)
    assert "loss CEWithChunkedOutputLoss -> chunked_cross_entropy 8" in notes[0]


def test_the_sft_config_example() -> None:
    notes: list[str] = []
    out = read_training_args(str(EXAMPLES_DIR / "sft-config.json"), notes)
    assert out == SFT_EXAMPLE
    TrainingConfig(**out)
    assert notes[0].startswith("SFTConfig sft-config.json: ")
    assert any("a model loaded in bfloat16 is -p bf16-true" in n for n in notes)


@pytest.mark.parametrize(
    ("option", "example", "expected"),
    [
        ("--axolotl-config", "axolotl-qlora.yml", AXOLOTL_EXAMPLE),
        ("--torchtune-config", "torchtune-lora-single-device.yaml", TORCHTUNE_EXAMPLE),
        ("--training-args", "sft-config.json", SFT_EXAMPLE),
    ],
)
def test_the_cli_reads_each_example(
    invoke: Invoke, option: str, example: str, expected: dict[str, Any]
) -> None:
    out = _estimate(invoke, [option, str(EXAMPLES_DIR / example)])
    config = out["config"]
    for field, value in expected.items():
        assert config[field] == (list(value) if isinstance(value, tuple) else value), field
    assert any(n.startswith(("axolotl ", "torchtune ", "SFTConfig ")) for n in out["notes"])


# --- axolotl -------------------------------------------------------------------------------


def test_axolotl_defaults_are_axolotls(tmp_path: Path) -> None:
    # schemas: micro_batch_size 1, gradient_accumulation_steps 1, sequence_len 512, bf16
    # "auto", optimizer adamw_torch_fused; no adapter: a full fine-tune
    out = read_axolotl_config(_write(tmp_path, "a.yml", "base_model: gpt2\n"))
    assert out == {
        "framework": "axolotl",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "seq_len": 512,
        "precision": "bf16-true",
        "optimizer": "adamw",
        "optimizer_implementation": "fused",
    }


def test_axolotl_batch_size_gives_the_accumulation_steps(tmp_path: Path) -> None:
    # utils/config normalize_config: gradient_accumulation_steps = batch_size // micro_batch_size
    path = _write(tmp_path, "a.yml", "micro_batch_size: 4\nbatch_size: 32\nbf16: false\n")
    out = read_axolotl_config(path)
    assert (out["gradient_accumulation_steps"], out["precision"]) == (8, "32-true")


def test_axolotl_lora_8bit_and_attention_and_offload(tmp_path: Path) -> None:
    text = (
        "adapter: lora\nload_in_8bit: true\nlora_r: 16\n"
        "lora_target_modules: [q_proj, k_proj, v_proj, o_proj]\n"
        "attn_implementation: sdpa\ngradient_checkpointing: offload\nfp16: true\n"
        "optimizer: adamw_torch\ntorch_compile: true\n"
    )
    out = read_axolotl_config(_write(tmp_path, "a.yml", text))
    assert out["quantize_base"] == "int8"
    assert out["lora_targets"] == ("q", "k", "v", "o")
    assert (out["attention"], out["precision"]) == ("sdpa", "16-true")
    assert (out["activation_checkpointing"], out["activation_offloading"]) == ("full", True)
    assert (out["optimizer"], out["optimizer_implementation"], out["compile"]) == (
        "adamw",
        "foreach",
        True,
    )


def test_axolotl_lora_target_linear_takes_the_models_linears(
    invoke: Invoke, tmp_path: Path
) -> None:
    path = _write(tmp_path, "a.yml", "adapter: lora\nlora_r: 8\nlora_target_linear: true\n")
    out = read_axolotl_config(path, linears=("q", "k", "v", "o", "up", "down"))
    assert out["lora_targets"] == ("q", "k", "v", "o", "up", "down")
    # through the CLI, for GPT-2 (no gated MLP): peft's all-linear, no gate
    config = _estimate(invoke, ["-s", "128", "--axolotl-config", path], "gpt2")["config"]
    assert config["lora_targets"] == ["q", "k", "v", "o", "up", "down"]


def test_axolotl_lora_target_linear_on_a_family_only_the_generic_path_runs(
    invoke: Invoke, tmp_path: Path
) -> None:
    # AFM-4.5B's architecture (transformers ``ArceeMLP``: up_proj, down_proj, relu2; no
    # gate_proj), which the formulas lack: peft's all-linear is q, k, v, o, up, down (session
    # 28: the reader targeted gate too and the estimate refused it)
    config = {
        "architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 256, "hidden_act": "relu2", "tie_word_embeddings": False,
    }  # fmt: skip
    model = _write(tmp_path, "config.json", json.dumps(config))
    path = _write(tmp_path, "a.yml", "adapter: lora\nlora_r: 8\nlora_target_linear: true\n")
    out = _estimate(invoke, ["-s", "64", "--axolotl-config", path], model)
    assert out["engine"] == "generic"
    assert out["config"]["lora_targets"] == ["q", "k", "v", "o", "up", "down"]


def test_axolotl_names_what_it_ignores_and_a_base_model_mismatch(tmp_path: Path) -> None:
    text = (
        "base_model: mistralai/Mistral-7B-v0.1\nadapter: lora\nlora_r: 8\npeft_use_dora: true\n"
        "lora_modules_to_save: [embed_tokens, lm_head]\ntiled_mlp: true\ntf32: true\n"
    )
    notes: list[str] = []
    out = read_axolotl_config(_write(tmp_path, "a.yml", text), notes, model="llama-3.1-8b")
    assert out["lora_variant"] == "dora"  # peft_use_dora: peft's LoraConfig(use_dora=True)
    # loaders/adapter.py: LoraConfig(modules_to_save=cfg.lora_modules_to_save), read since
    # session 25 (Note [peft modules_to_save])
    assert out["lora_modules_to_save"] == ("embed_tokens", "lm_head")
    ignored = [n for n in notes if "ignored" in n]
    assert len(ignored) == 1 and "peft_use_dora" not in ignored[0]
    assert "lora_modules_to_save" not in ignored[0] and "tiled_mlp" in ignored[0]
    assert "tf32" not in ignored[0]
    assert any("base_model mistralai/Mistral-7B-v0.1 is not MODEL llama-3.1-8b" in n for n in notes)
    notes = []
    read_axolotl_config(_write(tmp_path, "b.yml", "base_model: meta-llama/Llama-3.1-8B\n"), notes)
    assert not any("base_model" in n for n in notes)


def test_same_model() -> None:
    assert same_model("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct")
    assert same_model("llama-3.1-8b", "NousResearch/Meta-Llama-3.1-8B")
    assert not same_model("llama-3.1-8b", "mistralai/Mistral-7B-v0.1")


def test_axolotl_reads_the_deepspeed_config_it_names(tmp_path: Path) -> None:
    # axolotl's deepspeed_configs/zero3_bf16.json style: "auto" values the Trainer fills in
    # from axolotl's own micro_batch_size / gradient_accumulation_steps / bf16
    ds = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "zero3.json").write_text(json.dumps(ds))
    text = "micro_batch_size: 4\ngradient_accumulation_steps: 2\nbf16: true\n"
    path = _write(tmp_path, "a.yml", text + "deepspeed: configs/zero3.json\n")
    out = read_axolotl_config(path)
    assert (out["framework"], out["zero_stage"], out["offload"]) == ("deepspeed", 3, "optimizer")
    # DeepSpeed's bf16: 16-bit weights, fp32 master weights in the optimizer
    assert (out["micro_batch_size"], out["gradient_accumulation_steps"]) == (4, 2)
    assert out["precision"] == "bf16-mixed"


def test_axolotl_fsdp_config(tmp_path: Path) -> None:
    text = (
        "fsdp_version: 2\nfsdp_config:\n  offload_params: false\n"
        "  activation_checkpointing: true\n  reshard_after_forward: false\n"
    )
    out = read_axolotl_config(_write(tmp_path, "a.yml", text))
    assert (out["framework"], out["zero_stage"], out["reshard_after_forward"]) == (
        "fsdp2",
        3,
        False,
    )
    assert out["activation_checkpointing"] == "full"
    # the deprecated fsdp_ prefixes and the fsdp list (axolotl check_fsdp_config_kwargs_prefix)
    text = "fsdp: [full_shard, auto_wrap]\nfsdp_config:\n  fsdp_offload_params: true\n"
    out = read_axolotl_config(_write(tmp_path, "b.yml", text))
    assert (out["framework"], out["offload"]) == ("accelerate-fsdp", "optimizer+params")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optimizer: adamw_apex_fused\n", "optimizer 'adamw_apex_fused' unknown or not modelled"),
        ("adapter: llama-adapter\n", "adapter 'llama-adapter' unknown or not modelled"),
        ("adapter: qlora\nlora_r: 8\n", "adapter qlora needs load_in_4bit: true"),
        ("adapter: lora\n", "adapter lora needs lora_r"),
        ("load_in_4bit: true\n", "load_in_4bit True unknown or not modelled; allowed: an adapter"),
        ("attn_implementation: sage\n", "attn_implementation 'sage' unknown"),
        ("micro_batch_size: 0\n", "micro_batch_size 0 unknown or not modelled"),
        ("bf16: maybe\n", "bf16 'maybe' unknown or not modelled; allowed: true, false, auto"),
        ("deepspeed: 3\n", "deepspeed 3 unknown"),
    ],
)
def test_axolotl_bad_values_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        read_axolotl_config(_write(tmp_path, "bad.yml", text))
    assert info.value.field == "axolotl_config"
    assert str(info.value).startswith("axolotl_config: bad.yml: ")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_optimizer_lists_the_allowed(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="allowed: adamw_torch, adamw_torch_fused, adafactor"):
        read_axolotl_config(_write(tmp_path, "bad.yml", "optimizer: lomo\n"))


# --- torchtune -----------------------------------------------------------------------------


def test_a_torchtune_dora_config_is_refused_not_read_as_lora(
    invoke: Invoke, tmp_path: Path
) -> None:
    # torchtune runs its own DoRALinear (modules/peft/dora.py), not peft's: refused with what
    # runs instead, where 0.2 estimated plain LoRA and listed use_dora as ignored
    text = (
        "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n"
        "  lora_attn_modules: [q_proj, v_proj]\n  use_dora: true\n"
    )
    path = _write(tmp_path, "t.yaml", text)
    assert read_torchtune_config(path)["lora_variant"] == "dora"
    result = invoke(
        "estimate", "llama-3.2-1b", "-s", "128", "--torchtune-config", path, exit_code=2
    )
    message = result.stderr
    assert "Traceback" not in message
    assert "DoRALinear" in message and "lora under this framework" in message


def test_torchtune_defaults_and_qlora(tmp_path: Path) -> None:
    text = (
        "model:\n  _component_: torchtune.models.llama3_1.qlora_llama3_1_8b\n"
        "  lora_attn_modules: [q_proj, k_proj, v_proj]\n  apply_lora_to_output: true\n"
        "batch_size: 4\n"
    )
    out = read_torchtune_config(_write(tmp_path, "t.yaml", text))
    # no dtype: training/precision.py get_dtype(None) is float32; builder default lora_rank 8
    assert out == {
        "framework": "torchtune",
        "micro_batch_size": 4,
        "precision": "32-true",
        "lora_rank": 8,
        "lora_targets": ("q", "k", "v", "lm_head"),
        "lora_dropout": 0.0,
        "quantize_base": "nf4-dq",
    }


def test_torchtune_full_single_device_low_memory(tmp_path: Path) -> None:
    # recipes/configs/llama3_1/8B_full_single_device.yaml: PagedAdamW8bit, optimizer_in_bwd
    text = (
        "dtype: bf16\nbatch_size: 2\noptimizer:\n  _component_: bitsandbytes.optim.PagedAdamW8bit\n"
        "optimizer_in_bwd: True\nenable_activation_checkpointing: True\n"
        "enable_activation_offloading: True\ncompile: True\n"
        "model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\n"
    )
    out = read_torchtune_config(_write(tmp_path, "t.yaml", text))
    assert out["optimizer"] == "paged-adamw-8bit" and out["optimizer_in_backward"] is True
    assert (out["activation_offloading"], out["compile"]) == (True, True)
    assert "lora_rank" not in out


def test_torchtune_cpu_offload_optimizer_and_fsdp_offload(tmp_path: Path) -> None:
    text = (
        "optimizer:\n  _component_: torchao.optim.CPUOffloadOptimizer\n"
        "  optimizer_class: torch.optim.AdamW\n  offload_gradients: true\n"
    )
    out = read_torchtune_config(_write(tmp_path, "t.yaml", text))
    assert (out["offload"], out["optimizer"]) == ("optimizer+gradients", "adamw")
    out = read_torchtune_config(_write(tmp_path, "d.yaml", "fsdp_cpu_offload: True\n"))
    assert (out["zero_stage"], out["offload"]) == (3, "optimizer+params")
    text = "optimizer:\n  _component_: torch.optim.SGD\n  momentum: 0.9\n"
    assert read_torchtune_config(_write(tmp_path, "s.yaml", text))["optimizer"] == "sgd-momentum"


def test_torchtune_custom_sharded_layers(tmp_path: Path) -> None:
    # recipes/configs/llama3_1/70B_full.yaml @30b8519e: the embedding and the output as FSDP
    # units of their own; another list is reported, not read
    text = "custom_sharded_layers: ['tok_embeddings', 'output']\n"
    assert read_torchtune_config(_write(tmp_path, "u.yaml", text))["fsdp_embedding_head_units"]
    notes: list[str] = []
    out = read_torchtune_config(
        _write(tmp_path, "o.yaml", "custom_sharded_layers: [output]\n"), notes
    )
    assert "fsdp_embedding_head_units" not in out
    assert any("ignored" in n and "custom_sharded_layers" in n for n in notes)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dtype: fp16\n", "dtype 'fp16' unknown or not modelled; allowed: bf16, fp32"),
        ("optimizer:\n  _component_: my.Optim\n", "optimizer._component_ 'my.Optim' unknown"),
        ("loss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n", "loss._component_"),
        ("model:\n  _component_: x.lora_llama3_1_8b\n  lora_attn_modules: [wq]\n", "'wq'"),
        ("tokenizer:\n  max_seq_len: -1\n", "tokenizer.max_seq_len -1"),
    ],
)
def test_torchtune_bad_values_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        read_torchtune_config(_write(tmp_path, "bad.yaml", text))
    assert str(info.value).startswith("torchtune_config: bad.yaml: ")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_torchtune_recipe_implies_the_framework_unless_given(
    invoke: Invoke, tmp_path: Path
) -> None:
    path = _write(tmp_path, "t.yaml", "dtype: bf16\nbatch_size: 1\n")
    args = ["-s", "128", "--torchtune-config", path]
    assert _estimate(invoke, args, "gpt2")["config"]["framework"] == "torchtune"
    out = _estimate(invoke, [*args, "--framework", "pytorch-amp"], "gpt2")
    assert out["config"]["framework"] == "pytorch-amp"
    assert any(n.startswith("--framework pytorch-amp wins") for n in out["notes"])


# --- TrainingArguments / SFTConfig -----------------------------------------------------------


def test_training_arguments_defaults_are_the_trainers(tmp_path: Path) -> None:
    # TrainingArguments: per_device_train_batch_size 8, no bf16 / fp16, no checkpointing; no
    # optim: the Trainer's default (fused from torch 2.8), left to --framework hf-trainer
    out = read_training_args(_write(tmp_path, "args.json", '{"output_dir": "out"}'))
    assert out == {
        "framework": "hf-trainer",
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "precision": "32-true",
    }


def test_sft_config_defaults_are_trls(tmp_path: Path) -> None:
    # trl base_config.py: gradient_checkpointing True, bf16 = not fp16; sft_config.py
    # max_length 1024; a model loaded in bfloat16 through model_init_kwargs is bf16-true
    text = json.dumps({"packing": True, "model_init_kwargs": {"dtype": "bfloat16"}})
    out = read_training_args(_write(tmp_path, "sft.json", text))
    assert (out["seq_len"], out["activation_checkpointing"], out["precision"]) == (
        1024,
        "full",
        "bf16-true",
    )
    text = json.dumps({"max_seq_length": 512, "fp16": True, "optim": "paged_adamw_32bit"})
    out = read_training_args(_write(tmp_path, "old.json", text))
    assert (out["seq_len"], out["precision"], out["optimizer"]) == (512, "16-mixed", "paged-adamw")


def test_training_arguments_with_deepspeed_and_fsdp(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    text = json.dumps({"per_device_train_batch_size": 2, "bf16": True, "deepspeed": ds})
    notes: list[str] = []
    out = read_training_args(_write(tmp_path, "args.json", text), notes)
    # no bf16 section: accelerate adds the Trainer's (DeepSpeedPlugin.set_mixed_precision)
    assert (out["framework"], out["zero_stage"], out["micro_batch_size"]) == ("deepspeed", 2, 2)
    assert out["precision"] == "bf16-mixed"
    assert any('train_micro_batch_size_per_gpu "auto" -> micro_batch_size 2' in n for n in notes)
    text = json.dumps({"fsdp": "shard_grad_op auto_wrap offload", "bf16": True})
    out = read_training_args(_write(tmp_path, "fsdp.json", text))
    assert (out["framework"], out["zero_stage"], out["reshard_after_forward"]) == (
        "accelerate-fsdp",
        3,
        False,
    )
    assert out["offload"] == "optimizer+params"


def test_training_arguments_ignored_and_bad(tmp_path: Path) -> None:
    notes: list[str] = []
    text = json.dumps({"use_liger_kernel": True, "auto_find_batch_size": False})
    read_training_args(_write(tmp_path, "args.json", text), notes)
    ignored = [n for n in notes if "ignored" in n]
    assert len(ignored) == 1 and "use_liger_kernel" in ignored[0]
    assert "auto_find_batch_size" not in ignored[0]
    with pytest.raises(SpecError, match="bad.json: optim 'galore_adamw' unknown or not modelled"):
        read_training_args(_write(tmp_path, "bad.json", '{"optim": "galore_adamw"}'))
    with pytest.raises(SpecError, match="must hold a mapping"):
        read_training_args(_write(tmp_path, "list.json", "[]"))


# --- garbage in: a one-line SpecError, never a crash ----------------------------------------

_ODD = [0, -1, 1, 3, 2**70, 1.5, math.nan, True, False, None, "12", "auto", [], ["x"], {}, {"a": 1}]
_WORDS = ["lora", "qlora", "bf16", "fp16", "full_shard", "offload", "adamw_torch", "q_proj"]
_VALUES = st.recursive(
    st.sampled_from(_ODD + _WORDS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["_component_", "lora_rank", "max_seq_len", "stage", "fused"]), inner
        ),
    ),
    max_leaves=5,
)
_KEYS = {
    "axolotl": [
        "micro_batch_size",
        "batch_size",
        "sequence_len",
        "bf16",
        "fp16",
        "adapter",
        "load_in_4bit",
        "lora_r",
        "lora_target_modules",
        "optimizer",
        "gradient_checkpointing",
        "deepspeed",
        "fsdp",
        "fsdp_config",
        "attn_implementation",
        "plugins",
    ],
    "torchtune": [
        "batch_size",
        "dtype",
        "model",
        "optimizer",
        "loss",
        "tokenizer",
        "compile",
        "fsdp_cpu_offload",
    ],
    "args": [
        "per_device_train_batch_size",
        "bf16",
        "optim",
        "max_length",
        "deepspeed",
        "fsdp",
        "fsdp_config",
        "model_init_kwargs",
        "gradient_checkpointing",
    ],
}


@settings(
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(sorted(_KEYS)),
    data=st.data(),
)
def test_fuzz_trainer_configs(tmp_path: Path, kind: str, data: st.DataObject) -> None:
    cfg = data.draw(st.dictionaries(st.sampled_from(_KEYS[kind]), _VALUES, max_size=5))
    read = {
        "axolotl": read_axolotl_config,
        "torchtune": read_torchtune_config,
        "args": read_training_args,
    }[kind]
    path = tmp_path / ("f.json" if kind == "args" else "f.yaml")
    path.write_text(json.dumps(cfg))  # JSON is YAML
    try:
        TrainingConfig(**read(str(path), []))
    except SpecError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 600, exc


@pytest.mark.parametrize("option", ["--axolotl-config", "--torchtune-config", "--training-args"])
def test_an_unreadable_file_is_one_line(invoke: Invoke, option: str, tmp_path: Path) -> None:
    for path, message in (
        ("/dev/zero", "not a regular file"),
        (tmp_path / "no.yml", "cannot read"),
    ):
        r = invoke("estimate", "gpt2", option, str(path), exit_code=2)
        field = option[2:].replace("-", "_")
        assert r.stderr.startswith(f"error: {field}: ") and message in r.stderr
        assert r.stderr.count("\n") == 1


def test_a_missing_deepspeed_file_named_inside_is_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.yml", "deepspeed: nowhere/zero3.json\n")
    with pytest.raises(SpecError, match=r"^deepspeed_config: cannot read nowhere/zero3.json"):
        read_axolotl_config(path)


def test_fsdp_flag_with_a_trainer_file_is_the_trainers_fsdp(invoke: Invoke, tmp_path: Path) -> None:
    # --fsdp under the HF Trainer is accelerate's FSDP plugin, also when hf-trainer comes from
    # a TrainingArguments file rather than --framework
    path = _write(tmp_path, "args.json", '{"per_device_train_batch_size": 1}')
    args = ["-s", "128", "--training-args", path, "--fsdp", "full-shard"]
    config = _estimate(invoke, [*args, "--data-parallel-size", "2"], "gpt2")["config"]
    assert (config["framework"], config["zero_stage"]) == ("accelerate-fsdp", 3)
