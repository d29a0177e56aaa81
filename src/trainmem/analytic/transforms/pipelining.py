"""Pipeline parallelism as a transform: the activations and outputs of the other
micro-batches a stage holds, its receive buffers, the last stage's kept logits and the merged
output (Note [Pipeline stage buffers] in :mod:`trainmem.analytic.pipeline`).

Source: torch/distributed/pipelining/schedules.py (``ScheduleGPipe`` / ``Schedule1F1B``
``_step_microbatches``, ``_merge_outputs``), stage.py (``fwd_cache``, ``output_chunks``);
megatron-core schedules.py / p2p_communication.py (Note [Megatron's pipeline stage buffers]);
Korthikanti et al. 2022 sec. 4.2.3 (micro-batches in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.pipeline import stage_buffers
from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
)
from trainmem.analytic.transforms.lora import first_layer_less_bytes
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op, Repeat


class Pipeline(Transform):
    """One pipeline stage's buffers (sizes from the activation profile and
    :func:`~trainmem.analytic.pipeline.stage_buffers`).

    Inserts: ``micro_batches.begin`` the receive buffers (warm-up step, kept);
    ``micro_batch.begin`` the other micro-batches' activations and stage outputs in flight
    (until ``micro_batch.end``); ``head.forward`` the micro-batch's logits kept in
    ``output_chunks`` (freed at ``step.end``); ``step.post_backward`` the merged output;
    ``backward.begin`` a received output gradient allocated per message (Megatron, until
    ``micro_batch.end``).
    """

    name = "pipeline"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        t, rank, prof = ctx.training, ctx.rank, ctx.profile
        emb_acts = prof.embedding if rank.stage == 0 else 0
        head_acts = prof.head if rank.has_head else 0
        on_gpu = min(ctx.num_layers, 2) if t.activation_offloading else ctx.num_layers
        first, last = rank.stage == 0, rank.has_head
        self.buffers = stage_buffers(ctx.model, t, in_flight=rank.in_flight, first=first, last=last)
        # GPipe runs every forward (and, on the last stage, every loss), then the backwards in
        # micro-batch order (torch/distributed/pipelining/schedules.py ``ScheduleGPipe.
        # _step_microbatches``): the other micro-batches in flight hold their loss's saved
        # tensors too, and micro-batch k's backward finds only k + 1 .. m - 1 still held, so
        # after the first at most m - 2 others
        gpipe = t.pipeline_schedule == "gpipe" and t.pipeline_parallel_size > 1
        per_micro_batch = emb_acts + on_gpu * prof.per_layer + (head_acts if gpipe else 0)
        per_micro_batch -= first_layer_less_bytes(ctx)  # Note [LoRA's first layer]
        self.in_flight = round((rank.in_flight - 1) * per_micro_batch)
        # 1F1B: the warmup runs min(m, p - stage) forwards, then each backward is followed by
        # the next forward while one is left (schedules.py ``Schedule1F1B._step_microbatches``:
        # ``if fwd_mb_index == self._n_microbatches: break``, then the cooldown's backwards);
        # when the warmup already ran every micro-batch (m <= p - stage, as with torchtitan's
        # m = p on the first stage) the second backward finds one micro-batch fewer, as under
        # GPipe
        one_fewer = gpipe or (
            t.pipeline_schedule == "1f1b" and t.gradient_accumulation_steps <= rank.in_flight
        )
        later = max(rank.in_flight - 1, 1) if one_fewer else rank.in_flight
        self.in_flight_later = round((later - 1) * per_micro_batch)
        self.outputs_later = stage_buffers(
            ctx.model, t, in_flight=later, first=first, last=last
        ).in_flight_outputs
        # the last stage's logits stay in ``output_chunks``: they are the kept part of the
        # loss's forward transients
        self.held_logits = self.buffers.output_chunk
        self.balanced_micro_batches = not self.buffers.output_chunk

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return ctx.training.pipeline_parallel_size > 1 or ctx.rank.in_flight != 1

    def micro_batches_begin(self, where: Where) -> Sequence[Emitted]:
        # Note [Pipeline stage buffers]: one receive buffer per micro-batch
        if not where.first_step:
            return ()
        recv = alloc(
            self.buffers.recv_buffers,
            Cat.TEMPORARY,
            "forward",
            "pp/recv",
            "pipeline",
            "per-micro-batch receive buffers of the pipeline stage",
        )
        return (recv,)

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        acts = alloc(
            self.in_flight if where.new_grads else self.in_flight_later,
            Cat.ACTIVATION,
            "forward",
            "in_flight",
            "pipeline",
            "activations of the other micro-batches in flight on this stage",
        )
        outputs = alloc(
            self.buffers.in_flight_outputs if where.new_grads else self.outputs_later,
            Cat.ACTIVATION,
            "forward",
            "pp/outputs",
            "pipeline",
            "stage outputs kept for backward (pipelining fwd_cache)",
        )
        return [Lifetime(op, "micro_batch.end") for op in (acts, outputs) if op.size_bytes]

    def backward_begin(self, where: Where) -> Sequence[Emitted]:
        # Note [Megatron's pipeline stage buffers]: the output gradient received for this
        # backward, allocated per message
        if not self.buffers.backward_grad:
            return ()
        grad = alloc(
            self.buffers.backward_grad,
            Cat.TEMPORARY,
            "backward",
            "pp/grad_recv",
            "pipeline",
            "the stage output's gradient received for this backward (one per message)",
        )
        return (Lifetime(grad, "micro_batch.end"),)

    def _output_chunk(self) -> Op:
        """The last stage's logits of micro-batch ``{i}``, kept in ``output_chunks`` until the
        next step (Note [Pipeline stage buffers])."""
        return alloc(
            self.buffers.output_chunk,
            Cat.ACTIVATION,
            "forward",
            "pp/chunk/{i}",
            "pipeline",
            "the micro-batch's logits, kept until the next step (pipelining output_chunks)",
        )

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return (self._output_chunk(),) if self.buffers.output_chunk else ()

    def step_post_backward(self, where: Where) -> Sequence[Emitted]:
        # step() merges the outputs after the schedule's perform_reduce_grad (torch/
        # distributed/pipelining/schedules.py: ``_step_microbatches`` then ``_merge_outputs``)
        merged = alloc(
            self.ctx.training.gradient_accumulation_steps * self.buffers.output_chunk,
            Cat.TEMPORARY,
            "backward",
            "pp/merged",
            "pipeline",
            "the merged logits step() returns (torch.cat of output_chunks)",
        )
        return (merged, free(merged, "backward"))

    def step_end(self, where: Where) -> Sequence[Emitted]:
        # cleared when the next step() starts (``clear_runtime_states``)
        if not self.buffers.output_chunk:
            return ()
        m = self.ctx.training.gradient_accumulation_steps
        return (Repeat((free(self._output_chunk(), "zero_grad"),), m),)
