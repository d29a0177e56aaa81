"""Caches keyed on the settings a function reads (issue 28: the planner evaluates thousands of
configurations that differ only in a few fields, and most terms read none of those).

A function of a :class:`~trainmem.specs.training.TrainingConfig` (its last argument) that reads
only some of its fields is cached on those fields' values and its other arguments (a
:class:`~trainmem.specs.model.ModelSpec`, by identity), never on the whole configuration: a
configuration that differs in a field the function does not read is answered from the cache,
as a user's second query with another micro-batch would be. The fields listed must be every
field the function reads, directly or through properties (each use names them beside it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from operator import attrgetter
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MISSING = object()


def cached_on(*fields: str, maxsize: int = 256) -> Callable[[F], F]:
    """Cache ``fn(*args, config)`` on ``args`` (by identity: an equal copy is a miss) and the
    values of ``config``'s ``fields``,
    keeping the ``maxsize`` newest entries (the oldest is dropped first). The cached value is
    shared: it must be immutable (a tuple, a frozen dataclass, an int).

    Args:
        fields: the attributes of the last argument the function reads (at least one).
        maxsize: entries kept.
    """
    key = attrgetter(*fields)

    def wrap(fn: F) -> F:
        store: dict[object, object] = {}
        # the last call's arguments (one or two) and answer: the same objects asked again (a
        # configuration's terms ask about twenty times) are answered without building the key
        last: list[Any] = [(_MISSING,), None]

        @wraps(fn)
        def cached(*args: Any) -> Any:
            prev = last[0]
            if len(args) == len(prev) and args[-1] is prev[-1] and args[0] is prev[0]:
                return last[1]
            # NB: the other arguments by identity (hashing a ModelSpec reads every field, 2 us);
            # the entry holds them, so no other object takes their id while it is kept
            k = key(args[0]) if len(args) == 1 else (*map(id, args[:-1]), key(args[-1]))
            hit = store.get(k, _MISSING)
            if hit is _MISSING:
                if len(store) >= maxsize:
                    del store[next(iter(store))]
                hit = store[k] = (fn(*args), args[:-1])
            if len(args) <= 2:
                last[0], last[1] = args, hit[0]  # type: ignore[index]
            return hit[0]  # type: ignore[index]

        def clear() -> None:
            store.clear()
            last[0], last[1] = (_MISSING,), None

        cached.cache_clear = clear  # type: ignore[attr-defined]
        return cached  # type: ignore[return-value]

    return wrap


def per_configuration(fn: F) -> F:
    """Cache ``fn(model, training)`` on the identity of both arguments (both frozen: the same
    objects give the same answer), keeping the few newest entries: for a term the engine asks
    about several times for one configuration (the step's builder, then the estimate's
    details). Unlike :func:`cached_on`, a configuration equal to an earlier one but another
    object is a miss, so no list of fields can be incomplete."""
    store: dict[tuple[int, int], tuple[object, object, object]] = {}

    @wraps(fn)
    def cached(model: Any, training: Any) -> Any:
        k = (id(model), id(training))
        hit = store.get(k)
        if hit is None:
            if len(store) >= 8:
                del store[next(iter(store))]
            # the entry holds both arguments, so no other object takes their ids while kept
            hit = store[k] = (fn(model, training), model, training)
        return hit[0]

    cached.cache_clear = store.clear  # type: ignore[attr-defined]
    return cached  # type: ignore[return-value]


class Identity:
    """A key for an object that hashes and compares by the object's identity (the object is
    held, so no other object takes its id while the key lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj


_BY_ID: dict[int, tuple[object, Identity]] = {}
_BY_VALUE: dict[object, Identity] = {}


def by_value(obj: object) -> Identity:
    """One :class:`Identity` per value: the key of the first object met that equals ``obj``
    (a ModelSpec is frozen, and hashing one reads every field, about 2 us: an object met
    before is found by its id instead). ``obj`` must be hashable and immutable."""
    known = _BY_ID.get(id(obj))
    if known is not None and known[0] is obj:
        return known[1]
    if len(_BY_ID) >= 256:  # the keys made stay valid; only the lookup is rebuilt
        _BY_ID.clear()
        _BY_VALUE.clear()
    key = _BY_VALUE.setdefault(obj, Identity(obj))
    _BY_ID[id(obj)] = (obj, key)
    return key
