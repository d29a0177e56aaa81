"""transformers 5 MoE layers as the analytic engine holds them: the routed experts are two 3-D
parameters per layer, and under an FSDP mixed-precision policy they compute in bf16.

Independent references: transformers' own model built on the meta device (its parameter
shapes), and the trace engine running the real model under FSDP2 on fake tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.analytic.tensor_states import tensor_states
from trainmem.estimate import estimate
from trainmem.specs.hf import load_hf_config, model_spec_from_hf
from trainmem.specs.training import TrainingConfig

CONFIG = Path(__file__).parent / "configs" / "tiny-qwen3-moe.json"


def test_experts_are_two_3d_parameters_per_layer() -> None:
    pytest.importorskip("transformers")
    from trainmem.trace.hf_model import build_hf_model

    raw = load_hf_config(str(CONFIG))
    model = build_hf_model(raw, attention="sdpa")  # on the meta device
    layer = model.model.layers[0]
    want = sorted(p.numel() for p in layer.parameters() if p.dim() >= 2)
    spec = model_spec_from_hf(raw, name="tiny")
    states = tensor_states(spec, TrainingConfig())
    matrices = [
        s for s in states if s.name in ("q", "k", "v", "o", "router") or "experts" in s.name
    ]
    got = sorted(s.numel for s in matrices[: len(matrices) // spec.num_layers])
    assert got == want


def test_fsdp2_moe_layer_computes_in_bf16(tmp_path: Path) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) gathers the experts in bf16, so the
    grouped matmuls' saved inputs and outputs are 2 B per element, not fp32 as under plain
    autocast (grouped_mm is on none of autocast's lists). Expected: the second
    layer's saved bytes in the trace of the real model (its modules under model.layers.1)."""
    pytest.importorskip("transformers")
    from trainmem.analytic.activations import layer_activation_terms

    path = tmp_path / "config.json"
    path.write_text(CONFIG.read_text())
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=64,
        precision="bf16-mixed",
        data_parallel_size=2,
        zero_stage=3,
        framework="fsdp2",
    )
    spec = model_spec_from_hf(load_hf_config(str(path)), name="tiny")
    analytic = sum(layer_activation_terms(spec, training).values())
    traced = estimate(str(path), training, engine="trace", simulate_allocator=False)
    modules = traced.details["activation_bytes_by_module"]
    layer = sum(v for k, v in modules.items() if f"{k}.".startswith("model.layers.1."))
    assert abs(layer - analytic) <= 0.001 * layer, (analytic, layer)
