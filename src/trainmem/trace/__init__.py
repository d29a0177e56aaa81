"""trainmem.trace: the trace engine (run the real training step on fake tensors).

Importing this package does not import torch: :func:`trace` and :func:`estimate_trace` load
``trainmem.trace.engine`` (and torch) on first call. The package object is itself callable, so
``trainmem.trace(build_model, make_batch, training=...)`` works whether ``trainmem.trace`` names
this package or the function.

Modules, in data-flow order: ``hf_model`` (build a HF config on meta, fake storage, mask patches),
``lora`` (peft LoRA, targets read off the model), ``float8`` (torchao float8 linears),
``parallel`` (one rank of a dp_shard x cp x tp mesh on a fake process group; context
parallelism), ``tensor_parallel`` (DTensor TP / SP, torchtitan's plan), ``fsdp`` (FSDP2
``fully_shard``), ``compile`` (torch.compile: AOTAutograd + min-cut partition),
``cuda_sdpa`` / ``cuda_autocast`` / ``optimizers`` / ``host_scalars`` (what CUDA would run;
Adafactor's ``.item()``), ``chunked_loss`` (chunked cross-entropy), ``step`` (the training
loop), ``recorder`` (dispatch-mode storage tracker), ``capture`` (warm-up + recorded step,
categories), ``attribution`` (timeline, peak breakdown, per-module tables), ``engine``; the
generic path on top: ``blocks`` (find and cut the repeated block lists), ``compose`` (the
full-depth step schedule from the cut model's trace), ``generic`` (build, cut, trace, compose).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmem.breakdown import MemoryEstimate

__all__ = ["estimate_trace", "trace"]


def trace(build_model: Any, make_batch: Any, **kwargs: Any) -> MemoryEstimate:
    """Trace one steady-state training step of any ``nn.Module``; see
    :func:`trainmem.trace.engine.trace` for the arguments.

    Args:
        build_model: returns the model (called under ``torch.device("meta")``).
        make_batch: returns one micro-batch.
        **kwargs: ``training``, ``loss_fn``, ``optimizer``, ``gpu``, ``name``.

    Returns:
        The :class:`~trainmem.breakdown.MemoryEstimate` with ``engine="trace"``.
    """
    from trainmem.trace.engine import trace as _trace

    return _trace(build_model, make_batch, **kwargs)


def estimate_trace(model_spec_or_name: Any, training: Any, **kwargs: Any) -> MemoryEstimate:
    """Trace a preset / HF config; see :func:`trainmem.trace.engine.estimate_trace`.

    Args:
        model_spec_or_name: preset name, config path, hub id or ModelSpec.
        training: the TrainingConfig.
        **kwargs: ``gpu``.

    Returns:
        The :class:`~trainmem.breakdown.MemoryEstimate` with ``engine="trace"``.
    """
    if getattr(training, "pipeline_parallel_size", 1) > 1:
        from trainmem.trace.pipeline import estimate_pipeline_trace

        return estimate_pipeline_trace(model_spec_or_name, training, **kwargs)  # type: ignore[no-any-return]
    from trainmem.trace.engine import estimate_trace as _estimate_trace

    return _estimate_trace(model_spec_or_name, training, **kwargs)


class _CallableModule(types.ModuleType):
    """Lets ``trainmem.trace(...)`` call :func:`trace` when it resolves to this package."""

    def __call__(self, build_model: Any, make_batch: Any, **kwargs: Any) -> MemoryEstimate:
        return trace(build_model, make_batch, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
