"""``--controlnet`` on FLUX and SD3 transformers (issue 26; Note [FLUX and SD3 ControlNet
training steps] in ``trace/controlnet.py``): the ControlNet diffusers v0.40's
``train_controlnet_flux.py`` / ``train_controlnet_sd3.py`` make with ``from_transformer`` (FLUX
4 double- and 4 single-stream blocks, SD3 12 blocks: the scripts' defaults) trained in fp32
beside the frozen transformer in the compute dtype.

Independent expectations: parameter counts from diffusers' own classes built on ``meta`` from
the configs; which ControlNet weights get a gradient (so hold AdamW states) from a real CPU
step of the same diffusers modules, called as the scripts call them (a ControlNet deeper than
the toy transformer feeds it only some of its residuals, and the last SD3 block's context
output is unused); bytes by hand from the scripts' dtypes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from conftest import step_made_at_peak, storage_peak
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs import diffusers as spec
from trainmem.specs.training import TrainingConfig

CONFIGS = Path(__file__).parent / "diffusers_configs"
FLUX = str(CONFIGS / "tiny-flux.json")
SD3 = str(CONFIGS / "tiny-sd3.json")
TRAINING = TrainingConfig(precision="bf16-mixed", resolution=64, text_seq_len=16, controlnet=True)


def _models(path: str, device: str, flux_blocks: tuple[int, int] = (4, 4)) -> tuple[Any, Any]:
    """(transformer, ControlNet) as the scripts make them, diffusers' classes on ``device``;
    ``flux_blocks``: ``--num_double_layers`` / ``--num_single_layers`` (their defaults)."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    with torch.device(device):
        if "flux" in path:
            cfg = diffusers.FluxTransformer2DModel.load_config(path)
            transformer = diffusers.FluxTransformer2DModel.from_config(cfg)
            controlnet = diffusers.FluxControlNetModel.from_transformer(
                transformer,
                attention_head_dim=transformer.config["attention_head_dim"],
                num_attention_heads=transformer.config["num_attention_heads"],
                num_layers=flux_blocks[0],
                num_single_layers=flux_blocks[1],
                load_weights_from_transformer=False,  # (the toy SD3's blocks differ in shape)
            )
        else:
            cfg = diffusers.SD3Transformer2DModel.load_config(path)
            transformer = diffusers.SD3Transformer2DModel.from_config(cfg)
            controlnet = diffusers.SD3ControlNetModel.from_transformer(
                transformer, num_extra_conditioning_channels=0, load_weights_from_transformer=False
            )
    return transformer, controlnet


def _trained_elements(path: str) -> int:
    """Elements of the ControlNet weights with a gradient after one real fp32 CPU step, the
    script's two calls on a 64 px batch of 16 prompt tokens (64 / 8 = 8 x 8 latents)."""
    import torch

    torch.manual_seed(0)
    transformer, controlnet = _models(path, "cpu")
    transformer.requires_grad_(False)
    cfg = transformer.config
    if "flux" in path:
        tokens = 16  # 8 x 8 latents packed 2 x 2
        inputs: dict[str, Any] = {
            "hidden_states": torch.randn(1, tokens, cfg.in_channels),
            "encoder_hidden_states": torch.randn(1, 16, cfg.joint_attention_dim),
            "pooled_projections": torch.randn(1, cfg.pooled_projection_dim),
            "timestep": torch.rand(1),
            "guidance": torch.full((1,), 3.5),
            "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(16, 3),
        }
        block, single = controlnet(
            controlnet_cond=torch.randn_like(inputs["hidden_states"]), return_dict=False, **inputs
        )
        pred = transformer(
            **inputs,
            controlnet_block_samples=block,
            controlnet_single_block_samples=single,
            return_dict=False,
        )[0]
    else:
        inputs = {
            "hidden_states": torch.randn(1, cfg.in_channels, 8, 8),
            "encoder_hidden_states": torch.randn(1, 16, cfg.joint_attention_dim),
            "pooled_projections": torch.randn(1, cfg.pooled_projection_dim),
            "timestep": torch.rand(1) * 1000,
        }
        samples = controlnet(
            controlnet_cond=torch.randn_like(inputs["hidden_states"]), return_dict=False, **inputs
        )[0]
        pred = transformer(**inputs, block_controlnet_hidden_states=samples, return_dict=False)[0]
    pred.float().square().mean().backward()
    return sum(p.numel() for p in controlnet.parameters() if p.grad is not None)


def _counts(path: str) -> tuple[int, int]:
    """(transformer, ControlNet) parameter counts, diffusers' classes on meta."""
    transformer, controlnet = _models(path, "meta")
    return (
        sum(p.numel() for p in transformer.parameters()),
        sum(p.numel() for p in controlnet.parameters()),
    )


def test_a_transformer_controlnet_is_refused_with_lora() -> None:
    with pytest.raises(SpecError, match="controlnet: train_controlnet.py trains the whole"):
        estimate(FLUX, dataclasses.replace(TRAINING, lora_rank=4), engine="generic")


@pytest.mark.parametrize("path", [FLUX, SD3])
def test_step_holds_the_frozen_16bit_transformer_and_the_fp32_controlnet(path: str) -> None:
    pytest.importorskip("diffusers")
    import torch

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.controlnet import build_controlnet_step
    from trainmem.trace.diffusers_model import build_diffusers_model

    raw = load_hf_config(path)
    step = build_controlnet_step(raw, build_diffusers_model(raw, TRAINING), TRAINING)
    n_transformer, n_cn = _counts(path)
    frozen = list(step.transformer.parameters())
    assert sum(p.numel() for p in frozen) == n_transformer
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in frozen)
    trained = [p for p in step.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == n_cn
    assert all(p.dtype == torch.float32 for p in trained)
    # the transformer's config is left as built (SD3's from_transformer writes num_layers)
    assert step.transformer.config["num_layers"] == raw["num_layers"]


@pytest.mark.slow  # ~10-40 s each on a loaded machine: the transformer and its ControlNet traced
@pytest.mark.parametrize("engine", ["generic", "trace"])
@pytest.mark.parametrize("path", [FLUX, SD3])
def test_controlnet_step_bytes(path: str, engine: str) -> None:
    n_transformer, n_cn = _counts(path)
    est = estimate(path, TRAINING, engine=engine, simulate_allocator=False)
    b = est.breakdown
    assert est.num_parameters == n_transformer + n_cn
    assert est.num_trainable_parameters == n_cn
    # the bf16 transformer (weight_dtype) and the fp32 ControlNet, and the buffers: the bf16
    # sin-cos position tables of SD3's patch embeddings (the transformer's, the ControlNet's
    # and its conditioning input's: pos_embed_max_size^2 x inner dim x 2 B each)
    tables = 3 * 32**2 * 32 * 2 if path == SD3 else 0
    assert b.parameters == 2 * n_transformer + 4 * n_cn + tables
    # AdamW's two fp32 moments of the ControlNet weights that got a gradient
    assert b.optimizer_states == 8 * _trained_elements(path)
    assert est.details["diffusers"]["controlnet"] is True


TINY_VAE_16: dict[str, Any] = {
    **spec.SD_VAE,
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "latent_channels": 16,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": False,
}
"""FLUX's VAE layout (16 latent channels, no quant convs) at a toy width, no mid-block
attention (so no attention kernel differs between the CPU run and the emulated CUDA one)."""


def _real_two_encodes_peak() -> int:
    """Peak bytes made by the script's two encodes of a [2, 3, 64, 64] bf16 batch (the pixels,
    then the conditioning image, the first latents bound), a real CPU run."""
    import torch

    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**TINY_VAE_16).to(torch.bfloat16).requires_grad_(False)
    kept: list[Any] = []

    def step() -> None:
        with torch.no_grad():
            for _ in range(2):
                pixels = torch.randn(2, 3, 64, 64, dtype=torch.bfloat16)
                kept.append(vae.encode(pixels).latent_dist.sample())

    return int(storage_peak(step))


@pytest.mark.slow  # ~40 s: the toy FLUX and its ControlNet traced twice
def test_a_flux_controlnet_step_encodes_pixels_and_conditioning_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("diffusers")
    rows = tuple(
        dataclasses.replace(c, build=("AutoencoderKL", TINY_VAE_16)) if c.kind == "vae" else c
        for c in spec.FROZEN_COMPONENTS["FluxTransformer2DModel"]
    )
    monkeypatch.setitem(spec.FROZEN_COMPONENTS, "FluxTransformer2DModel", rows)
    training = dataclasses.replace(
        TRAINING, micro_batch_size=2, frozen_on_gpu="vae", activation_checkpointing="full"
    )
    est = estimate(FLUX, training, engine="generic", simulate_allocator=False)
    expected = _real_two_encodes_peak()
    assert step_made_at_peak(est) == expected
    # latents cached (no VAE on the GPU): the toy step made far less at its peak
    cached = estimate(
        FLUX, dataclasses.replace(training, frozen_on_gpu="none"), engine="generic",
        simulate_allocator=False,
    )  # fmt: skip
    assert step_made_at_peak(cached) < expected / 2


def test_flux_controlnet_blocks_are_settings_of_a_flux_controlnet_only() -> None:
    pytest.importorskip("diffusers")
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.controlnet import build_controlnet_step
    from trainmem.trace.diffusers_model import build_diffusers_model

    # diffusers' README_flux.md command: --num_double_layers 4 --num_single_layers 0
    training = dataclasses.replace(TRAINING, controlnet_double_layers=3, controlnet_single_layers=0)
    raw = load_hf_config(FLUX)
    step = build_controlnet_step(raw, build_diffusers_model(raw, training), training)
    assert len(step.controlnet.transformer_blocks) == 3
    assert len(step.controlnet.single_transformer_blocks) == 0
    with pytest.raises(SpecError, match="controlnet_single_layers: 0: the blocks of a FLUX"):
        estimate(SD3, dataclasses.replace(TRAINING, controlnet_single_layers=0), engine="generic")
    unset = dataclasses.replace(TRAINING, controlnet=False, controlnet_double_layers=2)
    with pytest.raises(SpecError, match="controlnet_double_layers: 2: the blocks of a FLUX"):
        estimate(FLUX, unset, engine="generic")
    with pytest.raises(SpecError, match="controlnet_double_layers: must be a non-negative"):
        TrainingConfig(controlnet_double_layers=-1)


@pytest.mark.slow  # ~40 s: the toy FLUX traced with a ControlNet of double blocks only
def test_a_flux_controlnet_without_single_blocks_runs() -> None:
    # the README's command: no single-stream residuals (the ControlNet returns None for them)
    training = dataclasses.replace(TRAINING, controlnet_double_layers=2, controlnet_single_layers=0)
    est = estimate(FLUX, training, engine="generic", simulate_allocator=False)
    transformer, controlnet = _models(FLUX, "meta", (2, 0))
    n_cn = sum(p.numel() for p in controlnet.parameters())
    assert est.num_trainable_parameters == n_cn
    assert est.num_parameters == n_cn + sum(p.numel() for p in transformer.parameters())
    assert "2 double- and 0 single-stream blocks" in " ".join(est.notes)
