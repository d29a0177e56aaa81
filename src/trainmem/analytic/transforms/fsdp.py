"""ZeRO-2/3 and FSDP1 / FSDP2 / HSDP sharding as a transform: the gathered parameters (the
current, the prefetched and the root module's), the gathered weights kept from forward to
backward, each layer's gradients before their reduce-scatter, FSDP1's ``no_sync``
accumulation and flat-parameter gradients. FSDP2's gradient release is :mod:`.fsdp2`, FSDP
under pipelining :mod:`.fsdp_pipeline`.

Note [FSDP gradient accumulation under no_sync]
    A framework that accumulates under FSDP1's ``no_sync()`` (``fsdp_no_sync_accumulation``:
    lit-gpt's ``fabric.no_backward_sync`` -> Lightning ``module.no_sync()``) with FULL_SHARD
    keeps each unit's gradient *unsharded* from the first micro-batch's backward to the last
    one's: torch distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` returns before the
    reduce-scatter while ``not state._sync_gradients`` (``flat_param.grad`` keeps the padded
    unsharded size, ``FlatParamHandle.prepare_gradient_for_backward``), and frees the gathered
    parameters all the same (``_should_free_in_backward``: FULL_SHARD reshards after forward).
    The last micro-batch runs with sync on: each unit's reduce-scatter leaves this rank's shard
    and frees the unsharded gradient, layer by layer in its backward. With flat-parameter
    gradients (:func:`~trainmem.analytic.tensor_states.flat_parameter_grads`) that unsharded
    gradient covers every weight of a LoRA layer, not only the adapters: about one unsharded
    copy of the layers per rank, alive from the first micro-batch's backward to the last one's.
    Run on the CPU under the fake process group in ``tests/analytic/test_fsdp_flat_parameter.py``.

Note [Flat-parameter gradients in backward]
    FSDP1 with ``use_orig_params=True`` runs a unit's forward on views of its unsharded flat
    parameter, made by one ``torch.split`` (torch distributed/fsdp/flat_param.py
    ``_get_unflat_views_aligned``); in backward autograd buffers the gradient of every view (the
    frozen base weights' too) until the split's backward concatenates them into the flat
    gradient (``split_with_sizes_backward``: ``at::cat``), so at the end of a layer's backward
    its per-parameter gradients and their concatenation are alive together (two unsharded
    copies of the layer in the gradient dtype). Under ``no_sync`` accumulation the micro-batches
    after the first add that concatenation into the kept gradient and free it (autograd
    ``AccumulateGrad``: ``variable_grad += new_grad``). Measured on the real FSDP1 on the CPU
    (torch.profiler allocation events, a 3-layer LoRA model, 2 fake ranks): per layer +1 unit
    of view gradients, +1 unit concatenated, the views freed; the accumulated unit kept in the
    first micro-batch, freed after the add in the later ones.

Source: torch/distributed/fsdp/_runtime_utils.py, flat_param.py (cited per rule above);
ZeRO-3 gathers (Rajbhandari et al. 2020 sec. 5.3) through :mod:`.sharding`.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    embedding_gradients,
    free,
    gradient_ops,
)
from trainmem.analytic.transforms.fsdp1_flat import (
    embedding_views,
    flat_gradient,
    fsdp1_flat_layer_grads,
    fsdp1_no_shard_flat,
    layer_views,
    root_gradient_views,
    root_views,
)
from trainmem.analytic.transforms.fsdp2 import post_backward_active
from trainmem.analytic.transforms.sharding import (
    gather_ops,
    group_states,
    kept_op,
    low_precision_shard_ops,
    no_shard_copies,
    offload_copy_ops,
    sharding,
    unsharded_gradient_ops,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase


def fsdp1_adapter_unit_prefetch(ctx: RankContext) -> bool:
    """Whether FSDP1's backward prefetch of the next layer starts in a layer's attention
    backward rather than at its pre-backward (each LoRA leaf a unit of its own under
    accelerate's FSDP, or fsdp_qlora without checkpointing or with its reentrant checkpointing
    inside the units; ZeRO-3 sharding; Note [FSDP1 backward prefetch under adapter units]).

    Note [FSDP1 backward prefetch under adapter units]
        With ``BACKWARD_PRE`` FSDP1 prefetches, in a unit's pre-backward hook, the unit whose
        post-forward came just before it in this iteration (torch distributed/fsdp/
        _exec_order_utils.py ``get_handle_to_backward_prefetch``, ``_backward_prefetch_limit``
        1; ``record_post_forward`` records the order every iteration). Under accelerate's FSDP
        with LoRA, peft's ``fsdp_auto_wrap_policy`` (trainer.py ``_fsdp_qlora_plugin_updates``)
        makes each adapter leaf a unit inside the layer's, so the post-forward order of layer
        i + 1 is its adapters (q's first) then the layer: the layer's pre-backward prefetches
        its own last adapter, each adapter the one before, and q's first adapter (in the
        attention's backward) prefetches layer i. So the layer's MLP backward, its peak, runs
        with one layer gathered; the next layer's gathers are allocated in its attention
        backward. Traced (torch's FSDP1 on fake tensors, trainmem.trace.fsdp): a 6-layer
        1024-wide Qwen2, LoRA on q / v, full checkpointing, 4 ranks, 4 x 1,024 tokens: one
        layer's 22,026,752 B gathered at the MLP backward peak, where the formulas held two.
        Answer.AI fsdp_qlora (train.py 50efa1e: each LoRA leaf and each decoder layer a unit,
        the constructor's ``BACKWARD_PRE``) wraps the same units, so without checkpointing
        its order is the same: traced, the 2-layer 2048-wide Llama of benchmarks/
        generic_options.py (nf4, LoRA 16, 4 ranks) holds one 22,560,768 B layer at the first
        layer's MLP backward (the formulas held two; 'fsdp-qlora 4' -7.9 -> -0.2 %). With its
        reentrant checkpointing inside the units (train.py ``apply_activation_checkpointing(
        ..., CheckpointImpl.REENTRANT)`` after wrapping) the order is the same: the post-forward
        order is recorded in the forward (torch 2.2.2 _exec_order_utils.py
        ``record_post_forward``; the recompute's adapter forwards append after it, leaving the
        indices ``get_handle_to_backward_prefetch`` reads unchanged), the layer's pre-backward
        prefetches its own last adapter, and the recompute registers each adapter unit's
        pre-backward hook again (``_register_pre_backward_hooks`` under ``enable_grad``), so q's
        first adapter prefetches layer i in the attention's backward. Checked on torch's FSDP1
        on the CPU (tests/analytic/test_fsdp_qlora_prefetch.py: the last layer alone gathered
        at its MLP backward, the layer below too once q's backward has run). No dev row moves
        (the unshard stream's pool keeps the block cached: reserved unchanged); GT117 / GT118's
        published peak allocated (benchmarks_03_2024.md, 8.28 / 9.16 GiB) is met within +1.0 /
        +0.3 % at the runs' versions (+1.8 / +2.8 % with two layers held).

        In the forward the adapter units also shorten the pool's pending block (Note [FSDP1
        unshard stream pool]): layer i's free, queued at its post-forward, is synchronised by
        the rate limiter (_limiter_utils.py, two in flight) at the second unshard after layer
        i + 1's, its first adapters' (q's ``lora_A``, ``lora_B``), before any of layer i + 1's
        tensors exist; so a layer's MLP runs with one layer gathered, the previous one pending
        only at its start. Traced: the same accelerate FSDP-QLoRA Llama holds one 22,552,576 B
        layer beside the root at layer 1's down projection.
    """
    t = ctx.training
    # fsdp_qlora wraps the same units; its reentrant checkpointing inside them keeps the order
    # (its non-reentrant checkpointing is not checked: left with the prefetched layer held)
    reentrant = t.activation_checkpointing == "full" and t.checkpoint_reentrant is not False
    qlora_units = t.framework == "fsdp-qlora" and (
        t.activation_checkpointing == "none" or reentrant
    )
    return (
        (t.conventions.fsdp1_checkpoint_outside_units or qlora_units)
        and t.lora_rank > 0
        and ctx.zero_stage == 3
        and t.data_parallel_size > 1
    )


class FullyShardedDataParallel(Transform):
    """ZeRO-2/3 / FSDP buffers of one rank (sizes: :func:`.sharding.sharding`, from the rank's
    model states).

    Inserts: ``micro_batch.begin`` the root's and the current layer's gathered parameters
    (until ``micro_batch.end``; FSDP2's post-backward reshards them itself);
    ``stack.pre_forward`` / ``stack.pre_backward`` the prefetched layer's (until the stack's
    end; under Note [FSDP1 backward prefetch under adapter units] from
    ``layer.attention.pre_backward`` to ``layer.post_backward`` instead, none in the stack's last
    layer run); ``layer.pre_forward`` the kept gathered weights (freed at ``layer.post_backward``);
    ``layer.mlp.post_backward`` the layer's reduce bucket (until
    ``layer.attention.post_backward``), flat-parameter gradients, ``no_sync``'s reduce;
    ``head.post_backward`` / ``root.post_backward`` ``no_sync``'s reduce of the head's and the
    embedding's gradients; under :func:`fsdp1_flat_layer_grads` the root unit's flat gradient
    at ``root.post_backward`` (Note [FSDP1 flat gradient of the root]). Makes the gradients
    unsharded under ``no_sync`` accumulation.
    """

    name = "fsdp"
    # Note [FSDP1 backward prefetch under adapter units]: the stack's last layer run prefetches
    # nothing
    # Note [FSDP1 unshard stream pool]: the first layer run starts the pending block
    layer_position = frozenset({"first", "last"})

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.sharding = s = sharding(ctx)
        self.post_backward = post_backward_active(ctx)
        self.reduces_last_micro_batch = s.no_sync
        # Note [FSDP1 NO_SHARD's 16-bit copy]: a unit's gradient is made at its post-backward
        # Note [FSDP1 NO_SHARD's 16-bit copy]: a full fine-tune's as flat gradients
        self.no_shard_flat = fsdp1_no_shard_flat(ctx)
        self.unit_grads = no_shard_copies(ctx.training) and not self.no_shard_flat
        self.adapter_unit_prefetch = fsdp1_adapter_unit_prefetch(ctx)
        self.flat_layer_grads = fsdp1_flat_layer_grads(ctx)
        self.emb = embedding_gradients(ctx)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        s = sharding(ctx)
        flat = fsdp1_no_shard_flat(ctx)  # Note [FSDP1 NO_SHARD's 16-bit copy]
        return s.stage >= 2 or s.reduce > 0 or s.flat_views > 0 or s.kept > 0 or flat

    def _grads(self, group: str, phase: Phase) -> list[Op]:
        """A group's gradients as this micro-batch makes them (unsharded while accumulating)."""
        states, key, module = group_states(self.ctx, group)
        if self.sharding.unsharded_grads:
            return unsharded_gradient_ops(self.ctx, states, phase, key, module)
        return gradient_ops(self.ctx, states, phase, key, module)

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        s = self.sharding
        if self.flat_layer_grads and group != "layer":  # Note [FSDP1 flat gradient of the root]
            return (
                embedding_views(self.ctx) if group == "embedding" else root_views(self.ctx, group)
            )
        if self.unit_grads and group in ("layer", "head"):  # made at the unit's post-backward
            return []
        if group == "layer" and (s.flat_views or self.flat_layer_grads):  # made by the hooks
            return []
        if group == "layer" and s.pp_fsdp:  # :mod:`.fsdp_pipeline`
            return None
        if not s.unsharded_grads:
            return None
        return self._grads(group, "backward") if where.new_grads else []

    def vocab_gradient_bytes(self, base: int) -> int:
        # Note [FSDP1 flat gradient of the root]: a tied lookup's gradient, summed out of place
        return base or (self.emb.tied_lookup if self.flat_layer_grads else 0)

    def _reduce_ops(self, group: str) -> list[Op]:
        """A unit's reduce-scatter after ``no_sync`` accumulation: this rank's gradient shard
        allocated, then the accumulated unsharded gradient freed (torch
        distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` -> ``_reduce_grad``)."""
        b: Phase = "backward"
        states, key, module = group_states(self.ctx, group)
        sharded = gradient_ops(self.ctx, states, b, key, module)
        unsharded = unsharded_gradient_ops(self.ctx, states, b, key, module)
        return [*sharded, *(free(op, b) for op in unsharded)]

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        ops = [op for op in gather_ops(self.sharding) if op.size_bytes]
        out: list[Emitted] = list(ops)
        # resharded by .fsdp2 (Note [FSDP2 post-backward]) or NO_SHARD's reshards (see below)
        if not self.post_backward and not self.no_shard_flat:
            out = [Lifetime(op, "micro_batch.end") for op in ops]
        if self.sharding.offload_copy:  # Note [FSDP1 offloaded shard copy]
            copy, done = offload_copy_ops(self.sharding, "forward")
            out = [copy, *out, done]
        # Note [FSDP1 16-bit shard on the pre-unshard stream]
        return [*low_precision_shard_ops(self.sharding), *out]

    def _prefetch(self, phase: Phase) -> Op:
        """The next layer's gathered parameters, prefetched while one runs, in the forward and
        in the backward through the layers; around the head and the loss only the current one
        is gathered (FSDP ``forward_prefetch`` / ``BACKWARD_PRE``; seen in the trace of
        FSDP2)."""
        s = self.sharding
        label = "gathered parameters of the prefetched layer"
        return alloc(s.gather_b, Cat.TEMPORARY, phase, "gather/b", "layers", label, s.ag_stream)

    def _no_shard_reshard(self, phase: Phase, *units: str) -> list[Op]:
        """Note [FSDP1 NO_SHARD's 16-bit copy]: ``units``' copies freed (root, a, b)."""
        root, layer = gather_ops(self.sharding)
        ops = {"root": root, "a": layer, "b": self._prefetch("backward")}
        return [free(ops[u], phase) for u in units if ops[u].size_bytes]

    def stack_post_forward(self, where: Where) -> Sequence[Emitted]:
        return self._no_shard_reshard("forward", "a") if self.no_shard_flat else ()

    def head_post_forward(self, where: Where) -> Sequence[Emitted]:
        return self._no_shard_reshard("forward", "root") if self.no_shard_flat else ()

    def backward_begin(self, where: Where) -> Sequence[Emitted]:
        # NO_SHARD: the root's pre-backward makes its copy again and prefetches the stack's first
        if not self.no_shard_flat:
            return ()
        b: Phase = "backward"
        return [alloc(op.size_bytes, op.category, b, op.key, op.module, op.label, op.stream)
                for op in gather_ops(self.sharding) if op.size_bytes]  # fmt: skip

    def _layer_reshard(self, where: Where) -> list[Op]:
        """The layer's reshard before its gradient's reduce (NO_SHARD's copy it ran on)."""
        if not self.no_shard_flat:
            return []
        return self._no_shard_reshard("backward", "a" if where.last_layer else "b")

    def _root_reshard(self) -> list[Op]:
        """The root's reshard before its gradient's reduce (NO_SHARD's)."""
        return self._no_shard_reshard("backward", "root") if self.no_shard_flat else []

    def stack_pre_forward(self, where: Where) -> Sequence[Emitted]:
        if not self.sharding.gather_b or self.no_shard_flat:  # NO_SHARD: no forward prefetch
            return ()
        if self.adapter_unit_prefetch:  # :meth:`layer_pre_forward`
            return ()
        return (Lifetime(self._prefetch("forward"), "stack.post_forward"),)

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        s = self.sharding
        # Note [FSDP2 post-backward]: the layer slot holds the next all-gather output
        if not s.gather_b or self.adapter_unit_prefetch or self.post_backward or self.no_shard_flat:
            return ()
        if s.gather_c:  # freed at the last layer's pre-backward (:meth:`layer_pre_backward`)
            out: list[Emitted] = [self._prefetch("backward")]
        else:
            out = [Lifetime(self._prefetch("backward"), "stack.post_backward")]
        return out

    def _pending(self) -> Op:
        """Note [FSDP1 unshard stream pool]: trainable units, the previous layer's block freed
        and not yet reusable, from the end of the first layer's post-backward (the backward's
        first free of a layer: the block it ran on, which adds to the pool only once the next
        layer's pre-backward gathers another) to the backward's end (:meth:`_held_to_the_end`)."""
        s = self.sharding
        label = "the previous layer's gathered parameters, freed, not yet reusable"
        bp: Phase = "backward"
        return alloc(s.gather_c, Cat.TEMPORARY, bp, "gather/c", "layers", label, s.ag_stream)

    def _pends(self) -> bool:
        """The pending block exists: trainable units over more than one layer."""
        return bool(self.sharding.gather_c) and self.ctx.num_layers > 1

    def _held_to_the_end(self) -> list[Op]:
        """Note [FSDP1 unshard stream pool]: the layers' blocks still pending at the backward's
        end (the last two layers', from 3 layers the third one's), freed after the root's."""
        if not self._pends():
            return []
        out = [free(self._pending(), "backward")]
        if self.ctx.num_layers >= 3:
            out.append(free(self._prefetch("backward"), "backward"))
        return out

    def layer_attention_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if self.flat_layer_grads:  # the rest of the MLP's, after its transients, and o's
            return layer_views(self.ctx, 1, 2)
        # Note [FSDP1 backward prefetch under adapter units]: the next layer's gathers begin in
        # this layer's attention backward (none after the stack's last layer)
        if not self.adapter_unit_prefetch or where.last_layer:
            return ()
        return (Lifetime(self._prefetch("backward"), "layer.post_backward"),)

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        # Note [FSDP1 unshard stream pool]: the stack's last layer in the backward (layer 0)
        # prefetches no unit (none ran its post-forward before it): over 2 layers its own block
        # and layer 1's pending one remain; from 3 layers layer 2's stays pending too
        if self.sharding.gather_c and where.last_layer and self.ctx.num_layers < 3:
            return (free(self._prefetch("backward"), "backward"),)
        # Note [FSDP1 NO_SHARD's 16-bit copy]: the next layer's prefetched, none after layer 0
        # (without a mixed-precision policy NO_SHARD makes no copy: nothing is prefetched)
        if self.no_shard_flat and not where.last_layer and self.sharding.gather_b:
            return (self._prefetch("backward"),)
        return ()

    def layer_pre_forward(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = [kept_op(self.sharding, "forward")] if self.sharding.kept else []
        # Note [FSDP1 backward prefetch under adapter units]: in the forward the previous
        # layer's freed block is pending only until the layer's second adapter unit gathers
        if self.adapter_unit_prefetch and self.sharding.gather_b and not where.first_layer:
            s = self.sharding
            label = "the previous layer's gathered parameters, freed, not yet reusable"
            f: Phase = "forward"
            pending = alloc(s.gather_b, Cat.TEMPORARY, f, "gather/b", "layers", label, s.ag_stream)
            out.append(Lifetime(pending, "layer.forward"))
        return out

    def layer_attention_post_backward(self, where: Where) -> Sequence[Emitted]:
        return layer_views(self.ctx, 3) if self.flat_layer_grads else ()

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.flat_layer_grads:
            views = [*layer_views(self.ctx, 0), *layer_views(self.ctx, 1, 2)]
            views += layer_views(self.ctx, 3)
            out += flat_gradient(self.ctx, where, "layer", views, self._layer_reshard(where))
        if self.unit_grads and where.new_grads:  # the unit's flat gradient, cast to fp32
            out += self._grads("layer", "backward")
        if self.sharding.kept:
            out.append(free(kept_op(self.sharding, "forward"), "backward"))
        # Note [FSDP1 unshard stream pool]: the stack's first layer's block, freed by its
        # post-backward reshard, is the pending one once the next layer's pre-backward gathers
        if self._pends() and where.first_layer:
            out.append(self._pending())
        return out

    def head_post_backward(self, where: Where) -> Sequence[Emitted]:
        return self._reduce_ops("head") if where.reduce else ()

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.flat_layer_grads:  # Note [FSDP1 flat gradient of the root]
            views = root_gradient_views(self.ctx)
            out += flat_gradient(self.ctx, where, "root", views, self._root_reshard())
        if self.unit_grads and where.new_grads:  # the root unit's: the head's with it
            out += self._grads("head", "backward")
        if where.reduce:
            out += self._reduce_ops("embedding")
        return out + self._held_to_the_end()

    def _reduce_bucket(self) -> Lifetime:
        """The layer's unsharded gradients before their reduce-scatter (ZeRO-2/3, gradient
        offload), until the attention's backward is done."""
        reduce = alloc(
            self.sharding.reduce,
            Cat.TEMPORARY,
            "backward",
            "reduce",
            "layers.{i}",
            "the layer's unsharded gradients before their reduce-scatter",
        )
        return Lifetime(reduce, "layer.attention.post_backward")

    def layer_mlp_post_backward(self, where: Where) -> Sequence[Emitted]:
        s = self.sharding
        if s.flat_views:
            return self._flat_views(where)
        if self.flat_layer_grads:
            return layer_views(self.ctx, 0)
        out: list[Emitted] = []
        if where.reduce:
            out += self._reduce_ops("layer")
        if not self.post_backward and s.reduce:
            out.append(self._reduce_bucket())
        return out

    def _flat_views(self, where: Where) -> list[Emitted]:
        """Note [Flat-parameter gradients in backward]: the per-parameter gradients and their
        concatenation, which becomes the accumulated gradient (first micro-batch) or is added
        into it."""
        s = self.sharding
        bp: Phase = "backward"
        views = alloc(
            s.flat_views,
            Cat.TEMPORARY,
            bp,
            "flat_views",
            "layers.{i}",
            "the layer's per-parameter gradients before autograd concatenates them",
        )
        fresh = alloc(
            0 if where.new_grads or not s.unsharded_grads else s.flat_views,
            Cat.TEMPORARY,
            bp,
            "flat_fresh",
            "layers.{i}",
            "the layer's new flat gradient before it is added to the accumulated one",
        )
        grads = self._grads("layer", bp) if where.new_grads else []
        out: list[Emitted] = [views]
        if s.unsharded_grads:
            out += grads  # the concatenated gradient becomes the accumulated one
        out.append(fresh)
        if s.reduce:
            out.append(self._reduce_bucket())
        out.append(free(views, bp))
        if not s.unsharded_grads:
            out += grads
        if where.reduce:
            out += self._reduce_ops("layer")
        out.append(free(fresh, bp))
        return out
