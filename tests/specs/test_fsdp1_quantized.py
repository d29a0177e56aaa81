"""Quantized bases FSDP1 frameworks never run, refused on both engines naming what runs
(``_check_fsdp1_quantized``, specs/training.py; issue 26: "the generic path does not model
quantize_base=int8 under framework=accelerate-fsdp yet" while the formulas answered a run no
release has): bitsandbytes int8 under FSDP1 (torch's _flat_param.py: "Cannot flatten integer
dtype tensors"), int8 / GPTQ under Answer.AI fsdp_qlora (bitsandbytes 4-bit or HQQ only)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

MODEL = str(MODELS_DIR / "formula" / "qwen2.json")
DP4: dict[str, Any] = {"zero_stage": 3, "data_parallel_size": 4}


@pytest.mark.parametrize(
    ("framework", "base", "names"),
    [
        ("accelerate-fsdp", "int8", "Cannot flatten integer dtype tensors"),
        ("fsdp-qlora", "int8", "train_type qlora"),
        ("fsdp-qlora", "gptq-int4", "train_type qlora"),
    ],
)
@pytest.mark.parametrize("sharded", [True, False])
def test_refused(framework: str, base: str, names: str, sharded: bool) -> None:
    with pytest.raises(SpecError, match=names):
        TrainingConfig(
            framework=framework, lora_rank=8, quantize_base=base, **(DP4 if sharded else {})
        )


@pytest.mark.parametrize("engine", ["analytic", "generic"])
def test_both_engines_refuse(engine: str) -> None:
    with pytest.raises(SpecError, match="int8 with --framework accelerate-fsdp"):
        training = TrainingConfig(
            micro_batch_size=1,
            seq_len=32,
            framework="accelerate-fsdp",
            lora_rank=8,
            quantize_base="int8",
            **DP4,
        )
        estimate(MODEL, training, engine=engine, simulate_allocator=False)


@pytest.mark.parametrize(
    "settings",
    [
        {"framework": "accelerate-fsdp", "quantize_base": "gptq-int4", **DP4},  # buffers
        {"framework": "accelerate-fsdp", "quantize_base": "nf4", **DP4},
        {"framework": "fsdp-qlora", "quantize_base": "nf4-dq", **DP4},
        {"framework": "fsdp2", "quantize_base": "int8", **DP4},
    ],
)
def test_allowed(settings: dict[str, Any]) -> None:
    TrainingConfig(lora_rank=8, **settings)
