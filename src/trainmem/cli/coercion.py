"""Typer's value coercion without pydantic for the plain options (issue 28: start-up time).

Note [Plain options skip pydantic]
    typer 0.2x coerces every parameter's value through a pydantic ``TypeAdapter``
    (``typer/_coercion.py`` ``build_runtime_param``, called from
    ``_TyperParameter.process_value`` for every option of the command, given or not): the
    first one imports pydantic (about 60 ms of CPU on the 2-core machine) and each builds a
    schema (another 30 ms for the ~50 options of ``plan`` / ``fit`` / ``estimate``).
    trainmem's options are ``str``, ``int``, ``float`` and ``bool`` without ``min`` /
    ``max`` / ``clamp`` (each setting checks its own values; the numbers have a ``parser``,
    ``cli/options.py`` ``strict_int`` / ``strict_float``), and for those the adapters' answer
    is known: ``parser(value)`` where there is a parser (typer's adapter is
    ``Annotated[Any, BeforeValidator(parser)]``), else the value itself when it already has
    the type, ``int(text)`` for a plain decimal integer. :func:`install` makes typer's
    parameters start from ``PlainRuntimeParam``, which answers those cases and hands every
    other value to the adapter typer would have built (so an error message is pydantic's,
    word for word). With a typer without ``typer._coercion`` (before 0.2x: click's own types
    convert) it does nothing. ``tests/test_cli_coercion.py`` compares both ways on every
    option of ``estimate``, ``plan`` and ``fit``.
"""

from __future__ import annotations

import re
from typing import Any

_PLAIN = (str, int, float, bool)
_DECIMAL = re.compile(r"0|-?[1-9][0-9]{0,17}")
"""An integer as pydantic's lax ``int`` reads it to the same value: no sign but ``-``, no
leading zero, no space or underscore, fewer than 19 digits."""


def plain_value(annotation: Any, value: Any) -> tuple[bool, Any]:
    """``(True, coerced)`` when the pydantic adapter of ``annotation`` (no constraints) is
    known to return ``coerced`` for ``value``, else ``(False, None)``."""
    kind = type(value)
    if kind is annotation and annotation in _PLAIN:
        return True, value
    if annotation is int and kind is str and _DECIMAL.fullmatch(value):
        return True, int(value)
    return False, None


def install() -> None:
    """Start typer's parameters from the plain runtime parameter (Note [Plain options skip
    pydantic]); idempotent; nothing with a typer that has no runtime coercion."""
    plain = plain_runtime_param_class()
    if plain is None:
        return
    from typer.core import _TyperParameter

    if getattr(_TyperParameter, "_trainmem_plain", False):
        return
    full = _TyperParameter.get_runtime_param

    def get_runtime_param(self: Any) -> Any:
        if self._runtime_param is None and self.type_descriptor.file_annotation is None:
            desc = self.type_descriptor
            self._runtime_param = plain(
                annotation=desc.annotation, parameter_info=desc.parameter_info
            )
        return full(self)

    _TyperParameter.get_runtime_param = get_runtime_param  # type: ignore[method-assign]
    _TyperParameter._trainmem_plain = True  # type: ignore[attr-defined]


def plain_runtime_param_class() -> Any:
    """The runtime parameter of Note [Plain options skip pydantic] (a subclass of typer's
    ``RuntimeParam``), or None with a typer that has none."""
    try:
        from typer import _coercion
    except ImportError:  # typer before runtime coercion: click converts the values
        return None

    class PlainRuntimeParam(_coercion.RuntimeParam):
        """The plain cases of Note [Plain options skip pydantic] (a missing value included,
        which typer's ``RuntimeParam.coerce`` answers itself); anything else goes to the
        runtime parameter typer builds."""

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            info = self.parameter_info
            parser = getattr(info, "parser", None)
            if self.annotation not in _PLAIN:
                pass
            elif parser is not None:  # typer's adapter is ``parser(value)``, nothing more
                try:
                    return parser(value)
                except Exception:  # noqa: BLE001 - the adapter words the error
                    pass
            elif _unbounded(info):
                known, coerced = plain_value(self.annotation, value)
                if known:
                    return coerced
            full = _coercion.build_runtime_param(param.type_descriptor)
            param._runtime_param = full
            return full.coerce(value, param=param, ctx=ctx)

    return PlainRuntimeParam


def _unbounded(info: Any) -> bool:
    """No bound on the value (typer's ``ParameterInfo``)."""
    return (
        getattr(info, "min", None) is None
        and getattr(info, "max", None) is None
        and not getattr(info, "clamp", False)
    )
