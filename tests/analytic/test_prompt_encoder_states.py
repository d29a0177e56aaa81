"""peft's prompt encoder in the model-state layout (Note [Prompt encoder tensors] in
trainmem/analytic/prompt_encoder.py), and the rules that read it under data parallelism,
DeepSpeed ZeRO and FSDP (issue 26: prompt learning where it was refused).

Expected values by hand: tiny-llama-test (hidden 64, 4 heads of 16, 2 key/value heads, 2
layers, 158,016 parameters) with peft 0.21.2's encoders (``PrefixEncoder``: ``Embedding(p, 2 L
t)``, ``t = 2 x 16``; ``PromptEncoder``; ``PromptEmbedding``), made in fp32; DeepSpeed's
engine casts its whole module to the 16-bit dtype (runtime/engine.py
``_configure_distributed_model``) and its ZeRO optimizer partitions the trained tensors' fp32
master and Adam moments over the ranks (runtime/zero/stage_1_and_2.py
``single_partition_of_fp32_groups``), ZeRO-3 every weight (stage3.py); FSDP2 shards every
parameter (``fully_shard``); DDP's reducer holds one bucket of the trained gradients
(torch/csrc/distributed/c10d/reducer.cpp).
"""

from __future__ import annotations

from typing import Any

import pytest

from trainmem.analytic.tensor_states import state_layout
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

L, H, T = 2, 64, 2 * 16
BASE = 158_016
PREFIX = 8 * 2 * L * T  # p = 8: Embedding(8, 2 L t), 1,024 elements
BUFFERS = 2 * 8 * 4 + 8 * 8  # rotary inv_freq + original_inv_freq (fp32), 8 int64 prompt ids


@pytest.mark.parametrize(
    ("settings", "trained"),
    [
        (dict(), PREFIX),
        # Embedding(p, t), Linear(t, t) + bias, Linear(t, 2 L t) + bias
        (dict(prefix_projection=True), 8 * T + T * T + T + T * 2 * L * T + 2 * L * T),
        # Embedding(p, h) and its MLP, Linear(h, h) + bias three times
        (dict(prompt_learning="p-tuning"), 8 * H + 3 * (H * H + H)),
        (dict(prompt_learning="prompt-tuning"), 8 * H),
    ],
)
def test_the_layout_trains_the_prompt_encoder_alone(settings: dict[str, Any], trained: int) -> None:
    training = TrainingConfig(num_virtual_tokens=8, **settings)
    layout = state_layout(resolve_model("tiny-llama-test"), training)
    states = layout.expand()
    assert sum(s.numel for s in states if s.trainable) == trained
    assert layout.total("numel") == BASE + trained
    # fp32 over a bf16 base: weight 4 + AdamW's two moments 8 bytes per element
    assert sum(s.state_bytes for s in states) == 8 * trained
    # peft's own modules on the generic path count the same
    generic = estimate(
        "tiny-llama-test",
        TrainingConfig(micro_batch_size=1, seq_len=16, num_virtual_tokens=8, **settings),
        engine="generic",
        simulate_allocator=False,
    )
    assert generic.num_trainable_parameters == trained


def _estimate(**settings: Any) -> Any:
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, precision="bf16-mixed", num_virtual_tokens=8, **settings
    )
    return estimate("tiny-llama-test", training, engine="generic", simulate_allocator=False)


def test_ddp_buckets_the_prefix_gradient_only() -> None:
    # bf16-mixed: fp32 weights; the reducer's bucket holds the fp32 prefix's gradient alone
    one = _estimate().breakdown
    ddp = _estimate(data_parallel_size=4).breakdown
    assert ddp.gradients - one.gradients == 4 * PREFIX
    assert ddp.parameters == one.parameters == 4 * (BASE + PREFIX) + BUFFERS
    assert ddp.optimizer_states == 8 * PREFIX


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_partitions_the_prefix_s_states(stage: int) -> None:
    # DeepSpeed's bf16 module (the prefix too); its fp32 master + 2 moments, a quarter each
    est = _estimate(framework="deepspeed", data_parallel_size=4, zero_stage=stage).breakdown
    weights = 2 * (BASE + PREFIX)
    assert est.parameters == (weights // 4 if stage == 3 else weights) + BUFFERS
    assert est.optimizer_states == 12 * PREFIX // 4


def test_fsdp2_shards_the_frozen_base_and_the_prefix() -> None:
    est = _estimate(framework="fsdp2", data_parallel_size=4, zero_stage=3).breakdown
    assert est.parameters == 4 * (BASE + PREFIX) // 4 + BUFFERS
    assert est.optimizer_states == 8 * PREFIX // 4


def test_bitsandbytes_8bit_states_of_the_prompt_encoder() -> None:
    # the trace runs torch's AdamW in place of bitsandbytes' (no kernel on fake tensors); the
    # states come from the layout: 32-bit (8 B per element) under min_8bit_size = 4096
    # elements, else two 1-byte codes per element and one fp32 absmax per 256-element block
    # (bitsandbytes optim/optimizer.py Optimizer2State.init_state). Projection, p 16:
    # Embedding(16, 32) 512, Linear(32, 32) 1,024 + 32, Linear(32, 128) 4,096 + 128.
    assert _estimate(optimizer="adamw-8bit").breakdown.optimizer_states == 8 * PREFIX
    est = estimate(
        "tiny-llama-test",
        TrainingConfig(
            micro_batch_size=2,
            seq_len=64,
            precision="bf16-mixed",
            num_virtual_tokens=16,
            prefix_projection=True,
            optimizer="adamw-8bit",
        ),
        engine="generic",
        simulate_allocator=False,
    )
    small = 8 * (512 + 1_024 + 32 + 128)
    quantized = 2 * (4_096 + 4 * 4_096 // 256)
    assert est.breakdown.optimizer_states == small + quantized
