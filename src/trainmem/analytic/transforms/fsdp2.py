"""FSDP2's gradient release as a transform: each layer's reduce-scatter input kept until the
next group's post-backward, and the root group reduced in the root's final callback.

Note [FSDP2 post-backward]
    FSDP2 (``FrameworkConventions.fsdp2_post_backward``) reduces a layer's gradients in its
    post-backward, after the whole layer's backward: it reshards the layer's parameters, releases
    the previous group's reduce-scatter input, then ``foreach_reduce`` allocates this layer's
    (the unsharded gradients copied in the reduce dtype) on the default stream and keeps it
    until the next group's post-backward (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py ``post_backward``: ``reduce_scatter_max_input_buffers`` = 1;
    _fsdp_collectives.py ``foreach_reduce``). So layer ``i + 1``'s input lives through layer
    ``i``'s whole backward, the recomputation of a checkpointed layer included, and the first
    layer's lives through the token embedding's backward until the root's final callback
    (_fsdp_state.py ``_root_post_backward_final_callback``), while that layer's gathered
    parameters are already resharded. Seen in the trace of llama-3.2-1b FSDP 2 x TP 2 + SP.

    Until then the layer's gradients are the unsharded parameters' ``.grad``: each weight's,
    in the unsharded parameters' dtype (bf16 under torchtitan's policy, fp32 under autocast),
    made where its linear's backward runs (Note [Gradients where their linear's backward
    runs]), none sharded yet. ``post_backward`` takes them off the parameters, reshards the
    layer (frees its unsharded parameters), releases the previous reduce-scatter input, and
    ``foreach_reduce`` copies them into the new one, drops them, and leaves the reduce-scatter's
    output as the sharded gradients (views of one block; on a later micro-batch added into the
    kept ones and freed: ``sharded_param.grad._local_tensor += new_sharded_grad``). In backward
    a layer's pre-backward copies its unsharded parameters out of its all-gather output and
    frees that output at once (``wait_for_unshard``: ``foreach_all_gather_copy_out``, the output
    kept only in forward, ``all_gather_state``), then prefetches the next layer's all-gather:
    two layer copies through a layer's backward, but one through layer 0's, the last (it
    prefetches nothing). The formulas made each weight's gradient sharded (fp32, a quarter of
    the layer at 4 ranks) during the layer's backward and kept two layer copies through layer
    0's: on the agreement model (benchmarks/generic_options.py: a 2-layer 2048-wide Llama,
    2 x 256 tokens, FSDP2 over 4 ranks) 871,880,704 B against the trace's 841,472,544 B
    (-3.5 %), now 841,472,000 B, both peaking at layer 0's copy-out.

Note [FSDP2 root group]
    Under FSDP2's post-backward order the root group (token embedding, final norm, LM head:
    torchtitan's root ``fully_shard(model)``, the trace's root module) is reduced only in the
    root's final callback, after the whole backward. Until then its gradients are the unsharded
    parameters' ``.grad``: this rank's tensor-parallel slice in the unsharded parameters'
    dtype, bf16 under torchtitan's policy, fp32 under autocast (the head's
    [V / t, h] from the head's backward on; the embedding's from its backward, the whole-
    vocabulary DTensor gradient redistributed to the weight's vocabulary shard and that freed).
    The final callback then reshards the root, releases the first layer's reduce-scatter input,
    copies the unsharded gradients into one reduce-scatter input in the reduce dtype, frees
    them and leaves the shards (torch/distributed/fsdp/_fully_shard/_fsdp_state.py
    ``_root_post_backward_final_callback`` -> ``FSDPParamGroup.post_backward`` ->
    _fsdp_collectives.py ``foreach_reduce``). A tied lookup's gradient without DTensor is added
    in place into the head's under autocast (a plain tensor holding its last reference:
    torch/csrc/autograd/input_buffer.cpp ``accumulate``), so only while the add runs does it
    exist; without autocast, out of place (below). Seen in the
    trace of llama-3.1-70b FSDP 8 x TP 4 + SP x CP 2, full AC, whose peak is the embedding's
    backward (-2.3% before the rule: the head's sharded fp32 gradient stood for its 4x larger
    unsharded bf16 one). Without autocast's cast between the tied weight and the head's
    matmul (FSDP2's bf16 unsharded parameters, bf16-true) the head's weight gradient reaches
    the weight's input buffer as a view (``mm_mat2_backward`` computes it transposed for the
    transposed weight, and the ``t()`` view keeps its base: storage use count 2), which
    ``can_accumulate_inplace`` refuses, so the lookup's is added out of place: the sum is a
    third vocabulary-sized block beside the two until they are freed (torch/csrc/autograd/
    input_buffer.cpp; on the CPU without a dispatch mode the gradient reaching the leaf is a
    view with a base). Under autocast the fp32 cast's gradient is a fresh tensor, added in
    place. Seen in the trace of a tied 2-layer 2048-wide Llama (vocabulary 32768) and of
    llama-3.2-1b under ``--framework fsdp2``: +7.1 / +8.1 % over the formulas before.

Source: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, _fsdp_collectives.py,
_fsdp_state.py (cited per rule above).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.buffers import reduce_scatter_layer_bytes
from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    RankContext,
    Transform,
    Where,
    alloc,
    embedding_gradients,
    free,
    gradient_ops,
    tied_sum_op,
)
from trainmem.analytic.transforms.sharding import gather_ops, sharding
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def post_backward_active(ctx: RankContext) -> bool:
    """FSDP2's post-backward order applies (``FrameworkConventions.fsdp2_post_backward``
    under FULL_SHARD; the loop split by activation offloading keeps the old order)."""
    s, t = sharding(ctx), ctx.training
    return (
        t.conventions.fsdp2_post_backward
        and s.stage == 3
        and not s.pp_fsdp
        and not s.flat_views
        and not s.no_sync
        and not (t.activation_offloading and ctx.num_layers >= 2)
        and not t.optimizer_in_backward
    )


class Fsdp2PostBackward(Transform):
    """FSDP2's gradient release (Note [FSDP2 post-backward], Note [FSDP2 root group]).

    Inserts: ``layer.pre_backward`` the layer's copy-out, its all-gather output freed and the
    next layer's made (not after the stack's last layer run); ``layer.post_backward`` the
    layer resharded, the previous layer's reduce-scatter input freed, this layer's made, its
    unsharded gradients freed and its sharded ones made (or added into the kept ones);
    ``embedding.backward`` the tied head gradient replaced by the sum, the embedding's
    unsharded gradients; ``root.post_backward`` the root group's post-backward. Makes the
    layer's gradients unsharded (one per tensor, where its linear's backward runs), the
    head's as the root group's unsharded ones and the embedding's in its own
    ``embedding.backward``.
    """

    name = "fsdp2"
    keeps_root_gradients = True
    layer_position = frozenset({"first", "last"})
    places_layer_gradients = True

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.sharding = sharding(ctx)
        self.emb = embedding_gradients(ctx)
        # Note [FSDP2 root group]: a tied weight's head gradient is a view without autocast's
        # cast between, so the lookup's is added out of place
        viewed = self.emb.tied_lookup if not ctx.training.uses_autocast else 0
        self.tied_sum = self.emb.tied_sum or viewed

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return post_backward_active(ctx)

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        if group == "head":
            return self._root_unsharded_grads("head", self.ctx.head_grad_states)
        if group == "embedding":
            return []
        return self._layer_unsharded_grads()

    def vocab_gradient_bytes(self, base: int) -> int:
        # a tied lookup's gradient, added into the head's
        return base or self.emb.tied_lookup

    def tied_sum_bytes(self, base: int) -> int:
        return self.tied_sum

    def _unsharded_bytes(self, state: TensorState) -> int:
        """A parameter's unsharded gradient: this rank's tensor-parallel slice in the unsharded
        parameter's dtype."""
        g = dtype_bytes(self.ctx.training.grad_dtype)
        w = dtype_bytes(self.ctx.training.gathered_weight_dtype)  # the unsharded parameters'
        return w * (state.full_grad_bytes // g)

    def _root_unsharded_grads(self, key: str, states: list[TensorState]) -> list[Op]:
        """The root group's unsharded gradients (this rank's tensor-parallel slice in the
        unsharded parameters' dtype), kept until the root's post-backward."""
        return [
            alloc(
                self._unsharded_bytes(s),
                Cat.TEMPORARY,
                "backward",
                f"root_grad/{key}/{n}",
                key,
                "the root group's unsharded gradients, kept until its post-backward (FSDP2)",
            )
            for n, s in enumerate(states)
        ]

    def _layer_unsharded_grads(self) -> list[Op]:
        """A layer's unsharded gradients, one per tensor, each made where its linear's
        backward runs and kept until the layer's post-backward (Note [FSDP2 post-backward])."""
        return [
            alloc(
                self._unsharded_bytes(s),
                Cat.TEMPORARY,
                "backward",
                f"layer_grad/{n}",
                "layers.{i}",
                "a weight's unsharded gradient, kept until its layer's post-backward (FSDP2)",
            )
            for n, s in enumerate(self.ctx.layer_states)
        ]

    def _reduce_scatter_input(self, index: str) -> Op:
        """Layer ``index``'s reduce-scatter input, allocated on the default stream before
        ``foreach_reduce`` enters the reduce-scatter stream
        (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``)."""
        return alloc(
            self.sharding.reduce,
            Cat.TEMPORARY,
            "backward",
            f"reduce/{index}",
            f"layers.{index}",
            "the layer's reduce-scatter input, kept until the next group's post-backward",
        )

    def _unsharded_params(self) -> Op:
        """The layer's unsharded parameters, copied out of its all-gather output (the layer
        slot of :func:`~trainmem.analytic.transforms.sharding.gather_ops`) on the default
        stream (_fsdp_param_group.py ``wait_for_unshard``: ``foreach_all_gather_copy_out``)."""
        return alloc(
            self.sharding.gather_a,
            Cat.TEMPORARY,
            "backward",
            "gather/unsharded",
            "layers.{i}",
            "the layer's unsharded parameters, copied out of its all-gather output",
        )

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        # the copy-out, the all-gather output freed, the next layer's all-gather (none after
        # the stack's last layer run)
        _, output = gather_ops(self.sharding)
        if not output.size_bytes:
            return ()
        bp: Phase = "backward"
        out: list[Emitted] = [self._unsharded_params(), free(output, bp)]
        if not where.last_layer:
            label = "the next layer's all-gather output (prefetched)"
            out.append(output._replace(phase=bp, label=label))
        return out

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        # resharded; the previous layer's reduce-scatter input goes, this layer's is made from
        # its unsharded gradients, which go; the reduce-scatter's output is the sharded
        # gradient (a later micro-batch's is added into it and freed)
        bp: Phase = "backward"
        out: list[Emitted] = []
        if self.sharding.gather_a:
            out.append(free(self._unsharded_params(), bp))
        if not where.first_layer:
            out.append(free(self._reduce_scatter_input("{i_next}"), bp))
        out.append(self._reduce_scatter_input("{i}"))
        out += [free(op, bp) for op in self._layer_unsharded_grads()]
        sharded = gradient_ops(self.ctx, self.ctx.layer_states, bp, "{i}", "layers.{i}")
        if where.new_grads:
            return [*out, *sharded]
        added = alloc(
            sum(op.size_bytes for op in sharded),
            Cat.TEMPORARY,
            bp,
            "rs_output",
            "layers.{i}",
            "the reduce-scatter's output, added into the kept sharded gradients",
            self.ctx.grad_stream,
        )
        return [*out, added, free(added, bp)]

    def embedding_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if self.ctx.num_layers:  # the last layer's all-gather output went at its copy-out
            return ()
        _, layer = gather_ops(self.sharding)
        return (free(layer, "backward"),) if layer.size_bytes else ()

    def _tied_head_grads(self) -> list[Op]:
        """The head's unsharded gradients of a tied, vocabulary-parallel weight, replaced by
        the sum (Note [Tied embedding gradient under DTensor])."""
        ctx = self.ctx
        root = self._root_unsharded_grads("head", ctx.head_grad_states)
        return [
            op
            for op, st in zip(root, ctx.head_grad_states, strict=True)
            if self.tied_sum and st.name == "embedding/tokens"
        ]

    def embedding_backward(self, where: Where) -> Sequence[Emitted]:
        # the sum replaces the head's gradient
        tied = [free(op, "backward") for op in self._tied_head_grads()]
        return [*tied, *self._root_unsharded_grads("embedding", self.ctx.emb_grad_states)]

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        """The root group's post-backward in the final callback: reshard, release the first
        layer's reduce-scatter input, copy the unsharded gradients into the group's
        reduce-scatter input and free them, leave the shards."""
        ctx = self.ctx
        bp: Phase = "backward"
        root_gather, _ = gather_ops(self.sharding)
        tied = self._tied_head_grads()
        unsharded = [
            op for op in self._root_unsharded_grads("head", ctx.head_grad_states) if op not in tied
        ]
        if self.tied_sum:
            unsharded.append(tied_sum_op(self.tied_sum))
        unsharded += self._root_unsharded_grads("embedding", ctx.emb_grad_states)
        states = ctx.head_grad_states + ctx.emb_grad_states
        rs_input = alloc(
            reduce_scatter_layer_bytes(states, ctx.training),
            Cat.TEMPORARY,
            bp,
            "rs_input/root",
            "(model)",
            "FSDP2's reduce-scatter input of the root group (embedding, final norm, head)",
        )
        items: list[Emitted] = [free(root_gather, bp)] if root_gather.size_bytes else []
        if ctx.num_layers:
            items.append(free(self._reduce_scatter_input("0"), bp))
        items += [rs_input, *(free(op, bp) for op in unsharded)]
        if where.new_grads:
            items += gradient_ops(ctx, ctx.head_grad_states, bp, "head", "head")
            items += gradient_ops(ctx, ctx.emb_grad_states, bp, "embedding", "embedding")
        items.append(free(rs_input, bp))
        return items
