"""The coverage benchmark's cut of a default config to a few layers (benchmarks/coverage.py
``shrink``, issue 26): a hybrid keeps one layer of each kind, the same layers in every
per-layer list, and the fields that point at layers follow them. Each expected config is
worked out by hand from the layers kept."""

from __future__ import annotations

import importlib.util
from typing import Any

from conftest import REPO_DIR

_spec = importlib.util.spec_from_file_location(
    "coverage_bench", REPO_DIR / "benchmarks/coverage.py"
)
assert _spec is not None and _spec.loader is not None
coverage_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_bench)
shrink = coverage_bench.shrink


def test_a_hybrid_keeps_its_first_attention_layer() -> None:
    config: dict[str, Any] = {
        "num_hidden_layers": 8,
        "layer_types": ["mamba"] * 4 + ["attention"] + ["mamba"] * 3,
    }
    assert shrink(config) == {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"]}


def test_every_per_layer_list_keeps_the_same_layers_and_index_lists_follow() -> None:
    config: dict[str, Any] = {
        "num_hidden_layers": 6,
        "layer_types": ["full", "full", "shared", "full", "full", "shared"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
        "moe_layers": [1, 2, 3, 4, 5],
    }
    # kept: layer 0 (full, dense), 1 (the first sparse), 2 (the first shared)
    assert shrink(config) == {
        "num_hidden_layers": 3,
        "layer_types": ["full", "full", "shared"],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "moe_layers": [1, 2],
    }


def test_a_period_and_offset_put_their_layer_inside_the_cut() -> None:
    config = {"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4}
    # layer i is attention when i % period == offset: layer 1 of 2
    assert shrink(config) == {
        "num_hidden_layers": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
    }


def test_a_repeating_pattern_keeps_the_leading_layers_up_to_its_last_new_kind() -> None:
    config = {"num_hidden_layers": 26, "block_types": ["recurrent", "recurrent", "attention"]}
    assert shrink(config) == {
        "num_hidden_layers": 3,
        "block_types": ["recurrent", "recurrent", "attention"],
    }


def test_backbone_stages_and_per_layer_entries_follow_the_kept_layers() -> None:
    config: dict[str, Any] = {
        "num_hidden_layers": 12,
        "layer_types": ["sliding"] * 5 + ["full"] + ["sliding"] * 6,
        "out_features": ["stage12"],  # stage N is layer N - 1; the stem is stage 0
        "out_indices": [0, 12],
        "backbone_out_indices": [2, 5, 8, 11],
        "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}},
    }
    # kept: layers 0 and 5; every later layer maps to the last kept layer before it (5 -> 1)
    assert shrink(config) == {
        "num_hidden_layers": 2,
        "layer_types": ["sliding", "full"],
        "out_features": ["stage2"],
        "out_indices": [0, 2],
        "backbone_out_indices": [0, 1, 1, 1],
        "per_layer_config": {"01": {"head_dim": 512}},
    }


def _rotary_split(model_type: str, fix: dict[str, Any]) -> tuple[int, int]:
    """(frequencies the text rotary embedding makes, frequencies its mrope_section splits) for
    transformers' default config of ``model_type`` with ``fix``'s fields, by hand from
    modeling_glm4v.py ``compute_default_rope_parameters`` (``arange(0, dim, 2)`` over
    ``dim = int(head_dim * partial_rotary_factor)``) and ``recomposition_frequencies``."""
    import transformers

    raw = coverage_bench._merged(transformers.AutoConfig.for_model(model_type).to_dict(), fix)
    text = raw["text_config"]
    rope = text.get("rope_parameters") or {}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return (dim + 1) // 2, sum(rope.get("mrope_section", [8, 12, 12]))


def test_the_glm4v_fixes_give_the_rotary_embedding_the_frequencies_its_sections_split() -> None:
    """The default GLM-4V text configs make 64 (GLM-4.1V, 4.6V: 128 dims) or 11 (GLM-4.5V:
    4096 // 96 = 42 wide heads, half rotated) frequencies for an mrope_section of 32, which
    transformers' own forward cannot split; the released layout (head_dim 128, half rotated)
    makes 32."""
    fixes = coverage_bench.CONFIG_FIXES
    assert {"glm4v", "glm46v", "glm4v_moe"} <= set(fixes)
    assert _rotary_split("glm4v", {}) == (64, 32)
    assert _rotary_split("glm4v_moe", {}) == (11, 32)
    for model_type in ("glm4v", "glm46v", "glm4v_moe"):
        assert _rotary_split(model_type, fixes[model_type]) == (32, 32)
