"""``Module.to`` inside a traced forward, when it converts nothing.

Note [Module.to on fake parameters]
    Some forwards move a submodule to the dtype it already has on every step (transformers
    5.24 ``models/switch_transformers/modeling_switch_transformers.py``
    ``SwitchTransformersTop1Router.forward``: ``self.classifier =
    self.classifier.to(self.dtype)``, the router's fp32 "selective precision"; its weights are
    fp32 already). On a GPU that is a no-op: ``Module._apply`` converts each parameter with
    ``t.to(dtype)``, which returns ``t`` itself, and sets ``param.data`` to it
    (``torch/nn/modules/module.py`` ``_apply``, torch 2.13). On fake parameters ``_apply``
    swaps instead (``p_should_use_swap_tensors`` is true for every ``FakeTensor``), and the swap
    fails: the fake-tensor converter keeps weak references to the fake parameters it made
    (``torch/_subclasses/meta_utils.py`` ``MetaConverter.tensor_memo``, a
    ``WeakValueDictionary``), and ``torch.utils.swap_tensors`` refuses a tensor with one
    ("Cannot swap t1 because it has weakref associated with it").

    :func:`unchanged_conversions_kept` makes ``Module.to`` return the module untouched when
    every parameter and buffer already has the device and dtype asked for (no memory format
    asked): exactly the GPU's outcome, with no allocation. Any conversion that changes a
    tensor goes to ``Module.to`` as before (and still fails on fake parameters, as a refused
    trace).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["unchanged_conversions_kept"]


def _converts_nothing(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``module.to(*args, **kwargs)`` would leave every parameter and buffer as it is
    (``Module.to``'s ``convert``: floating and complex tensors take ``dtype``, every tensor
    ``device``)."""
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return False  # Module.to raises its own error
    if memory_format is not None:
        return False
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return False  # Module.to refuses it
    for t in itertools.chain(module.parameters(), module.buffers()):
        if device is not None and t.device != torch.device(device):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True


@contextlib.contextmanager
def unchanged_conversions_kept() -> Iterator[None]:
    """Within the block, ``Module.to`` that changes no tensor returns the module
    (Note [Module.to on fake parameters])."""
    original = torch.nn.Module.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _converts_nothing(self, args, kwargs):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]
