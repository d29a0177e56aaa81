"""The diffusers batch settings (no torch): defaults per model class as the diffusers pipelines
set them, explicit settings win, bad values are refused naming the field."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.diffusers import check_image_options, image_batch
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig


def test_defaults_of_the_pipelines() -> None:
    # FluxPipeline: 1024 px (default_sample_size 128 x vae_scale_factor 8), 512 T5 tokens
    flux = image_batch(load_hf_config("flux.1-dev-transformer"), TrainingConfig())
    assert (flux.height, flux.width, flux.text_seq_len, flux.latent_height) == (
        1024,
        1024,
        512,
        128,
    )
    # SD3: sample_size 128 x 8 = 1024 px; 77 CLIP + 256 T5 tokens
    sd3 = image_batch(load_hf_config("sd3-medium-transformer"), TrainingConfig())
    assert (sd3.height, sd3.text_seq_len) == (1024, 333)
    # SDXL: sample_size 128 x 8 = 1024 px; 77 CLIP tokens
    sdxl = image_batch(load_hf_config("sdxl-base-1.0-unet"), TrainingConfig())
    assert (sdxl.height, sdxl.text_seq_len, sdxl.frames) == (1024, 77, 0)
    # WanPipeline: 480 x 832, 81 frames -> (81 - 1) / 4 + 1 = 21 latent frames of 60 x 104
    wan = image_batch(load_hf_config("wan2.1-t2v-1.3b-transformer"), TrainingConfig())
    assert (wan.frames, wan.latent_frames, wan.latent_height, wan.latent_width) == (81, 21, 60, 104)


def test_explicit_settings_win() -> None:
    training = TrainingConfig(resolution="720x1280", frames=49, text_seq_len=226)
    wan = image_batch(load_hf_config("wan2.1-t2v-1.3b-transformer"), training)
    assert (wan.height, wan.width, wan.latent_frames, wan.text_seq_len) == (720, 1280, 13, 226)


@pytest.mark.parametrize(("text", "value", "size"), [
    ("1024", 1024, (1024, 1024)), ("480x832", "480x832", (480, 832)), ("512X512", 512, (512, 512)),
])  # fmt: skip
def test_resolution_spellings(text: str, value: object, size: tuple[int, int]) -> None:
    training = TrainingConfig(resolution=text)
    assert (training.resolution, training.image_size) == (value, size)


@pytest.mark.parametrize("bad", ["abc", "0", "480x", "x832", "480x0", -3, 0, True, 1.5])
def test_bad_resolution_names_the_field(bad: object) -> None:
    with pytest.raises(SpecError, match="resolution"):
        TrainingConfig(resolution=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("preset", "settings", "field"),
    [
        ("flux.1-dev-transformer", dict(resolution=1000), "resolution"),  # not a multiple of 16
        ("flux.1-dev-transformer", dict(frames=9), "frames"),  # an image model
        ("wan2.1-t2v-1.3b-transformer", dict(frames=80), "frames"),  # not 1 + 4k
        ("gpt2", dict(resolution=512), "resolution"),  # a language model
        ("gpt2", dict(frames=9), "frames"),
        ("llama-3.2-1b", dict(text_seq_len=77), "text_seq_len"),
    ],
)
def test_settings_refused_for_the_model(preset: str, settings: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        check_image_options(load_hf_config(preset), TrainingConfig(**settings))
    assert info.value.field == field


def test_unknown_diffusers_class_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedError, match="FluxTransformer2DModel"):
        image_batch({"_class_name": "AutoencoderKL"}, TrainingConfig())
