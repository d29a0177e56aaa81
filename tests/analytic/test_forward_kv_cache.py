"""A Llama-style transformers decoder in training, without checkpointing, keeps two things
alive until its loss has run that no backward needs: the KV cache (transformers 5 builds a
``DynamicCache`` whenever ``use_cache`` is true, and ``DynamicLayer.update`` stores
``torch.cat`` copies of the rotated keys and the values, fp32 under autocast), and the final
hidden states (``LlamaForCausalLM.forward`` keeps ``hidden_states`` in scope while
``self.loss_function`` runs). Expected: the forward peak of the trace engine running the real
model (cache_utils.py ``DynamicLayer.update``; modeling_llama.py ``LlamaForCausalLM.forward``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_forward_peak_holds_the_cache_and_the_final_hidden_states(
    family: str, use_cache: bool, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    raw = {
        **load_hf_config("tiny-llama-test"),
        "model_type": family,
        "architectures": [f"{family.title()}ForCausalLM"],
        "use_cache": use_cache,
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
    # the cache and the hidden states are 64 KiB here; 2,184 B of small int64 / scalar tensors
    # (position ids, cache positions) are not modelled
    assert abs(peaks["analytic"] - peaks["trace"]) <= 4096, peaks
