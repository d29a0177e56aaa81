"""Which module is running: a forward stack plus autograd-node ownership for backward.

``torch.utils.module_tracker.ModuleTracker`` would be the natural tool, but it registers a
multi-grad hook per module call whose handle it keeps for the whole step; under non-reentrant
activation checkpointing those handles keep each recomputed layer's graph (and its saved
tensors) alive, so the traced peak rose by megabytes over the real run's (measured on
tiny-gpt2-test, b2 s128: +4.26 MB). This tracker holds no tensors and no graph nodes:

- forward (and checkpoint recomputation): global ``nn.Module`` forward pre/post hooks push and pop
  the module's dotted path (``torch/nn/modules/module.py``, ``register_module_forward_pre_hook``);
- backward: when a module's forward returns, the autograd nodes it created (walked from its
  outputs' ``grad_fn`` back to nodes already owned) are mapped, by ``Node._sequence_nr()``, to its
  path; inner modules return first and own their nodes. During backward the running node is
  ``torch._C._current_autograd_node()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.utils._pytree import tree_flatten  # noqa: E402

__all__ = ["ModulePathTracker", "clean_module_path"]

_FSDP1_WRAPPER = "_fsdp_wrapped_module"
"""The attribute FSDP1 keeps the wrapped module under (torch/distributed/fsdp/_common_utils.py
``FSDP_WRAPPED_MODULE``)."""


def clean_module_path(path: str) -> str:
    """``path`` without FSDP1's wrapper segments (``model.layers.0._fsdp_wrapped_module.mlp``
    -> ``model.layers.0.mlp``), as the unwrapped model names the module (Note [Tracing FSDP1]
    in trainmem/trace/fsdp.py); other paths unchanged."""
    if _FSDP1_WRAPPER not in path:
        return path
    return ".".join(p for p in path.split(".") if p != _FSDP1_WRAPPER)


class ModulePathTracker:
    """Context manager answering :meth:`current` = the innermost running module's dotted path.

    Args:
        root: the model; paths are ``root.named_modules()`` names (``""`` for the root).
    """

    active: ClassVar[ModulePathTracker | None] = None
    """The tracker inside its ``with`` block, if any (for :meth:`inside`'s callers)."""

    def __init__(self, root: Any) -> None:
        self._names = {
            id(m): clean_module_path(n) for n, m in root.named_modules(remove_duplicate=False)
        }
        self._stack: list[str] = []
        self._owner: dict[int, str] = {}
        self._handles: list[Any] = []
        self.depth_callback: Any = None

    def current(self) -> str:
        """Innermost module path (forward stack first, else the running backward node's)."""
        if self._stack:
            return self._stack[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        return self._owner.get(node._sequence_nr(), "")

    @contextlib.contextmanager
    def inside(self, module: Any) -> Iterator[None]:
        """Name ``module`` the running module for work done on its behalf outside its forward
        and its autograd nodes (FSDP2's post-backward reduce-scatter that pipelining calls
        after the last micro-batch); not a forward region, so no depth callback.

        Args:
            module: the module.

        Yields:
            None.
        """
        self._stack.append(self._names.get(id(module), type(module).__name__))
        try:
            yield
        finally:
            self._stack.pop()

    def _pre(self, module: Any, _args: Any) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))
        if self.depth_callback is not None:
            self.depth_callback(len(self._stack))

    def _post(self, module: Any, _args: Any, output: Any) -> None:
        name = self._stack.pop() if self._stack else ""
        flat, _ = tree_flatten(output)
        todo = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        owner = self._owner
        while todo:
            node = todo.pop()
            seq = node._sequence_nr()
            if seq in owner or type(node).__name__ == "AccumulateGrad":
                continue
            owner[seq] = name
            todo.extend(n for n, _ in node.next_functions if n is not None)
        if self.depth_callback is not None:
            self.depth_callback(len(self._stack))

    def __enter__(self) -> ModulePathTracker:
        mod = torch.nn.modules.module
        self._handles = [
            mod.register_module_forward_pre_hook(self._pre),
            mod.register_module_forward_hook(self._post, always_call=True),
        ]
        ModulePathTracker.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        ModulePathTracker.active = None
