"""Sliding-window attention in the Mistral-style families: which layers slide (read from the
config as transformers does), and what a sliding layer's SDPA call keeps once the sequence
reaches the window.

Hand derivation (transformers modeling_mistral.py ``MistralModel.forward``: ``mask_function =
create_causal_mask if self.config.sliding_window is None else
create_sliding_window_causal_mask``; masking_utils.py ``_ignore_causal_mask_sdpa`` keeps the
mask once ``kv_length >= local_attention_size``): every layer then gets an explicit (b, 1, s, s)
boolean mask. SDPA turns it into an additive bias in the compute dtype c and the
memory-efficient kernel saves it (c * b * s * s per layer; aten ``convert_boolean_attn_mask``,
derivatives.yaml ``_scaled_dot_product_efficient_attention`` saves ``attn_bias``), and with a
mask transformers repeats k and v to every query head before SDPA (integrations/
sdpa_attention.py ``use_gqa_in_sdpa``): 2 * c * (a - k) * d * b * s more per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.specs.hf import model_spec_from_hf
from trainmem.specs.training import TrainingConfig

A, K, D, L = 4, 2, 32, 3  # query heads, kv heads, head dim, layers
MISTRAL = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "hidden_size": A * D,
    "intermediate_size": 256,
    "num_hidden_layers": L,
    "num_attention_heads": A,
    "num_key_value_heads": K,
    "vocab_size": 128,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _sliding(config: dict) -> tuple[int, int]:
    spec = model_spec_from_hf(config, name="x")
    return spec.num_sliding_layers, spec.sliding_window


def test_which_layers_slide() -> None:
    # MistralConfig.sliding_window defaults to 4096; an explicit null turns it off
    assert _sliding(MISTRAL) == (L, 4096)
    assert _sliding({**MISTRAL, "sliding_window": None}) == (0, 0)
    assert _sliding({**MISTRAL, "sliding_window": 64}) == (L, 64)
    # Mixtral / Phi-3 / Starcoder2 configs default to no window
    for family in ("mixtral", "phi3", "starcoder2"):
        assert _sliding({**MISTRAL, "model_type": family})[0] == 0
        assert _sliding({**MISTRAL, "model_type": family, "sliding_window": 64}) == (L, 64)
    # Qwen2: only with use_sliding_window, from layer max_window_layers on
    qwen = {**MISTRAL, "model_type": "qwen2", "sliding_window": 64}
    assert _sliding(qwen)[0] == 0
    assert _sliding({**qwen, "use_sliding_window": True, "max_window_layers": 1}) == (L - 1, 64)
    assert _sliding({**qwen, "use_sliding_window": True})[0] == 0  # default 28 >= L


def _peak(config: dict, tmp_path: Path, engine: str, s: int) -> int:
    path = tmp_path / f"{engine}-{config.get('sliding_window')}.json"
    path.write_text(json.dumps(config))
    training = TrainingConfig(
        micro_batch_size=2, seq_len=s, precision="bf16-mixed", optimizer="sgd"
    )
    est = estimate(str(path), training, engine=engine, simulate_allocator=False)
    return est.breakdown.activations


@pytest.mark.parametrize("family", ["mistral", "phi3"])
@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_sliding_layers_keep_the_bias_and_expanded_kv(
    engine: str, family: str, tmp_path: Path
) -> None:
    """Phi-3 also loses one tensor: without a mask the flash kernel's output is laid out like
    its (b, a, s, d)-contiguous q (the rotary ``torch.cat``), so transformers'
    ``transpose(1, 2).contiguous()`` copies it for o_proj (c * a * d * b * s); the
    memory-efficient kernel's output is (b, s, a, d) and the transpose is a view."""
    if engine == "trace":
        pytest.importorskip("transformers")
    b, s, c = 2, 256, 2
    config = {**MISTRAL, "model_type": family, "architectures": [f"{family.title()}ForCausalLM"]}
    full = _peak({**config, "sliding_window": None}, tmp_path, engine, s)
    sliding = _peak({**config, "sliding_window": 128}, tmp_path, engine, s)
    per_layer = c * b * s * s + 2 * c * (A - K) * D * b * s
    if family == "phi3":
        per_layer -= c * A * D * b * s
    # the trace's peak may hold a few more host-scalar bytes (tests/trace/test_real_cpu.py)
    assert 0 <= L * per_layer - (sliding - full) <= 512
    # below the window transformers drops the mask: nothing changes
    assert _peak({**config, "sliding_window": 512}, tmp_path, engine, s) == full


def test_flash_attention_2_gets_no_sliding_mask(tmp_path: Path) -> None:
    """flash-attn 2 takes the window as the kernel's ``window_size`` and no (b, 1, s, s) mask:
    transformers 4.48 modeling_mistral.py ``MistralModel._update_causal_mask`` returns, under
    ``flash_attention_2``, the 2D ``attention_mask`` only if it holds a 0 and None otherwise
    (transformers 5 masking_utils.py ``flash_attention_mask`` alike). So past the window the
    activations are those of the same model without one, under checkpointing too (no boolean
    mask kept as every layer's input); with SDPA they are not (the test above)."""
    s = 256

    def activations(window: int | None, attention: str) -> int:
        path = tmp_path / f"{attention}-{window}.json"
        path.write_text(json.dumps({**MISTRAL, "sliding_window": window}))
        out = []
        for checkpointing in ("none", "full"):
            training = TrainingConfig(
                micro_batch_size=2,
                seq_len=s,
                precision="bf16-mixed",
                optimizer="sgd",
                attention=attention,
                activation_checkpointing=checkpointing,
            )
            est = estimate(str(path), training, engine="analytic", simulate_allocator=False)
            out.append(est.breakdown.activations)
        return out[0] * 10**12 + out[1]

    assert activations(128, "flash") == activations(None, "flash")
    assert activations(128, "sdpa") > activations(None, "sdpa")


def test_sliding_layers_leave_the_cache_values_unsaved() -> None:
    """Note [The training KV cache's copies]: past the window the sliding layers' explicit mask
    makes transformers repeat k / v, so SDPA saves the repeated tensors and the cache's values
    copy is extra too, beside the fp32 keys' copy (bf16-mixed: r = 4, c = 2). Hand: per layer
    kv_heads x head_dim x b x s = 2 x 32 x 2 x 256 = 32,768 values; below the window
    4 x 32,768 B per layer, past it (4 + 2) x 32,768 B."""
    from trainmem.analytic.attention import forward_kv_cache_bytes

    training = TrainingConfig(micro_batch_size=2, seq_len=256, precision="bf16-mixed")
    per_layer = K * D * 2 * 256
    below = model_spec_from_hf({**MISTRAL, "sliding_window": 512}, name="x")
    past = model_spec_from_hf({**MISTRAL, "sliding_window": 128}, name="x")
    assert forward_kv_cache_bytes(below, training, L) == L * 4 * per_layer
    assert forward_kv_cache_bytes(past, training, L) == L * (4 + 2) * per_layer
