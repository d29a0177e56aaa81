"""The scatters of ``gather``'s and ``max(dim)``'s backward in place, as on a GPU.

``gather_backward`` (PyTorch torch/csrc/autograd/FunctionsManual.cpp) makes
``result = grad.new_zeros(self.sizes())`` and scatters the gradient into it in place,
``result.scatter_add_(dim, index, grad)``, unless the index or the gradient is a tensor subclass
(``areAnyTensorSubclassLike``, "for composite, vmap and inductor compliance"), when it calls the
out-of-place ``result.scatter_add(...)``. ``value_selecting_reduction_backward_symint``
(aten/src/ATen/native/ReduceOps.cpp: the backward of ``max(dim)``, ``min(dim)``, ``kthvalue``,
``mode``, ``median(dim)``, ``nanmedian(dim)``, ``sort``, ``topk``) does the same with
``zeros.scatter_`` / ``zeros.scatter``. Fake tensors are a subclass, so a trace would hold the
zeros and the scattered copy at once: one tensor of the input's size more than a GPU (the CS336
course's cross-entropy gathers from the whole (tokens, vocabulary) log-softmax,
cs336_basics/nn_utils.py ``cross_entropy``: real GPU snapshot S001 shows one allocation there; its
written-out softmax subtracts ``torch.max(x, dim, keepdim=True)[0]`` from the attention scores:
real snapshot S026 shows one (b, heads, s, s) allocation per layer there, the trace made two).

:func:`cuda_scatter_backward` answers ``aten.scatter_add`` inside a ``GatherBackward0`` node and
``aten.scatter.src`` inside a value-selecting reduction's backward node with the in-place op on
its own zeros tensor, which nothing else references; values do not matter on fake tensors and
the allocations become the GPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

__all__ = ["cuda_scatter_backward"]

VALUE_SELECTING_BACKWARD = frozenset(
    {
        "MaxBackward0",
        "MinBackward0",
        "KthvalueBackward0",
        "ModeBackward0",
        "MedianBackward1",
        "NanmedianBackward1",
        "SortBackward0",
        "SortBackward1",
        "TopkBackward0",
    }
)
"""Backward nodes whose formula is ``value_selecting_reduction_backward_symint``
(tools/autograd/derivatives.yaml: ``max.dim``, ``min.dim``, ``kthvalue``, ``mode``,
``median.dim``, ``nanmedian.dim``, ``sort`` / ``sort.stable``, ``topk``)."""


class _ScatterBackwardMode(TorchDispatchMode):  # type: ignore[misc]
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.scatter_add.default:
            node = torch._C._current_autograd_node()
            if node is not None and node.name() == "GatherBackward0":
                return torch.ops.aten.scatter_add_.default(*args, **kwargs)
        elif func is torch.ops.aten.scatter.src:
            node = torch._C._current_autograd_node()
            if node is not None and node.name() in VALUE_SELECTING_BACKWARD:
                return torch.ops.aten.scatter_.src(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_scatter_backward() -> Iterator[None]:
    """Within the block, ``gather``'s and the value-selecting reductions' backward scatter in
    place (module docstring).

    Yields:
        None.
    """
    with _ScatterBackwardMode():
        yield
