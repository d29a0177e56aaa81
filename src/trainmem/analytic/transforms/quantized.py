"""Quantized bases (QLoRA's NF4, int8) as a transform: the dequantized weight each quantized
linear makes in its forward and again in its backward, one at a time, and the LM head's.

Source: bitsandbytes autograd/_functions.py ``MatMul4Bit`` (``dequantize_4bit`` in forward
and backward, freed after the matmul); sizes :func:`~trainmem.analytic.buffers.
dequantized_weight_bytes`, :func:`~trainmem.analytic.activations.lm_head_dequant_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.buffers import dequantized_weight_bytes
from trainmem.analytic.head import lm_head_dequant_bytes
from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase


def _head_bytes(ctx: RankContext) -> int:
    return lm_head_dequant_bytes(ctx.model, ctx.training) if ctx.rank.has_head else 0


class QuantizedBase(Transform):
    """The dequantized weights of a quantized base: per layer at ``layer.forward`` and
    ``layer.backward`` (made and freed), the LM head's from ``head.forward`` to
    ``head.post_forward`` and again at ``head.backward``."""

    name = "quantized"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.layer = dequantized_weight_bytes(ctx.layer_states, ctx.training)
        self.head = _head_bytes(ctx)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return bool(dequantized_weight_bytes(ctx.layer_states, ctx.training) or _head_bytes(ctx))

    def _layer(self, phase: Phase) -> Sequence[Op]:
        if not self.layer:
            return ()
        label = "a dequantized base weight"
        d = alloc(self.layer, Cat.TEMPORARY, phase, "dequant", "layers.{i}", label)
        return (d, free(d, phase))

    def _head(self, phase: Phase) -> Op:
        label = "the LM head's dequantized weight"
        return alloc(self.head, Cat.TEMPORARY, phase, "dequant/head", "head", label)

    def layer_forward(self, where: Where) -> Sequence[Emitted]:
        return self._layer("forward")

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        return self._layer("backward")

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return (Lifetime(self._head("forward"), "head.post_forward"),) if self.head else ()

    def head_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.head:
            return ()
        d = self._head("backward")
        return (d, free(d, "backward"))
