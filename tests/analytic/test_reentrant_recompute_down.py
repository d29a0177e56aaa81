"""fsdp_qlora's reentrant full checkpointing over a frozen 4-bit down projection (Note [The
recompute's tensors held at the down projection]: analytic/backward_transients.py
``reentrant_recompute_runs_down``; analytic/schedule.py ``_recompute_up``).

torch's reentrant ``CheckpointFunction.backward`` (torch 2.13 utils/checkpoint.py: ``outputs =
ctx.run_function(*detached_inputs)`` under ``enable_grad``, then ``torch.autograd.backward(
outputs_with_grad, args_with_grad)``) recomputes the whole layer before any of its backward,
so the recompute runs down's forward (bitsandbytes ``MatMul4Bit``: the dequantized weight,
then the output) with every recomputed block alive, and the layer's output exists only after
it; the backward then runs op by op (down's input gradient, then the product's).

Hand derivation on the agreement model (2-layer 2048-wide Llama, i = 5,632, 2 x 256 = 512
tokens), fsdp_qlora (bf16 autocast over an fp32 model: c = 2, r = 4), nf4 LoRA on q / v: at the
recompute's down projection, beside its saved blocks, the recomputed code holds down's output
c t h = 2 x 512 x 2048 = 2,097,152 B, its input ``act(gate) * up`` c t i = 2 x 512 x 5632 =
5,767,168 B and the MLP's input (the second norm's fp32 output) r t h = 4,194,304 B; the
residual is that norm's saved input (``x.to(float32)`` of an fp32 tensor is the tensor), the
layer's input the checkpoint's. The dequantized weight is 2 x 5632 x 2048 = 23,068,672 B.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.backward_transients import (
    down_backward_before_recompute,
    reentrant_recompute_runs_down,
)
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER = 2 * 256, 2048, 5632
FSDP_QLORA: dict[str, Any] = {
    "framework": "fsdp-qlora",
    "lora_rank": 16,
    "quantize_base": "nf4",
    "activation_checkpointing": "full",
    "zero_stage": 3,
}


def test_which_runs_recompute_through_down_reentrantly() -> None:
    reentrant = TrainingConfig(**FSDP_QLORA)
    assert reentrant.layer_checkpoint_reentrant
    assert reentrant_recompute_runs_down(reentrant)
    assert not down_backward_before_recompute(reentrant)
    # train.py's --reentrant_checkpointing false, an adapter on down, a saved input: not it
    assert not reentrant_recompute_runs_down(
        TrainingConfig(**FSDP_QLORA, checkpoint_reentrant=False)
    )
    on_down = TrainingConfig(**{**FSDP_QLORA, "lora_targets": ("q", "v", "down")})
    assert not reentrant_recompute_runs_down(on_down)
    old = TrainingConfig(**FSDP_QLORA, bitsandbytes_version="0.42.0")
    assert not reentrant_recompute_runs_down(old)


def _backward_body() -> list[Any]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **FSDP_QLORA)
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    return layer_bodies(est.schedules[0].step, marker="up_held/0")[-1]


def test_the_recompute_holds_down_output_product_and_mlp_input_by_hand() -> None:
    body = _backward_body()
    held = [op for op in body if op.action == "alloc" and op.key.startswith("up_held/")]
    assert [op.size_bytes for op in held] == [2 * T * H, 2 * T * INTER, 4 * T * H]
    keys = [(op.action, op.key) for op in body]
    dequant = keys.index(("alloc", "dequant"))
    # the recompute's dequantization beside the held tensors; the layer's output only after
    assert all(keys.index(("alloc", op.key)) < dequant < keys.index(("free", op.key))
               for op in held)  # fmt: skip
    output = keys.index(("alloc", "reentrant_output"))
    assert all(keys.index(("free", op.key)) < output for op in held)
    assert body[dequant].size_bytes == 2 * INTER * H


def test_the_mlp_backward_runs_linear_by_linear() -> None:
    # down's input gradient (c t i) beside its dequantized weight, not one c h i + 3 c t i block
    body = _backward_body()
    sizes = {op.key: op.size_bytes for op in body if op.action == "alloc"}
    assert sizes["mlp_tmp"] == 2 * T * INTER
    assert sizes["mlp_tmp/act"] == 2 * 2 * T * INTER  # the product's two gradients


# axolotl's default QLoRA path: reentrant checkpointing, the k-bit base's norms / embeddings /
# head cast back to bf16 (Note [axolotl casts a k-bit base's embeddings and norms back]), so a
# 16-bit residual stream: c = r = 2, the norms save their own fp32 copies, not their inputs
AXOLOTL: dict[str, Any] = {
    "framework": "axolotl",
    "lora_rank": 16,
    "quantize_base": "nf4-dq",
    "activation_checkpointing": "full",
    "precision": "bf16-true",
}


def test_a_16_bit_stream_holds_the_residual_but_not_the_layer_input_twice() -> None:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **AXOLOTL)
    assert reentrant_recompute_runs_down(training) and not training.kbit_fp32_activations
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    body = layer_bodies(est.schedules[0].step, marker="up_held/0")[-1]
    held = [op.size_bytes for op in body if op.action == "alloc" and op.key.startswith("up_held/")]
    # down's output c t h, its input act(gate) * up c t i, the MLP's input (the second norm's
    # bf16 output) r t h and the residual r t h (the norm saved its fp32 copy, not it); the
    # layer's input is the checkpoint's saved tensor (next test), not a fifth 2 t h
    assert held == [2 * T * H, 2 * T * INTER, 2 * T * H, 2 * T * H]


def test_the_reentrant_recompute_runs_on_the_saved_input_itself() -> None:
    # a real CPU run of torch's reentrant checkpoint: the recompute's input is a view of the
    # bf16 tensor the checkpoint saved (detach_variable's inp.detach()), not a copy
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    seen: list[int] = []

    def layer(x: Any) -> Any:
        seen.append(x.untyped_storage().data_ptr())
        return (x.float() * 2).to(x.dtype)

    weight = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
    x = weight * 3  # a layer input that needs grad, like a LoRA layer's
    checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert seen == [x.untyped_storage().data_ptr()] * 2  # the forward's and the recompute's
