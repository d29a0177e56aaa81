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
