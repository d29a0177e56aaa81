"""Autocast's copies where the tensor already is in the compute dtype (issue 26): a quantized
base kept in 16 bits under autocast (``TrainingConfig.kbit_16bit_dense``: a GPTQ base, or
``prepare_kbit_training=False``) has a 16-bit LM head and 16-bit norm outputs, and aten's
``cached_cast`` (aten/src/ATen/autocast_mode.cpp) casts only a tensor of another dtype: no
copy of the head weight, one saved input for q / k / v and one for gate / up. Found by the
generic path (trace/quantized.py stand-ins on a 1024-wide Qwen2: -2.2 % and -5.4 % -> 0.000 %).

Hand-derived for tests/models/formula/qwen2.json (h = 64, V = 512, untied head) at 2 x 64
tokens (t = 128), bf16-mixed (c = 2 B): the head copy c * V * h = 65,536 B; a layer's input
copies c * h * t = 16,384 B each.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.head import head_activation_bytes
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

MODEL = load_model_spec(str(MODELS_DIR / "formula" / "qwen2.json"))
COPY = 2 * 64 * 128


def _int8_lora(**changes: Any) -> TrainingConfig:
    base: dict[str, Any] = {
        "micro_batch_size": 2,
        "seq_len": 64,
        "lora_rank": 16,
        "quantize_base": "int8",
    }
    return TrainingConfig(**{**base, **changes})


def test_a_16bit_head_gets_no_autocast_copy() -> None:
    upcast = _int8_lora()  # peft's prepare_model_for_kbit_training: an fp32 head
    kept = _int8_lora(prepare_kbit_training=False)
    assert kept.kbit_16bit_dense and not upcast.kbit_16bit_dense
    assert head_activation_bytes(MODEL, upcast)["autocast_weight_copies"] == 2 * 512 * 64
    assert "autocast_weight_copies" not in head_activation_bytes(MODEL, kept)
    gptq = _int8_lora(quantize_base="gptq-int4")  # peft casts no GPTQ parameter to fp32
    assert "autocast_weight_copies" not in head_activation_bytes(MODEL, gptq)


def test_16bit_norm_outputs_are_saved_once_by_the_linears_reading_them() -> None:
    upcast = layer_activation_terms(MODEL, _int8_lora())
    kept = layer_activation_terms(MODEL, _int8_lora(prepare_kbit_training=False))
    assert (upcast["attention/qkv_input"], upcast["mlp/input"]) == (3 * COPY, 2 * COPY)
    assert (kept["attention/qkv_input"], kept["mlp/input"]) == (COPY, COPY)
