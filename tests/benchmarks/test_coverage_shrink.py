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


def test_feature_maps_a_neck_reads_stay_distinct() -> None:
    # DPT: modeling_dpt.py keeps hidden state idx `if idx in config.backbone_out_indices`, so
    # the 2-layer cut's [0, 1, 1, 1] gave 2 maps for 4 neck sizes ("The number of hidden states
    # should be equal to the number of neck hidden sizes"): the 4 named layers are kept
    dpt: dict[str, Any] = {
        "num_hidden_layers": 12,
        "backbone_out_indices": [2, 5, 8, 11],
        "neck_hidden_sizes": [96, 192, 384, 768],
    }
    assert shrink(dpt) == {
        "num_hidden_layers": 4,
        "backbone_out_indices": [0, 1, 2, 3],
        "neck_hidden_sizes": [96, 192, 384, 768],
    }
    # a backbone's out_features (TIPSv2-DPT's DINOv2-style backbone_config): the cut's
    # ['stage2'] * 4 was refused by transformers ("out_features must not contain any
    # duplicates"); stage N is layer N - 1, out_indices are stage numbers
    tips: dict[str, Any] = {
        "backbone_config": {
            "num_hidden_layers": 12,
            "out_features": ["stage3", "stage6", "stage9", "stage12"],
            "out_indices": [3, 6, 9, 12],
        }
    }
    assert shrink(tips) == {
        "backbone_config": {
            "num_hidden_layers": 4,
            "out_features": ["stage1", "stage2", "stage3", "stage4"],
            "out_indices": [1, 2, 3, 4],
        }
    }


def test_a_layer_count_under_another_name_is_cut_with_it() -> None:
    # xLSTM: configuration_xlstm.py sets num_blocks = num_hidden_layers (32) and modeling_xlstm.py
    # builds config.num_blocks blocks, its cache num_hidden_layers states: the cut of one
    # left 32 blocks reading 2 states (KeyError: 2). A num_blocks that is no layer count
    # (Perceiver's 1 cross-attention block) is left alone.
    assert shrink({"num_hidden_layers": 32, "num_blocks": 32}) == {
        "num_hidden_layers": 2,
        "num_blocks": 2,
    }
    assert shrink({"num_hidden_layers": 32, "num_blocks": 1}) == {
        "num_hidden_layers": 2,
        "num_blocks": 1,
    }


def test_a_count_of_cache_slots_stays_a_multiple_of_the_layers_kept() -> None:
    # HRM (configuration_hrm_text.py __post_init__): 16 blocks per stack run H_cycles * (L_cycles
    # + 1) = 2 * 4 times, one cache slot each, num_hidden_layers = 16 * 8 = 128. The cut of the
    # slots alone left 16 blocks indexing a 2-slot cache; 2 blocks take 2 * 8 = 16 slots.
    config = {"num_hidden_layers": 128, "num_layers_per_stack": 16, "H_cycles": 2, "L_cycles": 3}
    assert shrink(config) == {
        "num_hidden_layers": 16,
        "num_layers_per_stack": 2,
        "H_cycles": 2,
        "L_cycles": 3,
    }
