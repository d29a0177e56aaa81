"""The frozen VAE's encode inside the step (issue 26; Note [The frozen VAE encodes inside the
step] in ``trace/frozen_encode.py``): with ``--frozen-on-gpu vae`` the scripts encode each
batch's pixels with the VAE before the denoiser's forward (finetrainers e5df80c
``trainer.py`` / ``ltx_video_lora.py prepare_latents``; diffusers' ``train_dreambooth_lora_*``
without ``--cache_latents``), and the step's peak holds that encode's transients.

Expected bytes from a real CPU execution: diffusers' ``AutoencoderKL`` (a toy width: 2 blocks
of 32 / 64 channels, one resnet each, no mid-block attention so no attention kernel differs
between the CPU run and the emulated CUDA one) encoding a [2, 3, 64, 64] bf16 batch made
inside the counted call, under ``no_grad``, ``latent_dist.sample()`` kept, its storages counted
by tests/conftest.py ``storage_peak``. The toy SD 1.x UNet (tests/models/diffusers/
tiny-sd1-unet.json) at 64 px works on an 8 x 8 latent, far below the encode at 64 x 64."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from conftest import step_made_at_peak, storage_peak
from trainmem.estimate import estimate
from trainmem.specs import diffusers as spec
from trainmem.specs.training import TrainingConfig

SD1 = str(Path(__file__).resolve().parents[1] / "models" / "diffusers" / "tiny-sd1-unet.json")
TINY_VAE: dict[str, Any] = {
    **spec.SD_VAE,
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "latent_channels": 4,
    "mid_block_add_attention": False,
}


def _real_encode_peak(config: dict[str, Any] | None = None, tiling: bool = False) -> int:
    import torch

    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**(config or TINY_VAE)).to(torch.bfloat16).requires_grad_(False)
    if tiling:
        vae.enable_tiling()
    kept: list[Any] = []

    def step() -> None:
        with torch.no_grad():
            pixels = torch.randn(2, 3, 64, 64, dtype=torch.bfloat16)
            kept.append(vae.encode(pixels).latent_dist.sample())

    return int(storage_peak(step))


@pytest.fixture
def tiny_vae(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = tuple(
        dataclasses.replace(c, build=("AutoencoderKL", TINY_VAE)) if c.kind == "vae" else c
        for c in spec.FROZEN_COMPONENTS[spec.SD1_UNET]
    )
    monkeypatch.setitem(spec.FROZEN_COMPONENTS, spec.SD1_UNET, rows)


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_the_step_peak_holds_the_vae_encode(tiny_vae: None, engine: str) -> None:
    pytest.importorskip("diffusers")
    training = TrainingConfig(
        precision="bf16-mixed", resolution=64, micro_batch_size=2, frozen_on_gpu="vae",
        lora_rank=4, activation_checkpointing="full",  # (the UNet small beside the encode)
    )  # fmt: skip
    est = estimate(SD1, training, engine=engine)
    expected = _real_encode_peak()
    assert step_made_at_peak(est) == expected
    # the setting without the VAE on the GPU (latents cached) made far less at its peak
    cached = estimate(SD1, dataclasses.replace(training, frozen_on_gpu="none"), engine=engine)
    assert step_made_at_peak(cached) < expected / 2


def test_each_vae_build_is_the_counted_model() -> None:
    # the class and arguments the encode builds give the count --frozen-on-gpu holds
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    for rows in spec.FROZEN_COMPONENTS.values():
        for c in rows:
            assert (c.build is None) == (c.kind != "vae"), c.source
            if c.build is not None:
                cls, kwargs = c.build
                with torch.device("meta"):
                    vae = getattr(diffusers, cls)(**kwargs)
                assert sum(p.numel() for p in vae.parameters()) == c.num_params, c.source


TILED_VAE: dict[str, Any] = {**TINY_VAE, "sample_size": 32}
"""The toy VAE with 32-pixel tiles (``tile_sample_min_size`` = ``sample_size``): a 64 x 64
image is encoded as 3 x 3 tiles (every 24 pixels: 0.75 x 32; 32, 32 and 16 pixels wide)."""


def test_vae_tiling_encodes_tile_by_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    # Note [The frozen VAE encodes inside the step]: --vae-tiling calls vae.enable_tiling(),
    # and the step's peak is diffusers' own tiled encode, as a real CPU execution of it counts
    pytest.importorskip("diffusers")
    rows = tuple(
        dataclasses.replace(c, build=("AutoencoderKL", TILED_VAE)) if c.kind == "vae" else c
        for c in spec.FROZEN_COMPONENTS[spec.SD1_UNET]
    )
    monkeypatch.setitem(spec.FROZEN_COMPONENTS, spec.SD1_UNET, rows)
    training = TrainingConfig(
        precision="bf16-mixed", resolution=64, micro_batch_size=2, frozen_on_gpu="vae",
        lora_rank=4, activation_checkpointing="full", vae_tiling=True,
    )  # fmt: skip
    tiled = _real_encode_peak(TILED_VAE, tiling=True)
    assert tiled < _real_encode_peak(TILED_VAE) / 2  # one tile's activations
    # (602,112 B against 2,146,304 B untiled; the UNet's backward now peaks higher, so the
    # encode's own peak is compared: the bytes made before the UNet's first module runs)
    assert _encode_peak(estimate(SD1, training, engine="generic")) == tiled


def _encode_peak(est: Any) -> int:
    """The most bytes the step made (forward / backward allocations, as
    :func:`conftest.step_made_at_peak` counts) before a micro-batch's UNet forward starts:
    the frozen encode's peak."""
    timeline = est.schedules[est.reported_rank].expand()
    live: dict[int, Any] = {}
    best = 0
    for ev in timeline.events:
        if ev.phase == "forward" and ev.module.split(".")[0] in ("time_proj", "conv_in"):
            return best
        if ev.action == "alloc":
            live[ev.block_id] = ev
        else:
            del live[ev.block_id]
        made = (e.size_bytes for e in live.values() if e.phase in ("forward", "backward"))
        best = max(best, sum(made))
    return best


def test_vae_tiling_needs_the_vae_on_the_gpu() -> None:
    from trainmem.errors import SpecError

    pytest.importorskip("diffusers")
    training = TrainingConfig(micro_batch_size=2, resolution=64, vae_tiling=True)
    with pytest.raises(SpecError, match="vae_tiling.*--frozen-on-gpu vae or all"):
        estimate(SD1, training, engine="generic")
