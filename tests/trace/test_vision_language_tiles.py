"""Vision-language models whose processor hands over several images per sample, query tokens
or a cross-attention mask train on an image (issue 26, trainmem/trace/hf_inputs.py and
trainmem/trace/processor_layouts.py): Idefics2, Idefics3 / SmolVLM, IDEFICS, BLIP-2,
InstructBLIP-Video. Tiny configs in tests/models/vlm/.

Expected tiles and sizes come from running transformers' own PIL image processors on a real
image (image_processing_pil_idefics3.py, image_processing_pil_idefics2.py) or by hand from the
processor's code; token counts from transformers' own prompt string
(processing_smolvlm.py ``get_image_prompt_string``) or by hand.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import MODELS_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

SMOLVLM = MODELS_DIR / "vlm" / "smolvlm.json"
"""A 2 + 2 layer SmolVLM: tower image_size 32, patch_size 8; scale_factor 2; so
(32 / 8) ** 2 / 2 ** 2 = 4 image tokens per tile; image token 250."""
IDEFICS2 = MODELS_DIR / "vlm" / "idefics2.json"
"""A 2 + 2 layer Idefics2: tower image_size 64, patch_size 8; perceiver 8 latents; token 250."""
IDEFICS = MODELS_DIR / "vlm" / "idefics.json"
"""A 2-layer IDEFICS (cross-attention every layer), CLIP-like tower image_size 32."""
BLIP2 = MODELS_DIR / "vlm" / "blip2.json"
"""A 2 + 2 + 2 layer BLIP-2 (OPT text, vocab 256, pad 1, bos / eos 2), 8 query tokens, tower
image_size 32, no image_token_index (transformers' default config names none)."""
INSTRUCTBLIP_VIDEO = MODELS_DIR / "vlm" / "instructblipvideo.json"
"""The tiny BLIP-2 as InstructBLIP-Video (no video_token_index)."""


def _batch(path, image_size=None, b=2, s=16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch, materialize_fake

    model = build_hf_model(json.loads(path.read_text()))
    fake = FakeTensorMode()
    materialize_fake(model, fake)
    notes: list[str] = []
    with fake:
        batch = make_hf_batch(model, b, s, image_size=image_size, notes=notes)
    return model, batch, notes


def _processor_tiles(height: int, width: int, side: int):
    """transformers' Idefics3 image processor run on a height x width image whose longest edge
    is the processor's ``size`` (what trainmem's ``--resolution`` describes): pixel_values
    shape and (rows, cols)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    processor = Idefics3ImageProcessorPil(
        size={"longest_edge": max(height, width)}, max_image_size={"longest_edge": side}
    )
    image = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
    return tuple(out["pixel_values"].shape), (out["rows"][0][0], out["cols"][0][0])


@pytest.mark.parametrize(
    ("height", "width", "side"),
    [(40, 70, 32), (20, 30, 32), (2048, 2048, 512), (1000, 1500, 364), (1456, 600, 364)],
)
def test_idefics3_tiles_are_the_image_processors(height: int, width: int, side: int) -> None:
    from trainmem.trace.processor_layouts import idefics3_layout

    shape, grid = _processor_tiles(height, width, side)
    layout = idefics3_layout(side, 8, 2, (height, width))
    assert (1, layout.tiles, 3, layout.height, layout.width) == shape
    assert layout.grid == grid


SEPARATORS = ("<fake_token_around_image>", "<image>", "<global-img>")


def test_idefics3_prompt_is_the_processors_string() -> None:
    """SmolVLM-256M's numbers (tower 512, patch 16, scale_factor 4: 64 tokens a tile), its
    default processor (longest edge 2048): 4 x 4 tiles and the whole image. transformers'
    ``get_image_prompt_string`` made into tokens, each special token and each newline run one
    token ("\\n\\n" one token, as in Llama 3's and SmolLM2's tokenizers): 17 x 64 = 1,088
    image tokens, 1,127 in all (transformers' ``_get_num_multimodal_tokens``: 64 + 3 + 4 x
    (4 x (64 + 2) + 1))."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from trainmem.trace.processor_layouts import idefics3_layout

    layout = idefics3_layout(512, 16, 4, None)
    assert layout.image == (2048, 2048) and layout.grid == (4, 4) and layout.tiles == 17
    text = get_image_prompt_string(4, 4, 64, "<fake_token_around_image>", "<image>", "<global-img>")
    tokens = re.findall(r"<fake_token_around_image>|<row_\d_col_\d>|<global-img>|<image>|\n+", text)
    assert "".join(tokens) == text
    assert layout.tokens == len(tokens) == 1127
    assert layout.image_tokens == tokens.count("<image>") == 1088
    flags = [image for image, n in layout.prompt for _ in range(n)]
    assert flags == [t == "<image>" for t in tokens]
    alone = idefics3_layout(512, 16, 4, (300, 512))  # one tile: not split
    whole = get_image_prompt_string(
        0, 0, 64, "<fake_token_around_image>", "<image>", "<global-img>"
    )
    assert alone.tiles == 1 and alone.tokens == 64 + 3 == len(re.findall(r"<[^>]+>", whole))


@pytest.mark.parametrize(("height", "width"), [(1200, 600), (200, 300), (980, 980), (500, 2000)])
def test_idefics2_image_is_the_image_processors(height: int, width: int) -> None:
    """Idefics2's default processor (shortest edge 378, longest 980, no splitting) run on the
    image; the layout with the released tower's 980 pixels and 64 perceiver latents."""
    from transformers.models.idefics2.image_processing_pil_idefics2 import (
        Idefics2ImageProcessorPil,
    )

    from trainmem.trace.processor_layouts import idefics2_layout

    image = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    shape = tuple(
        Idefics2ImageProcessorPil()(images=[[image]], return_tensors="pt")["pixel_values"].shape
    )
    layout = idefics2_layout(980, 64, (height, width))
    assert (1, layout.tiles, 3, layout.height, layout.width) == shape
    assert layout.image_tokens == 64 and layout.tokens == 66  # <fake> <image> x 64 <fake>


def test_a_tiled_model_takes_its_tiles_mask_and_placeholders() -> None:
    """The tiny SmolVLM without --resolution: the default processor's 4 x 32 = 128-pixel
    square, 4 x 4 tiles and the whole image: pixel_values [2, 17, 3, 32, 32], an all-ones
    pixel_attention_mask [2, 17, 32, 32], 17 x 4 = 68 image tokens among 4 + 3 + 4 x (4 x (4
    + 2) + 1) = 107 prompt tokens, then the 16 text tokens. Row 1's first tile: tokens 0-1
    (<fake_token_around_image><row_1_col_1>), 2-5 its image tokens; the prompt ends with the
    whole image's 4 image tokens and <fake_token_around_image> (102-105, 106)."""
    from trainmem.trace.known_values import value_of

    _, batch, notes = _batch(SMOLVLM)
    assert tuple(batch["pixel_values"].shape) == (2, 17, 3, 32, 32)
    mask = value_of(batch["pixel_attention_mask"])
    assert tuple(mask.shape) == (2, 17, 32, 32) and bool(mask.eq(1).all())
    ids = value_of(batch["input_ids"])
    assert tuple(ids.shape) == (2, 107 + 16)
    image = ids == 250
    assert image.sum(dim=1).tolist() == [68, 68]
    assert image[0, 2:6].all() and not image[0, :2].any()
    assert image[0, 102:106].all() and not image[0, 106:].any()
    assert torch.equal(value_of(batch["labels"]), ids)
    assert any("17 images through the tower" in n and "68 image tokens" in n for n in notes)


def test_a_tiled_model_cuts_the_resolution_into_tiles(invoke_json) -> None:
    """--resolution 40x70 on the tiny SmolVLM: 2 x 3 tiles and the whole image (the
    processor's own cut, test_idefics3_tiles_are_the_image_processors), 7 x 4 = 28 image
    tokens; 20x30 is one tile, 4 image tokens. More tiles, more memory."""

    def run(resolution: str) -> tuple[int, str]:
        out = invoke_json(
            "estimate", SMOLVLM, "--engine", "generic", "-s", "16", "--resolution", resolution
        )
        said = [n for n in out["notes"] if n.startswith("vision-language model")]
        assert len(said) == 1
        return int(out["peak"]["allocated_bytes"]), said[0]

    many, said = run("40x70")
    assert "2 x 3 tiles" in said and "28 image tokens" in said
    one, said = run("20x30")
    assert "not split" in said and " 4 image tokens" in said
    assert many > one


def test_idefics2_takes_its_perceiver_latents() -> None:
    """The tiny Idefics2 at its tower's 64 pixels: one image, 8 latents, so 8 image tokens
    between two <fake_token_around_image> (text ids)."""
    from trainmem.trace.known_values import value_of

    _, batch, notes = _batch(IDEFICS2)
    assert tuple(batch["pixel_values"].shape) == (2, 1, 3, 64, 64)
    ids = value_of(batch["input_ids"])
    assert tuple(ids.shape) == (2, 10 + 16)
    assert (ids[:, 1:9] == 250).all() and not (ids[:, [0, *range(9, 26)]] == 250).any()


def test_query_token_models_place_their_queries() -> None:
    """BLIP-2's processor puts num_query_tokens = 8 <image> tokens before the text; the config
    names no image_token_index, so the vocabulary's last id no field reserves: 255 (pad 1,
    bos / eos 2), set on the config the forward reads. InstructBLIP-Video: 4 frames, 8 x 4 =
    32 placeholders, pixel_values [b, 4, 3, 32, 32]."""
    from trainmem.trace.known_values import value_of

    model, batch, notes = _batch(BLIP2)
    ids = value_of(batch["input_ids"])
    assert tuple(ids.shape) == (2, 8 + 16) and (ids[:, :8] == 255).all()
    assert not (ids[:, 8:] == 255).any() and model.config.image_token_index == 255
    model, batch, notes = _batch(INSTRUCTBLIP_VIDEO)
    assert tuple(batch["pixel_values"].shape) == (2, 4, 3, 32, 32)
    ids = value_of(batch["input_ids"])
    assert tuple(ids.shape) == (2, 32 + 16) and (ids[:, :32] == 255).all()
    assert model.config.video_token_index == 255
    assert tuple(batch["qformer_input_ids"].shape) == (2, 16)


def test_idefics_attends_to_its_image_from_the_image_token_on() -> None:
    """IDEFICS: <fake_token_around_image><image><fake_token_around_image> then the text;
    processing_idefics.py's image_attention_mask is -1 (no image) before the first <image>
    and 0 (image 0) from it on, one-hot: [0, 1, 1, ...] per sample, [b, 3 + s, 1]."""
    from trainmem.trace.known_values import value_of

    _, batch, _ = _batch(IDEFICS)
    assert tuple(batch["pixel_values"].shape) == (2, 1, 3, 32, 32)
    mask = value_of(batch["image_attention_mask"])
    assert mask[:, :, 0].tolist() == [[0] + [1] * 18] * 2


@pytest.mark.parametrize("path", [IDEFICS, BLIP2, INSTRUCTBLIP_VIDEO, IDEFICS2])
def test_each_family_estimates_with_its_image(invoke_json, path) -> None:
    out = invoke_json("estimate", path, "--engine", "generic", "-b", "2", "-s", "16")
    said = [n for n in out["notes"] if n.startswith("vision-language model")]
    assert len(said) == 1 and "text only" not in said[0]


def test_a_query_token_model_refuses_another_resolution(invoke) -> None:
    result = invoke("estimate", BLIP2, "--engine", "generic", "--resolution", "48", exit_code=2)
    assert "32 x 32" in result.stderr


PIX2STRUCT = MODELS_DIR / "vlm" / "pix2struct.json"
"""A 2 + 2 layer Pix2Struct, patch_embed_hidden_size 48 (4 x 4 pixel patches of 3 channels)."""


def test_pix2struct_takes_its_processors_flattened_patches(invoke, invoke_json) -> None:
    """The processor's flattened_patches: max_patches = 2048 rows of (row id, column id, 48
    pixel values) = 50 (image_processing_pix2struct.py extract_flattened_patches, padded to
    max_patches whatever the image), and the decoder's 16 label ids; --resolution changes
    nothing, so it is refused."""
    from transformers.models.pix2struct.image_processing_pil_pix2struct import (
        Pix2StructImageProcessorPil,
    )

    processor = Pix2StructImageProcessorPil(patch_size={"height": 4, "width": 4})
    for height, width in ((64, 64), (1000, 300)):
        image = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
        out = processor(images=[image], return_tensors="pt")
        assert tuple(out["flattened_patches"].shape) == (1, 2048, 50)
    _, batch, notes = _batch(PIX2STRUCT)
    assert tuple(batch["flattened_patches"].shape) == (2, 2048, 50)
    assert tuple(batch["labels"].shape) == (2, 16) and "input_ids" not in batch
    out = invoke_json("estimate", PIX2STRUCT, "--engine", "generic", "-b", "1", "-s", "16")
    said = [n for n in out["notes"] if n.startswith("vision-language model")]
    assert len(said) == 1 and "2048 flattened patches" in said[0]
    result = invoke(
        "estimate", PIX2STRUCT, "--engine", "generic", "--resolution", "64", exit_code=2
    )
    assert "max_patches" in result.stderr


def test_an_encoder_decoder_blip2_learns_the_text_alone(tmp_path) -> None:
    """BLIP-2 with Flan-T5: the query outputs and the prompt go to the encoder (8 + 16 ids),
    the labels are the decoder's target text, 16 ids (modeling_blip_2.py passes ``labels`` to
    the T5 language model)."""
    raw = json.loads(BLIP2.read_text())
    raw["text_config"] = {
        "model_type": "t5",
        "vocab_size": 256,
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_heads": 4,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    _, batch, _ = _batch(path)
    assert tuple(batch["input_ids"].shape) == (2, 8 + 16)
    assert tuple(batch["labels"].shape) == (2, 16)
