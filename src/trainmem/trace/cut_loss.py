"""Apple's Cut Cross Entropy on a traced HF causal LM (``TrainingConfig.cut_cross_entropy``,
axolotl's ``CutCrossEntropyPlugin``): the head and the loss replaced by one autograd function
that allocates what the kernel's Python allocates and nothing it keeps on chip.

Shapes: b = micro_batch_size, s = seq_len, t = b s, h = hidden_size, V = vocab_size.

Note [Cut Cross Entropy on a traced step]
    The Triton kernels cannot run here, and they write no (t x V) tensor: every logit lives in
    a kernel's registers (Note [axolotl's Cut Cross Entropy] in trainmem/analytic/loss.py, read
    at axolotl-ai-cloud/ml-cross-entropy 5f0c7a7). So the model runs with its output head made
    the identity (as :mod:`trainmem.trace.chunked_loss` runs it: ``output.logits`` is the final
    norm's output, [b, s, h], a view), and :class:`_CutCrossEntropy` stands for cce.py
    ``LinearCrossEntropyFunction`` with the allocations of its Python:

    * forward: the fp32 log-sum-exp per token (``cce_lse_forward_kernel``), the fp32 mean logit
      per vocabulary entry (``return_logit_avg``: ``filter_eps="auto"`` and a gradient wanted),
      the fp32 negated target logit per token (``indexed_neg_dot_forward_kernel``, added into in
      place, ``neg_dot.add_(lse)``) and its sum; ``ctx.save_for_backward(e, c, bias, lse,
      targets, valids, logit_avg)``: the hidden states (already alive), the head weight (a
      parameter), lse and logit_avg;
    * backward (cce_backward.py ``cce_backward_kernel``): ``de = torch.zeros_like(e)`` when the
      hidden states require grad, ``dc = torch.zeros_like(c)`` only when the head weight does.

    Its values are not the loss (zeros: a fake tensor has none, and only the bytes are read).
    Not allocated, as the analytic engine does not count them: the int32 valid positions and
    the targets' pad (up to 8 B per token), ``vocab_ordering`` (the backward's argsort of
    logit_avg, 12 B per vocabulary entry) and the kernel's int32 locks. A final logit
    soft-cap is the kernel's own (``softcap``): the model's is turned off around the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trainmem.errors import UnsupportedError

__all__ = ["cut_cross_entropy_forward"]

IGNORE_INDEX = -100
"""HF's and cut_cross_entropy's ``ignore_index``."""


class _CutCrossEntropy(torch.autograd.Function):
    """cce.py ``LinearCrossEntropyFunction``'s allocations (Note [Cut Cross Entropy on a
    traced step])."""

    @staticmethod
    def forward(ctx: Any, e: Any, c: Any) -> Any:
        t, v = e.size(0), c.size(0)
        lse = e.new_zeros((t,), dtype=torch.float32)
        needs_grad = e.requires_grad or c.requires_grad
        logit_avg = e.new_zeros((v,), dtype=torch.float32) if needs_grad else None
        neg_dot = e.new_zeros((t,), dtype=torch.float32)
        loss = neg_dot.add_(lse).sum()
        ctx.save_for_backward(e, c, lse, logit_avg)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Any) -> tuple[Any, Any]:
        e, c, _lse, _logit_avg = ctx.saved_tensors
        de = torch.zeros_like(e) if ctx.needs_input_grad[0] else None
        dc = torch.zeros_like(c) if ctx.needs_input_grad[1] else None
        return de, dc


@contextlib.contextmanager
def _identity_head(head: Any, config: Any) -> Iterator[None]:
    cap = getattr(config, "final_logit_softcapping", None)
    head.forward = lambda x: x
    if cap:
        config.final_logit_softcapping = None
    try:
        yield
    finally:
        del head.forward
        if cap:
            config.final_logit_softcapping = cap


def cut_cross_entropy_forward(*, keep_output: bool = False) -> Any:
    """A ``forward_loss(model, batch)`` with the head and the loss as Cut Cross Entropy.

    Args:
        keep_output: the loop binds the model's output past the loss (``keep_logits``, loop
            ``previous``): the patched forward returns no logits, so it holds the KV cache a
            transformers model returns.

    Returns:
        ``forward_loss(model, batch) -> scalar``, or with ``keep_output`` ``-> (scalar, the
        returned cache)``, for :func:`trainmem.trace.step.run_step`.
    """

    def forward_loss(model: Any, batch: Any) -> Any:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not isinstance(batch, dict) or "labels" not in batch:
            raise UnsupportedError(
                "cut_cross_entropy is traced for HF causal LMs only (an output head and "
                "labels); allowed: cut_cross_entropy false"
            )
        if getattr(head, "bias", None) is not None:
            raise UnsupportedError(
                "cut_cross_entropy with an LM head bias is not traced; use --engine analytic"
            )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with _identity_head(head, getattr(model, "config", None)):
            output = model(**inputs)
        hidden = output.logits  # [b, s, h], the final norm's output
        cache = getattr(output, "past_key_values", None) if keep_output else None
        del output
        # transformers/utils.py ``apply_lce``: ``e = e.to(c.dtype)`` for fp32 hidden states
        # over a bf16 head (DoRA's output); cce.py: ``e.contiguous()``, ``flatten(0, -2)``
        weight = head.weight
        if hidden.dtype == torch.float32 and weight.dtype == torch.bfloat16:
            hidden = hidden.to(weight.dtype)
        loss = _CutCrossEntropy.apply(hidden.contiguous().flatten(0, -2), weight)
        return (loss, cache) if keep_output else loss

    return forward_loss
