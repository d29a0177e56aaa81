"""Unsloth's offloaded gradient checkpointing as a transform: each checkpointed layer's input
leaves for the CPU instead of being saved on the GPU, and comes back, in the backward, into
one GPU buffer reused by every layer.

Note [Unsloth's offloaded gradient checkpointing]
    ``FastLanguageModel.get_peft_model(use_gradient_checkpointing = "unsloth")``, Unsloth's
    default (unsloth 2026.3.5, tag ``March-2026``; unsloth/models/_utils.py
    ``apply_unsloth_gradient_checkpointing``), patches ``torch.utils.checkpoint.checkpoint``
    with unsloth_zoo's ``unsloth_checkpoint`` (unsloth_zoo 2026.3.4, gradient_checkpointing.py
    ``patch_unsloth_smart_gradient_checkpointing``), which always runs the reentrant
    ``UnslothCheckpointFunction``; Unsloth's Llama forward (unsloth/models/llama.py
    ``LlamaModel_fast_forward``) checkpoints every decoder layer through it. Read from that
    code:

    * patching runs ``initialize_unsloth_gradient_checkpointing``: 200 pinned CPU buffers and,
      per GPU, ``GPU_BUFFERS = torch.empty(2*256*2048, dtype)`` in the model's 16-bit dtype
      (2 MiB in bf16), kept for the run
      (:data:`~trainmem.specs.frameworks.UNSLOTH_GPU_BUFFER_ELEMENTS`);
    * ``forward``: the layer input (``args[0]``, requiring grad) of more than ``MINIMUM_SIZE
      = 2 MiB // n_bytes`` elements is copied to a pinned CPU buffer on a side stream
      (``x.copy_(arg, non_blocking = True)``) and *not* saved (``tensor_inputs.append(None)``),
      the layer runs under ``no_grad``, so nothing of it is saved on the GPU either; the GPU
      buffer is grown to the input's size (``GPU_BUFFER.resize_(new_size)``: a new storage of
      that size, the old one freed), once;
    * except the last layer run: during the first forward ``LAST_GC_INDEX`` counts the
      checkpointed layers, and from then on the layer with ``CURRENT_GC_INDEX ==
      LAST_GC_INDEX`` keeps its input saved on the GPU ("Disable offloading on the last
      layer", after torchtune PR #1443). The steady state, modelled here, keeps it (the first
      step, which offloads it too, holds less);
    * ``backward``: the input is copied back into ``GPU_BUFFERS[device][:new_size]`` and the
      layer recomputed on that buffer (``x = buffer.detach(); x.requires_grad_(True)``), so a
      layer's input in its backward costs no allocation beyond the buffer, whichever layer;
    * with ``max_seq_length < 512`` (:data:`~trainmem.specs.frameworks.
      UNSLOTH_OFFLOAD_MIN_SEQ_LEN`) Unsloth unpatches it and checkpoints plainly (reentrant):
      the base order's ``full`` checkpointing, no buffer.

    * the recomputed layer's output stays alive through the layer's backward: ``backward``
      binds ``outputs = ctx.run_function(*detached_inputs)`` and keeps it while
      ``torch.autograd.backward(outputs_with_grad, args_with_grad)`` runs the layer's
      backward (the decoder layer returns ``(hidden_states,)``, ``residual + hidden_states``,
      a new (b, s, h) tensor no node saves: unsloth 2026.3.5 models/llama.py
      ``LlamaDecoderLayer_fast_forward``); only ``grads`` is returned. So r h per token of
      every layer's backward, beside its recomputed activations and the incoming gradient
      (Note [Recomputed output held through the backward]).

    So with ``n = b s h`` elements of the layer input (c bytes each, the buffer's dtype is the
    model's): a buffer of ``c max(2 * 256 * 2048, n)`` bytes from load; in the forward every
    layer's saved input but the last's freed once the layer has run; in each backward but the
    last layer's, the layer's input held in the buffer. The schedule frees the buffer at the
    layer's pre-backward and makes the layer's saved input in its place, then makes the buffer
    again at the layer's post-backward, once the base order has freed that input: the same
    bytes at every point when the input is the buffer's size (``r = c``, the ``*-true``
    precisions Unsloth runs), the 2 MiB minimum otherwise only approximated. The CPU copies
    are host memory (not modelled on the GPU).

Note [Recomputed output held through the backward]
    A reentrant checkpoint's backward (Unsloth's ``UnslothCheckpointFunction``, and the
    ``Unsloth_Offloaded_Gradient_Checkpointer`` before 2025.3, whose ``backward`` binds
    ``(output,) = ctx.forward_function(hidden_states, *ctx.args)`` and runs
    ``torch.autograd.backward(output, dY)``) holds the recomputed layer's output until the
    layer's backward has returned. The schedule makes it at ``layer.backward`` (after the
    recompute) and frees it at ``layer.post_backward``: r b s h bytes. Counted against the
    code for Llama-3.1-8B at the last layer's LoRA_MLP backward (the step's peak at long
    context), in (b, s, h) 16-bit tensors: the kept input 1, the GPU buffer 1, LoRA_QKV's X
    1, q 1, k and v 0.25 each (as flash-attn saves them; xformers, Unsloth's choice without
    flash-attn, saves k and v expanded to every head, 1 each: not modelled), the attention
    output 1 (also LoRA_W's X), the second norm's input 1, LoRA_MLP's X 1, ``e`` and ``g``
    7, the incoming gradient 1, ``DW`` 3.5 and this output 1: 20, of which trainmem had 19.
    torch's own reentrant ``CheckpointFunction.backward`` does the same
    (torch/utils/checkpoint.py); whether trainmem's rules for transformers' reentrant
    checkpointing hold it was not checked here.

Source: unsloth 2026.3.5 unsloth/models/_utils.py, unsloth/models/llama.py; unsloth_zoo
2026.3.4 unsloth_zoo/gradient_checkpointing.py (``initialize_unsloth_gradient_checkpointing``,
``UnslothCheckpointFunction``, ``unsloth_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.analytic.transforms.checkpointing import layer_plan, saved_ops
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.frameworks import (
    UNSLOTH_GPU_BUFFER_ELEMENTS,
    UNSLOTH_OFFLOAD_MIN_BYTES,
    UNSLOTH_OFFLOAD_MIN_SEQ_LEN,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase

BUFFER_LABEL = "Unsloth's reused GPU buffer of an offloaded layer input"


def unsloth_offload_patched(training: TrainingConfig) -> bool:
    """Unsloth's offloaded checkpoint is patched in: full checkpointing under a framework with
    ``unsloth_offloaded_checkpointing`` at ``seq_len`` >= 512 (Note [Unsloth's offloaded
    gradient checkpointing]; ``seq_len`` stands for ``max_seq_length``)."""
    return (
        training.conventions.unsloth_offloaded_checkpointing
        and training.activation_checkpointing == "full"
        and training.seq_len >= UNSLOTH_OFFLOAD_MIN_SEQ_LEN
    )


def layer_input_elements(model: ModelSpec, training: TrainingConfig) -> int:
    """Elements of one layer's input on this GPU: b s h."""
    return training.micro_batch_size * tokens_per_sequence(model, training) * model.hidden_size


def unsloth_buffer_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(initial, grown) bytes of Unsloth's GPU buffer: ``c * 2 * 256 * 2048`` at load and
    ``c * max(2 * 256 * 2048, b s h)`` once an offloaded input grew it (c: the model's 16-bit
    dtype, the compute dtype here); (0, 0) when the checkpoint is not patched."""
    if not unsloth_offload_patched(training):
        return 0, 0
    c, _ = compute_and_residual_bytes(training)
    grown = max(UNSLOTH_GPU_BUFFER_ELEMENTS, layer_input_elements(model, training))
    return c * UNSLOTH_GPU_BUFFER_ELEMENTS, c * grown


def unsloth_offloads_inputs(model: ModelSpec, training: TrainingConfig) -> bool:
    """The layer inputs are offloaded: the checkpoint is patched and an input has more than
    ``2 MiB // c`` elements (unsloth_zoo ``MINIMUM_SIZE``)."""
    c, _ = compute_and_residual_bytes(training)
    n = layer_input_elements(model, training)
    return unsloth_offload_patched(training) and n > UNSLOTH_OFFLOAD_MIN_BYTES // c


class UnslothOffloadedCheckpointing(Transform):
    """Inserts: ``setup`` the 2 MiB buffer; ``step.begin`` (warm-up step) its growth to the
    layer input's size; ``layer.post_forward`` the free of the layer's saved input (but the
    last layer's); ``layer.pre_backward`` the buffer swapped for the layer's input and
    ``layer.post_backward`` back (but the first layer run in the backward, whose input
    stayed); ``layer.backward`` the recomputed output, freed at ``layer.post_backward``
    (Note [Recomputed output held through the backward])."""

    name = "unsloth_offload"
    layer_position = frozenset({"first", "last"})

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.initial, self.grown = unsloth_buffer_bytes(ctx.model, ctx.training)
        self.offloads = unsloth_offloads_inputs(ctx.model, ctx.training)
        _, r = compute_and_residual_bytes(ctx.training)
        self.output = r * layer_input_elements(ctx.model, ctx.training)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return unsloth_offload_patched(ctx.training)

    def _buffer(self, phase: Phase, size: int, key: str = "unsloth_gc/buffer") -> Op:
        return alloc(size, Cat.BUFFER, phase, key, "", BUFFER_LABEL)

    def setup(self, where: Where) -> Sequence[Emitted]:
        return (self._buffer("init", self.initial, "unsloth_gc/buffer0"),)

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        if not where.first_step or not self.offloads or self.grown == self.initial:
            return ()
        old = self._buffer("forward", self.initial, "unsloth_gc/buffer0")
        return (self._buffer("forward", self.grown), free(old, "forward"))

    def _key(self) -> str:
        """The buffer's key: the grown one once an input outgrew the first."""
        return "unsloth_gc/buffer" if self.grown > self.initial else "unsloth_gc/buffer0"

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        if not self.offloads or where.last_layer:
            return ()
        return [free(op, "forward") for op in saved_ops(layer_plan(self.ctx), "forward", "{i}")]

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.offloads or where.first_layer:  # the backward's first: the kept input
            return ()
        made = saved_ops(layer_plan(self.ctx), "backward", "{i}")  # in the buffer's place
        return [free(self._buffer("backward", self.grown, self._key()), "backward"), *made]

    def _output(self) -> Op:
        label = "the recomputed layer output the checkpoint's backward holds"
        return alloc(
            self.output, Cat.ACTIVATION, "backward", "unsloth_gc/output", "layers.{i}", label
        )

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        return (self._output(),)

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        held = free(self._output(), "backward")
        if not self.offloads or where.first_layer:
            return (held,)
        return (held, self._buffer("backward", self.grown, self._key()))
