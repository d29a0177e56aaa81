"""FSDP2 under pipeline parallelism as a transform: the stage's parameters gathered for the
whole step, the gradients accumulated unsharded, each micro-batch's new gradients, and the
reduce-scatter after the last micro-batch.

Note [FSDP under pipeline parallelism]
    With pipeline parallelism, ``torch.distributed.pipelining`` runs every micro-batch's
    backward of an FSDP2 stage with ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)`` (torch/distributed/pipelining/stage.py
    ``backward_maybe_with_nosync``), and reduces only after the last micro-batch
    (``perform_reduce_grad``); torchtitan also sets ``reshard_after_forward=False`` under PP
    (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``). So the stage's parameters stay
    gathered for the whole step, and its gradients accumulate unsharded, upcast to the reduce
    dtype (FSDP2 ``FSDPParam.to_accumulated_grad_if_needed``: fp32 under torchtitan's
    ``MixedPrecisionPolicy(reduce_dtype=float32)``), until the reduce-scatter leaves the shards.

Note [New gradients under pipeline parallelism]
    Under pipeline parallelism FSDP2 skips the reduce-scatter and accumulates (Note [FSDP under
    pipeline parallelism]); each micro-batch's backward still gives every unsharded parameter a
    new gradient in the parameter's dtype (the compute dtype under ``MixedPrecisionPolicy(
    param_dtype=bf16)``), which lives until the layer's post-backward adds it into the fp32
    accumulated gradient (``FSDPParam.accumulate_unsharded_grad_if_needed``) or, on the first
    micro-batch, becomes it (``to_accumulated_grad_if_needed``: ``grad.to(reduce_dtype)``,
    then the 16-bit gradient dropped), parameter by parameter
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``post_backward``). The MLP's
    weight gradients are made in the MLP's backward, so its three [i / t, h] gradients are alive
    at the MLP's backward transients; the attention's come after. Seen in the trace of
    llama-3.1-405b shapes (4 layers, FSDP 8 x TP 8 + SP x PP 2): three bf16 [i / 8, h]
    gradients alive at gate_proj's input-gradient allocation.

Source: torch/distributed/pipelining/stage.py, torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py, _fsdp_collectives.py (cited per rule above).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from trainmem.analytic.params import MLP_LINEARS
from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    gradient_ops,
    keeps_gradients,
)
from trainmem.analytic.transforms.points import Point
from trainmem.analytic.transforms.sharding import partial_factor, sharding, unsharded_gradient_ops
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def _is_mlp(state: TensorState) -> bool:
    """A parameter of the layer's MLP (its LoRA adapters and fused experts included)."""
    name = state.name.split(".")[-1]
    return name in MLP_LINEARS or name.startswith("experts_")


class FsdpUnderPipeline(Transform):
    """FSDP2 on a pipeline stage (Note [FSDP under pipeline parallelism], Note [New gradients
    under pipeline parallelism]).

    Inserts: ``micro_batches.begin`` the stage's gathered parameters (and two flat all-gather
    outputs); ``layer.mlp.pre_backward`` / ``layer.attention.pre_backward`` the MLP's / the
    rest's new gradients; ``layer.post_backward`` each added into the accumulated one;
    ``micro_batches.end`` the reduce-scatter after the last micro-batch; with gradients that
    are kept, the gathered parameters freed at ``step.post_backward`` (after the pipeline's
    merged output). Makes the layer's gradients in ``layer.post_backward``.
    """

    name = "fsdp_pipeline"
    late: ClassVar[frozenset[Point]] = frozenset({"step.post_backward"})

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.sharding = sharding(ctx)
        self.keep = keeps_gradients(ctx.training)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return sharding(ctx).pp_fsdp

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        return [] if group == "layer" and not self.sharding.flat_views else None

    def _gathered(self) -> tuple[Op, Op]:
        """The stage's gathered root (embedding, head) and layers, kept across micro-batches."""
        s = self.sharding
        fp: Phase = "forward"
        root = alloc(
            s.stage_gather_root,
            Cat.TEMPORARY,
            fp,
            "gather/stage/root",
            "(stage)",
            "the stage's gathered embedding / head, kept across micro-batches",
        )
        layers = alloc(
            s.stage_gather,
            Cat.TEMPORARY,
            fp,
            "gather/stage",
            "(stage)",
            "the stage's gathered parameters, kept across micro-batches",
        )
        return root, layers

    def micro_batches_begin(self, where: Where) -> Sequence[Emitted]:
        s = self.sharding
        root, layers = self._gathered()
        items: list[Emitted] = [root]
        if s.flat_gather:  # each layer's flat all-gather output, two in flight
            flats = [
                alloc(
                    s.flat_gather,
                    Cat.TEMPORARY,
                    "forward",
                    f"gather/flat/{k}",
                    "(stage)",
                    "a layer's flat all-gather output",
                    s.ag_stream,
                )
                for k in range(2)
            ]
            items += [*flats, *(free(op, "forward") for op in flats)]
        items.append(layers)
        return items

    def step_post_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.keep:
            return ()
        return [free(op, "backward") for op in self._gathered()]

    def _new_grads(self) -> list[Op]:
        """The layer's new unsharded gradients of one micro-batch, one per parameter in the
        compute dtype (Note [New gradients under pipeline parallelism])."""
        if self.sharding.flat_views:
            return []
        t = self.ctx.training
        c, tp = dtype_bytes(t.compute_dtype), t.tensor_parallel_size
        return [
            alloc(
                c * s.numel // tp if s.trainable else 0,
                Cat.TEMPORARY,
                "backward",
                f"pp_new_grad/{n}",
                "layers.{i}",
                "the layer's new unsharded gradients, until FSDP2's post-backward",
            )
            for n, s in enumerate(self.ctx.layer_states)
        ]

    def layer_mlp_pre_backward(self, where: Where) -> Sequence[Emitted]:
        new = self._new_grads()
        return [op for op, st in zip(new, self.ctx.layer_states, strict=False) if _is_mlp(st)]

    def layer_attention_pre_backward(self, where: Where) -> Sequence[Emitted]:
        new = self._new_grads()
        return [op for op, st in zip(new, self.ctx.layer_states, strict=False) if not _is_mlp(st)]

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        # FSDP2's post-backward, per parameter
        b: Phase = "backward"
        ctx = self.ctx
        grads = unsharded_gradient_ops(ctx, ctx.layer_states, b, "{i}", "layers.{i}")
        out: list[Emitted] = []
        for new_op, acc in zip(self._new_grads(), grads, strict=False):
            out += [acc, free(new_op, b)] if where.new_grads else [free(new_op, b)]
        return out

    def micro_batches_end(self, where: Where) -> Sequence[Emitted]:
        """Pipelining's ``perform_reduce_grad`` after the last micro-batch: FSDP2's
        post-backward of each parameter group in turn, the root's (embedding, head) first,
        then the layers', each resharding its parameters (``FSDPParamGroup.post_backward``:
        ``reshard`` before ``foreach_reduce``), then leaving its gradient shard and freeing the
        unsharded gradient accumulated over the micro-batches (torch/distributed/pipelining/
        stage.py ``perform_reduce_grad``)."""
        if self.keep:
            return ()
        ctx = self.ctx
        bp: Phase = "backward"
        root, layers = self._gathered()
        layer = self._reduce_group(ctx.layer_states, "{i}", "layers.{i}")
        return [
            free(root, bp),
            *self._reduce_group(ctx.head_grad_states, "head", "head"),
            *self._reduce_group(ctx.emb_grad_states, "embedding", "embedding"),
            free(layers, bp),
            Repeat(tuple(layer), ctx.num_layers),
        ]

    def _reduce_group(self, states: list[TensorState], key: str, module: str) -> list[Item]:
        """One FSDP2 group's post-backward after pipelining's micro-batches: a partial
        (whole-vocabulary) embedding gradient is first redistributed to its tensor-parallel
        shard, which frees the accumulated one (DTensor ``redistribute``); ``foreach_reduce``
        copies the unsharded gradients into one reduce-scatter input, allocates the output (the
        shard), and frees its input (torch/distributed/fsdp/_fully_shard/
        _fsdp_collectives.py ``foreach_reduce``). Order as traced on llama-3.2-1b."""
        b: Phase = "backward"
        ctx = self.ctx
        unsharded = unsharded_gradient_ops(ctx, states, b, key, module)
        items: list[Item] = []
        partial = [
            (op, s) for op, s in zip(unsharded, states, strict=True) if partial_factor(ctx, s) > 1
        ]
        for op, s in partial:
            local = alloc(
                s.full_grad_bytes,
                Cat.TEMPORARY,
                b,
                f"redistributed/{key}",
                module,
                "the partial gradient reduce-scattered to this rank's vocabulary shard",
            )
            items += [local, free(op, b)]
        rs_input = alloc(
            sum(s.full_grad_bytes for s in states),
            Cat.TEMPORARY,
            b,
            f"rs_input/{key}",
            module,
            "FSDP2's reduce-scatter input (a copy of the unsharded gradients)",
            self.sharding.rs_stream,
        )
        items.append(rs_input)
        items += gradient_ops(ctx, states, b, key, module)
        items += [free(op, b) for op in unsharded if all(op is not p for p, _ in partial)]
        items += [free(op, b) for op in items[: 2 * len(partial) : 2] if isinstance(op, Op)]
        items.append(free(rs_input, b))
        return items
