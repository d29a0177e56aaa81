"""Casts of one tensor under torch.compile are one tensor (Note [Compiled casts are computed
once], trainmem/analytic/activation_shapes.py; AOTAutograd's CSE before the min-cut partition).

Sizes by hand on the 2-layer Qwen2 formula config (tests/models/formula/qwen2.json: h = 64,
separate q / k / v and gate / up linears) at micro-batch 2 x 64 tokens: t = 128 tokens, one
bf16 copy of a norm's output is 2 B x 64 x 128 = 16,384 B, one fp32 copy 32,768 B.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.analytic.activation_shapes import cast_copies
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
BF16_COPY, FP32_COPY = 2 * 64 * 128, 4 * 64 * 128


def _terms(**changes: Any) -> dict[str, int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **changes)
    est = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    terms: dict[str, int] = est.details["activation_terms_per_layer_bytes"]
    return terms


def test_cast_copies_is_one_tensor_per_input_under_compile() -> None:
    assert cast_copies(3, TrainingConfig()) == 3
    assert cast_copies(3, TrainingConfig(compile=True)) == 1
    assert cast_copies(0, TrainingConfig(compile=True)) == 0


def test_autocast_input_copies_eager_and_compiled() -> None:
    # eager autocast: q, k and v each cast the attention norm's output, gate and up the MLP's
    eager = _terms(precision="bf16-mixed")
    assert eager["attention/qkv_input"] == 3 * BF16_COPY
    assert eager["mlp/input"] == 2 * BF16_COPY
    # compiled: one cast node per input after CSE
    compiled = _terms(precision="bf16-mixed", compile=True)
    assert compiled["attention/qkv_input"] == BF16_COPY
    assert compiled["mlp/input"] == BF16_COPY


def test_lora_under_autocast_compiled_saves_one_copy_per_input() -> None:
    terms = _terms(precision="bf16-mixed", compile=True, lora_rank=8, lora_targets=("q", "v"))
    assert terms["attention/qkv_input"] == BF16_COPY  # eager: 2 copies (q and v)


def test_peft_fp32_input_casts_eager_and_compiled() -> None:
    # bf16-true: peft casts each targeted linear's input to its fp32 adapters
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    eager = _terms(precision="bf16-true", lora_rank=8, lora_targets=targets)
    casts = {k: v for k, v in eager.items() if k.endswith("_input_cast")}
    # q, k, v, gate, up read h = 64 values a token; o reads a * d = 64; down i = 128
    assert casts == {
        "lora/q_input_cast": FP32_COPY,
        "lora/k_input_cast": FP32_COPY,
        "lora/v_input_cast": FP32_COPY,
        "lora/o_input_cast": FP32_COPY,
        "lora/gate_input_cast": FP32_COPY,
        "lora/up_input_cast": FP32_COPY,
        "lora/down_input_cast": 2 * FP32_COPY,
    }
    compiled = _terms(precision="bf16-true", lora_rank=8, lora_targets=targets, compile=True)
    casts = {k: v for k, v in compiled.items() if k.endswith("_input_cast")}
    # one cast of the attention norm's output (q's), one of the MLP norm's (gate's)
    assert casts == {
        "lora/q_input_cast": FP32_COPY,
        "lora/o_input_cast": FP32_COPY,
        "lora/gate_input_cast": FP32_COPY,
        "lora/down_input_cast": 2 * FP32_COPY,
    }


def test_compiled_mlp_norm_keeps_the_16_bit_attention_output() -> None:
    # Note [Compiled residual add] (analytic/mlp.py): under compile a norm saves its input and
    # the fp32 rstd (r h + 4 B a token); the MLP norm's fp32 input x + attn_out is recomputed
    # from the 16-bit attention output, which the min-cut keeps instead (c h + 4)
    mixed = _terms(precision="bf16-mixed", compile=True)
    assert mixed["attention/norm"] == (4 * 64 + 4) * 128
    assert mixed["mlp/norm"] == (2 * 64 + 4) * 128
    # on a 16-bit residual stream the sum is 16-bit too: nothing to trade
    true = _terms(precision="bf16-true", compile=True)
    assert true["attention/norm"] == true["mlp/norm"] == (2 * 64 + 4) * 128
