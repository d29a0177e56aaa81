"""A diffusers config or batch option out of range is one line, not a hang or a silent
estimate (issue 29, item 3). No torch needed: the checks run before diffusers builds anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.diffusers import MAX_DIFFUSERS_BLOCKS, check_diffusers_config
from trainmem.specs.hf import load_hf_config

CONFIGS = Path(__file__).parents[1] / "trace" / "diffusers_configs"
PRESETS = [
    "flux.1-dev-transformer",
    "sd3-medium-transformer",
    "sdxl-base-1.0-unet",
    "wan2.1-t2v-1.3b-transformer",
]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_shipped_diffusers_configs_pass(preset: str) -> None:
    check_diffusers_config(load_hf_config(preset))


@pytest.mark.parametrize(
    ("file", "key", "value"),
    [
        ("tiny-flux.json", "num_layers", -2),  # was accepted
        ("tiny-flux.json", "num_layers", 10_000_000),  # hung at 1.6 GB
        ("tiny-flux.json", "num_single_layers", MAX_DIFFUSERS_BLOCKS + 1),
        ("tiny-flux.json", "attention_head_dim", -16),
        ("tiny-flux.json", "in_channels", 2**40),
        ("tiny-sdxl-unet.json", "transformer_layers_per_block", [1, -1]),
    ],
)
def test_out_of_range_config_fields_are_one_line(
    invoke: Invoke, file: str, key: str, value: Any, tmp_path: Path
) -> None:
    config = json.loads((CONFIGS / file).read_text())
    config[key] = value
    with pytest.raises(SpecError) as info:
        check_diffusers_config(config)
    assert info.value.field == key and "allowed: 0.." in str(info.value)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = invoke("estimate", str(path), exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith(f"error: {key}: "), err


@pytest.mark.parametrize(
    "option",
    [
        ["--frames", "nan"],
        ["--frames", "inf"],
        ["--text-seq-len", "1e400"],
        ["--resolution", "nan"],
        ["--resolution", "inf"],
        ["--resolution", "1e400"],
        ["--set", "frames=nan"],
    ],
)
def test_non_numbers_for_the_batch_options_are_one_line(invoke: Invoke, option: list[str]) -> None:
    """Already one line on HEAD when issue 29 was filed (TrainingConfig's int checks)."""
    args = ["estimate", str(CONFIGS / "tiny-wan.json"), *option]
    if option[0] == "--set":
        args = ["compare", str(CONFIGS / "tiny-wan.json"), *option]
    result = invoke(*args, exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("error: "), err


def test_minus_one_passes_only_where_diffusers_reads_it_as_from_the_input() -> None:
    # transformer_wan_animate_2.py: refer_offset_w defaults to -1 ("resolve from the reference
    # grid"); -2 means nothing there, and -1 is no layer count
    config = {"_class_name": "WanAnimate2Transformer3DModel", "refer_offset_w": -1}
    check_diffusers_config(config)
    with pytest.raises(SpecError, match="allowed: -1.."):
        check_diffusers_config({**config, "refer_offset_w": -2})
    with pytest.raises(SpecError, match="allowed: 0.."):
        check_diffusers_config({**config, "num_layers": -1})
