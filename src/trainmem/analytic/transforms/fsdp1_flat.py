"""FSDP1's flat gradients with ``use_orig_params=False``: each weight of a trainable unit is a
view of the unit's unsharded flat parameter, so autograd makes each view's gradient where its
op's backward runs and concatenates them at the unit's end, which the post-backward hook then
reduces (layer units: Note [FSDP1 flat gradient of a layer unit]; the root unit: Note [FSDP1
flat gradient of the root]; without sharding: Note [FSDP1 NO_SHARD's 16-bit copy] in
:mod:`.sharding`). The ops here are placed by :class:`~.fsdp.FullyShardedDataParallel`.

Source: torch 2.13 distributed/fsdp/_flat_param.py, _runtime_utils.py (cited per rule).
"""

from __future__ import annotations

from trainmem.analytic.buffers import reduce_scatter_layer_bytes
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    RankContext,
    Where,
    alloc,
    embedding_gradients,
    free,
    gradient_ops,
    gradient_places,
)
from trainmem.analytic.transforms.sharding import group_states, no_shard_copies, sharding
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.ranks import fsdp1_no_shard
from trainmem.timeline import Phase


def fsdp1_flat_layer_grads(ctx: RankContext) -> bool:
    """Whether a trainable layer unit's gradient is FSDP1's flat-parameter gradient, made at the
    layer's end (Note [FSDP1 flat gradient of a layer unit]): FSDP1 with
    ``use_orig_params=False`` (accelerate's FSDP, fsdp_qlora, torchtune before 0.3: the
    frameworks of :func:`~trainmem.analytic.transforms.sharding.fsdp1_unshard_pool_units`)
    sharding a full fine-tune's layers (ZeRO-2/3 over more than one rank), reduced every
    micro-batch (no ``no_sync``, no pipelining), or not sharding them under a mixed-precision
    policy (:func:`fsdp1_no_shard_flat`).

    Note [FSDP1 flat gradient of a layer unit]
        With ``use_orig_params=False`` a unit's module parameters are views of its unsharded
        flat parameter, made by one ``split`` and a ``view`` each (torch 2.13 distributed/fsdp/
        _flat_param.py ``_get_unflat_views_unaligned``, ``_use_unsharded_views``), so autograd
        makes each weight's gradient where its op's backward runs (the MLP's in the MLP's
        backward, the attention's and the norms' after it), unsharded in the unsharded
        parameter's dtype, and buffers them until the split's backward concatenates them into
        the flat gradient (``split_with_sizes_backward``: ``at::cat``), at the layer's end:
        then the views' gradients and their concatenation are alive together and the views'
        are freed. The flat parameter's ``AccumulateGrad`` post-hook (_runtime_utils.py
        ``_post_backward_hook``) then reduce-scatters it under the post-backward stream: this
        rank's shard in the reduce dtype (``_get_reduce_scatter_tensors``: ``torch.empty_like
        (chunks[0])``), cast to the parameter's dtype if it differs
        (``_cast_grad_to_param_dtype``), kept as ``_saved_grad_shard`` (added into it on a
        later micro-batch, ``_accumulate_sharded_grad``), and the unsharded gradient freed
        (``flat_param.grad = None``). So no sharded gradient and no whole-layer unsharded
        gradient exist during the layer's MLP backward, only the MLP weights' own. Seen in
        torch's FSDP1 traced on fake tensors (trainmem/trace/fsdp.py): a 2-layer 256-wide
        Qwen2 full fine-tune, 4 ranks, full checkpointing: at the peak (the first layer's MLP
        backward) the down projection's 360,448 B gradient, where the formulas held the
        layer's 1,476,608 B and its 369,152 B shard.
    """
    t = ctx.training
    s = sharding(ctx)
    fsdp1 = t.framework in ("fsdp-qlora", "accelerate-fsdp") or (
        t.framework == "torchtune" and t.torchtune_release < (0, 3, 0)
    )
    return fsdp1_no_shard_flat(ctx) or (
        fsdp1
        and not t.is_lora
        and s.stage >= 2
        and t.sharding_degree > 1
        and not s.pp_fsdp
        and not s.no_sync
        and not s.flat_views
        and not s.kept
    )


def fsdp1_no_shard_flat(ctx: RankContext) -> bool:
    """Whether the units' flat gradients are FSDP1 ``NO_SHARD``'s in a full fine-tune: each
    unit's flat gradient concatenated at its end and all-reduced in place; under a
    mixed-precision policy (:func:`~trainmem.analytic.transforms.sharding.no_shard_copies`)
    16-bit and cast to the fp32 parameter's dtype, without one it is the kept gradient itself
    (Note [FSDP1 NO_SHARD's 16-bit copy])."""
    return fsdp1_no_shard(ctx.training) and not ctx.training.is_lora


def layer_views(ctx: RankContext, *places: int) -> list[Op]:
    """Note [FSDP1 flat gradient of a layer unit]: the gradients of the layer's views made at
    ``places`` (:func:`~trainmem.analytic.transforms.base.gradient_places`), unsharded in the
    reduce dtype."""
    at = gradient_places(tuple(s.name for s in ctx.layer_states))
    states = [s for s, p in zip(ctx.layer_states, at, strict=True) if p in places]
    key = "".join(str(p) for p in places)
    return [
        alloc(
            reduce_scatter_layer_bytes([s], ctx.training),
            Cat.TEMPORARY,
            "backward",
            f"view_grad/{key}/{n}",
            "layers.{i}",
            "a weight's unsharded gradient before autograd concatenates the layer's",
        )
        for n, s in enumerate(states)
    ]


def root_views(ctx: RankContext, group: Group) -> list[Op]:
    """The gradients of the root unit's views in ``group`` (``"head"``: the output head
    and the final norm; ``"embedding"``), unsharded in the reduce dtype, made where their
    backward runs (Note [FSDP1 flat gradient of the root]).

    Note [FSDP1 flat gradient of the root]
        Under :func:`fsdp1_flat_layer_grads` the root unit (the embeddings, the final norm
        and the head: the modules no layer unit wraps) is one ``FlatParameter`` too, and its
        weights are views of its unsharded flat parameter like a layer's (Note [FSDP1 flat
        gradient of a layer unit]). So the head's and the final norm's weight gradients,
        made in the head's backward, are unsharded in the unsharded parameter's dtype and
        wait in the ``split``'s backward input buffer, with the embedding's (made in its
        backward, the step's last), until the split's backward concatenates them
        (``split_with_sizes_backward``: ``at::cat``); the root's ``_post_backward_hook``
        then reduce-scatters that flat gradient as a layer's (torch 2.13 distributed/fsdp/
        _runtime_utils.py, ``_reduce_grad``). Through the whole layer stack's backward the
        head's unsharded gradient (``V h`` in the reduce dtype) is alive, not its shard.
        Seen in torch's FSDP1 traced on fake tensors (trainmem/trace/fsdp.py, Note [FSDP1
        streams on the trace]): the 2-layer 2048-wide Llama of benchmarks/
        generic_options.py (vocabulary 4,096, 4 ranks, bf16-mixed): the head's 16,777,216 B
        and the final norm's 4,096 B gradients from the head's backward to the root's
        post-backward, where the 33,558,528 B concatenation is reduce-scattered into this
        rank's 8,389,632 B bf16 chunk and cast to the 16,779,264 B fp32 shard.

        A token embedding tied to the head is one view of the flat parameter: the lookup's
        dense ``V h`` gradient (``embedding_dense_backward``, the base order's vocabulary
        gradient: :meth:`vocab_gradient_bytes`) is added out of place to the head's view
        gradient waiting in the input buffer (autograd ``InputBuffer::accumulate``), which
        is freed, then the lookup's: the trace of llama-3.2-1b (tied, 4 ranks) holds the
        head's, the lookup's and the sum's 525,336,576 B each at the sum.
    """
    states, key, module = group_states(ctx, group)
    t = ctx.training
    label = "a root weight's unsharded gradient before autograd concatenates the root's"
    return [
        alloc(reduce_scatter_layer_bytes([st], t), Cat.TEMPORARY, "backward",
              f"view_grad/{key}/{n}", module, label)
        for n, st in enumerate(states)
    ]  # fmt: skip


def tied_sum(ctx: RankContext) -> tuple[Op | None, Op | None]:
    """(the head's view gradient of a tied token embedding, the sum that replaces it), or
    (None, None) without a tied embedding (Note [FSDP1 flat gradient of the root])."""
    if not embedding_gradients(ctx).tied_lookup:
        return None, None
    names = [st.name for st in ctx.head_grad_states]
    if "embedding/tokens" not in names:
        return None, None
    head = root_views(ctx, "head")[names.index("embedding/tokens")]
    label = "a tied weight's view gradient plus the lookup's, out of place"
    total = alloc(head.size_bytes, Cat.TEMPORARY, "backward", "view_grad/tied", "embedding", label)
    return head, total


def embedding_views(ctx: RankContext) -> list[Op]:
    """The root views' gradients the embedding's backward makes: its own, and for a tied
    weight the sum with the head's view gradient, which it frees."""
    head, total = tied_sum(ctx)
    tied = [total, free(head, "backward")] if head and total else []
    return root_views(ctx, "embedding") + tied


def root_gradient_views(ctx: RankContext) -> list[Op]:
    """The views' gradients the root's concatenation frees (a tied weight's sum in place of the
    head's view of it)."""
    head, total = tied_sum(ctx)
    views = root_views(ctx, "head") + root_views(ctx, "embedding")
    return [total if op == head and total else op for op in views]


def flat_gradient(
    ctx: RankContext, where: Where, unit: str, views: list[Op], reshard: list[Op]
) -> list[Emitted]:
    """Note [FSDP1 flat gradient of a layer unit] (``unit`` ``"layer"``) and Note [FSDP1 flat
    gradient of the root] (``"root"``): the concatenation of the unit's ``views``, the views
    freed, then the post-backward hook: sharded, the reduce-scatter's shard (cast to the
    gradient's dtype, or added into the kept shard); under :func:`fsdp1_no_shard_flat` the unit
    resharded first (``reshard``: its 16-bit copy freed) and the all-reduced gradient cast to
    the parameter's dtype; the concatenation freed.

    Raises:
        ValueError: ``unit`` is neither ``"layer"`` nor ``"root"``.
    """
    if unit not in ("layer", "root"):
        raise ValueError(f"unit {unit!r}: 'layer' or 'root'")
    s = sharding(ctx)
    bp: Phase = "backward"
    size = sum(op.size_bytes for op in views)
    module = "layers.{i}" if unit == "layer" else "(model)"
    flat = alloc(
        size, Cat.TEMPORARY, bp, f"flat_grad/{unit}", module,
        f"the {unit}'s flat unsharded gradient before its reduce",
    )  # fmt: skip
    out: list[Emitted] = [flat, *(free(op, bp) for op in views)]
    if unit == "layer":
        states = ctx.layer_states
        grads = gradient_ops(ctx, states, bp, "{i}", "layers.{i}")
    else:
        states = ctx.head_grad_states + ctx.emb_grad_states
        grads = gradient_ops(ctx, ctx.head_grad_states, bp, "head", "head")
        grads += gradient_ops(ctx, ctx.emb_grad_states, bp, "embedding", "embedding")
    if fsdp1_no_shard_flat(ctx) and not no_shard_copies(ctx.training):
        # the concatenation is ``flat_param.grad`` (no cast: _cast_grad_to_param_dtype keeps
        # a gradient of the parameter's dtype), or is added in place into the kept one
        if where.new_grads:
            return [*grads, *(free(op, bp) for op in views)]
        return [*out, free(flat, bp)]
    if fsdp1_no_shard_flat(ctx) and where.new_grads:  # all-reduced, cast to fp32 (kept)
        return [*out, *reshard, *grads, free(flat, bp)]
    if fsdp1_no_shard_flat(ctx):  # a later micro-batch's: Note [FSDP1 NO_SHARD's 16-bit copy]
        label = "the accumulated gradient cast to the reduce dtype for its all-reduce"
        copy = alloc(size, Cat.TEMPORARY, bp, f"ns_copy/{unit}", module, label)
        label = "the all-reduced gradient cast back to fp32, replacing the kept one"
        shard = sum(op.size_bytes for op in grads)
        cast = alloc(shard, Cat.TEMPORARY, bp, f"ns_cast/{unit}", module, label)
        return [*out, *reshard, copy, cast, free(cast, bp), free(copy, bp), free(flat, bp)]
    shard = sum(op.size_bytes for op in grads)
    # the padded flat gradient's chunk (Note [FSDP1 flat blocks of a layer unit])
    numel = sum(st.local_numel or st.numel for st in states)
    per = size // numel if numel and size % numel == 0 else 0
    dp = ctx.training.sharding_degree
    reduced = -(-numel // dp) * per if per else -(-size // dp)
    if reduced != shard or not where.new_grads:  # a shard in the reduce dtype first
        label = "the reduce-scatter's output, before it is cast or added to the gradient"
        key = f"rs_out/{unit}"
        tmp = alloc(reduced, Cat.TEMPORARY, bp, key, module, label, s.rs_stream)
        out += [tmp, *(grads if where.new_grads else []), free(tmp, bp)]
    elif where.new_grads:
        out += grads
    out.append(free(flat, bp))
    return out
