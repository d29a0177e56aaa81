"""DeepSpeed's flat model-state buffers, made when ``deepspeed.initialize`` builds the ZeRO
optimizer, in its order, where the base order has one block per tensor (issue 24).

Note [DeepSpeed's flat buffers at init]
    The ZeRO optimizer wrapper moves this rank's trainable model states into flat tensors when
    it is built, before the first step, one parameter group assumed (as
    :func:`~trainmem.analytic.buffers.deepspeed_step_gradient_copies`), nothing offloaded:

    * ZeRO-3 (runtime/zero/stage3.py ``DeepSpeedZeroOptimizer_Stage3.__init__``, the same
      order at v0.8.0, v0.12.3, v0.16.4 and v0.19.5):
      ``_create_fp16_partitions_with_defragmentation`` -> ``defragment``: every trainable
      parameter's partition (:func:`zero3_partitions`)
      copied to one CPU buffer, its own block freed, ``empty_cache()``, then
      ``cpu_buffer.to(device)``: one flat 16-bit block of every trainable partition, no
      padding (frozen parameters keep their own); ``_setup_for_real_optimizer`` ->
      ``_create_fp32_partitions``: per optimizer sub-group
      (:func:`~trainmem.analytic.buffers.deepspeed_zero3_sub_groups`)
      ``self.fp16_partitioned_groups_flat[i].to(self.device).clone().float().detach()``, a
      16-bit clone freed once ``.float()`` has made the fp32 partition (kept; none from 0.18.2
      for fp32 weights, ``TrainingConfig.fp32_master_copy``); ``initialize_optimizer_states``:
      ``gradient_buffer = torch.zeros(largest_numel, fp32)``, narrowed as each sub-group's
      ``.grad``, and up to 0.13.1 ``_optimizer_step(i)`` per sub-group, whose client optimizer
      makes that sub-group's states (FusedAdam's ``exp_avg`` / ``exp_avg_sq``,
      ``zeros_like`` of the fp32 partition), the buffer freed when the function returns
      (``group.grad = None``); then the IPG bucket (``torch.empty(reduce_bucket_size,
      dtype=self.dtype)`` with ``contiguous_gradients``, on by default:
      :func:`~trainmem.analytic.buffers.deepspeed_persistent_bucket_bytes`) and
      ``grad_partitions_flat_buffer = torch.zeros(sum(p.partition_numel() ...),
      dtype=self.gradient_accumulation_dtype)``, every gradient partition in one block, kept.
    * ZeRO-1/2 (runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``): per
      parameter group, up to 0.18.9 ``move_to_cpu`` of its trainable parameters and
      ``empty_cache()``, then ``flatten_dense_tensors_aligned(..., nccl_start_alignment_factor
      * dp)`` (``align_dense_tensors``: a zero tensor pads the group to a multiple of 2 x N,
      runtime/utils.py) ``.to(device)``: one flat 16-bit block; from 0.19.0 the group is
      flattened on the GPU beside its parameters when the flat buffer fits
      (``flatten_on_accelerator``, assumed here), their blocks freed when they become views
      of it (``_update_model_bit16_weights``; no ``empty_cache`` after:
      :data:`~trainmem.specs.frameworks.DEEPSPEED_FLATTENS_ON_DEVICE_SINCE`); then this
      rank's partition ``.to(self.device).clone().float().detach()`` (0.12.3; ``.detach().
      clone().to(device, dtype)`` at 0.19.5): a 16-bit clone, freed once the fp32 partition
      exists (kept, ``single_partition_of_fp32_groups``). ``initialize_optimizer_states``:
      ``single_grad_partition = torch.zeros(partition_size, fp32)`` per group as its ``.grad``,
      up to 0.13.1 ``self.optimizer.step()`` (the states of every group), then ``.grad = None``.
      The gradients are not flat from init (ZeRO-2's ``grads_in_partition`` is made in the
      backward; ZeRO-1's at the step: :mod:`.deepspeed`).
    * From 0.13.2 (PR #5104, :data:`~trainmem.specs.frameworks.
      DEEPSPEED_LAZY_OPTIMIZER_STATES_SINCE`) no step at init: the client optimizer makes each
      flat fp32 partition's states in the first ``step()`` (here at ``optimizer.begin`` of the
      warm-up step, one block per state and (sub-)group, where the base order made one per
      tensor).

    So in the schedule the trainable parameters' per-tensor blocks, their optimizer states and
    ZeRO-3's gradients are these blocks instead (their bytes as the layout sizes them: the
    states per (sub-)group its share of the trainable tensors' ``state_bytes``, the fp32
    partition 4 B per element of it, the rest one block per state of the optimizer's row when
    the states are plain, else one), made at ``setup`` in this order; frozen parameters keep
    their blocks. Not modelled: a second parameter group (the HF Trainer's no-decay group of
    norms and biases: a second, small flat group), the init step's own temporaries (FusedAdam
    makes none), CPU offload (the fp32 partitions, states and ZeRO-3's gradient
    buffer on the host: the per-tensor blocks stay), paged and torchao low-bit optimizers (their
    per-tensor rules stay, Note [Optimizer states of flat tensors]), and a recorded (traced)
    step, whose traced blocks trainmem/traced_transforms.py re-sizes in place.

Source: DeepSpeed runtime/zero/stage3.py, runtime/zero/stage_1_and_2.py, runtime/utils.py at
the tags named above (the deepspeedai/DeepSpeed repository).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainmem.analytic.buffers import (
    deepspeed_partition_elements,
    deepspeed_persistent_bucket_bytes,
    deepspeed_zero3_sub_groups,
)
from trainmem.analytic.model_states import flat_state_bytes
from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    layer_parameter_ops,
    outer_parameter_ops,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def _trainable(ctx: RankContext) -> list[tuple[int, int]]:
    """(elements, weight bytes per element) of each trainable tensor on this rank, in the
    optimizer's order (embedding, layers, head; the layers' ``num_layers`` times)."""
    gb = max(dtype_bytes(ctx.training.grad_dtype), 1)

    def rows(states: list[TensorState]) -> list[tuple[int, int]]:
        out = []
        for s in states:
            n = s.full_grad_bytes // gb
            if s.trainable and n:
                out.append((n, s.full_param_bytes // n))
        return out

    return rows(ctx.emb_states) + ctx.num_layers * rows(ctx.layer_states) + rows(ctx.head_states)


def zero3_partitions(ctx: RankContext) -> list[int] | None:
    """ZeRO-3's parameter (and gradient) partitions on this rank, elements, one per trainable
    parameter in the optimizer's order (embedding, layers, head; None below ZeRO-3):
    ``ceil(numel / N)`` each (DeepSpeed runtime/zero/partition_parameters.py
    ``_partition_param``: ``partition_size = tensor_size // self.num_partitions`` of the size
    padded to a multiple of N, ``_aligned_size``)."""
    t = ctx.training
    if t.deepspeed_optimizer != "zero" or t.zero_stage != 3:
        return None
    return [-(-n // t.sharding_degree) for n, _ in _trainable(ctx)]


def zero12_tensors(ctx: RankContext) -> list[int] | None:
    """Elements of each trainable tensor on this rank in the order ZeRO-1/2 flattens them
    (embedding, layers, head; None for other stages)."""
    t = ctx.training
    if t.deepspeed_optimizer != "zero" or t.zero_stage not in (1, 2):
        return None
    return [n for n, _ in _trainable(ctx)]


@dataclass(frozen=True, slots=True)
class FlatBuffers:
    """One rank's DeepSpeed flat buffers (Note [DeepSpeed's flat buffers at init]), bytes.

    Attributes:
        stage: the ZeRO stage.
        params: the flat 16-bit block of the trainable parameters (ZeRO-3: their partitions).
        params_beside: the flat block is made beside the trainable parameters' own blocks,
            freed after it (ZeRO-1/2 from 0.19.0); else those blocks are gone before.
        groups: elements of each optimizer (sub-)group's fp32 partition.
        clones: per (sub-)group, the 16-bit clone made before its fp32 partition (0: none).
        partitions: per (sub-)group, the fp32 partition (0 when the weights are it).
        states: per (sub-)group, its optimizer-state blocks.
        init_grads: the ``.grad`` buffers set for the init (ZeRO-3: one, of the largest
            sub-group; ZeRO-1/2: one per group), freed at its end.
        states_at_init: the states are made at init (else by the first step).
        bucket: ZeRO-3's IPG bucket (0 below ZeRO-3).
        gradients: ZeRO-3's flat gradient partitions (0 below ZeRO-3).
    """

    stage: int
    params: int
    params_beside: bool
    groups: tuple[int, ...]
    clones: tuple[int, ...]
    partitions: tuple[int, ...]
    states: tuple[tuple[int, ...], ...]
    init_grads: tuple[int, ...]
    states_at_init: bool
    bucket: int
    gradients: int


def _state_blocks(elements: int, ctx: RankContext) -> tuple[int, tuple[int, ...]]:
    """(the fp32 partition, the optimizer-state blocks) of a (sub-)group of ``elements``: the
    states of a flat tensor of that size (:func:`~trainmem.analytic.model_states.
    flat_state_bytes`, Note [Optimizer states of flat tensors]), of which the fp32 partition
    takes 4 B per element when the optimizer keeps one (``TrainingConfig.fp32_master_copy``),
    the rest one block per state when the states are plain full-width tensors (``zeros_like``
    of the partition: torch/optim/adamw.py ``_init_group``, DeepSpeed's FusedAdam), else one
    block."""
    t = ctx.training
    share = flat_state_bytes(t, elements)
    partition = min(4 * elements, share) if t.fp32_master_copy else 0
    rest = share - partition
    if rest <= 0:
        return partition, ()
    row = OPTIMIZER_TABLE[t.optimizer]
    plain = not (row.blockwise or row.factored)
    k = row.num_states if plain and row.num_states > 1 else 1
    return partition, (rest - (k - 1) * (rest // k), *([rest // k] * (k - 1)))


def deepspeed_flat_buffers(ctx: RankContext) -> FlatBuffers | None:
    """This rank's DeepSpeed flat buffers (Note [DeepSpeed's flat buffers at init]), or None:
    not DeepSpeed's ZeRO optimizer, something offloaded, a paged or torchao low-bit optimizer,
    optimizer in backward, pipelining, no trainable element, or a step whose model-state
    blocks are not the context's own (``RankContext.builds_model_states``). Computed once per
    context."""
    memo = ctx.memo.get("deepspeed_flat_buffers", False)
    if memo is not False:
        return memo if isinstance(memo, FlatBuffers) else None
    out = _flat_buffers(ctx)
    ctx.memo["deepspeed_flat_buffers"] = out
    return out


def _flat_states_modelled(optimizer: str) -> bool:
    """The optimizer's states of one flat partition are modelled: not a paged optimizer
    (bitsandbytes pages a tensor of >= 1e5 elements: the flat partition whole), nor torchao's
    low-bit rows, which quantize only a tensor the block divides (Note [Optimizer states of
    flat tensors]: their per-tensor rule stays)."""
    row = OPTIMIZER_TABLE[optimizer]
    return not row.paged and not (row.blockwise is not None and row.blockwise.block_must_divide)


def _flat_buffers(ctx: RankContext) -> FlatBuffers | None:
    t = ctx.training
    if not (
        ctx.builds_model_states
        and t.deepspeed_optimizer == "zero"
        and t.zero_stage in (1, 2, 3)
        and t.offload == "none"
        and _flat_states_modelled(t.optimizer)
        and not t.optimizer_in_backward
        and t.pipeline_parallel_size == 1
    ):
        return None
    tensors = _trainable(ctx)
    if not tensors:
        return None
    dp = t.sharding_degree
    n = sum(k for k, _ in tensors)
    w = tensors[0][1]  # DeepSpeed casts the module to one 16-bit dtype
    if t.zero_stage == 3:
        parts = zero3_partitions(ctx) or []
        params = sum(p * wb for p, (_, wb) in zip(parts, tensors, strict=True))
        groups = tuple(deepspeed_zero3_sub_groups(parts))
        init_grads: tuple[int, ...] = (4 * max(groups),)
        bucket = deepspeed_persistent_bucket_bytes(ctx.model, t)
        grads = dtype_bytes(t.grad_dtype) * sum(parts)
    else:
        partition = deepspeed_partition_elements(n, t)
        params = sum(k * wb for k, wb in tensors) + w * (partition * dp - n)  # the padding
        groups, init_grads, bucket, grads = (partition,), (4 * partition,), 0, 0
    blocks = [_state_blocks(g, ctx) for g in groups]
    clones = tuple(w * g if p and w != 4 else 0 for g, (p, _) in zip(groups, blocks, strict=True))
    return FlatBuffers(
        stage=t.zero_stage,
        params=params,
        params_beside=t.zero_stage < 3 and t.deepspeed_flattens_on_device,
        groups=groups,
        clones=clones,
        partitions=tuple(p for p, _ in blocks),
        states=tuple(b for _, b in blocks),
        init_grads=init_grads,
        states_at_init=t.deepspeed_states_at_init,
        bucket=bucket,
        gradients=grads,
    )


def trainable_parameter_ops(ctx: RankContext) -> tuple[list[Op], list[Op]]:
    """The per-tensor parameter blocks (outside the layers, of one layer) the flat block
    replaces: the trainable tensors' (the base order's keys, :func:`~.base.
    outer_parameter_ops` / :func:`~.base.layer_parameter_ops`)."""
    outer = [
        op
        for op, s in zip(outer_parameter_ops(ctx), ctx.emb_states + ctx.head_states, strict=True)
        if s.trainable
    ]
    layer = [
        op for op, s in zip(layer_parameter_ops(ctx), ctx.layer_states, strict=True) if s.trainable
    ]
    return outer, layer


class DeepSpeedFlatBuffers(Transform):
    """DeepSpeed's flat model-state buffers (Note [DeepSpeed's flat buffers at init]).

    Inserts: ``setup`` the flat 16-bit parameters (from 0.19.0 under ZeRO-1/2, then the
    trainable parameters' own blocks freed), per (sub-)group the 16-bit clone and the fp32
    partition, the init's ``.grad`` buffer(s) and, up to 0.13.1, the optimizer states, then
    ZeRO-3's IPG bucket and flat gradient partitions, all kept; ``optimizer.begin`` of the
    warm-up step the optimizer states from 0.13.2. The base order then makes no block of its
    own for the trainable parameters (unless made beside), the :class:`~.optimizer.Optimizer`
    none for their states, the loop none for ZeRO-3's gradients and :class:`~.deepspeed.
    DeepSpeedZero` no ZeRO-3 bucket (each asks :func:`deepspeed_flat_buffers`).
    """

    name = "deepspeed_flat_buffers"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        flat = deepspeed_flat_buffers(ctx)
        assert flat is not None  # applies()
        self.flat = flat

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return deepspeed_flat_buffers(ctx) is not None

    def _states(self) -> list[Op]:
        o: Phase = "init" if self.flat.states_at_init else "optimizer"
        return [
            alloc(size, Cat.OPTIMIZER_STATE, o, f"ds/state/{k}/{j}", "(optimizer)",
                  "an optimizer state of DeepSpeed's flat fp32 partition")
            for k, blocks in enumerate(self.flat.states)
            for j, size in enumerate(blocks)
        ]  # fmt: skip

    def setup(self, where: Where) -> Sequence[Emitted]:
        f = self.flat
        out: list[Item] = [
            alloc(f.params, Cat.PARAMETER, "init", "ds/flat_params", "(model)",
                  "DeepSpeed's flat 16-bit trainable parameters")
        ]  # fmt: skip
        if f.params_beside:  # their blocks freed once they are views of the flat one
            outer, layer = trainable_parameter_ops(self.ctx)
            out += [free(op, "init") for op in outer]
            if layer:
                out.append(Repeat(tuple(free(op, "init") for op in layer), self.ctx.num_layers))
        for k, (clone, partition) in enumerate(zip(f.clones, f.partitions, strict=True)):
            label = "the 16-bit clone of a partition before its fp32 copy (.clone().float())"
            copy = alloc(clone, Cat.TEMPORARY, "init", f"ds/clone/{k}", "(optimizer)", label)
            label = "DeepSpeed's fp32 partition (the master weights)"
            fp32 = alloc(partition, Cat.OPTIMIZER_STATE, "init", f"ds/fp32/{k}", "(optimizer)",
                         label)  # fmt: skip
            out += [copy, fp32, free(copy, "init")]
        label = "the fp32 .grad set for initialize_optimizer_states"
        grads = [
            alloc(size, Cat.TEMPORARY, "init", f"ds/init_grad/{k}", "(optimizer)", label)
            for k, size in enumerate(f.init_grads)
        ]
        out += grads
        if f.states_at_init:
            out += self._states()
        out += [free(op, "init") for op in grads]
        if f.bucket:
            label = "DeepSpeed's gradient bucket"
            out.append(
                alloc(f.bucket, Cat.TEMPORARY, "init", "bucket/persistent", "(model)", label)
            )
        if f.gradients:
            label = "DeepSpeed ZeRO-3's flat gradient partitions (grad_partitions_flat_buffer)"
            out.append(
                alloc(f.gradients, Cat.GRADIENT, "init", "ds/grad_partitions", "(model)", label)
            )
        return out

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        if not where.first_step or self.flat.states_at_init:
            return ()
        return self._states()
