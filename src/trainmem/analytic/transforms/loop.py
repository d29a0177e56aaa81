"""The training loop's conventions as a transform: the logits a loop holds until the step ends
(``TrainingConfig.keep_logits``).

Source: a loop that keeps the model output past ``loss.backward()`` (``outputs = model(...)``
read after ``optimizer.step()``, e.g. for logging) holds its logits until the step function
returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.loss import loss_forward_transient_bytes
from trainmem.analytic.pipeline import logits_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op


def kept_logits_bytes(ctx: RankContext) -> int:
    """The logits the loop holds: one micro-batch's (the loop keeps the last output), when
    they are part of the loss's forward transients (0 otherwise)."""
    t = ctx.training
    if not (t.keep_logits and ctx.rank.has_head) or t.pipeline_parallel_size > 1:
        return 0
    part = logits_bytes(ctx.model, t)
    return part if 0 < part <= loss_forward_transient_bytes(ctx.model, t) else 0


class TrainingLoop(Transform):
    """The loop's kept logits: allocated with the logits (``head.forward``), freed when the
    step function returns (``step.post_optimizer``)."""

    name = "loop"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.held_logits = kept_logits_bytes(ctx)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return kept_logits_bytes(ctx) > 0

    def _kept(self) -> Op:
        return alloc(
            self.held_logits,
            Cat.TEMPORARY,
            "forward",
            "logits_kept",
            "head",
            "the logits, held by the training loop until the step ends",
        )

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return (self._kept(),)

    def step_post_optimizer(self, where: Where) -> Sequence[Emitted]:
        return (free(self._kept(), "optimizer"),)
