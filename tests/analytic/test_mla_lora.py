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
