"""What ``torch.distributed.pipelining`` itself keeps on a pipeline stage, beyond the layers'
saved activations: the stage outputs held for backward, the last stage's outputs held for the
step's return value, and the per-micro-batch receive buffers.

Note [Pipeline stage buffers]
    ``torch.distributed.pipelining`` (torch/distributed/pipelining/stage.py, the same since
    torch 2.4; torchtitan runs it for ``--pipeline-parallel-size``):

    * ``forward_one_chunk`` stores every micro-batch's stage output in ``fwd_cache`` until that
      micro-batch's ``backward_one_chunk`` (``stage_backward`` differentiates it). Under
      activation checkpointing the last layer's output is not among the layer's saved tensors,
      so a non-last stage holds one output tensor (the residual stream at the stage boundary)
      per micro-batch in flight (the one in backward included), on top of the saved layer
      inputs.
    * On the last stage ``forward_one_chunk`` also appends the output (the logits) to
      ``output_chunks``, which is cleared only by ``clear_runtime_states`` at the start of the
      next ``step()``; ``step()`` returns ``_merge_outputs(output_chunks)``, a ``torch.cat`` of
      them (torchtitan discards it). So the last stage holds the logits of every micro-batch
      of the step, and a copy of all of them at its end.
      Megatron's schedules do not (megatron-core 0.9.0 megatron/core/pipeline_parallel/
      schedules.py ``forward_step``: the last stage's output tensor is ``loss_func``'s reduced
      loss, and only ``loss_reduced`` goes to ``forward_data_store``), so its last stage keeps
      no logits past each micro-batch's loss
      (``FrameworkConventions.pipeline_last_stage_output_is_loss``).
    * ``_prepare_forward_infra`` / ``_prepare_backward_infra`` allocate, at the first step, one
      receive buffer per micro-batch (``args_recv_info[chunk]``: the stage input on every stage
      but the first; ``grad_recv_info[chunk]``: the gradient of the stage output on every stage
      but the last); they live as long as the schedule. The input buffers of micro-batches in
      flight are the first layer's saved input (already counted with the activations); the
      others are extra.

    Under interleaving (``ScheduleInterleaved1F1B``) a rank holds v stages, each with its own
    ``fwd_cache`` and receive buffers (``_prepare_forward_infra`` per stage): the first rank's
    first stage and the last rank's last one are the only first and last stages, so the
    buffers are summed over the rank's v stages, the chunks in flight spread over them. Seen in
    the trace of llama-3.1-70b FSDP 8 x TP 8 + SP x PP 4 (rank 3: stages 3 and 7, 24 receive
    buffers: 8 inputs and 8 gradients for stage 3, 8 inputs for stage 7).

    The boundary tensor is the residual stream of one micro-batch on one rank: sequence-sharded
    under sequence parallelism (torchtitan's TP plan: the block outputs are ``Shard(1)`` local
    tensors) and context parallelism; the logits are vocabulary-sharded under TP (loss
    parallel).

Note [Megatron's pipeline stage buffers]
    megatron-core keeps neither the stage outputs nor persistent receive buffers
    (megatron/core/pipeline_parallel/schedules.py and p2p_communication.py, the same at
    core_r0.9.0 and at 7e6a045 of Jul 2026;
    ``FrameworkConventions.pipeline_sent_outputs_freed``):

    * ``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving`` append
      each micro-batch's output to ``output_tensors`` for its backward, but call
      ``deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)`` right
      after sending it: ``out.data = torch.empty((1,), ...)``, the grad_fn kept (Megatron-LM
      sets ``deallocate_pipeline_outputs = True``: training/arguments.py
      ``core_transformer_config_from_args`` at core_r0.9.0, training/argument_utils.py at
      7e6a045). ``backward_step`` then runs ``custom_backward``, the C++ engine's
      ``run_backward`` on the 1-element output with the received gradient. So no stage output
      outlives its send: ``in_flight_outputs`` is 0.
    * ``_communicate`` receives every tensor into a new ``torch.empty(tensor_shape,
      requires_grad=True, dtype=config.pipeline_dtype)`` per message. A received input lives
      in ``input_tensors`` until its micro-batch's backward: it is the first layer's saved
      input, counted with the activations. A received gradient (``output_tensor_grad``,
      received by ``send_forward_recv_backward`` before the backward) lives through that
      backward: one boundary tensor during a backward on a rank with a non-last stage
      (``backward_grad``). No buffer outlives its message: ``recv_buffers`` is 0.

    Megatron's last stage keeps no logits either (``output_chunk`` 0, the note above).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

__all__ = ["StageBuffers", "stage_buffers"]


@dataclass(frozen=True, slots=True)
class StageBuffers:
    """Bytes ``torch.distributed.pipelining`` keeps on one stage (Note [Pipeline stage
    buffers]).

    Attributes:
        in_flight_outputs: stage outputs of the micro-batches in flight, the current one
            included (non-last stage).
        output_chunk: one micro-batch's logits kept in ``output_chunks`` (last stage; 0
            elsewhere, and under Megatron's schedules).
        recv_buffers: the persistent receive buffers not already counted as saved inputs.
        backward_grad: the received output gradient alive through one micro-batch's backward,
            when it is allocated per message (Note [Megatron's pipeline stage buffers]; 0
            under torch's pipelining, whose gradient buffers are in ``recv_buffers``).
    """

    in_flight_outputs: int
    output_chunk: int
    recv_buffers: int
    backward_grad: int = 0


def boundary_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """One micro-batch's residual stream at a stage boundary, on one rank: ``b * s * h`` values
    of the residual dtype, split like the layer input (``layer_input``: by context parallelism,
    and by tensor parallelism under sequence parallelism)."""
    _, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return -(-r * t * model.hidden_size // parallel_divisor("layer_input", training))


def logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """One micro-batch's logits on one rank: ``b * s * V`` values of the compute dtype (the
    output projection's result before the loss upcasts it), vocabulary-parallel under TP."""
    if model.head not in ("causal-lm", "masked-lm"):
        return 0
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return -(-c * t * model.vocab_size // parallel_divisor("logits", training))


def stage_buffers(
    model: ModelSpec, training: TrainingConfig, *, in_flight: float, first: bool, last: bool
) -> StageBuffers:
    """What the pipeline runtime keeps on one stage; see Note [Pipeline stage buffers].

    Args:
        model / training: what is trained and how (``gradient_accumulation_steps`` is the
            number of micro-batches of the step).
        in_flight: micro-batches whose activations the stage holds at once.
        first / last: the stage is the first / the last one.

    Returns:
        The buffers; all zero without pipeline parallelism.
    """
    if training.pipeline_parallel_size == 1:
        return StageBuffers(0, 0, 0)
    m = training.gradient_accumulation_steps
    edge = boundary_bytes(model, training)
    # the rank's stages (Note [Pipeline stage buffers]): v under interleaving, of which only
    # the first rank's first is the first stage and the last rank's last the last one
    v = training.virtual_pipeline_stages if training.pipeline_schedule == "interleaved-1f1b" else 1
    non_first, non_last = v - int(first), v - int(last)
    # ``in_flight`` counts the rank's whole layer set: in_flight * v chunks, spread over its
    # stages
    outputs = round(in_flight * non_last * edge)
    # input buffers of the micro-batches not in flight, gradient buffers of every micro-batch
    recv = max(m * non_first - round(in_flight * non_first), 0) * edge + m * non_last * edge
    # Megatron's last stage hands its schedule the loss, not the logits
    # (``FrameworkConventions.pipeline_last_stage_output_is_loss``)
    keeps_logits = last and not training.conventions.pipeline_last_stage_output_is_loss
    logits = logits_bytes(model, training) if keeps_logits else 0
    if training.conventions.pipeline_sent_outputs_freed:
        # Note [Megatron's pipeline stage buffers]: outputs freed once sent, receives per
        # message; one received gradient during a backward
        return StageBuffers(0, logits, 0, edge if non_last else 0)
    return StageBuffers(outputs, logits, recv)
