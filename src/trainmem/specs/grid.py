"""Training settings written as text: one value of a field (``--set``, the web form, a sweep's
``--over``) and a sweep's grid (``FIELD=V1,V2,...``), typed like the field's default of
:class:`~trainmem.specs.training.TrainingConfig`.

Split out of :mod:`trainmem.planner.sweep` so that the CLI's option tables and the web form
parse settings without importing the planner and its engines (Note [--help imports no engine]
in :mod:`trainmem.specs.engines`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import MISSING, fields
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.bounds import STRICT_INT, parse_strict_int
from trainmem.specs.training import TrainingConfig

__all__ = ["SWEEPABLE", "field_name", "parse_over", "parse_value"]

_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(TrainingConfig) if f.default is not MISSING
}
_ANNOTATIONS: dict[str, Any] = {f.name: f.type for f in fields(TrainingConfig)}
SWEEPABLE: tuple[str, ...] = tuple(_DEFAULTS)
"""TrainingConfig fields a sweep may vary (every field with a default)."""


def field_name(key: str) -> str:
    """The TrainingConfig field for a sweep key (``micro-batch-size`` or ``micro_batch_size``).

    Raises:
        SpecError: not a sweepable field (the message lists them).
    """
    name = key.strip().replace("-", "_")
    if name not in _DEFAULTS:
        allowed = ", ".join(n.replace("_", "-") for n in SWEEPABLE)
        raise SpecError("over", f"unknown field {key!r}; allowed: {allowed}")
    return name


def parse_value(name: str, text: str) -> Any:
    """One value of field ``name`` from text, typed like the field's default.

    ints (``4``), floats, bools (``true/false/1/0/yes/no``), tuples (``q+v``), strings.
    The value's range is checked later by TrainingConfig itself.

    Raises:
        SpecError: text that is not of the field's type.
    """
    default = _DEFAULTS[name]
    raw = text.strip()
    if default is None:  # an optional field: type the value by the field's annotation
        annotation = str(_ANNOTATIONS.get(name, ""))
        if annotation.startswith("bool"):
            default = False
        elif annotation.startswith("int") and raw.lstrip("-").isdigit():
            default = 0
        elif annotation.startswith("tuple"):  # lora_modules_to_save: none by default
            default = ()
    if isinstance(default, bool):
        folded = raw.lower()
        if folded in ("true", "1", "yes", "on"):
            return True
        if folded in ("false", "0", "no", "off"):
            return False
        raise SpecError(name, f"must be true or false, got {raw!r}")
    if isinstance(default, int):
        if not STRICT_INT.fullmatch(raw):
            raise SpecError(name, f"must be an integer, got {raw[:40]!r}")
        return parse_strict_int(raw)
    if isinstance(default, float):
        try:
            value = float(raw)
        except ValueError:
            raise SpecError(name, f"must be a number, got {raw[:40]!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise SpecError(name, f"must be a finite number, got {raw[:40]!r}")
        return value
    if isinstance(default, tuple):
        return tuple(p for p in raw.split("+") if p)
    return raw


def parse_over(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["micro-batch-size=1,2,4", "seq-len=512,1024"]`` -> ``{"micro_batch_size": [1, 2, 4],
    "seq_len": [512, 1024]}``.

    Raises:
        SpecError: an item without ``=``, an unknown field, an empty or mistyped value, or a
            field given twice.
    """
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep:
            raise SpecError("over", f"expected FIELD=V1,V2,..., got {item!r}")
        name = field_name(key)
        if name in out:
            raise SpecError("over", f"field {key.strip()!r} given twice")
        parts = [v for v in values.split(",") if v.strip()]
        if not parts:
            raise SpecError(name, f"no values in {item!r}")
        out[name] = [parse_value(name, v) for v in parts]
    return out
