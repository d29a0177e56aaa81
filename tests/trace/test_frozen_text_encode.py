"""The frozen text encoders' forwards inside the step (issue 26; Note [The frozen text encoders
encode inside the step] in ``trace/frozen_encode.py``): with ``--frozen-on-gpu text-encoders``
the scripts encode each batch's prompts with the kept encoders under ``no_grad`` before the
denoiser's forward (diffusers v0.40 ``train_dreambooth_lora_flux.py``
``compute_text_embeddings`` with per-image captions).

Expected bytes from a real CPU execution: transformers' ``CLIPTextModel`` (a toy config whose
MLP dominates: 256 wide, 4096 inner, so no attention kernel difference between the CPU run
and the emulated CUDA one decides the peak) on [2, 77] ids in bf16 under ``no_grad``, its
output kept, counted by tests/conftest.py ``storage_peak``. The toy SD 1.x UNet at 64 px
makes far less. Parameter counts: each text config built by transformers on meta gives the
count ``--frozen-on-gpu`` holds."""

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
TINY_CLIP: dict[str, Any] = {
    **spec.CLIP_L_TEXT,
    "hidden_size": 256,
    "intermediate_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "projection_dim": 256,
}


def _real_encode_peak() -> int:
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CLIPTextConfig(**TINY_CLIP)
    encoder = transformers.CLIPTextModel(config).to(torch.bfloat16).requires_grad_(False)
    kept: list[Any] = []

    def step() -> None:
        with torch.no_grad():
            ids = torch.zeros(2, 77, dtype=torch.int64)
            kept.append(encoder(ids, output_hidden_states=False))

    return int(storage_peak(step))


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_the_step_peak_holds_the_text_encoder_forward(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    pytest.importorskip("diffusers")
    rows = tuple(
        dataclasses.replace(c, text=("CLIPTextModel", TINY_CLIP, "clip"))
        if c.kind == "text-encoder"
        else c
        for c in spec.FROZEN_COMPONENTS[spec.SD1_UNET]
    )
    monkeypatch.setitem(spec.FROZEN_COMPONENTS, spec.SD1_UNET, rows)
    training = TrainingConfig(
        precision="bf16-mixed", resolution=64, micro_batch_size=2,
        frozen_on_gpu="text-encoders", lora_rank=4, activation_checkpointing="full",
    )  # fmt: skip
    est = estimate(SD1, training, engine=engine, simulate_allocator=False)
    expected = _real_encode_peak()
    assert step_made_at_peak(est) == expected
    # the embeddings precomputed (no encoder on the GPU): the toy step made far less
    cached = dataclasses.replace(training, frozen_on_gpu="none")
    assert step_made_at_peak(estimate(SD1, cached, engine=engine)) < expected / 2


def test_each_text_encoder_config_is_the_counted_model() -> None:
    import torch

    transformers = pytest.importorskip("transformers")
    seen = set()
    for rows in spec.FROZEN_COMPONENTS.values():
        for c in rows:
            if c.text is None or c.source in seen:
                continue
            seen.add(c.source)
            cls_name, kwargs, rule = c.text
            assert rule in spec.PROMPT_TOKENS
            config_cls = transformers.T5Config if "T5" in cls_name else transformers.CLIPTextConfig
            with torch.device("meta"):
                model = getattr(transformers, cls_name)(config_cls(**kwargs))
            assert sum(p.numel() for p in model.parameters()) == c.num_params, c.source
    assert len(seen) >= 4  # CLIP-L, CLIP-L with projection, bigG, T5-XXL
