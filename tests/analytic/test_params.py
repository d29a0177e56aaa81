"""Parameter counts equal the numel of the same transformers model built on the meta device.

The expected value is an independent execution: transformers builds the class named in each
preset's ``architectures`` (or ``AutoModel`` for a bare trunk) and we sum ``p.numel()``.
"""

from __future__ import annotations

import pytest

from trainmem.analytic.params import num_parameters
from trainmem.specs.hf import SUPPORTED_MODEL_TYPES, list_presets, load_hf_config, load_model_spec
from trainmem.specs.hf_table import family_row

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def meta_numel(config_dict: dict) -> int:
    cfg = dict(config_dict)
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0]) if archs else transformers.AutoModel
    with torch.device("meta"):
        model = cls._from_config(config) if archs else transformers.AutoModel.from_config(config)
    return sum(p.numel() for p in model.parameters())


FORMULA_PRESETS = [
    p
    for p in list_presets()
    if load_hf_config(p).get("model_type") in SUPPORTED_MODEL_TYPES
    and not family_row(load_hf_config(p).get("model_type")).not_transformers
]  # the others: diffusers models in tests/specs/test_diffusers_presets.py, the CS336 course
# model (not a transformers model) in tests/analytic/test_cs336_family.py


@pytest.mark.parametrize("preset", FORMULA_PRESETS)
def test_parameter_count_equals_transformers_meta_model(preset: str) -> None:
    assert num_parameters(load_model_spec(preset)) == meta_numel(load_hf_config(preset))


def test_gpt2_small_is_124m() -> None:
    # Published: GPT-2 small has 124,439,808 parameters (wte 50257*768 + wpe 1024*768 + 12
    # layers of 7,087,872 + ln_f 1536); hand sum below.
    layer = 2 * 2 * 768 + (768 * 2304 + 2304) + (768 * 768 + 768) + 2 * (768 * 3072) + 3072 + 768
    expected = 50257 * 768 + 1024 * 768 + 12 * layer + 2 * 768
    assert expected == 124_439_808
    assert num_parameters(load_model_spec("gpt2")) == expected


def test_llama_2_7b_is_6_74b() -> None:
    # Llama-2-7B: 6,738,415,616 parameters (Touvron et al. 2023 report "7B"; HF model card count).
    assert num_parameters(load_model_spec("llama-2-7b")) == 6_738_415_616
