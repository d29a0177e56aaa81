"""Sizes and modes shared by the ZeRO-2/3 / FSDP transforms (:mod:`.fsdp`, :mod:`.fsdp2`,
:mod:`.fsdp_pipeline`): what one rank gathers, keeps and reduce-scatters, computed once per
rank from its model states.

Source: the gathered and reduced sizes are :mod:`trainmem.analytic.buffers`' (FSDP
``forward_prefetch`` / ``BACKWARD_PRE``, DeepSpeed ZeRO-3's prefetch bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.buffers import (
    gathered_layer_bytes,
    gradient_buffer_from_init,
    kept_gathered_layer_bytes,
    reduce_scatter_layer_bytes,
    root_gathered_bytes,
)
from trainmem.analytic.tensor_states import TensorState, flat_parameter_grads
from trainmem.analytic.transforms.base import (
    ALL_GATHER_STREAM,
    PRE_UNSHARD_STREAM,
    REDUCE_SCATTER_STREAM,
    RankContext,
    alloc,
    embedding_gradients,
    free,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.ranks import fsdp1_no_shard
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase


@dataclass(frozen=True, slots=True)
class Sharding:
    """One rank's ZeRO / FSDP buffers, bytes.

    Attributes:
        stage: ZeRO / FSDP stage in effect (0 without sharding).
        gather_a / gather_b: the current / prefetched layer's gathered parameters.
        gather_root: the root module's (embedding, final norm, head) gathered parameters.
        kept: one layer's gathered weights kept from its forward to its backward.
        reduce: one layer's unsharded gradients before their reduce-scatter.
        ag_stream / rs_stream: streams of the all-gather / reduce-scatter (FSDP2; FSDP1's
            unshard / post-backward streams).
        flat_gather: one layer's flat all-gather output (FSDP2's, under pipelining).
        pp_fsdp: FSDP under pipeline parallelism (Note [FSDP under pipeline parallelism]).
        no_sync: FSDP1 accumulation under ``no_sync`` (Note [FSDP gradient accumulation
            under no_sync]).
        flat_views: one layer's per-parameter gradients before autograd concatenates them
            (Note [Flat-parameter gradients in backward]); 0 without flat-parameter gradients.
        stage_gather / stage_gather_root: the stage's gathered layers / root under pipelining.
        offload_copy: the largest unit's local shard copied to the GPU before its all-gather
            under FSDP1 CPU offload (Note [FSDP1 offloaded shard copy]); 0 otherwise.
        gather_embedding / gather_head: the token embedding's / the output head's gathered
            parameters when each is an FSDP unit of its own (Note [FSDP embedding and head
            units]); 0 when the root holds them.
        gather_stream: stream of the root's and the current layer's gathered parameters
            (FSDP1's unshard stream under Note [FSDP1 unshard stream pool]; 0 otherwise).
        gather_c: a third layer-sized block in the unshard stream's pool through the layers'
            backward (Note [FSDP1 unshard stream pool]: trainable layer units); 0 otherwise.
        mp_shards: the root's and a layer unit's 16-bit shards made on FSDP1's pre-unshard
            stream before their all-gathers (Note [FSDP1 16-bit shard on the pre-unshard
            stream]); empty otherwise.
    """

    stage: int
    gather_a: int
    gather_b: int
    gather_root: int
    kept: int
    reduce: int
    ag_stream: int
    rs_stream: int
    flat_gather: int
    pp_fsdp: bool
    no_sync: bool
    flat_views: int
    stage_gather: int
    stage_gather_root: int
    offload_copy: int = 0
    gather_embedding: int = 0
    gather_head: int = 0
    gather_stream: int = 0
    gather_c: int = 0
    mp_shards: tuple[int, ...] = ()

    @property
    def unsharded_grads(self) -> bool:
        """The gradients accumulate unsharded over the micro-batches."""
        return self.pp_fsdp or self.no_sync


#: the states of the FSDP units of their own (Note [FSDP embedding and head units])
OWN_UNIT_STATES = {"embedding": "embedding/tokens", "head": "lm_head"}


def own_units_apply(ctx: RankContext) -> bool:
    """The token embedding and the output head are FSDP units of their own (Note [FSDP
    embedding and head units]): ``fsdp_embedding_head_units`` under FSDP FULL_SHARD (ZeRO-3
    without DeepSpeed's buckets, no pipelining)."""
    t = ctx.training
    return (
        t.fsdp_embedding_head_units
        and ctx.zero_stage == 3
        and not t.conventions.zero_ipg_buckets
        and t.pipeline_parallel_size == 1
    )


def own_unit_gathered_bytes(ctx: RankContext, unit: str) -> int:
    """Bytes of ``unit``'s (``"embedding"`` or ``"head"``) gathered parameters when it is an
    FSDP unit of its own, else 0 (sized as the root's:
    :func:`~trainmem.analytic.buffers.root_gathered_bytes`)."""
    if not own_units_apply(ctx):
        return 0
    name = OWN_UNIT_STATES[unit]
    return root_gathered_bytes(
        [s for s in ctx.emb_states + ctx.head_states if s.name == name], ctx.training
    )


def _gathers(ctx: RankContext) -> tuple[int, int, int]:
    """(the current layer's gathered parameters, the prefetched layer's, the root module's)
    under ZeRO-3 / FULL_SHARD. DeepSpeed's are :mod:`.deepspeed_gathers`' (none here); FSDP
    the current and the next layer in the gathered dtype
    (:func:`~trainmem.analytic.buffers.gathered_layer_bytes`); torchao float8 all-gathers
    linear weights in float8 (1 byte each). The root's leaves out the embedding and the head
    when they are units of their own (Note [FSDP embedding and head units])."""
    t = ctx.training
    if ctx.zero_stage != 3 and not no_shard_copies(t):
        return 0, 0, 0
    c, _ = compute_and_residual_bytes(t)
    layer = ctx.layer_states
    outer = ctx.emb_states + ctx.head_states
    if own_units_apply(ctx):
        outer = [s for s in outer if s.name not in OWN_UNIT_STATES.values()]
    root = root_gathered_bytes(outer, t)
    if t.is_fp8:
        per = (
            sum(
                (1 if s.name != "vector" and not s.name.startswith("lora_") else c) * s.numel
                for s in layer
            )
            // t.tensor_parallel_size
        )
        return per, per, root
    if t.conventions.zero_ipg_buckets:  # :mod:`.deepspeed_gathers`
        return 0, 0, 0
    per = gathered_layer_bytes(layer, t)
    return per, per, root


def no_shard_copies(t: TrainingConfig) -> bool:
    """FSDP1 ``NO_SHARD`` under a mixed-precision policy, whose 16-bit copies of each unit's
    weights and gradient are made like FULL_SHARD's gathers and reduce buckets.

    Note [FSDP1 NO_SHARD's 16-bit copy]
        Under ``NO_SHARD`` (``--fsdp no-shard``, or FSDP1 on one GPU: torch switches every
        strategy to it, distributed/fsdp/_init_utils.py ``_init_core_state``) with
        ``MixedPrecision(param_dtype=<16-bit>)`` each unit's ``_mp_shard`` (its 16-bit copy,
        which is also its unsharded parameter) is made in the pre-forward unshard and freed by
        ``FlatParamHandle.post_reshard`` after the unit's forward ("For NO_SHARD, _mp_shard is
        not freed in the post-unshard ... we delay the free until the reshard"), the root's
        too, then made again in the pre-backward unshard and freed after the unit's backward
        (torch 2.13 distributed/fsdp/_flat_param.py ``post_reshard``, _runtime_utils.py
        ``_post_forward_reshard`` / ``_pre_backward_hook``): the sizes and lifetimes of
        FULL_SHARD's gathers (:func:`_gathers`, the next unit prefetched, ``BACKWARD_PRE``),
        nothing kept from forward to backward. The unit's gradient is made in the 16-bit
        dtype, all-reduced in place and cast to the fp32 parameter's dtype
        (``_reduce_grad_no_shard`` -> ``_cast_grad_to_param_dtype``: ``.to(param.dtype)``, the
        16-bit one freed after), and the fp32 gradient exists only from the unit's
        post-backward on: a layer's at the end of its backward, the root unit's (embedding,
        final norm and head: one flat parameter) after the embedding's backward, not the
        head's from the head's backward (``FullyShardedDataParallel`` in :mod:`.fsdp` makes
        them there). No DDP reducer buckets: FSDP1 reduces ``flat_param.grad`` itself.

        In a full fine-tune (:func:`~trainmem.analytic.transforms.fsdp1_flat.
        fsdp1_no_shard_flat`) the 16-bit gradient is the flat one of Note [FSDP1 flat gradient
        of a layer unit] (each weight's view gradient where its op's backward runs,
        concatenated at the unit's end) and of Note [FSDP1 flat gradient of the root], and the
        copies' lifetimes are each unit's: no free event is queued for NO_SHARD
        (``_should_free_in_backward`` is False for it, so ``_reshard`` enqueues none), so a
        unit's copy is gone at its reshard: after its forward, the root's after the head's
        (``_post_forward_reshard`` calls ``post_reshard`` for the root too); in the backward
        the post-backward hook reshards before it reduces (``_post_backward_hook``:
        ``_post_backward_reshard`` first), so the copy is freed between the concatenation and
        the fp32 cast; the forward prefetches none (``forward_prefetch=False``), and the
        backward's last layer none (layer 0: no unit ran its post-forward before it). So the
        backward's layers run with two copies (theirs and the next one's), layer 0 with one.
        Without a mixed-precision policy (bf16-true, 32-true) there is no copy and no cast
        (``_cast_grad_to_param_dtype`` keeps a gradient of the parameter's dtype): the
        concatenation is the kept ``flat_param.grad``, made while the views' gradients are
        alive. Checked against torch's own FSDP1 traced on fake tensors under the fake process
        group (tests/trace/test_traced_fsdp1.py; benchmarks/generic_options.py
        'accelerate-fsdp no-shard 4' on its 2-layer 2048-wide Llama: -3.9 % before the flat
        gradients and these lifetimes, -0.007 % after; in bf16-true +7.1 -> -0.014 %).

        Under accumulation with the policy a later micro-batch's concatenation is added in
        place into the kept fp32 ``flat_param.grad`` (autograd ``AccumulateGrad``; the hook runs
        as its post-hook, the concatenation still alive), so the hook finds an fp32 gradient:
        ``flat_param.grad.to(reduce_dtype)`` makes a 16-bit copy for the all-reduce, and
        ``_cast_grad_to_param_dtype`` a new fp32 one while the kept one is still held
        (``autograd_computed_grad``, freed when the hook returns): the concatenation, the copy
        and two fp32 gradients at once (generic_options' no-shard cell with 2 micro-batches:
        +6.6 % before, 0.000 % after).

        Not under a quantized base: its units hold the codes and the rest of the base in the
        dtype the model is loaded in, which is the policy's (transformers' FSDP-QLoRA and
        fms-acceleration's GPTQ patch under ``*-mixed``:
        :func:`~trainmem.specs.quantization.float_quant_storage`, the compute dtype), so no
        frozen unit is copied (``_uses_param_mixed_precision`` is False for it); the adapter
        units' small casts are not modelled (as :func:`low_precision_shards`).
    """
    return (
        fsdp1_no_shard(t)
        and t.is_mixed
        and t.conventions.fsdp_param_dtype_follows_precision
        and t.quantize_base == "none"
    )


def sharding(ctx: RankContext) -> Sharding:
    """The rank's :class:`Sharding` (computed once per context)."""
    cached = ctx.memo.get("sharding")
    if isinstance(cached, Sharding):
        return cached
    t, stage = ctx.training, ctx.zero_stage
    gather_a, gather_b, gather_root = _gathers(ctx)
    # FSDP SHARD_GRAD_OP / NO_SHARD under a mixed-precision policy: each layer's gathered
    # weights stay from its forward to its backward (they replace the per-layer gathers)
    kept = kept_gathered_layer_bytes(ctx.layer_states, t)
    if kept and stage == 3:
        gather_a = gather_b = 0
    # Note [torchao gradient offload]: each gradient leaves in its own hook, no bucket
    offloads_grads = (
        t.offload in ("optimizer+gradients", "optimizer+params") and not t.torchao_cpu_offload
    )
    reduced = stage >= 2 or offloads_grads or no_shard_copies(t)
    reduce = reduce_scatter_layer_bytes(ctx.layer_states, t) if reduced else 0
    streams = t.conventions.fsdp_collective_streams and stage == 3
    pp_fsdp = t.pipeline_parallel_size > 1 and stage == 3
    # FULL_SHARD only (lit-gpt's): under SHARD_GRAD_OP no_sync also keeps the gathered
    # parameters, not modelled here
    no_sync = (
        not pp_fsdp
        and stage == 3
        and t.conventions.fsdp_no_sync_accumulation
        and t.gradient_accumulation_steps > 1
        and bool(t.zero_grad_set_to_none)  # resolved by TrainingConfig
        and not gradient_buffer_from_init(t)
    )
    if no_sync:  # the accumulated unsharded gradient is the reduce-scatter's input
        reduce = 0
    flat_views = sum(s.full_grad_bytes for s in ctx.layer_states) if flat_parameter_grads(t) else 0
    flat = gather_a if streams else 0  # one layer's flat all-gather output
    stage_gather = stage_gather_root = 0
    if pp_fsdp:  # the layers' and the root's (embedding, norm, head) FSDP2 groups
        stage_gather, stage_gather_root = ctx.num_layers * (gather_a + kept), gather_root
        gather_a = gather_b = gather_root = kept = reduce = 0
    units = fsdp1_unshard_pool_units(ctx) if streams and not pp_fsdp and not kept else 0
    out = Sharding(
        stage=stage,
        gather_a=gather_a,
        gather_b=gather_b,
        gather_root=gather_root,
        kept=kept,
        reduce=reduce,
        ag_stream=ALL_GATHER_STREAM if streams else 0,
        rs_stream=REDUCE_SCATTER_STREAM if streams else 0,
        flat_gather=flat,
        pp_fsdp=pp_fsdp,
        no_sync=no_sync,
        flat_views=flat_views,
        stage_gather=stage_gather,
        stage_gather_root=stage_gather_root,
        offload_copy=offloaded_shard_copy_bytes(ctx) if stage == 3 and not pp_fsdp else 0,
        gather_embedding=own_unit_gathered_bytes(ctx, "embedding"),
        gather_head=own_unit_gathered_bytes(ctx, "head"),
        gather_stream=ALL_GATHER_STREAM if units else 0,
        gather_c=gather_b if units == 3 else 0,
        mp_shards=low_precision_shards(ctx, gather_root, gather_a) if units else (),
    )
    ctx.memo["sharding"] = out
    return out


def fsdp1_unshard_pool_units(ctx: RankContext) -> int:
    """Layer units whose unsharded flat parameters FSDP1's unshard stream holds at once (live,
    or freed and not yet reusable), beside the root's, for the frameworks that run torch's
    FSDP1 with its defaults (Note [FSDP1 unshard stream pool]): 2 when each LoRA leaf is a unit
    of its own (the layer's flat parameter frozen), 3 when the layer's flat parameter trains;
    0 where the rule does not apply (FSDP2, torchtune from 0.3, litgpt, the frameworks without
    FSDP).

    Note [FSDP1 unshard stream pool]
        torch 2.2.2 distributed/fsdp (the FSDP1 of Answer.AI fsdp_qlora train.py 50efa1e and
        of torchtune's distributed recipes before 0.3, 6deeda92 / v0.3.0 moved them to FSDP2)
        with the constructor's defaults both use (fully_sharded_data_parallel.py:
        ``backward_prefetch=BACKWARD_PRE``, ``forward_prefetch=False``,
        ``limit_all_gathers=True``; fsdp_qlora passes ``limit_all_gathers=True`` and
        ``use_orig_params=False`` itself) gathers every unit in ``_unshard``
        (_runtime_utils.py) under ``stream(unshard_stream)``: ``_alloc_storage`` of the padded
        unsharded flat parameter (_flat_param.py ``_alloc_padded_unsharded_flat_param``) is a
        block of that stream's pool, which the default stream's freed blocks (the load's cache,
        the activations') cannot serve (c10/cuda/CUDACachingAllocator.cpp ``get_free_block``
        matches the stream). Which units' blocks the pool holds at once:

        - the root (embeddings, final norm, head): gathered first and kept to the end of the
          backward (``_post_forward_reshard``: 'Do not free the root's parameters in the
          post-forward'): R bytes for the micro-batch;
        - forward: unit i + 1 is gathered in its pre-forward right after unit i's
          post-forward freed i; that free is ``record_stream``-ed on the compute stream
          (``_free_unsharded_flat_param``), so i's block returns to the pool only when the GPU
          has run layer i; the rate limiter (_limiter_utils.py ``_FreeEventQueue``, two in
          flight) synchronises only on the older frees: i + 1 live and i pending, 2 blocks;
        - backward, BACKWARD_PRE prefetches the unit whose post-forward came just before
          (_exec_order_utils.py ``get_handle_to_backward_prefetch``). With each LoRA leaf a unit
          (fsdp_qlora's lambda policy, torchtune utils/_distributed.py
          ``lora_fsdp_wrap_policy``) the unit before layer i + 1 in that order is its own last
          adapter, and the unit before layer i + 1's first adapter is layer i: layer i is
          gathered by that adapter's pre-backward hook while layer i + 1 is still running, and
          i + 2's free is long synchronised: 2 blocks. A trainable layer unit (a full
          fine-tune) prefetches i - 1 from i's pre-backward, right after i + 1's post-backward
          hook freed i + 1 (``_post_backward_hook`` -> ``_post_backward_reshard``), a free the
          limiter has not synchronised: i and i - 1 live, i + 1 pending, 3 blocks.

        So the unshard stream's pool holds R + 2 L (adapters as units) or R + 3 L (trainable
        layer units), L the layer's gathered bytes. Run on torch's FSDP1 on the CPU under the
        fake process group (tests/analytic/test_fsdp1_streams.py): the order of the units'
        gathers and frees gives 2 live layer units at most in both cases, and with the
        limiter's queue replayed (a free pending until the limiter synchronises on it or a
        later one) 2 and 3 blocks. The schedule keeps the root's and the current layer's
        gathers on the unshard stream for the micro-batch, the prefetched layer's over each
        stack, and for trainable units a third layer-sized block over the backward stack.
        With trainable units the backward stack's first layer holds two layer blocks, not
        three: it has no freed layer before it (the third block starts at the end of its
        post-backward: the reshard makes pending the block the layer ran on, so through its
        reduce-scatter the pool holds R + 2 L, and only the next layer's pre-backward gathers
        a third). Its last (layer 0) prefetches none (no unit ran its post-forward before
        layer 0's), so no unshard dequeues the limiter's queue after layer 1's pre-backward:
        from 3 layers layer 0 runs beside layers 2's and 1's pending frees (3 blocks), and
        after its post-backward layers 2's, 1's and 0's stay pending through the embedding's
        backward and the root's reduce-scatter, to the backward's end (the schedule frees them
        after ``root.post_backward``); over 2 layers, 2 blocks (layer 1's and 0's). The trace
        replays the same limiter on torch's FSDP1 (Note [FSDP1 streams on the trace],
        trainmem/trace/fsdp.py, which releases the held frees at the backward's final
        callback): R + 2 L over a 2-layer stack, R + 3 L from 3 layers; llama-3.2-1b (16
        layers, tied, 4 ranks) traced whole holds 3 x 121,643,008 B beside the root at the
        tied embedding's sum, its step's peak (formulas 7,163,983,872 B, trace 7,163,918,540
        B). Assumed: the GPU runs behind the CPU (an unsynchronised free is still pending when
        the next gather is allocated).

        accelerate's FSDP1 (``accelerate-fsdp``: ``accelerate launch`` and the HF Trainer's
        ``--fsdp``) meets the rule's preconditions with the settings its users pass:
        ``FullyShardedDataParallelPlugin`` (accelerate utils/dataclasses.py, v0.29.3 to
        v1.3.0) defaults ``limit_all_gathers=True``, ``forward_prefetch=False`` and
        ``use_orig_params=False`` (``FSDP_USE_ORIG_PARAMS`` unset); its ``backward_prefetch``
        comes from ``FSDP_BACKWARD_PREFETCH`` (``NO_PREFETCH``, torch's ``None``, when unset),
        which the rows' configs set to ``BACKWARD_PRE`` (philschmid
        fsdp-qlora-distributed-llama3.ipynb ``backward_prefetch: "backward_pre"``;
        fms-hf-tuning fixtures/accelerate_fsdp_defaults.yaml ``fsdp_backward_prefetch_policy:
        BACKWARD_PRE``), the prefetch trainmem assumes for accelerate-fsdp throughout (Note
        [FSDP1 backward prefetch under adapter units], trainmem/analytic/transforms/fsdp.py:
        under LoRA the HF Trainer wraps each adapter leaf as a unit, peft's
        ``fsdp_auto_wrap_policy``; peft examples/sft/configs/fsdp_config.yaml the same).
        Not modelled: ``NO_PREFETCH``, accelerate's own default; the adapter units' own small
        gathers (their LoRA weights are counted in L).
    """
    t = ctx.training
    fsdp1 = t.framework in ("fsdp-qlora", "accelerate-fsdp") or (
        t.framework == "torchtune" and t.torchtune_release < (0, 3, 0)
    )
    if not fsdp1 or ctx.zero_stage != 3:
        return 0
    return 2 if t.lora_rank > 0 else 3


def low_precision_shards(ctx: RankContext, root: int, layer: int) -> tuple[int, ...]:
    """The 16-bit shards, bytes, of the root unit and of a layer unit (gathered bytes ``root``
    and ``layer``) that accelerate's FSDP1 makes on its pre-unshard stream under ``*-mixed``
    (Note [FSDP1 16-bit shard on the pre-unshard stream]); () where the rule does not apply.

    Note [FSDP1 16-bit shard on the pre-unshard stream]
        With ``MixedPrecision(param_dtype=<16-bit>)`` over fp32 flat parameters (accelerate's
        FSDP1 under ``*-mixed``, ``set_mixed_precision``), each unit's ``_unshard`` runs
        ``handle.pre_unshard()`` under ``stream(pre_unshard_stream)`` (torch 2.13
        distributed/fsdp/_runtime_utils.py), which casts the local fp32 shard into a new
        16-bit one (_flat_param.py ``_use_low_precision_shard``: ``_alloc_storage(
        flat_param._mp_shard)``, ``copy_``), the all-gather's input; ``post_unshard`` frees
        it (``_free_low_precision_sharded_param``, ``record_stream``-ed on the unshard
        stream). So the pre-unshard stream's pool holds the largest unit's 16-bit shard, a
        block the default stream cannot reuse: ceil(numel / N) 16-bit elements, the root's
        (embeddings, final norm, head) and a layer's, each emitted once before the
        micro-batch's gathers (one per size class of the caching allocator: a small root
        shard and a large layer shard land in different pools). Seen in torch's FSDP1 traced
        with its streams (Note [FSDP1 streams on the trace], trainmem/trace/fsdp.py): a
        4-layer 1024-wide Qwen2 over 4 ranks, 524,800 B and 5,637,888 B on the pre-unshard
        stream, a 2 MiB and a 20 MiB segment. Not under a quantized base (transformers'
        FSDP-QLoRA: the policy's dtype is the codes' storage dtype, so the frozen units are not
        cast; the adapter units' small casts are not modelled).
    """
    t = ctx.training
    # a quantized base's units hold its codes in the policy's own dtype (transformers'
    # Trainer._fsdp_qlora_plugin_updates sets param_dtype to bnb_4bit_quant_storage): no cast
    fp32_units = t.quantize_base == "none"
    if not (t.framework == "accelerate-fsdp" and t.is_mixed and not t.is_fp8 and fp32_units):
        return ()
    c, _ = compute_and_residual_bytes(t)
    n = t.sharding_degree
    return tuple(-(-size // (n * c)) * c for size in (root, layer) if size)


def low_precision_shard_ops(s: Sharding) -> list[Op]:
    """Each 16-bit shard of :func:`low_precision_shards` made and freed on the pre-unshard
    stream, emitted before the micro-batch's gathers."""
    label = "a unit's 16-bit shard, the all-gather's input (FSDP1 mixed precision)"
    out: list[Op] = []
    for n, size in enumerate(s.mp_shards):
        op = alloc(size, Cat.TEMPORARY, "forward", f"mp_shard/{n}", "(model)", label,
                   PRE_UNSHARD_STREAM)  # fmt: skip
        out += [op, free(op, "forward")]
    return out


def offloaded_shard_copy_bytes(ctx: RankContext) -> int:
    """Bytes of the largest FSDP1 unit's local shard that CPU offload copies to the GPU before
    the unit's all-gather (Note [FSDP1 offloaded shard copy]): the root's (embeddings, final
    norm, head) or a layer's frozen weights, unsharded bytes divided by the sharding degree
    (rounded up; FSDP1 pads the flat parameter to a multiple of it); 0 unless fsdp_qlora
    offloads the parameters (``--offload optimizer+params``).

    Note [FSDP1 offloaded shard copy]
        Answer.AI fsdp_qlora train.py (50efa1e, Mar 2024) wraps the model with
        ``cpu_offload=CPUOffload(offload_params=True)`` under ``--use_cpu_offload`` and,
        for ``--precision bf16``, no mixed-precision policy. Before each unit's all-gather,
        FSDP1 (torch 2.2 distributed/fsdp/_runtime_utils.py ``_unshard``) runs
        ``handle.pre_unshard()`` under ``stream(pre_unshard_stream)``, and for an offloaded
        flat parameter that is on the CPU ``pre_unshard`` (distributed/fsdp/_flat_param.py)
        calls ``self.flat_param_to(self.device, non_blocking=True)``: a new GPU tensor of the
        padded local shard, allocated on the pre-unshard stream. ``unshard()`` all-gathers it
        into the padded unsharded flat parameter and ``_use_unsharded_flat_param`` replaces
        ``flat_param.data``, the copy's last reference, so one copy is alive at a time, beside
        the unit's gathered parameters. The caching allocator keeps a stream's freed blocks for
        that stream only (c10/cuda/CUDACachingAllocator.cpp ``get_free_block`` matches the
        stream), so the first and largest copy, the root's in the forward, stays reserved
        outside the default stream's pool. 70B Llama-2 on 2 ranks: (2 x 32000 x 8192 + 8192)
        x 2 bytes / 2 = 524,296,192 bytes. The schedule holds that copy at the micro-batch's
        start, beside the root's gathered parameters; the layers' smaller copies reuse its
        block and are not modelled, so the allocated peak misses one layer's copy (the
        reserved bytes do not). Not modelled either: NCCL's ``recordStream`` on the
        all-gather input, which can delay the copy's reuse until the all-gather completes.
    """
    t = ctx.training
    if t.framework != "fsdp-qlora" or t.offload != "optimizer+params" or ctx.zero_stage != 3:
        return 0
    root = root_gathered_bytes(ctx.emb_states + ctx.head_states, t)
    base = sum(s.full_param_bytes for s in ctx.layer_states if not s.trainable)
    degree = t.sharding_degree
    return -(-max(root, base) // degree)


def offload_copy_ops(s: Sharding, phase: Phase) -> tuple[Op, Op]:
    """The offloaded shard's GPU copy on the pre-unshard stream and its free (Note [FSDP1
    offloaded shard copy]); emitted around the gathers it feeds."""
    label = "an offloaded shard copied to the GPU for its all-gather"
    size = s.offload_copy
    op = alloc(size, Cat.TEMPORARY, phase, "offload_copy", "(model)", label, PRE_UNSHARD_STREAM)
    return op, free(op, phase)


def gather_ops(s: Sharding) -> tuple[Op, Op]:
    """The root module's and the current layer's gathered parameters, allocated when the
    micro-batch's forward starts (on FSDP1's unshard stream under Note [FSDP1 unshard stream
    pool])."""
    f: Phase = "forward"
    st = s.gather_stream
    root_label = "the root module's gathered parameters"
    root = alloc(s.gather_root, Cat.TEMPORARY, f, "gather/root", "(model)", root_label, st)
    layer_label = "gathered parameters of the current layer"
    layer = alloc(s.gather_a, Cat.TEMPORARY, f, "gather/a", "layers", layer_label, st)
    return root, layer


def kept_op(s: Sharding, phase: Phase) -> Op:
    """One layer's gathered weights kept from its forward to its backward
    (:func:`~trainmem.analytic.buffers.kept_gathered_layer_bytes`)."""
    return alloc(
        s.kept,
        Cat.TEMPORARY,
        phase,
        "kept/{i}",
        "layers.{i}",
        "the layer's gathered weights, kept from its forward to its backward",
    )


def partial_factor(ctx: RankContext, state: TensorState) -> int:
    """How many times its tensor-parallel slice a state's accumulated gradient is: the
    token embedding's partial gradient covers the whole vocabulary (FrameworkConventions.
    dtensor_vocab_parallel_embedding)."""
    if state.name == "embedding/tokens" and state in ctx.emb_grad_states:
        return embedding_gradients(ctx).vocab_factor
    return 1


def unsharded_gradient_ops(
    ctx: RankContext, states: list[TensorState], phase: Phase, key: str, module: str
) -> list[Op]:
    """Gradients accumulated unsharded until the last micro-batch (Note [FSDP under pipeline
    parallelism], Note [FSDP gradient accumulation under no_sync]); key ``ugrad/<key>/<n>``."""
    return [
        alloc(
            s.full_grad_bytes * partial_factor(ctx, s),
            Cat.GRADIENT,
            phase,
            f"ugrad/{key}/{n}",
            module,
            "unsharded gradients accumulated until the last micro-batch",
        )
        for n, s in enumerate(states)
    ]


def group_states(ctx: RankContext, group: str) -> tuple[list[TensorState], str, str]:
    """(states, key, module) of the head's, the layer's or the embedding's gradients."""
    if group == "head":
        return ctx.head_grad_states, "head", "head"
    if group == "embedding":
        return ctx.emb_grad_states, "embedding", "embedding"
    return ctx.layer_states, "{i}", "layers.{i}"
