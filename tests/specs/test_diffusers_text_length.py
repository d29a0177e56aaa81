"""CogVideoX's one text length (trainmem.specs.diffusers.fixed_text_seq_len): with sincos or
learned positions its patch embedding adds one table of max_text_seq_length + video rows to
the joined text and video tokens (diffusers models/embeddings.py ``CogVideoXPatchEmbed``), so
the batch's text length is the config's; tiny-cogvideox failed on the generic path with
"Attempting to broadcast a dimension of length 17566" (226 default text tokens against its 16
text rows: 210 rows short)."""

from __future__ import annotations

import json

import pytest

from conftest import MODELS_DIR
from trainmem.errors import SpecError
from trainmem.specs.diffusers import fixed_text_seq_len, image_batch
from trainmem.specs.training import TrainingConfig

COGVIDEOX = json.loads((MODELS_DIR / "diffusers" / "tiny-cogvideox.json").read_text())
NAME = "CogVideoXTransformer3DModel"


def test_cogvideox_takes_its_configs_text_length() -> None:
    assert fixed_text_seq_len(NAME, COGVIDEOX) == 16  # its max_text_seq_length
    assert fixed_text_seq_len(NAME, {}) == 226  # diffusers' default
    # rotary positions (CogVideoX-5b / 1.5): no table, any length runs
    assert fixed_text_seq_len(NAME, {**COGVIDEOX, "use_rotary_positional_embeddings": True}) is None
    assert fixed_text_seq_len("WanTransformer3DModel", {}) is None
    batch = image_batch(COGVIDEOX, TrainingConfig())
    assert batch.text_seq_len == 16
    assert image_batch(COGVIDEOX, TrainingConfig(text_seq_len=16)).text_seq_len == 16


def test_cogvideox_refuses_another_text_length() -> None:
    with pytest.raises(SpecError, match=r"text_seq_len.*max_text_seq_length \(16\)"):
        image_batch(COGVIDEOX, TrainingConfig(text_seq_len=226))
