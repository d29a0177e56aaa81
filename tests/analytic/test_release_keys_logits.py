"""Two transformers release rules on Llama / Mistral, bytes by hand from the source.

* Note [The rotated keys' dtype by release] (analytic/attention.py): the rotary tables are
  computed per layer on ``value_states`` (16-bit under autocast) before Llama 4.43 / Mistral
  4.48 (modeling_llama.py 4.42.0 ``cos, sin = self.rotary_emb(value_states, position_ids)``;
  4.43.0 ``LlamaModel.forward`` ``self.rotary_emb(hidden_states, position_ids)`` on the fp32
  residual), so the training KV cache's keys are the 16-bit ones SDPA saves (none extra) before,
  fp32 copies after: 4 B x kv_heads x head_dim per token and layer.
* Note [The upcast 16-bit logits] (analytic/loss.py): Llama before 4.46 (Mistral before 4.48)
  rebinds ``logits = logits.float()``, so its 16-bit logits (2 B x vocab per token) go at the
  upcast in any loop, the plain one too.
"""

from __future__ import annotations

from dataclasses import replace

from conftest import MODELS_DIR
from trainmem.analytic.attention import forward_kv_cache_bytes
from trainmem.analytic.loss import model_upcast_logits_bytes, upcast_logits_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

LLAMA = MODELS_DIR / "agreement" / "llama_h1024.json"  # 2 layers, 8 of 8 kv heads of 128, V 4096


def _t(version: str, **kw: object) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=4, seq_len=512, precision="bf16-mixed", transformers_version=version, **kw
    )


def _model(model_type: str = "llama") -> ModelSpec:
    return replace(load_model_spec(str(LLAMA)), model_type=model_type)


def test_cached_keys_by_release() -> None:
    model = _model()
    per_layer = 4 * 8 * 128 * 4 * 512  # fp32 keys: 8 kv heads x 128 x 2,048 tokens
    assert forward_kv_cache_bytes(model, _t("4.42.0"), 2) == 0
    assert forward_kv_cache_bytes(model, _t("4.43.0"), 2) == 2 * per_layer
    mistral = _model("mistral")
    assert forward_kv_cache_bytes(mistral, _t("4.47.0"), 2) == 0
    assert forward_kv_cache_bytes(mistral, _t("4.48.0"), 2) == 2 * per_layer


def test_logits_freed_at_the_upcast_by_release() -> None:
    model = _model()
    logits16 = 2 * 4096 * 4 * 512
    assert model_upcast_logits_bytes(model, _t("4.45.0")) == logits16
    assert model_upcast_logits_bytes(model, _t("4.46.0")) == 0
    assert model_upcast_logits_bytes(_model("mistral"), _t("4.47.0")) == logits16
    # the plain loop's; the loops that hold the output keep their own rule
    assert upcast_logits_bytes(model, _t("4.45.0")) == 0
    assert upcast_logits_bytes(model, _t("4.45.0", loop="step")) == logits16


def test_analytic_step_by_release() -> None:
    """4.42 against 4.43 (the same loss rules, the rotary moved): the peak at the loss differs
    by both layers' fp32 keys; 4.45 against 4.46 (the same keys, ``logits.float()`` gone, and
    the loss's shifted copy kept until 4.49): by the 16-bit logits."""

    def peak(version: str) -> int:
        return estimate(str(LLAMA), _t(version), engine="analytic").breakdown.allocated_bytes

    assert peak("4.43.0") - peak("4.42.0") == 2 * 4 * 8 * 128 * 4 * 512
    assert peak("4.46.0") - peak("4.45.0") == 2 * 4096 * 4 * 512
