"""ChatGLM's own int8 / int4 quantize (``--quantize-base chatglm-int8 | chatglm-int4``) on fake
tensors.

Note [ChatGLM's quantize]
    ChatGLM2 / ChatGLM3 ship their own ``model.quantize(bits)`` in their remote code, which
    THUDM's P-Tuning v2 scripts run with ``--quantization_bit 4 | 8`` (ChatGLM2-6B
    ptuning/main.py and THUDM/ChatGLM3 finetune_demo/finetune.py @7559fe2:
    ``model.quantize(model_args.quantization_bit)``, then ``model.half()`` and
    ``model.transformer.prefix_encoder.float()``, ``gradient_checkpointing_enable()``,
    ``enable_input_require_grads()``). Source: THUDM/chatglm3-6b quantization.py (the Hub
    repo's remote code, read from its copy in DracoUnion/chatglm3-6b-int4-lora @61985f2;
    ChatGLM2-6B's is the same code):

    * which linears: ``quantize(model, bits)`` replaces the encoder's four per layer
      (``self_attention.query_key_value``, ``self_attention.dense``, ``mlp.dense_h_to_4h``,
      ``mlp.dense_4h_to_h``) by ``QuantizedLinear``; the embedding, the prefix encoder and
      ``output_layer`` stay 16-bit. The stand-in (Note [Remote-code stand-ins]) has exactly
      these four as ``nn.Linear`` (its fused ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
      ``down_proj``) beside the LM head, which is kept, as for every quantized base;
    * storage: ``weight``, int8 of [out, in * bits / 8] (int4: two values a byte,
      ``compress_int4_weight``), and ``weight_scale``, [out] in the weight's dtype (16-bit:
      ``extract_weight_to_half`` asserts fp16 / bf16), both ``requires_grad=False``; the bias
      as it was: :func:`~trainmem.specs.quantization.quantized_weight_bytes` (one ``uint8``
      tensor of those bytes here);
    * forward (``W8A16Linear.forward``): the input as a 2-D view (``inp.contiguous().view``,
      no copy for a contiguous input), the 16-bit weight rebuilt
      (``extract_weight_to_half``: int8, ``weight.to(scale.dtype) * scale[:, None]``, two
      [out, in] tensors, the first freed after the product; int4, one kernel output), ``inp.mm
      (weight.t())``, the rebuilt weight freed on return; ``ctx.save_for_backward(inp,
      quant_w, scale_w)``: every quantized linear saves its input, whether or not it needs a
      gradient; then ``output + self.bias`` (a new tensor) where there is a bias;
    * backward (``W8A16Linear.backward``, run when the input needs a gradient: with the
      prefix's keys and values and ``enable_input_require_grads`` every layer's does): the
      weight rebuilt again, ``grad_input = grad_output.mm(weight)``, and ``grad_weight =
      grad_output.t().mm(inp)`` (after ``grad_output.contiguous()``, a copy of a
      non-contiguous gradient), a full 16-bit [out, in] gradient of the frozen weight,
      computed unconditionally (no ``ctx.needs_input_grad`` test) and returned for
      ``quant_w``, which does not require grad, so autograd drops it when the node's outputs
      go: rebuilt weight, input gradient and weight gradient are alive together at the end of
      each quantized linear's backward.

    The stand-in (:class:`_W8A16Linear`) makes the same allocations in the same order with
    the same lifetimes. Not modelled: the quantization itself (each weight moved to the GPU
    and quantized there one linear at a time, on the model still on the CPU: a load-time
    transient of one linear, before the step). The analytic formulas do not run it:
    ChatGLM's quantize is only allowed under
    prompt learning (:func:`~trainmem.specs.training._check_chatglm_quantize`), which the
    formulas refuse (Note [Prefix tuning] in :mod:`trainmem.trace.prefix`).
"""

from __future__ import annotations

import types
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.quantization import quantized_weight_bytes
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.autograd import Function  # noqa: E402

__all__ = ["chatglm_quantize"]

CHATGLM_MODEL_TYPES = frozenset({"chatglm"})
"""The ``model_type`` whose remote code has ``quantize(bits)`` (ChatGLM2 / ChatGLM3; GLM-4's
remote code has none)."""


def _rebuilt_weight(shape: tuple[int, int], bits: int, dtype: Any, device: Any) -> Any:
    """``extract_weight_to_half``'s allocations (Note [ChatGLM's quantize]): int8, the cast and
    the scaled product (the cast freed after it); int4, the kernel's one output."""
    if bits == 8:
        cast = torch.empty(shape, dtype=dtype, device=device)
        weight = torch.empty(shape, dtype=dtype, device=device)
        del cast
        return weight
    return torch.empty(shape, dtype=dtype, device=device)


class _W8A16Linear(Function):
    """ChatGLM's ``W8A16Linear`` with its memory (Note [ChatGLM's quantize])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Any, packed: Any, shape: tuple[int, int], bits: int, dtype: Any
    ) -> Any:
        ctx.inp_shape, ctx.shape, ctx.bits, ctx.dtype = x.size(), shape, bits, dtype
        inp = x.contiguous().view(-1, x.size(-1))
        weight = _rebuilt_weight(shape, bits, dtype, x.device)
        output = inp.mm(weight.t())
        del weight
        ctx.save_for_backward(inp, packed)
        return output.view(*ctx.inp_shape[:-1], shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: Any) -> tuple[Any, ...]:  # type: ignore[override]
        inp, _ = ctx.saved_tensors
        weight = _rebuilt_weight(ctx.shape, ctx.bits, ctx.dtype, grad_output.device)
        grad_output = grad_output.contiguous().view(-1, ctx.shape[0])
        grad_input = grad_output.mm(weight)
        grad_weight = grad_output.t().mm(inp)  # for the frozen packed weight: dropped
        return grad_input.view(ctx.inp_shape), grad_weight, None, None, None


def _forward(self: Any, x: Any) -> Any:
    """``QuantizedLinear.forward``: the matmul, then ``output + self.bias``."""
    output = _W8A16Linear.apply(
        x, self.weight, self.dequantized_shape, self.weight_bit_width, self.compute_dtype
    )
    if self.bias is not None:
        output = output + self.bias
    return output


def chatglm_quantize(model: Any, training: TrainingConfig, kept: set[int], model_type: str) -> int:
    """Replace, in place, each frozen linear of ``model`` outside ``kept`` (the LM head) by
    ChatGLM's ``QuantizedLinear`` stand-in (Note [ChatGLM's quantize]).

    Args:
        model: the ChatGLM stand-in as built for the trace, after the prompt learning's
            wrapping (the base frozen).
        training: ``quantize_base`` (``chatglm-int8`` / ``chatglm-int4``), ``compute_dtype``.
        kept: ids of the modules left unconverted.
        model_type: the ``model_type`` of the config the user gave.

    Returns:
        The number of linears replaced.

    Raises:
        SpecError: ``quantize_base`` on a model other than ChatGLM2 / ChatGLM3.
    """
    if model_type not in CHATGLM_MODEL_TYPES:
        raise SpecError(
            "quantize_base",
            f"{training.quantize_base} is ChatGLM's own quantize (its remote code's "
            f"quantization.py), which {model_type or type(model).__name__} does not have; "
            "allowed: a ChatGLM2 / ChatGLM3 config (model_type chatglm), or none",
        )
    bits = 8 if training.quantize_base == "chatglm-int8" else 4
    dtype = getattr(torch, training.compute_dtype)
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or id(module) in kept:
            continue
        if weight is None or weight.requires_grad:
            continue
        size = quantized_weight_bytes(weight.numel(), module.out_features, training.quantize_base)
        packed = torch.empty(size, dtype=torch.uint8, device=weight.device)
        module.weight = torch.nn.Parameter(packed, requires_grad=False)
        module.dequantized_shape = (module.out_features, module.in_features)
        module.weight_bit_width = bits
        module.compute_dtype = dtype
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count
