"""What a layer's forward holds at its MLP's down projection besides what the layer saves:
the tensors its Python code still references there. Symbols as in
:mod:`trainmem.analytic.activations` (c the compute dtype's bytes, r the residual stream's, t
the tokens of a micro-batch, h the hidden size, i the MLP's intermediate size).

Note [Forward tensors held at the down projection]
    A quantized base dequantizes each linear's weight inside that linear's forward and frees it
    when the matmul has returned (bitsandbytes 0.45.0 autograd/_functions.py
    ``MatMul4Bit.forward``: ``torch.nn.functional.linear(A, F.dequantize_4bit(B,
    quant_state).to(A.dtype).t(), bias)``; nn/modules.py ``Linear4bit.forward`` calls it per
    module). The largest dequantized weight of a dense layer is an MLP linear's (i h), and the
    last of them, the down projection, runs when the layer's saved activations all exist. At
    its matmul the forward also holds what its code still references, unsaved:

    * the down projection's output (c t h), made while the weight is alive (not under
      float8 casts, whose peak comes before it: Note [Float8 casts of a base weight]);
    * its input, ``act(gate) * up`` (c t i), unless the layer saves it (the term
      ``mlp/down_input``: a LoRA adapter or a base matmul that keeps its input);
    * the MLP's input, the second norm's output (r t h, the norm returns the input's dtype),
      unless saved as itself (``mlp/input`` without an autocast cast, r = c);
    * the residual, the attention block's sum (r t h; transformers 5.24 modeling_llama.py
      ``LlamaDecoderLayer.forward``: ``hidden_states = residual + hidden_states; residual =
      hidden_states``), unless the second norm saves it as itself (LayerNorm, or RMSNorm's
      ``x.to(float32)`` on an fp32 stream: :func:`~trainmem.analytic.transforms.
      checkpointing.first_norm_saves_its_input`);
    * the layer's input (r t h), bound in the caller's loop (``hidden_states =
      decoder_layer(hidden_states, ...)``), unless the first norm saves it as itself;
    * in transformers' model code, the embeddings' output (r t h), bound as ``inputs_embeds``
      in ``LlamaModel.forward`` for the whole loop (``hidden_states = inputs_embeds``): a
      tensor of its own from the second layer on (the first layer's input is that tensor),
      also where the norms save their input as itself but the embeddings are frozen
      (:func:`~trainmem.analytic.activation_shapes.frozen_embeddings`): torch records no
      saved tensor for an input that needs no grad, so the first layer's norm saves nothing
      of it (checked on a real CPU run, transformers 5.24 + peft 0.21.2 LoRA on a tiny Llama,
      saved tensors by storage: ``inputs_embeds`` is never saved, under 32-true, bf16-true,
      bf16-mixed, plain and bitsandbytes nf4 bases).

    Under full checkpointing (and op-level selective with SDPA) the layer runs without saving
    its inner tensors: the gate's output and ``act(gate)`` / ``up`` are freed once their
    product exists, so the same list holds with the product and the MLP's input always unsaved
    and the residual unsaved; the layer's input is the checkpoint's saved input, and so is the
    embeddings' output (the first layer's). Likewise, where the first norm saves its input as
    itself, the embeddings' output is the first layer's saved input. Checked against the generic
    path's trace of the agreement model (2-layer 2048-wide Llama, 2 x 256 tokens, nf4 LoRA on
    q / v, bf16-true, accelerate FSDP1): at layer 1's down projection the trace holds exactly
    these six tensors, 5,767,168 B + 5 x 2,097,152 B, beside the 23,068,672 B weight.
    The layer's start keeps a dequantized weight of the same size, made and freed there: it
    stands for the linears before the MLP's saved blocks (q / k / v / o, gate, up), each
    dequantizing in turn; it never holds more than the down projection's moment, but it is
    where a replayed allocator first caches that block (without it, dev row GT177's replay
    reserved 1.2 points more). Only the dense sequential pre-norm decoder block (Note
    [Backward of a pre-norm block]) is modelled; other blocks hold none here (their
    dequantized weight sits beside the saved blocks alone).

Note [fp32 layers over a 16-bit quantized matmul]
    Under ``bf16-true`` / ``16-true`` with peft's ``prepare_model_for_kbit_training``
    (``TrainingConfig.kbit_fp32_activations``: every 16-bit parameter but the packed weights
    cast to fp32, peft 0.21.2 utils/other.py) the residual stream is fp32, and each
    bitsandbytes linear casts its fp32 input to the 16-bit compute dtype, multiplies, and casts
    its output back (0.45.0 nn/modules.py ``Linear4bit.forward``: ``x = x.to(self.compute_dtype)
    ... .to(inp_dtype)``; ``MatMul8bitLt.forward``: ``.to(A.dtype)``), so every activation is
    fp32 (c = 4, :func:`~trainmem.analytic.activation_shapes.compute_and_residual_bytes`) but
    the matmul's own tensors: at the down projection's dequantization the forward holds down's
    output in the compute dtype (2 t h, before its cast back) and its input's 16-bit copy
    (2 t i) instead of a c t h output. Checked: a real CPU run (bitsandbytes 0.50.2, peft
    0.21.2: every quantized linear takes and returns fp32, tests/trace/test_traced_quantized.py)
    and the generic path's trace of the agreement model (nf4 on q / v, 2 x 256 tokens): the
    activations 124,205,088 B traced vs 124,205,056 B here, and at layer 1's down projection
    the trace holds down's bf16 output (2,097,152 B) and its input's bf16 copy (5,767,168 B).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    frozen_embeddings,
    tokens_per_sequence,
)
from trainmem.analytic.checkpointing import layer_checkpoint_reentrant, layer_is_checkpointed
from trainmem.analytic.float8 import float8_eager_casts
from trainmem.analytic.lora import adapter_matmul_bytes
from trainmem.analytic.mlp import sequential_pre_norm_block
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

__all__ = [
    "down_projection_held_bytes",
    "recompute_down_held_bytes",
    "recompute_gradient_cast_bytes",
    "recompute_up_held_bytes",
]


def _pre_norm_sizes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int, int, int] | None:
    """(c, r, h t, i t): the compute and residual bytes per value and the values in a layer's
    hidden- and intermediate-wide tensors on this rank, for a dense sequential pre-norm decoder
    block, the only block these Notes model; None for another block."""
    dense = model.num_experts <= 1 and model.mlp_kind == "gated"
    if not (dense and model.architecture == "decoder" and sequential_pre_norm_block(model)):
        return None
    c, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    h = model.hidden_size * t // parallel_divisor("mlp/input", training)
    i = model.intermediate_size * t // parallel_divisor("mlp/gated", training)
    return c, r, h, i


def down_projection_held_bytes(
    model: ModelSpec,
    training: TrainingConfig,
    terms: Mapping[str, int],
    *,
    input_saved: bool,
    first_layer: bool,
    has_embedding: bool,
    base_output_saved: bool = False,
    input_kept: bool = False,
) -> list[int]:
    """The tensors (bytes each) a layer's forward holds at its MLP's down projection besides
    its saved blocks (Note [Forward tensors held at the down projection]): down's output, its
    input and the MLP's input where not saved, the residual and the layer's input where the
    norms do not save them, the embeddings' output in transformers' code from the second
    layer on. Empty for a block other than a dense sequential pre-norm decoder's.

    Args:
        model: the model (hidden / intermediate sizes, block kind).
        training: batch, precision, checkpointing, conventions.
        terms: the layer's activation terms (``ActivationProfile.terms``), bytes.
        input_saved: the norms save their input as itself (LayerNorm; RMSNorm on an fp32
            stream).
        first_layer: the stack's first layer on this rank (its input is the embeddings').
        has_embedding: this rank runs the embeddings (pipeline stage 0).
        base_output_saved: down's output is a saved block of the layer made before this
            point (DoRA's ``base_result``: Note [DoRA's down moment in the forward] in
            analytic/lora_variants.py), so not one more tensor here.
        input_kept: the layer's input is a tensor held elsewhere whatever its norm saves
            (the reentrant checkpoint's saved input, which its recompute runs on: Note
            [The recompute's tensors held at the down projection] in
            analytic/backward_transients.py), so not one more tensor here.
    """
    sizes = _pre_norm_sizes(model, training)
    if sizes is None:
        return []
    c, r, h, i = sizes
    inner = layer_is_checkpointed(training)  # nothing inside the layer is saved
    # Note [Float8 casts of a base weight]: down's output is made after the cast's fp32 copies
    out = [] if float8_eager_casts(model, training) or base_output_saved else [c * h]
    if training.kbit_fp32_activations:  # Note [fp32 layers over a 16-bit quantized matmul]
        q = dtype_bytes(training.compute_dtype)
        out = [q * h, q * i]  # down's output before its cast back, its input's 16-bit copy
    if inner or not terms.get("mlp/down_input", 0):
        out.append(c * i)
    if inner or not terms.get("mlp/input", 0) or r != c:
        out.append(r * h)
    if inner or not input_saved:
        out.append(r * h)  # the residual
    # the layer's input is saved (by its norm or the checkpoint)
    kept = input_saved or inner or input_kept
    if not kept:
        out.append(r * h)  # the layer's input
    # the first layer's norm saves nothing of a frozen embeddings' output (it needs no grad)
    embeds_kept = inner or (input_saved and not frozen_embeddings(training))
    if training.conventions.hf_model_code and has_embedding and not (first_layer or embeds_kept):
        out.append(r * h)  # inputs_embeds, also the first layer's input
    return out


def recompute_up_held_bytes(
    model: ModelSpec, training: TrainingConfig, terms: Mapping[str, int], *, input_saved: bool
) -> list[int]:
    """The tensors (bytes each) a non-reentrant recompute holds at its up projection besides
    the blocks it recomputes, where a frozen 4-bit down projection ran its backward first
    (Note [The recompute's tensors held at the up projection]): the MLP's input where not
    saved as itself, its cast to the compute dtype where not saved, the residual where the
    second norm does not save it as itself. Empty for a block other than a dense sequential
    pre-norm decoder's.

    Args:
        model: the model (hidden size, block kind).
        training: batch, precision.
        terms: the layer's activation terms without checkpointing (what the recompute
            saves), bytes.
        input_saved: the norms save their input as itself (RMSNorm on an fp32 stream).
        base_output_cached: an adapted down's base output comes from op-level selective
            checkpointing's cache, a saved block of the layer (Note [The adapters' matmuls
            under op-level selective checkpointing] in analytic/op_selective.py), so not one
            more tensor here.

    Note [The recompute's tensors held at the up projection]
        Under torch's non-reentrant checkpoint (utils/checkpoint.py, ``_checkpoint_hook``'s
        unpack runs the recompute, which stops early once the last saved tensor it needs is
        packed) with a frozen bitsandbytes 4-bit down projection that saved nothing through
        the hooks (Note [A frozen 4-bit down projection before the recompute]), the last
        tensor the recompute packs is the up projection's output, saved by ``act(gate) * up``
        (transformers 5.24 modeling_llama.py ``LlamaMLP.forward``: ``down_proj(act_fn(
        gate_proj(x)) * up_proj(x))``). Its largest moment is therefore up's matmul: the
        dequantized weight (``MatMul4Bit.forward``) and up's output beside every block
        recomputed so far and what the recomputed code still references, unsaved:

        * the MLP's input ``x``, the second norm's output (r t h: RMSNorm returns the input's
          dtype), unless the layer saves it as itself (``mlp/input`` with r = c);
        * up's input cast to the compute dtype (c t h; bitsandbytes ``Linear4bit.forward``
          ``x.to(self.compute_dtype)``), where r != c and the cast is not saved
          (``mlp/input``); gate's cast was freed after gate's matmul;
        * the residual (r t h; ``LlamaDecoderLayer.forward``: ``residual = hidden_states``,
          needed for the sum after the MLP), unless the second norm saves it as itself
          (RMSNorm's ``x.to(float32)`` on an fp32 stream).

        The layer's input is the checkpoint's saved input; down's output and input do not
        exist yet. Checked against the generic path's trace of the agreement model (2-layer
        2048-wide Llama, 2 x 256 tokens, nf4 LoRA on q / v, full checkpointing): under
        autocast on an fp32 stream the recompute holds x (4,194,304 B) and its bf16 cast
        (2,097,152 B) at layer 1's up projection, the residual being the norm's saved input;
        bf16-true (accelerate FSDP-QLoRA) holds x and the residual, 2,097,152 B each.
    """
    sizes = _pre_norm_sizes(model, training)
    if sizes is None:
        return []
    c, r, h, _ = sizes
    saved = bool(terms.get("mlp/input", 0))
    out = []
    if not saved or r != c:
        out.append(r * h)  # the MLP's input
    if r != c and not saved:
        out.append(c * h)  # up's input cast
    if not input_saved:
        out.append(r * h)  # the residual
    return out


def recompute_down_held_bytes(
    model: ModelSpec,
    training: TrainingConfig,
    terms: Mapping[str, int],
    *,
    input_saved: bool,
    base_output_cached: bool = False,
) -> list[int]:
    """The tensors (bytes each) a recomputed LoRA layer holds under autocast at its down
    projection besides the blocks it recomputes and autocast's weight copies (Note [The
    recompute's tensors held at an autocast down projection]). Empty for a block other than
    a dense sequential pre-norm decoder's.

    Args:
        model: the model (hidden / intermediate sizes, block kind).
        training: batch, precision, LoRA targets, reentrancy.
        terms: the layer's activation terms without checkpointing (what the recompute
            saves), bytes.
        input_saved: the norms save their input as itself (RMSNorm on an fp32 stream).
        base_output_cached: an adapted down's base output comes from op-level selective
            checkpointing's cache, a saved block of the layer (Note [The adapters' matmuls
            under op-level selective checkpointing] in analytic/op_selective.py), so not one
            more tensor here.

    Note [The recompute's tensors held at an autocast down projection]
        Under full checkpointing of a peft LoRA model with autocast, the layer's backward
        peaks inside its recompute, at the down projection, before the recompute returns and
        before any of the layer's own backward runs: every recomputed block and autocast's
        16-bit copy of every frozen base weight (down's included, made just before its
        matmul and saved by it) is alive there, with what the recomputed code references
        unsaved and what the backward made before the recompute began:

        * three c t h tensors with an adapter on down, else one. Reentrant (torch
          utils/checkpoint.py ``CheckpointFunction.backward``: the whole layer runs under
          ``enable_grad`` before ``torch.autograd.backward``): down's base output, and with
          an adapter ``lora_B``'s output and its product with ``scaling`` (peft 0.21
          tuners/lora/layer.py ``Linear.forward``: ``result = result + lora_B(lora_A(
          dropout(x))) * scaling``). Non-reentrant (the unpack of the first saved tensor the
          layer's backward reads runs the recompute, which stops once the last tensor the
          layer saves is packed, before that op's output exists): the incoming gradient's
          cast to down's 16-bit output (the residual add's backward, r != c), and with an
          adapter the gradient times ``scaling`` (``MulBackward0``, which saves nothing, so
          it runs before ``lora_B``'s unpack) and down's base output (the recompute stops at
          ``lora_B``'s packed input);
        * with an adapter on down whose dtype differs from the compute dtype, peft's cast
          of down's input to the adapters' (a t i; ``x = self._cast_input_dtype(x,
          lora_A.weight.dtype)``), bound in ``Linear.forward``; ``lora_A`` saves autocast's
          16-bit copy of it (the ``mlp/down_input`` block), not the input itself;
        * with ``lora_dropout`` there, the dropout's output (a t i) too: ``lora_B(lora_A(
          dropout(x)))`` (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``, lines
          1098-1102) holds it until ``lora_A``'s matmul returns, beside its 16-bit copy,
          which lora_A saves, and the mask, which ``native_dropout`` saves (torch 2.13
          derivatives.yaml: its backward reads ``result1`` only; CUDA runs ``native_dropout``,
          ATen native/Dropout.cpp ``dropout``), both recomputed blocks (``lora/down_dropout``).
          Non-reentrant, that is the moment (the gradient's products were made before the
          recompute). Reentrant, lora_B's output and its product come after the dropout's
          output is freed: the larger of the two moments, lora_A's (a t i more, two c t h
          less) wherever a t i > 2 c t h;
        * down's input ``act(gate) * up`` (c t i), the argument of down's call, where no
          block is that tensor: a frozen down saves only its weight copy (Note [Frozen down
          projection's input]), an adapter in another dtype a copy;
        * the MLP's input, the second norm's output (r t h), unless saved as itself;
        * the residual (r t h) unless the second norm saves it as itself.

        The layer's output, which the reentrant checkpoint then holds (Note [Reentrant
        checkpoint's recomputed output]), is made only after these are freed, and the
        backward of down (its weight copy, the gradient's cast and the input gradient c t i)
        holds no more than this moment, so the MLP's backward is split linear by linear
        (Note [An MLP's backward, linear by linear]) rather than one block holding c h i.
        Checked by a real CPU execution (transformers 5.24 ``LlamaForCausalLM`` of the
        agreement model, 2 x 256 tokens, peft 0.21 LoRA r 16, HF gradient checkpointing with
        ``use_reentrant`` True and False, which calls ``enable_input_require_grads``
        (modeling_utils.py ``_activation_checkpointing_enable``), CUDA's autocast lists, a
        dispatch-mode storage counter): the step's peak at layer 1's recomputed down
        projection, 146,298,888 B made in the step with LoRA on q / v, 177,215,496 B on all
        seven linears, the same reentrant or not; the generic path's trace holds the same
        tensors (146,298,912 / 177,215,520 B).
    """
    sizes = _pre_norm_sizes(model, training)
    if sizes is None:
        return []
    c, r, h, i = sizes
    adapted = "down" in training.lora_targets
    reentrant = layer_checkpoint_reentrant(training)
    # down's output / the grad's cast (recompute_gradient_cast_bytes)
    first = reentrant or recompute_gradient_cast_bytes(model, training) > 0
    # the gradient's product with ``scaling`` and down's base output, with an adapter
    # (reentrant: lora_B's output and its product)
    own = (1 if base_output_cached else 2) if adapted else 0
    a = adapter_matmul_bytes(training, model)
    # peft's dropout output in the adapters' dtype, alive at lora_A's matmul
    dropout_output = adapted and a != c and training.lora_dropout > 0
    if dropout_output and reentrant and a * i > own * c * h:
        own = 0  # the moment at lora_A's matmul, before lora_B's output and its product
    out = [c * h] * (own + (1 if first else 0))
    if adapted and a != c:
        out.append(a * i)  # peft's cast of down's input to the adapters' dtype
        if dropout_output and not (reentrant and own):
            out.append(a * i)  # the dropout's output, until lora_A's 16-bit copy of it
        out.append(c * i)  # act(gate) * up itself (the block is lora_A's 16-bit copy)
    elif not terms.get("mlp/down_input", 0):
        out.append(c * i)  # act(gate) * up
    if not terms.get("mlp/input", 0) or r != c:
        out.append(r * h)  # the MLP's input
    if not input_saved:
        out.append(r * h)  # the residual
    return out


def recompute_gradient_cast_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """The incoming gradient's 16-bit cast a non-reentrant recompute runs beside (c t h; 0
    where the residual stream is in the compute dtype, under a reentrant checkpoint, or for a
    block these Notes do not model), one of :func:`recompute_down_held_bytes`' tensors.

    Note [The gradient's cast through the recompute]
        The layer's backward starts with the residual add after the MLP (transformers 5.24
        modeling_llama.py ``LlamaDecoderLayer.forward``: ``hidden_states = residual +
        hidden_states``), whose ``AddBackward0`` casts the fp32 incoming gradient to down's
        16-bit output dtype; then down's ``MmBackward0`` unpacks its first saved tensor and
        torch's non-reentrant checkpoint runs the whole recompute (torch 2.13
        utils/checkpoint.py ``_checkpoint_hook``: the unpack hook calls ``recompute_fn``), so
        that cast is alive from the recompute's start to down's backward, at every moment of
        the recompute, not only at down's (Note [The recompute's tensors held at an autocast
        down projection]): at q / k / v's DoRA moment at the recompute's start and at o's and
        up's (Note [DoRA's moment at each linear]). Traced on the 1024-wide agreement Llama
        (2 x 256 tokens, DoRA r 16 on gate / up, selective checkpointing): a 1,048,576 B
        ``layers.1`` block made before layer 1's recompute replays its first norm, alive at
        the up projection's DoRA moment, the step's peak.
    """
    sizes = _pre_norm_sizes(model, training)
    if sizes is None or layer_checkpoint_reentrant(training):
        return 0
    c, r, h, _ = sizes
    return c * h if r != c else 0
