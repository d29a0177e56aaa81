"""DoRA's forward transients as a transform: the weight-sized tensors peft's DoRA builds in each
targeted linear's forward to take the row norms (Note [DoRA forward transients] in
:mod:`trainmem.analytic.lora_variants`; over a bitsandbytes base, Note [QDoRA]), made and freed
at the layer's start for its input projections and at its end for the other linears (Note
[Where DoRA's transients sit]) and, under activation checkpointing, in its recomputation in
the backward.

Note [DoRA's layer start on a 16-bit stream]
    At q / k / v's moment the layer's first norm has run: on a 16-bit residual stream
    (bf16-true) HF's RMSNorm saves ``x.to(torch.float32)``, a new 4 t h copy (Note in
    :func:`~trainmem.analytic.transforms.checkpointing.first_norm_saves_its_input`), alive
    there though the schedule makes the layer's saved blocks later; and peft's
    ``_cast_input_dtype`` (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``, after
    ``result = self.base_layer(x)``, before the variant's forward) has made the fp32 input
    lora_A saves without autocast (:func:`dora_forward_transient_bytes` ``at_start``). Traced
    on the agreement model (2048-wide Llama, 2 x 256 tokens, DoRA on q / v, bf16-true): the
    generic path peaks at layer 1's q_proj norm 8,393,240 B above the formulas (+2.27 %),
    these two 4 MiB tensors; with them +0.001 %.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.activation_shapes import tokens_per_sequence
from trainmem.analytic.checkpointing import layer_is_checkpointed
from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.lora_variants import (
    INPUT_PROJECTIONS,
    O_LINEARS,
    UP_LINEARS,
    dora_down_dropout_output_bytes,
    dora_down_moment_in_forward,
    dora_embeddings_held_bytes,
    dora_forward_transient_bytes,
    dora_layer_start_held_bytes,
    dora_moments_per_linear,
    dora_recompute_down_held_bytes,
    dora_recompute_gradient_bytes,
)
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.analytic.transforms.checkpointing import (
    cached_down_output,
    dora_down_base_recomputed_first,
    first_norm_saves_its_input,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


class DoraWeightNorm(Transform):
    """peft's DoRA: the adapters' product, the base weight's cast (or dequantization) and their
    scaled sum, in each layer's forward (the input projections' at ``layer.forward``, the
    others' at ``layer.post_forward``) and recomputation (the larger, at ``layer.backward``)."""

    name = "dora"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        adapter_bytes = dtype_bytes(lora_adapter_dtype(ctx.training))
        model, training = ctx.model, ctx.training
        # Note [Where DoRA's transients sit]
        self.start = dora_forward_transient_bytes(
            model, training, adapter_bytes=adapter_bytes, linears=INPUT_PROJECTIONS, at_start=True
        )
        self.start_held = {
            first: dora_layer_start_held_bytes(
                model, training, first_layer=first, has_embedding=ctx.rank.has_embedding
            )
            for first in (False, True)
        }
        # inputs_embeds at o's and gate / up's moments (Note [DoRA's moment at each linear])
        self.embeddings = {
            first: dora_embeddings_held_bytes(
                model, training, first_layer=first, has_embedding=ctx.rank.has_embedding
            )
            for first in (False, True)
        }
        # Note [DoRA's layer start on a 16-bit stream]: the first RMSNorm's fp32 copy
        if not first_norm_saves_its_input(model, training) and not layer_is_checkpointed(training):
            t = training.micro_batch_size * tokens_per_sequence(model, training)
            for held in self.start_held.values():
                if held:
                    held.append(4 * t * model.hidden_size)
        # Note [DoRA's moment at each linear]: o's and gate / up's where they run
        per_linear = dora_moments_per_linear(model, training)
        self.o, self.up = (
            dora_forward_transient_bytes(
                model, training, adapter_bytes=adapter_bytes, linears=linears, at_start=True
            )
            if per_linear
            else 0
            for linears in (O_LINEARS, UP_LINEARS)
        )
        moved = O_LINEARS | UP_LINEARS if per_linear else frozenset()
        # Note [DoRA's down moment in the forward]: down's at its base matmul
        self.forward_down = 0
        if dora_down_moment_in_forward(model, training):
            moved |= {"down"}
            # down's input: the base matmul's saved input, or held by the schedule where no
            # block saves it (``down_projection_held_bytes``); the product's cast a t i here
            input_held = training.quantized_matmul_saves_input or not ctx.profile.terms.get(
                "mlp/down_input"
            )
            self.forward_down = dora_forward_transient_bytes(
                model,
                training,
                adapter_bytes=adapter_bytes,
                linears=frozenset({"down"}),
                input_held=input_held,
            ) + sum(dora_down_dropout_output_bytes(model, training, adapter_bytes=adapter_bytes))
        self.end = dora_forward_transient_bytes(
            model, training, adapter_bytes=adapter_bytes, exclude=INPUT_PROJECTIONS | moved
        )
        self.bytes = max(self.start, self.o, self.up, self.end, self.forward_down)
        down = dora_forward_transient_bytes(
            model, training, adapter_bytes=adapter_bytes, linears=frozenset({"down"})
        )
        # Note [DoRA's moments in the recompute]: down's moment, with what the recompute holds
        # Note [The adapters' matmuls under op-level ...], Note [DoRA's base output in the
        # recompute]: down's base output a block of the layer
        cached = cached_down_output(ctx) or dora_down_base_recomputed_first(model, training)
        self.recompute_down = (
            dora_recompute_down_held_bytes(
                model, training, adapter_bytes=adapter_bytes, base_output_cached=cached
            )
            if down
            else []
        )
        self.down = down
        # Note [DoRA's output gradient before the recompute]
        self.output_grads = dora_recompute_gradient_bytes(
            model, training, adapter_bytes=adapter_bytes
        )

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return ctx.training.lora_variant == "dora" and ctx.training.is_lora

    def _made(self, size: int, phase: Phase) -> Sequence[Emitted]:
        if not size:
            return ()
        label = "DoRA's weight-norm temporaries (peft tuners/lora/dora.py)"
        op = alloc(size, Cat.TEMPORARY, phase, "dora_norm", "layers.{i}", label)
        return (op, free(op, phase))

    def _beside(self, size: int, held: Sequence[int], key: str, label: str) -> Sequence[Emitted]:
        """A forward moment of ``size`` bytes with the tensors ``held`` (bytes each; keys
        ``key/<k>``) alive around it; nothing without the moment."""
        made = self._made(size, "forward")
        if not made:
            return ()
        ops = [
            alloc(n, Cat.TEMPORARY, "forward", f"{key}/{k}", "layers.{i}", label)
            for k, n in enumerate(held)
        ]
        return [*ops, *made, *(free(op, "forward") for op in ops)]

    def layer_forward(self, where: Where) -> Sequence[Emitted]:
        """The input projections' moment, with what the forward holds there that no block
        made so far counts (Note [Where DoRA's transients sit])."""
        label = "what the forward holds at the layer's input projections"
        return self._beside(self.start, self.start_held[where.first_layer], "dora_held", label)

    def _made_beside_embeddings(self, size: int, where: Where) -> Sequence[Emitted]:
        """A forward moment after the layer's input projections, with transformers'
        ``inputs_embeds`` where no block holds it (:func:`dora_embeddings_held_bytes`)."""
        label = "transformers' inputs_embeds, held through the layer loop"
        return self._beside(size, self.embeddings[where.first_layer], "dora_embeds", label)

    def layer_o_forward(self, where: Where) -> Sequence[Emitted]:
        return self._made_beside_embeddings(self.o, where)

    def layer_mlp_up_forward(self, where: Where) -> Sequence[Emitted]:
        return self._made_beside_embeddings(self.up, where)

    def layer_mlp_forward(self, where: Where) -> Sequence[Emitted]:
        """Down's moment beside what the forward holds at down (Note [DoRA's down moment in
        the forward]; the schedule's ``down_held``)."""
        return self._made(self.forward_down, "forward")

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        return self._made(self.end, "forward")

    def layer_o_recompute(self, where: Where) -> Sequence[Emitted]:
        if self.ctx.training.activation_checkpointing == "none":
            return ()
        return self._made(self.o, "backward")

    def layer_mlp_up_recompute(self, where: Where) -> Sequence[Emitted]:
        if self.ctx.training.activation_checkpointing == "none":
            return ()
        return self._made(self.up, "backward")

    def _gradients(self) -> list[Op]:
        """What the layer's backward makes before the recompute (Note [DoRA's output gradient
        before the recompute]), freed after down's moment."""
        label = "DoRA's output gradient before the recompute"
        return [
            alloc(size, Cat.TEMPORARY, "backward", f"dora_grad/{k}", "layers.{i}", label)
            for k, size in enumerate(self.output_grads)
        ]

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        """The recompute's input projections' moment, at its start (Note [DoRA's moments in
        the recompute])."""
        if self.ctx.training.activation_checkpointing == "none":
            return ()
        return [*self._gradients(), *self._made(self.start, "backward")]

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        """The recompute's other linears' moment, with what it holds at down's (Note [DoRA's
        moments in the recompute])."""
        if self.ctx.training.activation_checkpointing == "none":
            return ()
        gradients = [free(op, "backward") for op in self._gradients()]
        made = self._made(self.end, "backward")
        if not made or not self.recompute_down:
            return [*made, *gradients]
        label = "what the recompute holds at the down projection"
        held = [
            alloc(size, Cat.TEMPORARY, "backward", f"dora_re_held/{k}", "layers.{i}", label)
            for k, size in enumerate(self.recompute_down)
        ]
        down = self._made(self.down, "backward")
        rest = self._made(self.end, "backward") if self.end > self.down else ()
        return [*held, *down, *(free(op, "backward") for op in held), *gradients, *rest]
