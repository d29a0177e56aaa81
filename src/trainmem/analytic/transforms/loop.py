"""The training loop's conventions as a transform: when ``zero_grad()`` frees the gradients
(``set_to_none=True``, the default since PyTorch 2.0, after the step or between the forward
and the backward; kept with ``set_to_none=False`` or a gradient buffer made at wrap time) and
the logits a loop holds until the step ends (``TrainingConfig.keep_logits``).

Source: torch/optim/optimizer.py ``zero_grad`` (``set_to_none``); a loop that keeps the model
output past ``loss.backward()`` (``outputs = model(...)`` read after ``optimizer.step()``, e.g.
for logging) holds its logits until the step function returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from trainmem.analytic.loss import loss_forward_transient_bytes
from trainmem.analytic.pipeline import logits_bytes
from trainmem.analytic.transforms.base import (
    Emitted,
    RankContext,
    Transform,
    Where,
    all_gradients,
    alloc,
    free,
    free_gradients,
    keeps_gradients,
)
from trainmem.analytic.transforms.deepspeed import zero1_reduces
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op, Repeat


class ZeroGrad(NamedTuple):
    """When ``zero_grad()`` frees the gradients.

    Attributes:
        keep: never (:func:`~trainmem.analytic.transforms.base.keeps_gradients`): the
            micro-batches accumulate into gradients that exist from the warm-up step on.
        before_backward: between the forward and the backward
            (``TrainingConfig.zero_grad_before_backward``): the previous step's gradients are
            alive through the forward (the warm-up step is given them too, as after an
            earlier step) and freed before the backward rebuilds them.
        after_step: after ``optimizer.step()``.
    """

    keep: bool
    before_backward: bool
    after_step: bool


def zero_grad_policy(ctx: RankContext) -> ZeroGrad:
    """The rank's :class:`ZeroGrad` (neither with optimizer-in-backward, which frees each
    gradient once stepped, nor under DeepSpeed ZeRO-1, which frees them into its partition;
    kept in ``ctx.memo``: the builder asks at every step it builds)."""
    cached = ctx.memo.get("zero_grad_policy")
    if isinstance(cached, ZeroGrad):
        return cached
    t = ctx.training
    keep = keeps_gradients(t)
    released = t.optimizer_in_backward or zero1_reduces(ctx)
    before = t.zero_grad_before_backward and not keep and not released
    out = ctx.memo["zero_grad_policy"] = ZeroGrad(
        keep, before, not keep and not before and not released
    )
    return out


def kept_logits_bytes(ctx: RankContext) -> int:
    """The logits the loop holds: one micro-batch's (the loop keeps the last output), when
    they are part of the loss's forward transients (0 otherwise)."""
    t = ctx.training
    if not (t.keep_logits and ctx.rank.has_head) or t.pipeline_parallel_size > 1:
        return 0
    part = logits_bytes(ctx.model, t)
    return part if 0 < part <= loss_forward_transient_bytes(ctx.model, t) else 0


class TrainingLoop(Transform):
    """The loop's ``zero_grad`` and kept logits: the gradients kept over steps allocated in the
    warm-up step (``step.begin``); ``zero_grad()`` before the backward (``forward.end``) or
    after the step (``step.post_optimizer``); the kept logits allocated with the logits
    (``head.forward``) and freed when the step function returns (``step.post_optimizer``)."""

    name = "loop"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.held_logits = kept_logits_bytes(ctx)
        self.zero_grad = zero_grad_policy(ctx)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return True

    def _kept(self) -> Op:
        return alloc(
            self.held_logits,
            Cat.TEMPORARY,
            "forward",
            "logits_kept",
            "head",
            "the logits, held by the training loop until the step ends",
        )

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        z = self.zero_grad
        if where.first_step and (z.keep or z.before_backward):
            return all_gradients(self.ctx, "forward")
        return ()

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return (self._kept(),) if self.held_logits else ()

    def forward_end(self, where: Where) -> Sequence[Emitted]:
        # optimizer.zero_grad() between the loss and loss.backward()
        return free_gradients(self.ctx, "zero_grad") if where.zero_grad else ()

    def step_post_optimizer(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.held_logits:  # the step function returns: its logits go
            out.append(free(self._kept(), "optimizer"))
        if self.zero_grad.after_step:
            cached = self.ctx.shared.get("zero_grad")
            if not isinstance(cached, Repeat):
                frees = tuple(free_gradients(self.ctx, "zero_grad"))
                cached = self.ctx.shared["zero_grad"] = Repeat(frees, 1)
            out.append(cached)
        return out
