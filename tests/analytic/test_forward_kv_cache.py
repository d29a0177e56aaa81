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


@pytest.mark.parametrize(
    ("precision", "padded", "key_bytes", "value_bytes"),
    [
        # fp32: k and v reach SDPA repeated (the fp32 memory-efficient kernel: sdpa_expands_kv)
        ("32-true", False, 4, 4),
        # bf16 without autocast, a padded batch's mask: transformers' repeat_kv
        ("bf16-true", True, 2, 2),
    ],
)
def test_repeated_kv_leaves_both_cache_copies_unsaved(
    precision: str, padded: bool, key_bytes: int, value_bytes: int, tmp_path: Path
) -> None:
    """Note [The training KV cache's copies]: where k and v reach SDPA repeated to every query
    head (2 of 4 kv heads here), SDPA saves the repeated tensors, so both of the cache's copies
    (transformers 5.24 cache_utils.py ``DynamicLayer.update``'s ``torch.cat``) are extra until
    the loss, also where r = c (a real CPU run with saved-tensor hooks: with a padded batch no
    cache tensor is among the saved ones, under 32-true, bf16-true and bf16-mixed). Hand
    derivation: the forward peak (the loss's, vocabulary 2048) grows by
    layers * (key + value bytes) * kv_heads * head_dim * b * s with ``use_cache`` on. The
    trace engine checks the fp32 case only: on a padded batch with ``use_cache`` on its step
    saves k / v at their 2 kv heads and no mask bias (it traces the model as if the batch
    had no mask: session 23 notes, left), where the real CPU run saves the repeated ones."""
    pytest.importorskip("transformers")
    base = {**load_hf_config("tiny-llama-test"), "vocab_size": 2048}
    b, s = 2, 64
    training = TrainingConfig(
        micro_batch_size=b, seq_len=s, precision=precision, optimizer="sgd", padding_mask=padded
    )
    engines = ("analytic",) if padded else ("analytic", "trace")
    peaks: dict[bool, dict[str, int]] = {}
    for use_cache in (False, True):
        path = tmp_path / f"config-{use_cache}.json"
        path.write_text(json.dumps({**base, "use_cache": use_cache}))
        peaks[use_cache] = {
            engine: estimate(str(path), training, engine=engine, simulate_allocator=False).details[
                "phase_peaks_bytes"
            ]["forward"]
            for engine in engines
        }
    kv_heads, head_dim = 2, 64 // 4
    want = 2 * (key_bytes + value_bytes) * kv_heads * head_dim * b * s
    for engine in engines:
        assert peaks[True][engine] - peaks[False][engine] == want, (engine, peaks)


def test_each_layer_cache_exists_from_its_attention(tmp_path: Path) -> None:
    """The cache's copies are made layer by layer at each attention, so a forward peak inside
    the last layer (the agreement model's: layer 1's down projection under a 32-true nf4 LoRA,
    its dequantized weight) holds every layer's copies, not none. Hand derivation (2 layers,
    4 kv heads x 128, 2 x 256 tokens, k and v fp32 and repeated for the fp32 kernel):
    2 x 2 x 4 x 512 x 512 = 4,194,304 B more forward peak with ``use_cache`` on."""
    raw = json.loads((Path(__file__).parents[1] / "models/agreement/llama_h2048.json").read_text())
    training = TrainingConfig(
        micro_batch_size=2, seq_len=256, precision="32-true", lora_rank=16, quantize_base="nf4"
    )
    peaks = {}
    for use_cache in (False, True):
        path = tmp_path / f"config-{use_cache}.json"
        path.write_text(json.dumps({**raw, "use_cache": use_cache}))
        est = estimate(str(path), training, engine="analytic", simulate_allocator=False)
        peaks[use_cache] = est.details["phase_peaks_bytes"]["forward"]
    assert peaks[True] - peaks[False] == 2 * 2 * 4 * (4 * 128) * 512
