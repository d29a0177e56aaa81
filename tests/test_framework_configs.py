"""DeepSpeed / accelerate config files and framework conventions, from the documented formats."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Invoke
from trainmem.analytic.tensor_states import tensor_states
from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


def test_deepspeed_config_fields(tmp_path: Path) -> None:
    # keys from https://www.deepspeed.ai/docs/config-json/ ; "auto" is left to the Trainer
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": "auto",
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    assert read_deepspeed_config(str(p)) == {
        "framework": "deepspeed",
        "micro_batch_size": 4,
        "precision": "bf16-mixed",
        "zero_stage": 3,
        "offload": "optimizer",
    }


def test_accelerate_fsdp_config(tmp_path: Path) -> None:
    p = tmp_path / "accelerate.yaml"
    p.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n"
        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_activation_checkpointing: true\n"
    )
    # SHARD_GRAD_OP shards the weights outside computation (torch fsdp/api.py): stage 3 that
    # keeps the gathered weights from forward to backward; FSDP v1 under accelerate installs
    # MixedPrecision(param_dtype=bf16) (framework accelerate-fsdp)
    assert read_accelerate_config(str(p)) == {
        "precision": "bf16-mixed",
        "data_parallel_size": 8,
        "zero_stage": 3,
        "reshard_after_forward": False,
        "framework": "accelerate-fsdp",
        "activation_checkpointing": "full",
        # a plain accelerate script's torch.optim.AdamW: foreach on CUDA (torch/optim/
        # optimizer.py _default_to_fused_or_foreach), not the HF Trainer's fused default
        "optimizer_implementation": "foreach",
    }


def test_accelerate_without_mixed_precision_trains_in_fp32(tmp_path: Path) -> None:
    # accelerate config default_config.yaml `mixed_precision: no` (or absent): Accelerator runs
    # no autocast, the model trains in fp32
    for text in ("distributed_type: MULTI_GPU\nmixed_precision: no\n", "num_processes: 2\n"):
        p = tmp_path / "accelerate.yaml"
        p.write_text(text)
        assert read_accelerate_config(str(p))["precision"] == "32-true", text


def test_accelerate_hybrid_shard_groups_one_node(tmp_path: Path) -> None:
    p = tmp_path / "accelerate.yaml"
    p.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 32\nnum_machines: 4\n"
        "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"
    )
    out = read_accelerate_config(str(p))
    # 32 processes on 4 machines: shards span the 32 / 4 = 8 GPUs of a node
    assert (out["zero_stage"], out["shard_group_size"]) == (3, 8)


def test_explicit_flags_win_over_the_file(invoke: Invoke, tmp_path: Path) -> None:
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
    )
    r = invoke(
        "estimate",
        "gpt2",
        "--deepspeed-config",
        str(p),
        "--micro-batch-size",
        "2",
        "--data-parallel-size",
        "4",
        "--json",
    )
    config = json.loads(r.stdout)["config"]
    assert config["micro_batch_size"] == 2 and config["zero_stage"] == 2
    assert config["framework"] == "deepspeed"


def test_deepspeed_mixed_precision_is_the_zero_papers_2_2_12() -> None:
    # Rajbhandari et al. 2020 sec. 3.1: fp16 weights (2) + fp16 grads (2) + fp32 master weights,
    # momentum and variance (12) = 16 bytes per parameter.
    training = TrainingConfig(precision="16-mixed", framework="deepspeed")
    states = tensor_states(load_model_spec("gpt2"), training)
    n = sum(s.numel for s in states)
    assert sum(s.param_bytes for s in states) == 2 * n
    assert sum(s.grad_bytes for s in states) == 2 * n
    assert sum(s.state_bytes for s in states) == 12 * n


def test_megatron_accumulates_gradients_in_fp32() -> None:
    training = TrainingConfig(precision="bf16-mixed", framework="megatron")
    states = tensor_states(load_model_spec("gpt2"), training)
    n = sum(s.numel for s in states)
    assert sum(s.grad_bytes for s in states) == 4 * n


def test_deepspeed_grad_accum_dtype_is_read(tmp_path: Path) -> None:
    # runtime/config.py get_data_types_params: "data_types": {"grad_accum_dtype": ...}, any
    # DtypeEnum spelling; with bf16 and ZeRO-1, fp32 selects BF16_Optimizer (engine.py
    # _do_optimizer_sanity_check)
    import pytest

    from trainmem.errors import SpecError
    from trainmem.specs.framework_configs import deepspeed_settings

    base = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    for name, dtype in (("fp32", "float32"), ("torch.bfloat16", "bfloat16"), ("half", "float16")):
        out = deepspeed_settings({**base, "data_types": {"grad_accum_dtype": name}})
        assert out["grad_accum_dtype"] == dtype
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({**base, "data_types": {"grad_accum_dtype": "fp32"}}))
    training = TrainingConfig(**read_deepspeed_config(str(p)))
    assert (
        training.deepspeed_optimizer == "bf16" and training.bf16_optimizer_buffer_dtype == "float32"
    )
    assert "grad_accum_dtype" not in deepspeed_settings(base)
    with pytest.raises(SpecError, match="grad_accum_dtype 'int8' unknown; allowed: fp32"):
        deepspeed_settings({"data_types": {"grad_accum_dtype": "int8"}})


def test_deepspeed_without_a_precision_section_trains_in_fp32() -> None:
    # deepspeed/runtime/precision_config.py: DeepSpeedBF16Config.enabled and
    # DeepSpeedFP16Config.enabled default to False, and nothing autocasts: the model is fp32
    import pytest

    from trainmem.errors import SpecError
    from trainmem.specs.framework_configs import deepspeed_settings

    for ds in (
        {},
        {"bf16": {}},
        {"bf16": {"enabled": False}, "fp16": {"enabled": False}},
        {"bf16": None, "bfloat16": {"enabled": False}},
    ):
        assert deepspeed_settings(ds)["precision"] == "32-true", ds
    assert deepspeed_settings({"bfloat16": {"enabled": True}})["precision"] == "bf16-mixed"
    assert deepspeed_settings({"fp16": {"enabled": True}})["precision"] == "16-mixed"
    # runtime/config.py: 'bfloat16 and fp16 modes cannot be simultaneously enabled'
    with pytest.raises(SpecError, match="bf16 and fp16 are both enabled; DeepSpeed refuses"):
        deepspeed_settings({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_deepspeed_auto_precision_is_left_to_the_trainer() -> None:
    # transformers integrations/deepspeed.py trainer_config_process: fill_match("bf16.enabled",
    # args.bf16 ...): an "auto" takes the Trainer's value, for trainmem the option's own
    from trainmem.specs.framework_configs import deepspeed_settings

    auto: dict[str, str] = {}
    out = deepspeed_settings(
        {"bf16": {"enabled": "auto"}, "fp16": {"enabled": False}, "gradient_accumulation_steps": 2},
        auto,
    )
    assert "precision" not in out and out["gradient_accumulation_steps"] == 2
    assert auto == {"precision": "bf16.enabled"}
    auto = {}
    out = deepspeed_settings({"fp16": {"enabled": "auto"}, "bf16": {"enabled": True}}, auto)
    assert out["precision"] == "bf16-mixed" and auto == {}  # an enabled section decides


GPT2_PARAMETERS = 124_439_808
"""GPT-2 small with its tied embedding: 12 layers x 7,087,872 + 50,257 x 768 + 1,024 x 768 +
2 x 768 (Radford et al. 2019; sum(p.numel()) of transformers' GPT2LMHeadModel)."""


def _estimate_json(invoke: Invoke, args: list[str]) -> dict[str, object]:
    r = invoke("estimate", "gpt2", "-s", "128", *args, "--json")
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_a_ds_config_without_bf16_is_estimated_in_fp32(invoke: Invoke, tmp_path: Path) -> None:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    out = _estimate_json(invoke, ["--deepspeed-config", str(p)])
    config, states = out["config"], out["model_states_bytes"]
    assert isinstance(config, dict) and isinstance(states, dict)
    assert (config["precision"], config["weight_dtype"]) == ("32-true", "float32")
    # fp32 weights: 4 bytes per parameter (before, read as bf16: 2 bytes)
    assert states["parameters"] == 4 * GPT2_PARAMETERS
    # an explicit --precision is the Trainer's --bf16: accelerate adds the section
    # (utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision); 16-bit weights, 2 bytes each
    out = _estimate_json(invoke, ["--deepspeed-config", str(p), "-p", "bf16-mixed"])
    assert out["model_states_bytes"]["parameters"] == 2 * GPT2_PARAMETERS  # type: ignore[index]


def test_ds_config_auto_values_take_the_options_and_say_so(invoke: Invoke, tmp_path: Path) -> None:
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}})
    )
    out = _estimate_json(invoke, ["--deepspeed-config", str(p)])
    config, notes = out["config"], out["notes"]
    assert isinstance(config, dict) and isinstance(notes, list)
    assert (config["precision"], config["micro_batch_size"]) == ("bf16-mixed", 1)
    assert (
        'ds_config bf16.enabled "auto": precision bf16-mixed (trainmem\'s default), as the HF '
        "Trainer fills it from its own arguments" in notes[-1]
    )
    assert 'train_micro_batch_size_per_gpu "auto": micro_batch_size 1' in notes[-2]
    out = _estimate_json(invoke, ["--deepspeed-config", str(p), "-p", "32-true", "-b", "2"])
    config, notes = out["config"], out["notes"]
    assert isinstance(config, dict) and isinstance(notes, list)
    assert (config["precision"], config["micro_batch_size"]) == ("32-true", 2)
    assert 'bf16.enabled "auto": precision 32-true (--precision)' in notes[-1]
