"""diffusers presets: the parameter count recorded in presets/index.json equals the numel of the
model diffusers builds from the shipped config on the meta device, and the published size.

Published sizes: FLUX.1-dev 12B (black-forest-labs' model card; 11.9B transformer), SD3 Medium 2B
(Stability AI's model card), SDXL base UNet 2.6B (Podell et al. 2023, "SDXL", Table 1: 2.6B UNet
parameters), Wan2.1-T2V-1.3B (the name; the model card's "1.3B" rounds 1.42B down, so the
tolerance there is 10%).
"""

from __future__ import annotations

import json

import pytest

from conftest import Invoke
from trainmem.specs.diffusers import is_diffusers_config
from trainmem.specs.hf import list_presets, load_hf_config, preset_index

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PUBLISHED = {  # preset: (published parameters, relative tolerance)
    "flux.1-dev-transformer": (11.9e9, 0.005),
    "sd3-medium-transformer": (2.0e9, 0.02),
    "sdxl-base-1.0-unet": (2.6e9, 0.02),
    "wan2.1-t2v-1.3b-transformer": (1.3e9, 0.10),
}
DIFFUSERS_PRESETS = [p for p in list_presets() if is_diffusers_config(load_hf_config(p))]


def meta_numel(config: dict) -> int:
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_every_diffusers_preset_has_a_published_size() -> None:
    assert set(DIFFUSERS_PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("preset", DIFFUSERS_PRESETS)
def test_recorded_count_equals_diffusers_meta_model(preset: str) -> None:
    recorded = preset_index()[preset]["num_parameters"]
    assert recorded == meta_numel(load_hf_config(preset))
    published, tolerance = PUBLISHED[preset]
    assert abs(recorded - published) <= tolerance * published, (recorded, published)


def test_models_command_shows_family_count_and_path(invoke: Invoke) -> None:

    r = invoke("models", "--json")
    rows = {row["preset"]: row for row in json.loads(r.stdout)}
    flux = rows["flux.1-dev-transformer"]
    assert (flux["family"], flux["path"]) == ("FluxTransformer2DModel", "generic")
    assert flux["num_parameters"] == meta_numel(load_hf_config("flux.1-dev-transformer"))
    assert (rows["gpt2"]["family"], rows["gpt2"]["path"]) == ("gpt2", "analytic")
    assert rows["gpt2"]["num_parameters"] == 124_439_808  # tests/analytic/test_params.py
