"""The issue 15 families with blocks unlike a decoder's: deepseek_v3 (multi-head latent
attention, shared + routed experts, first dense layers), t5 (encoder-decoder, relative position
bias, relu / gated-gelu MLP) and the vision towers clip_vision_model, siglip_vision_model and
dinov2 (layer scale, SwiGLU).

Expected values:
- parameter counts: transformers builds each config's class on the meta device and we sum
  ``p.numel()`` (:func:`tests.analytic.test_params.meta_numel`); for the presets also the
  published size;
- peak allocated bytes: the trace engine, which runs the real transformers model of the same
  2-layer config on fake tensors (``--engine trace``);
- the mean block over layer kinds: a hand sum of the per-kind blocks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainmem.analytic.activation_shapes import tokens_per_sequence
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.params import num_parameters, parameter_counts
from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.hf import load_hf_config, load_model_spec, model_spec_from_hf
from trainmem.specs.training import TrainingConfig

CONFIGS = Path(__file__).parent / "hard_configs"
TINY = sorted(p.name for p in CONFIGS.glob("tiny-*.json"))

PUBLISHED = {
    # DeepSeek-V3 technical report (arXiv:2412.19437): 671B total parameters in the main
    # model (the 14B MTP module is not part of transformers' DeepseekV3ForCausalLM)
    "deepseek-v3": (671_026_404_352, 671e9, 0.001),
    # model cards / papers: CLIP ViT-L/14 vision tower 303M; SigLIP So400m (the
    # "shape-optimized 400M" tower, Alabdulmohsin et al. 2023) 428M with its pooling head;
    # DINOv2 ViT-g/14 1.1B and ViT-L/14 304M (Oquab et al. 2023, Table 1 of the model cards)
    "clip-vit-large-patch14-vision": (303_179_776, 303e6, 0.01),
    "siglip-so400m-patch14-384-vision": (428_225_600, 400e6, 0.08),
    "dinov2-giant": (1_136_480_768, 1.1e9, 0.04),
    "dinov2-large": (304_368_640, 304e6, 0.01),
    # t5-base: 222.9M (T5ForConditionalGeneration, tied head). flan-t5-xl's checkpoint has
    # 2.85B with its separate lm_head, but transformers 5 always ties T5's LM head to the
    # shared embedding (T5Config.__post_init__), so its model has 2.78B
    "t5-base": (222_903_552, 223e6, 0.01),
    "flan-t5-xl": (2_783_959_040, 2.85e9 - 32128 * 2048, 0.001),
}


def meta_numel(config_dict: dict[str, object]) -> int:
    from tests.analytic.test_params import meta_numel as build

    return build(dict(config_dict))


def test_tiny_configs_cover_every_family() -> None:
    families = {load_hf_config(str(CONFIGS / name))["model_type"] for name in TINY}
    assert families == {
        "deepseek_v3",
        "t5",
        "clip_vision_model",
        "siglip_vision_model",
        "dinov2",
    }


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count(preset: str) -> None:
    exact, published, tolerance = PUBLISHED[preset]
    got = num_parameters(load_model_spec(preset))
    assert abs(got - published) <= tolerance * published
    assert got == exact


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count_equals_transformers_meta_model(preset: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert num_parameters(load_model_spec(preset)) == meta_numel(load_hf_config(preset))


@pytest.mark.parametrize("name", TINY)
def test_tiny_parameter_count_equals_transformers_meta_model(name: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = str(CONFIGS / name)
    assert num_parameters(load_model_spec(path)) == meta_numel(load_hf_config(path))


def test_deepseek_v3_mla_and_moe_by_hand() -> None:
    # DeepSeek-V3 (h = 7168, a = 128, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128): one
    # block's attention, from modeling_deepseek_v3.py DeepseekV3Attention
    h, a = 7168, 128
    attention = (
        h * 1536  # q_a_proj
        + 1536  # q_a_layernorm
        + 1536 * a * 192  # q_b_proj
        + h * (512 + 64)  # kv_a_proj_with_mqa
        + 512  # kv_a_layernorm
        + 512 * a * (128 + 128)  # kv_b_proj
        + a * 128 * h  # o_proj
    )
    dense_mlp = 3 * h * 18432
    moe_mlp = 256 * 3 * h * 2048 + 3 * h * 2048  # routed + 1 shared expert
    router = 256 * h
    counts = parameter_counts(load_model_spec("deepseek-v3"))
    assert counts["layers/attention"] == 61 * attention
    assert counts["layers/mlp"] == 3 * dense_mlp + 58 * moe_mlp
    assert counts["layers/router"] == 58 * router


def test_layer_kinds_and_the_mean_block() -> None:
    spec = load_model_spec(str(CONFIGS / "tiny-deepseek-v3.json"))
    kinds = spec.layer_kinds()
    assert [(n, block.num_experts) for n, block in kinds] == [(1, 1), (1, 8)]
    training = TrainingConfig(micro_batch_size=2, seq_len=64)
    mean = layer_activation_terms(spec, training)
    per_kind = [layer_activation_terms(block, training) for _, block in kinds]
    keys = set(per_kind[0]) | set(per_kind[1])
    for key in keys:
        total = sum(terms.get(key, 0) for terms in per_kind)
        assert mean[key] == -(-total // 2)  # two blocks: the mean, rounded up


def test_deepseek_v3_with_every_layer_dense_by_hand() -> None:
    # first_k_dense_replace = num_hidden_layers: DeepseekV3DecoderLayer builds a DeepseekV3MLP
    # in every layer (``layer_idx >= config.first_k_dense_replace`` never holds), so no expert,
    # router or shared expert exists. tiny-deepseek-v3 (h 64, a 4, q_lora 48, kv_lora 32, nope
    # 16, rope 8, v 16, intermediate 160, vocab 512 untied), per layer:
    attention = 64 * 48 + 48 + 48 * 4 * 24 + 64 * (32 + 8) + 32 + 32 * 4 * 32 + 4 * 16 * 64
    mlp = 3 * 64 * 160
    norms = 2 * 64
    expected = 2 * (attention + mlp + norms) + 2 * 512 * 64 + 64  # + embeddings, head, norm
    assert expected == 164_320
    deepseek = load_hf_config(str(CONFIGS / "tiny-deepseek-v3.json"))
    spec = model_spec_from_hf({**deepseek, "first_k_dense_replace": 2}, "x")
    assert num_parameters(spec) == expected
    assert [(n, block.num_experts) for n, block in spec.layer_kinds()] == [(2, 1)]
    terms = layer_activation_terms(spec, TrainingConfig(micro_batch_size=2, seq_len=64))
    # (before: the MoE block's router, expert and shared-expert terms in every layer)
    assert not [key for key in terms if "expert" in key or "router" in key]


def test_t5_decoder_blocks_see_the_target_length() -> None:
    spec = load_model_spec(str(CONFIGS / "tiny-t5.json"))
    encoder, decoder = (block for _, block in spec.layer_kinds())
    training = TrainingConfig(micro_batch_size=2, seq_len=128, target_seq_len=32)
    assert tokens_per_sequence(encoder, training) == 128
    assert tokens_per_sequence(decoder, training) == 32
    assert decoder.cross_attention and not encoder.cross_attention
    # 0 means "as long as the source"
    same = dataclasses.replace(training, target_seq_len=0)
    assert tokens_per_sequence(decoder, same) == 128


def test_target_seq_len_changes_a_t5_estimate_only() -> None:
    from trainmem.estimate import estimate

    t5 = str(CONFIGS / "tiny-t5.json")
    short = TrainingConfig(micro_batch_size=8, seq_len=256, target_seq_len=32)
    long = dataclasses.replace(short, target_seq_len=256)
    assert (
        estimate(t5, short).breakdown.allocated_bytes < estimate(t5, long).breakdown.allocated_bytes
    )
    llama = "tiny-llama-test"
    a = estimate(llama, dataclasses.replace(short, seq_len=64))
    b = estimate(llama, dataclasses.replace(long, seq_len=64))
    assert a.breakdown.allocated_bytes == b.breakdown.allocated_bytes


def test_bad_target_seq_len_names_the_field() -> None:
    with pytest.raises(SpecError, match="target_seq_len"):
        TrainingConfig(target_seq_len=-1)


def test_vision_towers_sequence_lengths() -> None:
    training = TrainingConfig()
    clip = load_model_spec(str(CONFIGS / "tiny-clip-vision.json"))
    siglip = load_model_spec(str(CONFIGS / "tiny-siglip-vision.json"))
    # 64 px / 4 px patches = 256 patches; CLIP prepends [CLS], SigLIP does not
    assert tokens_per_sequence(clip, training) == 257
    assert tokens_per_sequence(siglip, training) == 256


def test_dinov2_swiglu_width_follows_the_modeling_code() -> None:
    # Dinov2SwiGLUFFN: hidden = int(1536 * 4) = 6144; (int(6144 * 2 / 3) + 7) // 8 * 8 = 4096
    assert load_model_spec("dinov2-giant").intermediate_size == 4096
    assert load_model_spec("dinov2-giant").mlp_kind == "gated"
    assert load_model_spec("dinov2-large").intermediate_size == 4096  # 1024 * 4, plain MLP


def test_unmodelled_options_are_refused_with_the_field() -> None:
    base = load_hf_config(str(CONFIGS / "tiny-dinov2.json"))
    with pytest.raises(UnsupportedError, match="drop_path_rate"):
        model_spec_from_hf({**base, "drop_path_rate": 0.1}, "x")
    with pytest.raises(UnsupportedError, match="Dinov2ForImageClassification"):
        model_spec_from_hf({**base, "architectures": ["Dinov2ForImageClassification"]}, "x")
    siglip = load_hf_config(str(CONFIGS / "tiny-siglip-vision.json"))
    with pytest.raises(UnsupportedError, match="vision_use_head"):
        model_spec_from_hf({**siglip, "vision_use_head": False}, "x")
    t5 = load_hf_config(str(CONFIGS / "tiny-t5.json"))
    with pytest.raises(SpecError, match="feed_forward_proj"):
        model_spec_from_hf({**t5, "feed_forward_proj": "fancy-gated-gelu"}, "x")
    deepseek = load_hf_config(str(CONFIGS / "tiny-deepseek-v3.json"))
    with pytest.raises(SpecError, match="first_k_dense_replace"):
        model_spec_from_hf({**deepseek, "first_k_dense_replace": 3}, "x")


VISION = dict(micro_batch_size=64)
TEXT = dict(micro_batch_size=8, seq_len=256, target_seq_len=64)  # T5: 256 source, 64 target
SETTINGS = {
    "bf16-mixed": dict(precision="bf16-mixed"),
    "bf16-mixed full-AC": dict(precision="bf16-mixed", activation_checkpointing="full"),
}

#: (config, setting) pairs where the formulas are not yet within 1% of the trace engine.
NOT_YET: dict[tuple[str, str], str] = {}


def _cases() -> list[object]:
    out: list[object] = []
    for name in TINY:
        for setting in SETTINGS:
            reason = NOT_YET.get((name, setting))
            marks = [pytest.mark.slow]
            if reason:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            out.append(pytest.param(name, setting, marks=marks, id=f"{name}-{setting}"))
    return out


@pytest.mark.parametrize(("name", "setting"), _cases())
def test_analytic_peak_within_1_percent_of_the_trace(name: str, setting: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainmem.estimate import estimate

    path = str(CONFIGS / name)
    shape = VISION if load_model_spec(path).architecture == "vision-encoder" else TEXT
    training = TrainingConfig(**shape, **SETTINGS[setting])  # type: ignore[arg-type]
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    traced = estimate(path, training, engine="trace", simulate_allocator=False)
    got = analytic.details["per_rank"][0]["allocated_bytes"]
    want = traced.details["per_rank"][0]["allocated_bytes"]
    assert abs(got - want) <= 0.01 * want, (got, want, (got - want) / want)


def test_lora_on_t5_adapts_the_cross_attention_too() -> None:
    # peft adapts every module whose name ends with a target (tuners_utils.py
    # check_target_module_exists), so q,v adapts T5's EncDecAttention.q / .v too: real peft
    # (LoraConfig(r=4, target_modules=["q", "v"]) on this config, CPU) counts 12 adapted
    # linears and 6144 trainable: 2 + 2 blocks' self-attention q, v and 2 decoder blocks'
    # cross-attention q, v, each A [4, 64] + B [64, 4] (d_model 64 = 4 heads x d_kv 16)
    from conftest import MODELS_DIR
    from trainmem.estimate import estimate

    result = estimate(str(MODELS_DIR / "t5.json"), TrainingConfig(lora_rank=4))
    assert TrainingConfig(lora_rank=4).lora_targets == ("q", "v")
    assert result.num_trainable_parameters == 12 * (4 * 64 + 64 * 4)
