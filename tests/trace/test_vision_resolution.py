"""``--resolution`` on a transformers vision model: the image size it trains at.

A vision encoder's sequence is its image's patches (+1 [CLS]), so the formulas take the token
count from the resolution (the patch convolution's stride-p grid), the generic path feeds
``pixel_values`` of that size (with ``interpolate_pos_encoding`` where the model's forward
takes it), and an explicit ``--seq-len`` that is not that count is refused (it was accepted and
ignored: the same peak at any ``--seq-len``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke, InvokeJson

TINY_DINOV2 = Path(__file__).parents[1] / "analytic" / "hard_configs" / "tiny-dinov2.json"
TINY_VIT = {
    "architectures": ["ViTForImageClassification"],
    "model_type": "vit",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_channels": 3,
    "num_labels": 10,
    "patch_size": 8,
    "image_size": 32,
}


def _tiny_vit(tmp_path: Path) -> str:
    path = tmp_path / "tiny-vit.json"
    path.write_text(json.dumps(TINY_VIT))
    return str(path)


@pytest.mark.parametrize(
    ("model", "resolution", "tokens"),
    [
        # ViT-L/16: (384 // 16) x (512 // 16) patches + [CLS] = 24 x 32 + 1
        ("vit-large-patch16-224", "384x512", 769),
        # DINOv2-L/14 (config 518 px): 384 // 14 = 27 -> 27^2 + 1; its table is interpolated
        ("dinov2-large", "384", 730),
        # SigLIP so400m/14 has no [CLS]: (224 // 14)^2
        ("siglip-so400m-patch14-384-vision", "224", 256),
    ],
)
def test_the_sequence_is_the_patches_of_the_resolution(
    invoke_json: InvokeJson, model: str, resolution: str, tokens: int
) -> None:
    out = invoke_json(
        "estimate", model, "-b", "2", "--resolution", resolution, "--engine", "analytic"
    )
    assert out["config"]["seq_len"] == tokens


def test_the_peak_follows_the_resolution(invoke_json: InvokeJson) -> None:
    small = invoke_json("estimate", "vit-large-patch16-224", "-b", "8", "--engine", "analytic")
    large = invoke_json(
        "estimate",
        "vit-large-patch16-224",
        "-b",
        "8",
        "--resolution",
        "384",
        "--engine",
        "analytic",
    )
    # the weights are the config's (its position table interpolated), the activations grow
    assert large["num_parameters"] == small["num_parameters"]
    assert large["peak"]["allocated_bytes"] > small["peak"]["allocated_bytes"] + 2**30


def test_a_seq_len_that_is_not_the_patches_is_refused(invoke: Invoke) -> None:
    result = invoke("estimate", "vit-large-patch16-224", "-s", "577", exit_code=2)
    err = result.stderr.strip()
    assert err.startswith("error: seq_len: 577"), err
    assert "197 at 224x224 px" in err and "--resolution" in err
    # the count at the resolution given is accepted
    invoke("estimate", "vit-large-patch16-224", "-s", "577", "--resolution", "384")


def test_resolution_is_refused_on_a_language_model(invoke: Invoke) -> None:
    result = invoke("estimate", "gpt2", "--resolution", "512", exit_code=2)
    assert result.stderr.strip().startswith("error: resolution: "), result.stderr
    assert "takes tokens" in result.stderr


def test_frames_are_refused_on_an_image_model(invoke: Invoke) -> None:
    result = invoke("estimate", "vit-large-patch16-224", "--frames", "5", exit_code=2)
    assert result.stderr.strip().startswith("error: frames: "), result.stderr
    assert "--resolution" in result.stderr


def test_the_web_page_reports_the_sequence_it_computed() -> None:
    from trainmem.web.compute import resolve_request
    from trainmem.web.form import default_values

    values = {**default_values(), "model": "vit-large-patch16-224", "resolution": "384"}
    assert resolve_request(values).training.seq_len == 577  # 24^2 + 1


@pytest.mark.parametrize(("make_config", "resolution"), [("vit", "48x64"), ("dinov2", "32x48")])
def test_the_generic_path_agrees_with_the_formulas(
    invoke_json: InvokeJson, tmp_path: Path, make_config: str, resolution: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = _tiny_vit(tmp_path) if make_config == "vit" else str(TINY_DINOV2)
    args = ("estimate", config, "-b", "4", "--resolution", resolution, "-p", "32-true")
    formulas = invoke_json(*args, "--engine", "analytic")["peak"]["allocated_bytes"]
    traced = invoke_json(*args, "--engine", "generic")["peak"]["allocated_bytes"]
    assert abs(traced - formulas) / traced < 0.01, (formulas, traced)


def test_the_traced_batch_is_the_resolution() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    from trainmem.trace.hf_model import make_hf_batch

    with torch.device("meta"):
        model = SegformerForSemanticSegmentation(SegformerConfig(num_labels=5))
        batch = make_hf_batch(model, 2, 0, image_size=(64, 96))
    assert tuple(batch["pixel_values"].shape) == (2, 3, 64, 96)
    assert tuple(batch["labels"].shape) == (2, 64, 96)  # per-pixel labels at that size


def test_a_sweep_over_the_sequence_of_a_vision_encoder_is_refused(invoke: Invoke) -> None:
    args = ("sweep", "vit-large-patch16-224", "-b", "32", "--gpu", "A100-80GB", "--over")
    result = invoke(*args, "seq-len=197,577", exit_code=2)
    assert result.stderr.strip().startswith("error: seq_len: "), result.stderr
    assert "--over resolution=" in result.stderr
    rows = invoke(*args, "resolution=224,384", "--format", "csv").stdout.strip().splitlines()
    allocated = [int(row.split(",")[2]) for row in rows[1:]]
    assert allocated[1] > allocated[0] + 2**30  # 577 tokens a sample, not 197


def test_a_resolution_under_one_patch_is_refused(invoke: Invoke) -> None:
    # ViT-L/16: a 8 px side gives the stride-16 patch convolution no output (it was estimated
    # as [CLS] alone)
    result = invoke("estimate", "vit-large-patch16-224", "--resolution", "8", exit_code=2)
    assert result.stderr.strip().startswith("error: resolution: 8x8 px"), result.stderr
    assert "at least 16 px" in result.stderr


def test_the_library_refuses_the_seq_len_the_cli_refuses(invoke: Invoke) -> None:
    from trainmem import TrainingConfig, estimate
    from trainmem.errors import SpecError

    result = invoke("estimate", "vit-large-patch16-224", "-s", "512", exit_code=2)
    with pytest.raises(SpecError) as exc:
        estimate("vit-large-patch16-224", TrainingConfig(seq_len=512))
    assert result.stderr.strip() == f"error: {exc.value}"
    assert "197 at 224x224 px" in str(exc.value)  # (224 // 16)^2 + 1


def test_the_library_takes_the_resolution(invoke_json: InvokeJson) -> None:
    from trainmem import TrainingConfig, estimate

    cli = invoke_json(
        "estimate", "vit-large-patch16-224", "-b", "2", "--resolution", "384", "-e", "analytic"
    )
    for training in (
        TrainingConfig(micro_batch_size=2, resolution=384),  # seq_len left at its default
        TrainingConfig(micro_batch_size=2, resolution=384, seq_len=577),  # (384 // 16)^2 + 1
    ):
        lib = estimate("vit-large-patch16-224", training, engine="analytic").to_dict()
        lib = json.loads(json.dumps(lib))  # as the CLI prints it (tuples as lists)
        assert lib["config"]["seq_len"] == 577 and lib["config"] == cli["config"]
        assert lib["peak"] == cli["peak"]
        # its position table is interpolated to the patches: no "beyond the context" warning
        assert not any("beyond the model's context" in n for n in lib["notes"])


def test_the_web_page_refuses_the_seq_len_the_cli_refuses(invoke: Invoke) -> None:
    from trainmem.errors import SpecError
    from trainmem.web.compute import resolve_request
    from trainmem.web.form import default_values

    result = invoke("estimate", "vit-large-patch16-224", "-s", "512", exit_code=2)
    values = {**default_values(), "model": "vit-large-patch16-224", "seq_len": 512}
    with pytest.raises(SpecError) as exc:
        resolve_request(values)
    assert result.stderr.strip() == f"error: {exc.value}"


SEGFORMER = Path(__file__).parents[1] / "models" / "heads" / "segformer.json"
"""A tiny SegFormer, image_size 128: a pixel model the formulas do not model."""


def test_a_generic_pixel_model_reports_its_images_not_a_sequence(
    invoke: Invoke, invoke_json: InvokeJson
) -> None:
    pytest.importorskip("transformers")
    from trainmem import TrainingConfig, estimate
    from trainmem.errors import SpecError

    config = invoke_json("estimate", str(SEGFORMER))["config"]
    assert config["seq_len"] is None and config["resolution"] == 128  # the config's image_size
    config = invoke_json("estimate", str(SEGFORMER), "--resolution", "64x96")["config"]
    assert config["seq_len"] is None and config["resolution"] == "64x96"
    table = invoke("estimate", str(SEGFORMER)).stdout
    assert "resolution=128" in table and "seq_len=" not in table
    # a sequence length it does not read is refused, by the CLI and the library alike
    result = invoke("estimate", str(SEGFORMER), "-s", "512", exit_code=2)
    assert "--resolution" in result.stderr
    with pytest.raises(SpecError) as exc:
        estimate(str(SEGFORMER), TrainingConfig(seq_len=512))
    assert result.stderr.strip() == f"error: {exc.value}"


def test_a_head_on_a_vision_backbone_takes_the_resolution(invoke_json: InvokeJson) -> None:
    """UperNet keeps ``num_channels`` in its ``backbone_config`` (transformers
    ``UperNetConfig``; the Hub's openmmlab/upernet-* files): ``--resolution`` was refused as
    for a language model ("this model takes tokens"), so mmsegmentation's UperNet runs could
    not be expressed (benchmarks/published_probe_vision.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = str(Path(__file__).parents[1] / "models" / "heads" / "upernet_convnext.json")
    args = ("estimate", config, "-b", "2", "-p", "32-true", "--engine", "generic")
    small = invoke_json(*args, "--resolution", "64")
    large = invoke_json(*args, "--resolution", "128")
    assert (small["config"]["resolution"], large["config"]["resolution"]) == (64, 128)
    assert small["config"]["seq_len"] is None
    # 3-class fp32 logits upsampled to the labels' size, and their log-softmax: at least
    # 2 x 2 x 3 x (128^2 - 64^2) x 4 bytes more at four times the pixels
    gap = large["peak"]["allocated_bytes"] - small["peak"]["allocated_bytes"]
    assert gap > 2 * 2 * 3 * (128**2 - 64**2) * 4, gap
