"""Multi-head latent attention under LoRA in the formulas (issue 26)."""

from __future__ import annotations

from trainmem.specs.training import TrainingConfig


def test_mla_latent_norms_are_frozen_under_lora() -> None:
    # DeepseekV3RMSNorm (modeling_deepseek_v3.py) on the q and kv latents: a trained norm saves
    # its fp32 upcast (4 B), its normalised 16-bit tensor (for the weight's gradient) and the
    # fp32 rstd; frozen (LoRA) the normalised tensor goes, as the generic path's trace shows
    # (q_a_layernorm 4 x 128 + 4 B a token on a 128-rank latent). tests/models/deepseek_v3.json:
    # q_lora_rank 32, kv_lora_rank 16; b 2 x s 32 = 64 tokens, bf16-mixed (c = 2)
    from conftest import MODELS_DIR
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.specs.hf import load_model_spec

    model = load_model_spec(str(MODELS_DIR / "deepseek_v3.json"))
    full = layer_activation_terms(model, TrainingConfig(micro_batch_size=2, seq_len=32))
    lora = layer_activation_terms(
        model, TrainingConfig(micro_batch_size=2, seq_len=32, lora_rank=4)
    )
    assert full["attention/q_latent_norm"] == (4 * 32 + 2 * 32 + 4) * 64
    assert lora["attention/q_latent_norm"] == (4 * 32 + 4) * 64
    assert lora["attention/kv_latent_norm"] == (4 * 16 + 4) * 64


# Hand derivations on tests/models/deepseek_v3.json: h = 64, a = 4 heads of qk_nope 16 + rope 8
# (d = 24) and v_head_dim 16; q_lora_rank 32, kv_lora_rank 16; first_k_dense_replace 1 of 2
# layers; bf16 autocast over fp32 weights (c = 2); LoRA rank 4; b 2 x s 32: t = 64 tokens.
# peft's adapters in fp32, so each A casts its own 16-bit copy of its input under autocast
# (Note [MLA under LoRA]). q targets q_a_proj and q_b_proj, k or v kv_a_proj_with_mqa and
# kv_b_proj (``_mla_roles``), o o_proj.
T = 64


def _lora_terms(targets: tuple[str, ...]) -> dict[str, int]:
    from conftest import MODELS_DIR
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.specs.hf import load_model_spec

    model = load_model_spec(str(MODELS_DIR / "deepseek_v3.json"))
    training = TrainingConfig(micro_batch_size=2, seq_len=32, lora_rank=4, lora_targets=targets)
    return layer_activation_terms(model, training)


def test_mla_adapters_save_their_own_inputs() -> None:
    # q,k,v,o: two linears read the attention norm's output (q_a_proj, kv_a_proj_with_mqa),
    # each A its 16-bit copy: 2 x c h t (three before: one per q / k / v name); q_b's and
    # kv_b's A their latent copies, c r_q t and c r_kv t; o's A the attention output, a
    # v_head_dim wide (a * qk_head_dim before): c a v t
    terms = _lora_terms(("q", "k", "v", "o"))
    assert terms["attention/qkv_input"] == 2 * 2 * 64 * T == 16_384
    assert terms["attention/q_latent_input"] == 2 * 32 * T == 4_096
    assert terms["attention/kv_latent_input"] == 2 * 16 * T == 2_048
    assert terms["attention/out_proj_input"] == 2 * 4 * 16 * T == 8_192


def test_frozen_mla_linears_save_no_input() -> None:
    # o alone: nothing reads the norm's output or a latent for an adapter (frozen q_b / kv_b
    # keep no input: mm saves its input only for the weight's gradient)
    terms = _lora_terms(("o",))
    assert terms["attention/qkv_input"] == 0
    assert terms["attention/q_latent_input"] == 0
    assert terms["attention/kv_latent_input"] == 0
    assert terms["attention/out_proj_input"] == 2 * 4 * 16 * T
    # q alone: q_a's A reads the norm's output, q_b's A the query latent; the kv path and o
    # save nothing for an adapter
    terms = _lora_terms(("q",))
    assert terms["attention/qkv_input"] == 2 * 64 * T
    assert terms["attention/q_latent_input"] == 2 * 32 * T
    assert terms["attention/kv_latent_input"] == 0
    assert terms["attention/out_proj_input"] == 0


def _first_layer(targets: tuple[str, ...]) -> object:
    from conftest import MODELS_DIR
    from trainmem.analytic.lora import first_layer_unsaved
    from trainmem.specs.hf import load_model_spec

    model = load_model_spec(str(MODELS_DIR / "deepseek_v3.json"))
    training = TrainingConfig(micro_batch_size=2, seq_len=32, lora_rank=4, lora_targets=targets)
    return first_layer_unsaved(model, training)


# 16-bit autocast copies of frozen weights (c x in x out) and of A weights (c x r x in)
Q_A, KV_A = 2 * 64 * 32, 2 * 64 * (16 + 8)
Q_B, KV_B, O_PROJ = 2 * 32 * (4 * 24), 2 * 16 * (4 * (16 + 16)), 2 * (4 * 16) * 64
A_H, A_O = 2 * 4 * 64, 2 * 4 * (4 * 16)
SDPA = (
    "attention/q_k",
    "attention/v",
    "attention/sdpa_output",
    "attention/logsumexp",
    "scores/",
)


def test_mla_first_layer_by_hand() -> None:
    # Note [LoRA's first layer]: the embedding and the norms frozen, layer 0's input needs no
    # gradient. q,k,v,o: its input norm saves nothing; q_a_proj / kv_a_proj_with_mqa keep no
    # weight copy, their A's no weight copy (each keeps its input); from their outputs on
    # every tensor needs a gradient
    got = _first_layer(("q", "k", "v", "o"))
    assert got == (("attention/norm",), {"autocast_weight_copies": Q_A + KV_A + 2 * A_H})
    assert Q_A + KV_A + 2 * A_H == 8_192
    # q: the kv latent's norm (kv_a_layernorm) and kv_b_proj see no gradient either
    got = _first_layer(("q",))
    whole = ("attention/norm", "attention/kv_latent_norm", "attention/kv_latent_input")
    assert got == (whole, {"autocast_weight_copies": Q_A + KV_A + A_H + KV_B})
    # o: nothing before o_proj's adapter needs a gradient, so neither latent norm nor the
    # attention kernel is recorded, and o_proj and its A keep no weight copy
    got = _first_layer(("o",))
    whole = (
        "attention/norm",
        "attention/q_latent_norm",
        "attention/q_latent_input",
        "attention/kv_latent_norm",
        "attention/kv_latent_input",
        *SDPA,
    )
    copies = Q_A + KV_A + Q_B + KV_B + O_PROJ + A_O
    assert got == (whole, {"autocast_weight_copies": copies})
    assert copies == 4_096 + 3_072 + 6_144 + 4_096 + 8_192 + 512
