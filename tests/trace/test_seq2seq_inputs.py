"""Encoder-decoder models on the generic path (issue 26): a T5-like config without
``decoder_start_token_id`` (transformers' default ``T5Config`` has none; released T5 configs
start the decoder with the pad id), and vision / speech encoder-decoders, whose input is their
encoder's (pixels, a waveform) and whose labels are the decoder's tokens. Configs: 2 layers,
small widths, in tests/models/seq2seq/.

Expected values are independent of trainmem: shapes from the configs (image 32 x 32; a
waveform of 20 samples per encoder frame, the product of ``conv_stride`` 5 x 4), parameter
counts from transformers' own classes.
"""

from __future__ import annotations

import json

import pytest

from conftest import MODELS_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ2SEQ = MODELS_DIR / "seq2seq"


def _raw(name: str) -> dict[str, object]:
    return dict(json.loads((SEQ2SEQ / f"{name}.json").read_text()))


def test_a_t5_config_without_a_decoder_start_starts_the_decoder_with_pad() -> None:
    from trainmem.trace.hf_model import build_hf_model

    raw = _raw("t5_no_start")
    assert "decoder_start_token_id" not in raw
    model = build_hf_model(raw, device="cpu")
    assert model.config.decoder_start_token_id == raw["pad_token_id"] == 0
    # the decoder's input: the labels shifted right behind the start id, -100 read as pad
    shifted = model._shift_right(torch.tensor([[5, 6, -100]]))
    assert shifted.tolist() == [[0, 5, 6]]


def _batch(name: str) -> tuple[object, dict[str, object]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    model = build_hf_model(_raw(name))
    with FakeTensorMode():
        batch = make_hf_batch(model, 2, 32)
    return model, batch


def test_a_vision_encoder_decoder_reads_pixels_and_learns_the_decoder_tokens() -> None:
    model, batch = _batch("vision_encoder_decoder")
    assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 32)
    assert tuple(batch["labels"].shape) == (2, 32)  # text tokens, not class labels
    assert batch["labels"].dtype == torch.int64


def test_a_speech_encoder_decoder_reads_a_waveform_with_its_encoders_switches_off() -> None:
    model, batch = _batch("speech_encoder_decoder")
    assert tuple(batch["inputs"].shape) == (2, 32 * 5 * 4)
    assert tuple(batch["labels"].shape) == (2, 32)
    # LayerDrop and SpecAugment of the encoder sub-config: off in the reported step
    assert model.config.encoder.layerdrop == 0.0
    assert model.config.encoder.apply_spec_augment is False


def test_the_vision_encoder_decoder_estimates_end_to_end(invoke_json) -> None:
    out = invoke_json(
        "estimate", SEQ2SEQ / "vision_encoder_decoder.json", "--engine", "generic", "-s", "32"
    )
    config = transformers.VisionEncoderDecoderConfig(**_raw("vision_encoder_decoder"))
    with torch.device("meta"):
        expected = sum(
            p.numel() for p in transformers.VisionEncoderDecoderModel(config).parameters()
        )
    assert out["num_parameters"] == expected
    assert out["peak"]["allocated_bytes"] > 0
