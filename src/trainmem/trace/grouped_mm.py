"""The MoE experts' grouped matmul on the traced step for weights that are not bf16.

Note [Traced grouped matmul of frozen experts]
    transformers 5.24 integrations/moe.py ``_grouped_mm`` calls torch's ``grouped_mm`` on
    CUDA whatever the weights' dtype (``_can_use_grouped_mm`` restricts only CPU and compiled
    runs); torch's CUDA kernel runs its loop of ``mm`` for dtypes other than bf16
    (aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``: ``use_fast_path`` only
    for bf16, else ``_grouped_mm_fallback``), so fp32 experts under autocast run it too. Its
    autograd node keeps an operand only for the other's gradient (``GroupedMmBackward0``,
    generated like ``mm``'s: on CPU a frozen weight's node keeps the weight and the offsets,
    not the input). torch's meta kernel accepts bf16 only (torch/_meta_registrations.py
    ``_meta_grouped_mm_common``), so the fake step runs transformers' own fallback op for
    other dtypes, whose ``setup_context`` keeps input and weight always. Here that op is
    wrapped in a function that keeps what torch's node keeps: with frozen experts (LoRA
    without expert adapters) the weight only, so neither the gathered tokens nor the product
    fed to the down projection stays saved; a weight that needs a gradient keeps both, as
    before (its input needs one too, except in a first layer whose experts alone train: an
    over-count left there).
"""

from __future__ import annotations

from typing import Any


def guarded_grouped_mm(torch: Any) -> Any:
    """``(input, weight, offs) -> output`` over transformers' fallback op that saves the
    operands torch's ``grouped_mm`` saves (Note [Traced grouped matmul of frozen experts])."""
    ops = torch.ops.transformers

    class GroupedMm(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, inputs: Any, weight: Any, offs: Any) -> Any:
            ctx.offs = offs
            if weight.requires_grad:
                ctx.save_for_backward(inputs, weight)
            else:
                ctx.save_for_backward(weight)
            return ops.grouped_mm_fallback(inputs, weight, offs)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            saved = ctx.saved_tensors
            if len(saved) == 2:
                grad_input, grad_weight = ops.grouped_mm_fallback_backward(*saved, ctx.offs, grad)
                return grad_input, grad_weight, None
            (weight,) = saved
            return ops.grouped_mm_fallback(grad, weight.transpose(-2, -1), ctx.offs), None, None

    def grouped_mm(inputs: Any, weight: Any, offs: Any) -> Any:
        return GroupedMm.apply(inputs.to(weight.dtype), weight, offs)

    return grouped_mm
