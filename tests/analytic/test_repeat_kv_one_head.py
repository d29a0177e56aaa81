"""transformers' ``repeat_kv`` of one kv head is a view, of two or more a copy (Note [repeat_kv
of one kv head is a view] in trainmem/analytic/attention.py), in the formulas as on the traced
step.

Source: transformers 4.40.0 models/llama/modeling_llama.py ``repeat_kv``
(``hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)``
then ``.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)``); torch ``reshape``
returns a view where ``computeStride`` finds strides (aten/src/ATen/TensorUtils.cpp), checked
below on the installed torch.

Gemma-2B (a = 8 query heads, kv = 1, d = 256), bf16 (c = 2 B), t = 1024 tokens, transformers
4.40.0 (SDPA after ``repeat_kv``): SDPA saves k and v as given, c * kv * d * t = 2 * 1 * 256 *
1024 = 524,288 B each (views of the kv-size tensors). The same model with 2 kv heads: copies at
every query head, c * a * d * t = 2 * 8 * 256 * 1024 = 4,194,304 B each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.analytic.attention import attention_terms, kv_saved_repeated
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

GEMMA = load_model_spec("gemma-2b")
T = 1024
Q = 2 * 8 * 256 * T


def _training(**kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "precision": "bf16-true",
        "micro_batch_size": 1,
        "seq_len": T,
        "attention": "sdpa",
        "transformers_version": "4.40.0",
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def _kv(model: object, training: TrainingConfig) -> tuple[int, int]:
    terms = attention_terms(model, training, t=T, norm=0, output_norm=0)  # type: ignore[arg-type]
    return terms["attention/q_k"] - Q, terms["attention/v"]


def test_reshape_of_expanded_one_head_is_a_view() -> None:
    torch = pytest.importorskip("torch")
    for kv, viewed in ((1, True), (2, False)):
        x = torch.zeros(2, kv, 16, 4)  # (batch, kv heads, seq, head_dim)
        repeated = x[:, :, None, :, :].expand(2, kv, 4, 16, 4).reshape(2, kv * 4, 16, 4)
        assert (repeated.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) is viewed


def test_one_kv_head_saved_at_its_own_size() -> None:
    old = _training()
    assert not kv_saved_repeated(GEMMA, old)
    assert _kv(GEMMA, old) == (2 * 1 * 256 * T, 2 * 1 * 256 * T)
    # a padded batch's mask on a release with GQA in SDPA: repeat_kv again, a view again
    assert _kv(GEMMA, _training(transformers_version="4.54.0", padding_mask=True)) == (
        2 * 256 * T,
        2 * 256 * T,
    )


def test_two_kv_heads_copied() -> None:
    two = replace(GEMMA, num_kv_heads=2)
    assert kv_saved_repeated(two, _training())
    assert _kv(two, _training()) == (2 * 8 * 256 * T, 2 * 8 * 256 * T)


def test_eager_matmul_still_copies_one_kv_head() -> None:
    """Eager ``torch.matmul`` reshapes the expanded (b, a, ...) keys to (b * a, ...): merging
    the batch dim with the stride-0 head dim is no view for b > 1, a copy ``bmm`` saves."""
    torch = pytest.importorskip("torch")
    x = torch.zeros(2, 1, 16, 4)
    keys = x[:, :, None, :, :].expand(2, 1, 4, 16, 4).reshape(2, 4, 16, 4)
    batched = keys.reshape(2 * 4, 16, 4)  # matmul's fold of the batch dims
    assert batched.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert kv_saved_repeated(GEMMA, _training(attention="eager"))
