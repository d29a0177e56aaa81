"""SigLIP 2 takes its image as a padded sequence of patches (issue 26,
trainmem/trace/hf_inputs.py ``patch_sequence_batch``), as transformers 5.24's
models/siglip2/image_processing_pil_siglip2.py lays one out. Config: a 2-layer SigLIP 2
classifier, 8-pixel patches, at most 16 of them (tests/models/heads/siglip2.json; a square
number: the embeddings keep a 4 x 4 grid of positions, resized to each image's grid).

Expected values by hand from the processor's rule (resize keeping the aspect ratio to the
largest grid of at most num_patches patches, sides rounded up to whole patches): a 32 x 32
image is a 4 x 4 grid (16 patches); a 32 x 64 image is 3 x 5 = 15 patches (scale in
(0.5, 0.625]: ceil(4 s) = 3, ceil(8 s) = 5; the next grid, 3 x 6 = 18, exceeds 16), padded
with one empty slot. Each patch is 3 x 8 x 8 = 192 values.
"""

from __future__ import annotations

import json

import pytest

from conftest import MODELS_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SIGLIP2 = MODELS_DIR / "heads" / "siglip2.json"


def _batch(image_size: tuple[int, int] | None) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch, materialize_fake

    model = build_hf_model(json.loads(SIGLIP2.read_text()))
    fake = FakeTensorMode()
    materialize_fake(model, fake)
    with fake:
        return make_hf_batch(model, 2, 64, image_size=image_size)


@pytest.mark.parametrize(("size", "grid"), [((32, 32), (4, 4)), ((32, 64), (3, 5))])
def test_the_batch_is_the_processors_padded_patch_sequence(size, grid) -> None:
    from trainmem.trace.known_values import value_of

    batch = _batch(size)
    assert tuple(batch["pixel_values"].shape) == (2, 16, 192)
    assert value_of(batch["spatial_shapes"]).tolist() == [list(grid)] * 2
    used = grid[0] * grid[1]
    mask = value_of(batch["pixel_attention_mask"])
    assert mask.tolist() == [[1] * used + [0] * (16 - used)] * 2
    assert tuple(batch["labels"].shape) == (2,)


def test_siglip2_estimates_on_its_patches(invoke_json) -> None:
    out = invoke_json("estimate", SIGLIP2, "--engine", "generic", "-b", "2", "--resolution", "32")
    assert out["peak"]["allocated_bytes"] > 0
