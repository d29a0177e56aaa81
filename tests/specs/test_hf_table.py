"""The family table (specs/hf_table.py) against transformers' own configuration classes.

Expected values come from transformers itself: each config class's ``attribute_map`` and the
defaults of a config built with no arguments (``configuration_<family>.py``).
"""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.specs.hf import SUPPORTED_MODEL_TYPES, load_hf_config, model_spec_from_hf
from trainmem.specs.hf_table import FAMILIES, REMOTE_CODE_TYPES

transformers = pytest.importorskip("transformers")
CONFIG_MAPPING = pytest.importorskip("transformers.models.auto.configuration_auto").CONFIG_MAPPING

#: Row defaults transformers 5 keeps elsewhere: the partial rotary factor moved into
#: ``rope_parameters``, so the config object has no such attribute.
NOT_A_CONFIG_ATTRIBUTE = {("phi", "partial_rotary_factor"), ("phi3", "partial_rotary_factor")}

TRANSFORMERS_FAMILIES = sorted(
    t
    for t, row in FAMILIES.items()
    if not (row.not_transformers or row.analytic_only) and t not in REMOTE_CODE_TYPES
)
"""Rows with a transformers configuration class (the CS336 course model has none; its fields
are its constructor's, tests/analytic/test_cs336_family.py; torchvision's ViT neither, its
defaults are the vit row's, tests/analytic/test_torchvision_vit.py; the remote-code families'
classes are on the Hub, tests/specs/test_remote_code_families.py)."""


def test_table_lists_every_supported_model_type() -> None:
    assert set(FAMILIES) == set(SUPPORTED_MODEL_TYPES)
    assert {"phi3", "olmo2", "starcoder2", "gpt_bigcode", "bloom", "gemma3_text"} <= set(FAMILIES)
    assert {"qwen2_moe", "qwen3_moe"} <= set(FAMILIES)


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_row_aliases_are_the_config_attribute_map(model_type: str) -> None:
    attribute_map = getattr(CONFIG_MAPPING[model_type], "attribute_map", {})
    for canonical, alias in FAMILIES[model_type].aliases.items():
        assert attribute_map.get(canonical) == alias, (canonical, alias, attribute_map)


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_row_defaults_are_the_configuration_defaults(model_type: str) -> None:
    row = FAMILIES[model_type]
    config = CONFIG_MAPPING[model_type]()
    for canonical, default in row.defaults.items():
        if callable(default) or default is None:
            continue
        name = row.renames.get(canonical) or row.aliases.get(canonical) or canonical
        if (model_type, name) in NOT_A_CONFIG_ATTRIBUTE:
            continue
        assert getattr(config, name) == default, (name, default)


def test_canonical_name_wins_over_the_alias_as_in_transformers() -> None:
    config = {**load_hf_config("tiny-gpt2-test"), "hidden_size": 128}  # n_embd stays 64
    expected = transformers.GPT2Config(**{k: v for k, v in config.items() if k != "model_type"})
    assert model_spec_from_hf(config, name="x").hidden_size == expected.hidden_size == 128


def test_legacy_name_is_read_after_the_canonical_one() -> None:
    # BloomConfig.__post_init__ pops ``n_embed`` (the name in BLOOM's published configs)
    config = load_hf_config("bloomz-7b1")
    legacy = {k: v for k, v in config.items() if k != "hidden_size"} | {"n_embed": 4096}
    assert model_spec_from_hf(legacy, name="x").hidden_size == 4096


def test_gemma3_layer_types_must_list_every_layer() -> None:
    config = load_hf_config("gemma-3-1b")
    spec = model_spec_from_hf(config, name="x")
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    sliding = sum(kind == "sliding_attention" for kind in hf.layer_types)
    assert (spec.num_sliding_layers, spec.sliding_window) == (sliding, hf.sliding_window)
    assert sliding == 22  # sliding_window_pattern 6: every 6th of the 26 layers is global
    # the pattern itself, layer by layer, as the config class lists it
    assert spec.sliding_layers == tuple(kind == "sliding_attention" for kind in hf.layer_types)
    with pytest.raises(SpecError, match="layer_types"):
        model_spec_from_hf({**config, "layer_types": ["full_attention"]}, name="x")
