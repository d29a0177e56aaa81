"""Quantized base weights: the bytes one frozen linear weight takes once quantized (QLoRA's NF4 /
FP4 with or without double quantization, LLM.int8(), GPTQ), read by both engines (the analytic
per-tensor layout, :mod:`trainmem.analytic.tensor_states`, and the traced stand-in of a quantized
linear, :mod:`trainmem.trace.quantized`). See Note [Model states with PEFT and sharding] in
``analytic/tensor_states.py``.

Source: bitsandbytes nn/modules.py ``Linear4bit`` / ``Params4bit`` (``quantize_4bit(blocksize=64,
compress_statistics=...)``), ``Linear8bitLt`` / ``Int8Params``; auto-gptq / optimum
``QuantLinear`` (``qweight``, ``scales``, ``qzeros``, ``g_idx``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainmem.specs.training import TrainingConfig

__all__ = [
    "BNB_4BIT",
    "GPTQ_GROUP_SIZE",
    "NF4_BLOCK",
    "NF4_DOUBLE_QUANT_BLOCK",
    "bnb_4bit_statistics_bytes",
    "float_quant_storage",
    "quantized_weight_bytes",
    "unflattened_quantized_bytes",
]

NF4_BLOCK = 64
"""Values per NF4 quantization block (bitsandbytes ``Linear4bit`` default blocksize)."""
GPTQ_GROUP_SIZE = 128
"""Input rows per GPTQ quantization group (the common ``group_size=128``)."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""First-level absmax values per second-level fp32 absmax (QLoRA double quantization)."""


def quantized_weight_bytes(numel: int, out_features: int, quantize: str) -> int:
    """Bytes of a frozen linear weight of ``numel`` elements and ``out_features`` output rows
    once quantized as ``quantize`` (a ``TrainingConfig.quantize_base`` value other than
    ``none``): 4-bit codes (half a byte per value) with one fp32 absmax per block of
    :data:`NF4_BLOCK` values, or one 8-bit absmax per block and one fp32 absmax per
    :data:`NF4_DOUBLE_QUANT_BLOCK` blocks (``-dq``); int8: a byte per value and one fp32 scale
    per output row; GPTQ: 4-bit ``qweight``, per group of :data:`GPTQ_GROUP_SIZE` input rows an
    fp16 ``scales`` row and a 4-bit ``qzeros`` row, and an int32 ``g_idx`` per input row;
    ChatGLM's own quantize (``chatglm-int8`` / ``chatglm-int4``): ``bits / 8`` bytes a value
    and one 16-bit scale per output row.

    Raises:
        AssertionError: an unknown ``quantize``.
    """
    if quantize in ("nf4", "fp4"):
        return -(-numel // 2) + 4 * -(-numel // NF4_BLOCK)
    if quantize in ("nf4-dq", "fp4-dq"):
        blocks = -(-numel // NF4_BLOCK)
        return -(-numel // 2) + blocks + 4 * -(-blocks // NF4_DOUBLE_QUANT_BLOCK)
    if quantize == "int8":
        return numel + 4 * out_features
    if quantize == "gptq-int4":
        # auto-gptq / optimum ``QuantLinear``: ``qweight`` int32 packing 8 values, per group of
        # 128 input rows an fp16 ``scales`` row and a 4-bit packed ``qzeros`` row, and an int32
        # ``g_idx`` per input row (in_features = numel / out_features)
        in_features = numel // max(out_features, 1)
        groups = -(-in_features // GPTQ_GROUP_SIZE)
        return (
            -(-numel // 2)
            + 2 * groups * out_features
            + -(-groups * out_features // 2)
            + (4 * in_features)
        )
    if quantize in ("chatglm-int8", "chatglm-int4"):
        # ChatGLM's QuantizedLinear (THUDM chatglm2-6b / chatglm3-6b quantization.py): an int8
        # ``weight`` of [out, in * bits / 8] (two 4-bit values a byte) and a 16-bit
        # ``weight_scale`` of [out] (the dtype of the weight it quantized, fp16 / bf16)
        bits = 8 if quantize == "chatglm-int8" else 4
        return numel * bits // 8 + 2 * out_features
    raise AssertionError(quantize)


def bnb_4bit_statistics_bytes(numel: int, quantize: str) -> int:
    """Bytes of a bitsandbytes 4-bit weight's quantization statistics (its ``QuantState``), the
    part of :func:`quantized_weight_bytes` outside the packed codes: one fp32 absmax per block of
    :data:`NF4_BLOCK` values, or with double quantization (``-dq``) one uint8 absmax per block
    and one fp32 absmax per :data:`NF4_DOUBLE_QUANT_BLOCK` blocks; 0 for any other
    ``quantize``.

    The statistics are not a parameter: bitsandbytes 0.43.0 nn/modules.py ``Params4bit._quantize``
    keeps them in ``self.quant_state`` and on its ``Linear4bit`` (``self.module.quant_state =
    quant_state``; ``fix_4bit_weight_quant_state_from_module`` gives them back to the weight
    after FSDP replaced it by a view), so ZeRO-3 / FSDP, which shard and offload parameters
    only, leave them whole on every rank (Note [bitsandbytes statistics under sharding] in
    ``analytic/tensor_states.py``).
    """
    if quantize not in ("nf4", "fp4", "nf4-dq", "fp4-dq"):
        return 0
    return quantized_weight_bytes(numel, 1, quantize) - -(-numel // 2)


BNB_4BIT = ("nf4", "nf4-dq", "fp4", "fp4-dq")
"""The ``quantize_base`` values bitsandbytes' ``Linear4bit`` stores (and ``quant_storage``
applies to)."""


def float_quant_storage(training: TrainingConfig) -> str | None:
    """The float dtype a quantized base's packed tensors are stored in under FSDP1, which
    flattens a unit into one float tensor (Note [Traced quantized base] in
    trainmem/trace/quantized.py), or None for their integer storage (bitsandbytes' ``uint8``,
    GPTQ's ``int32``: every other run).

    Args:
        training: ``framework``, ``quantize_base``, ``precision``, ``prepare_kbit_training``.

    Returns:
        Under ``fsdp-qlora`` or ``accelerate-fsdp`` the dtype the rest of the base is loaded
        in (the compute dtype when it stays in 16 bits under autocast,
        :attr:`~trainmem.specs.training.TrainingConfig.kbit_16bit_dense`, else the weight
        dtype), which each run stores its packed tensors in:

        * a bitsandbytes 4-bit base's codes (``quant_storage``): Answer.AI fsdp_qlora train.py
          50efa1e ``quant_storage=torch_dtype``, the dtype it loads the model in; transformers'
          FSDP-QLoRA ``BitsAndBytesConfig(bnb_4bit_quant_storage=<the model's torch_dtype>)``
          (fms-acceleration framework_plugin_bnb.py ``model_loader``: ``torch_dtype`` under
          ``ACCELERATE_USE_FSDP``), which transformers' Trainer also makes FSDP1's
          mixed-precision dtype (trainer.py ``_fsdp_qlora_plugin_updates``);
        * a GPTQ base's ``qweight`` and ``qzeros`` under accelerate's FSDP1: fms-acceleration's
          AutoGPTQ plugin (accelerated-peft autogptq_utils.py
          ``build_patch_to_view_tensor_to_parameter_for_fsdp_gptq``, PR #15) replaces the two
          ``int32`` buffers by frozen Parameters viewed as the model's ``torch_dtype`` "so FSDP
          can shard them" (and views them back to ``int32`` before each forward); ``scales``
          and ``g_idx`` stay buffers (:func:`unflattened_quantized_bytes`).

        None under ``accelerate-fsdp`` for a base whose other parameters peft upcasts to fp32
        under autocast (``prepare_kbit_training`` asked for: the fp32 norms and the 16-bit
        codes would share a unit, which FSDP1 refuses to flatten, "Must flatten tensors with
        uniform dtype"), and for every other framework or base.
    """
    q, f = training.quantize_base, training.framework
    if not (q in BNB_4BIT or (q == "gptq-int4" and f == "accelerate-fsdp")):
        return None
    if f not in ("fsdp-qlora", "accelerate-fsdp"):
        return None
    if f == "accelerate-fsdp" and training.is_mixed and not training.kbit_16bit_dense:
        return None
    return training.compute_dtype if training.kbit_16bit_dense else training.weight_dtype


def unflattened_quantized_bytes(numel: int, out_features: int, training: TrainingConfig) -> int:
    """Bytes of a quantized weight of ``numel`` elements and ``out_features`` rows (this rank's
    tensor-parallel slice) that are not part of the parameter ZeRO-3 / FSDP shard, gather and
    offload, so stay whole on every rank: a bitsandbytes 4-bit weight's statistics
    (:func:`bnb_4bit_statistics_bytes`, its ``QuantState``), and under fms-acceleration's
    AutoGPTQ FSDP patch (:func:`float_quant_storage` names a dtype for a GPTQ base) the
    ``scales`` (fp16, one row per group of :data:`GPTQ_GROUP_SIZE` input rows) and ``g_idx``
    (int32, one per input row) buffers it leaves as they are (accelerated-peft
    autogptq_utils.py ``PATCH_FOR_FSDP_TRITON_V2 = ["qweight", "qzeros"]``; gptqmodel
    qlinear_tritonv2.py ``register_buffer("scales")``, ``register_buffer("g_idx")``). 0 for
    every other base (int8; GPTQ elsewhere, counted as the formulas' parameter)."""
    q = training.quantize_base
    if q == "gptq-int4" and float_quant_storage(training) is not None:
        in_features = numel // max(out_features, 1)
        groups = -(-in_features // GPTQ_GROUP_SIZE)
        return 2 * groups * out_features + 4 * in_features
    return bnb_4bit_statistics_bytes(numel, q)
