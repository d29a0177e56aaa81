"""torchao's eager float8 casts of the MLP linears' weights as a transform (Note [Float8 casts
of a base weight] in :mod:`trainmem.analytic.float8`): the linear's other operand's and
the weight's two fp32 copies and float8 copy each (the weight's not under FSDP2's float8
all-gather), made per matmul and freed after it, at the layer's first
MLP linear (``layer.forward``), at its down projection (``layer.mlp.forward``), at a fully
checkpointed layer's recompute (``layer.backward``) and at the down projection's backward
(``layer.mlp.down_backward``), where the input gradient is made after the fp32 copies are
freed, beside the float8 weight, then the weight gradient's operands are cast
(``layer.mlp.down_weight_backward``)."""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import tokens_per_sequence
from trainmem.analytic.float8 import float8_eager_casts, float8_weight_cast_bytes
from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
)
from trainmem.analytic.transforms.points import Point
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase

_RELEASE: Point = "layer.mlp.post_backward"  # the weight gradient exists


class Float8WeightCasts(Transform):
    """The float8 casts of an MLP linear's input and weight (torchao 0.18
    torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args``), one linear at a time."""

    name = "float8"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        m, t = ctx.model, ctx.training
        tokens = t.micro_batch_size * tokens_per_sequence(m, t)
        # float8 copies, 1 byte a value: the MLP's input (gate's), act(gate) * up (down's),
        # the gradient of down's output
        self.hidden = m.hidden_size * tokens // parallel_divisor("mlp/input", t)
        self.inner = m.intermediate_size * tokens // parallel_divisor("mlp/gated", t)
        self.weight = float8_weight_cast_bytes(m, t)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return float8_eager_casts(ctx.model, ctx.training)

    def _operand_cast(self, operand: int, key: str, label: str) -> list[Emitted]:
        """A backward operand's cast for the weight-gradient matmul: its fp32 copies made and
        freed, its float8 copy kept until the weight gradient exists
        (``layer.mlp.post_backward``)."""
        b: Phase = "backward"
        scaled, clamped, fp8 = (
            alloc(size, Cat.TEMPORARY, b, f"float8/{key}{part}", "layers.{i}", label)
            for part, size in (("_scaled", 4 * operand), ("_clamped", 4 * operand), ("", operand))
        )
        return [scaled, clamped, Lifetime(fp8, _RELEASE), free(scaled, b), free(clamped, b)]

    def _casts(self, phase: Phase, operand: int, which: str) -> list[Op]:
        """The operand's scaled fp32 copy, its clamp and its float8 copy, then the weight's
        (where it is cast); the fp32 copies freed after each cast, the float8 ones after the
        matmul."""
        label = f"torchao's float8 casts of {which}"
        keys: tuple[str, ...] = ("operand_scaled", "operand_clamped", "operand")
        sizes: tuple[int, ...] = (4 * operand, 4 * operand, operand)
        if self.weight:
            keys += ("scaled", "clamped", "weight")
            sizes += self.weight
        made = [
            alloc(size, Cat.TEMPORARY, phase, f"float8/{key}", "layers.{i}", label)
            for key, size in zip(keys, sizes, strict=True)
        ]
        out: list[Op] = []
        for cast in (made[:3], made[3:]):  # fp32 copies freed as the cast returns
            out += [*cast, *(free(op, phase) for op in cast[:2])]
        return [*out, *(free(op, phase) for op in reversed(made[2::3]))]

    def layer_forward(self, where: Where) -> Sequence[Emitted]:
        return self._casts("forward", self.hidden, "the MLP's input and gate's weight")

    def layer_mlp_forward(self, where: Where) -> Sequence[Emitted]:
        return self._casts("forward", self.inner, "down's input and weight")

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        """A fully checkpointed layer's recompute casts again (Note [The recompute's tensors
        held at the down projection]: down's casts beside the recomputed blocks)."""
        if self.ctx.training.activation_checkpointing != "full":
            return ()
        return self._casts("backward", self.inner, "the recomputed down's input and weight")

    def layer_mlp_down_weight_backward(self, where: Where) -> Sequence[Emitted]:
        """The weight gradient's operands, cast along the other dimension once down's input
        gradient exists (the output gradient, t h, then down's saved input, t i), and the
        copies ``torch._scaled_mm``'s operand layout takes of both before the matmul."""
        label = "torchao's float8 casts for down's weight gradient"
        go = self._operand_cast(self.hidden, "grad_output_dim1", label)
        x = self._operand_cast(self.inner, "input_dim1", label)
        layout = [
            Lifetime(
                alloc(size, Cat.TEMPORARY, "backward", f"float8/{key}", "layers.{i}", label),
                _RELEASE,
            )
            for key, size in (("grad_output_layout", self.hidden), ("input_layout", self.inner))
        ]
        return [*go, *x, *layout]

    def layer_mlp_down_backward(self, where: Where) -> Sequence[Emitted]:
        """Down's input gradient is made between the fp32 copies' frees and the float8
        weight's (:meth:`~trainmem.analytic.schedule._Layers._down_backward`)."""
        return self._casts("backward", self.hidden, "down's output gradient and weight")
