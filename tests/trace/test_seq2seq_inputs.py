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


_T5_LIKE = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}
_BART_LIKE = {
    "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "max_position_embeddings": 128,
}  # fmt: skip
_IDS = {"vocab_size": 512, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


@pytest.mark.parametrize(
    ("model_type", "head", "shape"),
    [("t5", "T5ForConditionalGeneration", _T5_LIKE),
     ("mt5", "MT5ForConditionalGeneration", _T5_LIKE),
     ("umt5", "UMT5ForConditionalGeneration", _T5_LIKE),
     ("bart", "BartForConditionalGeneration", _BART_LIKE),
     ("pegasus", "PegasusForConditionalGeneration", _BART_LIKE),
     ("marian", "MarianMTModel", _BART_LIKE)],
)  # fmt: skip
def test_a_text_encoder_decoder_has_labels_target_seq_len_long(
    model_type: str, head: str, shape: dict[str, int]
) -> None:
    # issue 26: the generic path read --target-seq-len for t5 only; mT5 / UMT5 / BART /
    # Pegasus / Marian were traced with labels seq_len long. Their ForConditionalGeneration
    # shifts the labels right into the decoder's input, of any length (shift_tokens_right):
    # a real CPU forward of the tiny model checks the decoder runs at the target length
    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    raw = {"model_type": model_type, "architectures": [head], **shape, **_IDS}
    model = build_hf_model(raw, device="cpu")
    assert type(model).__name__ == head
    batch = make_hf_batch(model, 2, 32, target_seq_len=8)
    assert tuple(batch["input_ids"].shape) == (2, 32)
    assert tuple(batch["labels"].shape) == (2, 8)
    out = model(**batch)
    assert tuple(out.logits.shape) == (2, 8, 512) and out.loss.requires_grad


@pytest.mark.parametrize("name", ["vision_encoder_decoder", "speech_encoder_decoder"])
def test_an_image_or_speech_encoder_decoder_keeps_labels_seq_len_long(name: str) -> None:
    # their labels are the text the decoder writes, seq_len long (the input is not tokens)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    model = build_hf_model(_raw(name))
    with FakeTensorMode():
        batch = make_hf_batch(model, 2, 32, target_seq_len=8)
    assert tuple(batch["labels"].shape) == (2, 32)


def test_bart_estimates_at_its_target_length_without_a_warning(invoke_json) -> None:
    args = ("estimate", SEQ2SEQ / "bart.json", "--engine", "generic", "-s", "64")
    short = invoke_json(*args, "--target-seq-len", "16")
    same = invoke_json(*args, "--target-seq-len", "64")
    assert not any("target_seq_len" in n for n in short["notes"] + same["notes"])
    assert same["peak"] == invoke_json(*args)["peak"]  # 0 means seq_len
    # a shorter decoder: less activation memory (its self- and cross-attention, FFN, logits)
    assert short["peak"]["allocated_bytes"] < same["peak"]["allocated_bytes"]
