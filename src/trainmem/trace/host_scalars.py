"""Host-side values for the scalars an optimizer reads with ``.item()`` inside its step.

torch's Adafactor reads its ``step`` count and parameter / update norms as Python numbers
(``torch/optim/_adafactor.py``: ``step_t.item()``, ``param.norm(2).item()``) to compute its
learning-rate scale. Fake tensors hold no data, so ``aten._local_scalar_dense`` raises
``DataDependentOutputException``. On a GPU that call only copies one scalar to the host (the
norm it reads is allocated either way), and the value sets step sizes, never allocation sizes.

:func:`host_scalars` answers it on the host while ``optimizer.step()`` runs: a ``step`` state
reads as the number of steps taken so far (counted by a step pre-hook, as the state itself would
hold), any other scalar as 1. Outside the optimizer step the call still raises, so a model whose
control flow reads tensor values is still refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

__all__ = ["host_scalars"]


class _HostScalarMode(TorchDispatchMode):  # type: ignore[misc]
    def __init__(self, optimizer: Any) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.active = False
        self.steps = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if (
            self.active
            and func is torch.ops.aten._local_scalar_dense.default
            and isinstance(args[0], FakeTensor)
        ):
            t = args[0]
            is_step = any(s.get("step") is t for s in self.optimizer.state.values())
            value: float = float(self.steps) if is_step else 1.0
            if t.dtype == torch.bool:
                return True
            if not t.dtype.is_floating_point and not t.dtype.is_complex:
                return int(value)
            return value
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_scalars(optimizer: Any) -> Iterator[None]:
    """Answer ``.item()`` on fake tensors inside ``optimizer.step()``; see the module docstring.

    Args:
        optimizer: the ``torch.optim.Optimizer`` whose steps are emulated.

    Yields:
        None.
    """
    mode = _HostScalarMode(optimizer)

    def pre(*_: Any) -> None:
        mode.steps += 1
        mode.active = True

    def post(*_: Any) -> None:
        mode.active = False

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    try:
        with mode:
            yield
    finally:
        for h in handles:
            h.remove()
