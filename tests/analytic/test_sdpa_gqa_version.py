"""Grouped keys and values under transformers' SDPA path as a property of the transformers
release: before 4.54 every SDPA path expands them to all query heads (``repeat_kv``), whatever
the torch release; from 4.54 ``use_gqa_in_sdpa`` hands them to the kernel at their own heads
when torch >= 2.5 and no attention mask is passed.

Source: transformers 4.40.0 models/llama/modeling_llama.py ``LlamaSdpaAttention.forward``
(``key_states = repeat_kv(key_states, self.num_key_value_groups)``, the same for values, then
``scaled_dot_product_attention``); 4.48.1 and 4.53.0 integrations/sdpa_attention.py
``sdpa_attention_forward`` (``repeat_kv`` unconditionally); 4.54.0 the same file with
``use_gqa_in_sdpa`` (``torch >= 2.5 and attention_mask is None``) and ``enable_gqa=True``.

Mistral-7B-v0.1: a = 32 query heads, kv = 8, d = 128; bf16 (c = 2 B); t = 1024 tokens. SDPA
saves the rotated q, k and v it was given, so k and v are each c * heads * d * t:
expanded 2 * 32 * 128 * 1024 = 8,388,608 B, grouped 2 * 8 * 128 * 1024 = 2,097,152 B.
"""

from __future__ import annotations

from trainmem.analytic.attention import attention_terms, sdpa_expands_kv
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

MISTRAL = load_model_spec("mistral-7b-v0.1")
T = 1024
EXPANDED = 2 * 32 * 128 * T
GROUPED = 2 * 8 * 128 * T


def _training(**kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "precision": "bf16-true",
        "micro_batch_size": 1,
        "seq_len": T,
        "attention": "sdpa",
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def _kv(training: TrainingConfig) -> tuple[int, int]:
    terms = attention_terms(MISTRAL, training, t=T, norm=0, output_norm=0)
    q = 2 * 32 * 128 * T
    return terms["attention/q_k"] - q, terms["attention/v"]


def test_transformers_before_4_54_expands_grouped_kv_on_any_torch() -> None:
    old = _training(transformers_version="4.40.0", torch_version="2.6")
    assert sdpa_expands_kv(old)
    assert _kv(old) == (EXPANDED, EXPANDED)
    assert _kv(_training(transformers_version="4.53.0", torch_version="2.6")) == (
        EXPANDED,
        EXPANDED,
    )


def test_transformers_4_54_hands_grouped_kv_to_the_kernel_on_torch_2_5() -> None:
    new = _training(transformers_version="4.54.0", torch_version="2.6")
    assert not sdpa_expands_kv(new)
    assert _kv(new) == (GROUPED, GROUPED)
    # torch before 2.5 has no enable_gqa: expanded whatever transformers does
    assert _kv(_training(transformers_version="4.54.0", torch_version="2.4")) == (
        EXPANDED,
        EXPANDED,
    )
