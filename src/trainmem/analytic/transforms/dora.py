"""DoRA's forward transients as a transform: the weight-sized tensors peft's DoRA builds in each
targeted linear's forward to take the row norms (Note [DoRA forward transients] in
:mod:`trainmem.analytic.lora_variants`), made and freed at the end of each layer's forward
and, under activation checkpointing, of its recomputation in the backward."""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.lora_variants import dora_forward_transient_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


class DoraWeightNorm(Transform):
    """peft's DoRA: the adapters' product, the base weight's cast and their scaled sum, once per
    layer's forward (at ``layer.post_forward``) and recomputation (``layer.backward``)."""

    name = "dora"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        adapter_bytes = dtype_bytes(lora_adapter_dtype(ctx.training))
        self.bytes = dora_forward_transient_bytes(
            ctx.model, ctx.training, adapter_bytes=adapter_bytes
        )

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return ctx.training.lora_variant == "dora" and ctx.training.is_lora

    def _made(self, phase: Phase) -> Sequence[Emitted]:
        label = "DoRA's weight-norm temporaries (peft tuners/lora/dora.py)"
        op = alloc(self.bytes, Cat.TEMPORARY, phase, "dora_norm", "layers.{i}", label)
        return (op, free(op, phase))

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        return self._made("forward")

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        if self.ctx.training.activation_checkpointing == "none":
            return ()
        return self._made("backward")
