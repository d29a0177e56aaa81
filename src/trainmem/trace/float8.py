"""float8 training with torchao, as torchtitan applies it (``fp8-mixed``).

Note [Tracing float8]
    ``precision="fp8-mixed"`` converts the model's linears to torchao's ``Float8Linear``
    (``torchao.float8.convert_to_float8_training``) on the ``meta`` model, before it gets fake
    storage, with torchtitan's filter (``torchtitan/components/quantization/float8.py``): the
    output layer (``lm_head``) stays in high precision, and so does every linear whose
    ``in_features`` or ``out_features`` is not a multiple of 16 (``torch._scaled_mm``'s
    alignment). A quantized base's stand-ins (``trainmem.trace.quantized``, only a GPTQ base
    reaches here: Note [float8 training over a bitsandbytes base] in trainmem/specs/training.py)
    are left as they are: GPTQ's ``QuantLinear`` is an ``nn.Module``, not an ``nn.Linear``
    (auto-gptq nn_modules/qlinear/qlinear_tritonv2.py), which torchao's ``swap_linear_layers``
    skips (``isinstance(module, nn.Linear)``), while peft's LoRA adapters beside it convert.
    Under FSDP2 the weights are all-gathered in float8
    (``enable_fsdp_float8_all_gather=True``) with ``MixedPrecisionPolicy(param_dtype=bf16)``
    (trainmem.trace.fsdp); without FSDP the step runs under bf16 autocast. The float8 casts,
    amax / scale tensors and ``torch._scaled_mm`` have fake-tensor kernels, so the step traces
    as is (torchao 0.18, torch 2.13).

Note [Float8Linear under the traced autocast]
    ``Float8Linear.forward`` casts its input to the autocast dtype itself ("Duplicate the
    autocast logic for F.linear": ``if torch.is_autocast_enabled(): input =
    input.to(torch.get_autocast_gpu_dtype())``, torchao 0.18 float8/float8_linear.py), then
    runs ``matmul_with_hp_or_float8_args``, which saves that 16-bit copy. The no-argument
    ``torch.is_autocast_enabled()`` asks about CUDA; the trace runs CUDA's policy under the CPU
    autocast key (trainmem.trace.cuda_autocast), so torchao's check is False on the trace and
    each linear would save the fp32 input where a GPU saves a 16-bit copy per linear. A
    forward pre-hook on each converted linear makes the same cast under the trace's autocast
    (``torch.is_autocast_enabled("cpu")``, ``torch.get_autocast_dtype("cpu")``); torchao's own
    branch stays off, so the cast happens once. Under FSDP2 no autocast runs (its
    ``MixedPrecisionPolicy`` casts): nothing changes there.
"""

from __future__ import annotations

from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["apply_float8"]


def _keep(module: Any, fqn: str) -> bool:
    quantized = hasattr(module, "dequantized_shape")  # a stand-in (trainmem.trace.quantized)
    if fqn.split(".")[-1] == "lm_head" or quantized:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: Any, training: TrainingConfig, *, fsdp: bool) -> None:
    """Swap the model's linears for ``Float8Linear`` in place; see Note [Tracing float8].

    Args:
        model: the model, on ``meta`` (or real tensors for a CPU run).
        training: the settings (only called for ``fp8-mixed``).
        fsdp: FSDP2 shards the model (float8 all-gather on).

    Raises:
        UnsupportedError: torchao is not installed.
    """
    try:
        from torchao.float8 import (  # type: ignore[import-untyped,import-not-found]
            Float8LinearConfig,
            convert_to_float8_training,
        )
    except ImportError as exc:
        raise UnsupportedError(
            "precision=fp8-mixed: tracing float8 needs torchao (pip install torchao)"
        ) from exc
    del training
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    convert_to_float8_training(model, config=config, module_filter_fn=_keep)
    from torchao.float8.float8_linear import Float8Linear  # type: ignore[import-untyped,import-not-found]

    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(_autocast_input)


def _autocast_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``Float8Linear.forward``'s input cast under the trace's autocast (Note [Float8Linear
    under the traced autocast])."""
    del module
    if not torch.is_autocast_enabled("cpu") or not args:
        return None
    return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
