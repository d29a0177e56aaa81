"""DDP's gradient buckets (Note [DDP gradient buckets]): a torch DDP rank keeps a flat copy of
every trainable gradient from wrap time on (reducer.cpp ``initialize_buckets``), in the
parameters' dtype, beside the ``.grad`` tensors ``zero_grad`` frees.

Expected bytes by hand: the 2-layer Qwen2 formula config has 139,840 parameters (its
embedding 1,000 x 64 + its untied head 64 x 1,000 + 2 layers of 36,896 + the final norm 64:
the count transformers' Qwen2ForCausalLM gives, checked in tests/specs), so the buckets hold
139,840 x 4 bytes with fp32 weights (bf16-mixed) and x 2 with bf16 weights.
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
PARAMS = 139_840


def _kept_gradients(**settings: object) -> int:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **settings)  # type: ignore[arg-type]
    est = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    assert est.num_trainable_parameters == PARAMS or "lora_rank" in settings
    return est.schedules[0].live_before_step().get(MemoryCategory.GRADIENT, 0)


@pytest.mark.parametrize(
    ("framework", "precision", "expected"),
    [
        ("pytorch-amp", "bf16-mixed", PARAMS * 4),
        ("pytorch-amp", "bf16-true", PARAMS * 2),
        ("hf-trainer", "bf16-mixed", PARAMS * 4),
    ],
)
def test_ddp_rank_keeps_a_flat_copy_of_the_gradients(
    framework: str, precision: str, expected: int
) -> None:
    assert _kept_gradients(framework=framework, precision=precision) == 0  # one GPU: no DDP
    kept = _kept_gradients(framework=framework, precision=precision, data_parallel_size=4)
    assert kept == expected


@pytest.mark.parametrize(
    "settings",
    [
        {"framework": "deepspeed"},  # its own buffers, not torch DDP
        {"framework": "megatron"},
        {"framework": "torchtune"},  # FSDP, no DDP
        # FSDP1 NO_SHARD all-reduces flat_param.grad itself (torch distributed/fsdp/
        # _runtime_utils.py _reduce_grad_no_shard): no reducer (Note [FSDP1 NO_SHARD's 16-bit
        # copy])
        {"framework": "accelerate-fsdp"},
        {"zero_stage": 3},  # FSDP shards instead
    ],
)
def test_no_ddp_buckets_outside_torch_ddp(settings: dict) -> None:
    with_dp = _kept_gradients(data_parallel_size=4, **settings)
    alone = _kept_gradients(data_parallel_size=1, **settings)
    assert with_dp <= alone
