"""diffusers configs through the command line: the trace engine builds them, --resolution,
--frames and --text-seq-len describe the batch, and every misuse is one clear line. The step's
bytes are checked against a real CPU run in tests/trace/test_diffusers_real_cpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

CONFIGS = Path(__file__).parent / "diffusers_configs"
FLUX = str(CONFIGS / "tiny-flux.json")
UNET = str(CONFIGS / "tiny-sdxl-unet.json")
WAN = str(CONFIGS / "tiny-wan.json")


def meta_numel(path: str) -> int:
    config = json.loads(Path(path).read_text())
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_tiny_flux_estimates_end_to_end(invoke: Invoke) -> None:
    r = invoke("estimate", FLUX, "--engine", "trace", "--resolution", "256", "--text-seq-len", "32",
            "-b", "2", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    assert d["engine"] == "trace"
    assert d["num_parameters"] == d["num_trainable_parameters"] == meta_numel(FLUX)
    geometry = d["details"]["diffusers"]
    assert (geometry["height"], geometry["width"], geometry["text_seq_len"]) == (256, 256, 32)
    assert geometry["latent_shape"] == [32, 32]  # 256 px / VAE factor 8
    # the activations grow with the image: 4x the pixels, more bytes at the peak
    small = invoke("estimate", FLUX, "--engine", "trace", "--resolution", "128", "--text-seq-len",
                "32", "-b", "2", "--json")  # fmt: skip
    assert json.loads(small.stdout)["peak"]["allocated_bytes"] < d["peak"]["allocated_bytes"]


@pytest.mark.slow  # ~9 s (the UNet traced at 128 px, 77 tokens); the defaults are checked
# torch-free in tests/specs/test_diffusers_settings.py, the UNet's trace in the fast set by
# test_diffusers_real_cpu.py and test_generic.py
def test_tiny_sdxl_unet_estimates_end_to_end_with_its_defaults(invoke: Invoke) -> None:
    r = invoke("estimate", UNET, "--engine", "trace", "--json")
    d = json.loads(r.stdout)
    assert d["num_parameters"] == meta_numel(UNET)
    geometry = d["details"]["diffusers"]
    # sample_size 16 latents x VAE factor 8 = 128 px; SDXL's 77 CLIP tokens
    assert (geometry["height"], geometry["text_seq_len"]) == (128, 77)


def test_lora_on_a_diffusers_model_trains_only_the_adapters(invoke: Invoke) -> None:
    r = invoke("estimate", FLUX, "--engine", "trace", "--resolution", "64", "--text-seq-len", "16",
            "--lora-rank", "4", "--lora-targets", "q,v", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    # to_q/to_v in 4 blocks + add_q_proj/add_v_proj in the 2 double blocks: 12 linears of
    # 32 -> 32 (2 heads x 16), each r * (32 + 32) adapter parameters
    assert d["num_trainable_parameters"] == 12 * 4 * (32 + 32)


def test_video_frames(invoke: Invoke) -> None:
    r = invoke("estimate", WAN, "--engine", "trace", "--resolution", "64x96", "--frames", "9",
            "--text-seq-len", "16", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    assert d["details"]["diffusers"]["latent_shape"] == [3, 8, 12]  # 1 + 8/4 frames, px / 8
    assert d["config"]["resolution"] == "64x96" and d["config"]["frames"] == 9


@pytest.mark.parametrize(
    ("args", "field", "words"),
    [
        ((FLUX, "--engine", "trace", "--frames", "9"), "frames", "image model"),
        ((WAN, "--engine", "trace", "--frames", "10"), "frames", "1 + 4k"),
        ((FLUX, "--engine", "trace", "--resolution", "100"), "resolution", "multiple of 16"),
        ((FLUX, "--engine", "trace", "--resolution", "0"), "resolution", "HEIGHTxWIDTH"),
        (("gpt2", "--resolution", "512"), "resolution", "--seq-len"),
        (("gpt2", "--engine", "trace", "--text-seq-len", "77"), "text_seq_len", "--seq-len"),
        ((FLUX, "--engine", "analytic"), "", "not a formula family"),  # auto: generic path
        ((FLUX, "--engine", "trace", "--lora-rank", "4", "--lora-targets", "gate"), "", "gate"),
    ],
)
def test_misuse_is_one_clear_line(
    invoke: Invoke, args: tuple[str, ...], field: str, words: str
) -> None:
    r = invoke("estimate", *args, exit_code=2)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert field in lines[0] and words in lines[0], lines[0]


@pytest.mark.slow
def test_flux_1_dev_lora_preset(invoke: Invoke) -> None:
    """The real FLUX.1-dev transformer (about 20 s): LoRA r=16 on q, k, v, o. By hand: 19
    double-stream blocks with 8 such 3072 x 3072 linears (to_q/k/v, to_out.0, add_q/k/v_proj,
    to_add_out) and 38 single-stream blocks with 3 (to_q/k/v; the output is proj_out, not an
    attention linear), each 16 * (3072 + 3072) adapter parameters."""
    r = invoke("estimate", "flux.1-dev-transformer", "--engine", "trace", "-p", "bf16-true",
            "--lora-rank", "16", "--lora-targets", "q,k,v,o", "-c", "full", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    lora = (19 * 8 + 38 * 3) * 16 * (3072 + 3072)
    assert d["num_trainable_parameters"] == lora == 26_148_864
    assert d["num_parameters"] == 11_901_408_320 + lora  # presets/index.json, tested vs numel
    # bf16 weights alone are 2 B per parameter
    assert d["peak"]["allocated_bytes"] > 2 * d["num_parameters"]
