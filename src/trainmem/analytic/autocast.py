"""Autocast's 16-bit copies of the layer weights: the copies the matmuls save for backward and
the ones autocast's weight cache holds until the forward region exits
(aten/src/ATen/autocast_mode.cpp ``cached_cast``)."""

from __future__ import annotations

from trainmem.analytic.activation_shapes import compute_and_residual_bytes, mean_terms
from trainmem.analytic.lora import lora_adapter_elements
from trainmem.analytic.params import linear_shapes
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def layer_linear_weights(model: ModelSpec, *, autocast_only: bool = False) -> int:
    """Weight elements of the linears of one layer (all experts for MoE), no biases.

    ``autocast_only`` leaves out the routed experts of a transformers MoE layer, whose grouped
    matmul is not autocast-enabled and runs in the weights' own dtype (transformers
    integrations/moe.py ``_grouped_mm``: "torch.nn.functional.grouped_mm and torch._grouped_mm
    are not autocast-enabled"). The mean block of a model with blocks of several kinds
    (``mean_terms``)."""
    mean = mean_terms(
        model, lambda block: {"": layer_linear_weights(block, autocast_only=autocast_only)}
    )
    if mean is not None:
        return mean[""]
    experts = model.num_experts > 1 and autocast_only
    return sum(
        fan_in * fan_out * n
        for name, (fan_in, fan_out, n) in linear_shapes(model).items()
        if not (experts and name in ("gate", "up", "down"))
    )


def autocast_weight_copy_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """16-bit copies of one layer's linear weights that autocast makes and the matmuls save for
    the input gradient (``mm`` saves ``mat2`` when ``self`` requires grad), frozen or not; none
    for a quantized base, whose bitsandbytes matmul dequantizes inside and saves only the
    quantized weight (``MatMul4Bit``). Source: aten/src/ATen/autocast_mode.cpp ``cached_cast``;
    tools/autograd/derivatives.yaml (mm)."""
    if not training.uses_autocast:
        return 0
    c, _ = compute_and_residual_bytes(training)
    # LoRA adapters (fp32 under autocast) are cast and saved by their own matmuls too
    adapters = c * lora_adapter_elements(model, training)
    # a model loaded in 16 bits: its linears' weights are in the compute dtype already
    # (``cached_cast`` casts only another dtype; TrainingConfig.autocast_over_loaded_16bit)
    if training.quantize_base != "none" or training.autocast_over_loaded_16bit:
        return adapters
    return c * layer_linear_weights(model, autocast_only=True) + adapters


def autocast_cached_weight_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of one layer's weights held in autocast's weight cache until the forward region
    exits: a 16-bit copy of every *trainable* linear weight (LoRA adapters included), none of
    a frozen base and none under ZeRO-3 / FSDP1, whose gathered weights are views (FSDP2's
    unsharded parameters are leaves: ``fsdp_unsharded_leaf_parameters``).

    Alive: forward (from the layer's forward to the end of the autocast region). This matters
    under activation checkpointing, where the copies are not saved for backward but stay in the
    cache; without checkpointing the matmuls save the same copies (the per-layer term
    ``autocast_weight_copies``).

    Source: aten/src/ATen/autocast_mode.cpp ``cached_cast``: ``can_try_cache = to_type ==
    lower_precision_fp && arg.scalar_type() == kFloat && arg.requires_grad() && arg.is_leaf()
    && !arg.is_view() && cache_enabled``; a frozen weight (requires_grad False) or an FSDP
    view is cast on every call and the cast lives only as long as autograd saves it.
    """
    sharded = training.zero_stage == 3 and training.data_parallel_size > 1
    leaves = (  # FSDP2's unsharded parameters, plain tensors without tensor parallelism
        training.conventions.fsdp_unsharded_leaf_parameters and training.tensor_parallel_size == 1
    )
    if not training.uses_autocast or (sharded and not leaves):
        return 0
    c, _ = compute_and_residual_bytes(training)
    if not training.frozen_base:
        # 16-bit weights (autocast_over_loaded_16bit) are not kFloat: nothing cached
        if training.autocast_over_loaded_16bit:
            return 0
        return c * layer_linear_weights(model, autocast_only=True)
    return c * lora_adapter_elements(model, training)
