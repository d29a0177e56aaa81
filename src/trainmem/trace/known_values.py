"""Concrete values for the batch tensors whose contents trainmem chose (masks, ids), so that a
model's forward may read them on fake tensors.

Note [Known values of a synthetic batch]
    Fake tensors hold no data: a forward that reads a value (``mask.sum(1).tolist()``,
    ``int(mask.sum())``, ``torch.nonzero(mask)``, ``x[mask]``, ``repeat_interleave(x,
    counts)``) raises ``DataDependentOutputException`` / ``DynamicOutputShapeException`` in
    ``FakeTensorMode``. But the batch is synthetic: a prompt mask is all ones (unpadded prompts),
    ids are zeros, an image-slot mask is what the pipeline builds for one image. Such a tensor is
    made with :func:`known`, which keeps a real CPU copy of its value beside the fake tensor.

    :func:`known_values` pushes a ``TorchDispatchMode`` between ``FakeTensorMode`` and the
    storage recorder (so the recorder still sees every op's output) that

    - propagates the copies: an op whose every tensor input has a value (or that reads none:
      ``zeros`` / ``ones`` / ``full`` / ``arange``, ``new_zeros`` ...) is run on the real copies
      too, its outputs get theirs (each at most :data:`MAX_KNOWN_ELEMENTS` elements or no
      larger than its largest input: an image's pixels the batch chose, compared and summed
      by a forward that drops padding images, ``modeling_idefics2.py`` ``get_image_features``;
      views alias as the real views do, in-place ops update them). Random and uninitialised
      results (``rand``, ``empty``) never have a value;
    - answers the reads: an op that raises one of the two exceptions above while every tensor
      input has a value returns the real result (a Python number for ``.item()``, a fake tensor
      of the real result's shape and contents otherwise); ``index`` / ``index_put_`` with a
      boolean index that has a value are run with that index's ``nonzero()`` positions, as the
      kernels do (``aten/src/ATen/native/TensorAdvancedIndexing.cpp`` expands boolean indices
      with ``nonzero``; its int64 positions are a temporary of [n, dims] elements, not recorded);
    - forgets: an in-place op on a tensor with a value that also reads a tensor without one
      drops the values of every tensor sharing its storage.

    A read of a value nobody chose still raises, so a model whose control flow depends on data
    (not on the synthetic batch's masks) stays refused. Memory never depends on the values the
    model computes with, only on shapes; the values fixed here are the ones that set shapes
    (how many prompt tokens are valid, where image tokens go).

    Mirrors in spirit torch's ``fake_tensor_propagate_real_tensors``
    (``torch/_subclasses/fake_tensor.py``), which runs every op for real; here only the small
    tensors derived from the chosen values are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: E402

__all__ = ["MAX_KNOWN_ELEMENTS", "known", "known_values", "value_of"]

MAX_KNOWN_ELEMENTS = 1 << 22
"""Largest tensor (elements) whose value is kept when it is larger than every input of the op
that made it: masks and ids are [batch, tokens]; a [batch, 1, tokens, tokens] attention mask
built from them is kept up to 2,048 tokens. An op's result no larger than one of its inputs
with a value (a view, an elementwise op, a reduction of the pixels :func:`known` made) keeps
its value at any size: the real work is that of the op on the batch's own tensor."""

_VALUES: Any = WeakTensorKeyDictionary()
"""fake tensor -> its real CPU value."""

_aten = torch.ops.aten
_METADATA_ONLY = frozenset(
    {
        _aten.new_zeros.default,
        _aten.new_ones.default,
        _aten.new_full.default,
        _aten.zeros_like.default,
        _aten.ones_like.default,
        _aten.full_like.default,
    }
)
"""Ops whose tensor input gives only dtype, device and shape: the result has a value."""
_NO_VALUE = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.empty_strided.default,
        _aten.new_empty_strided.default,
    }
)
"""Uninitialised results."""
_BOOL_INDEXED = frozenset(
    {
        _aten.index.Tensor,
        _aten.index_put.default,
        _aten.index_put_.default,
        _aten._unsafe_index.Tensor,
        _aten._unsafe_index_put.default,
        _aten._index_put_impl_.default,
    }
)
"""Ops taking a list of indices (argument 1), boolean ones expanded with ``nonzero``."""


def known(make: Callable[[], Any]) -> Any:
    """``make()``'s tensor, its value kept for the forward's reads (Note [Known values of a
    synthetic batch]).

    Args:
        make: builds the tensor (a deterministic factory: ``torch.ones(b, t, dtype=bool)``);
            called once in the current mode (a fake tensor inside ``FakeTensorMode``) and once
            for real on the CPU.

    Returns:
        The tensor ``make()`` returns in the current mode.
    """
    tensor = make()
    if isinstance(tensor, FakeTensor):
        with _disable_current_modes():
            value = make()
        _VALUES[tensor] = value.to("cpu")
    return tensor


def value_of(tensor: Any) -> Any:
    """The real value of ``tensor``: itself for a real tensor (a Python scalar the op wrapped,
    ``torch.tensor(data)`` before its lift), the kept one for a fake tensor, a fake tensor's
    ``constant`` (small tensors the fake mode made from data); else None."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if not isinstance(tensor, FakeTensor):
        return tensor
    value = _VALUES.get(tensor)
    return value if value is not None else tensor.constant


def _cpu(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, torch.device) else x


def _real(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on the inputs' values, every device the CPU, no mode active."""
    args, kwargs = tree_map(
        lambda x: value_of(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    args, kwargs = tree_map(_cpu, (args, kwargs))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    with _disable_current_modes():
        return func(*args, **kwargs)


def _tensors(tree: Any) -> list[Any]:
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _mutated(func: Any, args: Any, kwargs: Any) -> list[Any]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(_tensors(value))
    return out


def _all_have_values(args: Any) -> bool:
    """Every tensor among ``args`` (and in their lists) has a value; stops at the first that
    has none (the common case costs one lookup)."""
    for x in args:
        if isinstance(x, torch.Tensor):
            if value_of(x) is None:
                return False
        elif isinstance(x, (list, tuple)) and not _all_have_values(x):
            return False
    return True


def _limit(args: Any, kwargs: Any) -> int:
    """Elements an op's result may have and keep its value: :data:`MAX_KNOWN_ELEMENTS`, or the
    largest of the op's inputs that has a value."""
    sizes = [t.numel() for t in _tensors((args, kwargs)) if value_of(t) is not None]
    return max([MAX_KNOWN_ELEMENTS, *sizes])


def _storage(t: Any) -> int:
    return id(t.untyped_storage())


class _KnownValueMode(TorchDispatchMode):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.storages = {_storage(t) for t in list(_VALUES.keys())}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_ONLY:
            have = all(value_of(t) is not None for t in _tensors((args[1:], kwargs)))
        else:  # stops at the first input without a value: most ops read an activation
            have = _all_have_values(args) and _all_have_values(kwargs.values())
        if not have:
            self._forget(func, args, kwargs)
            if func in _BOOL_INDEXED:
                args = self._positions(args)
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._answer(func, args, kwargs)
        if func not in _NO_VALUE and torch.Tag.nondeterministic_seeded not in func.tags:
            self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        fakes = [t for t in _tensors(out) if isinstance(t, FakeTensor)]
        limit = _limit(args, kwargs)
        if not fakes or any(t.numel() > limit for t in fakes):
            return
        try:
            real = _tensors(_real(func, args, kwargs))
        except Exception:  # noqa: BLE001 - a CPU kernel missing for a dtype: no value, as before
            return
        if len(real) != len(_tensors(out)):
            return
        for fake, value in zip(fakes, real, strict=True):
            if fake.shape == value.shape:
                _VALUES[fake] = value
                self.storages.add(_storage(fake))

    def _answer(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The real result of a data-dependent op whose inputs all have values."""
        real = _real(func, args, kwargs)
        if not isinstance(real, torch.Tensor | tuple | list):
            return real  # ``.item()``: a Python number
        mode = next(t.fake_mode for t in _tensors((args, kwargs)) if isinstance(t, FakeTensor))
        limit = _limit(args, kwargs)

        def fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            with _disable_current_modes():
                value = value.clone()
            t = mode.from_tensor(value)
            if value.numel() <= limit:
                _VALUES[t] = value
                self.storages.add(_storage(t))
            return t

        return tree_map(fake, real)

    def _positions(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with each boolean index that has a value replaced by its positions."""
        if len(args) < 2 or not isinstance(args[1], list | tuple):
            return args
        indices: list[Any] = []
        for index in args[1]:
            value = value_of(index)
            if value is None or value.dtype not in (torch.bool, torch.uint8):
                indices.append(index)
                continue
            mode = index.fake_mode
            with _disable_current_modes():
                positions = [p.clone() for p in value.bool().nonzero().unbind(1)]
            indices.extend(mode.from_tensor(p) for p in positions)
        return (args[0], indices, *args[2:])

    def _forget(self, func: Any, args: Any, kwargs: Any) -> None:
        """An in-place op that also reads an unknown tensor: its target's storage has no
        value any more."""
        if not func._schema.is_mutable:
            return
        stale = {_storage(t) for t in _mutated(func, args, kwargs)} & self.storages
        if not stale:
            return
        for t in list(_VALUES.keys()):
            if _storage(t) in stale:
                del _VALUES[t]
        self.storages -= stale


@contextlib.contextmanager
def known_values() -> Iterator[None]:
    """Answer the forward's reads of the values :func:`known` kept (Note [Known values of a
    synthetic batch]); a no-op when no tensor has a value.

    Yields:
        None.
    """
    if not len(_VALUES):
        yield
        return
    with _KnownValueMode():
        yield
