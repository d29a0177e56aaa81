"""Remote-code families as table rows (issue 26): Qwen (1), ChatGLM2/3, Baichuan2.

Their modeling code is on the Hub (``trust_remote_code``), not in transformers, so there is no
meta-device model to count. Each count here is summed by hand from the shapes in the family's
modeling file, reading the shipped config's own fields, and must equal both trainmem's
``num_parameters`` and the published total. The configs in tests/models/remote_code/ are the
published config.json files of Qwen/Qwen-7B, THUDM/chatglm3-6b and
baichuan-inc/Baichuan2-7B-Base.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import MODELS_DIR, Invoke
from trainmem.analytic.params import num_parameters
from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.hf import model_spec_from_hf

MODELS = MODELS_DIR / "remote_code"


def _config(name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((MODELS / f"{name}.json").read_text())
    return config


def _count(config: dict[str, Any]) -> int:
    return num_parameters(model_spec_from_hf(config, name="x"))


# --- Qwen (1) ---------------------------------------------------------------------------


def qwen_by_hand(c: dict[str, Any]) -> int:
    """modeling_qwen.py: wte Embedding(V, h); per QWenBlock ln_1 and ln_2 RMSNorm(h), c_attn
    Linear(h, 3 * kv_channels * a) with bias, c_proj Linear(h, kv_channels * a, bias=not
    no_bias), QWenMLP w1 and w2 Linear(h, intermediate_size // 2) and c_proj
    Linear(intermediate_size // 2, h), all bias=not no_bias; ln_f; lm_head Linear(h, V)."""
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    proj = c["kv_channels"] * c["num_attention_heads"]
    ff = c["intermediate_size"] // 2
    bias = 0 if c["no_bias"] else 1
    attention = h * 3 * proj + 3 * proj + proj * h + bias * h
    mlp = 2 * (h * ff + bias * ff) + ff * h + bias * h
    return v * h + layers * (2 * h + attention + mlp) + h + h * v


def test_qwen_7b_count_is_the_published_total() -> None:
    c = _config("qwen-7b")
    assert qwen_by_hand(c) == _count(c) == 7_721_324_544


def test_qwen_fields_map_onto_the_llama_layer() -> None:
    spec = model_spec_from_hf(_config("qwen-7b"), name="x")
    assert (spec.num_kv_heads, spec.head_dim, spec.intermediate_size) == (32, 128, 11008)
    assert spec.fused_qkv and spec.attention_bias
    assert not (spec.attention_out_bias or spec.mlp_bias or spec.tie_word_embeddings)
    # seq_length (8192) is the trained context, not max_position_embeddings (32768)
    assert spec.max_position_embeddings == 8192


def test_qwen_no_bias_false_biases_c_proj_and_the_mlp() -> None:
    c = {**_config("qwen-7b"), "no_bias": False}
    assert _count(c) == qwen_by_hand(c) == 7_721_324_544 + 32 * (2 * 4096 + 2 * 11008)


def test_qwen_kv_channels_must_split_the_width() -> None:
    with pytest.raises(SpecError, match="kv_channels"):
        model_spec_from_hf({**_config("qwen-7b"), "kv_channels": 64}, name="x")


# --- ChatGLM2 / ChatGLM3 ----------------------------------------------------------------


def chatglm_by_hand(c: dict[str, Any]) -> int:
    """modeling_chatglm.py: embedding.word_embeddings Embedding(padded_vocab_size, h); per
    GLMBlock input_layernorm and post_attention_layernorm (RMSNorm: weight; LayerNorm: weight
    and bias), query_key_value Linear(h, (a + 2g) * kv_channels, bias=add_bias_linear or
    add_qkv_bias) with g = multi_query_group_num if multi_query_attention else a, dense
    Linear(a * kv_channels, h, bias=add_bias_linear), dense_h_to_4h Linear(h, 2 *
    ffn_hidden_size), dense_4h_to_h Linear(ffn_hidden_size, h) (bias=add_bias_linear);
    final_layernorm if post_layer_norm; output_layer Linear(h, padded_vocab_size, bias=False)."""
    h, v, layers = c["hidden_size"], c["padded_vocab_size"], c["num_layers"]
    a, d, ff = c["num_attention_heads"], c["kv_channels"], c["ffn_hidden_size"]
    g = c["multi_query_group_num"] if c["multi_query_attention"] else a
    linear_bias = 1 if c["add_bias_linear"] else 0
    qkv_bias = 1 if c["add_bias_linear"] or c["add_qkv_bias"] else 0
    norm = h if c["rmsnorm"] else 2 * h
    qkv = (a + 2 * g) * d
    attention = h * qkv + qkv_bias * qkv + a * d * h + linear_bias * h
    mlp = h * 2 * ff + linear_bias * 2 * ff + ff * h + linear_bias * h
    final = norm if c["post_layer_norm"] else 0
    return v * h + layers * (2 * norm + attention + mlp) + final + h * v


def test_chatglm3_6b_count_is_the_published_total() -> None:
    c = _config("chatglm3-6b")
    assert chatglm_by_hand(c) == _count(c) == 6_243_584_000


def test_chatglm_fields_map_onto_the_llama_layer() -> None:
    spec = model_spec_from_hf(_config("chatglm3-6b"), name="x")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (28, 2, 128)
    assert (spec.intermediate_size, spec.vocab_size, spec.max_position_embeddings) == (
        13696,
        65024,
        8192,
    )
    assert spec.partial_rotary_factor == 0.5  # RotaryEmbedding(kv_channels // 2)
    assert spec.fused_qkv and spec.fused_gate_up and spec.attention_bias
    # architectures names ChatGLMModel, which holds output_layer itself
    assert spec.head == "causal-lm" and not spec.tie_word_embeddings


@pytest.mark.parametrize(
    "change",
    [
        {"multi_query_attention": False},
        {"add_bias_linear": True},
        {"add_qkv_bias": False},
        {"rmsnorm": False},
        {"post_layer_norm": False},
        {"architectures": ["ChatGLMForConditionalGeneration"]},
    ],
)
def test_chatglm_switches_change_the_count_as_the_modeling_code(change: dict[str, Any]) -> None:
    c = {**_config("chatglm3-6b"), **change}
    assert _count(c) == chatglm_by_hand(c)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architectures": ["ChatGLMForSequenceClassification"]}, "architectures"),
        ({"apply_residual_connection_post_layernorm": True}, "post_layernorm"),
        ({"pre_seq_len": 128}, "pre_seq_len"),
    ],
)
def test_chatglm_variants_the_formulas_do_not_model_are_refused(
    change: dict[str, Any], field: str
) -> None:
    with pytest.raises(UnsupportedError, match=field):
        model_spec_from_hf({**_config("chatglm3-6b"), **change}, name="x")


# THUDM/chatglm-6b config.json (the first generation, as published): the same model_type, a
# GLM architecture (2D positions, a GELU MLP of inner_hidden_size, LayerNorm)
CHATGLM_6B_V1 = {
    "architectures": ["ChatGLMModel"],
    "model_type": "chatglm",
    "hidden_size": 4096,
    "inner_hidden_size": 16384,
    "layernorm_epsilon": 1e-05,
    "max_sequence_length": 2048,
    "num_attention_heads": 32,
    "num_layers": 28,
    "position_encoding_2d": True,
    "torch_dtype": "float16",
    "vocab_size": 130528,
}


@pytest.mark.parametrize(
    "extra",
    # as published; with the ChatGLM2 fields a user might add to get past a missing one, which
    # would read its plain 16,384-wide GELU MLP as a gated one of twice that
    [{}, {"ffn_hidden_size": 16384, "padded_vocab_size": 130528}],
)
def test_chatglm_6b_first_generation_is_refused_as_such(extra: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedError, match="position_encoding_2d: a ChatGLM-6B"):
        model_spec_from_hf({**CHATGLM_6B_V1, **extra}, name="x")
    without_2d = {k: v for k, v in CHATGLM_6B_V1.items() if k != "position_encoding_2d"}
    with pytest.raises(UnsupportedError, match="inner_hidden_size: a ChatGLM-6B"):
        model_spec_from_hf({**without_2d, **extra}, name="x")


# --- Baichuan2 --------------------------------------------------------------------------


def baichuan_by_hand(c: dict[str, Any]) -> int:
    """modeling_baichuan.py (7B): embed_tokens Embedding(V, h); per DecoderLayer
    input_layernorm and post_attention_layernorm RMSNorm(h), W_pack Linear(h, 3h, bias=False),
    o_proj Linear(h, h, bias=False), gate_proj / up_proj Linear(h, i), down_proj Linear(i, h),
    no biases; norm; NormHead weight (V, h)."""
    h, v, layers, i = (
        c["hidden_size"],
        c["vocab_size"],
        c["num_hidden_layers"],
        c["intermediate_size"],
    )
    return v * h + layers * (2 * h + h * 3 * h + h * h + 3 * h * i) + h + v * h


def test_baichuan2_7b_count_is_the_published_total() -> None:
    c = _config("baichuan2-7b")
    assert baichuan_by_hand(c) == _count(c) == 7_505_973_248


def test_baichuan_13b_alibi_is_refused_naming_the_rope_models() -> None:
    # Baichuan2-13B-Base: 5120 wide, 40 layers and heads, ALiBi
    c = {
        **_config("baichuan2-7b"),
        "hidden_size": 5120,
        "intermediate_size": 13696,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
    }
    with pytest.raises(UnsupportedError, match="ALiBi.*hidden_size 4096"):
        model_spec_from_hf(c, name="x")


# --- the CLI --------------------------------------------------------------------------------


def test_cli_estimates_qwen_7b_on_the_analytic_engine(invoke: Invoke) -> None:

    path = str(MODELS / "qwen-7b.json")
    r = invoke("estimate", path, "-s", "2048", "-c", "full", "--json")
    d = json.loads(r.stdout)
    assert d["engine"] == "analytic"
    assert d["num_parameters"] == 7_721_324_544
    assert d["peak"]["allocated_bytes"] > d["breakdown_bytes"]["parameters"] > 0
