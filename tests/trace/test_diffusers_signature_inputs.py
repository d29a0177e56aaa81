"""Classes beyond the four hand-written batches get theirs from the forward signature
(trainmem/trace/diffusers_inputs.py): a video DiT (CogVideoX), a pixel-space UNet (DDPM's
UNet2DModel) and a PixArt DiT, tiny configs in tests/models/diffusers/. The parameter count is
the one diffusers builds from the same config; the expected shapes are derived by hand from
each class's forward docstring and pipeline (comments), not read from the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.specs.hf import load_hf_config  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.trace.diffusers_inputs import forward_inputs  # noqa: E402
from trainmem.trace.diffusers_model import build_diffusers_model  # noqa: E402
from trainmem.trace.known_values import value_of  # noqa: E402


def config_path(models_dir: Path, name: str) -> str:
    return str(models_dir / "diffusers" / f"{name}.json")


def meta_numel(path: str) -> int:
    config = json.loads(Path(path).read_text())
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    return sum(p.numel() for p in model.parameters())


def shapes(path: str, **settings: Any) -> dict[str, Any]:
    training = TrainingConfig(micro_batch_size=2, **settings)
    model = build_diffusers_model(load_hf_config(path), training)
    with FakeTensorMode():
        batch = forward_inputs(model, training)
    return {
        k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


CASES = [
    ("tiny-cogvideox", ("--resolution", "64", "--frames", "9", "--text-seq-len", "16")),
    ("tiny-ddpm-unet", ()),
    ("tiny-pixart", ("--text-seq-len", "12")),
]


@pytest.mark.parametrize(("name", "options"), CASES)
def test_estimates_with_the_parameters_diffusers_builds(
    invoke: Invoke, models_dir: Path, name: str, options: tuple[str, ...]
) -> None:
    path = config_path(models_dir, name)
    r = invoke("estimate", path, "--engine", "trace", "-b", "2", *options, "--json")
    d = json.loads(r.stdout)
    assert d["num_parameters"] == d["num_trainable_parameters"] == meta_numel(path)
    assert d["peak"]["allocated_bytes"] > 0


def test_video_dit_takes_frames_first_latents(models_dir: Path) -> None:
    # CogVideoXTransformer3DModel.forward: hidden_states (batch, num_frames, channels, height,
    # width); pipeline_cogvideox.py: 8x spatial VAE, (frames - 1) // 4 + 1 latent frames; the
    # T5 states [batch, tokens, text_embed_dim]
    got = shapes(config_path(models_dir, "tiny-cogvideox"), resolution=64, frames=9,
                 text_seq_len=16)  # fmt: skip
    f32 = torch.float32
    assert got == {
        "hidden_states": ((2, 3, 4, 8, 8), f32),  # 9 frames -> 3, 64 px -> 8, 4 channels
        "encoder_hidden_states": ((2, 16, 48), f32),
        "timestep": ((2,), f32),
        "return_dict": False,
    }


def test_pixel_space_unet_takes_resolution_as_pixels(models_dir: Path) -> None:
    # UNet2DModel.forward: sample (batch, channel, height, width), timestep; DDPM denoises the
    # 3-channel image itself (no VAE): the default is sample_size = 32 px, --resolution 48 is
    # 48 pixels (not 48 / 8); train_unconditional.py draws int64 timesteps
    path = config_path(models_dir, "tiny-ddpm-unet")
    i64 = torch.int64
    assert shapes(path) == {
        "sample": ((2, 3, 32, 32), torch.float32),
        "timestep": ((2,), i64),
        "return_dict": False,
    }
    assert shapes(path, resolution=48)["sample"] == ((2, 3, 48, 48), torch.float32)


def test_pixart_reads_the_caption_width_not_the_attention_width(models_dir: Path) -> None:
    # PixArtTransformer2DModel.forward: hidden_states (batch, channel, height, width),
    # encoder_hidden_states (batch, tokens, caption_channels) before caption_projection maps
    # them to cross_attention_dim; added_cond_kwargs resolution / aspect_ratio only for the
    # 1024 px model (sample_size 128), None here (sample_size 8 latents = 64 px)
    got = shapes(config_path(models_dir, "tiny-pixart"), text_seq_len=12)
    f32 = torch.float32
    assert got == {
        "hidden_states": ((2, 4, 8, 8), f32),
        "encoder_hidden_states": ((2, 12, 48), f32),
        "timestep": ((2,), f32),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }


class _NoRule(torch.nn.Module):
    """A stand-in denoiser whose forward needs an argument no rule sizes."""

    config = {"_class_name": "ToyTransformer2DModel", "in_channels": 4, "sample_size": 8}

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states: Any, style_code: Any, return_dict: bool = True) -> Any:
        return hidden_states


def test_a_required_argument_without_a_rule_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match="ToyTransformer2DModel.forward needs 'style_code'"):
        forward_inputs(_NoRule(), TrainingConfig())


def test_qwenimage21_image_slots_follow_the_prompt_with_known_values(models_dir: Path) -> None:
    # pipeline_qwenimage21.py, text to image: the prompt's img_mask marks no image slot, then
    # append_target_slots adds one True per 2x2 group of packed latent tokens. 64 px / 8 = an
    # 8 x 8 latent, packed 2x2 into 16 tokens of 4 slots; 8 prompt tokens
    training = TrainingConfig(micro_batch_size=2, resolution=64, text_seq_len=8)
    path = config_path(models_dir, "tiny-qwenimage21")
    model = build_diffusers_model(load_hf_config(path), training)
    with FakeTensorMode():
        batch = forward_inputs(model, training)
    assert tuple(batch["hidden_states"].shape) == (2, 16, 16)
    assert batch["img_shapes"] == [[(1, 4, 4)], [(1, 4, 4)]]
    assert value_of(batch["img_mask"]).tolist() == [[False] * 8 + [True] * 4] * 2


@pytest.mark.parametrize(
    "name", ["tiny-qwenimage21", pytest.param("tiny-lumina2", marks=pytest.mark.slow)]
)
def test_forwards_that_read_their_masks_estimate_on_the_generic_path(
    invoke: Invoke, models_dir: Path, name: str
) -> None:
    # QwenImage 2.1 places its latent tokens by img_mask (repeat_interleave, boolean index_put,
    # nonzero, int(sum)); Lumina2 reads each caption's length (mask.sum(1).tolist())
    path = config_path(models_dir, name)
    r = invoke("estimate", path, "--engine", "generic", "-b", "2", "--resolution", "64",
               "--text-seq-len", "8", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    assert d["num_parameters"] == d["num_trainable_parameters"] == meta_numel(path)
    assert d["peak"]["allocated_bytes"] > 0


@pytest.mark.slow
def test_cogvideox_default_text_length_runs_on_the_generic_path(models_dir: Path) -> None:
    # without --text-seq-len the batch takes the config's max_text_seq_length (16), the rows of
    # its joint position table; 226 (the pipelines' T5 length) failed to broadcast
    from trainmem.estimate import estimate

    training = TrainingConfig(micro_batch_size=1, resolution="64", frames=9)
    est = estimate(config_path(models_dir, "tiny-cogvideox"), training, engine="generic")
    assert est.engine == "generic"
    assert "16 text tokens" in " ".join(est.notes)
