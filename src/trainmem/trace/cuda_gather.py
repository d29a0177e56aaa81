"""``gather``'s backward in place, as on a GPU.

``gather_backward`` (PyTorch torch/csrc/autograd/FunctionsManual.cpp) makes
``result = grad.new_zeros(self.sizes())`` and scatters the gradient into it in place,
``result.scatter_add_(dim, index, grad)``, unless the index or the gradient is a tensor subclass
(``areAnyTensorSubclassLike``, "for composite, vmap and inductor compliance"), when it calls the
out-of-place ``result.scatter_add(...)``. Fake tensors are a subclass, so a trace would hold the
zeros and the scattered copy at once: one tensor of ``gather``'s input size more than a GPU (the
CS336 course's cross-entropy gathers from the whole (tokens, vocabulary) log-softmax,
cs336_basics/nn_utils.py ``cross_entropy``; real GPU snapshot S001 shows one allocation there).

:func:`cuda_gather_backward` answers ``aten.scatter_add`` inside the ``GatherBackward0`` node
with the in-place op on its own zeros tensor, which nothing else references; values do not
matter on fake tensors and the allocations become the GPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

__all__ = ["cuda_gather_backward"]


class _GatherBackwardMode(TorchDispatchMode):  # type: ignore[misc]
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten.scatter_add.default:
            node = torch._C._current_autograd_node()
            if node is not None and node.name() == "GatherBackward0":
                return torch.ops.aten.scatter_add_.default(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_gather_backward() -> Iterator[None]:
    """Within the block, ``gather``'s backward scatters in place (module docstring).

    Yields:
        None.
    """
    with _GatherBackwardMode():
        yield
