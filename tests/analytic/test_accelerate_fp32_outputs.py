"""accelerate's fp32 outputs (Note [accelerate's fp32 outputs], trainmem/analytic/loss.py):
under ``native_amp`` (mixed precision fp16 / bf16, never DeepSpeed) ``Accelerator.prepare_model``
wraps the forward in ``convert_outputs_to_fp32``, which returns every 16-bit output tensor as
``tensor.float()`` (accelerate/utils/operations.py ``convert_to_fp32``, v0.20.0 .. v1.14.0).

Expected bytes by hand from the shapes (no code output pasted back):

* the 2-layer Qwen2 formula config (V 512) at b x s = 2 x 64 = 128 tokens: the logits are
  512 x 128 = 65,536 values; the fp32 copy 4 x 65,536 = 262,144 bytes, the bf16 logits
  131,072.
* santacoder (GPTBigCode, V 49,280) at 4 x 2048 = 8,192 tokens, transformers 4.48 (its
  loss on the 16-bit logits, shifting them into a bf16 copy of b (s - 1) = 8,188 positions):
  at the loss the bf16 logits and the shifted copy, 2 V T + 2 V 8,188; at the wrapper's
  return the bf16 logits and the fp32 copy, 2 V T + 4 V T, the larger.
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.held_outputs import previous_output_bytes
from trainmem.analytic.loss import accelerate_output_bytes, loss_forward_transient_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
V, T = 512, 2 * 64


def _training(**fields: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "hf-trainer",
        "micro_batch_size": 2,
        "seq_len": 64,
        "precision": "bf16-mixed",
        **fields,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "converts"),
    [
        ({}, True),
        ({"precision": "16-mixed"}, True),
        ({"framework": "accelerate-fsdp"}, True),
        ({"precision": "bf16-true"}, False),  # accelerate's mixed_precision "no"
        ({"precision": "32-true"}, False),
        ({"framework": "deepspeed"}, False),  # no native_amp under DistributedType.DEEPSPEED
        ({"framework": "pytorch-amp"}, False),  # a loop accelerate does not prepare
        ({"transformers_version": "4.29"}, False),  # the Trainer before its accelerate move
        ({"transformers_version": "4.30"}, True),
    ],
)
def test_which_runs_convert(fields: dict[str, object], converts: bool) -> None:
    assert _training(**fields).accelerate_fp32_outputs is converts


def test_the_fp32_copy_is_four_bytes_a_logit() -> None:
    model = load_model_spec(QWEN2)
    assert accelerate_output_bytes(model, _training()) == 4 * V * T == 262_144
    assert accelerate_output_bytes(model, _training(framework="pytorch-amp")) == 0
    assert accelerate_output_bytes(model, _training(precision="32-true")) == 0  # fp32 logits


def test_a_loop_that_keeps_the_output_keeps_the_fp32_copy() -> None:
    # previous: the loop holds the returned output, fp32 under accelerate, bf16 otherwise
    model = load_model_spec(QWEN2)
    assert previous_output_bytes(model, _training(loop="previous")) == 4 * V * T
    assert previous_output_bytes(model, _training(loop="previous", framework="pytorch-amp")) == (
        2 * V * T
    )


def _peak(**fields: object) -> int:
    est = estimate(QWEN2, _training(**fields), engine="analytic", simulate_allocator=False)
    return est.breakdown.allocated_bytes


def test_the_step_loop_holds_the_copy_through_the_backward() -> None:
    # the backward's peak (the loss gradients) is the same with either loop; ``step`` adds
    # the held output: accelerate's fp32 copy, or the bf16 logits without accelerate, and the
    # output's KV cache (Note [The current micro-batch's bound output]): 2 layers x (k, v) x
    # T tokens x 2 KV heads x head_dim 16 (64 / 4) x 2 B (bf16 under autocast) = 32,768 B
    cache = 2 * 2 * T * 2 * 16 * 2
    assert _peak(loop="step") - _peak(loop="drop") == 4 * V * T + cache
    amp = {"framework": "pytorch-amp"}
    assert _peak(loop="step", **amp) - _peak(loop="drop", **amp) == 2 * V * T + cache


def test_at_the_forward_end_the_copy_takes_the_upcast_s_place() -> None:
    # transformers >= 4.46: ForCausalLMLoss's fp32 upcast, freed when the loss returns, is
    # the copy's size: the forward's end holds the same bytes as without accelerate
    model = load_model_spec(QWEN2)
    with_copy = loss_forward_transient_bytes(model, _training())
    assert with_copy == loss_forward_transient_bytes(model, _training(framework="pytorch-amp"))
    assert with_copy == (2 + 4) * V * T


def test_a_loss_on_16_bit_logits_is_outgrown_by_the_copy() -> None:
    bigcode = load_model_spec("santacoder")
    v, t = 49_280, 4 * 2048
    old = {"micro_batch_size": 4, "seq_len": 2048, "transformers_version": "4.48.1"}
    amp = loss_forward_transient_bytes(bigcode, _training(framework="pytorch-amp", **old))
    assert amp == 2 * v * t + 2 * v * 4 * 2047
    assert loss_forward_transient_bytes(bigcode, _training(**old)) == (2 + 4) * v * t
