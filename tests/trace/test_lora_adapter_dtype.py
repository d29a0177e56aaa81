"""An explicit LoRA adapter dtype (``--lora-adapter-dtype``): diffusers'
``cast_training_params(model, torch.float32)``, which CogVideo's and finetrainers' LoRA trainers
call for every precision, over diffusers' bf16 adapters (``add_adapter`` keeps the base dtype).

Expected values: the dtypes diffusers' own ``cast_training_params`` gives a real CPU model, and
AdamW's two states per trainable element in the parameter's dtype (torch optim/adamw.py
``exp_avg`` / ``exp_avg_sq`` = ``torch.zeros_like(p)``) over elements counted by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

FLUX = Path(__file__).parent / "diffusers_configs" / "tiny-flux.json"


def _flux(dtype: str | None) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=1, precision="bf16-mixed", load_dtype="bfloat16", lora_rank=4,
        lora_targets=("q", "k", "v", "o"), activation_checkpointing="full", resolution=64,
        text_seq_len=16, lora_adapter_dtype=dtype,
    )  # fmt: skip


def test_diffusers_adapters_as_cast_training_params_casts_them() -> None:
    pytest.importorskip("diffusers")
    import torch
    from diffusers.training_utils import cast_training_params

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model

    raw = load_hf_config(str(FLUX))
    real = build_diffusers_model(raw, _flux(None), device="cpu")
    cast_training_params(real, dtype=torch.float32)  # the trainer's own call
    ours = build_diffusers_model(raw, _flux("float32"))

    def trainable(model: Any) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for p in model.parameters():
            if p.requires_grad:
                out[p.dtype] = out.get(p.dtype, 0) + p.numel()
        return out

    assert trainable(ours) == trainable(real) == {torch.float32: trainable(real)[torch.float32]}
    frozen = {p.dtype for p in ours.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}  # the base stays in the load dtype


@pytest.mark.parametrize(("dtype", "size"), [(None, 2), ("float32", 4)])
def test_traced_optimizer_states_follow_the_adapter_dtype(dtype: str | None, size: int) -> None:
    pytest.importorskip("diffusers")
    est = estimate(str(FLUX), _flux(dtype), engine="trace")
    n = est.num_trainable_parameters
    # tiny-flux.json: 2 joint + 2 single blocks, 2 heads x 16 = 32 wide; r 4 on to_q/k/v,
    # to_out.0, add_q/k/v_proj, to_add_out of each joint block (8 x 4 x (32 + 32)) and on
    # to_q/k/v of each single block (3 x 4 x (32 + 32))
    assert n == 2 * 8 * 4 * (32 + 32) + 2 * 3 * 4 * (32 + 32)
    assert est.breakdown.optimizer_states == 2 * size * n


def test_analytic_states_follow_an_explicit_adapter_dtype() -> None:
    # Llama-3.1-8B, r 16 on q (4096 -> 4096) and v (4096 -> 1024) in 32 layers
    n = 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    for dtype, size in (("bfloat16", 2), ("float32", 4), (None, 4)):  # None: peft's fp32
        t = TrainingConfig(
            micro_batch_size=1, seq_len=256, precision="bf16-mixed", lora_rank=16,
            lora_adapter_dtype=dtype,
        )  # fmt: skip
        est = estimate("llama-3.1-8b", t, engine="analytic")
        assert est.num_trainable_parameters == n
        assert est.breakdown.optimizer_states == 2 * size * n


def test_refused_where_the_framework_casts_the_adapters() -> None:
    with pytest.raises(SpecError, match="lora_adapter_dtype.*zero_stage 2"):
        TrainingConfig(
            lora_rank=8, lora_adapter_dtype="float32", framework="deepspeed", zero_stage=2,
            data_parallel_size=2,
        )  # fmt: skip
    with pytest.raises(SpecError, match="lora_adapter_dtype.*lora_rank > 0"):
        TrainingConfig(lora_adapter_dtype="float32")


def test_the_assumed_line_names_the_given_adapter_dtype_and_the_casting() -> None:
    from trainmem.specs.assumptions import assumptions

    config = {
        "precision": "bf16-mixed", "load_dtype": "bfloat16", "lora_rank": 4,
        "lora_adapter_dtype": "float32", "layerwise_casting": "float8_e4m3fn",
    }  # fmt: skip
    means = assumptions(config, library="diffusers")["framework_means"]
    assert "LoRA adapters float32 (--lora-adapter-dtype)" in means
    assert "stored in float8_e4m3fn" in means
    plain = assumptions(
        {**config, "lora_adapter_dtype": None, "layerwise_casting": "none"}, "diffusers"
    )
    assert "LoRA adapters bfloat16," in plain["framework_means"]
    assert "float8" not in plain["framework_means"]
