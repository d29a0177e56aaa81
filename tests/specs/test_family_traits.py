"""The behaviour traits of the family table (specs/hf_table.py), read by ModelSpec's properties.

The families per trait are the ones the modeling files and the trace engine showed (each trait's
docstring in ``Family`` cites them); a trait added to ``Family`` without its families here fails.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from trainmem.specs.hf import load_model_spec
from trainmem.specs.hf_table import FAMILIES, NO_FAMILY, Family, family_row

_LLAMA_STYLE = {"llama", "mistral", "mixtral", "qwen2"}

BEHAVIOURS: dict[str, set[str]] = {
    # softmax(..., dtype=torch.float32) in eager_attention_forward
    "eager_softmax_fp32": _LLAMA_STYLE | {"gemma", "gemma2", "phi", "gpt_neox"},
    "training_kv_cache": {"gpt2", "gpt_bigcode"},
    "loss_holds_hidden": _LLAMA_STYLE
    | {"phi3", "olmo2", "starcoder2", "gpt_bigcode", "gemma3_text", "qwen2_moe", "qwen3_moe"}
    | {"gpt_neox", "phi", "qwen3", "gemma"},
    # BLOOM's baddbmm ALiBi scores, Gemma-2's _supports_sdpa = False, the course's einsum
    "eager_only": {"bloom", "gemma2", "cs336_basics"},
    "not_transformers": {"cs336_basics"},
    "eager_scores_kept": {"bloom"},
    "mlm_loss_in_model_dtype": {"bert"},
    "materialised_mask": {"falcon"},
    "rotary_cat": {"gpt_neox", "phi", "phi3"},
    "forward_kv_cache": _LLAMA_STYLE
    | {"phi3", "starcoder2", "gemma3_text", "qwen2_moe", "qwen3_moe", "gpt_neox", "phi"},
    "causal_mask_buffer": {"gpt_bigcode"},
    # torchvision's VisionTransformer: nn.MultiheadAttention, torchvision not a dependency
    "mha_out_proj_copy": {"torchvision_vit"},
    "analytic_only": {"torchvision_vit"},
}


def _traits() -> list[str]:
    return [f.name for f in fields(Family) if f.type in ("bool", bool)]


def test_every_trait_has_its_families() -> None:
    assert set(_traits()) == set(BEHAVIOURS)


@pytest.mark.parametrize("trait", sorted(BEHAVIOURS))
def test_families_per_trait(trait: str) -> None:
    assert {t for t, row in FAMILIES.items() if getattr(row, trait)} == BEHAVIOURS[trait]


def test_a_type_without_a_row_has_every_trait_off() -> None:
    assert family_row("no-such-type") is NO_FAMILY
    assert family_row(None) is NO_FAMILY
    assert not any(getattr(NO_FAMILY, trait) for trait in BEHAVIOURS)


def test_model_spec_reads_its_row() -> None:
    gpt2 = load_model_spec("gpt2")
    assert gpt2.family_row is FAMILIES["gpt2"]
    assert gpt2.training_kv_cache == gpt2.use_cache
    assert not gpt2.forward_kv_cache and not gpt2.eager_only
    # GPT-BigCode's (max_position_embeddings, max_position_embeddings) bool mask buffer
    bigcode = replace(gpt2, model_type="gpt_bigcode")
    assert bigcode.module_buffer_bytes == gpt2.max_position_embeddings**2
    assert replace(gpt2, model_type="bloom").eager_only
    assert replace(gpt2, model_type="cs336_basics").not_transformers
