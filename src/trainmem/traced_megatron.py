"""Megatron-LM's memory applied to a traced step (issue 26: "every training option on every
model path").

Note [Megatron on a traced step]
    megatron-core needs CUDA (TransformerEngine or its fused kernels, its process groups), so
    its step is not traced. Megatron-LM trains its own ``GPTModel`` (megatron-core
    models/gpt/gpt_model.py: a decoder-only transformer, standard attention and MLP or MoE), so
    on the generic path the transformers model's layers stand in for its layers, and what is
    Megatron's is applied to them, with the rules the formulas use for Megatron:

    * traced as it is, from the transformers layers: the weights (16-bit, no autocast:
      ``FrameworkConventions.master_weights``), every activation the layers save and every
      transient of their forward and backward;
    * run for real, as Megatron's own code on the traced logits: the vocabulary-parallel
      cross-entropy (its fp32 softmax saved and turned into the gradient in place; Note
      [Megatron's cross-entropy on a traced step], trainmem/trace/megatron_loss.py);
    * rules of the traced step, the analytic engine's (one implementation, both engines):
      the optimizer is Megatron's (``Float16OptimizerWithFloat16Params`` / the distributed
      optimizer: fp32 master weights and moments, :func:`~trainmem.traced_transforms.
      apply_optimizer` with the analytic state layout or the traced tensors'), partitioned over
      the data-parallel ranks with ``zero_stage=1`` (``--use-distributed-optimizer``,
      megatron/core/optimizer/distrib_optimizer.py: each rank steps its shard); the gradients
      live in one contiguous fp32 buffer allocated when the model is wrapped and never freed
      (megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer.__init__``:
      ``self.grad_data = torch.zeros(...)``; :func:`~trainmem.analytic.buffers.
      gradient_buffer_from_init`), whole under the distributed optimizer too (it
      reduce-scatters in place; with master weights, the ``*-mixed`` precisions, as the
      formulas' rule has it); each 16-bit gradient autograd makes is a temporary that
      Megatron's backward hook adds into ``main_grad`` and drops at once
      (megatron/core/distributed/distributed_data_parallel.py ``_make_backward_post_hook``:
      ``param.main_grad.add_(param.grad.data)``, ``param.grad = None``), as the analytic
      schedule's new-gradient temporaries (# NB: with ``gradient_accumulation_fusion`` the
      weight-gradient GEMM writes into ``main_grad`` and no 16-bit gradient exists; neither
      engine models that).

    The plain loop of one rank is traced (``data_parallel_size=1``, ``zero_stage=0``) with
    torch's fused AdamW as the optimizer stand-in (no step temporaries; its states are
    replaced). Tensor and sequence parallelism run as DTensor's (Note [Megatron's tensor
    parallelism on a traced step]), pipeline parallelism as torch's pipelining (Note
    [Megatron's last pipeline stage]), the RMSNorms as Megatron's fused kernel (Note
    [Megatron's fused RMSNorm], trainmem/trace/fused_norm.py). Not traced: context
    parallelism, GPipe,
    ZeRO-2/3 (megatron-core's custom FSDP), CPU offload, the optimizers the trace needs a
    stand-in for, LoRA and quantized bases (Megatron-LM trains no adapters; PEFT on
    megatron-core is NeMo's). Refused too: a model Megatron's ``GPTModel`` does not build
    (encoder-decoder, masked-LM, vision, speech, multimodal, attention-free, diffusion, timm;
    :func:`trainmem.trace.megatron_loss.megatron_model_refusal`).

Note [Megatron's tensor parallelism on a traced step]
    ``tensor_parallel_size=t`` (with or without ``sequence_parallel``) runs the trace's DTensor
    plan (Note [Tracing tensor parallelism], trainmem/trace/tensor_parallel.py), whose shapes
    are megatron-core's (megatron/core/tensor_parallel/layers.py: ``ColumnParallelLinear`` for
    q / k / v, gate, up and the output layer with ``gather_output=False``,
    ``RowParallelLinear`` for o and down, ``VocabParallelEmbedding``; norms replicated). The
    cross-entropy runs on rank 0's vocabulary shard of the logits (trace/megatron_loss.py
    ``_vocab_shard``). With sequence parallelism the column-parallel linears save the
    sequence shard of their input and gather it again in backward, as Megatron's do (Note
    [Megatron's column-parallel linears save the shard], trainmem/trace/sequence_shard.py;
    ``TrainingConfig.sequence_parallel_saves_gathered_input``, False for Megatron, is the
    decision the formulas read too). One difference is applied as a rule:

    Note [Megatron's vocabulary-parallel embedding gradient]
        ``VocabParallelEmbedding.forward`` looks the masked ids up in the rank's own weight
        shard (``F.embedding(masked_input, self.weight)``, megatron-core core_r0.9.0
        tensor_parallel/layers.py), so its new 16-bit gradient is ``V / t x h``; DTensor's
        ``RowwiseParallel`` embedding makes the whole ``V x h`` one in the trace. Its size is
        divided by ``t`` (as the formulas' new gradient of the embedding has it).

    Tensor beside data parallelism is traced as tensor parallelism alone, its optimizer states
    partitioned over the data-parallel ranks by the rule above (tp 2 x dp 2 ZeRO-1 on the
    agreement Llama: +0.13 % at 2 x 256 tokens, -0.05 % at 2 x 1,024; refused while the
    stand-in's transformers RMSNorm was traced: +1.4 %). The norms run as Megatron's fused
    kernel (Note [Megatron's fused RMSNorm], trainmem/trace/fused_norm.py): tp 2 +0.09 % /
    -0.04 % at 2 x 256 / 2 x 1,024 tokens (+0.98 / +3.2 % with transformers' norm), tp 2 + SP
    +0.19 / -0.04 % (+0.60 / +1.77 % while the trace saved DTensor's gathered inputs; +0.69 /
    +2.05 % with transformers' norm too).

Note [Megatron's last pipeline stage]
    ``pipeline_parallel_size=p`` runs the trace's torch pipelining (1F1B or interleaved 1F1B,
    the schedules megatron-core has: pipeline_parallel/schedules.py
    ``get_forward_backward_func``; GPipe is refused), with two of Megatron's conventions: the
    last stage's loss is Megatron's cross-entropy (trace/megatron_loss.py ``megatron_loss``),
    and the last stage keeps no micro-batch's logits (``schedule.step(return_outputs=False)``:
    megatron-core's ``forward_step`` returns the loss GPTModel computes on its logits and
    ``deallocate_output_tensor`` frees what a stage sent; torch's ``PipelineStage`` otherwise
    holds every micro-batch's logits in ``output_chunks`` to the step's end, +2.6 % on the
    last stage). Each stage's optimizer states and gradient buffer are its own traced
    tensors' (Note [Traced tensors as model states]). Agreement on the agreement Llama,
    pp 2 x 4 micro-batches: +0.31 % (the first stage sets the peak; -0.68 % at 2 x 1,024
    tokens). Context parallelism was not tried.

Source: megatron-core 0.9.0 (files cited per rule above); the analytic rules named per rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainmem.analytic.buffers import gradient_buffer_from_init
from trainmem.analytic.tensor_states import state_layout
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig
from trainmem.traced_transforms import (
    after_state,
    apply_optimizer,
    older_torch_step,
    optimizer_standin,
    traced_tensor_states,
)

__all__ = [
    "apply_megatron",
    "megatron_note",
    "megatron_refusals",
    "megatron_traced_as",
    "traced_megatron",
    "untraced_megatron",
]

NEW_GRADIENT_LABEL = "a new 16-bit gradient, added into Megatron's fp32 main_grad and dropped"
EMBEDDING = "embed_tokens"
"""The token embedding's module name under the traced TP plan (trainmem/trace/tensor_parallel.py
applies it to models with this name only)."""
BUFFER_LABEL = "Megatron's contiguous fp32 gradient buffer (grad_data, from wrap time)"


def megatron_refusals(training: TrainingConfig) -> list[str]:
    """What of a Megatron run :func:`apply_megatron` does not model, as ``field=value`` (empty:
    it does)."""
    t = training
    out = []
    if t.context_parallel_size > 1:
        out.append(f"context_parallel_size={t.context_parallel_size}")
    if t.pipeline_parallel_size > 1 and t.pipeline_schedule == "gpipe":
        # megatron-core schedules 1F1B or interleaved 1F1B only (pipeline_parallel/schedules.py
        # get_forward_backward_func); +7.8 % vs the formulas' GPipe on the agreement Llama
        out.append("pipeline_schedule=gpipe")
    if t.zero_stage not in (0, 1):
        out.append(f"zero_stage={t.zero_stage}")
    if t.offload != "none":
        out.append(f"offload={t.offload}")
    if optimizer_standin(t) is not None:
        older = older_torch_step(t) and not OPTIMIZER_TABLE[t.optimizer].untraceable
        out.append(f"torch_version={t.torch_version}" if older else f"optimizer={t.optimizer}")
    if t.is_lora:  # Megatron-LM trains no adapters (PEFT on megatron-core is NeMo's)
        out.append(f"lora_rank={t.lora_rank}")
    if t.quantize_base != "none":
        out.append(f"quantize_base={t.quantize_base}")
    return out


def untraced_megatron(training: TrainingConfig) -> str:
    """One refusal for a Megatron run the traced paths do not model, as ``framework=megatron
    (<field=value>: why; what works)`` (Note [Megatron on a traced step])."""
    why = megatron_refusals(training)
    return (
        "framework=megatron ("
        + (f"{', '.join(why)}: " if why else "")
        + "megatron-core's context parallelism, GPipe (Megatron has none), its ZeRO-2/3 "
        "(custom FSDP), CPU offload, LoRA and quantized bases are not traced; traced: "
        "--framework megatron on one GPU or over --data-parallel-size N with --zero-stage 0 "
        "or 1 (the distributed optimizer), with --tensor-parallel-size N (and "
        "--sequence-parallel) and --pipeline-parallel-size N (1F1B or interleaved), with a "
        "torch-traceable optimizer, megatron-core's memory applied to the transformers "
        "layers; or --engine analytic)"
    )


def traced_megatron(training: TrainingConfig) -> bool:
    """A Megatron run the traced paths model (Note [Megatron on a traced step]): one GPU or
    data parallelism, with or without the distributed optimizer (``zero_stage`` 0 or 1), with
    tensor (+ sequence) parallelism (Note [Megatron's tensor parallelism on a traced step])
    and pipelining."""
    return training.framework == "megatron" and not megatron_refusals(training)


def megatron_traced_as(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs for a Megatron run: one rank's plain loop (its tensor- and
    sequence-parallel layers as they are) with torch's fused AdamW as the optimizer stand-in
    (its states and step replaced by :func:`apply_megatron`)."""
    return replace(
        training,
        data_parallel_size=1,
        zero_stage=0,
        optimizer="adamw",
        optimizer_implementation="fused",
    )


def apply_megatron(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced plain-loop step as a Megatron run has it (Note [Megatron on a traced step]).

    Args:
        schedule: a traced step of :func:`megatron_traced_as`'s settings.
        model: the model's shape (the states and the buffer from the analytic layout), or None
            (from the traced tensors, Note [Traced tensors as model states] in
            trainmem/traced_transforms.py).
        training: the Megatron run.

    Returns:
        The schedule with Megatron's optimizer states, its fp32 gradient buffer and each new
        16-bit gradient dropped once added into it.
    """
    if training.pipeline_parallel_size > 1:
        # one stage's schedule: its own tensors' states (Note [Traced tensors as model
        # states]; the analytic layout handed here is the whole model's)
        model = None
    with_states = apply_optimizer(schedule, model, training)
    if not gradient_buffer_from_init(training):  # no master weights (bf16-true, 32-true)
        return with_states
    if model is not None:
        buffer_bytes = state_layout(model, training).total("grad_bytes")
    else:
        buffer_bytes = sum(s.grad_bytes for s in traced_tensor_states(schedule, training))
    buffer = Op("alloc", buffer_bytes, Cat.GRADIENT, "init", "grad/main_grad", "(model)",
                BUFFER_LABEL)  # fmt: skip
    dropped: set[str] = set()
    tp = training.tensor_parallel_size
    setup = _main_grad(with_states.setup, dropped, tp)
    step = _main_grad(with_states.step, dropped, tp)
    if setup:
        return StepSchedule(setup=after_state(setup, buffer), step=step, name=schedule.name)
    return StepSchedule(setup=(), step=after_state(step, buffer), name=schedule.name)


def _main_grad(items: Sequence[Item], dropped: set[str], tp: int) -> tuple[Item, ...]:
    """``items`` with each gradient autograd makes in the backward a temporary freed at once
    (Megatron's hook adds it into ``main_grad``), its own later free dropped; under tensor
    parallelism the token embedding's one rank's vocabulary shard (Note [Megatron's
    vocabulary-parallel embedding gradient])."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, Repeat):
            body = _main_grad(item.body, dropped, tp)
            out.append(Repeat(body, item.count, item.reverse, item.start, item.independent))
            continue
        if item.category is not Cat.GRADIENT:
            out.append(item)
        elif item.action == "alloc" and item.phase == "backward":
            new = item._replace(category=Cat.TEMPORARY, label=NEW_GRADIENT_LABEL)
            if tp > 1 and item.module.endswith(EMBEDDING):
                new = new._replace(size_bytes=-(-item.size_bytes // tp))
            out += [new, new._replace(action="free")]
            dropped.add(item.key)
        elif not (item.action == "free" and item.key in dropped):
            out.append(item)
    return tuple(out)


def megatron_note(training: TrainingConfig) -> str:
    """The estimate's note for a Megatron run on a traced step."""
    dp = training.data_parallel_size
    optimizer = (
        f"the distributed optimizer's fp32 master weights and states over {dp} ranks"
        if training.optimizer_states_partitioned
        else "fp32 master weights and optimizer states"
    )
    tp = training.tensor_parallel_size
    if tp > 1:
        optimizer += (
            f", tensor parallelism over {tp} ranks as DTensor's plan (the embedding's new "
            "gradient one vocabulary shard, as megatron-core's VocabParallelEmbedding)"
        )
    return (
        "framework=megatron: the transformers model's layers were traced as a stand-in for "
        "megatron-core's GPTModel (their weights, activations and transients), with Megatron's "
        "vocabulary-parallel cross-entropy run on their logits; Megatron's memory applied as "
        f"the formulas' rules: {optimizer}, one contiguous fp32 gradient buffer from wrap "
        "time, each new 16-bit gradient dropped once added into it (Note [Megatron on a "
        "traced step] in trainmem/traced_megatron.py)"
    )
