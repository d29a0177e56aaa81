"""trainmem: how much GPU memory training a model needs, where it goes, and what fits.

The public entry points, none of which imports torch::

    from trainmem import estimate, TrainingConfig
    training = TrainingConfig(micro_batch_size=2, seq_len=2048)
    est = estimate("llama-3.1-8b", training, gpu="H100-80GB")

``trainmem.trace(build_model, make_batch, training=...)`` traces any ``nn.Module`` (needs the
``trace`` extra; torch is imported on first use).
"""

from typing import Any

from trainmem.breakdown import MemoryBreakdown, MemoryEstimate
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

__version__ = "0.3.0"
__all__ = ["MemoryBreakdown", "MemoryEstimate", "TrainingConfig", "estimate", "trace"]


def __getattr__(name: str) -> Any:
    """``trainmem.trace``: the trace engine's package, itself callable as
    :func:`trainmem.trace.trace` (imported lazily so that ``import trainmem`` stays torch-free)."""
    if name == "trace":
        import importlib

        return importlib.import_module("trainmem.trace")
    raise AttributeError(f"module 'trainmem' has no attribute {name!r}")
