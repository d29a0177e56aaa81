"""A padded batch (``padding_mask``) on a transformers decoder with SDPA (Note in
trainmem/analytic/attention.py ``materialised_mask_bias_bytes``).

Hand derivation on tests/models/formula/qwen2.json (4 query heads and 2 kv heads of 16, so
k and v are repeated to 4 heads; bf16 autocast: c = 2, fp32 residual r = 4), b = 4, s = 256
(t = 1024 tokens):

* transformers builds the boolean (b, 1, s, s) mask (a 0 in ``attention_mask`` keeps
  ``_ignore_causal_mask_sdpa`` from leaving it to ``is_causal``); each layer's SDPA turns it
  into a c-byte bias the memory-efficient kernel saves: 2 * 4 * 256 * 256 = 524,288 B a layer;
* the batch's ``attention_mask``, (b, s) int64: 8 * 1024 = 8,192 B;
* transformers 5's training KV cache keeps, per layer, the fp32 rotated keys (r * 2 * 16 * t =
  131,072 B) and, as SDPA now saves the repeated k and v, the values' c-byte copy too
  (2 * 2 * 16 * t = 65,536 B).

Checked against the generic path: this Qwen2 at b4 s256 +3.2 % -> 0.000 %, a 4-layer Qwen2 of
width 256 (8 heads, 4 kv heads) +2.2 % -> +0.014 %.
"""

from __future__ import annotations

from pathlib import Path

from trainmem.analytic.activations import embedding_activation_bytes, layer_activation_terms
from trainmem.analytic.attention import forward_kv_cache_bytes
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = Path(__file__).resolve().parents[1] / "models" / "formula" / "qwen2.json"
T = 4 * 256


def _training(padding: bool, attention: str = "sdpa") -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=4, seq_len=256, padding_mask=padding, attention=attention
    )


def test_mask_bias_per_layer() -> None:
    model = load_model_spec(str(QWEN2))
    assert layer_activation_terms(model, _training(True))["attention/mask_bias"] == 2 * 4 * 256**2
    assert "attention/mask_bias" not in layer_activation_terms(model, _training(False))
    # eager adds the mask to the scores and saves none of it
    assert "attention/mask_bias" not in layer_activation_terms(model, _training(True, "eager"))


def test_attention_mask_input() -> None:
    model = load_model_spec(str(QWEN2))
    assert embedding_activation_bytes(model, _training(True))["inputs/attention_mask"] == 8 * T
    assert "inputs/attention_mask" not in embedding_activation_bytes(model, _training(False))


def test_kv_cache_keeps_the_values_copy_when_kv_is_repeated() -> None:
    model = load_model_spec(str(QWEN2))
    assert forward_kv_cache_bytes(model, _training(False), 1) == 4 * 2 * 16 * T
    assert forward_kv_cache_bytes(model, _training(True), 1) == 4 * 2 * 16 * T + 2 * 2 * 16 * T
