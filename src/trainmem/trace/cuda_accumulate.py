"""Gradient accumulation in the autograd engine's input buffers in place, as on a GPU.

When two gradients reach the same input of a backward node (the residual stream feeds the
residual add and the next norm; ``x`` feeds both ``x * cos`` and ``rotate_half(x) * sin`` in
RoPE; a gated MLP's input feeds its gate and up projections), the engine sums them in
``InputBuffer::accumulate`` (PyTorch torch/csrc/autograd/input_buffer.cpp)::

    if (at::GradMode::is_enabled()) buffer[pos] = old_var + var;
    else if (can_accumulate_inplace(old_var) && !at::isTensorSubclassLike(var))
      buffer[pos] = old_var.add_(var);
    else buffer[pos] = old_var + var;

``can_accumulate_inplace(v)`` asks for a plain tensor (not ``isTensorSubclassLike``), non-
overlapping and dense, whose ``use_count`` and storage ``use_count`` are 1 (the buffer holds the
last reference). ``isTensorSubclassLike`` is true for every tensor while a ``TorchDispatchMode``
is active (ATen/TensorSubclassLikeUtils.h: ``c10::impl::dispatch_mode_enabled()``) and for fake
tensors, so a trace always takes the out-of-place branch: it allocates the sum beside the two
addends, one gradient-sized tensor a GPU does not allocate, at every such junction (a real GPU
snapshot of the course transformer, S026, shows the in-place sums: about 7 fp32 (b, s, d)
allocations per layer fewer than the trace made, at its norms, RoPE and MLP input).

:func:`cuda_grad_accumulation` answers the engine's ``aten.add.Tensor`` with ``aten.add_.Tensor``
on ``old_var`` when the GPU would (:func:`_in_place_on_gpu`): the call is the engine's
accumulation (it comes after the current node's ``apply`` returned: a post hook marks the node,
see :class:`_AccumulateMode`), ``old_var`` is dense and no other tensor shares its storage, and
it holds no more references than ``var``, which the engine has just moved in (the dispatch path
adds the same count to both arguments). Checked against the engine's own choice on a real CPU run
without a dispatch mode (tests/trace/test_cuda_in_place_backward.py). Values do not matter on
fake tensors; the allocations become the GPU's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

__all__ = ["cuda_grad_accumulation"]


def _storage_use_count(t: Any) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _dense(t: Any) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return bool(is_non_overlapping_and_dense_or_false(t))


def _plain(t: Any) -> bool:
    """A tensor a GPU run would hold as a plain tensor: a fake tensor (the trace's stand-in for
    one) or no Python dispatch key; a tensor subclass (DTensor, float8, NF4...) is
    ``isTensorSubclassLike`` on a GPU too."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return True
    return not torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


_SUBCLASS_DISPATCH_FILES = ("torch/distributed/tensor/_dispatch.py",)


def _inside_subclass_dispatch() -> bool:
    """Whether this op is a tensor subclass's own local computation: DTensor's op dispatcher
    (torch/distributed/tensor/_dispatch.py) or a subclass's ``__torch_dispatch__`` (torchao's
    float8 tensors) is on the Python stack. The trace's recorder lets subclass ops through
    (``NotImplemented``) and sees their local ops, so a DTensor gradient sum -- out of place on a
    GPU, ``isTensorSubclassLike`` -- reaches this mode only as its local ``add``."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_SUBCLASS_DISPATCH_FILES):
            return True
        if code.co_name == "__torch_dispatch__":
            owner = frame.f_locals.get("cls", frame.f_locals.get("self"))
            if isinstance(owner, type) and issubclass(owner, torch.Tensor):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _in_place_on_gpu(old: Any, var: Any) -> bool:
    """``can_accumulate_inplace(old_var)`` of input_buffer.cpp, read through the dispatch path:
    same shape and dtype (``add_`` keeps ``old``'s), non-overlapping and dense, its storage
    held by no other tensor (storage ``use_count`` 2: its one tensor and the Python storage
    object asked here) and not ``var``'s, and no more tensor references than ``var``, which the
    engine has just moved in (the dispatch path adds the same count to both arguments); neither
    a tensor subclass, and not a subclass's own local sum (:func:`_inside_subclass_dispatch`)."""
    if not (_plain(old) and _plain(var)) or _inside_subclass_dispatch():
        return False
    if old.shape != var.shape or old.dtype != var.dtype or not _dense(old):
        return False
    if old.untyped_storage()._cdata == var.untyped_storage()._cdata:
        return False
    return _storage_use_count(old) == 2 and old._use_count() <= var._use_count()


def _key(node: Any) -> tuple[int, str]:
    """A node's identity without a reference to it: its sequence number and name (node objects
    take no weak references, and holding one would keep its inputs alive: a node holds its
    successors, ``AccumulateGrad`` its leaf tensor)."""
    return int(node._sequence_nr()), str(node.name())


class _AccumulateMode(TorchDispatchMode):  # type: ignore[misc]
    """Marks each backward node once its ``apply`` has returned (a post hook, registered on a
    node's successors when it runs: the engine decides whether to call post hooks before
    ``apply``, torch/csrc/autograd/engine.cpp ``call_function``), so an ``add`` the engine
    runs under that node afterwards is the input buffer's accumulation, not the node's formula.
    No hook goes on ``AccumulateGrad``: a post hook makes the engine copy a node's inputs, and
    ``AccumulateGrad`` steals an incoming gradient only when it holds the last reference."""

    def __init__(self) -> None:
        super().__init__()
        self._hooked: set[tuple[int, str]] = set()
        self._applied: tuple[int, str] | None = None
        self.decisions: list[bool] = []  # per accumulation: summed in place

    def _post_hook(self, _grad_inputs: Any, _grad_outputs: Any) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            self._applied = _key(node)
            self._hook_next(node)

    def _hook_next(self, node: Any) -> None:
        for nxt, _ in node.next_functions:
            if nxt is None or nxt.name().endswith("AccumulateGrad"):
                continue
            key = _key(nxt)
            if key not in self._hooked:
                self._hooked.add(key)
                nxt.register_hook(self._post_hook)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        if node is not None:
            key = _key(node)
            if (
                func is torch.ops.aten.add.Tensor
                and key == self._applied
                and not kwargs
                and len(args) == 2
                and isinstance(args[1], torch.Tensor)
            ):
                old, var = args
                in_place = _in_place_on_gpu(old, var)
                self.decisions.append(in_place)
                if in_place:
                    return torch.ops.aten.add_.Tensor(old, var)
            elif key not in self._hooked:  # a node not hooked in time (the root)
                self._hooked.add(key)
                self._hook_next(node)
            del node
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_grad_accumulation() -> Iterator[_AccumulateMode]:
    """Within the block, the autograd engine sums gradients in place where a GPU would
    (module docstring).

    Yields:
        the mode (``decisions``: for each accumulation, whether it ran in place; for tests).
    """
    with _AccumulateMode() as mode:
        yield mode
