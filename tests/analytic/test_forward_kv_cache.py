"""A Llama-style transformers decoder in training keeps its final hidden states alive until its
loss has run (``LlamaForCausalLM.forward`` keeps ``hidden_states`` in scope while
``self.loss_function`` runs), though no backward needs them. Expected: the forward peak of the
trace engine running the real model (modeling_llama.py ``LlamaForCausalLM.forward``), with
``use_cache: false`` (the training KV cache's copies depend on the transformers version:
``ModelSpec.forward_kv_cache``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_forward_peak_holds_the_final_hidden_states(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    raw = {
        **load_hf_config("tiny-llama-test"),
        "model_type": family,
        "architectures": [f"{family.title()}ForCausalLM"],
        "use_cache": False,
        "sliding_window": None,
        "vocab_size": 2048,  # the loss's forward peak over the layers' activations
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, precision="bf16-mixed", optimizer="sgd"
    )
    peaks = {
        engine: estimate(str(path), training, engine=engine, simulate_allocator=False).details[
            "phase_peaks_bytes"
        ]["forward"]
        for engine in ("analytic", "trace")
    }
    # the hidden states are 32 KiB here; 2,184 B of small int64 / scalar tensors (position ids,
    # cache positions) are not modelled
    assert abs(peaks["analytic"] - peaks["trace"]) <= 4096, peaks


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_training_kv_cache_keeps_the_fp32_rotated_keys(family: str, tmp_path: Path) -> None:
    """With ``use_cache`` on (the config default), transformers 5.24 builds a ``DynamicCache`` in
    training; its ``torch.cat`` copy of the rotated keys is fp32 under bf16 autocast (the rotary
    tables are fp32) and lives until the forward ends, while the values' copy is the bf16
    tensor SDPA saves anyway. Hand derivation: the forward peak grows by
    layers * 4 B * kv_heads * head_dim * b * s. Checked on both engines (the trace runs the
    real model code)."""
    pytest.importorskip("transformers")
    base = {
        **load_hf_config("tiny-llama-test"),
        "model_type": family,
        "architectures": [f"{family.title()}ForCausalLM"],
        "sliding_window": None,
        "vocab_size": 2048,
    }
    b, s = 2, 64
    training = TrainingConfig(
        micro_batch_size=b, seq_len=s, precision="bf16-mixed", optimizer="sgd"
    )
    peaks: dict[bool, dict[str, int]] = {}
    for use_cache in (False, True):
        path = tmp_path / f"config-{use_cache}.json"
        path.write_text(json.dumps({**base, "use_cache": use_cache}))
        peaks[use_cache] = {
            engine: estimate(str(path), training, engine=engine, simulate_allocator=False).details[
                "phase_peaks_bytes"
            ]["forward"]
            for engine in ("analytic", "trace")
        }
    kv_heads = base.get("num_key_value_heads", base["num_attention_heads"])
    head_dim = base["hidden_size"] // base["num_attention_heads"]
    want = base["num_hidden_layers"] * 4 * kv_heads * head_dim * b * s
    for engine in ("analytic", "trace"):
        assert peaks[True][engine] - peaks[False][engine] == want, (engine, peaks)
