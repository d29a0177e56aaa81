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

        @wraps(fn)
        def cached(*args: Any) -> Any:
            # NB: the other arguments by identity (hashing a ModelSpec reads every field, 2 us);
            # the entry holds them, so no other object takes their id while it is kept
            k = key(args[0]) if len(args) == 1 else (*map(id, args[:-1]), key(args[-1]))
            hit = store.get(k, _MISSING)
            if hit is _MISSING:
                if len(store) >= maxsize:
                    del store[next(iter(store))]
                hit = store[k] = (fn(*args), args[:-1])
            return hit[0]  # type: ignore[index]

        cached.cache_clear = store.clear  # type: ignore[attr-defined]
        return cached  # type: ignore[return-value]

    return wrap
