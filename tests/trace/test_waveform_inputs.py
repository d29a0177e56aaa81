"""A waveform model's batch (trace/hf_model.py ``_waveform_batch``): OmniASR reads [b, 1,
samples], the channel dimension its feature extractor adds (feature_extraction_omniasr.py,
``input_values[:, None, :]``), with the stride of its audio tower's convolutions (the product
of ``audio_config.conv_stride``, 5 x 4 here). Checked against the real model's CPU forward,
which fails on the [b, samples] the batch had before."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_OMNIASR = {
    "vocab_size": 32,
    "audio_config": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": [8, 8],
        "conv_kernel": [5, 4],
        "conv_stride": [5, 4],
    },
}


def test_omniasr_takes_a_waveform_with_a_channel_dimension_at_its_towers_stride() -> None:
    from trainmem.trace._torch import require_torch
    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    require_torch()
    raw = {"model_type": "omniasr_ctc", **_OMNIASR}
    model = build_hf_model(raw, device="cpu").train()
    batch = make_hf_batch(model, 2, 16)
    assert tuple(batch["input_values"].shape) == (2, 1, 16 * 5 * 4)
    model.eval()  # (its LayerDrop draw is the trace's problem, not the layout's)
    model(**batch)  # the real forward takes the layout
    with pytest.raises((IndexError, RuntimeError)):  # (conv1d reads [2, n] as 2 channels)
        model(input_values=batch["input_values"][:, 0])  # the layout before: no channel
