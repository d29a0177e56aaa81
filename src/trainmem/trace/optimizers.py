"""torch.optim optimizers for a :class:`~trainmem.specs.training.TrainingConfig`.

CUDA defaults: ``torch.optim`` picks ``foreach=True`` when every parameter is a CUDA tensor
(``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``); on fake CPU tensors it would
pick the for-loop, so the implementation is always passed explicitly
(``TrainingConfig.optimizer_implementation``). Hyperparameters do not change memory and keep
torch's defaults (momentum 0.9 for ``sgd-momentum``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.errors import UnsupportedError
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.module_paths import ModulePathTracker

torch = require_torch()

__all__ = ["EMAStep", "build_optimizer"]


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
        UnsupportedError: an optimizer whose row of
            :data:`~trainmem.specs.optimizers.OPTIMIZER_TABLE` has no ``torch_optim`` (Lion,
            the bitsandbytes / torchao ones: CUDA kernels), or an implementation torch lacks for
            that optimizer (fused Adafactor).
    """
    params = list(params)
    row = OPTIMIZER_TABLE[training.optimizer]
    if training.step_implementation == "cs336":  # TrainingConfig: Adam / AdamW only
        from trainmem.trace.course_model import CourseAdamW

        return CourseAdamW(params, lr=1e-4)
    if training.optimizer == "adafactor" and training.adafactor_implementation == "transformers":
        return _transformers_adafactor(params)
    if row.torch_optim is None:
        raise UnsupportedError(row.untraceable)
    cls = getattr(torch.optim, row.torch_optim)
    return cls(params, **row.torch_kwargs, **_impl_kwargs(training, fused_ok=row.torch_fused))


def _transformers_adafactor(params: list[Any]) -> Any:
    """transformers' own ``Adafactor`` (transformers/optimization.py; plain torch ops, so it runs
    on fake tensors as it is), with the HF Trainer's ``optim="adafactor"`` arguments
    (trainer.py ``get_optimizer_cls_and_kwargs``: ``scale_parameter=False,
    relative_step=False``): the run of ``TrainingConfig.adafactor_implementation``
    ``transformers`` (the HF Trainer, accelerate, torch < 2.5)."""
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)


EMA_DECAY = 0.9999
"""diffusers ``EMAModel(decay=0.9999)``, its default (no effect on memory)."""


class EMAStep:
    """An optimizer followed by diffusers' ``EMAModel.step`` on an EMA copy of its parameters
    (``TrainingConfig.ema``; Note [EMA weights] in ``analytic/tensor_states.py``).

    The copy is made here, before the step is recorded, as ``EMAModel.__init__`` makes it
    (``shadow_params = [p.clone().detach() for p in parameters]``, then ``.to(dtype=...)``), and
    :meth:`runtime_state` registers it as a persistent parameter. :meth:`step` runs the optimizer,
    then ``EMAModel.step``'s per-parameter loop (``foreach=False``, its default):
    ``s_param.sub_(one_minus_decay * (s_param - param))``. With ``ema_device="cpu"`` the copy
    stays off the GPU (it is not registered) and is moved to the GPU for the update and back
    (the examples' ``--offload_ema``: ``ema_unet.to(device="cuda")`` / ``.to(device="cpu")``).

    Source: diffusers 0.42.1 src/diffusers/training_utils.py ``EMAModel``; examples/
    text_to_image/train_text_to_image.py (``ema_unet.step`` after ``optimizer.step()``).

    Known limitations: the scripts step the EMA after ``optimizer.zero_grad()``; here it runs
    inside ``optimizer.step()``, with the gradients still held (an upper bound by the
    gradients when the EMA update is the step's peak). ``foreach=True`` (one temporary of all
    the parameters at once) is not modelled.

    Args:
        optimizer: the ``torch.optim.Optimizer`` stepping ``params``.
        params: the trainable parameters, named (``model.named_parameters()`` order).
        training: ``ema_dtype`` and ``ema_device``.
        owners: the module holding each parameter (names the module of the update's
            temporaries), or None.
    """

    def __init__(
        self,
        optimizer: Any,
        params: Iterable[tuple[str, Any]],
        training: TrainingConfig,
        owners: list[Any] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.owners = owners
        named = list(params)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        dtype = getattr(torch, training.ema_dtype) if training.ema_dtype else None
        with torch.no_grad():
            self.shadow = [p.detach().clone().to(dtype=dtype or p.dtype) for p in self.params]
        self.on_gpu = training.ema_device == "cuda"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def step(self, closure: Any = None) -> Any:
        """``optimizer.step()``, then the EMA update.

        Args:
            closure: passed to the optimizer.

        Returns:
            What the optimizer's step returns.
        """
        out = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._ema_step()
        return out

    def _owner(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """Name the parameter's module the running one (a composed schedule repeats its
        temporaries with its layer, Note [Composing the full depth])."""
        tracker = ModulePathTracker.active
        owner = self.owners[index] if self.owners else None
        if tracker is None or owner is None:
            return contextlib.nullcontext()
        return tracker.inside(owner)

    def _ema_step(self) -> None:
        one_minus_decay = 1 - EMA_DECAY
        with torch.no_grad():
            moved = list(self.shadow)
            if not self.on_gpu:  # ema.to(device="cuda"): a GPU copy of every shadow parameter
                for i, s_param in enumerate(self.shadow):
                    with self._owner(i):
                        moved[i] = s_param.clone()
            for i, (s_param, param) in enumerate(zip(moved, self.params, strict=True)):
                with self._owner(i):
                    s_param.sub_(one_minus_decay * (s_param - param))
            # ema.to(device="cpu") makes new host tensors and frees the GPU ones: only the
            # free is device memory (writing into self.shadow would count it as on the GPU)
            del moved

    def runtime_state(self) -> Iterator[tuple[Any, MemoryCategory, str]]:
        """The EMA copy held on the GPU, as ``(tensor, PARAMETER, parameter name)``.

        Yields:
            One triple per trainable parameter (none with ``ema_device="cpu"``).
        """
        if self.on_gpu:
            for name, s_param in zip(self.names, self.shadow, strict=True):
                yield s_param, MemoryCategory.PARAMETER, name
