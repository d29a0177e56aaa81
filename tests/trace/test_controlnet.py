"""``--controlnet`` (issue 26): a ControlNet made from a diffusers UNet config and trained beside
the frozen UNet, the real diffusers forwards on fake tensors (Note [ControlNet training step] in
``trace/controlnet.py``). Parameter counts come from diffusers' own classes built on meta; the
bytes from the scripts' dtypes (UNet in the compute dtype, ControlNet in fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

UNET = str(Path(__file__).parent / "diffusers_configs" / "tiny-sdxl-unet.json")
WAN = str(Path(__file__).parent / "diffusers_configs" / "tiny-wan.json")
TRAINING = TrainingConfig(precision="bf16-mixed", resolution=64, text_seq_len=16, controlnet=True)


def _counts() -> tuple[int, int]:
    """(UNet, ControlNet) parameter counts from diffusers on meta."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    config = diffusers.UNet2DConditionModel.load_config(UNET)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(config)
        controlnet = diffusers.ControlNetModel.from_unet(unet, load_weights_from_unet=False)
    return (
        sum(p.numel() for p in unet.parameters()),
        sum(p.numel() for p in controlnet.parameters()),
    )


def test_controlnet_is_refused_off_a_unet_and_with_lora() -> None:
    # (FLUX and SD3 transformers take one: tests/trace/test_transformer_controlnet.py)
    with pytest.raises(SpecError, match="controlnet: .* this model is diffusers WanTransf"):
        estimate(WAN, TrainingConfig(controlnet=True), engine="generic")
    with pytest.raises(SpecError, match="controlnet: .* this model is not a diffusers model"):
        estimate("tiny-llama-test", TrainingConfig(controlnet=True), engine="analytic")
    with pytest.raises(SpecError, match="controlnet: train_controlnet.py trains the whole"):
        estimate(UNET, TrainingConfig(controlnet=True, lora_rank=4), engine="generic")


def test_controlnet_step_holds_a_frozen_16bit_unet_and_a_trained_fp32_controlnet() -> None:
    pytest.importorskip("diffusers")
    import torch

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.controlnet import build_controlnet_step
    from trainmem.trace.diffusers_model import build_diffusers_model

    raw = load_hf_config(UNET)
    step = build_controlnet_step(raw, build_diffusers_model(raw, TRAINING), TRAINING)
    n_unet, n_cn = _counts()
    unet = list(step.unet.parameters())
    assert sum(p.numel() for p in unet) == n_unet
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in unet)
    trained = [p for p in step.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trained) == n_cn
    assert all(p.dtype == torch.float32 for p in trained)


@pytest.mark.slow  # ~8 s on a loaded machine: the UNet and the ControlNet traced
@pytest.mark.parametrize("engine", ["generic", "trace"])
def test_controlnet_step_bytes(engine: str) -> None:
    n_unet, n_cn = _counts()
    est = estimate(UNET, TRAINING, engine=engine, simulate_allocator=False)
    b = est.breakdown
    assert est.num_parameters == n_unet + n_cn
    assert est.num_trainable_parameters == n_cn
    assert b.parameters == 2 * n_unet + 4 * n_cn  # bf16 UNet (weight_dtype), fp32 ControlNet
    assert b.optimizer_states == 8 * n_cn  # AdamW, fp32 moments of the ControlNet only
    assert est.details["diffusers"]["controlnet"] is True
