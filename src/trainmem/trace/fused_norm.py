"""A fused RMSNorm kernel in the trace: Megatron's norms (Note [Megatron's fused RMSNorm]).

Note [Megatron's fused RMSNorm]
    megatron-core runs its RMSNorms as fused kernels: ``TENorm`` is TransformerEngine's
    ``te.pytorch.RMSNorm`` (megatron-core core_r0.9.0 extensions/transformer_engine.py
    ``TENorm.__new__``, ``config.normalization == "RMSNorm"``; the final norm of GPTModel
    and ``pre_mlp_layernorm``; the input norm is fused into ``TELayerNormColumnParallelLinear``),
    Apex's ``FusedRMSNormAffineMixedDtypesFunction`` without TE (apex
    normalization/fused_layer_norm.py: ``ctx.save_for_backward(input_, weight_, invvar)``,
    the output instead of the input under ``memory_efficient``). Each saves its input in its
    own dtype, the weight (a parameter) and the fp32 inverse RMS per row (``invvar`` /
    ``rsigma``): r h + 4 bytes per token; its forward and backward are single kernels that
    allocate their outputs only (y; dx and dw). transformers' ``LlamaRMSNorm`` is written out
    in fp32 (Note [Final RMSNorm's backward], trainmem/analytic/head.py): it saves the fp32
    input and the normalised 16-bit tensor too (4 h + r h + 4) and its backward holds five fp32
    tokens x h temporaries. For ``FrameworkConventions.fused_rms_norm`` the stand-in's
    RMSNorms run :class:`FusedRMSNorm` instead: two ``torch.library`` ops whose fake kernels
    allocate exactly the fused kernels' outputs (their CPU kernels compute the RMSNorm and its
    gradients, checked against transformers' norm by tests/trace/test_fused_norm.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["FusedRMSNorm", "fuse_rms_norms"]


@torch.library.custom_op("trainmem::fused_rms_norm", mutates_args=())
def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (xf * rstd).to(x.dtype)).to(x.dtype), rstd


@_forward.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("trainmem::fused_rms_norm_backward", mutates_args=())
def _backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xhat = x.float() * rstd
    g = dy.float() * weight.float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_backward.register_fake
def _(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _local(t: Any) -> Any:
    """A DTensor's local shard (the trace's TP plan hands the norm DTensors), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(local: torch.Tensor, model: Any) -> Any:
    """``local`` as a DTensor with ``model``'s mesh and placements if ``model`` is one."""
    if not hasattr(model, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, model.device_mesh, model.placements, run_check=False,
        shape=model.shape, stride=model.stride(),
    )  # fmt: skip


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as a fused kernel: saves the input, the weight and the fp32 rstd (Note
    [Megatron's fused RMSNorm])."""

    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, eps: float) -> Any:
        y, rstd = _forward(_local(x), _local(weight), eps)
        ctx.save_for_backward(x, weight, rstd)
        return _like(y, x)

    @staticmethod
    def backward(ctx: Any, dy: Any) -> Any:
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(_local(dy), _local(x), _local(weight), rstd)
        return _like(dx, x), _like(dw, weight), None


def _fused_forward(self: Any, hidden_states: Any) -> Any:
    return FusedRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def fuse_rms_norms(model: Any) -> int:
    """Run every transformers RMSNorm of ``model`` written as ``LlamaRMSNorm`` (a 1-D
    ``weight`` multiplying the normalised tensor, ``variance_epsilon``) as
    :class:`FusedRMSNorm`, in place; returns how many. Gemma's ``1 + weight`` norms keep
    their own forward."""
    n = 0
    for module in model.modules():
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        if (
            name.endswith("RMSNorm")
            and not name.startswith("Gemma")
            and hasattr(module, "variance_epsilon")
            and isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 1
        ):
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n
