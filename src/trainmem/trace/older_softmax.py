"""Run softmax and log-softmax as torch before 1.11 did: autograd saves their input too.

Note [Softmax saving its input before torch 1.11]
    Until torch 1.11 the backward formulas of ``_softmax`` and ``_log_softmax`` took the
    forward's input (tools/autograd/derivatives.yaml: ``self: _softmax_backward_data(grad,
    result, dim, self)``, ``self: _log_softmax_backward_data(grad, result, dim, self)``), so
    autograd kept ``self`` beside the output although the kernels read only the output
    (pytorch/pytorch issue #64000, "Softmax/logsoftmax use more memory for backward than
    needed"; fixed by PR #65242, which passes ``self.scalar_type()``; transformers 4.21
    pytorch_utils.py ``softmax_backward_data`` dates the signature change to 1.11 with
    ``is_torch_less_than_1_11``). An eager attention therefore kept its pre-softmax scores per
    layer, and a cross-entropy (``cross_entropy_loss`` = ``nll_loss`` on ``log_softmax``) its
    logits, until the backward reached them. The input kept is the one the kernel saw: with
    ``dtype=`` or under autocast (softmax and log_softmax are fp32 ops in CUDA's autocast
    lists) the float32 copy, which the older release made and saved.

    The installed torch saves the output only, so within :func:`older_softmax_backward`
    ``F.softmax`` / ``F.log_softmax`` run through a ``torch.autograd.Function`` that computes
    the installed op, saves the input (in the output's dtype) and the output, and backs off
    with the installed ``_softmax_backward_data`` / ``_log_softmax_backward_data``; and
    ``F.cross_entropy`` with class-index targets and no label smoothing runs as the ATen
    composite it is (aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss``:
    ``nll_loss_nd(log_softmax(self, 1, self.scalar_type()), target, weight, reduction,
    ignore_index)``) so that its log-softmax is the patched one (with label smoothing,
    probability targets or the legacy ``size_average`` / ``reduce`` the installed op runs, whose
    log-softmax keeps its output only). ``Tensor.softmax`` and
    ``torch.softmax`` are not patched (transformers' eager attentions call
    ``nn.functional.softmax``). The analytic engine keeps the scores of an eager attention
    (``trainmem.analytic.attention``) and a cross-entropy's logits in the log-softmax's
    output dtype (``trainmem.analytic.loss`` ``loss_saved_terms``: the plain and the 16-bit
    cross-entropy; the course's, chunked-compiled, Megatron's, torchtune's transposed and
    Unsloth's losses are torch 2 code) on such a release; both engines ask
    ``TrainingConfig.softmax_saves_input``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

F = torch.nn.functional

__all__ = ["older_softmax_backward"]


class _SavesInput(torch.autograd.Function):
    """``op(x)`` whose backward holds ``x`` (in the output's dtype) beside the output."""

    @staticmethod
    def forward(ctx: Any, x: Any, op: Any, dim: int, log: bool) -> Any:
        out = op(x)
        kept = x if x.dtype == out.dtype else x.to(out.dtype)  # the kernel's input
        ctx.save_for_backward(kept, out)
        ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:
        kept, out = ctx.saved_tensors
        backward = (
            torch.ops.aten._log_softmax_backward_data
            if ctx.log
            else torch.ops.aten._softmax_backward_data
        )
        grad_in = backward(grad.to(out.dtype), out, ctx.dim, kept.dtype)
        return grad_in.to(ctx.in_dtype), None, None, None


def _dim_of(x: Any, dim: int | None) -> int:
    """``F.softmax``'s implicit dim (``_get_softmax_dim``) made explicit."""
    if dim is not None:
        return dim
    return 0 if x.dim() in (0, 1, 3) else 1


@contextlib.contextmanager
def older_softmax_backward() -> Iterator[None]:
    """Within the block ``F.softmax``, ``F.log_softmax`` and ``F.cross_entropy`` keep their
    input for the backward as torch before 1.11 did (Note [Softmax saving its input before
    torch 1.11]).

    Yields:
        None.
    """
    softmax, log_softmax, cross_entropy = F.softmax, F.log_softmax, F.cross_entropy

    def wrap(original: Any, log: bool) -> Any:
        def patched(
            input: Any,  # noqa: A002
            dim: int | None = None,
            _stacklevel: int = 3,
            dtype: Any = None,
        ) -> Any:
            if not (torch.is_grad_enabled() and input.requires_grad):
                return original(input, dim, _stacklevel, dtype)
            axis = _dim_of(input, dim)
            x = input if dtype is None else input.to(dtype)

            def op(t: Any) -> Any:
                return original(t, axis)

            return _SavesInput.apply(x, op, axis, log)

        return patched

    def patched_cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        names = ("weight", "size_average", "ignore_index", "reduce", "reduction")
        given = dict(zip(names, args, strict=False)) | kwargs
        smoothing = given.pop("label_smoothing", 0.0)
        if smoothing or target.is_floating_point() or given.get("size_average") is not None:
            return cross_entropy(input, target, *args, **kwargs)
        if given.get("reduce") is not None:
            return cross_entropy(input, target, *args, **kwargs)
        return F.nll_loss(
            F.log_softmax(input, 1 if input.dim() > 1 else 0),
            target,
            weight=given.get("weight"),
            ignore_index=given.get("ignore_index", -100),
            reduction=given.get("reduction", "mean"),
        )

    F.softmax = wrap(softmax, log=False)
    F.log_softmax = wrap(log_softmax, log=True)
    F.cross_entropy = patched_cross_entropy
    try:
        yield
    finally:
        F.softmax, F.log_softmax, F.cross_entropy = softmax, log_softmax, cross_entropy
