"""A quantized MoE base dequantizes one expert linear at a time where each expert is a module
of its own (Note [Dequantized expert weights]: transformers 4.48 modeling_mixtral.py
``MixtralBlockSparseTop2MLP``, bitsandbytes ``MatMul4Bit``)."""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

# Mixtral-8x7B: an expert's w1 / w3 is [14336, 4096], w2 [4096, 14336]; bf16 compute
ONE_EXPERT_LINEAR = 2 * 14_336 * 4_096  # 117,440,512 B
ALL_GATE_UP = 2 * 8 * 2 * 14_336 * 4_096  # the 3-D gate_up parameter of transformers 5


def _temporary_sizes(transformers: str) -> set[int]:
    training = TrainingConfig(
        micro_batch_size=1,
        seq_len=256,
        precision="bf16-mixed",
        activation_checkpointing="full",
        lora_rank=8,
        lora_targets=("q", "v"),
        quantize_base="nf4",
        framework="hf-trainer",
        transformers_version=transformers,
    )
    sched = estimate("mixtral-8x7b", training, engine="analytic", simulate_allocator=False)
    return {
        ev.size_bytes
        for ev in sched.schedules[0].events()
        if ev.action == "alloc" and ev.module.startswith("layers.") and ev.phase != "load"
    }


def test_transformers_4_dequantizes_one_expert_linear() -> None:
    sizes = _temporary_sizes("4.48.1")
    assert ONE_EXPERT_LINEAR in sizes
    assert ALL_GATE_UP not in sizes


def test_transformers_5_keeps_the_fused_parameters() -> None:
    # the layout's 3-D experts parameter: unchanged by the rule (Note [Dequantized expert
    # weights] covers the per-expert modules only)
    assert ALL_GATE_UP in _temporary_sizes("5.0.0")
