"""How each training setting is offered to a user: the one record the CLI options and the web
form are generated from.

Every field of :class:`~trainmem.specs.training.TrainingConfig` (and of its concern dataclasses)
is declared with :func:`setting`, which stores a :class:`Setting` in the field's ``metadata``.
From a field and its :class:`Setting`:

- the CLI option (:mod:`trainmem.cli.options`): ``--`` plus the field name with dashes, the
  short flag, the ``--no-...`` flag of a boolean that defaults to True, the help text with its
  allowed values and default, the ``--help`` panel (:data:`trainmem.specs.groups.FIELD_GROUPS`);
- the web input (:mod:`trainmem.web.form`): its kind (:func:`kind_of`), its allowed values, its
  default, the same help text and label;
- the allowed values the dataclass itself checks (:attr:`Setting.choices`).

A test (``tests/test_settings_source.py``) holds the three to one another: every field has one
CLI option of its own name, default and choices, or is listed here as deliberately left to
``--set`` (:attr:`Setting.no_option`, with the reason), and one input on the page.

This module imports nothing from trainmem (the CLI reads it at start-up: no torch, no gradio).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

SETTING_KEY = "trainmem.setting"
"""The ``dataclasses.Field.metadata`` key of a field's :class:`Setting`."""

Defer = Literal["", "model", "cli"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One training setting as the CLI and the web page offer it (the field's name, type and
    default are the dataclass field's own)."""

    help: str
    """One or two sentences for ``--help`` and the page: what the setting is, its unit. The
    allowed values (:attr:`choices`) and the default are appended by :func:`help_text`."""
    choices: tuple[Any, ...] = ()
    """Allowed values (a tuple of :mod:`trainmem.specs.training`, ``PRECISIONS``...), or ()
    for a number, a flag or free text. Several of them for a tuple field (``lora_targets``)."""
    short: str = ""
    """The one-letter flag (``-b``), or ``""``."""
    off_flag: str = ""
    """A boolean that defaults to True: the flag that turns it off (``--no-dropout``)."""
    default_text: str = ""
    """What the default means, shown as ``[default: ...]`` instead of the bare value (None,
    or a value whose meaning needs words: ``0, the same as --seq-len``)."""
    defer: Defer = ""
    """Who fills the value in when the user gives none, if not the dataclass default:
    ``model``: the model's own (the CLI's option and the page's input are empty, None);
    ``cli``: :func:`trainmem.cli.options.training_from_options` from the other settings (its
    option is None; the page starts at the dataclass default and its command spells it out)."""
    no_option: str = ""
    """Why the setting has no CLI option of its own (it is given as ``--set KEY=VALUE`` or by a
    config file), or ``""``: it has one."""


def setting(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - the field's help
    """A dataclass field with ``default`` and its :class:`Setting` (``help`` and ``kwargs``)
    as metadata: ``micro_batch_size: int = setting(1, "Sequences per GPU per step.")``."""
    return dataclasses.field(default=default, metadata={SETTING_KEY: Setting(help, **kwargs)})


def setting_of(field: dataclasses.Field[Any]) -> Setting:
    """The :class:`Setting` of a field declared with :func:`setting`.

    Raises:
        KeyError: a field declared otherwise.
    """
    return field.metadata[SETTING_KEY]  # type: ignore[no-any-return]


def settings_of(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Setting]]:
    """Every field of a dataclass of settings with its :class:`Setting`, in field order."""
    return {f.name: (f, setting_of(f)) for f in dataclasses.fields(cls)}


def kind_of(field: dataclasses.Field[Any]) -> str:
    """The input a field needs: ``multi`` (several of its choices: a tuple field), ``choice``,
    ``bool``, ``tristate`` (true, false, or None: the framework's or the release's default,
    ``zero_grad_set_to_none``), ``int``, ``float`` or ``str`` (free text, or a value of a mixed
    type), from its :attr:`Setting.choices`, its default and, for a default of None, its
    annotation (a tuple field whose default is None, ``lora_targets``: the framework's, is
    still ``multi``)."""
    default = field.default
    if isinstance(default, tuple) or str(field.type).startswith("tuple["):  # None: resolved
        return "multi"
    if default is None and str(field.type) == "bool | None":
        return "tristate"
    if setting_of(field).choices:
        return "choice"
    if isinstance(default, bool | int | float):
        return type(default).__name__
    if default is None and str(field.type) == "int | None":  # an optional count
        return "int"
    return "str"


def help_text(field: dataclasses.Field[Any], *, choices: bool = True) -> str:
    """The help of a setting as ``--help`` and the page show it: :attr:`Setting.help`, its
    allowed values (``a | b | c``; left out with ``choices=False``, for an input that lists
    them itself) and :attr:`Setting.default_text` as ``[default: ...]`` (a plain default is the
    CLI's to print, as typer does, and the page's input shows it)."""
    s = setting_of(field)
    parts = [s.help]
    if s.choices and choices:
        parts.append(" | ".join(str(c) for c in s.choices) + ".")
    elif s.help.endswith(":"):  # "Lightning precision:" introduces the values
        parts = [s.help[:-1] + "."]
    if s.default_text:
        parts.append(f"[default: {s.default_text}]")
    return " ".join(parts)
