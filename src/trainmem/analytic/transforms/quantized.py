"""Quantized bases (QLoRA's NF4, int8) as a transform: the dequantized weight each quantized
linear makes in its forward and again in its backward, one at a time, and the LM head's.

Source: bitsandbytes autograd/_functions.py ``MatMul4Bit`` (``dequantize_4bit`` in forward
and backward, freed after the matmul); sizes :func:`~trainmem.analytic.buffers.
dequantized_weight_bytes`, :func:`~trainmem.analytic.activations.lm_head_dequant_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainmem.analytic.backward_transients import mlp_backward_parts
from trainmem.analytic.buffers import (
    dequantize_cast_bytes,
    dequantized_weight_bytes,
    largest_base_numel,
)
from trainmem.analytic.checkpointing import layer_is_checkpointed
from trainmem.analytic.head import lm_head_dequant_bytes
from trainmem.analytic.lora import BNB_4BIT, unsloth_fast_lora
from trainmem.analytic.mlp import EXPERT_LOOP_FAMILIES, EXPERT_LOOP_UNTIL
from trainmem.analytic.params import linear_shapes
from trainmem.analytic.pipeline import logits_bytes
from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.frameworks import UNSLOTH_DEQUANT_BUFFER_SINCE
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def _head_bytes(ctx: RankContext) -> int:
    return lm_head_dequant_bytes(ctx.model, ctx.training) if ctx.rank.has_head else 0


def per_expert_linears(model: ModelSpec, training: TrainingConfig) -> bool:
    """The MoE layer's routed experts are one ``nn.Linear`` triple per expert, each quantized
    by itself (Note [Dequantized expert weights]): a family of
    :data:`~trainmem.analytic.mlp.EXPERT_LOOP_FAMILIES` in transformers' model code before
    :data:`~trainmem.analytic.mlp.EXPERT_LOOP_UNTIL`."""
    return (
        model.num_experts > 1
        and training.conventions.hf_model_code
        and model.model_type in EXPERT_LOOP_FAMILIES
        and training.transformers_release < EXPERT_LOOP_UNTIL
    )


def _expert_states(ctx: RankContext) -> list[TensorState]:
    """The layer's tensors with its routed experts sized one linear at a time where they are
    separate modules (Note [Dequantized expert weights])."""
    states = ctx.layer_states
    if per_expert_linears(ctx.model, ctx.training):
        one = max(
            i * o
            for name, (i, o, n) in linear_shapes(ctx.model).items()
            if name in ("gate", "up", "down") and n == ctx.model.num_experts
        )
        states = [replace(st, numel=one) if st.name.startswith("experts_") else st for st in states]
    return states


def layer_dequantized_bytes(ctx: RankContext) -> int:
    """Bytes of the largest dequantized weight one of the layer's quantized linears makes
    (:func:`~trainmem.analytic.buffers.dequantized_weight_bytes`), its routed experts counted
    one linear at a time where they are separate modules.

    Note [Dequantized expert weights]
        The layout holds a MoE layer's routed experts as transformers 5's two 3-D parameters
        (``experts_gate_up`` [E, 2i, h], ``experts_down`` [E, h, i]). transformers 4.48
        modeling_mixtral.py builds each expert as ``MixtralBlockSparseTop2MLP`` with three
        ``nn.Linear`` (w1, w3: [i, h]; w2: [h, i]), which ``BitsAndBytesConfig`` replaces one by
        one with ``Linear4bit`` (transformers integrations/bitsandbytes.py
        ``_replace_with_bnb_linear``); ``MatMul4Bit`` dequantizes its own weight for its matmul
        and frees it after (bitsandbytes autograd/_functions.py), and the block calls the
        experts one after another. So the dequantized weight of an expert is i h elements in
        the compute dtype, not the E experts' 2 E i h: Mixtral-8x7B, 14,336 x 4,096 x 2 B =
        117,440,512 B, not 1,879,048,192 B.
    """
    return dequantized_weight_bytes(_expert_states(ctx), ctx.training)


def layer_cast_bytes(ctx: RankContext) -> int:
    """Bytes of the fp16 dequantization the layer's largest quantized linear makes before its
    cast to the compute dtype (:func:`~trainmem.analytic.buffers.dequantize_cast_bytes`)."""
    largest = largest_base_numel(_expert_states(ctx), ctx.training)
    return dequantize_cast_bytes(largest, ctx.training)


def _head_cast_bytes(ctx: RankContext) -> int:
    """The same fp16 dequantization for a quantized LM head (:func:`_head_bytes` is its cast)."""
    if not _head_bytes(ctx):
        return 0
    model, training = ctx.model, ctx.training
    numel = model.vocab_size * model.hidden_size // training.tensor_parallel_size
    return dequantize_cast_bytes(numel, training)


def unsloth_dequant_buffers(ctx: RankContext) -> tuple[int, int]:
    """Bytes of Unsloth's ``WEIGHT_BUFFER`` (the layer's largest 4-bit weight in the compute
    dtype) and ``ABSMAX_BUFFER`` (its statistics in fp32, one per 64 values), kept from the
    first forward on (Note [Unsloth's fast LoRA] in trainmem/analytic/lora.py); (0, 0) where
    its kernels do not run or, before 2025.2.1, dequantize into a new tensor per matmul
    (:data:`~trainmem.specs.frameworks.UNSLOTH_DEQUANT_BUFFER_SINCE`)."""
    t = ctx.training
    if not unsloth_fast_lora(ctx.model, t) or t.quantize_base not in BNB_4BIT:
        return 0, 0
    if t.unsloth_release < UNSLOTH_DEQUANT_BUFFER_SINCE:
        return 0, 0
    largest = largest_base_numel(ctx.layer_states, t)
    return dtype_bytes(t.compute_dtype) * largest, 4 * -(-largest // 64)


class QuantizedBase(Transform):
    """The dequantized weights of a quantized base: per layer at ``layer.forward`` (the
    linears before the MLP's saved blocks), ``layer.mlp.forward`` (the down projection's,
    Note [Forward tensors held at the down projection]) and ``layer.backward`` (each made and
    freed), the LM head's from ``head.forward`` to
    ``head.post_forward`` and again at ``head.backward`` (``head.post_backward`` under an fp32
    model output, Note [Quantized head after the loss's backward]). Under Unsloth's kernels the
    forward's go into its two buffers, made at the warm-up step's start and kept
    (:func:`unsloth_dequant_buffers`).

    Note [Quantized head after the loss's backward]
        lit-gpt's quantized head under Fabric's fp32 output (``_FabricModule.forward`` ->
        ``convert_output``: each 16-bit head chunk ``.to(float32)``, then the loss per chunk,
        lit-gpt utils.py ``chunked_cross_entropy``) runs its ``MatMul4Bit`` backward after the
        whole loss's: autograd's ready queue takes the highest sequence number first
        (torch/csrc/autograd/engine.cpp ``CompareNodeTaskTime``), and the nodes were made in
        the order head matmuls < casts < (log-softmax, nll) per chunk, so every chunk's
        cross-entropy backward runs (releasing its saved fp32 log-softmax), then every cast's
        backward (fp32 gradient -> the compute dtype, the fp32 one freed), and only then the
        first head matmul's backward dequantizes the head (its fp16 copy and its cast,
        :func:`_head_cast_bytes`) beside the whole logits gradient in the compute dtype, c V t
        (:func:`~trainmem.analytic.pipeline.logits_bytes`). So the head's backward
        dequantization sits at ``head.post_backward``, after the loss's saved blocks are
        freed, with that gradient alive. The fp32 copy the loop binds stays (Note [litgpt's
        bound logits]). Reasoned from the code, checked against the generic path's trace of
        litgpt's own GPT (a 2-layer 1024-wide Llama, nf4, bf16-true: the formulas -6.9 % ->
        +0.05 % with a chunked head, -1.85 % unchunked, where the last fp32 loss gradient the
        formulas keep to the head's end is freed by the cast's backward in the trace).
    """

    name = "quantized"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.layer = layer_dequantized_bytes(ctx)
        # Note [torchao's decode before the input gradient]: its 16-bit result, 2 n bytes
        self.decoded = (
            2 * largest_base_numel(_expert_states(ctx), ctx.training)
            if ctx.training.torchao_nf4_decode
            else 0
        )
        self.head = _head_bytes(ctx)
        self.layer_cast = layer_cast_bytes(ctx)
        self.head_cast = _head_cast_bytes(ctx)
        # Note [Quantized head after the loss's backward]
        fp32_output = ctx.training.conventions.fp32_model_output
        self.after_loss = logits_bytes(ctx.model, ctx.training) if self.head and fp32_output else 0
        self.buffers = unsloth_dequant_buffers(ctx)
        # the MLP's backward as its linears (Note [An MLP's backward, linear by linear])
        self.split = mlp_backward_parts(ctx.model, ctx.training) is not None
        self.recomputed = layer_is_checkpointed(ctx.training)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return bool(layer_dequantized_bytes(ctx) or _head_bytes(ctx))

    def _layer(self, phase: Phase) -> Sequence[Op]:
        if not self.layer:
            return ()
        label = "a dequantized base weight"
        if self.decoded:  # Note [torchao's decode before the input gradient]
            label = "torchao's NF4 decode: its locals"
            loc = alloc(self.layer - self.decoded, Cat.TEMPORARY, phase, "dequant/locals",
                        "layers.{i}", label)  # fmt: skip
            label = "torchao's NF4 decode: the 16-bit weight it returns"
            d = alloc(self.decoded, Cat.TEMPORARY, phase, "dequant", "layers.{i}", label)
            return (loc, d, free(loc, phase), free(d, phase))
        d = alloc(self.layer, Cat.TEMPORARY, phase, "dequant", "layers.{i}", label)
        if not self.layer_cast:
            return (d, free(d, phase))
        # fp16 dequantization, cast to the compute dtype, fp16 freed before the matmul
        label = "a dequantized base weight before its cast"
        q = alloc(self.layer_cast, Cat.TEMPORARY, phase, "dequant/fp16", "layers.{i}", label)
        return (q, d, free(q, phase), free(d, phase))

    def _head(self, phase: Phase) -> Op:
        label = "the LM head's dequantized weight"
        return alloc(self.head, Cat.TEMPORARY, phase, "dequant/head", "head", label)

    def _head_cast(self, phase: Phase) -> Op:
        label = "the LM head's dequantized weight before its cast"
        return alloc(self.head_cast, Cat.TEMPORARY, phase, "dequant/head_fp16", "head", label)

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        if not where.first_step or not self.buffers[0]:
            return ()
        names = ("WEIGHT_BUFFER", "ABSMAX_BUFFER")
        return [
            alloc(size, Cat.BUFFER, "forward", f"unsloth/{name}", "", f"Unsloth's {name}")
            for name, size in zip(names, self.buffers, strict=True)
        ]

    def layer_forward(self, where: Where) -> Sequence[Emitted]:
        if self.buffers[0]:  # written into Unsloth's WEIGHT_BUFFER
            return ()
        return self._layer("forward")

    def layer_mlp_forward(self, where: Where) -> Sequence[Emitted]:
        """The forward's largest dequantized weight, the down projection's, beside what the
        forward holds there (Note [Forward tensors held at the down projection])."""
        if self.buffers[0]:  # written into Unsloth's WEIGHT_BUFFER
            return ()
        return self._layer("forward")

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        if self.split and not self.recomputed:  # beside down's input gradient instead
            return ()
        return self._layer("backward")  # the recompute's (or the one block's) dequantization

    def layer_mlp_down_backward(self, where: Where) -> Sequence[Emitted]:
        """The input gradient's dequantized weight: the base makes down's input gradient
        before its free (Note [An MLP's backward, linear by linear]).

        Note [torchao's decode before the input gradient]
            torchao's ``LinearNF4.backward`` computes ``grad_output @ weight.to(
            grad_output.dtype)``: ``to`` runs ``get_original_weight`` to its end (its locals,
            14 n + n / 32 bytes at its peak with the result, :func:`~trainmem.analytic.
            buffers.torchao_nf4_dequantize_bytes`) and returns the 16-bit weight (2 n), the
            locals freed on return; only then ``matmul`` allocates the input gradient
            (c t i). So the decode's peak and the input gradient are never alive together:
            the locals are freed before the gradient is made, the 2 n weight stays beside it
            (torchao v0.1 dtypes/nf4tensor.py ``LinearNF4.backward``, ``get_original_weight``;
            torchtune modules/peft/lora.py @fef3ed1 ``linear_nf4``). Checked against the
            generic path's trace of torchtune's eager QLoRA (tests/analytic/
            test_torchao_nf4_decode.py: a 256 x 4096 MLP, the formulas' backward peak was
            c t i = 524,288 B above the trace's with the decode beside the gradient).
        """
        if not self.split:
            return ()
        return self._layer("backward")

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        if not self.head:
            return ()
        d = Lifetime(self._head("forward"), "head.post_forward")
        if not self.head_cast:
            return (d,)
        q = self._head_cast("forward")
        return (q, d, free(q, "forward"))

    def _head_dequant_backward(self) -> list[Op]:
        d = self._head("backward")
        if not self.head_cast:
            return [d, free(d, "backward")]
        q = self._head_cast("backward")
        return [q, d, free(q, "backward"), free(d, "backward")]

    def head_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.head or self.after_loss:
            return ()
        return self._head_dequant_backward()

    def head_post_backward(self, where: Where) -> Sequence[Emitted]:
        """Note [Quantized head after the loss's backward]"""
        if not self.head or not self.after_loss:
            return ()
        label = "the logits gradient cast back to the compute dtype"
        g = alloc(self.after_loss, Cat.TEMPORARY, "backward", "dequant/head_grad", "head", label)
        return [g, *self._head_dequant_backward(), free(g, "backward")]
