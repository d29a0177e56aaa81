"""LoRA's first layer as a transform: the stack's first layer saves less than the others when
nothing before its adapters requires grad (Note [LoRA's first layer] in
:mod:`trainmem.analytic.lora`).

Source: torch 2.13 torchgen/packaged/autograd/gen_variable_type.py ``guard_for`` (a recorded
op keeps a tensor only for the inputs that need a gradient; an op none of whose inputs
requires grad is not recorded); peft tuners/lora/layer.py ``Linear.forward``.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.lora import first_layer_unsaved
from trainmem.analytic.transforms.base import RankContext, Transform
from trainmem.analytic.transforms.checkpointing import layer_plan, term_blocks


class LoraFirstLayer(Transform):
    """Under LoRA without activation checkpointing, on the rank that holds the embedding
    (pipeline stage 0, or no pipelining), layer 0 saves the other layers' blocks less its
    input norm's term and the rest of :func:`~trainmem.analytic.lora.first_layer_unsaved`.
    Under pipelining the first stage's input is the token ids, as without it (torch
    distributed/pipelining: the first stage's forward takes the micro-batch's ``input_ids``,
    which need no gradient), so each micro-batch's first layer saves as much less, the other
    micro-batches in flight too (:func:`first_layer_less_bytes`, read by the pipeline
    transform).

    Not with activation offloading: its transform frees and prefetches the previous layer's
    blocks by the common layer plan (``ActivationOffloading``, ``{i_prev}``), which has no
    "second layer" position to name layer 0's smaller set; layer 0 is counted as the others
    there (an over-count of the terms above, about one layer's input), never a free of a block
    that was not made."""

    name = "lora_first_layer"
    layer_position = frozenset({"first", "last"})

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return (
            ctx.prof is not None
            and ctx.rank.stage == 0
            and not ctx.training.activation_offloading
            and first_layer_unsaved(ctx.model, ctx.training) is not None
        )

    def first_layer_saved(
        self, saved: Sequence[tuple[str, int]]
    ) -> Sequence[tuple[str, int]] | None:
        unsaved = first_layer_unsaved(self.ctx.model, self.ctx.training)
        if unsaved is None:
            return None
        totals: dict[str, int] = {}
        for term, size in saved:
            whole = any(term.startswith(w) if w.endswith("/") else term == w for w in unsaved.whole)
            if not whole:
                totals[term] = totals.get(term, 0) + size
        for term, less in unsaved.less.items():
            if term in totals:
                totals[term] = max(totals[term] - less, 0)
        return term_blocks(self.ctx, totals)


def first_layer_less_bytes(ctx: RankContext) -> int:
    """Bytes the stack's first layer saves less than the others on this rank (0 where
    :class:`LoraFirstLayer` does not apply): what a micro-batch in flight on the first
    pipeline stage holds less than ``per_layer`` times its layers."""
    if not LoraFirstLayer.applies(ctx):
        return 0
    saved = layer_plan(ctx).saved
    first = LoraFirstLayer(ctx).first_layer_saved(saved)
    if first is None:
        return 0
    return sum(size for _, size in saved) - sum(size for _, size in first)
