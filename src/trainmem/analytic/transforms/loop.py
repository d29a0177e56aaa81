"""The training loop's conventions as a transform: when ``zero_grad()`` frees the gradients
(``set_to_none=True``, the default since PyTorch 2.0, after the step or between the forward
and the backward; kept with ``set_to_none=False`` or a gradient buffer made at wrap time), the
logits a loop holds until the step ends (loop ``step``, ``TrainingConfig.keep_logits``) and
what a loop that binds its outputs in its own scope holds of the previous micro-batch (loop
``previous``: Note [The previous micro-batch's graph], analytic/held_outputs.py).

Source: torch/optim/optimizer.py ``zero_grad`` (``set_to_none``); a loop that keeps the model
output past ``loss.backward()`` (``outputs = model(...)`` read after ``optimizer.step()``, e.g.
for logging) holds its logits until the step function returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.attention import forward_kv_cache_bytes, returned_presents_bytes
from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.held_outputs import graph_held_input_bytes, previous_output_bytes
from trainmem.analytic.loss import accelerate_output_bytes, loss_forward_transient_bytes
from trainmem.analytic.pipeline import logits_bytes
from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    all_gradients,
    alloc,
    free,
    free_gradients,
    keeps_gradients,
)
from trainmem.analytic.transforms.deepspeed import zero1_reduces
from trainmem.analytic.transforms.deepspeed_init import deepspeed_flat_buffers
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op, Repeat


class ZeroGrad(NamedTuple):
    """When ``zero_grad()`` frees the gradients.

    Attributes:
        keep: never (:func:`~trainmem.analytic.transforms.base.keeps_gradients`): the
            micro-batches accumulate into gradients that exist from the warm-up step on.
        before_backward: between the forward and the backward
            (``TrainingConfig.zero_grad_before_backward``): the previous step's gradients are
            alive through the forward (the warm-up step is given them too, as after an
            earlier step) and freed before the backward rebuilds them.
        after_step: after ``optimizer.step()``.
    """

    keep: bool
    before_backward: bool
    after_step: bool


def zero_grad_policy(ctx: RankContext) -> ZeroGrad:
    """The rank's :class:`ZeroGrad` (neither with optimizer-in-backward, which frees each
    gradient once stepped, nor under DeepSpeed ZeRO-1, which frees them into its partition;
    kept in ``ctx.memo``: the builder asks at every step it builds)."""
    cached = ctx.memo.get("zero_grad_policy")
    if isinstance(cached, ZeroGrad):
        return cached
    t = ctx.training
    keep = keeps_gradients(t)
    released = t.optimizer_in_backward or zero1_reduces(ctx)
    # DeepSpeed BF16_Optimizer up to 0.16.4: clear_lp_grads() at the start of its backward
    # (Note [BF16_Optimizer's two gradients])
    by_backward = t.bf16_optimizer_grads_released == "backward"
    before = (t.zero_grad_before_backward or by_backward) and not keep and not released
    out = ctx.memo["zero_grad_policy"] = ZeroGrad(
        keep, before, not keep and not before and not released
    )
    return out


def kept_logits_bytes(ctx: RankContext) -> int:
    """The logits the loop holds past the loss: one micro-batch's (the ``step`` loop keeps the
    last output; the ``previous`` loop each micro-batch's through its own backward, Note [The
    current micro-batch's bound output]), when they are part of the loss's forward transients
    (0 otherwise); accelerate's fp32 copy of them where its wrapped forward returns one (Note
    [accelerate's fp32 outputs]: the 16-bit logits go when the forward returns). 0 under
    litgpt's own model code, whose fp32 copy is a head term bound by its loop (Note [litgpt's
    bound logits])."""
    t = ctx.training
    if not ctx.rank.has_head or t.pipeline_parallel_size > 1:
        return 0
    if t.training_loop == "step":
        # accelerate's fp32 copy, else the lm_head output, fp32 where the model code returns
        # it upcast (held_outputs.py ``output_logits_bytes``)
        part = accelerate_output_bytes(ctx.model, t)
        if not part:
            c, _ = compute_and_residual_bytes(t)
            own = t.conventions.hf_model_code and ctx.model.returns_fp32_logits(
                t.transformers_release
            )
            part = logits_bytes(ctx.model, t) * (4 if own else c) // c
    elif t.training_loop == "previous" and not t.conventions.own_model_code:
        part = previous_output_bytes(ctx.model, t)
    else:
        return 0
    return part if 0 < part <= loss_forward_transient_bytes(ctx.model, t) else 0


def bound_logits_bytes(ctx: RankContext) -> int:
    """Bytes of the fp32 logits litgpt's loop still binds during the optimizer step.

    Note [litgpt's bound logits]
        litgpt's ``fit`` binds ``logits = model(input_ids, ...)`` (Fabric's fp32 copy of the
        output, Note [litgpt's cast output]) and rebinds it only when the next micro-batch's
        forward returns (litgpt/finetune/lora.py and full.py v0.5.13; lit-gpt @8641822 alike),
        so the copy lives through the whole backward and the optimizer step whatever the loop
        setting says of the previous micro-batch: the head's ``logits_fp32_output`` block is
        freed when the micro-batch's backward ends (not at the head's backward), and the last
        micro-batch's is held again from ``optimizer.begin`` to ``step.post_optimizer`` (one
        rank with the whole model; the ``previous`` loop re-adds it at the next micro-batch's
        start). Found by the generic path on litgpt's own GPT (trace/litgpt_model.py), where
        the peak is the optimizer step (a 2-layer 1024-wide Llama, full fine-tuning at 2 x 256
        tokens): +1.3 / +2.6 % -> 0 % (bf16-mixed / bf16-true)."""
    t = ctx.training
    if not (t.conventions.own_model_code and ctx.rank.has_head and ctx.rank.stage == 0):
        return 0
    return head_activation_bytes(ctx.model, t).get("logits_fp32_output", 0)


def bound_output_bytes(ctx: RankContext) -> int:
    """Bytes of the last micro-batch's output a loop that binds it in its own scope still holds
    during the optimizer step: litgpt's fp32 logits (:func:`bound_logits_bytes`, under any
    loop setting), or under the ``previous`` loop the output :func:`kept_logits_bytes` holds
    through each micro-batch's backward (Note [The current micro-batch's bound output]).

    Note [The current micro-batch's bound output]
        A plain loop binds the model output in its own scope and reads the loss from it::

            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()

        (peft examples/causal_language_modeling/peft_lora_clm_accelerate_ds_zero3_offload.py
        at 026d1e01, the loop of the 'PEFT + Accelerate' rows; accelerate
        examples/nlp_example.py at 03a5f887, ``loss = loss / gradient_accumulation_steps`` and
        ``optimizer.step()`` every ``gradient_accumulation_steps`` micro-batches). So the
        output (the logits: accelerate's fp32 copy where its wrapped forward returns one,
        Note [accelerate's fp32 outputs]; the compute-dtype ``lm_head`` output otherwise) lives
        through its own micro-batch's backward, and the last micro-batch's through
        ``optimizer.step()``, until ``outputs`` is rebound when the next forward returns
        (Note [The previous micro-batch's graph] has that part). With accumulation micro-batch
        k's output lives until micro-batch k + 1's forward returns. The HF Trainer drops it
        (``compute_loss`` returns the loss alone unless ``return_outputs``, and
        ``training_step`` returns ``loss.detach()``; transformers trainer.py): loop ``drop``.
        litgpt's own model code is :func:`bound_logits_bytes`. The formulas allocate the
        output with the head's forward until ``micro_batch.end`` and the last one again from
        ``optimizer.begin`` to ``step.post_optimizer``; the trace runs the binding itself
        (``trainmem.trace.step.run_step``'s ``hold_output``). The KV cache a transformers model
        builds in training, or the presents it returns (:func:`returned_cache_bytes`), are
        held with the output, as the trace holds them (and by the ``step`` loop's output
        until the step function returns: its trace agreed within 32,996 B, the cache, before).
        Not modelled: the previous
        micro-batch's cache into the next forward (the previous-output rule holds its logits
        only, on both engines)."""
    litgpt = bound_logits_bytes(ctx)
    if litgpt or ctx.training.training_loop != "previous":
        return litgpt
    return kept_logits_bytes(ctx)


def returned_cache_bytes(ctx: RankContext) -> int:
    """Bytes of the KV cache transformers builds in training
    (:func:`~trainmem.analytic.attention.forward_kv_cache_bytes`) or the presents it returns
    (:func:`~trainmem.analytic.attention.returned_presents_bytes`) over the rank's layers: the
    model output holds them until the loss, or as long as the loop binds the output."""
    return ctx.num_layers * layer_kv_cache_bytes(ctx) + returned_presents_bytes_of(ctx)


def layer_kv_cache_bytes(ctx: RankContext) -> int:
    """One layer's KV cache copies beyond what SDPA saves (Note [The training KV cache's
    copies]), made at its attention: the rank's layers' mean (sliding and full layers differ)."""
    n = ctx.num_layers
    return forward_kv_cache_bytes(ctx.model, ctx.training, n) // n if n else 0


def returned_presents_bytes_of(ctx: RankContext) -> int:
    """The presents the rank's layers return (:func:`~trainmem.analytic.attention.
    returned_presents_bytes`), one block with the model output."""
    return returned_presents_bytes(ctx.model, ctx.training, ctx.num_layers)


def bound_cache_bytes(ctx: RankContext) -> int:
    """The returned cache a loop that keeps the output holds with it (Note [The current
    micro-batch's bound output]; the ``step`` loop's output object too, until the step
    function returns): :func:`returned_cache_bytes` on the rank with the head when
    :func:`kept_logits_bytes` holds its output, else 0."""
    return returned_cache_bytes(ctx) if kept_logits_bytes(ctx) else 0


class Previous(NamedTuple):
    """What the ``previous`` loop holds of the last micro-batch when the next one starts
    (Note [The previous micro-batch's graph]): its output and the tensors its graph keeps,
    until the next forward returns (``head.post_forward``: the output's ``grad_fn`` reaches
    the whole graph; the loss, which does too, is rebound to a float by the logging that
    follows each step at ``log_interval: 1``). Both are allocated at ``micro_batch.begin``, the
    warm-up step's first
    micro-batch too (as after an earlier step). The current micro-batch's own quantized-linear
    inputs are freed with its layers' other saved tensors in its backward, as they would be
    without this loop: the backward after its first layers and the optimizer step are under
    by up to ``graph`` bytes, never the backward's first ops, which hold them all."""

    output: int
    graph: int


def previous_micro_batch(ctx: RankContext) -> Previous:
    """The rank's :class:`Previous` (zeros for another loop; the output only on the rank with
    the head)."""
    t = ctx.training
    has_head = ctx.rank.has_head
    return Previous(
        previous_output_bytes(ctx.model, t) if has_head else 0,
        graph_held_input_bytes(ctx.model, t, num_layers=ctx.num_layers, has_head=has_head),
    )


class TrainingLoop(Transform):
    """The loop's ``zero_grad`` and kept logits: the gradients kept over steps allocated in the
    warm-up step (``step.begin``); ``zero_grad()`` before the backward (``forward.end``) or
    after the step (``step.post_optimizer``); the kept logits allocated with the logits
    (``head.forward``) and freed when the step function returns (``step.post_optimizer``);
    the previous micro-batch's output and graph (:class:`Previous`)."""

    name = "loop"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.held_logits = kept_logits_bytes(ctx)
        self.zero_grad = zero_grad_policy(ctx)
        self.previous = previous_micro_batch(ctx)
        self.held_cache = bound_cache_bytes(ctx)
        self.rebinds = ctx.training.training_loop == "previous"
        self.bound = bound_output_bytes(ctx) + (self.held_cache if self.rebinds else 0)

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        if not self.bound:
            return ()
        # Note [litgpt's bound logits], Note [The current micro-batch's bound output]: the
        # last micro-batch's, through the optimizer step
        label = "the last micro-batch's logits, bound by the loop through the step"
        op = alloc(self.bound, Cat.TEMPORARY, "optimizer", "loop/bound_logits", "head", label)
        return (Lifetime(op, "step.post_optimizer"),)

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        output, graph = self.previous
        if graph:
            label = "the previous micro-batch's quantized-linear inputs, kept by its graph"
            op = alloc(graph, Cat.ACTIVATION, "forward", "previous/graph", "layers", label)
            out.append(Lifetime(op, "head.post_forward"))
        if output:
            label = "the previous micro-batch's logits, held by the loop"
            op = alloc(output, Cat.TEMPORARY, "forward", "previous/logits", "head", label)
            out.append(Lifetime(op, "head.post_forward"))
        return out

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return True

    def _kept(self) -> Op:
        return alloc(
            self.held_logits,
            Cat.TEMPORARY,
            "forward",
            "logits_kept",
            "head",
            "the logits, held by the training loop until the step ends",
        )

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        z = self.zero_grad
        flat = deepspeed_flat_buffers(self.ctx)
        if flat is not None and flat.gradients:  # Note [DeepSpeed's flat buffers at init]
            return ()
        if where.first_step and (z.keep or z.before_backward):
            return all_gradients(self.ctx, "forward")
        return ()

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        if not self.held_logits:
            return ()
        if not self.rebinds:  # the step function's output: its logits and cache
            return [op for op in (self._cache(), self._kept()) if op.size_bytes]
        # Note [The current micro-batch's bound output]: the output, and the cache it returns
        held = [Lifetime(op, "micro_batch.end") for op in (self._cache(), self._kept())]
        return [x for x in held if x.op.size_bytes]

    def _cache(self) -> Op:
        label = "the KV cache the model output returns, held by the loop"
        return alloc(self.held_cache, Cat.TEMPORARY, "forward", "loop/cache", "layers", label)

    def forward_end(self, where: Where) -> Sequence[Emitted]:
        # optimizer.zero_grad() between the loss and loss.backward()
        return free_gradients(self.ctx, "zero_grad") if where.zero_grad else ()

    def step_post_optimizer(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.held_logits and not self.rebinds:  # the step function returns: its output goes
            out.append(free(self._kept(), "optimizer"))
            if self.held_cache:
                out.append(free(self._cache(), "optimizer"))
        if self.zero_grad.after_step:
            cached = self.ctx.shared.get("zero_grad")
            if not isinstance(cached, Repeat):
                frees = tuple(free_gradients(self.ctx, "zero_grad"))
                cached = self.ctx.shared["zero_grad"] = Repeat(frees, 1)
            out.append(cached)
        return out
