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


QWEN2_VL = MODELS_DIR / "vlm" / "qwen2_vl.json"
"""A 2 + 2 layer Qwen2-VL: patch_size 8, spatial_merge_size 2, temporal_patch_size 2, 3 channels,
image token 250, mrope_section [2, 3, 3]."""


def _qwen2_vl_batch(image_size: tuple[int, int] | None) -> tuple[dict, list[str]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.hf_model import build_hf_model, make_hf_batch, materialize_fake

    model = build_hf_model(json.loads(QWEN2_VL.read_text()))
    fake = FakeTensorMode()
    materialize_fake(model, fake)
    notes: list[str] = []
    with fake:
        batch = make_hf_batch(model, 2, 24, image_size=image_size, notes=notes)
    return batch, notes


def test_a_grid_model_takes_its_processor_patches_grid_and_positions() -> None:
    """Qwen2-VL's processor layout, by hand: a 64 x 96 image in 8-pixel patches is an 8 x 12
    grid, 96 patches of 3 x 2 x 8 x 8 = 384 values; merged 2 x 2, 24 image tokens. M-RoPE
    (Qwen2-VL paper, sec. 2.1): image token i of the 4 x 6 merged grid sits at (0, i // 6,
    i % 6); the text resumes at max(4, 6) = 6 on all three axes."""
    from trainmem.trace.known_values import value_of

    batch, notes = _qwen2_vl_batch((64, 96))
    assert tuple(batch["pixel_values"].shape) == (2 * 96, 384)
    assert value_of(batch["image_grid_thw"]).tolist() == [[1, 8, 12]] * 2
    ids = value_of(batch["input_ids"])
    assert tuple(ids.shape) == (2, 24 + 24)
    assert (ids[:, :24] == 250).all() and not (ids[:, 24:] == 250).any()
    assert value_of(batch["mm_token_type_ids"]).tolist() == [[1] * 24 + [0] * 24] * 2
    pos = value_of(batch["position_ids"])
    assert tuple(pos.shape) == (3, 2, 48)
    i = torch.arange(24)
    assert pos[0, :, :24].eq(0).all()
    assert torch.equal(pos[1, 0, :24], i // 6) and torch.equal(pos[2, 0, :24], i % 6)
    assert all(torch.equal(pos[k, 1, 24:], torch.arange(6, 30)) for k in range(3))
    assert any("64 x 96 pixel image" in n and "24 image tokens" in n for n in notes)


def test_a_grid_model_rounds_the_image_as_its_processor_does() -> None:
    """``smart_resize`` rounds each side to the nearest multiple of patch x merge (16 here):
    70 -> 64, 90 -> 96; without a size, the largest square of at most 28 * 28 * 1280 =
    1,003,520 pixels: isqrt = 1001, so 62 x 16 = 992 here and 35 x 28 = 980 for Qwen2-VL's
    14-pixel patches."""
    from trainmem.trace.hf_inputs import grid_image_side

    assert grid_image_side(16, (70, 90)) == (64, 96)
    assert grid_image_side(16, (3, 3)) == (16, 16)  # at least one merged patch
    assert grid_image_side(16, None) == (992, 992)
    assert grid_image_side(28, None) == (980, 980)
    batch, notes = _qwen2_vl_batch((70, 90))
    assert tuple(batch["pixel_values"].shape) == (2 * 96, 384)


def test_a_vision_language_estimate_says_what_image_it_traced(invoke_json) -> None:
    out = invoke_json(
        "estimate", QWEN2_VL, "--engine", "generic", "-b", "1", "-s", "16", "--resolution", "32"
    )
    said = [n for n in out["notes"] if n.startswith("vision-language model")]
    assert len(said) == 1 and "32 x 32 pixel image" in said[0] and "4 image tokens" in said[0]
    out = invoke_json("estimate", LLAVA, "--engine", "generic", "-b", "1", "-s", "16")
    said = [n for n in out["notes"] if n.startswith("vision-language model")]
    assert len(said) == 1 and "32 x 32 pixel image" in said[0] and "16 image tokens" in said[0]


def test_more_image_tokens_cost_more_memory(invoke_json) -> None:
    """The image's tokens go through the language model: a larger image at the same text
    length raises the peak (32 x 32: 4 image tokens; 128 x 128: 64)."""

    def peak(resolution: str) -> int:
        out = invoke_json(
            "estimate",
            QWEN2_VL,
            "--engine",
            "generic",
            "-b",
            "1",
            "-s",
            "16",
            "--resolution",
            resolution,
        )
        return int(out["peak"]["allocated_bytes"])

    assert peak("128") > peak("32")


def test_a_fixed_size_tower_refuses_another_resolution(invoke) -> None:
    result = invoke("estimate", LLAVA, "--engine", "generic", "--resolution", "48", exit_code=2)
    assert "resolution" in result.stderr and "32 x 32" in result.stderr
    result = invoke("estimate", LLAVA, "--engine", "generic", "--frames", "5", exit_code=2)
    assert "--resolution and --seq-len" in result.stderr
    invoke("estimate", LLAVA, "--engine", "generic", "--resolution", "32")  # its own size


def test_a_step_that_fails_with_the_default_image_falls_back_to_text(monkeypatch) -> None:
    """A forward that cannot run the image on fake tensors (MiniMax-M3-VL's boolean index over
    the whole embedding): without --resolution the step is traced on text and the notes say
    so; with it, the failure stands. The failure is forced here in Qwen2-VL's placeholder
    check, which runs only when the batch has pixels."""
    import transformers.models.qwen2_vl.modeling_qwen2_vl as qwen2_vl

    from trainmem.errors import TrainmemError
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("forced")

    monkeypatch.setattr(qwen2_vl.Qwen2VLModel, "get_placeholder_mask", fail)
    est = estimate(str(QWEN2_VL), TrainingConfig(seq_len=16), engine="generic")
    said = [n for n in est.notes if n.startswith("vision-language model")]
    assert len(said) == 1 and "text only" in said[0] and "forced" in said[0]
    with pytest.raises(TrainmemError, match="forced"):
        estimate(str(QWEN2_VL), TrainingConfig(seq_len=16, resolution=32), engine="generic")


def test_the_checkpoint_dtype_in_a_config_does_not_set_the_run_weights(
    invoke_json, tmp_path
) -> None:
    """A hub config names its checkpoint's dtype (``"torch_dtype": "bfloat16"``), and
    transformers builds a composite's language model in its sub-config's dtype; the run's
    weights are the precision's. bf16-mixed AdamW, by hand (mixed-precision training,
    Micikevicius et al. 2018, sec. 3.1: fp32 master weights): fp32 gradients, 4 bytes per
    parameter, and two fp32 Adam moments, 8 bytes per parameter, for every parameter;
    bf16-true: 2 and 4."""
    raw = json.loads(QWEN2_VL.read_text())
    raw["torch_dtype"] = "bfloat16"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    for precision, grad, states in (("bf16-mixed", 4, 8), ("bf16-true", 2, 4)):
        out = invoke_json(
            "estimate",
            path,
            "--engine",
            "generic",
            "-s",
            "16",
            "--resolution",
            "32",
            "--precision",
            precision,
        )
        n = out["num_parameters"]
        assert out["model_states_bytes"]["gradients"] == grad * n
        assert out["model_states_bytes"]["optimizer_states"] == states * n


MISTRAL3 = MODELS_DIR / "vlm" / "mistral3.json"
"""A 2 + 2 layer Mistral-3 (Pixtral tower: image_size 64, patch_size 8; spatial_merge_size 2)."""


def test_an_any_size_tower_takes_its_image_sizes(invoke_json) -> None:
    """Pixtral in Mistral-3 takes any image up to its config's size, with ``image_sizes``; by
    hand: 64 x 64 in 8-pixel patches, merged 2 x 2, is 4 x 4 = 16 image tokens. 100 x 50 is
    scaled to fit 64 (x 0.64: 64 x 32, image_processing_pixtral.py), 4 x 2 = 8 tokens."""
    for args, said in (((), "64 x 64 pixel image"), (("--resolution", "100x50"), "64 x 32")):
        out = invoke_json("estimate", MISTRAL3, "--engine", "generic", "-s", "16", *args)
        notes = [n for n in out["notes"] if n.startswith("vision-language model")]
        tokens = "16 image tokens" if not args else "8 image tokens"
        assert len(notes) == 1 and said in notes[0] and tokens in notes[0]


LLAVA_NEXT = MODELS_DIR / "vlm" / "llava_next.json"
"""The tiny LLaVA (CLIP 32 x 32 in 8-pixel patches) as LLaVA-NeXT with image_grid_pinpoints
[[32, 64], [64, 32], [64, 64]]."""


def test_an_anyres_model_takes_its_tiles_and_unpadded_grid(invoke_json) -> None:
    """LLaVA-NeXT's "anyres", by hand (image_processing_llava_next.py select_best_resolution,
    modeling_llava_next.py pack_image_features / unpad_image):

    - 32 x 32: every pinpoint keeps 32 x 32 effective pixels, the least waste is 32 x 64, so
      1 x 2 tiles and the whole image: the base tile's 4 x 4 = 16 features ("default" drops
      CLIP's class token), the tiles' 4 x 8 grid unpadded to the image's square 4 x 4 with a
      newline per row, 4 x 5 = 20: 36 image tokens;
    - 64 x 64: 64 x 64 fits best, 2 x 2 tiles: 16 + 8 x (8 + 1) = 88."""
    for resolution, tokens in (("32", 36), ("64", 88)):
        out = invoke_json(
            "estimate", LLAVA_NEXT, "--engine", "generic", "-s", "16", "--resolution", resolution
        )
        notes = [n for n in out["notes"] if n.startswith("vision-language model")]
        assert len(notes) == 1 and f"{tokens} image tokens" in notes[0], notes
