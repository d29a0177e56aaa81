"""``--train-text-encoder`` (issue 26): the pipeline's CLIP text encoders run inside the step
and train with the UNet (Note [Text-encoder training step] in ``trace/text_encoders.py``).
Counts: CLIP-L's ``CLIPTextModel`` 123,060,480 and bigG's ``CLIPTextModelWithProjection``
694,659,840 (each built from its Hub config on meta: tests/specs/test_frozen_components.py);
the UNets are toy widths with SD 1.x's (768) and SDXL's (2048) text widths
(tests/models/diffusers/tiny-sd1-unet.json, tiny-sdxl-text-unet.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

MODELS = Path(__file__).resolve().parents[1] / "models" / "diffusers"
SD1 = str(MODELS / "tiny-sd1-unet.json")
SDXL = str(MODELS / "tiny-sdxl-text-unet.json")
FLUX = str(Path(__file__).parent / "diffusers_configs" / "tiny-flux.json")
CLIP_L, CLIP_G = 123_060_480, 694_659_840
POSITION_IDS = 77 * 8  # each CLIP text model's int64 position_ids buffer [1, 77]
# the scripts' text LoRA on q_proj / k_proj / v_proj / out_proj, r (in + out) each
LORA_L = 12 * 4 * 4 * (768 + 768)  # r 4, 12 layers of 768
LORA_G = 32 * 4 * 4 * (1280 + 1280)  # r 4, 32 layers of 1280


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(precision="bf16-mixed", resolution=64, **changes)  # type: ignore[arg-type]


def test_train_text_encoder_is_refused_where_no_text_encoder_is_known() -> None:
    on = _training(train_text_encoder=True)
    with pytest.raises(SpecError, match="train_text_encoder: .* this model is diffusers Flux"):
        estimate(FLUX, on, engine="generic")
    with pytest.raises(SpecError, match="is not a diffusers model: leave it off"):
        estimate("tiny-llama-test", on, engine="analytic")
    unet = str(Path(__file__).parent / "diffusers_configs" / "tiny-sdxl-unet.json")
    with pytest.raises(SpecError, match="UNet2DConditionModel with cross_attention_dim 32"):
        estimate(unet, on, engine="generic")
    with pytest.raises(SpecError, match="text_seq_len: 78: a CLIP text encoder reads at most 77"):
        estimate(SD1, _training(train_text_encoder=True, text_seq_len=78), engine="generic")
    with pytest.raises(SpecError, match="train_controlnet.py keeps the text encoder frozen"):
        estimate(SD1, _training(train_text_encoder=True, controlnet=True), engine="generic")


def test_sd1_step_builds_clip_l_with_the_scripts_lora() -> None:
    pytest.importorskip("diffusers")
    import torch

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model
    from trainmem.trace.text_encoders import build_text_encoder_step

    training = _training(train_text_encoder=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    raw = load_hf_config(SD1)
    step = build_text_encoder_step(raw, build_diffusers_model(raw, training), training)
    (one,) = step.text_encoders
    frozen = [p for p in one.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == CLIP_L
    assert {p.dtype for p in frozen} == {torch.bfloat16}  # text_encoder.to(weight_dtype)
    adapters = [p for p in one.parameters() if p.requires_grad]
    assert sum(p.numel() for p in adapters) == LORA_L
    assert {p.dtype for p in adapters} == {torch.bfloat16}


@pytest.mark.slow  # ~14 s cold: bigG's 32 layers built
def test_sdxl_step_builds_both_encoders_with_the_scripts_lora() -> None:
    pytest.importorskip("diffusers")
    import torch

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model
    from trainmem.trace.text_encoders import build_text_encoder_step

    training = _training(train_text_encoder=True, lora_rank=4, lora_targets=("q", "k", "v", "o"))
    raw = load_hf_config(SDXL)
    step = build_text_encoder_step(raw, build_diffusers_model(raw, training), training)
    one, two = step.text_encoders
    assert type(one).__name__ == "CLIPTextModel"
    assert type(two).__name__ == "CLIPTextModelWithProjection"
    frozen = [p for e in (one, two) for p in e.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == CLIP_L + CLIP_G
    assert {p.dtype for p in frozen} == {torch.bfloat16}  # text_encoder.to(weight_dtype)
    adapters = [p for e in (one, two) for p in e.parameters() if p.requires_grad]
    assert sum(p.numel() for p in adapters) == LORA_L + LORA_G


@pytest.mark.slow  # ~8 s: CLIP-L and the UNet traced
def test_sd1_full_fine_tuning_trains_clip_l_in_fp32() -> None:
    plain = estimate(SD1, _training(), engine="generic", simulate_allocator=False)
    est = estimate(SD1, _training(train_text_encoder=True), engine="generic")
    assert est.num_parameters - plain.num_parameters == CLIP_L
    assert est.num_trainable_parameters == est.num_parameters
    b, p = est.breakdown, plain.breakdown
    assert b.parameters - p.parameters == 4 * CLIP_L + POSITION_IDS
    assert b.optimizer_states - p.optimizer_states == 8 * CLIP_L  # AdamW, fp32
    assert est.details["diffusers"]["trained_text_encoders"] == ["text_encoder"]


@pytest.mark.slow  # ~15 s: CLIP-L, bigG and the UNet traced
def test_sdxl_lora_on_both_text_encoders() -> None:
    lora = {"lora_rank": 4, "lora_targets": ("q", "k", "v", "o")}
    plain = estimate(SDXL, _training(**lora), engine="generic", simulate_allocator=False)
    est = estimate(SDXL, _training(train_text_encoder=True, **lora), engine="generic")
    b, p = est.breakdown, plain.breakdown
    assert est.num_trainable_parameters - plain.num_trainable_parameters == LORA_L + LORA_G
    # bf16 frozen encoders and bf16 adapters
    assert b.parameters - p.parameters == 2 * (CLIP_L + CLIP_G + LORA_L + LORA_G) + 2 * POSITION_IDS
    # AdamW's bf16 moments, but CLIP-L's last layer gets no gradient (SDXL reads its
    # penultimate hidden states, out[-1][-2]), so torch.optim makes no state for its adapters
    assert b.optimizer_states - p.optimizer_states == 2 * 2 * (LORA_L + LORA_G - LORA_L // 12)
