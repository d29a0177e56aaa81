"""Dia (text to speech) trains on audio codes (issue 26, trainmem/trace/hf_model.py
``_audio_code_batch``), laid out as transformers 5.24's models/dia/processing_dia.py
``DiaProcessor.__call__(..., output_labels=True)`` does: ``decoder_input_ids`` [b, frames,
codebooks] and ``labels`` [b * codebooks, frames], codebook-major, the layout
``DiaForConditionalGeneration.forward`` flattens its logits to. Config: a 2 + 2 layer Dia, 3
codebooks of 40 codes, 36-38 special (tests/models/seq2seq/dia.json).

Expected by hand: b = 2, s = 5: codes [2, 5, 3], labels [6, 5], codes in range(40), none of
the special 36 (eos), 37 (pad), 38 (bos).
"""

from __future__ import annotations

import json

import pytest

from conftest import MODELS_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

DIA = MODELS_DIR / "seq2seq" / "dia.json"


def test_the_batch_is_the_processors_training_layout() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch, materialize_fake
    from trainmem.trace.known_values import value_of

    model = build_hf_model(json.loads(DIA.read_text()))
    fake = FakeTensorMode()
    materialize_fake(model, fake)
    with fake:
        batch = make_hf_batch(model, 2, 5)
    assert tuple(batch["input_ids"].shape) == (2, 5)
    codes = value_of(batch["decoder_input_ids"])
    labels = value_of(batch["labels"])
    assert tuple(codes.shape) == (2, 5, 3) and tuple(labels.shape) == (6, 5)
    for ids in (codes, labels):
        assert not torch.isin(ids, torch.tensor([36, 37, 38])).any()
        assert int(ids.min()) >= 0 and int(ids.max()) < 40


def test_dia_estimates_on_its_audio_codes(invoke_json) -> None:
    out = invoke_json("estimate", DIA, "--engine", "generic", "-b", "2", "-s", "16")
    assert out["peak"]["allocated_bytes"] > 0
