"""trainmem: how much GPU memory training a model needs, where it goes, and what fits.

The public entry points, none of which imports torch::

    from trainmem import estimate, TrainingConfig
    training = TrainingConfig(micro_batch_size=2, seq_len=2048)
    est = estimate("llama-3.1-8b", training, gpu="H100-80GB")

``trainmem.trace(build_model, make_batch, training=...)`` traces any ``nn.Module`` (needs the
``trace`` extra; torch is imported on first use).
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmem.breakdown import MemoryBreakdown, MemoryEstimate
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

__version__ = "0.3.0"
__all__ = ["MemoryBreakdown", "MemoryEstimate", "TrainingConfig", "estimate", "trace"]


_LAZY = {
    "MemoryBreakdown": "trainmem.breakdown",
    "MemoryEstimate": "trainmem.breakdown",
    "TrainingConfig": "trainmem.specs.training",
    "estimate": "trainmem.estimate",
}
"""Public names and their modules, imported on first use (PEP 562), so that importing one
stage (``trainmem.specs``, the CLI's ``--help``) does not load the engines (Note [--help
imports no engine] in :mod:`trainmem.specs.engines`)."""


def __getattr__(name: str) -> Any:
    """The public names of :data:`_LAZY` and ``trainmem.trace``, the trace engine's package,
    itself callable as :func:`trainmem.trace.trace` (imported lazily so that ``import trainmem``
    stays torch-free)."""
    if name == "trace":
        return importlib.import_module("trainmem.trace")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainmem' has no attribute {name!r}")


class _Package(types.ModuleType):
    """The ``trainmem`` package module: the function :func:`~trainmem.estimate.estimate` keeps
    the name ``trainmem.estimate`` once its module is imported (the import system binds each
    submodule on its package, which would put the module where the eager import of 0.2 put
    the function)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
