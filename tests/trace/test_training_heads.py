"""The generic path picks a training head and builds the batch from the model's own inputs
(issue 26): speech (CTC on a raw waveform), semantic segmentation (per-pixel labels),
bidirectional encoders whose mask transformers checks with ``padding_mask.all()``, and
LayerDrop models. Configs: 2-layer, small widths, in tests/models/heads/.

Expected values are independent of trainmem: the parameter count is the one transformers
gives for the class it builds from the same config, and the head is the first of
transformers' own task mappings that has the model type.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MODELS_DIR

pytest.importorskip("torch")
pytest.importorskip("transformers")

HEADS = MODELS_DIR / "heads"


def _transformers_count(name: str, auto: str) -> tuple[int, int]:
    import torch
    import transformers

    raw = json.loads((HEADS / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(
        raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"}
    )
    cls = getattr(transformers, auto)
    with torch.device("meta"):
        model = cls.from_config(config) if auto.startswith("Auto") else cls(config)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@pytest.mark.parametrize(
    ("name", "auto"),
    [
        ("wav2vec2", "AutoModelForCTC"),  # in no language-model mapping
        ("segformer", "AutoModelForImageClassification"),  # classification by default
        ("segformer_segmentation", "SegformerForSemanticSegmentation"),  # by architectures
        ("roformer", "AutoModelForCausalLM"),
        ("m2m_100", "AutoModelForSeq2SeqLM"),
        # a log-mel spectrogram [b, max_length, num_mel_bins], not a waveform
        ("audio-spectrogram-transformer", "AutoModelForAudioClassification"),
        # asserts its lengths with ``.item()`` (Note [Known values of a synthetic batch])
        ("xlm", "AutoModelForCausalLM"),
        # log-mel frames [b, 8 x s, mel bins] into a FastConformer encoder
        ("parakeet_ctc", "AutoModelForCTC"),
    ],
)
def test_generic_path_trains_the_task_head(name: str, auto: str, invoke_json) -> None:
    tokens = [] if name.startswith("segformer") else ["-s", "64"]  # an image: no sequence
    out = invoke_json("estimate", HEADS / f"{name}.json", "--engine", "generic", "-b", "2", *tokens)
    total, trainable = _transformers_count(name, auto)
    assert (out["num_parameters"], out["num_trainable_parameters"]) == (total, trainable)
    assert out["peak"]["allocated_bytes"] > 0


def test_layerdrop_is_off_in_the_reported_step() -> None:
    """LayerDrop skips layers at random per step; the step a run's max_memory_allocated comes
    from keeps all of them, so a config with LayerDrop estimates as the same config without."""
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    raw = json.loads((HEADS / "m2m_100.json").read_text())
    assert raw["encoder_layerdrop"] > 0 and raw["decoder_layerdrop"] > 0
    training = TrainingConfig(micro_batch_size=2, seq_len=64)
    with_drop = estimate(str(HEADS / "m2m_100.json"), training, engine="generic")
    raw.update(encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "config.json"
    path.write_text(json.dumps(raw))
    without = estimate(str(path), training, engine="generic")
    assert with_drop.breakdown.allocated_bytes == without.breakdown.allocated_bytes


def test_segmentation_labels_are_per_pixel() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch

    raw = json.loads((HEADS / "segformer_segmentation.json").read_text())
    model = build_hf_training_model(raw, TrainingConfig())
    with FakeTensorMode(allow_non_fake_inputs=True):
        batch = make_hf_batch(model, 3, 0)
    assert tuple(batch["pixel_values"].shape) == (3, 3, 128, 128)
    assert tuple(batch["labels"].shape) == (3, 128, 128)
    assert batch["labels"].dtype == torch.int64
