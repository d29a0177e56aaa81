"""``--frozen-on-gpu`` on the diffusers paths (issue 26): the pipeline's frozen models are
parameters from setup of the traced step, count x dtype bytes, on the whole-model trace and the
generic path alike; ``none`` is today's step; a kept VAE also encodes the batch inside the step
(tests/trace/test_frozen_vae_encode.py), kept text encoders the prompts
(tests/trace/test_frozen_text_encode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.breakdown import MemoryEstimate
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("diffusers")

CONFIGS = Path(__file__).parent / "diffusers_configs"
FLUX = str(CONFIGS / "tiny-flux.json")  # a FluxTransformer2DModel: FLUX.1's pipeline
UNET = str(CONFIGS / "tiny-sdxl-unet.json")  # addition_embed_type text_time: SDXL's
CLIP_L, T5_XXL, FLUX_VAE, SDXL_VAE = 123_060_480, 4_762_310_656, 83_819_683, 83_653_863


def _run(model: str, engine: str, frozen: str, precision: str = "bf16-true") -> MemoryEstimate:
    training = TrainingConfig(
        precision=precision, resolution=64, text_seq_len=16, frozen_on_gpu=frozen
    )
    return estimate(model, training, engine=engine)


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_flux_pipeline_on_the_gpu_in_bf16(engine: str) -> None:
    none = _run(FLUX, engine, "none")
    every = _run(FLUX, engine, "all")
    # count x 2 B (bf16): CLIP-L + T5-XXL encoder + the 16-channel VAE
    assert every.breakdown.parameters - none.breakdown.parameters == 2 * (
        CLIP_L + T5_XXL + FLUX_VAE
    )
    text = _run(FLUX, engine, "text-encoders")
    assert text.breakdown.parameters - none.breakdown.parameters == 2 * (CLIP_L + T5_XXL)
    # the kept encoders encode the prompts first (Note [The frozen text encoders encode inside
    # the step]): T5-XXL's 16 x 4096 states and 10240-wide MLP, above this toy denoiser's step
    assert text.breakdown.gradients == 0 < none.breakdown.gradients
    assert text.breakdown.temporary > none.breakdown.temporary
    # with the VAE the step encodes the 64 px batch first (Note [The frozen VAE encodes inside
    # the step]), above this toy denoiser's whole step: the peak comes before any gradient
    assert every.breakdown.gradients == 0 < none.breakdown.gradients
    assert every.breakdown.temporary > none.breakdown.temporary
    vae = _run(FLUX, engine, "vae")
    assert vae.breakdown.parameters - none.breakdown.parameters == 2 * FLUX_VAE
    assert any("--frozen-on-gpu none" in n for n in none.notes)


def test_sdxl_vae_stays_fp32() -> None:
    none = _run(UNET, "generic", "none", precision="bf16-mixed")
    vae = _run(UNET, "generic", "vae", precision="bf16-mixed")
    assert vae.breakdown.parameters - none.breakdown.parameters == 4 * SDXL_VAE
    text = _run(UNET, "generic", "text-encoders", precision="bf16-mixed")
    assert text.breakdown.parameters - none.breakdown.parameters == 2 * (CLIP_L + 694_659_840)
