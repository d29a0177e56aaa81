"""Activation checkpointing and offloading: which of a layer's activation terms are saved and
which dropped and recomputed (:func:`layer_plan`, the base order's layer body reads it), and
activation offloading as a transform (torchtune ``OffloadActivations``: the layer before the
current one leaves for the CPU once this one has run; backward prefetches the next one it
needs, so the current and the prefetched layer stay).

Note [Op-level selective recompute per tensor]
    Under eager op-level selective checkpointing (torchtitan's ``selective_ac_option="op"``,
    torch/utils/checkpoint.py ``create_selective_checkpoint_contexts``, non-reentrant) the
    layer's backward replays its forward: the outputs the policy saved come from the cache,
    every other op's output is made again and saved by the node that reads it, so each is freed
    when that node's backward has run, as in a layer run without checkpointing (the release
    groups of Note [Gradients where their linear's backward runs]). The formulas made the
    recompute one block (``ActivationProfile.recompute``, the layer's terms less the saved
    bytes) freed at the layer's end, and that block still held autocast's 16-bit weight copies,
    which the recompute's ``LayerPlan.weight_copy`` blocks make again: on the 2-layer 2048-wide
    Llama at 2 x 256 tokens (SGD) the formulas were +13.5 % over the generic path's trace
    (86 MB of copies twice, 37 MB of activations alive through the attention's backward). Now
    the recompute is the layer's terms as the tensors they are, less the cached outputs that are
    terms (the layer input where the first norm saves it, the SDPA output and logsumexp, the
    gate projection's output within ``mlp/gated``; the q / v / down outputs the policy saves are
    not terms: RoPE and the residual add make new tensors), the weight copies apart: +0.48 %.
    peft's adapters' matmuls are cached too, and some of those outputs no recompute op saves:
    they are freed where the recompute replays them (Note [The adapters' matmuls under
    op-level selective checkpointing] in analytic/op_selective.py).
    A compiled region keeps the one block: the min-cut partitioner chooses what it
    recomputes (Note [Tracing torch.compile] in trainmem/trace/compile.py).

Source: torch/utils/checkpoint.py (full), torch/utils/checkpoint.py
``create_selective_checkpoint_contexts`` (selective), torchtune/training/
_activation_offloading.py ``OffloadActivations``; the terms are
:func:`~trainmem.analytic.activations.layer_activation_terms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from trainmem.analytic.activation_parallelism import parallel_divisor, split_for_parallelism
from trainmem.analytic.activation_shapes import (
    cast_copies,
    compute_and_residual_bytes,
    tokens_per_sequence,
)
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.attention import SLIDING_MASK_BIAS, sliding_layer_mask_bias_bytes
from trainmem.analytic.autocast import autocast_cached_weight_bytes
from trainmem.analytic.checkpointing import layer_is_checkpointed
from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.lora_variants import (
    INPUT_PROJECTIONS,
    O_LINEARS,
    UP_LINEARS,
    dora_down_moment_in_forward,
    dora_moments_per_linear,
    dora_recomputed_down_splits,
    dora_terms,
)
from trainmem.analytic.norms import fused_norms
from trainmem.analytic.op_selective import (
    EYE_PRODUCTS,
    op_selective_cache_uses,
    op_selective_saved_terms,
)
from trainmem.analytic.params import adapted_linears, lora_targeted
from trainmem.analytic.t5 import buckets_in_first_blocks, position_bucket_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.memo import per_configuration
from trainmem.schedule import Op
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

WEIGHT_COPIES = "autocast_weight_copies"
POSITION_BUCKETS = "attention/position_buckets"
"""T5's relative-position buckets, made by the recompute of each stack's first block (Note
[Layer bodies per stack and block 0])."""

MAX_BLOCKS_PER_TERM = 64
"""A term is split into at most this many tensors (tiny sequence lengths would otherwise split a
term into millions of blocks); beyond it the term is one block."""

Blocks = list[tuple[str, int]]

UNADAPTED_ROTATED = frozenset({"op_selective/mm/q", "op_selective/mm/k"})
"""The saved blocks of an unadapted q / k projection's cached output, freed where the recompute
applies RoPE (Note [The cached q and v outputs in the recompute])."""

CACHED_EYE_PRODUCTS = tuple(f"op_selective/{prefix}" for prefix in EYE_PRODUCTS)
"""The saved blocks of DoRA's cached matmuls on ``torch.eye(in)`` (Note [The adapters'
matmuls under op-level selective checkpointing])."""


class LayerPlan(NamedTuple):
    """One layer's activations as blocks (term, bytes), non-MLP terms first (the forward
    order: attention, then MLP).

    Attributes:
        saved: kept from the forward to the backward.
        dropped: allocated and freed in the forward, recomputed in the backward.
        weight_copy: autocast's cached 16-bit weight copies held until the autocast region
            exits (under checkpointing), bytes; 0 otherwise.
        frozen_copy: under checkpointing, autocast's 16-bit copies of the frozen weights
            (LoRA's base), bytes: not cached (``autocast_cached_weight_bytes``), so each is
            made and dropped in its linear's forward, made again by the recompute and saved
            by its linear until that linear's backward; 0 otherwise.
    """

    saved: Blocks
    dropped: Blocks
    weight_copy: int
    frozen_copy: int = 0


def _saved_and_dropped(ctx: RankContext) -> tuple[dict[str, int], dict[str, int]]:
    """The layer's terms kept and dropped by the checkpointing mode."""
    prof, t, model = ctx.profile, ctx.training, ctx.model
    mode = t.activation_checkpointing
    parts: dict[str, int] = {}
    if mode == "none":
        saved = dict(prof.terms)
    elif mode == "selective" and t.attention == "eager":
        saved = {k: v for k, v in prof.terms.items() if not k.startswith("scores/")}
    elif mode == "selective":  # op-level: matmul / SDPA outputs kept, the rest recomputed
        saved = {"op_selective_saved": prof.per_layer}
        parts = op_selective_saved_terms(model, t)
        if sum(parts.values()) == prof.per_layer:  # as the tensors they are
            saved = {f"op_selective/{k}": v for k, v in parts.items()}
        else:
            parts = {}
    else:
        saved = {"layer_input": prof.per_layer}
    if mode == "selective" and t.attention != "eager" and t.compile:
        # a compiled region's recompute is the min-cut partitioner's, not the eager ops'
        dropped = {"recomputed": prof.recompute}
    elif mode == "selective" and t.attention != "eager":
        dropped = op_selective_recomputed(ctx, parts)
    else:
        dropped = {k: v for k, v in prof.terms.items() if k not in saved}
    return saved, dropped


def op_selective_recomputed(ctx: RankContext, kept: dict[str, int]) -> dict[str, int]:
    """What op-level selective checkpointing makes again in a layer's backward, per layer term
    (bytes; ``kept``: :func:`~trainmem.analytic.op_selective.op_selective_saved_terms`, empty
    where the saved tensors are not those terms: then one ``recomputed`` block).

    See Note [Op-level selective recompute per tensor]. Autocast's weight copies stay their own
    term (:func:`layer_plan` takes them out as the ``LayerPlan.weight_copy`` blocks).
    """
    prof = ctx.profile
    terms = dict(prof.terms)
    copies = terms.get(WEIGHT_COPIES, 0)
    if not kept:
        return {"recomputed": max(prof.recompute - copies, 0), WEIGHT_COPIES: copies}
    # the cached outputs that are layer terms are not made again
    if first_norm_saves_its_input(ctx.model, ctx.training) and "attention/norm" in terms:
        terms["attention/norm"] -= min(kept["layer_input"], terms["attention/norm"])
    for name in ("attention/sdpa_output", "attention/logsumexp"):
        if name in terms:
            terms[name] -= min(kept.get(name, 0), terms[name])
    # cached matmul outputs the recompute's ops save in place of (part of) a term: an
    # untargeted gate's output within ``mlp/gated`` (gate, act(gate), up), the adapters'
    # (Note [The adapters' matmuls under op-level selective checkpointing])
    for key, term in op_selective_cache_uses(ctx.model, ctx.training, kept).items():
        if term in terms:
            terms[term] -= min(kept[key], terms[term])
    return terms


def cache_release_places(ctx: RankContext, names: Sequence[str]) -> tuple[str, ...]:
    """Per saved block of a layer (``names``, the plan's term names) where the recompute
    frees it: ``""`` for a block kept to the layer's backward (the release groups of Note
    [Gradients where their linear's backward runs]); for a cached matmul output no op of the
    recompute saves (:func:`~trainmem.analytic.op_selective.op_selective_cache_uses`), the
    point its linear replays it: ``pre_backward`` (q / k / v under Note [DoRA's moment at
    each linear]), ``o``, ``up`` (gate / up), ``backward`` (before the transforms' ops at
    ``layer.backward``: down, every linear without that order) or ``after`` (after them: the
    down projection's base and B outputs, replayed after its frozen weight's copy; Note [The
    recompute's tensors held at an autocast down projection]). DoRA's eye products are
    popped inside their linear's DoRA forward, so before its moment (Note [DoRA forward
    transients] counts the product there); the other outputs where their linear runs.

    Note [The adapters' matmuls under op-level selective checkpointing] (analytic/
    op_selective.py)."""
    t = ctx.training
    if t.activation_checkpointing != "selective" or t.attention == "eager" or t.compile:
        return ("",) * len(names)
    kept = op_selective_saved_terms(ctx.model, t)
    uses = op_selective_cache_uses(ctx.model, t, kept)
    freed = {f"op_selective/{key}" for key, use in uses.items() if not use}
    per_linear = dora_moments_per_linear(ctx.model, t)
    adapted = {key.rsplit("/", 1)[-1] for key in kept if key.count("/") == 2}
    out = []
    for name in names:
        linear = name.rsplit("/", 1)[-1]
        eye = name.startswith(CACHED_EYE_PRODUCTS)
        if name not in freed:
            out.append("")
        elif linear == "down" and not eye:
            out.append("after")
        elif name in UNADAPTED_ROTATED and linear not in adapted:
            # Note [The cached q and v outputs in the recompute]: freed after RoPE, before o
            out.append("o" if per_linear else "pre_backward")
        elif per_linear and linear in INPUT_PROJECTIONS:
            out.append("pre_backward")
        elif per_linear and linear in O_LINEARS | UP_LINEARS:
            out.append("o" if linear in O_LINEARS else "up")
        else:
            out.append("backward")
    return tuple(out)


def cached_down_output(ctx: RankContext) -> bool:
    """Whether the recompute's adapted down projection takes its base output from op-level
    selective checkpointing's cache (a saved block of the layer, Note [The adapters' matmuls
    under op-level selective checkpointing]): then that output is not one more tensor the
    recompute holds at down (:func:`~trainmem.analytic.forward_transients.
    recompute_down_held_bytes`, :func:`~trainmem.analytic.lora_variants.
    dora_recompute_down_held_bytes` list it)."""
    names = {term for term, _ in layer_plan(ctx).saved}
    if "op_selective/mm/down" not in names:
        return False
    kept = {name.removeprefix("op_selective/"): 0 for name in names}
    return "mm/down" in op_selective_cache_uses(ctx.model, ctx.training, kept)


def _full_recompute(ctx: RankContext, dropped: dict[str, int]) -> None:
    """Full checkpointing's corrections of the dropped terms (in place)."""
    prof, model = ctx.profile, ctx.model
    if "attention/norm" in dropped and model.pre_norms and model.architecture == "decoder":
        if first_norm_saves_its_input(model, ctx.training):
            # the layer input the checkpoint keeps is not made again by the recomputation:
            # the first norm saves that very tensor (Note [Backward of a pre-norm block];
            # seen in the generic path for the output-norm blocks of Gemma-2 and Gemma-3 too)
            dropped["attention/norm"] -= min(prof.per_layer, dropped["attention/norm"])
    elif "attention/norm" in dropped:
        # a recompute smaller than the layer's terms (vision encoders: the first norm's
        # input is the held block input, :func:`activation_profile`): that norm's share
        excess = sum(prof.terms.values()) - prof.recompute
        if excess > 0:
            dropped["attention/norm"] = max(dropped["attention/norm"] - excess, 0)
    if model.architecture == "encoder-decoder" and sum(prof.terms.values()) < prof.recompute:
        # T5's blocks are held as their mean (encoder blocks at the source length, decoder
        # blocks at the target length); the largest kind is recomputed whole: the mean
        # body's recompute, which only pipeline stages run (one stage runs each kind's own,
        # Note [Layer bodies per stack and block 0]). DeepSeek's MoE block peaks
        # mid-recompute, where its mean block already agrees with the trace.
        dropped["recompute/largest_block"] = prof.recompute - sum(prof.terms.values())


def first_norm_saves_its_input(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether a pre-norm layer's first norm saves the layer input itself (the tensor full
    checkpointing keeps), rather than a copy of it.

    LayerNorm saves its input (``native_layer_norm``: tools/autograd/derivatives.yaml). HF's
    RMSNorm saves ``x.to(torch.float32)`` (modeling_llama.py ``LlamaRMSNorm.forward``, the
    ``pow`` and the product that read it), which is ``x`` itself only on an fp32 residual
    stream (``Tensor.to`` returns ``self`` when the dtype already matches:
    aten/src/ATen/native/TensorConversions.cpp ``to``); on a 16-bit stream (bf16-true,
    16-true) it is a new 4 B-per-value copy the recomputation makes again beside the kept
    16-bit input (traced: a 1024-wide Qwen2, bf16-true LoRA, full checkpointing, FSDP2).
    """
    _, r = compute_and_residual_bytes(training)
    # a fused norm (Unsloth's Fast_RMS_Layernorm, Megatron's TENorm) saves its input itself
    # (analytic/norms.py ``fused_norms``)
    return model.norm_kind == "layernorm" or r == 4 or fused_norms(training)


def layer_plan(ctx: RankContext) -> LayerPlan:
    """The layer's saved and dropped blocks (computed once per context)."""
    cached = ctx.memo.get("layer_plan")
    if isinstance(cached, LayerPlan):
        return cached
    t = ctx.training
    saved, dropped = _saved_and_dropped(ctx)
    if t.activation_checkpointing == "full":
        _full_recompute(ctx, dropped)
    copy = autocast_cached_weight_bytes(ctx.model, t) if layer_is_checkpointed(t) else 0
    frozen = 0
    if copy:  # autocast's cache holds them (Note [Analytic step schedule])
        copies = dropped.pop(WEIGHT_COPIES, 0)
        frozen = max(copies - copy, 0) if t.frozen_base else 0  # LayerPlan.frozen_copy
    out = LayerPlan(term_blocks(ctx, saved), term_blocks(ctx, dropped), copy, frozen)
    ctx.memo["layer_plan"] = out
    return out


def dropped_per_layer_kind(ctx: RankContext) -> tuple[tuple[int, ...], tuple[Blocks, ...]]:
    """The dropped blocks of each kind of layer body and, per layer of the rank's stack, its
    kind (an index into them; () where every layer drops the same blocks, kind 0): an
    encoder-decoder's per stack and block 0 (:func:`dropped_per_stack_block`), a model mixing
    sliding and full attention's per attention kind (:func:`dropped_per_attention_kind`)."""
    per_stack = dropped_per_stack_block(ctx)
    if per_stack is not None:
        return per_stack
    return dropped_per_attention_kind(ctx)


def dropped_per_stack_block(
    ctx: RankContext,
) -> tuple[tuple[int, ...], tuple[Blocks, ...]] | None:
    """An encoder-decoder's dropped blocks under full checkpointing: per kind (encoder block
    0, the other encoder blocks, decoder block 0, the other decoder blocks) and per layer its
    kind; None for other models and settings.

    Note [Layer bodies per stack and block 0]
        T5's schedule holds its encoder and decoder blocks as one mean block (``mean_terms``:
        exact in the total of the saved tensors). Under full checkpointing each block's
        recompute makes its own terms again, and they differ by stack: an encoder block's at
        the source length, a decoder block's at the target length with its cross-attention
        (modeling_t5.py ``T5Block``: ``T5LayerCrossAttention`` when ``is_decoder``). The
        mean block's recompute (or the largest kind's) is neither, so, as for Note [Layer
        bodies per attention kind], the layer loop runs each block's own recomputed blocks
        (the schedule's layers are the encoder's, then the decoder's: ``ModelSpec.
        layer_kinds``). Block 0 of each stack also makes the relative-position buckets again
        (:func:`~trainmem.analytic.t5.position_bucket_bytes`: only it has
        ``has_relative_attention_bias``; transformers 5.24 checkpoints each ``T5Block``, a
        ``GradientCheckpointingLayer``, non-reentrantly), so they are its recompute's, not
        the stacks' saved tensors. Found comparing both engines' schedules of tiny-t5 (8 x 256
        source, 64 target tokens; session 21, helper t5ac): the trace peaks in encoder block
        0's recompute with the encoder's 524,288 B of buckets. The saved blocks, the
        checkpointed block inputs, are per stack too (:func:`saved_per_stack_block`).
    """
    model, t = ctx.model, ctx.training
    if (
        model.architecture != "encoder-decoder"
        or not model.num_decoder_layers
        or not buckets_in_first_blocks(t)
        or ctx.num_layers != model.num_blocks
    ):
        return None
    plan = layer_plan(ctx)
    kinds: list[int] = []
    bodies: list[Blocks] = []
    for (count, block), buckets in zip(
        model.layer_kinds(), position_bucket_bytes(model, t), strict=True
    ):
        terms = layer_activation_terms(block, t)
        if plan.weight_copy:  # autocast's cached copies are the plan's own blocks
            terms = {k: v for k, v in terms.items() if k != WEIGHT_COPIES}
        own = split_for_parallelism({POSITION_BUCKETS: buckets}, t)
        first = _term_blocks(ctx, block, {**own, **terms})
        rest = _term_blocks(ctx, block, terms)
        kinds += [len(bodies)] + [len(bodies) + 1] * (count - 1)
        bodies += [first, rest]
    return tuple(kinds), tuple(bodies)


def saved_per_stack_block(ctx: RankContext) -> tuple[Blocks, ...] | None:
    """Per kind of :func:`dropped_per_stack_block` (encoder block 0, encoder, decoder block 0,
    decoder) the blocks full checkpointing keeps: the block's input hidden states, b s h in
    the residual dtype at its stack's length (the source's for an encoder block, the
    target's for a decoder block: modeling_t5.py ``T5Stack.forward`` passes each
    ``T5Block`` its stack's ``hidden_states``), not the mean block's; None where
    :func:`dropped_per_stack_block` is, or where a transform changes the first layer's saved
    blocks (the mean layer's then)."""
    if dropped_per_stack_block(ctx) is None:
        return None
    model, t = ctx.model, ctx.training
    _, r = compute_and_residual_bytes(t)
    out: list[Blocks] = []
    for _, block in model.layer_kinds():
        tokens = t.micro_batch_size * tokens_per_sequence(block, t)
        size = r * model.hidden_size * tokens // parallel_divisor("layer_input", t)
        out += [_term_blocks(ctx, block, {"layer_input": size})] * 2
    return tuple(out)


def dropped_per_attention_kind(ctx: RankContext) -> tuple[tuple[int, ...], tuple[Blocks, ...]]:
    """The dropped blocks of each kind of layer body and, per layer of the rank's stack, its
    kind (an index into them; () where every layer drops the same blocks, kind 0).

    Note [Layer bodies per attention kind]
        A model that mixes sliding-window and full-attention layers (``ModelSpec.
        sliding_layers``: Gemma-3's five sliding layers to one full, Gemma-2's alternation,
        Qwen2 past ``max_window_layers``) gives only its sliding layers SDPA's saved bias of
        the sliding mask (:func:`~trainmem.analytic.attention.sliding_mask_bias_bytes`);
        the mean layer spreads it over all layers (exact in the total). Under full
        checkpointing each layer's recompute makes its own terms again: a sliding layer the
        whole bias (c*b*s*s and the expanded k / v), a full layer none, so the recomputed
        blocks differ by kind and the schedule runs each layer's own body (``_layer_loop``
        over the pattern). The saved blocks stay the mean layer's: where the bias is saved
        rather than recomputed (no checkpointing) the total is exact and the order of the
        frees is all that differs. Found comparing both engines' schedules of
        tiny-gemma3-text (one sliding, one full layer) under full checkpointing at 8 x 1024
        tokens: the trace's recomputed layer 0 holds 18.9 MB of bias, layer 1 none (session
        20, helper moeorder). Pipeline stages keep the mean layer (a stage's first layer index
        is not known here).
    """
    plan = layer_plan(ctx)
    model, t = ctx.model, ctx.training
    if (
        not model.sliding_layers
        or ctx.num_layers != model.num_layers
        or all(term != SLIDING_MASK_BIAS for term, _ in plan.dropped)
    ):
        return (), (plan.dropped,)
    own = split_for_parallelism({SLIDING_MASK_BIAS: sliding_layer_mask_bias_bytes(model, t)}, t)
    bias = [
        (SLIDING_MASK_BIAS, size) for size in split(own[SLIDING_MASK_BIAS], tensor_sizes(model, t))
    ]
    full = [block for block in plan.dropped if block[0] != SLIDING_MASK_BIAS]
    at = next(n for n, (term, _) in enumerate(plan.dropped) if term == SLIDING_MASK_BIAS)
    sliding = full[:at] + bias + full[at:]
    return tuple(0 if kind else 1 for kind in model.sliding_layers), (sliding, full)


def term_blocks(ctx: RankContext, terms: dict[str, int]) -> Blocks:
    """A layer's terms (name -> bytes) as the blocks (term, bytes) they are made of, non-MLP
    terms first (:func:`split`; autocast's weight copies as :func:`weight_blocks`)."""
    return _term_blocks(ctx, ctx.model, terms)


def _term_blocks(ctx: RankContext, model: ModelSpec, terms: dict[str, int]) -> Blocks:
    """:func:`term_blocks` of a block of ``model`` (one kind of ``ctx.model``'s blocks)."""
    pieces = tensor_sizes(model, ctx.training)
    ordered = sorted(terms.items(), key=lambda kv: kv[0].startswith("mlp/"))
    copies = mlp_input_copies(ctx)
    return [
        (k, size)
        for k, v in ordered
        for size in (
            weight_blocks(ctx, v)
            if k == WEIGHT_COPIES
            else [v]
            if k.startswith(CACHED_EYE_PRODUCTS)  # one [in, out] (or [in, r]) tensor each
            else [v // copies] * copies
            if k == "mlp/input" and copies > 1 and v % copies == 0
            else dropout_blocks(ctx, v, k)
            if k in MOMENT_DROPOUT and dropout_blocks(ctx, v, k)
            else dora_down_blocks(ctx, model, v)
            if k == DORA_DOWN and dora_down_blocks(ctx, model, v)
            else split(v, pieces)
        )
        if v > 0
    ]


DOWN_DROPOUT = "lora/down_dropout"
"""peft's dropout on the down projection's adapter input: ``lora_A``'s 16-bit copy of the
dropout output and the dropout's mask (:func:`dropout_blocks`)."""


MOMENT_DROPOUT = frozenset({DOWN_DROPOUT, "lora/up_dropout", "lora/o_dropout"})
"""peft's dropout terms of the linears with a DoRA moment of their own in the layer (Note
[DoRA's moment at each linear]): each split by :func:`dropout_blocks`."""


def dropout_blocks(ctx: RankContext, size: int, term: str = DOWN_DROPOUT) -> list[int]:
    """A ``lora/<linear>_dropout`` term of :data:`MOMENT_DROPOUT` (``size`` bytes: (c + 1) t
    in) as its two tensors, ``lora_A``'s 16-bit copy of the dropout output (c t in) then the
    mask (t in), where DoRA on that linear has its moment between them (the mask made by
    ``x = dropout(x)`` before DoRA's forward, the copy by ``lora_A(x)`` after the norm: Note
    [What down's DoRA moment precedes], Note [DoRA's output combination]); [] (the term split
    as any other) otherwise."""
    t = ctx.training
    c, _ = compute_and_residual_bytes(t)
    linear = term.removeprefix("lora/").removesuffix("_dropout")
    if not (dora_moments_per_linear(ctx.model, t) and linear in t.lora_targets):
        return []
    if size % (c + 1):
        return []
    return [size // (c + 1) * c, size // (c + 1)]


DORA_DOWN = "dora/down"
"""DoRA's saved tensors of the down projection (Note [DoRA] in analytic/lora_variants.py)."""


def dora_down_blocks(ctx: RankContext, model: ModelSpec, size: int) -> list[int]:
    """The ``dora/down`` term (``size`` bytes) of a block of ``model`` as down's base output
    (``base_result``, c t h, made before down's DoRA moment) then DoRA's other saved tensors
    (``lora_result`` and the [out] vectors, made after it), where the forward's down moment
    splits them (Note [DoRA's down moment in the forward] in analytic/lora_variants.py) or the
    recompute's does (:func:`dora_down_base_recomputed_first`); []
    (the term split as any other) otherwise, or where ``size`` is not the term
    :func:`~trainmem.analytic.lora_variants.dora_terms` gives."""
    t = ctx.training
    if not (dora_down_moment_in_forward(model, t) or dora_down_base_recomputed_first(model, t)):
        return []
    if t.lora_dropout > 0:
        return []
    tokens = t.micro_batch_size * tokens_per_sequence(model, t)
    adapter_bytes = dtype_bytes(lora_adapter_dtype(t))
    terms = dora_terms(model, t, t=tokens, k_top=1, adapter_bytes=adapter_bytes)
    if terms.get(DORA_DOWN) != size:
        return []
    c, _ = compute_and_residual_bytes(t)
    base = c * tokens * adapted_linears(model)["down"][1]
    return [base, size - base]


def dora_down_base_recomputed_first(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether a non-reentrant recompute makes down's base output (``base_result``, saved by
    DoRA) before down's DoRA moment as a block of the layer (Note [DoRA's base output in the
    recompute] in analytic/lora_variants.py): DoRA on down without ``lora_dropout``, the
    output not op-level selective checkpointing's cached one (Note [The adapters' matmuls
    under op-level selective checkpointing] in analytic/op_selective.py)."""
    if not dora_recomputed_down_splits(model, training):
        return False
    if training.activation_checkpointing != "selective":
        return True
    kept = op_selective_saved_terms(model, training)
    return "mm/down" not in op_selective_cache_uses(model, training, kept)


def mlp_input_copies(ctx: RankContext) -> int:
    """The tensors the ``mlp/input`` term is kept as under Note [DoRA's moment at each
    linear]: autocast's 16-bit copy of the MLP's input that each adapted gate / up's
    ``lora_A`` saves (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``), one block each,
    up's made after up's DoRA moment (:func:`~trainmem.analytic.schedule._linear_groups`);
    1 (the term split as any other) otherwise."""
    t = ctx.training
    if not (t.uses_autocast and dora_moments_per_linear(ctx.model, t)):
        return 1
    return cast_copies(len({"gate", "up"} & set(t.lora_targets)), t)


def adapter_copy_blocks(ctx: RankContext, total: int) -> list[tuple[str, int]] | None:
    """autocast's cached 16-bit copies of one layer's adapters (``total`` bytes: the
    recompute's ``LayerPlan.weight_copy`` of a LoRA layer) per targeted linear, (linear, c r
    (in + out) n bytes) in the layer's order, or None where they do not add up to ``total``.
    Each is made inside its linear's forward (autocast's ``cached_cast`` at ``lora_A`` /
    ``lora_B``'s first matmul: for DoRA the one on ``torch.eye(in)``, before the weight norm;
    peft 0.21.2 tuners/lora/dora.py ``get_lora_weight``), so the recompute makes gate's and
    up's before up's DoRA moment (Note [DoRA's moment at each linear])."""
    t = ctx.training
    c, _ = compute_and_residual_bytes(t)
    blocks = [
        (name, c * n * t.lora_rank * (fan_in + fan_out))
        for name, (fan_in, fan_out, n) in adapted_linears(ctx.model).items()
        if name != "router" and lora_targeted(name, t.lora_targets)
    ]
    return blocks if sum(size for _, size in blocks) == total else None


def weight_blocks(ctx: RankContext, total: int) -> list[int]:
    """16-bit weight copies of one layer as the tensors they are (q, k, v, o, the MLP's
    linears per expert, the router; without q, k and v in LoRA's first layer, Note [LoRA's
    first layer] in trainmem/analytic/lora.py), or one block if their sum is not ``total``."""
    m, t = ctx.model, ctx.training
    c, _ = compute_and_residual_bytes(t)
    h, i = m.hidden_size, m.intermediate_size
    q, kv = h * m.num_heads * m.head_dim, h * m.num_kv_heads * m.head_dim
    n_mlp = (3 if m.mlp_kind == "gated" else 2) * m.num_experts
    router = [h * m.num_experts] if m.num_experts > 1 else []
    sizes = [q, kv, kv, q] + [h * i] * n_mlp + router
    for div in (1, t.tensor_parallel_size):
        for kept in (sizes, sizes[3:]):
            out = [c * n // div for n in kept]
            rest = total - sum(out)
            if rest == 0:
                return out
            if t.is_lora and 0 < rest < min(out):  # LoRA's adapters' copies, one block last
                return [*out, rest]
    return [total]


@per_configuration  # asked for the saved and the dropped blocks of one configuration
def tensor_sizes(model: ModelSpec, training: TrainingConfig) -> list[int]:
    """Sizes of the single tensors a layer's terms are made of, largest first: (t, i) and
    (t, h) activations in the compute, residual and fp32 dtypes, (b, a, s, s) scores, masks,
    for the tokens one rank holds: context parallelism splits every term by sequence
    (:func:`~trainmem.analytic.activations.parallel_divisor`), so a rank's tensors have
    ``b * s / cp`` tokens, and a tensor-parallel term's ``1 / t`` of the features or heads
    (Note [Per-rank tensor sizes])."""
    s, b = tokens_per_sequence(model, training), training.micro_batch_size
    cp, tp = training.context_parallel_size, training.tensor_parallel_size
    t = b * s // cp if (b * s) % cp == 0 else b * s
    c, r = compute_and_residual_bytes(training)
    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    i, h = model.intermediate_size * k_top, model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    sizes = {n * t for n in (4 * i, c * i, i, 4 * h, r * h, c * h, h, c * kv)}
    sizes |= {n * model.num_heads * s * s * b // cp for n in (4, c, 1)}
    if tp > 1:
        sizes |= {n * t // tp for n in (4 * i, c * i, i, 4 * h, c * h, h, c * kv)}
    return sorted((x for x in sizes if x > 0), reverse=True)


def split(term_bytes: int, sizes: list[int]) -> list[int]:
    """A term as the tensors it is made of: the largest single-tensor size that divides it,
    repeated; the term as one block if none does (e.g. LayerNorm input + statistics)."""
    for size in sizes:
        if term_bytes >= size and term_bytes % size == 0:
            if term_bytes // size > MAX_BLOCKS_PER_TERM:
                break
            return [size] * (term_bytes // size)
    return [term_bytes]


def saved_ops(
    plan: LayerPlan, phase: Phase, key: str, label: str = "saved activations"
) -> list[Op]:
    """The layer's saved blocks (key ``act/<key>/<n>``, module ``layers.{i}``)."""
    return [
        alloc(size, Cat.ACTIVATION, phase, f"act/{key}/{n}", "layers.{i}", label)
        for n, (_, size) in enumerate(plan.saved)
    ]


class ActivationOffloading(Transform):
    """torchtune's ``OffloadActivations`` on a stack of two or more layers: at
    ``layer.post_forward`` (every layer but the first) the previous layer's saved blocks are
    freed (they left for the CPU); at ``layer.pre_backward`` (every layer but the last run)
    the next layer backward needs is prefetched."""

    name = "offloading"
    layer_position = frozenset({"first", "last"})

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return ctx.training.activation_offloading and ctx.num_layers >= 2

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        if where.first_layer:
            return ()
        return [
            free(op, "forward") for op in saved_ops(layer_plan(self.ctx), "forward", "{i_prev}")
        ]

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if where.last_layer:
            return ()
        label = "saved activations prefetched from the CPU"
        return saved_ops(layer_plan(self.ctx), "backward", "{i_prev}", label)
