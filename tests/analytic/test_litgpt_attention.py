"""litgpt's own attention in the formulas (issue 26; found by tracing litgpt 0.5.13's GPT on the
generic path, trainmem/trace/litgpt_model.py).

litgpt/model.py v0.5.13 ``CausalSelfAttention.forward`` (lit-gpt @8641822 alike):
``qkv = self.qkv(x)`` (one fused linear), ``q = torch.cat((q_roped, q[..., rope_n_elem:]))``
((b, a, s, d)-contiguous), ``y = self.scaled_dot_product_attention(q, k, v, mask)`` (returns
``y.transpose(1, 2)``), ``y = y.reshape(B, T, head_size * n_head)``, ``self.proj(y)``.

Expected by hand on the 2-layer formula Qwen2 (h = 64, a = 4 heads of d = 16, Llama-style
separate q / k / v in transformers, no rotary ``torch.cat`` there), t = 2 x 64 = 128 tokens:
* the flash kernel's output is allocated like q (``empty_like``), so litgpt's reshape copies
  it and ``proj`` saves the copy: c*a*d*t = 2 * 64 * 128 = 16,384 B under bf16-true; none in
  32-true (the memory-efficient kernel allocates (b, s, a, d): the reshape is a view) and none
  for transformers' Qwen2 (its q is a transposed view);
* under bf16-mixed autocast casts the input once for the fused qkv: c*h*t = 16,384 B, where
  transformers' three projections cast it three times (49,152 B).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = load_model_spec(str(MODELS_DIR / "formula" / "qwen2.json"))


def _terms(**changes: Any) -> dict[str, int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **changes)
    return layer_activation_terms(QWEN2, training)


@pytest.mark.parametrize(
    ("framework", "precision", "expected"),
    [("litgpt", "bf16-true", 16_384), ("litgpt", "32-true", 0), ("pytorch-amp", "bf16-true", 0)],
)
def test_litgpt_proj_saves_a_copy_of_the_flash_output(
    framework: str, precision: str, expected: int
) -> None:
    terms = _terms(framework=framework, precision=precision)
    assert terms.get("attention/out_proj_input", 0) == expected


@pytest.mark.parametrize(("framework", "expected"), [("litgpt", 16_384), ("pytorch-amp", 49_152)])
def test_autocast_copies_the_input_once_for_litgpt_fused_qkv(framework: str, expected: int) -> None:
    assert _terms(framework=framework, precision="bf16-mixed")["attention/qkv_input"] == expected
