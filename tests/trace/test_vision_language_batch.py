"""Vision-language models train on an image and text (issue 26, trainmem/trace/hf_inputs.py
``vision_language_batch``): pixels at the vision config's size through the vision tower, and
one image placeholder per row of image features before the text, as the processor expands
``<image>``. Config: a 2-layer LLaVA (CLIP tower, Llama text) in tests/models/vlm/.

Expected values from the config by hand: a 32 x 32 image in 8 x 8 patches is 16 patches; the
"default" feature strategy drops CLIP's class token, so 16 placeholders.
"""

from __future__ import annotations

import json

import pytest

from conftest import MODELS_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LLAVA = MODELS_DIR / "vlm" / "llava.json"


def test_the_batch_places_one_placeholder_per_image_feature_row() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch, materialize_fake
    from trainmem.trace.known_values import value_of

    raw = json.loads(LLAVA.read_text())
    model = build_hf_model(raw)
    fake = FakeTensorMode()
    materialize_fake(model, fake)
    with fake:
        batch = make_hf_batch(model, 2, 24)
    assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 32)
    ids = value_of(batch["input_ids"])
    assert ids is not None and tuple(ids.shape) == (2, 16 + 24)
    assert (ids[:, :16] == raw["image_token_id"]).all()
    assert not (ids[:, 16:] == raw["image_token_id"]).any()  # the text has none
    assert torch.equal(value_of(batch["labels"]), ids)


def test_a_vision_language_model_estimates_with_its_image(invoke_json) -> None:
    out = invoke_json("estimate", LLAVA, "--engine", "generic", "-b", "2", "-s", "24")
    assert out["peak"]["allocated_bytes"] > 0
