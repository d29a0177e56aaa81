"""bitsandbytes' inputs under torch's non-reentrant checkpoint as a transform: each
checkpointed layer's quantized-linear inputs, kept by their ``MatMul4Bit`` / ``MatMul8bitLt``
nodes from the layer's forward to the end of the backward (Note [bitsandbytes' inputs under
non-reentrant checkpointing], Note [bitsandbytes' int8 inputs under non-reentrant
checkpointing] in trainmem/analytic/held_outputs.py)."""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.held_outputs import checkpoint_held_input_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op, Repeat

KEY = "bnb_ctx_inputs/{i}"
LABEL = "a layer's bitsandbytes inputs, kept by its matmuls' ctx through the backward"


class Bnb4bitCheckpointInputs(Transform):
    """Inserts: ``layer.post_forward`` the layer's kept inputs
    (:func:`~trainmem.analytic.held_outputs.checkpoint_held_input_bytes`); ``root.post_backward``
    their frees, every layer's (the graph dropped with the loss)."""

    name = "bnb_checkpoint_inputs"

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return checkpoint_held_input_bytes(ctx.model, ctx.training) > 0 and ctx.num_layers > 0

    def _kept(self, *, first: bool) -> Op:
        size = checkpoint_held_input_bytes(self.ctx.model, self.ctx.training, first_layer=first)
        return alloc(size, Cat.ACTIVATION, "forward", KEY, "layers.{i}", LABEL)

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        first = where.first_layer and self.ctx.rank.stage == 0
        return (self._kept(first=first),)

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        n = self.ctx.num_layers
        first = self.ctx.rank.stage == 0
        out: list[Emitted] = []
        if n > 1:
            op = free(self._kept(first=False), "backward")
            out.append(Repeat((op,), n - 1, start=1))
        # the stack's first layer under its own index (outside a repeat ``{i}`` would be the
        # micro-batch's)
        out.append(Repeat((free(self._kept(first=first), "backward"),), 1))
        return out
