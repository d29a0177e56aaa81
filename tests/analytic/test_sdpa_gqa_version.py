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

One kv head (Note [repeat_kv of one kv head is a view] in trainmem/analytic/attention.py):
``repeat_kv`` is ``hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep,
slen, head_dim).reshape(batch, num_key_value_heads * n_rep, slen, head_dim)``, and torch
``reshape`` returns a view where ``computeStride`` finds strides (aten/src/ATen/TensorUtils.cpp;
checked below on the installed torch): with one kv head a view, with two a copy. Gemma-2B (a =
8, kv = 1, d = 256), bf16, t = 1024, transformers 4.40.0: SDPA saves k and v at kv size, 2 * 1 *
256 * 1024 = 524,288 B each; the same model with 2 kv heads: copies, 2 * 8 * 256 * 1024 =
4,194,304 B each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.analytic.attention import attention_terms, kv_saved_repeated, sdpa_expands_kv
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

MISTRAL = load_model_spec("mistral-7b-v0.1")
GEMMA = load_model_spec("gemma-2b")
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


def _kv(training: TrainingConfig, model: ModelSpec = MISTRAL) -> tuple[int, int]:
    terms = attention_terms(model, training, t=T, norm=0, output_norm=0)
    q = 2 * model.num_heads * model.head_dim * T
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


def test_reshape_of_expanded_one_head_is_a_view() -> None:
    torch = pytest.importorskip("torch")
    for kv, viewed in ((1, True), (2, False)):
        x = torch.zeros(2, kv, 16, 4)  # (batch, kv heads, seq, head_dim)
        repeated = x[:, :, None, :, :].expand(2, kv, 4, 16, 4).reshape(2, kv * 4, 16, 4)
        assert (repeated.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) is viewed


def test_one_kv_head_saved_at_its_own_size() -> None:
    old = _training(transformers_version="4.40.0")
    assert not kv_saved_repeated(GEMMA, old)
    assert _kv(old, GEMMA) == (2 * 1 * 256 * T, 2 * 1 * 256 * T)
    # a padded batch's mask on a release with GQA in SDPA: repeat_kv again, a view again
    masked = _training(transformers_version="4.54.0", torch_version="2.6", padding_mask=True)
    assert _kv(masked, GEMMA) == (2 * 1 * 256 * T, 2 * 1 * 256 * T)


def test_two_kv_heads_copied() -> None:
    two = replace(GEMMA, num_kv_heads=2)
    old = _training(transformers_version="4.40.0")
    assert kv_saved_repeated(two, old)
    assert _kv(old, two) == (2 * 8 * 256 * T, 2 * 8 * 256 * T)


def test_eager_matmul_still_copies_one_kv_head() -> None:
    """Eager ``torch.matmul`` folds the expanded (b, a, ...) keys to (b * a, ...): merging the
    batch dim with the stride-0 head dim is no view for b > 1, a copy ``bmm`` saves."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(2, 1, 16, 4)
    keys = x[:, :, None, :, :].expand(2, 1, 4, 16, 4).reshape(2, 4, 16, 4)
    batched = keys.reshape(2 * 4, 16, 4)  # matmul's fold of the batch dims
    assert batched.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert kv_saved_repeated(GEMMA, _training(attention="eager", transformers_version="4.40.0"))
