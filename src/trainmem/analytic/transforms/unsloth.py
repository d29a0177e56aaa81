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

Note [Unsloth's offloaded layer 0 input]
    Unsloth checkpoints reentrantly and so makes the input embeddings' output require grad
    (unsloth_zoo 2026.3.4 training_utils.py ``prepare_model_for_training(use_reentrant =
    True)``: ``model.enable_input_require_grads()``; unsloth 2025.1.5 models/_utils.py
    ``prepare_model_for_kbit_training`` the same): with the embeddings frozen that output is a
    leaf, and the first layer's checkpoint node, whose input it is, points at its
    ``AccumulateGrad`` node, which holds it (torch/csrc/autograd/functions/accumulate_grad.h
    ``Variable variable``) until the graph goes after the backward. So offloading the first
    layer's input copies it to the CPU but frees nothing on the GPU: it stays, r b s h bytes,
    through the whole step (then its gradient too,
    :func:`~trainmem.analytic.checkpointing.input_grad_hook_bytes`). Its backward still
    recomputes on the copy brought back (the buffer from 2025.3.1; before, a new tensor
    beside the leaf).

Note [Unsloth before 2025.3]
    Through 2025.2.x (tags ``December-2024``, ``2025-01``, ``2025-02``; the README's context
    table dates from then, 2025-01-14) ``prepare_model_for_kbit_training(...,
    use_gradient_checkpointing = "unsloth")`` (unsloth/models/_utils.py) sets
    ``_offloaded_gradient_checkpointing`` and ``LlamaModel_fast_forward`` runs every decoder
    layer through unsloth_zoo's ``Unsloth_Offloaded_Gradient_Checkpointer`` (2025.1.3,
    gradient_checkpointing.py): ``forward`` copies the layer input to the CPU
    (``hidden_states.to("cpu", non_blocking = True)``, saved), runs the layer under
    ``no_grad``; ``backward`` copies it back into a new tensor (``.to("cuda:0")``), recomputes
    and runs the layer's backward. So: every layer's input leaves, the last one's too, at any
    length (no ``MINIMUM_SIZE``, no 512-token switch, no ``LAST_GC_INDEX``), and no GPU buffer:
    each backward makes the layer's input anew, freed with its backward. Its kernels'
    ``matmul_lora`` (unsloth/kernels/utils.py) adds the adapters as ``out += (X @ A) @ (s * B)``:
    the product is a new (t, fan_out) tensor beside ``out`` (Note [Unsloth's fast LoRA]).

Source: unsloth 2026.3.5 unsloth/models/_utils.py, unsloth/models/llama.py; unsloth_zoo
2026.3.4 unsloth_zoo/gradient_checkpointing.py (``initialize_unsloth_gradient_checkpointing``,
``UnslothCheckpointFunction``, ``unsloth_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.checkpointing import input_grad_hook_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.analytic.transforms.checkpointing import layer_plan, saved_ops
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.frameworks import (
    UNSLOTH_GPU_BUFFER_ELEMENTS,
    UNSLOTH_OFFLOAD_MIN_BYTES,
    UNSLOTH_OFFLOAD_MIN_SEQ_LEN,
    UNSLOTH_SMART_CHECKPOINT_SINCE,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase

BUFFER_LABEL = "Unsloth's reused GPU buffer of an offloaded layer input"


def unsloth_smart_checkpoint(training: TrainingConfig) -> bool:
    """The release checkpoints through ``UnslothCheckpointFunction`` (from 2025.3.1,
    :data:`~trainmem.specs.frameworks.UNSLOTH_SMART_CHECKPOINT_SINCE`), not the older
    ``Unsloth_Offloaded_Gradient_Checkpointer`` (Note [Unsloth before 2025.3])."""
    return training.unsloth_release >= UNSLOTH_SMART_CHECKPOINT_SINCE


def unsloth_offload_patched(training: TrainingConfig) -> bool:
    """Unsloth's offloaded checkpoint is patched in: full checkpointing under a framework with
    ``unsloth_offloaded_checkpointing``, at ``seq_len`` >= 512 from 2025.3.1 (Note [Unsloth's
    offloaded gradient checkpointing]; ``seq_len`` stands for ``max_seq_length``), at any
    length before (Note [Unsloth before 2025.3])."""
    return (
        training.conventions.unsloth_offloaded_checkpointing
        and training.activation_checkpointing == "full"
        and (
            training.seq_len >= UNSLOTH_OFFLOAD_MIN_SEQ_LEN
            or not unsloth_smart_checkpoint(training)
        )
    )


def layer_input_elements(model: ModelSpec, training: TrainingConfig) -> int:
    """Elements of one layer's input on this GPU: b s h."""
    return training.micro_batch_size * tokens_per_sequence(model, training) * model.hidden_size


def unsloth_buffer_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(initial, grown) bytes of Unsloth's GPU buffer: ``c * 2 * 256 * 2048`` at load and
    ``c * max(2 * 256 * 2048, b s h)`` once an offloaded input grew it (c: the model's 16-bit
    dtype, the compute dtype here); (0, 0) when the checkpoint is not patched or is the older
    one, which has no buffer (Note [Unsloth before 2025.3])."""
    if not unsloth_offload_patched(training) or not unsloth_smart_checkpoint(training):
        return 0, 0
    c, _ = compute_and_residual_bytes(training)
    grown = max(UNSLOTH_GPU_BUFFER_ELEMENTS, layer_input_elements(model, training))
    return c * UNSLOTH_GPU_BUFFER_ELEMENTS, c * grown


def unsloth_offloads_inputs(model: ModelSpec, training: TrainingConfig) -> bool:
    """The layer inputs are offloaded: the checkpoint is patched and an input has more than
    ``2 MiB // c`` elements (unsloth_zoo ``MINIMUM_SIZE``), any input before 2025.3.1 (Note
    [Unsloth before 2025.3])."""
    c, _ = compute_and_residual_bytes(training)
    n = layer_input_elements(model, training)
    large = n > UNSLOTH_OFFLOAD_MIN_BYTES // c or not unsloth_smart_checkpoint(training)
    return unsloth_offload_patched(training) and large


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
        # the smart checkpoint keeps the last layer's input and holds the others in its buffer
        self.smart = unsloth_smart_checkpoint(ctx.training)
        # Note [Unsloth's offloaded layer 0 input]
        self.leaf = input_grad_hook_bytes(ctx.model, ctx.training) > 0
        _, r = compute_and_residual_bytes(ctx.training)
        self.output = r * layer_input_elements(ctx.model, ctx.training)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return unsloth_offload_patched(ctx.training)

    def _buffer(self, phase: Phase, size: int, key: str = "unsloth_gc/buffer") -> Op:
        return alloc(size, Cat.BUFFER, phase, key, "", BUFFER_LABEL)

    def setup(self, where: Where) -> Sequence[Emitted]:
        if not self.initial:
            return ()
        return (self._buffer("init", self.initial, "unsloth_gc/buffer0"),)

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        if not where.first_step or not self.offloads or self.grown == self.initial:
            return ()
        old = self._buffer("forward", self.initial, "unsloth_gc/buffer0")
        return (self._buffer("forward", self.grown), free(old, "forward"))

    def _key(self) -> str:
        """The buffer's key: the grown one once an input outgrew the first."""
        return "unsloth_gc/buffer" if self.grown > self.initial else "unsloth_gc/buffer0"

    def _kept(self, where: Where, *, forward: bool) -> bool:
        """The layer's input stays on the GPU: the last layer run in the forward under the
        smart checkpoint (``LAST_GC_INDEX``), and the first layer's when it is the embedding
        output autograd holds as a leaf (Note [Unsloth's offloaded layer 0 input])."""
        last, first = (where.last_layer, where.first_layer)
        if not forward:  # the backward runs the layers in reverse
            last, first = first, last
        return (last and self.smart) or (first and self.leaf)

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        if not self.offloads or self._kept(where, forward=True):
            return ()
        return [free(op, "forward") for op in saved_ops(layer_plan(self.ctx), "forward", "{i}")]

    def _upload(self) -> Op:
        label = "an offloaded layer input copied back to the GPU"
        return alloc(
            self.output, Cat.ACTIVATION, "backward", "unsloth_gc/upload", "layers.{i}", label
        )

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.offloads:
            return ()
        if self._kept(where, forward=False):
            # the leaf stays; the older checkpoint still uploads its CPU copy anew
            leaf_only = self.leaf and where.last_layer and not self.smart
            return (self._upload(),) if leaf_only else ()
        made = saved_ops(layer_plan(self.ctx), "backward", "{i}")  # in the buffer's place
        if not self.smart:  # a new tensor: ``hidden_states.to("cuda:0")``
            return made
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
        if not self.offloads:
            return (held,)
        if self._kept(where, forward=False):
            leaf_only = self.leaf and where.last_layer and not self.smart
            return (held, free(self._upload(), "backward")) if leaf_only else (held,)
        if not self.smart:
            return (held,)
        return (held, self._buffer("backward", self.grown, self._key()))
