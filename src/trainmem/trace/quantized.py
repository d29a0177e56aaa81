"""A quantized base (QLoRA and kin: ``--quantize-base``) on fake tensors.

bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` and GPTQ's ``QuantLinear`` run CUDA kernels, which
fake CPU tensors cannot run. What they do to memory is small and fixed, so the traced model holds
a stand-in for each quantized linear that does the same to memory with plain torch ops
(Note [Traced quantized base]); peft's LoRA wraps the model as it does a real one.

Note [Traced quantized base]
    Each frozen linear the quantizer converts (every ``nn.Linear`` / transformers ``Conv1D``
    except, for a transformers model, its output embedding, or the module of its last parameter
    when it has none: transformers integrations/bitsandbytes.py ``get_keys_to_not_convert``;
    for a diffusers model every linear: ``BnB4BitDiffusersQuantizer`` skips only
    ``llm_int8_skip_modules`` and ``_keep_in_fp32_modules``, empty by default) becomes:

    * its weight: one frozen ``uint8`` tensor of
      :func:`~trainmem.specs.quantization.quantized_weight_bytes` bytes (the analytic engine's
      per-tensor rule: 4-bit codes and absmax, int8 and its row scales, GPTQ's packed tensors);
      the bias stays as it is; the model's other parameters stay in the 16-bit dtype it was
      loaded in when peft does not upcast them (``TrainingConfig.kbit_16bit_dense``: a GPTQ
      base, or ``prepare_kbit_training=False``, under autocast), LoRA's adapters fp32; where
      peft's ``prepare_model_for_kbit_training`` runs (``TrainingConfig.kbit_fp32_upcast``, the
      decision the formulas read too) every 16-bit parameter but the packed weights is cast to
      fp32 (peft 0.21.2 utils/other.py: ``param.data = param.data.to(torch.float32)`` for a
      float16 / bfloat16 parameter that is not ``Params4bit``; bitsandbytes' ``Int8Params``
      are int8): a no-op under autocast (the model is loaded in fp32), the embeddings, norms,
      LM head and biases in fp32 under ``bf16-true`` / ``16-true``;
    * under FSDP1 (``framework="fsdp-qlora"``): bitsandbytes
      ``Linear4bit(quant_storage=<the model's dtype>)``, as Answer.AI fsdp_qlora train.py
      (50efa1e ``replace_linear(..., quant_storage=torch_dtype)``) builds it, since FSDP1
      flattens a unit into one float tensor (torch distributed/fsdp/_flat_param.py
      ``_validate_tensors_to_flatten``: "Cannot flatten integer dtype tensors"): the weight is
      the packed codes stored in that dtype (bitsandbytes functional.py ``quantize_4bit``:
      ``torch.zeros(((n + 1) // mod, 1), dtype=quant_storage)``, ``mod`` = 2 x its element
      size: ``ceil(n / 2)`` bytes in whole elements), flattened, sharded and gathered with the
      unit; the absmax statistics (:func:`~trainmem.specs.quantization.
      bnb_4bit_statistics_bytes`) are the ``QuantState``'s, not a parameter, so a ``uint8``
      buffer here that FSDP1 leaves whole on every rank (Note [bitsandbytes statistics under
      sharding] in trainmem/analytic/tensor_states.py; :func:`~trainmem.specs.quantization.
      float_quant_storage`); transformers' FSDP-QLoRA under accelerate stores them likewise
      in the dtype the model is loaded in (``bnb_4bit_quant_storage``);
    * a GPTQ base under accelerate's FSDP1 as fms-acceleration's AutoGPTQ plugin runs it
      (accelerated-peft autogptq_utils.py ``build_patch_to_view_tensor_to_parameter_for_fsdp_
      gptq``): ``qweight`` and ``qzeros`` viewed as frozen Parameters of the model's dtype,
      flattened, sharded and gathered with the unit; ``scales`` and ``g_idx`` buffers left
      whole on every rank (:func:`~trainmem.specs.quantization.unflattened_quantized_bytes`),
      here one ``uint8`` buffer of their bytes;
    * its forward: the input cast to the compute dtype, the weight dequantized into an
      ``(out, in)`` tensor of the compute dtype, the matmul, the dequantized weight freed
      (bitsandbytes autograd/_functions.py ``MatMul4Bit.forward``:
      ``F.dequantize_4bit(B, quant_state).to(A.dtype).t()`` into ``torch.nn.functional.linear``);
      outside autocast, and under it for a 16-bit input of the other dtype (an fp16 stream
      under bf16 autocast: ``TrainingConfig.kbit_dense_cast``; checked against a real CPU run,
      benchmarks/kbit_fp16_rest_cpu.py), the output cast back to the input's dtype, the
      compute-dtype output freed (bitsandbytes 0.45.0 nn/modules.py ``Linear4bit.forward``:
      ``matmul_4bit(x, ...).to(inp_dtype)`` after ``x = x.to(self.compute_dtype)``;
      ``MatMul8bitLt.forward``: ``.to(A.dtype)``): after peft's upcast under ``bf16-true``
      every quantized linear reads and returns fp32, so the whole residual stream and every
      layer activation is fp32.
      Checked against a real CPU run (bitsandbytes 0.50.2, peft 0.21.2, transformers 5.24:
      a 2-layer 128-wide Llama loaded in bf16, its linears bitsandbytes ``Linear4bit`` nf4 /
      fp4 or ``Linear8bitLt``, ``prepare_model_for_kbit_training`` then LoRA r16 on q / v,
      2 x 32 tokens): all 14 quantized linears take and return fp32, and the forward saves
      1,250,308 B of fp32 storages and 512 B of int64, as the stand-in does
      (tests/trace/test_traced_quantized.py); without the cast back the stand-in's bf16 k / v
      beside LoRA's fp32 q fail SDPA's dtype check on real tensors;
    * saved for its backward (``ctx.save_for_backward``, which checkpointing's saved-tensor
      hooks see: unpacking one runs the recompute): GPTQ's packed weight (triton v2
      ``QuantLinearFunction`` saves qweight / scales / qzeros / g_idx; no bytes here, but under
      non-reentrant checkpointing down's backward then runs after the layer's recompute, where
      bitsandbytes' ``ctx.tensors`` attribute, unseen by the hooks, lets it run before); the
      cast input when
      :attr:`~trainmem.specs.training.TrainingConfig.quantized_matmul_saves_input` (int8
      always, 4-bit before bitsandbytes 0.43.2; GPTQ's triton v2 kernel never), else nothing
      (the packed weight is a parameter); a cast input that is the input itself (already in
      the compute dtype) is the same storage, so what else saves it is not counted twice;
      under torch's non-reentrant checkpoint (``TrainingConfig.checkpoint_keeps_bnb_inputs``)
      that input is kept as bitsandbytes keeps it, a ``ctx`` attribute the hooks never see,
      alive until the graph goes (Note [bitsandbytes' inputs under non-reentrant
      checkpointing] in trainmem/analytic/held_outputs.py);
    * its backward (only when the input requires grad): the weight dequantized again for the
      input gradient, ``grad_output @ W``, then freed (``MatMul4Bit.backward``).
    * a Lightning 4-bit weight (lit-gpt; ``TrainingConfig.dequantizes_through_fp16``): each
      dequantization an fp16 tensor first, cast to the compute dtype, the fp16 freed before the
      matmul (Lightning ``_Linear4bit.quantize`` quantizes from ``torch.half``, so bitsandbytes'
      ``dequantize_4bit`` returns fp16 and ``MatMul4Bit`` casts it: ``.to(A.dtype)``).
    * peft's DoRA over it (QDoRA, Note [QDoRA] in trainmem/analytic/lora_variants.py): peft's
      ``dequantize_module_weight`` (peft 0.21.2 utils/integrations.py) returns
      ``module.dequantize()`` for a module with a ``W_q`` attribute (its HQQ dispatch), which
      the stand-in answers, its packed weight not being bitsandbytes' ``Params4bit`` /
      ``Int8Params``, with what ``dequantize_bnb_weight`` makes (:func:`_peft_dequantize`): a
      4-bit weight a new ``(out, in)`` tensor in ``QuantState.dtype`` (bitsandbytes 0.45.0
      functional.py ``dequantize_4bit``: ``torch.empty(quant_state.shape,
      dtype=quant_state.dtype)``; the compute dtype here, fp16 for a Lightning weight), an
      int8 one ``int8_vectorwise_dequant``'s fp32 ``A * stats.view(-1, 1)`` and its product
      with 1 / 127 (the first freed). peft's own DoRA code then runs on it.
    * torchtune's eager QLoRA (``TrainingConfig.torchao_nf4_decode``): each dequantization is
      torchao's ``get_original_weight()``, whose int64 indices, table lookups, scalers and
      halves are allocated in its order before the weight (:func:`_torchao_decode`; the
      analytic engine counts their peak, ``trainmem.analytic.buffers.
      torchao_nf4_dequantize_bytes``).

    The analytic engine counts the same things (``analytic/transforms/quantized.py``: the
    layer's largest dequantized weight once in its forward and once in its backward;
    ``analytic/lora.py``: the saved inputs). One difference: where the base matmul saves its
    input under autocast, a targeted linear's LoRA ``A`` saves its own autocast copy of the same
    fp32 input beside the base's, which the trace keeps and the analytic layer terms do not
    count (a 20-layer Qwen2 at hidden 128 with an int8 base: generic +3% vs analytic; nf4 with a
    current bitsandbytes saves no input: -0.2%). Not modelled by either: int8's quantized
    copies of the input (``MatMul8bitLt``: ``CA``, ``CAt``, row statistics; it saves the input
    as given, not a cast), and, under autocast, the cast of a 4-bit linear's output back to
    the input's dtype (bitsandbytes nn/modules.py ``Linear4bit.forward``: ``matmul_4bit(x,
    ...).to(inp_dtype)`` after ``x = x.to(self.compute_dtype)``: an fp32 output when the input
    is fp32), which the stand-in does outside autocast and for a 16-bit input only.
"""

from __future__ import annotations

import types
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.frameworks import TRL_BF16_NAMES_MATCHED
from trainmem.specs.quantization import (
    float_quant_storage,
    quantized_weight_bytes,
    unflattened_quantized_bytes,
)
from trainmem.specs.training import CHATGLM_QUANTIZE, TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.chatglm_quantized import chatglm_quantize

torch = require_torch()

from torch.autograd import Function  # noqa: E402

__all__ = ["quantize_base"]


class _QuantizedMatmul(Function):
    """A quantized linear's matmul with the memory of bitsandbytes' (Note [Traced quantized
    base]): the dequantized weight made and freed in forward and backward, the input saved only
    when the library saves it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Any,
        packed: Any,
        bias: Any,
        shape: tuple[int, int],
        dtype: Any,
        saves_input: bool,
        torchao: bool = False,
        through_fp16: bool = False,
        saves_packed: bool = False,
        keeps_on_ctx: bool = False,
        int8: bool = False,
        int8_copy: bool = False,
    ) -> Any:
        cast = x.to(dtype)
        weight = _dequantized(shape, dtype, x.device, torchao, through_fp16)
        # bitsandbytes' F.linear with a bias on a 3-d input returns a view of its addmm, which
        # the adapter wrapping the base may not add to in place (peft's AdaLoRA SVDLinear:
        # "A view was created in no_grad mode"; its SVDLinear4bit clones first): the same
        # one output allocation, made by matmul (not a view) and the bias added in place
        cast_bias = None if bias is None else bias.to(dtype)
        out = torch.matmul(cast, weight.t())
        del weight
        if cast_bias is not None:
            out += cast_bias
        ctx.shape, ctx.torchao, ctx.through_fp16 = shape, torchao, through_fp16
        ctx.saves_packed = saves_packed and not saves_input
        if saves_input and keeps_on_ctx and int8:
            # MatMul8bitLt's ``ctx.tensors = (CAt, subA, A)``: the input as given, and before
            # bitsandbytes 0.45.0 its int8 copy (Note [bitsandbytes' int8 inputs under
            # non-reentrant checkpointing]; subA's outlier columns not modelled)
            graded = ctx.needs_input_grad[0]
            copy = None
            if graded and int8_copy:
                copy = torch.empty(x.shape, dtype=torch.int8, device=x.device)
            ctx.tensors = (copy, None, x if graded or int8_copy else None)
        elif saves_input and keeps_on_ctx:
            # bitsandbytes' own ``ctx.tensors = (A, B)``, which non-reentrant checkpointing's
            # hooks never see (Note [bitsandbytes' inputs under non-reentrant checkpointing])
            ctx.tensors = (cast, None) if ctx.needs_input_grad[0] else (None, None)
        elif saves_input:
            ctx.save_for_backward(cast)
        elif saves_packed:  # no bytes (a parameter), but a saved tensor checkpointing sees
            ctx.save_for_backward(packed)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.saves_packed:
            # GPTQ's QuantLinearFunction.backward unpacks its saved tensors first (AutoGPTQ
            # nn_modules/triton_utils/kernels.py, fms-acceleration's gptqmodel triton_utils:
            # ``qweight, scales, qzeros, g_idx = ctx.saved_tensors``): under non-reentrant
            # checkpointing the recompute runs before its input gradient exists (bitsandbytes'
            # MatMul4Bit reads ``ctx.tensors``, which runs no recompute)
            _ = ctx.saved_tensors
        weight = _dequantized(ctx.shape, grad.dtype, grad.device, ctx.torchao, ctx.through_fp16)
        grad_input = grad @ weight
        del weight
        return grad_input, None, None, None, None, None, None, None, None, None, None, None


def _dequantized(
    shape: tuple[int, int], dtype: Any, device: Any, torchao: bool, through_fp16: bool = False
) -> Any:
    """The dequantized (out, in) weight: one allocation (bitsandbytes), torchao's decode, or
    an fp16 dequantization cast to ``dtype`` (``TrainingConfig.dequantizes_through_fp16``)."""
    if torchao:
        return _torchao_decode(shape, dtype, device)
    if through_fp16:
        return torch.empty(shape, dtype=torch.float16, device=device).to(dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _torchao_decode(shape: tuple[int, int], dtype: Any, device: Any) -> Any:
    """torchao ``NF4Tensor.get_original_weight()``'s allocations on an (out, in) weight of n
    values, in its order and with its lifetimes: per half the
    shifted bytes (n / 2, freed) and their int64 copy (4n), the two table lookups (n each),
    the scalers' quotient (2n / 64, freed) and sum (2n / 64), per half the repeated scalers
    (n, freed) and the product (n), then the stacked weight (2n), every local freed after it.
    Source: torchao dtypes/nf4tensor.py ``get_original_weight``, ``dequantize_scalers``."""
    n = shape[0] * shape[1]
    half, nb = n // 2, n // 64

    def empty(count: int, kind: Any) -> Any:
        return torch.empty(count, dtype=kind, device=device)

    bits = empty(half, torch.uint8)
    first = empty(half, torch.long)
    del bits
    bits = empty(half, torch.uint8)
    second = empty(half, torch.long)
    del bits
    lookups = (empty(half, dtype), empty(half, dtype))
    quotient = empty(nb, dtype)
    scalers = empty(nb, dtype)
    del quotient
    repeated = empty(half, dtype)
    scaled_first = empty(half, dtype)
    del repeated
    repeated = empty(half, dtype)
    scaled_second = empty(half, dtype)
    del repeated
    weight = empty(n, dtype).view(shape)
    del first, second, lookups, scalers, scaled_first, scaled_second
    return weight


def _peft_dequantize(self: Any) -> Any:
    """The dequantized weight peft's ``dequantize_module_weight`` gets for DoRA's norm (Note
    [Traced quantized base]): bitsandbytes' ``dequantize_4bit`` output in the quantization
    state's dtype, or ``int8_vectorwise_dequant``'s two fp32 products, the first freed."""
    device = self.weight.device
    if self.int8:
        scaled = torch.empty(self.dequantized_shape, dtype=torch.float32, device=device)
        weight = torch.empty(self.dequantized_shape, dtype=torch.float32, device=device)
        del scaled
        return weight
    dtype = torch.float16 if self.through_fp16 else self.compute_dtype
    return torch.empty(self.dequantized_shape, dtype=dtype, device=device)


def _features(module: Any) -> tuple[int, int]:
    """(in_features, out_features); transformers' Conv1D stores its weight as [in, out]."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    w = module.weight
    return int(w.shape[0]), int(w.shape[1])


def _forward(self: Any, x: Any) -> Any:
    out: Any = _QuantizedMatmul.apply(
        x,
        self.weight,
        self.bias,
        self.dequantized_shape,
        self.compute_dtype,
        self.saves_input,
        self.torchao_decode,
        self.through_fp16,
        self.saves_packed,
        self.keeps_on_ctx,
        self.int8,
        self.int8_copy,
    )
    if out.dtype != x.dtype and (
        not torch.is_autocast_enabled(x.device.type) or x.dtype != torch.float32
    ):
        # Note [Traced quantized base]: bitsandbytes' ``.to(inp_dtype)``; under autocast only
        # a 16-bit input's (an fp16 stream under bf16 autocast, kbit_dense_cast)
        out = out.to(x.dtype)
    return out


def _kept_in_precision(model: Any, diffusers: bool) -> set[int]:
    """ids of the modules the quantizer leaves unconverted (Note [Traced quantized base])."""
    if diffusers:
        return set()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        last = ([n for n, _ in base.named_parameters()] or [""])[-1].rpartition(".")[0]
        head = base.get_submodule(last) if last else None
    if head is None:
        return set()
    return {id(m) for m in head.modules()}


def weight_read_directly(model: Any, name: str) -> bool:
    """Whether ``model``'s module ``name`` is a fused q/k/v linear whose attention's forward
    reads its weight rather than calling it: timm's attention with a q / v bias (``q_bias``,
    ``k_bias`` a zero buffer) and ``qkv_bias_separate`` False runs
    ``F.linear(x, weight=self.qkv.weight, bias=torch.cat((q_bias, k_bias, v_bias)))`` (timm 1.0.31
    models/eva.py ``EvaAttention.forward``, models/beit.py ``Attention.forward``,
    models/swin_transformer_v2.py ``WindowAttention.forward``), so a wrapper put in the linear's
    place, peft's LoRA layer, is never called (its ``weight`` is the base layer's), and a
    quantized weight is read packed, never dequantized (bitsandbytes dequantizes in
    ``Linear4bit.forward``)."""
    parent_name, _, leaf = name.rpartition(".")
    if leaf != "qkv":
        return False
    parent = model.get_submodule(parent_name) if parent_name else model
    return isinstance(getattr(parent, "q_bias", None), torch.nn.Parameter) and not getattr(
        parent, "qkv_bias_separate", False
    )


def _check_weights_called(model: Any, kept: set[int], training: TrainingConfig) -> None:
    """Refuse a quantized base whose model reads a linear's weight directly
    (:func:`weight_read_directly`: timm's EVA, BEiT and Swin V2 fused qkv): the packed weight
    would go into ``F.linear`` as it is.

    Raises:
        SpecError: ``quantize_base``.
    """
    for name, module in model.named_modules():
        path = name.removesuffix(".base_layer")  # peft's LoRA wraps the linear
        if id(module) in kept or not isinstance(module, torch.nn.Linear):
            continue
        if weight_read_directly(model, path):
            owner = type(model.get_submodule(path.rpartition(".")[0])).__name__
            raise SpecError(
                "quantize_base",
                f"{training.quantize_base} quantizes {owner}'s fused qkv linear, whose weight "
                "its forward reads directly: with its q / v biases it runs "
                "F.linear(x, self.qkv.weight, bias) (timm eva.py / beit.py / "
                "swin_transformer_v2.py), which would take the packed codes as they are, as on "
                "a GPU (bitsandbytes dequantizes only in its own Linear4bit / Linear8bitLt "
                "forward); allowed: none (LoRA on the 16-bit base)",
            )


def quantize_base(
    model: Any, training: TrainingConfig, *, diffusers: bool = False, model_type: str = ""
) -> int:
    """Replace, in place, each frozen linear of ``model`` that ``training.quantize_base``
    quantizes by its stand-in (Note [Traced quantized base]); no-op without a quantized base.

    Args:
        model: the model as built for the trace (on ``meta``), after peft's LoRA (frozen base
            linears are ``requires_grad=False``; adapters are trainable and left alone).
        training: ``quantize_base``, ``compute_dtype``, ``quantized_matmul_saves_input``,
            ``torchao_nf4_decode``.
        diffusers: a diffusers model (every linear is converted).
        model_type: the ``model_type`` of the config the user gave (ChatGLM's own quantize,
            Note [ChatGLM's quantize], runs on ``chatglm`` only).

    Returns:
        The number of linears replaced.

    Raises:
        SpecError: ``quantize_base`` that the model cannot take.
    """
    kind = training.quantize_base
    if kind == "none":
        return 0
    kept = _kept_in_precision(model, diffusers)
    if kind in CHATGLM_QUANTIZE:
        return chatglm_quantize(model, training, kept, model_type)
    dtype = getattr(torch, training.compute_dtype)
    if training.kbit_16bit_dense:  # loaded in 16 bits and not upcast by peft: the rest stays
        rest = getattr(torch, training.kbit_dense_dtype)  # fp16 beside bf16: kbit_dense_cast
        for name, param in model.named_parameters():
            if "lora_" not in name and param.is_floating_point():
                param.data = param.data.to(rest)
    _check_weights_called(model, kept, training)
    storage = float_quant_storage(training)
    count = 0
    for module in model.modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        weight = getattr(module, "weight", None)
        if not linear or id(module) in kept or weight is None or weight.requires_grad:
            continue
        fan_in, fan_out = _features(module)
        size = quantized_weight_bytes(fan_in * fan_out, fan_out, kind)
        if storage is None:
            packed = torch.empty(size, dtype=torch.uint8, device=weight.device)
        else:
            whole = unflattened_quantized_bytes(fan_in * fan_out, fan_out, training)
            packed = _float_packed(size - whole, getattr(torch, storage), weight.device)
            module.register_buffer(
                "quant_statistics", torch.empty(whole, dtype=torch.uint8, device=weight.device)
            )
        module.weight = torch.nn.Parameter(packed, requires_grad=False)
        module.dequantized_shape = (fan_out, fan_in)
        module.compute_dtype = dtype
        module.saves_input = training.quantized_matmul_saves_input
        module.torchao_decode = training.torchao_nf4_decode
        module.through_fp16 = training.dequantizes_through_fp16
        module.saves_packed = kind == "gptq-int4"
        module.keeps_on_ctx = training.checkpoint_keeps_bnb_inputs
        module.forward = types.MethodType(_forward, module)
        module.int8 = kind == "int8"
        module.int8_copy = training.bnb_int8_transposed_copy
        module.W_q = None  # peft's dequantize_module_weight then calls dequantize()
        module.dequantize = types.MethodType(_peft_dequantize, module)
        count += 1
    if training.kbit_fp32_upcast:  # peft's prepare_model_for_kbit_training
        packed = {id(m.weight) for m in model.modules() if hasattr(m, "dequantized_shape")}
        for param in model.parameters():
            if id(param) not in packed and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.to(torch.float32)
    if training.trl_bf16_embeddings:  # TRL's SFTTrainer, after peft's upcast
        _trl_casting_to_bf16(model)
    return count


def _trl_casting_to_bf16(model: Any) -> None:
    """TRL's ``peft_module_casting_to_bf16`` (trl v0.13.0 trl/trainer/utils.py, 0.9.3 .. 0.25):
    LayerNorms and modules named ``*norm*`` to fp32, else the embeddings and LM head
    (:data:`~trainmem.specs.frameworks.TRL_BF16_NAMES_MATCHED` in the name) from fp32 to
    bf16."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
            module.to(torch.float32)
        elif any(x in name for x in TRL_BF16_NAMES_MATCHED):
            weight = getattr(module, "weight", None)
            if weight is not None and weight.dtype == torch.float32:
                module.to(torch.bfloat16)


def _float_packed(nbytes: int, dtype: Any, device: Any) -> Any:
    """A quantized weight's flattened part in a float storage dtype (Note [Traced quantized
    base]): ``nbytes`` (a 4-bit weight's codes, ``ceil(numel / 2)``; GPTQ's ``qweight`` and
    ``qzeros``) in whole elements of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.empty(-(-nbytes // size), dtype=dtype, device=device)


def parameter_dtype(model: Any) -> Any:
    """The dtype of ``model``'s first floating-point parameter wider than a byte (the dtype its
    inputs take): a quantized base's packed ``uint8`` weights are not it, nor layerwise
    casting's float8 storage (Note [diffusers' layerwise casting]: the layers compute in the
    load dtype). ``torch.float32`` when it has none."""
    return next(
        (p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1),
        torch.float32,
    )
