"""A diffusers pipeline's frozen models (issue 26, ``--frozen-on-gpu``): every shipped count is
``sum(p.numel())`` of its class built from the Hub config on ``meta`` (the configs are written
out here, field by field, from the Hub's config.json files), and the option picks the
components and dtypes the training scripts move to the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.diffusers import FROZEN_COMPONENTS, frozen_components
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig

# openai/clip-vit-large-patch14 text_config; laion/CLIP-ViT-bigG-14-laion2B-39B-b160k
# text_config (SDXL's text_encoder_2/config.json); google/t5-v1_1-xxl; google/umt5-xxl
CLIP_L = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
    projection_dim=768,
)  # fmt: skip
CLIP_G = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
    num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280,
)  # fmt: skip
T5_XXL = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
)  # fmt: skip
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
VAE = dict(
    in_channels=3, out_channels=3, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    norm_num_groups=32, act_fn="silu",
)  # fmt: skip

# diffusers scripts/convert_ltx_to_diffusers.py get_vae_config("0.9.0"); HunyuanVideo's
# text_encoder/config.json (LlamaModel of llava-llama-3-8b-v1_1)
LTX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(128, 256, 512, 512),
    down_block_types=("LTXVideoDownBlock3D",) * 4, decoder_block_out_channels=(128, 256, 512, 512),
    layers_per_block=(4, 3, 3, 3, 4), decoder_layers_per_block=(4, 3, 3, 3, 4),
    spatio_temporal_scaling=(True, True, True, False),
    decoder_spatio_temporal_scaling=(True, True, True, False),
    decoder_inject_noise=(False,) * 5, downsample_type=("conv",) * 4,
    upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, patch_size=4, patch_size_t=1,
    resnet_norm_eps=1e-6, scaling_factor=1.0, encoder_causal=True, decoder_causal=False,
    timestep_conditioning=False,
)  # fmt: skip
LLAVA_LLAMA_3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128320, tie_word_embeddings=False,
)  # fmt: skip


def _count(source: str) -> int:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    df = pytest.importorskip("diffusers")
    builders: dict[str, Any] = {
        "CLIPTextModel, openai": lambda: tf.CLIPTextModel(tf.CLIPTextConfig(**CLIP_L)),
        "CLIPTextModelWithProjection, openai": lambda: tf.CLIPTextModelWithProjection(
            tf.CLIPTextConfig(**CLIP_L)
        ),
        "CLIPTextModelWithProjection, laion": lambda: tf.CLIPTextModelWithProjection(
            tf.CLIPTextConfig(**CLIP_G)
        ),
        "T5EncoderModel": lambda: tf.T5EncoderModel(tf.T5Config(**T5_XXL)),
        "UMT5EncoderModel": lambda: tf.UMT5EncoderModel(tf.UMT5Config(**UMT5_XXL)),
        "AutoencoderKL, 16": lambda: df.AutoencoderKL(
            latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, **VAE
        ),
        "AutoencoderKL, 4": lambda: df.AutoencoderKL(latent_channels=4, **VAE),
        "AutoencoderKLWan": lambda: df.AutoencoderKLWan(),
        "AutoencoderKLLTXVideo": lambda: df.AutoencoderKLLTXVideo(**LTX_VAE),
        "AutoencoderKLHunyuanVideo": lambda: df.AutoencoderKLHunyuanVideo(),
        "AutoencoderKLCogVideoX": lambda: df.AutoencoderKLCogVideoX(),
        "LlamaModel": lambda: tf.LlamaModel(tf.LlamaConfig(**LLAVA_LLAMA_3_8B)),
    }
    (build,) = [b for prefix, b in builders.items() if source.startswith(prefix)]
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


SOURCES = sorted({c.source: c.num_params for cs in FROZEN_COMPONENTS.values() for c in cs}.items())


@pytest.mark.parametrize(("source", "num_params"), SOURCES, ids=[s for s, _ in SOURCES])
def test_each_count_is_the_class_built_on_meta(source: str, num_params: int) -> None:
    assert _count(source) == num_params


def test_the_issue_figures() -> None:
    flux = {c.attribute: c.num_params for c in FROZEN_COMPONENTS["FluxTransformer2DModel"]}
    assert flux == {
        "text_encoder": 123_060_480,  # CLIP-L
        "text_encoder_2": 4_762_310_656,  # T5-XXL encoder
        "vae": 83_819_683,
    }


def test_the_option_picks_the_components_and_their_dtypes() -> None:
    flux = load_hf_config("flux.1-dev-transformer")
    bf16 = TrainingConfig(precision="bf16-mixed", frozen_on_gpu="all")
    assert frozen_components(flux, bf16) == [
        ("text_encoder", 123_060_480, "bfloat16"),  # weight_dtype: the 16-bit compute dtype
        ("text_encoder_2", 4_762_310_656, "bfloat16"),
        ("vae", 83_819_683, "bfloat16"),
    ]
    assert frozen_components(flux, TrainingConfig(frozen_on_gpu="vae")) == [
        ("vae", 83_819_683, "bfloat16")
    ]
    assert frozen_components(flux, TrainingConfig(frozen_on_gpu="none")) == []
    fp32 = TrainingConfig(precision="32-true", frozen_on_gpu="text-encoders")
    assert [d for *_, d in frozen_components(flux, fp32)] == ["float32", "float32"]
    # SDXL's script keeps its VAE in fp32 ("to avoid NaN losses")
    sdxl = load_hf_config("sdxl-base-1.0-unet")
    assert frozen_components(sdxl, TrainingConfig(frozen_on_gpu="vae")) == [
        ("vae", 83_653_863, "float32")
    ]
    sd3 = load_hf_config("sd3-medium-transformer")
    assert len(frozen_components(sd3, TrainingConfig(frozen_on_gpu="text-encoders"))) == 3


def test_refused_where_there_is_no_pipeline(invoke: Invoke) -> None:
    with pytest.raises(SpecError, match="^frozen_on_gpu"):
        TrainingConfig(frozen_on_gpu="unet")
    sd15 = {**load_hf_config("sdxl-base-1.0-unet"), "addition_embed_type": None}
    with pytest.raises(SpecError, match="SDXL"):
        frozen_components(sd15, TrainingConfig(frozen_on_gpu="vae"))
    r = invoke("estimate", "gpt2", "-s", "128", "--frozen-on-gpu", "vae", exit_code=2)
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: frozen_on_gpu: vae: the VAE and text encoders"), r.stderr


def test_sd1_unet_keeps_clip_l_and_the_vae_in_the_compute_dtype() -> None:
    # an SD 1.x UNet (cross_attention_dim 768, no added conditions): train_dreambooth.py /
    # train_controlnet.py move CLIP-L and the 4-channel VAE with dtype=weight_dtype; counts as
    # built on meta above (CLIPTextModel 123,060,480; AutoencoderKL 83,653,863)
    sd1 = load_hf_config(str(Path(__file__).resolve().parents[1] / "models" / "diffusers"
                             / "tiny-sd1-unet.json"))  # fmt: skip
    kept = frozen_components(sd1, TrainingConfig(frozen_on_gpu="all", precision="16-mixed"))
    assert kept == [("text_encoder", 123_060_480, "float16"), ("vae", 83_653_863, "float16")]
    trained = TrainingConfig(frozen_on_gpu="all", train_text_encoder=True)
    assert frozen_components(sd1, trained) == [("vae", 83_653_863, "bfloat16")]


def test_video_pipelines_as_finetrainers_keeps_them() -> None:
    # finetrainers (e5df80c) without precomputation: the condition and latent models in bf16
    # beside the transformer. Its LTX-Video doc's "before training start" 13.486 GiB allocated
    # is these two plus the transformer (1,923,385,472) and LoRA r 128 (117,440,512), all bf16:
    # (4,762,310,656 + 419,193,649 + 1,923,385,472 + 117,440,512) x 2 B = 13.453 GiB
    bf16 = TrainingConfig(precision="bf16-mixed", frozen_on_gpu="all")
    ltx = frozen_components({"_class_name": "LTXVideoTransformer3DModel"}, bf16)
    assert ltx == [("text_encoder", 4_762_310_656, "bfloat16"), ("vae", 419_193_649, "bfloat16")]
    total = sum(n for _, n, _ in ltx) + 1_923_385_472 + 117_440_512
    assert abs(total * 2 / 2**30 - 13.486) < 0.05
    hunyuan = frozen_components({"_class_name": "HunyuanVideoTransformer3DModel"}, bf16)
    assert [a for a, *_ in hunyuan] == ["text_encoder", "text_encoder_2", "vae"]
    cog = frozen_components({"_class_name": "CogVideoXTransformer3DModel"}, bf16)
    assert [n for _, n, _ in cog] == [4_762_310_656, 215_583_907]
