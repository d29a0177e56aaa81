"""peft's DoRA over a bitsandbytes base (QDoRA, issue 26) on the analytic path: bytes by hand
from peft 0.21.2 tuners/lora/dora.py ``DoraLinearLayer.forward`` / ``get_weight_norm``, peft
utils/integrations.py ``dequantize_bnb_weight`` and bitsandbytes 0.45.0 functional.py
``dequantize_4bit`` / ``int8_vectorwise_dequant`` (Note [QDoRA] in
``analytic/lora_variants.py``), on a 2-layer Llama (tests/models/lora_variants/llama_h1024.json:
h 1024, 16 heads of 64, 4 KV heads -> v out 256, MLP 2816), b 2 x s 256 = 512 tokens, r 16."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainmem.analytic.lora_variants import dora_forward_transient_bytes
from trainmem.errors import SpecError
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "lora_variants" / "llama_h1024.json")
T = 2 * 256  # tokens
Q_OUT, V_OUT = 1024, 4 * 64
FAN_IN, FAN_OUT = 2816, 1024  # down_proj
R = 16
LAYERS = 2
ALL = ("q", "k", "v", "o", "gate", "up", "down")
QLORA = TrainingConfig(
    micro_batch_size=2, seq_len=256, lora_rank=R, lora_targets=("q", "v"), quantize_base="nf4"
)
QDORA = dataclasses.replace(QLORA, lora_variant="dora")


def test_the_dequantized_weight_adds_one_weight_sized_tensor_at_the_norm() -> None:
    # bf16-mixed on fp32 weights (pytorch-amp): adapters a = 4 B, compute c = 2 B. All-linear:
    # the largest moment is down_proj's get_weight_norm. Alive beside the layer's saved
    # tensors: the linear's input [t, 2816] (c) and peft's fp32 cast of it (a), torch.eye(2816)'s
    # bf16 cast and lora_A's [2816, 16] bf16 output (saved by autocast's matmuls while
    # lora_weight lives), then four fp32 [1024, 2816] tensors: lora_weight (cast to x's fp32),
    # the base weight (dequantize_4bit's bf16 output cast to fp32 by weight.to(x.dtype), the
    # bf16 one freed on rebinding), scaling * lora_weight and the sum. Over an unquantized
    # fp32 base weight.to(fp32) is the parameter itself: three, not four.
    held = 2 * T * FAN_IN + 4 * T * FAN_IN + 2 * FAN_IN * FAN_IN + 2 * FAN_IN * R
    expected = held + 4 * (4 * FAN_IN * FAN_OUT)
    training = dataclasses.replace(QDORA, lora_targets=ALL)
    spec = resolve_model(MODEL)
    assert dora_forward_transient_bytes(spec, training, adapter_bytes=4) == expected == 70_737_920
    unquantized = dataclasses.replace(training, quantize_base="none")
    assert dora_forward_transient_bytes(spec, unquantized, adapter_bytes=4) == 62_087_168
    assert (
        held + 3 * (4 * FAN_IN * FAN_OUT) < 62_087_168
    )  # there the eye's product was the larger moment


def test_int8_dequantization_is_two_fp32_products() -> None:
    # DeepSpeed bf16: adapters cast to bf16 (a = 2), no autocast, so no input cast and the eye
    # in bf16. int8_vectorwise_dequant: A * stats.view(-1, 1) (fp32 [1024, 2816]) times 1/127
    # (another fp32 one) while lora_weight (bf16) lives: (2 + 4 + 4) per element, more than
    # the norm's four bf16 tensors (8) or the cast to bf16 (2 + 4 + 2)
    held = 2 * T * FAN_IN + 2 * FAN_IN * FAN_IN + 2 * FAN_IN * R
    expected = held + (2 + 8) * FAN_IN * FAN_OUT
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=256,
        lora_rank=R,
        lora_targets=ALL,
        lora_variant="dora",
        quantize_base="int8",
        framework="deepspeed",
    )
    spec = resolve_model(MODEL)
    assert dora_forward_transient_bytes(spec, training, adapter_bytes=2) == expected == 47_669_248


def test_qdora_saves_what_dora_saves_over_qlora() -> None:
    # q, v: the peak is in the backward, where the forward's transients are gone; what DoRA
    # saves beyond LoRA is the same over a quantized base (base_result and lora_result [t, out]
    # bf16, three fp32 [out] vectors; no mag_norm_scale - 1 in layer 0) plus the magnitude and
    # its two AdamW states
    saved = LAYERS * ((2 + 2) * T * (Q_OUT + V_OUT) + 3 * 4 * (Q_OUT + V_OUT))
    saved -= 4 * (Q_OUT + V_OUT)
    states = 12 * (Q_OUT + V_OUT) * LAYERS
    lora, dora = (
        estimate(MODEL, t, engine="analytic", simulate_allocator=False) for t in (QLORA, QDORA)
    )
    assert dora.peak_phase == lora.peak_phase == "backward"
    gap = dora.breakdown.allocated_bytes - lora.breakdown.allocated_bytes
    assert gap == saved + states


@pytest.mark.parametrize("framework", ["fsdp-qlora", "torchtune", "litgpt"])
@pytest.mark.parametrize("base", ["nf4", "none"])
def test_frameworks_whose_dora_is_not_peft_are_refused(framework: str, base: str) -> None:
    # fsdp_qlora 05ed9f2 train.py: DoRA only as BNBDORA / HQQDORA over a quantized base, its
    # peft train_type lora without use_dora; torchtune 0.6.1 modules/peft/dora.py DoRALinear;
    # litgpt 0.5.13: no DoRA in its source. None of them runs peft's DoraLinearLayer.
    with pytest.raises(SpecError, match=rf"lora_variant: dora.* under --framework {framework}"):
        TrainingConfig(lora_rank=8, lora_variant="dora", quantize_base=base, framework=framework)
    # LoRA over this base still runs there
    TrainingConfig(lora_rank=8, lora_variant="lora", quantize_base=base, framework=framework)


def test_dora_over_gptq_stays_refused_as_peft_refuses_it() -> None:
    with pytest.raises(SpecError, match="dora with --quantize-base gptq-int4: peft's GPTQ"):
        dataclasses.replace(QDORA, quantize_base="gptq-int4")
