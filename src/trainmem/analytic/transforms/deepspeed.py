"""DeepSpeed ZeRO-1/2/3 as a transform: the gradient buckets, ZeRO-1's reduce into the
partition, ZeRO-2's fresh partition under accumulation, the gradient copies at the step.

Note [DeepSpeed gradient copies at the step]
    DeepSpeed's optimizer wrappers step on an fp32 flat gradient they build from the model's
    16-bit gradients (:func:`~trainmem.analytic.buffers.deepspeed_step_gradient_copies`). ZeRO-1/2
    (runtime/zero/stage_1_and_2.py ``step``): per parameter group, ``single_grad_partition =
    self.flatten(self.averaged_gradients[i]).to(fp32)``: a 16-bit flat copy of this rank's
    gradient partition, then its fp32 copy, set as the fp32 partition's ``.grad``; the 16-bit
    copy has no reference once ``.to`` returns, the gradients are freed
    (``free_grad_in_param_list``, ``averaged_gradients[i] = None``) before
    ``self._optimizer_step(i)``, and the fp32 copy after it (``.grad = None``). So the step holds
    the partition's gradients + 2 + 4 bytes per partition element at its highest. ZeRO-1 (no
    gradient partitioning) first reduces the full gradients into one flat partition buffer
    after the backward (``reduce_gradients`` -> ``copy_grads_in_partition``: ``torch.empty(
    total_size, dtype=self.dtype)`` while the full gradients are alive, then each ``param.grad``
    a view of it or of the reduce bucket, all cleared by ``_clear_param_grad_only``), so by the
    step only the partition is left. With gradient accumulation ZeRO-2 keeps the first
    micro-batch's partition buffer through ``averaged_gradients`` (0.16.9) /
    ``all_grad_tensors`` (0.19.8) while ``_release_ipg_buffers`` drops ``grads_in_partition``,
    so every later micro-batch's backward allocates a fresh one (``copy_grads_in_partition``:
    ``if self.grads_in_partition is None: ... torch.empty(...)``), adds it into the kept one
    in ``independent_gradient_partition_epilogue`` (``accumulated_grad.add_(new_avg_grad)``) and
    frees it: one more partition of gradients through that backward (allocated with the first
    reduced bucket; at the start of the backward for the rank holding the last layers).
    ZeRO-1/2 take the gradients' norm before the copies, an fp64 copy of one tensor's piece of
    the partition at a time (``scaled_global_norm`` -> ``get_grad_norm_direct``,
    :func:`~trainmem.analytic.buffers.deepspeed_zero12_norm_copy_bytes`; 8 B per element of
    the largest piece, up to the partition). ZeRO-3 (runtime/zero/stage3.py ``step``) first
    takes the gradients' norm, an fp64 copy of
    one gradient partition at a time (:func:`~trainmem.analytic.buffers.
    deepspeed_zero3_norm_copy_bytes`), then builds the step's two copies per optimizer
    sub-group (``_prepare_fp32_grad_for_sub_group``; ``sub_group_size`` 1e9
    partition elements), freeing each fp32 copy before the next (``_release_sub_group``); its
    gradient partition stays (a buffer from init). ``FP16_Optimizer`` (ZeRO off, 16-bit gradients;
    fp16/fused_optimizer.py ``step``): ``_flatten_dense_tensors([p.grad.to(fp32) for p in
    group])``, every gradient's fp32 copy alive until the concatenation exists.

Note [Whole new gradients of the head and the embedding under ZeRO-3]
    ZeRO-3 keeps only this rank's partition of each gradient (``grad_partitions_flat_buffer``,
    from init), but autograd makes every gradient whole: the gathered parameter's full-shape
    ``.grad`` (``AccumulateGrad``), which the post-accumulate hook then queues for its
    reduce-scatter (stage3.py v0.13.1 / v0.14.2 ``reduce_independent_p_g_buckets_and_remove_
    grads`` -> ``__add_grad_to_ipg_bucket``: a gradient larger than ``reduce_bucket_size`` is
    not copied into the bucket and stays ``param.grad``; the next parameter's hook, or the
    backward's epilogue ``independent_gradient_partition_epilogue``, runs ``__reduce_and_
    partition_ipg_grads`` -> ``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``, whose
    output for one tensor divisible by N is a view of it, and ``partition_grads`` copies or adds
    that view into the partition and sets ``param.grad = None``). So the output layer's and the
    token embedding's new gradients are transients of their whole size (V x h in the gradient
    dtype: 2.31 GiB each for GLM-4-9B in fp32), not the partition's 1/N (the layers' whole
    gradients are the layer's reduce bucket, :mod:`.fsdp`'s ``reduce``). Untied weights only:
    a tied weight's gradient waits whole in autograd's input buffer already (Note [A tied
    gradient under DeepSpeed ZeRO-2/3]).

Note [Whole new gradients of the head and the embedding under ZeRO-2]
    ZeRO-2 keeps this rank's piece of each gradient (``grads_in_partition``, made in the
    backward), but autograd makes every micro-batch's gradient whole: the backward's epilogue
    sets every ``.grad`` to None (stage_1_and_2.py v0.12.3 / v0.16.4 / v0.19.5
    ``independent_gradient_partition_epilogue`` -> ``zero_grad(set_to_none=True)``), so each
    ``AccumulateGrad`` stores the whole new gradient, and the hook that runs after it
    (``reduce_independent_p_g_buckets_and_remove_grads``) copies it into the reduce bucket
    (``grad_reduc.data = new_grad_tensor.data.view_as(grad_reduc)``: the whole block freed),
    or, larger than ``reduce_bucket_size``, keeps it as ``param.grad``
    (``extra_large_param_to_reduce``) until ``reduce_ipg_grads`` reduces it in place and
    ``copy_grads_in_partition`` moves it into ``grads_in_partition`` (a rank that does not
    own it: ``clear_grad_attribute``). So, as under ZeRO-3, the output layer's and the token
    embedding's new gradients are transients of their whole size (V x h in the gradient
    dtype) in every micro-batch, the rank's piece made while the first one exists; before,
    the first micro-batch had only the piece and a later one a new gradient of the piece's
    size. The layers' whole gradients are their reduce bucket as before; untied weights only
    (Note [A tied gradient under DeepSpeed ZeRO-2/3]).

Source: DeepSpeed runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py,
runtime/fp16/fused_optimizer.py (cited per rule in :mod:`trainmem.analytic.buffers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.buffers import (
    deepspeed_backward_bucket_bytes,
    deepspeed_bf16_grad_buffer_bytes,
    deepspeed_partition_elements,
    deepspeed_persistent_bucket_bytes,
    deepspeed_step_gradient_copies,
    deepspeed_zero3_norm_copy_bytes,
    deepspeed_zero3_sub_group_elements,
    deepspeed_zero12_norm_copy_bytes,
    gradient_buffer_from_init,
)
from trainmem.analytic.tensor_states import TensorState
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
    free_gradients,
    gradient_ops,
)
from trainmem.analytic.transforms.deepspeed_init import (
    deepspeed_flat_buffers,
    zero3_partitions,
    zero12_tensors,
)
from trainmem.analytic.transforms.sharding import group_states
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def zero1_reduces(ctx: RankContext) -> bool:
    """ZeRO-1 reduces the full gradients into this rank's partition after the backward, and
    frees them into it at the step (Note [DeepSpeed gradient copies at the step])."""
    t = ctx.training
    return (
        t.deepspeed_optimizer == "zero"
        and ctx.zero_stage == 1
        and t.offload == "none"
        and bool(t.zero_grad_set_to_none)  # resolved by TrainingConfig
        and not gradient_buffer_from_init(t)
    )


class DeepSpeedZero(Transform):
    """DeepSpeed's ZeRO optimizer wrappers on one rank (Note [DeepSpeed gradient copies at the
    step]); sizes from the rank's trainable model states (:meth:`RankContext.
    trainable_elements`) and the DeepSpeed config fields of ``TrainingConfig``.

    Inserts: ``step.begin`` ZeRO-3's bucket and ``BF16_Optimizer``'s flat gradient buffer
    (warm-up step, kept); ``BF16_Optimizer``'s fp32 copy of one gradient at
    ``root.post_backward`` (at ``head`` / ``layer`` / ``embedding.post_backward`` with
    ``immediate_grad_update``; Note [BF16_Optimizer's two gradients]); ``backward.begin`` ZeRO-1/2's
    bucket(s) until ``micro_batch.end``; ``stack.pre_backward`` ZeRO-2's fresh partition of a
    later micro-batch until ``micro_batch.end``; ``optimizer.step`` ZeRO-1's partition and
    the step's flat gradient copies, the fp32 one until ``optimizer.end``.
    """

    name = "deepspeed"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        t = ctx.training
        self.bucket_backward = deepspeed_backward_bucket_bytes(ctx.model, t)
        self.bucket_persistent = deepspeed_persistent_bucket_bytes(ctx.model, t)
        self.zero1_reduce = zero1_reduces(ctx)
        #: frees the gradients into its own partition at the step (ZeRO-1)
        self.frees_gradients_at_step = self.zero1_reduce
        # Note [BF16_Optimizer's two gradients]: the flat buffer from init, and the fp32 copy
        # of one parameter's bf16 gradient that _update_hp_grad adds into it
        self.bf16_buffer = deepspeed_bf16_grad_buffer_bytes(ctx.trainable_elements(), t)
        self.bf16_immediate = t.bf16_optimizer_immediate_grad_update
        self.fresh_partition = 0
        if (
            t.deepspeed_optimizer == "zero"
            and t.zero_stage == 2
            and t.offload == "none"
            and t.gradient_accumulation_steps > 1
        ):
            self.fresh_partition = dtype_bytes(t.grad_dtype) * deepspeed_partition_elements(
                ctx.trainable_elements(), t
            )

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        t = ctx.training
        return t.conventions.zero_ipg_buckets or t.deepspeed_optimizer is not None

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        # Note [Whole new gradients of the head and the embedding under ZeRO-3]; ZeRO-2's
        # likewise (Note [Whole new gradients of the head and the embedding under ZeRO-2])
        ctx, t = self.ctx, self.ctx.training
        if (
            group == "layer"
            or t.deepspeed_optimizer != "zero"
            or ctx.zero_stage not in (2, 3)
            or (ctx.zero_stage == 3 and where.new_grads)
            or embedding_gradients(ctx).tied_lookup
        ):
            return None
        states, key, module = group_states(ctx, group)
        # ZeRO-2's first micro-batch keeps this rank's piece of each (grads_in_partition)
        kept = gradient_ops(ctx, states, "backward", key, module) if where.new_grads else []
        label = "a new gradient, whole, before its reduce-scatter into the partition"
        out: list[Op] = []
        for n, s in enumerate(states):
            new = alloc(s.full_grad_bytes, Cat.TEMPORARY, "backward", f"new_grad/{group}/{n}",
                        module, label)  # fmt: skip
            out += [new, *kept[n : n + 1], free(new, "backward")]
        return out

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        if not where.first_step:
            return ()
        out: list[Emitted] = []
        if self.bf16_buffer:  # BF16_Optimizer's fp32_groups_gradients_flat, from init
            label = "BF16_Optimizer's flat gradient buffer (fp32_groups_gradients_flat)"
            out.append(
                alloc(
                    self.bf16_buffer, Cat.GRADIENT, "forward", "grad/bf16_buffer", "(model)", label
                )
            )
        if self.bucket_persistent and deepspeed_flat_buffers(self.ctx) is None:
            # ZeRO-3's gradient bucket, allocated once at init (there, with the flat buffers:
            # Note [DeepSpeed's flat buffers at init])
            label = "DeepSpeed's gradient bucket"
            out.append(
                alloc(
                    self.bucket_persistent,
                    Cat.TEMPORARY,
                    "forward",
                    "bucket/persistent",
                    "(model)",
                    label,
                )
            )
        return out

    def _hp_grad_copy(self, states: list[TensorState], module: str) -> list[Emitted]:
        """``_update_hp_grad``'s fp32 copy of the largest bf16 gradient of ``states``
        (``lp.grad.data.to(hp_grad.dtype)``, freed once added into the buffer)."""
        t = self.ctx.training
        if not self.bf16_buffer or t.deepspeed_grad_accum_dtype == t.grad_dtype:
            return []
        gb = max(dtype_bytes(t.grad_dtype), 1)
        acc = dtype_bytes(t.deepspeed_grad_accum_dtype)
        n = max((s.full_grad_bytes // gb for s in states if s.trainable), default=0)
        if not n:
            return []
        label = "BF16_Optimizer: one gradient's fp32 copy added into its buffer"
        copy = alloc(acc * n, Cat.TEMPORARY, "backward", "grad/hp_copy", module, label)
        return [copy, free(copy, "backward")]

    def head_post_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.bf16_immediate:
            return ()
        return self._hp_grad_copy(self.ctx.head_grad_states, "head")

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.bf16_immediate:
            return ()
        return self._hp_grad_copy(self.ctx.layer_states, "layers.{i}")

    def embedding_post_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.bf16_immediate:
            return ()
        return self._hp_grad_copy(self.ctx.emb_grad_states, "embedding")

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        if self.bf16_immediate:
            return ()
        # update_hp_grads after loss.backward(): one parameter at a time
        ctx = self.ctx
        states = ctx.head_grad_states + ctx.layer_states + ctx.emb_grad_states
        return self._hp_grad_copy(states, "(model)")

    def backward_begin(self, where: Where) -> Sequence[Emitted]:
        if not self.bucket_backward:
            return ()
        label = "DeepSpeed's gradient bucket(s)"
        bucket = alloc(
            self.bucket_backward, Cat.TEMPORARY, "backward", "bucket/backward", "(model)", label
        )
        return (Lifetime(bucket, "micro_batch.end"),)

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        # ZeRO-2 reduces a later micro-batch's gradients into a fresh partition buffer, added
        # into the accumulated one at the end
        if where.new_grads or not self.fresh_partition:
            return ()
        fresh = alloc(
            self.fresh_partition,
            Cat.GRADIENT,
            "backward",
            "grad/fresh_partition",
            "(optimizer)",
            "this micro-batch's gradient partition (ZeRO-2 grads_in_partition)",
        )
        return (Lifetime(fresh, "micro_batch.end"),)

    def _largest_sub_group(self) -> int | None:
        """ZeRO-3's largest optimizer sub-group, elements (None below ZeRO-3)."""
        partitions = zero3_partitions(self.ctx)
        return None if partitions is None else deepspeed_zero3_sub_group_elements(partitions)

    def _norm_copy(self) -> list[Emitted]:
        """The gradients' norm: an fp64 copy of each gradient partition (ZeRO-3) or of each
        tensor's piece of the flat partition (ZeRO-1/2), one at a time
        (:func:`~trainmem.analytic.buffers.deepspeed_zero3_norm_copy_bytes`,
        :func:`~trainmem.analytic.buffers.deepspeed_zero12_norm_copy_bytes`)."""
        t = self.ctx.training
        size = deepspeed_zero3_norm_copy_bytes(zero3_partitions(self.ctx) or [], t)
        size += deepspeed_zero12_norm_copy_bytes(zero12_tensors(self.ctx) or [], t)
        if not size:
            return []
        label = "a gradient partition's fp64 copy for the norm (get_grad_norm_direct)"
        op = alloc(size, Cat.TEMPORARY, "optimizer", "grad/norm_fp64", "(optimizer)", label)
        return [op, free(op, "optimizer")]

    def optimizer_step(self, where: Where) -> Sequence[Emitted]:
        ctx, t = self.ctx, self.ctx.training
        o: Phase = "optimizer"
        n = ctx.trainable_elements()
        transient, kept = deepspeed_step_gradient_copies(
            n, t, largest_sub_group=self._largest_sub_group()
        )
        out: list[Emitted] = []
        if self.zero1_reduce:
            # a temporary: ``model_states_bytes`` keeps ZeRO-1's 2 B of gradients per parameter
            # (ZeRO paper Fig. 1), this buffer replaces them for the step
            grads = alloc(
                dtype_bytes(t.grad_dtype) * deepspeed_partition_elements(n, t),
                Cat.TEMPORARY,
                o,
                "grad/partition",
                "(optimizer)",
                "this rank's gradient partition (ZeRO-1 grads_in_partition)",
            )
            out += [grads, *free_gradients(ctx, o)]
        out += self._norm_copy()  # on the partition (ZeRO-1: once reduced into it)
        copy = alloc(
            transient, Cat.TEMPORARY, o, "grad/step_copy", "(optimizer)", "flat gradient copy"
        )
        fp32 = alloc(
            kept, Cat.TEMPORARY, o, "grad/step_fp32", "(optimizer)", "fp32 gradient at the step"
        )
        if transient:
            out.append(copy)
        if kept:
            out.append(Lifetime(fp32, "optimizer.end"))
        if transient:
            out.append(free(copy, o))
        if self.zero1_reduce:
            out.append(free(grads, o))
        return out
