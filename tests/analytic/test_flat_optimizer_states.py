"""Optimizer states of the flat tensors DeepSpeed and FSDP1 hand the optimizer (Note [Optimizer
states of flat tensors] in trainmem/analytic/model_states.py), by hand.

DeepSpeed v0.16.4 runtime/zero/stage_1_and_2.py ``param_group['params'] =
[self.single_partition_of_fp32_groups[i]]``: the client optimizer steps one flat fp32 partition
per parameter group, so transformers' / torch's Adafactor sees a 1-D tensor (``factored =
len(param_shape) >= 2`` is False: a full fp32 ``exp_avg_sq``), and bitsandbytes quantizes the
whole partition, biases and norm weights included (bitsandbytes/optim/optimizer.py
``Optimizer2State.init_state``: 32-bit only when ``p.numel() < min_8bit_size`` = 4096).

The model: the Qwen2 formula config (tests/models/formula/qwen2.json): hidden 64, intermediate
128, 4 heads of 16, 2 KV heads, vocabulary 512, 2 layers, q/k/v biases, untied head.
Trainable elements: embedding 32,768; per layer q 4,096 + 64, k 2,048 + 32, v 2,048 + 32, o
4,096, gate / up / down 3 x 8,192, two norms 2 x 64: 37,120; final norm 64; head 32,768:
139,840 in all, of which 1-D: per layer 64 + 32 + 32 + 128 = 256, twice, + 64 = 576.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.model_states import flat_state_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = MODELS_DIR / "formula" / "qwen2.json"
TRAINABLE = 139_840
VECTORS = 576

DEEPSPEED: dict[str, Any] = {
    "precision": "bf16-mixed",
    "framework": "deepspeed",
    "zero_stage": 2,
    "data_parallel_size": 4,
}
# bitsandbytes 8-bit AdamW: two states of 1 B of uint8 code per element + 4 B of fp32 absmax per
# block of 256 (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``)
BNB_8BIT = 2 * (1 + 4 / 256)


def _state_bytes(**settings: Any) -> int:
    training = TrainingConfig(micro_batch_size=1, seq_len=16, **settings)
    return sum(s.state_bytes for s in tensor_states(load_model_spec(str(QWEN2)), training))


def test_adafactor_under_deepspeed_keeps_a_full_second_moment() -> None:
    # fp32 master copy (4 B) + the unfactored fp32 exp_avg_sq of the flat partition (4 B), per
    # element, over 4 ranks: 8 x 139,840 / 4 = 279,680 B (factored per matrix it was far less)
    got = _state_bytes(**DEEPSPEED, optimizer="adafactor")
    assert got == 8 * TRAINABLE // 4


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "paged-adamw-8bit"])
def test_bitsandbytes_8bit_under_deepspeed_quantizes_the_vectors_too(optimizer: str) -> None:
    # fp32 master (4 B) + 8-bit states (2.03125 B) per element, over 4 ranks; each tensor's share
    # rounded up (< 1 B per tensor, 26 tensors). Sized per matrix, every tensor under 4,096
    # elements (k and v, 2,048 each, and the 576 1-D elements) kept 32-bit states (8 B):
    # (4 x 2,048 + 576) x (8 - 2.03125) / 4 = 13,083 B more.
    expected = TRAINABLE * (4 + BNB_8BIT) / 4
    got = _state_bytes(**DEEPSPEED, optimizer=optimizer) + _paged(optimizer)
    assert abs(got - expected) <= 2 * 26, (got, expected)


def _paged(optimizer: str) -> int:
    """The paged states left the allocator: added back (none of these tensors has 1e5
    elements, so none is paged; the assertion keeps that true)."""
    training = TrainingConfig(micro_batch_size=1, seq_len=16, **DEEPSPEED, optimizer=optimizer)
    paged = sum(s.paged_state_bytes for s in tensor_states(load_model_spec(str(QWEN2)), training))
    assert paged == 0
    return paged


def test_bitsandbytes_8bit_under_fsdp1_quantizes_the_flat_shards() -> None:
    # accelerate's FSDP1 (use_orig_params=False), bf16-mixed: fp32 flat parameters, no master
    # copy; 8-bit states of each unit's flat shard, 1-D tensors included, over 4 ranks (taken
    # as 1-D tensors, every one kept 32-bit states before: 8 x 139,840 / 4 = 279,680 B)
    got = _state_bytes(
        precision="bf16-mixed",
        framework="accelerate-fsdp",
        zero_stage=3,
        data_parallel_size=4,
        optimizer="adamw-8bit",
    )
    expected = TRAINABLE * BNB_8BIT / 4
    assert abs(got - expected) <= 2 * 26, (got, expected)


def test_a_small_flat_tensor_keeps_32_bit_states() -> None:
    # a LoRA adapter under FSDP1 is a unit of its own: its shard is the flat tensor, and one of
    # 4,095 elements keeps bitsandbytes' fp32 states (2 x 4 B per element); 4,096 is quantized:
    # 2 x 4,096 B of codes + 2 x 16 blocks x 4 B of absmax = 8,320 B
    training = TrainingConfig(
        micro_batch_size=1, seq_len=16, framework="accelerate-fsdp", optimizer="adamw-8bit"
    )
    assert flat_state_bytes(training, 4095, flat_numel=4095) == 8 * 4095
    assert flat_state_bytes(training, 4096, flat_numel=4096) == 8_320
    # a DeepSpeed partition (size not given) is taken as large: a 64-element share quantized
    assert flat_state_bytes(training, 64) == round(64 * BNB_8BIT)


def _step_temporaries(training: TrainingConfig) -> list[int]:
    from trainmem.estimate import estimate
    from trainmem.schedule import Op

    est = estimate(str(QWEN2), training, engine="analytic", simulate_allocator=False)

    def ops(items: Any) -> list[Op]:
        out: list[Op] = []
        for item in items:
            out += [item] if isinstance(item, Op) else ops(item.body)
        return out

    label = "step's temporaries"
    return [op.size_bytes for op in ops(est.schedules[0].step) if op.action == "alloc"
            and label in op.label]  # fmt: skip


def test_a_per_parameter_step_under_deepspeed_steps_the_whole_partition() -> None:
    # torch.optim.Adafactor's for-loop keeps one var_estimate of the stepped tensor (the
    # optimizer table's row); under DeepSpeed that tensor is this rank's flat fp32 partition:
    # 139,840 / 4 = 34,960 elements x 4 B = 139,840 B, once. Per model tensor it was the
    # largest one's shard in the 16-bit weight dtype: the embedding's 8,192 x 2 B = 16,384 B.
    training = TrainingConfig(
        micro_batch_size=1, seq_len=16, **DEEPSPEED, optimizer="adafactor",
        optimizer_implementation="for-loop",
    )  # fmt: skip
    assert _step_temporaries(training) == [4 * TRAINABLE // 4]
