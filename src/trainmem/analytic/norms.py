"""Bytes the normalisation layers save for backward: LayerNorm, HF RMSNorm (weight in the input
dtype or in fp32), frozen (LoRA) and compiled norms, and the q/k norms of the attention
projections. Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_shapes import (
    autocast_fp32_layer_norms,
    compute_and_residual_bytes,
)
from trainmem.specs.frameworks import LITGPT_RMSNORM_FP32_WEIGHT_SINCE
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def norm_saved_bytes(
    model: ModelSpec,
    r: int,
    *,
    trainable: bool = True,
    compiled: bool = False,
    width: int = 0,
    groups: int = 1,
    weight_in_fp32: bool = False,
) -> int:
    """Bytes per token one norm saves, for an input of ``r`` bytes per value (the residual
    stream for a pre-norm, the compute dtype for a norm on a projection's output) over
    ``width`` values (default h) normalised in ``groups`` (per-head q/k norms: one per head).

    LayerNorm r*w + 8 (input, fp32 mean and rstd); HF RMSNorm 4w + r*w + 4 (fp32 input or copy,
    normalised tensor in the input dtype, fp32 rstd: modeling_llama.py ``LlamaRMSNorm``), or
    4w + 4w + 4 where the weight multiplies in fp32 before the cast
    (``ModelSpec.norm_weight_in_fp32``: modeling_gemma3.py ``Gemma3RMSNorm``, modeling_olmo2.py
    ``Olmo2RMSNorm``; ``weight_in_fp32``: litgpt's own RMSNorm from 0.4.6,
    :func:`litgpt_norm_weight_in_fp32`). A frozen RMSNorm (LoRA) does not save the normalised
    tensor: ``weight * x`` saves ``x`` only for the weight's gradient (found by the trace
    engine). Under torch.compile the min-cut partition keeps only the norm's input in its own
    dtype and the fp32 rstd (r*w + 4): the fp32 upcast and the normalised tensor are fused and
    recomputed in backward (traced: AOTAutograd with ``min_cut_rematerialization_partition``
    on a Llama layer, trainmem.trace.compile)."""
    w = width or model.hidden_size
    if model.norm_kind == "layernorm":
        return r * w + 8 * groups
    if compiled:
        return r * w + 4 * groups
    normalised = 4 if model.norm_weight_in_fp32 or weight_in_fp32 else r
    return 4 * w + (normalised * w if trainable else 0) + 4 * groups


def qk_norm_saved_bytes(model: ModelSpec, c: int, **kwargs: bool) -> int:
    """Bytes per token the q and k norms save: norms of the projections' outputs (compute
    dtype), per head (modeling_qwen3.py / modeling_gemma3.py ``q_norm = RMSNorm(head_dim)``) or
    over the whole projection (modeling_olmo2.py ``q_norm = RMSNorm(a * d)``)."""
    d = model.head_dim
    total = 0
    for heads in (model.num_heads, model.num_kv_heads):
        groups = 1 if model.qk_norm_full_width else heads
        total += norm_saved_bytes(model, c, width=heads * d, groups=groups, **kwargs)
    return total


def litgpt_norm_weight_in_fp32(training: TrainingConfig) -> bool:
    """litgpt's own RMSNorm multiplies its weight in fp32 (``(x_normed * weight.float()).to(
    dtype=dtype)``, litgpt/model.py v0.5.13 ``RMSNorm.forward``) from 0.4.6
    (:data:`~trainmem.specs.frameworks.LITGPT_RMSNORM_FP32_WEIGHT_SINCE`,
    ``TrainingConfig.litgpt_release``). Found by the generic path on litgpt's own GPT
    (trace/litgpt_model.py): bf16-true full fine-tuning of a 1024-wide Qwen2, +2.6 % -> 0.0 %."""
    return (
        training.conventions.own_model_code
        and training.litgpt_release >= LITGPT_RMSNORM_FP32_WEIGHT_SINCE
    )


def unsloth_fast_norms(training: TrainingConfig) -> bool:
    """The RMSNorms are Unsloth's ``Fast_RMS_Layernorm`` (``FrameworkConventions.
    unsloth_fast_rms_layernorm``, under LoRA: ``FastLanguageModel``'s decoder layer calls
    ``fast_rms_layernorm`` for both norms and the model for the final one, unsloth 2026.3.5
    models/llama.py ``LlamaDecoderLayer_fast_forward``, ``LlamaModel_fast_forward``): they
    save what a compiled norm keeps, the input in its own dtype and the fp32 rstd (r w + 4 per
    token, ``ctx.save_for_backward(X, W, r)``, kernels/rms_layernorm.py), and write the input
    gradient into the incoming one."""
    return training.conventions.unsloth_fast_rms_layernorm and training.is_lora


def fused_norms(training: TrainingConfig) -> bool:
    """The RMSNorms save what a compiled norm keeps, the input in its own dtype and the fp32
    rstd (r h + 4 per token), and their backward holds no transients: Unsloth's
    ``Fast_RMS_Layernorm`` (:func:`unsloth_fast_norms`) or a framework's fused kernel
    (``FrameworkConventions.fused_rms_norm``: Megatron's ``TENorm`` / Apex's
    ``FusedRMSNormAffineMixedDtypesFunction``, ``ctx.save_for_backward(input_, weight_,
    invvar)``; Note [Megatron's fused RMSNorm], trainmem/trace/fused_norm.py)."""
    return unsloth_fast_norms(training) or training.conventions.fused_rms_norm


def norm_options(training: TrainingConfig) -> dict[str, bool]:
    """How the layer norms run: frozen (no normalised tensor saved for the weight's gradient)
    under LoRA and under torch.compile, compiled under torch.compile (and as a fused kernel,
    :func:`fused_norms`, which saves the same), the weight multiplied in fp32 by litgpt's
    RMSNorm (:func:`norm_saved_bytes`)."""
    return {
        "trainable": not training.frozen_base and not training.compile,
        "compiled": training.compile or fused_norms(training),
        "weight_in_fp32": litgpt_norm_weight_in_fp32(training),
    }


def block_norm_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(pre-norm, output norm) bytes per token one layer's norms save: a pre-norm on the
    residual stream (r bytes per value) and, for a model with output norms (Gemma-3, OLMo-2),
    one on a projection's output (c bytes per value), else 0."""
    c, r = compute_and_residual_bytes(training)
    options = norm_options(training)
    # Note [Autocast over 16-bit weights]: the LayerNorm saves its fp32 cast of the input
    norm = norm_saved_bytes(
        model, 4 if autocast_fp32_layer_norms(model, training) else r, **options
    )
    output_norm = norm_saved_bytes(model, c, **options) if model.output_norms else 0
    return norm, output_norm
