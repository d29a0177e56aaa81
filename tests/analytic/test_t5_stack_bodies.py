"""T5 under full activation checkpointing: each stack's blocks recompute their own terms, and
block 0 of each stack also the relative-position buckets (issue 26: tiny-t5 full-AC was +1.9 %
over the trace engine; Note [Layer bodies per stack and block 0],
analytic/transforms/checkpointing.py).

Hand derivation on tests/analytic/hard_configs/tiny-t5.json (d_model h 64, 2 encoder + 2
decoder blocks), b 8, 256 source / 64 target tokens, bf16 autocast, from transformers 5.24
modeling_t5.py:
- ``T5Stack`` builds ``T5Block(config, has_relative_attention_bias=bool(i == 0))``; block 0's
  ``T5Attention.compute_bias`` makes ``relative_position_bucket`` (query_length, key_length)
  int64 and ``self.relative_attention_bias(...)`` saves it for the weight's gradient:
  8 * 256 * 256 = 524,288 B (encoder), 8 * 64 * 64 = 32,768 B (decoder); blocks 1.. take the
  returned ``position_bias`` and make none. Each ``T5Block`` is a ``GradientCheckpointingLayer``
  checkpointed non-reentrantly, so the forward saves no buckets and block 0's recompute makes
  them again;
- the checkpointed input of a block is its stack's hidden states, fp32 under autocast (the
  embedding lookup and the residual adds stay fp32): 4 * h * b * s = 524,288 B for an encoder
  block (s 256), 131,072 B for a decoder block (s 64).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trainmem.analytic.engine import estimate_analytic
from trainmem.analytic.t5 import position_bucket_bytes, t5_stack_bytes
from trainmem.schedule import Repeat
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

CONFIG = Path(__file__).parent / "hard_configs" / "tiny-t5.json"
B, SOURCE, TARGET, H = 8, 256, 64, 64
ENCODER_BUCKETS = 8 * SOURCE * SOURCE  # 524,288
DECODER_BUCKETS = 8 * TARGET * TARGET  # 32,768


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=B,
        seq_len=SOURCE,
        target_seq_len=TARGET,
        precision="bf16-mixed",
        **changes,  # type: ignore[arg-type]
    )


def _made_by_layer(items: Any, prefix: str, phase: str) -> dict[int, int]:
    """Per layer index, the bytes of the blocks (keys starting ``prefix``) a layer body of
    ``phase`` allocates."""
    out: dict[int, int] = {}
    for item in items:
        if not isinstance(item, Repeat):
            continue
        made = sum(
            op.size_bytes
            for op in item.body
            if not isinstance(op, Repeat)
            and op.action == "alloc"
            and op.phase == phase
            and op.key.startswith(prefix)
        )
        if made:
            for k in range(item.count):
                out[item.index(k)] = made
        out.update(_made_by_layer(item.body, prefix, phase))
    return out


def test_bucket_bytes_per_stack() -> None:
    spec = load_model_spec(str(CONFIG))
    full = _training(activation_checkpointing="full")
    assert position_bucket_bytes(spec, full) == (524_288, 32_768)
    # under full checkpointing the stacks keep none (block 0's recompute makes them) ...
    assert t5_stack_bytes(spec, full)["position_buckets"] == 0
    # ... without it, or on pipeline stages (the mean layer's body), the forward saves both
    assert t5_stack_bytes(spec, _training())["position_buckets"] == 557_056
    staged = _training(activation_checkpointing="full", pipeline_parallel_size=2)
    assert t5_stack_bytes(spec, staged)["position_buckets"] == 557_056
    # LoRA freezes the bias embedding: the lookup saves no indices
    assert position_bucket_bytes(spec, _training(lora_rank=4)) == (0, 0)


def test_block_0_of_each_stack_recomputes_the_buckets() -> None:
    spec = load_model_spec(str(CONFIG))
    schedule = estimate_analytic(spec, _training(activation_checkpointing="full")).schedules[0]
    made = _made_by_layer(schedule.step, "re/", "backward")
    # the schedule's layers: encoder blocks 0, 1, then decoder blocks 0, 1
    assert set(made) == {0, 1, 2, 3}
    assert made[0] - made[1] == ENCODER_BUCKETS
    assert made[2] - made[3] == DECODER_BUCKETS
    # an encoder block (256 tokens) and a decoder block (64 tokens, cross-attention) recompute
    # different terms: one mean body made them equal
    assert made[1] != made[3]
    # under LoRA block 0 makes no buckets: its body is the other blocks'
    lora = estimate_analytic(
        spec, _training(activation_checkpointing="full", lora_rank=4)
    ).schedules[0]
    made_lora = _made_by_layer(lora.step, "re/", "backward")
    assert made_lora[0] == made_lora[1] and made_lora[2] == made_lora[3]


def test_each_stack_keeps_its_own_block_inputs() -> None:
    spec = load_model_spec(str(CONFIG))
    schedule = estimate_analytic(spec, _training(activation_checkpointing="full")).schedules[0]
    saved = _made_by_layer(schedule.step, "act/", "forward")
    assert saved == {0: 4 * H * B * SOURCE, 1: 524_288, 2: 4 * H * B * TARGET, 3: 131_072}
    # the same lengths: every block keeps the same input
    same = dataclasses.replace(_training(activation_checkpointing="full"), target_seq_len=SOURCE)
    saved_same = _made_by_layer(estimate_analytic(spec, same).schedules[0].step, "act/", "forward")
    assert set(saved_same.values()) == {524_288}
