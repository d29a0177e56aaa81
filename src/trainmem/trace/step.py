"""One training step as a real loop runs it: forward (+ loss) under autocast, backward, optimizer
step, ``zero_grad(set_to_none=...)``; with gradient accumulation, several forward/backward
pairs before the step. With ``set_to_none=False`` the gradients stay allocated (zeroed in place
by ``_foreach_zero_``) into the next step's forward.

The step follows the HF ``Trainer`` / Lightning pattern: the model output is dropped once the loss
is read (``Trainer.training_step`` returns ``loss.detach()``), the loss is divided by
``gradient_accumulation_steps``, and the autocast region covers forward and loss only
(``torch.amp`` recipe). ``GradScaler`` (16-mixed) is not run: its ``found_inf`` check reads a
tensor value (``.item()``), impossible on fake tensors; it allocates only a few scalars.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from trainmem.errors import TraceError
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["compute_loss", "run_step"]

PhaseCallback = Callable[[str], None]
ForwardLoss = Callable[[Any, Any], Any]
"""``forward_loss(model, batch) -> scalar loss`` or ``(scalar loss, model output)``: replaces
``model(**batch)`` + loss reading (the chunked cross-entropy of ``trainmem.trace.chunked_loss``,
whose output is the list of its chunks' logits). A loop that keeps the output holds the
returned one as it holds ``model(**batch)``'s."""


def compute_loss(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None) -> Any:
    """Run the forward pass on ``batch`` and return the scalar loss (:func:`forward_and_loss`
    without the output)."""
    return forward_and_loss(model, batch, loss_fn)[0]


def forward_and_loss(
    model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None
) -> tuple[Any, Any]:
    """Run the forward pass on ``batch`` and return the scalar loss and the model output.

    Args:
        model: the ``nn.Module``.
        batch: a dict (keyword arguments), a tuple/list (positional arguments) or one tensor.
        loss_fn: ``loss_fn(output, batch) -> scalar``; None reads ``output.loss`` /
            ``output["loss"]`` or takes a scalar output as the loss.

    Returns:
        (the scalar loss tensor, the model output).

    Raises:
        TraceError: no loss_fn and the output carries no loss.
    """
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if loss_fn is not None:
        return loss_fn(out, batch), out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if loss is None:
        raise TraceError(
            f"the model returned {type(out).__name__} without a loss; pass loss_fn=lambda out, "
            "batch: ... to trainmem.trace"
        )
    return loss, out


def run_step(
    model: Any,
    batches: Sequence[Any],
    optimizer: Any,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    accumulation_divisor: int = 1,
    on_phase: PhaseCallback | None = None,
    set_to_none: bool = True,
    forward_loss: ForwardLoss | None = None,
    keep_output: bool = False,
    zero_grad_before_backward: bool = False,
    hold_output: bool = False,
) -> None:
    """Run one optimizer step over ``batches`` (one micro-batch each).

    Args:
        model: the ``nn.Module`` in train mode.
        batches: micro-batches, see :func:`compute_loss`.
        optimizer: a ``torch.optim.Optimizer``.
        loss_fn: see :func:`compute_loss`.
        autocast: factory of the autocast context for forward + loss, or None.
        accumulation_divisor: the loss is divided by it (gradient accumulation), if > 1.
        on_phase: called with ``forward``, ``forward_end``, ``backward``, ``backward_end``,
            ``optimizer``, ``zero_grad``, ``end`` at each boundary.
        set_to_none: ``optimizer.zero_grad(set_to_none=...)``.
        forward_loss: computes the loss from ``(model, batch)`` instead of :func:`compute_loss`.
        keep_output: hold the model output until the step ends (``logits = model(x)`` in the
            step function; ``TrainingConfig.keep_logits``) instead of dropping it after the loss.
        zero_grad_before_backward: call ``zero_grad`` between the loss and ``backward()``
            (``TrainingConfig.zero_grad_before_backward``) instead of after the step.
        hold_output: hold each micro-batch's output through its backward, until the next
            micro-batch starts (the last one's until the step ends): a loop that binds the
            output in its own scope (litgpt's ``logits = model(...)``), whose hold into the
            next forward is a rule on the traced step (Note [The previous loop on a traced
            step]).
    """
    signal = on_phase or (lambda _phase: None)
    kept: list[Any] = []
    for batch in batches:
        if hold_output:
            kept.clear()  # the previous micro-batch's output (re-added by the rule)
        signal("forward")
        with autocast() if autocast is not None else contextlib.nullcontext():
            if forward_loss is not None:
                loss, out = _loss_and_output(forward_loss(model, batch))
            else:
                loss, out = forward_and_loss(model, batch, loss_fn)
            if out is not None and (keep_output or hold_output):
                kept.append(out)
            del out
            if accumulation_divisor > 1:
                loss = loss / accumulation_divisor
        signal("forward_end")
        if zero_grad_before_backward:
            signal("zero_grad")
            optimizer.zero_grad(set_to_none=set_to_none)
        signal("backward")
        loss.backward()
        del loss
        signal("backward_end")
    signal("optimizer")
    optimizer.step()
    kept.clear()  # the step function returns
    if not zero_grad_before_backward:
        signal("zero_grad")
        optimizer.zero_grad(set_to_none=set_to_none)
    signal("end")


def _loss_and_output(result: Any) -> tuple[Any, Any]:
    """A :data:`ForwardLoss` result as ``(loss, output)`` (output None when it returns the loss
    alone)."""
    if isinstance(result, tuple):
        loss, out = result
        return loss, out
    return result, None
