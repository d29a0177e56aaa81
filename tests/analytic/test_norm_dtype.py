"""RMSNorms that scale by their weight in fp32 (Gemma ``x * (1 + w)``) save their fp32
normalised tensor whatever the residual stream's dtype; Llama's casts first and saves it in
the input dtype. The difference shows only with a 16-bit residual stream (bf16-true, or an FSDP
mixed-precision policy). Expected: the second layer's saved bytes in the trace of the real model
(modeling_gemma.py ``GemmaRMSNorm.forward``: ``output = self._norm(x.float()); output = output
* (1.0 + self.weight.float())``).

Likewise a parallel block with one shared norm (Falcon, Phi: ``input_layernorm`` feeds both
attention and MLP) saves that norm's output once without autocast: the q/k/v projection and the
MLP's first projection save the same tensor (under autocast each casts its own copy)."""

from __future__ import annotations

import re

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.specs.hf import load_hf_config, model_spec_from_hf
from trainmem.specs.training import TrainingConfig

CONFIGS = MODELS_DIR / "formula"


@pytest.mark.parametrize("name", ["gemma.json", "qwen2.json", "falcon.json", "phi.json"])
def test_layer_saved_bytes_with_a_bf16_residual_stream(name: str) -> None:
    pytest.importorskip("transformers")
    from trainmem.trace.engine import run_trace
    from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch

    raw = {**load_hf_config(str(CONFIGS / name)), "num_hidden_layers": 3}
    training = TrainingConfig(micro_batch_size=2, seq_len=64, precision="bf16-true")
    analytic = sum(layer_activation_terms(model_spec_from_hf(raw, name="x"), training).values())
    holder = {}

    def build():
        holder["m"] = build_hf_training_model(raw, training)
        return holder["m"]

    _, report = run_trace(build, lambda: make_hf_batch(holder["m"], 2, 64), training)
    layer = re.compile(r"\.(layers|h)\.1\.")  # model.layers (Llama-style), transformer.h
    traced = sum(v for k, v in report.activation_bytes_by_module.items() if layer.search(f"{k}."))
    # beyond the trace's host scalars (512 B): Gemma's per-norm fp32 ``1.0 + weight`` (4 h B per
    # norm, independent of the tokens; not modelled)
    slack = 512 + 2 * 4 * raw["hidden_size"]
    assert abs(traced - analytic) <= slack, (analytic, traced)
