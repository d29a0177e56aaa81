"""torch.optim optimizers for a :class:`~trainmem.specs.training.TrainingConfig`.

CUDA defaults: ``torch.optim`` picks ``foreach=True`` when every parameter is a CUDA tensor
(``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``); on fake CPU tensors it would
pick the for-loop, so the implementation is always passed explicitly
(``TrainingConfig.optimizer_implementation``). Hyperparameters do not change memory and keep
torch's defaults (momentum 0.9 for ``sgd-momentum``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["build_optimizer"]


def _impl_kwargs(training: TrainingConfig, *, fused_ok: bool = True) -> dict[str, bool]:
    impl = training.step_implementation
    if impl == "fused":
        if not fused_ok:
            raise UnsupportedError(
                f"{training.optimizer} has no fused implementation in torch.optim; "
                "use optimizer_implementation='foreach'"
            )
        return {"fused": True, "foreach": False}
    return {"foreach": impl == "foreach"}


def build_optimizer(params: Iterable[Any], training: TrainingConfig) -> Any:
    """The torch optimizer a CUDA run of ``training`` would use.

    Args:
        params: trainable parameters.
        training: optimizer name and implementation.

    Returns:
        A ``torch.optim.Optimizer``.

    Raises:
        UnsupportedError: 8-bit optimizers (bitsandbytes needs CUDA) or an implementation torch
            lacks for that optimizer (fused Adafactor/Lion).
    """
    params = list(params)
    name = training.optimizer
    if name in ("adamw", "adam") and training.step_implementation == "cs336":
        from trainmem.trace.course_model import CourseAdamW

        return CourseAdamW(params, lr=1e-4)
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, **_impl_kwargs(training))
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, **_impl_kwargs(training))
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **_impl_kwargs(training))
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, **_impl_kwargs(training, fused_ok=False))
    if name == "lion":
        raise UnsupportedError(
            "Lion is not in torch.optim; trace it with trainmem.trace(..., optimizer=...) and "
            "your own Lion implementation, or use --engine analytic"
        )
    raise UnsupportedError(
        f"{name} needs bitsandbytes / torchao CUDA kernels, which cannot run on fake CPU "
        "tensors; "
        "use --engine analytic"
    )
