"""The analytic engine's mechanism transforms applied to a traced step (issues 25 and 26).

The trace engine records a plain training loop on one rank (no DeepSpeed: it cannot run on fake
tensors). This module turns that recorded :class:`~trainmem.schedule.StepSchedule` into the one a
DeepSpeed ZeRO-1/2/3 run would have, with the same rules the analytic engine uses, so both engines
answer the same question from the same definitions:

* the model states are re-sized as :mod:`trainmem.analytic.tensor_states` sizes them (Note
  [Traced model states under ZeRO]);
* the :class:`~trainmem.analytic.transforms.deepspeed.DeepSpeedZero` transform's ops (gradient
  buckets, ZeRO-1's reduce into the partition, ZeRO-2's fresh partition, the step's gradient
  copies) are spliced in at the named points located in the traced stream (Note [Points of a
  traced step]).

Note [Traced model states under ZeRO]
    The traced step has every parameter's gradient and optimizer states whole, in the dtypes of
    the loop it ran (16-bit weights, 16-bit gradients, torch's Adam moments in the weight dtype).
    DeepSpeed's ZeRO-1/2 hold them as the analytic layout does (``tensor_states._place`` and
    ``_build``; ZeRO paper Fig. 1):

    * optimizer states: each parameter's states (the traced events under the parameter's name)
      become ``ceil(flat_state_bytes(n) / N)`` bytes over N data-parallel ranks (sized as a
      share of the flat partition the optimizer steps, Note [Optimizer states of flat
      tensors]), an fp32
      master copy included (``TrainingConfig.fp32_master_copy``: ZeRO-1/2 clone this rank's
      partition in fp32, runtime/zero/stage_1_and_2.py ``single_partition_of_fp32_groups``),
      split over the traced events in proportion to their sizes. They exist from setup:
      DeepSpeed builds them when it wraps the optimizer (stage_1_and_2.py ``__init__`` ->
      ``initialize_optimizer_states``), not at the first step;
    * gradients: ``n`` elements in ``grad_dtype``; ZeRO-2 keeps ``ceil(bytes / N)`` of each
      (``grads_in_partition``). Before that, ZeRO-2 reduces each new 16-bit gradient (the
      analytic engine's ``reduce`` term, :func:`~trainmem.analytic.buffers.
      reduce_scatter_layer_bytes`: a layer's unsharded gradients, alive through the layer's
      backward): a layer's gradients as autograd makes them stay whole until its last one is
      made, then the partition is all that is left. The first micro-batch's gradients are the
      traced ``GRADIENT`` allocations; a later micro-batch's are the temporaries autograd
      makes before ``AccumulateGrad`` adds them in place (under the module of a gradient of
      that size); gradients outside the layers (embedding, final norm, head) are partitioned
      only, as the analytic engine counts them.
    * CPU offload (``offload_optimizer``: ``offload="optimizer"``, ``"optimizer+gradients"``):
      the analytic per-tensor rule (:func:`~trainmem.analytic.tensor_states.offloaded`, as
      ``tensor_states._place``): an offloaded tensor's optimizer states (fp32 master copy
      included) and, with ``optimizer+gradients``, its gradient partition are 0 bytes on the GPU
      (DeepSpeedCPUAdam steps the fp32 partition in host memory, stage_1_and_2.py
      ``cpu_offload``), and the traced step's own optimizer temporaries too; the transform
      emits no flat gradient copies and no fresh ZeRO-2 partition under offload (its own
      rules), the gradient buckets and each layer's whole gradients before their reduce stay.

Note [Traced ZeRO-3]
    DeepSpeed ZeRO-3 (runtime/zero/stage3.py, partition_parameters.py) partitions the 16-bit
    weights too: each traced weight becomes ``ceil(bytes / N)`` on this rank (0 with
    ``offload="optimizer+params"``), as ``tensor_states._place`` has it. The gradients live in
    one flat partition buffer built with the optimizer (``grad_partitions_flat_buffer``,
    :func:`~trainmem.analytic.buffers.gradient_buffer_from_init`): the traced gradients become
    0 bytes and one buffer of their partitions is allocated with the state the step starts from,
    never freed; each layer's new gradients stay whole until its last one is made (the
    analytic ``reduce`` term, as under ZeRO-2). The gathered parameters are the analytic
    :class:`~trainmem.analytic.transforms.deepspeed_gathers.DeepSpeedZero3Gathers`' (Note
    [DeepSpeed ZeRO-3 parameter gathers]), spliced at the traced modules' points (Note [Points
    of a traced step]): the embeddings' from the micro-batch's start, the layers' pool through
    the traced layers' forward and backward, the output layer's and the turnaround's kept
    layers from the last layer's forward to the first layer's backward, the embedding's again
    for its backward, each root gather's offloaded partition copied to the GPU (session 19:
    they were the pool and the larger root gather held through the whole micro-batch, which
    put a 172 MiB pool beside a tied embedding's backward and dropped an untied model's second
    root gather: 2-layer 2048-wide Llama, vocabulary 32,000, 4 ranks, accumulation 4, tied
    +2.98 -> +0.00 %, untied -4.96 -> +0.00 % against the formulas); the transform adds the
    persistent gradient bucket and the step's per-sub-group gradient copies. The plain loop is
    traced on one rank: the trace would run ``zero_stage=3`` over N ranks as FSDP2. Without a
    ModelSpec the gathered layer is the largest block of the traced block lists and the root
    every tensor outside them (untied).

Note [Points of a traced step]
    The traced step is forward / backward per micro-batch, then the optimizer and
    ``zero_grad``, its events tagged with their phase. ``step.begin`` is the first item,
    ``backward.begin`` a micro-batch's first backward item, ``stack.pre_backward`` its first
    backward item in a layer (module path ``<list>.<index>``), ``micro_batch.end`` the item
    after its last backward one; ``micro_batch.begin`` its first item, ``stack.pre_forward`` /
    ``stack.post_forward`` its first forward item in a layer and the item after its last,
    ``head.post_backward`` at ``stack.pre_backward``, ``stack.post_backward`` and
    ``embedding.pre_backward`` the item after its last backward item in a layer,
    ``embedding.post_backward`` its end (ZeRO-3's gathers); ``optimizer.begin`` and
    ``optimizer.step`` the first optimizer item (the first ``zero_grad`` item when the step
    allocates nothing, as fused Adam) and ``optimizer.end`` the first ``zero_grad`` item. Each
    micro-batch is spliced with its own :class:`~trainmem.analytic.transforms.base.Where` (the
    first makes the gradients, the others accumulate into them), and the setup holds a warm-up
    copy of the step spliced with ``first_step=True``, as the analytic schedule's.

Source: DeepSpeed runtime/zero/stage_1_and_2.py (cited per rule in
:mod:`trainmem.analytic.buffers` and :mod:`trainmem.analytic.transforms.deepspeed`);
:mod:`trainmem.analytic.tensor_states` for the sizes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.model_states import flat_state_bytes, optimizer_state_bytes
from trainmem.analytic.tensor_states import (
    TensorState,
    offloaded,
    paged_state_bytes,
    state_layout,
)
from trainmem.analytic.transforms.base import (
    Emitted,
    PipelineRank,
    RankContext,
    Transform,
    Where,
    splice,
)
from trainmem.analytic.transforms.deepspeed import DeepSpeedZero
from trainmem.analytic.transforms.deepspeed_gathers import DeepSpeedZero3Gathers
from trainmem.analytic.transforms.optimizer import Optimizer
from trainmem.analytic.transforms.points import Point
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.frameworks import parse_version
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.ranks import flat_optimizer_tensors
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

__all__ = [
    "after_state",
    "apply_deepspeed",
    "apply_optimizer",
    "deepspeed_refusals",
    "element_bytes",
    "forward_allocs_outside_layers",
    "layer_of",
    "micro_batches",
    "state_and_micro_batches",
    "older_torch_step",
    "optimizer_standin",
    "split_state",
    "traced_tensor_states",
    "untraced_deepspeed",
]

_LAYER = re.compile(r"^(.*?\.(?:\d+|\{i\}))(?:\.|$)")

FULL_LABEL = "the layer's unsharded gradients before their reduce (ZeRO-2)"


def layer_of(module: str) -> str | None:
    """The block a module path is in (``model.layers.3`` of ``model.layers.3.mlp.up_proj``,
    ``h.{i}`` in a repeated body), or None outside the block lists."""
    m = _LAYER.match(module)
    return m.group(1) if m else None


def after_state(items: tuple[Item, ...], op: Op) -> tuple[Item, ...]:
    """``items`` with ``op`` after their leading run of ``init`` ops (the state the step starts
    from: weights, buffers), where a framework's buffers allocated at wrap time go."""
    n = 0
    while n < len(items) and isinstance(items[n], Op) and items[n].phase == "init":  # type: ignore[union-attr]
        n += 1
    return (*items[:n], op, *items[n:])


def deepspeed_refusals(training: TrainingConfig) -> list[str]:
    """What of a DeepSpeed run :func:`apply_deepspeed` does not model, as ``field=value`` (empty:
    it does): ZeRO-1/2/3 with the ZeRO optimizer wrapper, or ZeRO-1's ``BF16_Optimizer`` where
    it frees its bf16 gradients after the step and adds them into its fp32 buffer after the
    backward (0.17.1 on: Note [BF16_Optimizer's two gradients]), any optimizer (its states sized
    as the formulas size a flat partition's, Note [Optimizer states of flat tensors])."""
    out = []
    wrapper = training.deepspeed_optimizer
    if training.zero_stage not in (1, 2, 3):
        out.append(f"zero_stage={training.zero_stage} with framework=deepspeed")
    elif wrapper == "bf16" and training.bf16_optimizer_grads_released != "step":
        # the traced plain loop frees its gradients after the step (zero_grad), as
        # BF16_Optimizer's zero_grad does from 0.16.5 (Note [BF16_Optimizer's two gradients])
        out.append(
            f"deepspeed_version={training.deepspeed_version} with DeepSpeed's bf16 "
            "optimizer wrapper"
        )
    elif wrapper == "bf16" and training.bf16_optimizer_immediate_grad_update:
        # its per-parameter copies are made at the layer points, which a trace has not
        out.append(
            f"deepspeed_version={training.deepspeed_version} with DeepSpeed's bf16 optimizer "
            "wrapper (bf16.immediate_grad_update on by default)"
        )
    elif wrapper not in ("zero", "bf16"):
        out.append(f"DeepSpeed's {wrapper} optimizer wrapper")
    return out


def untraced_deepspeed(training: TrainingConfig) -> str:
    """One refusal for a DeepSpeed run the traced paths do not model, saying what they model
    (ZeRO-1/2/3 with the ZeRO optimizer wrapper, any optimizer, without
    tensor, pipeline or context parallelism) and what else estimates it."""
    why = deepspeed_refusals(training) or [
        f"{name}={getattr(training, name)} with framework=deepspeed"
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
        if getattr(training, name) > 1
    ]
    return (
        ", ".join(why or ["framework=deepspeed"])
        + " (traced: DeepSpeed ZeRO-1/2/3 with its ZeRO optimizer, ZeRO-1's BF16_Optimizer from "
        "0.17.1, without tensor, pipeline or "
        "context parallelism; or --engine analytic)"
    )


def apply_deepspeed(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced plain-loop step ``schedule`` (one rank, no data parallelism, no offload) as a
    DeepSpeed ZeRO-1/2 run of ``training`` (with its CPU offload) has it (Notes [Traced model
    states under ZeRO] and [Points of a traced step]).

    Args:
        schedule: a traced step (``StepSchedule.from_timeline``, or the generic path's composed
            one, with or without its lazy-state warm-up).
        model: the model's shape (the DeepSpeed transform reads ``hidden_size`` for
            ``reduce_bucket_size="auto"`` and its trainable elements from the analytic layout),
            or None for a model without one (Note [DeepSpeed without a ModelSpec]).
        training: the DeepSpeed run (``framework="deepspeed"``, ``zero_stage`` 1, 2 or 3).

    Returns:
        The schedule with the states re-sized and the transform's ops spliced in.

    Raises:
        ScheduleError: a setting :func:`deepspeed_refusals` names, ``reduce_bucket_size``
            ``"auto"`` without a ModelSpec, or a step without a backward or optimizer to place
            the ops at.
    """
    refused = deepspeed_refusals(training)
    if refused:
        raise ScheduleError("no traced DeepSpeed transform for " + ", ".join(refused))
    init, body = split_state(schedule)
    sizes = _Sizes.of(init, training)
    ctx = _deepspeed_context(schedule, model, training)
    transform = DeepSpeedZero(ctx)
    segments, tail = micro_batches(body)
    reduces = training.zero_stage >= 2
    new_grads = _GradientSizes.of(segments[0]) if reduces else None
    transforms: list[Transform] = [transform]
    if training.zero_stage == 3:  # Note [Traced ZeRO-3]: its gathers at the traced modules
        transforms.append(_zero3_gathers(schedule, ctx))
    rewritten = [_rewrite(seg, sizes, new_grads, first=k == 0) for k, seg in enumerate(segments)]
    tail = _rewrite(tail, sizes, None, first=False)
    # Note [The step of DeepSpeed's flat partition]
    #     DeepSpeed's client optimizer steps this rank's flat fp32 partition (Note [Optimizer
    #     states of flat tensors] in analytic/model_states.py), not the traced plain loop's
    #     16-bit parameters: the traced step's temporaries (a foreach list over every whole
    #     parameter) are dropped, and the analytic optimizer's for the partition spliced in
    #     (:class:`_PartitionStep`, the formulas' ``Optimizer.optimizer_step``).
    tail, _ = _take(tail, _is_step_temporary, "optimizer")
    step_ops = _PartitionStep(ctx)
    frees: list[Item] = []
    if transform.frees_gradients_at_step:  # ZeRO-1: the traced gradients are freed at the step
        tail, frees = _take(tail, _is_gradient_free, "optimizer")

    def step(first: bool) -> list[Item]:
        out: list[Item] = []
        for k, seg in enumerate(rewritten):
            where = Where(first_step=first, new_grads=k == 0)
            out += splice(seg, _segment_points(seg, first=k == 0), transforms, where)
        points = _tail_points(tail)
        optimizer = splice(tail, points, [transform, step_ops], Where(first_step=first))
        return out + (_own_gradient_frees(optimizer, frees) if frees else optimizer)

    states = _rewrite(init, sizes, None, first=False)
    if sizes.from_init:  # ZeRO-3's flat gradient partition, from when the optimizer is built
        states.append(_partition_buffer(segments[0], sizes))
    steady = step(first=False)
    warm = step(first=True)
    candidate = StepSchedule(setup=(*states, *warm), step=tuple(steady), name=schedule.name)
    if _balanced(steady):
        return candidate
    return StepSchedule(setup=tuple(states), step=tuple(steady), name=schedule.name)


def _deepspeed_context(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> RankContext:
    """The rank the DeepSpeed transform reads: from the analytic layout of ``model``, or, for a
    model without a ModelSpec, from the traced step.

    Note [DeepSpeed without a ModelSpec]
        What :class:`~trainmem.analytic.transforms.deepspeed.DeepSpeedZero` reads of a ZeRO-1/2
        rank is its trainable elements (the step's flat gradient copies, ZeRO-1's partition,
        ZeRO-2's fresh partition: :func:`~trainmem.analytic.buffers.
        deepspeed_partition_elements` of them) and, only for ``reduce_bucket_size="auto"``, the
        hidden size (the HF Trainer's h^2 fill-in). A traced step has every trainable
        parameter's gradient in the weight dtype (DeepSpeed casts the whole module, LoRA's
        adapters too), so the most gradient bytes it holds divided by that dtype's size is the
        trainable elements, one aggregate tensor state; the model states are re-sized from the
        traced tensors as with a ModelSpec (Note [Traced model states under ZeRO]). ``"auto"``
        is refused without a ModelSpec (accelerate refuses it too for a model whose config has
        no ``hidden_size``: utils/deepspeed.py ``deepspeed_config_process``).
    """
    if model is not None:
        rank = PipelineRank(0, model.num_layers, 1, True, True)
        return RankContext.build(model, training, rank, state_layout(model, training))
    if training.reduce_bucket_size == "auto":
        raise ScheduleError(
            'reduce_bucket_size="auto" is hidden_size^2, and this model has no ModelSpec to give '
            "its hidden size; set reduce_bucket_size to a number of elements"
        )
    n = schedule.category_peak(Cat.GRADIENT) // max(dtype_bytes(training.weight_dtype), 1)
    grad = dtype_bytes(training.grad_dtype) * n
    whole = TensorState("embedding", "traced", n, True, 0, 0, 0, 0, grad, 0, n)
    return _traced_context([whole], training)


def _zero3_gathers(schedule: StepSchedule, ctx: RankContext) -> DeepSpeedZero3Gathers:
    """ZeRO-3's gathered parameters (Note [Traced ZeRO-3]) as the analytic transform places
    them, sized from the rank's layout or, without a ModelSpec, from the traced tensors (the
    layer the largest block of a block list, untied)."""
    if ctx.model is None:
        ctx = _traced_layers_context(traced_tensor_states(schedule, ctx.training), ctx.training)
    return DeepSpeedZero3Gathers(ctx)


def _traced_layers_context(states: list[TensorState], training: TrainingConfig) -> RankContext:
    """The traced tensors as a rank of identical layers for ZeRO-3's gathers: the tensors
    outside the block lists the root (embedding-side), the largest block the layer, as many
    layers as blocks (a repeated body's block counted once per repeat; before, its repeats
    were one layer of all of them, so the prefetch pool, capped at
    ``stage3_max_live_parameters`` but never below one layer, held every repeated layer)."""
    blocks: dict[str, list[TensorState]] = {}
    outer: list[TensorState] = []
    for state in states:
        block = layer_of(state.owner)
        if block is None:
            outer.append(state)
        else:
            blocks.setdefault(block, []).append(state)
    # a repeated body's block (``model.layers.{i}``) holds each of its tensors once per
    # repeat (:func:`traced_tensor_states`): one layer's tensors, that many layers
    layers: list[list[TensorState]] = []
    num_layers = 0
    for members in blocks.values():
        repeats = Counter(s.owner for s in members)
        firsts = {s.owner: s for s in reversed(members)}
        layers.append([firsts[owner] for owner in repeats])
        num_layers += max(repeats.values())
    layer = max(layers, key=lambda b: sum(s.full_param_bytes for s in b), default=[])
    ctx = _traced_context(outer, training)
    return replace(ctx, layer_states=layer, num_layers=num_layers, memo={})


def _partition_buffer(segment: Sequence[Item], sizes: _Sizes) -> Op:
    """ZeRO-3's flat gradient partition (stage3.py ``grad_partitions_flat_buffer``): every
    gradient the first micro-batch makes, this rank's partition of it, in one buffer."""
    size = sum(
        count * sizes.partition(op.size_bytes)
        for op, count in _counted(segment)
        if op.action == "alloc" and op.category is Cat.GRADIENT
    )
    label = "this rank's gradient partition (ZeRO-3 grad_partitions_flat_buffer)"
    return Op("alloc", size, Cat.GRADIENT, "init", "grad/partition3", "(optimizer)", label)


def older_torch_step(training: TrainingConfig) -> bool:
    """The optimizer step of the ``torch_version`` asked for holds other temporaries than the
    installed torch's, which the trace runs (``OptimizerRow.older_torch``: foreach Adam /
    AdamW before 2.1, two parameter-sized lists; :meth:`~trainmem.specs.optimizers.
    OptimizerRow.older_step`)."""
    return OPTIMIZER_TABLE[training.optimizer].older_step(
        training.step_implementation, parse_version("torch_version", training.torch_version)
    )


def optimizer_standin(training: TrainingConfig) -> TrainingConfig | None:
    """The settings the trace runs in place of an optimizer it cannot run on fake tensors
    (bitsandbytes' and torchao's kernels, ``OptimizerRow.untraceable``) or whose step on the
    ``torch_version`` asked for differs from the installed torch's (:func:`older_torch_step`;
    not under DeepSpeed, whose traced step's temporaries :func:`apply_deepspeed` replaces
    anyway): torch's fused AdamW, which allocates nothing at the step (its states are then
    replaced, and the step's temporaries are the optimizer transform's for the release, Note
    [Traced optimizer states]; a paged optimizer's large states leave the allocator as the
    layout's ``paged_state_bytes``); None when the optimizer runs as it is."""
    row = OPTIMIZER_TABLE[training.optimizer]
    older = older_torch_step(training) and not training.conventions.deepspeed_optimizer_wrappers
    if not row.untraceable and not older:
        return None
    return replace(training, optimizer="adamw", optimizer_implementation="fused")


def apply_optimizer(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The step traced with :func:`optimizer_standin`'s optimizer as ``training``'s optimizer
    has it (Note [Traced optimizer states]).

    Note [Traced optimizer states]
        The stand-in's states (and the step counters beside them) are dropped and the
        analytic :class:`~trainmem.analytic.transforms.optimizer.Optimizer` transform's are
        spliced in: every state as the optimizer table sizes it
        (:mod:`trainmem.specs.optimizers`: 8-bit codes and one fp32 scale per block for the
        quantized tensors, 32-bit states for the small ones), allocated by the warm-up step's
        ``optimizer.begin`` as torch-style optimizers do (lazily at the first step), and the
        step's temporaries at ``optimizer.step`` (the row's per implementation). The fused
        stand-in allocates nothing of its own at the step, so nothing else moves. A torch
        optimizer whose step on the ``torch_version`` asked for differs from the installed
        torch's (:func:`older_torch_step`: foreach Adam / AdamW before 2.1) takes the same
        path: its states as the table sizes them (torch's), its temporaries the release's.

    Args:
        schedule: the traced step (stand-in optimizer).
        model: the model's shape (the transform's states come from the analytic layout), or
            None for a model without one (the traced tensors', Note [Traced tensors as model
            states]).
        training: the run as asked (its optimizer).

    Returns:
        The schedule with the optimizer's states and temporaries.

    Raises:
        ScheduleError: a step without a backward and an optimizer step.
    """
    init, body = split_state(schedule)
    init, _ = _take(init, _is_state, "init")
    segments, tail = micro_batches(body)
    tail, _ = _take(tail, _is_state, "optimizer")
    if model is None:
        ctx = _traced_context(traced_tensor_states(schedule, training), training)
    else:
        rank = PipelineRank(0, model.num_layers, 1, True, True)
        ctx = RankContext.build(model, training, rank, state_layout(model, training))
    transform = Optimizer(ctx)
    head = [item for seg in segments for item in seg]

    def step(first: bool) -> list[Item]:
        return head + splice(tail, _tail_points(tail), [transform], Where(first_step=first))

    steady = step(first=False)
    if _balanced(steady):
        return StepSchedule(
            setup=(*init, *step(first=True)), step=tuple(steady), name=schedule.name
        )
    states = transform.optimizer_begin(Where(first_step=True))
    setup = (*init, *(x for x in states if isinstance(x, Op | Repeat)))
    return StepSchedule(setup=setup, step=tuple(steady), name=schedule.name)


def _is_state(op: Op) -> bool:
    return op.category is Cat.OPTIMIZER_STATE


def element_bytes(training: TrainingConfig, module: str) -> int:
    """Bytes per element of a traced weight (LoRA adapters and peft's prompt encoder in their
    own dtype: Note [Prompt encoder tensors] in analytic/prompt_encoder.py)."""
    adapter = "lora_" in module or "prompt_encoder." in module
    dtype = lora_adapter_dtype(training) if adapter else training.weight_dtype
    return max(dtype_bytes(dtype), 1)


def traced_tensor_states(schedule: StepSchedule, training: TrainingConfig) -> list[TensorState]:
    """Every parameter the traced step starts from, as the analytic layout's
    :class:`~trainmem.analytic.tensor_states.TensorState` (one per tensor; a repeated body's
    tensors once per repeat), for a model without a ModelSpec.

    Note [Traced tensors as model states]
        A traced parameter's allocation (category ``PARAMETER``, named by the parameter) gives
        its elements (its bytes over :func:`element_bytes`); it is trainable when the traced
        step holds optimizer states under its name (the stand-in optimizer makes states for
        every trainable parameter, and for nothing else). Its states are sized as the analytic
        layout sizes a tensor (``tensor_states._build``: ``optimizer_state_bytes`` of one
        tensor of that many elements), with one difference: the traced tensor's shape is not
        recorded, so every tensor is taken as a matrix, whose block-wise states (8-bit / 4-bit
        optimizers) follow the optimizer's own element-count rule (bitsandbytes keeps 32-bit
        states under ``min_8bit_size`` = 4096 elements, bitsandbytes/optim/optimizer.py
        ``Optimizer2State.init_state``), where the layout keeps every 1-D tensor's full. A
        paged optimizer's states of tensors of at least 1e5 elements leave the allocator
        (:func:`~trainmem.analytic.tensor_states.paged_state_bytes`), as in the layout. States
        partitioned over the sharding ranks (``TrainingConfig.optimizer_states_partitioned``:
        ZeRO >= 1, Megatron's distributed optimizer) are this rank's ``ceil(bytes / N)``, as
        ``tensor_states._place`` has them.

    Args:
        schedule: a traced step (its setup, or its leading ``init`` items, hold the weights).
        training: the run (dtypes, optimizer).

    Returns:
        The tensors, in the order the trace allocated them (owner: the parameter's name).
    """
    init, _ = split_state(schedule)
    named: set[str] = {op.module for op in _ops(init) if op.category is Cat.OPTIMIZER_STATE}
    row = OPTIMIZER_TABLE[training.optimizer]
    dp = training.sharding_degree if training.optimizer_states_partitioned else 1
    out: list[TensorState] = []
    for op, count in _counted(init):
        if op.action != "alloc" or op.category is not Cat.PARAMETER:
            continue
        n = op.size_bytes // element_bytes(training, op.module)
        trainable = op.module in named
        grad = dtype_bytes(training.grad_dtype) * n if trainable else 0
        state = -(-_state_bytes(training, n) // dp) if trainable else 0
        paged = min(paged_state_bytes(training, n, dp), state) if trainable and row.paged else 0
        state -= paged
        tensor = TensorState(
            op.module, "traced", n, trainable, op.size_bytes, grad, state,
            op.size_bytes, grad, paged, n,
        )  # fmt: skip
        out += [tensor] * count
    return out


def _state_bytes(training: TrainingConfig, n: int) -> int:
    """Optimizer states of a traced trainable tensor of ``n`` elements (Note [Traced tensors
    as model states]): a share of a flat tensor's under FSDP1 / DeepSpeed (Note [Optimizer
    states of flat tensors]), else a matrix's."""
    if flat_optimizer_tensors(training):
        return flat_state_bytes(training, n)
    return optimizer_state_bytes(training, [(1, n, 1)], 0)


def _counted(items: Sequence[Item], count: int = 1) -> list[tuple[Op, int]]:
    """Every op of ``items`` with how many times it runs (a repeated body's ``count`` times)."""
    out: list[tuple[Op, int]] = []
    for item in items:
        if isinstance(item, Op):
            out.append((item, count))
        else:
            out += _counted(item.body, count * item.count)
    return out


def _traced_context(states: list[TensorState], training: TrainingConfig) -> RankContext:
    """The rank the analytic transforms read, for a model without a ModelSpec: every traced
    tensor an outer one (no layer list; Note [Traced tensors as model states]); its ``model``
    is None, read by no transform applied to it (DeepSpeed's reads it only for
    ``reduce_bucket_size="auto"``, refused without a ModelSpec: Note [DeepSpeed without a
    ModelSpec])."""
    return RankContext(
        model=None,  # type: ignore[arg-type]  # see the docstring
        training=training,
        rank=PipelineRank(0, 0, 1, True, True),
        emb_states=states,
        head_states=[],
        layer_states=[],
        head_grad_states=[],
        emb_grad_states=states,
        num_layers=0,
        zero_stage=training.zero_stage if training.sharding_degree > 1 else 0,
        grad_stream=0,
    )


# -- the recorded step's parts ---------------------------------------------------------------


def _phases(item: Item) -> set[str]:
    if isinstance(item, Op):
        return {item.phase}
    return set().union(*(_phases(x) for x in item.body))


def split_state(schedule: StepSchedule) -> tuple[list[Item], list[Item]]:
    """(the state the step starts from: weights, buffers, optimizer states; the step's
    items), whether or not the schedule already has a lazy-state warm-up
    (``StepSchedule.with_lazy_optimizer_states``: its setup is the state without the optimizer
    states, then the step with them inserted, as ``init`` items)."""
    if schedule.setup:
        init = [x for x in schedule.setup if _phases(x) == {"init"}]
        return init, list(schedule.step)
    items = list(schedule.step)
    n = 0
    while n < len(items) and _phases(items[n]) == {"init"}:
        n += 1
    return items[:n], items[n:]


def forward_allocs_outside_layers(
    segment: Sequence[Item], size: int, *, named: bool = False
) -> list[int]:
    """Indices of ``segment``'s forward allocations of ``size`` bytes by a module outside the
    block lists (the head's logits and the loss's copies of them); ``named``: by a module with
    a name only."""
    return [
        k
        for k, x in enumerate(segment)
        if isinstance(x, Op)
        and x.phase == "forward"
        and x.action == "alloc"
        and x.size_bytes == size
        and (x.module or not named)
        and layer_of(x.module) is None
    ]


def state_and_micro_batches(
    items: Sequence[Item],
) -> tuple[list[Item], list[list[Item]], list[Item]] | None:
    """``items`` (a state, then a step, either may be empty) as (the leading ``init`` ops, the
    micro-batches, the rest: :func:`micro_batches`), or None for a state without a step."""
    n = 0
    while n < len(items) and isinstance(items[n], Op) and items[n].phase == "init":  # type: ignore[union-attr]
        n += 1
    try:
        segments, tail = micro_batches(list(items[n:]))
    except ScheduleError:  # a state without a warm-up step
        return None
    return list(items[:n]), segments, tail


def micro_batches(body: list[Item]) -> tuple[list[list[Item]], list[Item]]:
    """The micro-batches (forward then backward) and the rest (optimizer, ``zero_grad``); no
    rest when the step allocates and frees nothing after its last backward (a fused step
    with ``zero_grad_set_to_none=False``: the gradients kept, nothing freed).

    Raises:
        ScheduleError: no backward.
    """
    segments: list[list[Item]] = []
    current: list[Item] = []
    seen_backward = False
    for k, item in enumerate(body):
        phases = _phases(item)
        if phases & {"optimizer", "zero_grad"} and seen_backward:
            segments.append(current)
            return segments, body[k:]
        if seen_backward and "forward" in phases and "backward" not in phases:
            segments.append(current)
            current, seen_backward = [], False
        current.append(item)
        seen_backward = seen_backward or "backward" in phases
    if seen_backward:
        return [*segments, current], []
    raise ScheduleError("the traced step has no backward")


def _first(items: Sequence[Item], test: Callable[[Item], bool], default: int) -> int:
    return next((k for k, x in enumerate(items) if test(x)), default)


def _in_layer_backward(item: Item) -> bool:
    if isinstance(item, Repeat):
        return "backward" in _phases(item)
    return item.phase == "backward" and layer_of(item.module) is not None


def _in_layer_forward(item: Item) -> bool:
    if isinstance(item, Repeat):
        return "forward" in _phases(item)
    return item.phase == "forward" and layer_of(item.module) is not None


def _segment_points(items: list[Item], *, first: bool) -> dict[Point, int]:
    """Note [Points of a traced step]: a micro-batch's points."""
    backward = _first(items, lambda x: "backward" in _phases(x), len(items))
    layers = _first(items[backward:], _in_layer_backward, len(items) - backward)
    n = len(items)
    after = n - _first(items[::-1], _in_layer_backward, n)
    points: dict[Point, int] = {
        "micro_batch.begin": 0,
        "backward.begin": backward,
        "head.post_backward": backward + layers,
        "stack.pre_backward": backward + layers,
        "stack.post_backward": max(after, backward + layers),
        "embedding.pre_backward": max(after, backward + layers),
        "embedding.post_backward": n,
        "root.post_backward": n,
        "micro_batch.end": n,
    }
    start = _first(items[:backward], _in_layer_forward, backward)
    if start < backward:  # the forward through the layers
        points["stack.pre_forward"] = start
        points["stack.post_forward"] = backward - _first(
            items[backward - 1 :: -1], _in_layer_forward, backward
        )
    if first:
        points["step.begin"] = 0
    return points


def _tail_points(items: list[Item]) -> dict[Point, int]:
    """Note [Points of a traced step]: the optimizer's points."""
    zero_grad = _first(items, lambda x: "zero_grad" in _phases(x), len(items))
    begin = _first(items, lambda x: "optimizer" in _phases(x), zero_grad)
    begin = min(begin, zero_grad)
    return {"optimizer.begin": begin, "optimizer.step": begin, "optimizer.end": zero_grad}


def _balanced(items: Sequence[Item]) -> bool:
    """The step frees what it allocates and nothing else (so a warm-up copy of it can run
    first)."""
    try:
        events = list(StepSchedule(setup=(), step=tuple(items)).events())
    except ScheduleError:
        return False
    return sum(e.size_bytes if e.action == "alloc" else -e.size_bytes for e in events) == 0


def _is_step_temporary(op: Op) -> bool:
    return op.category is Cat.TEMPORARY and op.phase == "optimizer"


class _PartitionStep(Optimizer):
    """The analytic optimizer's step temporaries alone (Note [The step of DeepSpeed's flat
    partition]); the states are the DeepSpeed rewrite's (:class:`_Sizes`)."""

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        return ()


def _is_gradient_free(op: Op) -> bool:
    return op.action == "free" and op.category is Cat.GRADIENT


def _take(
    items: Sequence[Item], test: Callable[[Op], bool], phase: Phase
) -> tuple[list[Item], list[Item]]:
    """(``items`` without the ops ``test`` picks, those ops moved to ``phase``), repeated
    bodies kept as repeats on both sides."""
    kept: list[Item] = []
    taken: list[Item] = []
    for item in items:
        if isinstance(item, Op):
            if test(item):
                taken.append(item._replace(phase=phase))
            else:
                kept.append(item)
            continue
        rest, picked = _take(item.body, test, phase)
        again = (item.count, item.reverse, item.start, item.independent)
        if rest:
            kept.append(Repeat(tuple(rest), *again))
        if picked:
            taken.append(Repeat(tuple(picked), *again))
    return kept, taken


def _own_gradient_frees(items: list[Item], frees: list[Item]) -> list[Item]:
    """``items`` (the spliced optimizer step) with the traced step's own gradient frees in
    place of the analytic ones the transform emits (ZeRO-1 frees the gradients into its
    partition at the step, under the analytic schedule's keys ``grad/<head|{i}|embedding>/<n>``,
    which a traced step does not have)."""
    out: list[Item] = []
    placed = False
    for item in items:
        if _is_analytic_gradient_free(item):
            if not placed:
                out += frees
                placed = True
            continue
        out.append(item)
    return out


def _is_analytic_gradient_free(item: Item) -> bool:
    if isinstance(item, Repeat):
        return bool(item.body) and all(_is_analytic_gradient_free(x) for x in item.body)
    return _is_gradient_free(item) and item.key.startswith("grad/")


# -- the model states ------------------------------------------------------------------------


@dataclass(slots=True)
class _Sizes:
    """Per-key sizes of the re-sized model states (Note [Traced model states under ZeRO])."""

    training: TrainingConfig
    weight_bytes: int
    states: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, init: Sequence[Item], training: TrainingConfig) -> _Sizes:
        """The optimizer states' new sizes, from the weights' elements (a parameter's states
        carry its name)."""
        out = cls(training, max(dtype_bytes(training.weight_dtype), 1))
        numel: dict[str, int] = {}
        states: dict[str, list[Op]] = {}
        for op in _ops(init):
            if op.action != "alloc":
                continue
            if op.category is Cat.PARAMETER:
                numel[op.module] = op.size_bytes // out.weight_bytes
            elif op.category is Cat.OPTIMIZER_STATE:
                states.setdefault(op.module, []).append(op)
        dp = training.sharding_degree if training.optimizer_states_partitioned else 1
        for name, ops in states.items():
            n = numel.get(name, 0)
            total = -(-flat_state_bytes(training, n) // dp)
            if offloaded(training, n).state:  # on the CPU beside DeepSpeedCPUAdam
                total = 0
            elif OPTIMIZER_TABLE[training.optimizer].paged:  # managed memory, as the layout
                total -= min(paged_state_bytes(training, n, dp), total)
            traced = sum(op.size_bytes for op in ops)
            shares = [total * op.size_bytes // max(traced, 1) for op in ops]
            shares[0] += total - sum(shares)
            out.states.update({op.key: s for op, s in zip(ops, shares, strict=True)})
        return out

    def whole(self, size: int) -> int:
        """Bytes of a traced gradient of ``size`` bytes (weight dtype) in ``grad_dtype``."""
        return dtype_bytes(self.training.grad_dtype) * (size // self.weight_bytes)

    @property
    def from_init(self) -> bool:
        """The gradients live in one partition buffer from init (ZeRO-3), not per tensor."""
        return self.training.zero_stage == 3

    def partition(self, size: int) -> int:
        """This rank's bytes of a traced gradient of ``size`` bytes in the weight dtype (0 when
        offloaded: each leaves once its layer is reduced)."""
        t = self.training
        if offloaded(t, size // self.weight_bytes).grad:
            return 0
        full = self.whole(size)
        return -(-full // t.sharding_degree) if t.zero_stage >= 2 else full

    def gradient(self, size: int) -> int:
        """A traced gradient's bytes: its partition, or 0 under ZeRO-3 (in the buffer)."""
        return 0 if self.from_init else self.partition(size)

    def parameter(self, size: int) -> int:
        """A traced weight's bytes: ZeRO-3's partition (0 when offloaded)."""
        t = self.training
        if t.zero_stage < 3:
            return size
        if offloaded(t, size // self.weight_bytes).param:
            return 0
        return -(-size // t.sharding_degree)


def _ops(items: Sequence[Item]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


@dataclass(slots=True)
class _GradientSizes:
    """The first micro-batch's gradient sizes per module: a later micro-batch's new gradients
    are the temporaries of those sizes its backward makes under that module."""

    by_module: dict[str, list[int]]

    @classmethod
    def of(cls, items: Sequence[Item]) -> _GradientSizes:
        out: dict[str, list[int]] = {}
        for op in _ops(items):
            if op.action == "alloc" and op.category is Cat.GRADIENT:
                out.setdefault(op.module, []).append(op.size_bytes)
        return cls(out)


def _rewrite(
    items: Sequence[Item], sizes: _Sizes, new_grads: _GradientSizes | None, *, first: bool
) -> list[Item]:
    """``items`` with the model states re-sized; with ``new_grads`` (ZeRO-2) each layer's
    gradients whole from its first new gradient to its last (Note [Traced model states under
    ZeRO])."""
    runs = _layer_runs(items, new_grads, first=first)
    starts = {run[0]: run for run in runs}
    ends = {run[-1]: run for run in runs}
    members = {k for run in runs for k in run} if first else set()
    later = {k for run in runs for k in run} if not first else set()
    zeroed: set[str] = set()
    out: list[Item] = []
    blocks: dict[int, Op] = {}
    for k, item in enumerate(items):
        if isinstance(item, Repeat):
            body = _rewrite(item.body, sizes, new_grads, first=first)
            out.append(Repeat(tuple(body), item.count, item.reverse, item.start, item.independent))
            continue
        if k in starts:
            run = starts[k]
            size = sum(sizes.whole(_size(items[j])) for j in run)
            block = item._replace(
                size_bytes=size, category=Cat.TEMPORARY, key=f"{item.key}/whole", label=FULL_LABEL
            )
            blocks[id(run)] = block
            if first:  # its first partition, then the layer's whole gradients (the analytic
                # order: each partition where its gradient is made, Note [Gradients where
                # their linear's backward runs] in analytic/schedule.py)
                out.append(_resized(_op(item), sizes))
            out.append(block)
        if k in members:
            if k not in starts:
                out.append(_resized(_op(item), sizes))
        elif k in later:  # a later micro-batch's new gradient: inside the layer's whole block
            zeroed.add(item.key)
            out.append(item._replace(size_bytes=0))
        elif item.action == "free" and item.key in zeroed:
            out.append(item._replace(size_bytes=0))
        else:
            out.append(_resized(item, sizes))
        if k in ends:  # the layer's gradients are all made: reduced, the partition is left
            out.append(blocks.pop(id(ends[k]))._replace(action="free"))
    return out


def _op(item: Item) -> Op:
    assert isinstance(item, Op)
    return item


def _size(item: Item) -> int:
    return _op(item).size_bytes


def _layer_runs(
    items: Sequence[Item], new_grads: _GradientSizes | None, *, first: bool
) -> list[list[int]]:
    """Indices in ``items`` of each layer's new gradients, one list per run of one layer
    (gradients outside the layers are partitioned only, as the analytic engine has them)."""
    if new_grads is None:
        return []
    pending = {} if first else dict(new_grads.by_module)
    runs: list[list[int]] = []
    current: str | None = None
    for k, item in enumerate(items):
        if not isinstance(item, Op) or not _new_gradient(item, first, pending):
            continue
        layer = layer_of(item.module)
        if layer is not None and layer == current:
            runs[-1].append(k)
        elif layer is not None:
            runs.append([k])
        current = layer
    return runs


def _new_gradient(op: Op, first: bool, pending: dict[str, list[int]]) -> bool:
    """``op`` is a gradient autograd makes in the backward: the first micro-batch's gradient
    allocations, a later one's temporaries of a gradient's size under its module (made before
    ``AccumulateGrad`` adds them in place)."""
    if op.action != "alloc" or op.phase != "backward":
        return False
    if first:
        return op.category is Cat.GRADIENT
    expected = pending.get(op.module)
    if op.category is Cat.TEMPORARY and expected and op.size_bytes == expected[0]:
        pending[op.module] = expected[1:]
        return True
    return False


def _resized(op: Op, sizes: _Sizes) -> Op:
    if op.category is Cat.GRADIENT:
        return op._replace(size_bytes=sizes.gradient(op.size_bytes))
    if op.category is Cat.OPTIMIZER_STATE and op.key in sizes.states:
        return op._replace(size_bytes=sizes.states[op.key])
    if op.category is Cat.PARAMETER:
        return op._replace(size_bytes=sizes.parameter(op.size_bytes))
    offload = sizes.training.offload != "none"
    if offload and op.category is Cat.TEMPORARY and op.phase == "optimizer":
        return op._replace(size_bytes=0)  # the traced step's own: the step runs on the CPU
    return op
