"""The page's inputs as plain data: which widget each training setting gets, and how the page
state becomes a :class:`~trainmem.specs.training.TrainingConfig`, a URL query string and the
equivalent ``trainmem estimate`` command.

No gradio here (``layout.py`` draws these fields), so all of it is tested without a browser.

The option list is derived from :class:`TrainingConfig` itself: every field is in exactly one
of :data:`GROUPS` (a test checks this), its default is the dataclass default, and its kind,
allowed values and help are the field's :class:`~trainmem.specs.settings.Setting`, the record
the CLI options are generated from (``tests/test_settings_source.py``), so the page offers what
``trainmem estimate`` accepts and nothing is spelled twice.

A *values* dict maps ``model``, ``gpu``, ``alloc_conf``, ``engine``, ``fsdp`` (the CLI's
``--fsdp`` strategy, None for none) and every TrainingConfig field name to a typed value
(``int``, ``float``, ``bool``, ``str``, ``tuple`` for ``lora_targets``, None there for the
framework's; ``seq_len`` None means the model's own context length, at most 4096, and
``attention`` None the model's own attention, eager for BLOOM / Gemma-2 and sdpa otherwise, as
in the CLI).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

from trainmem.errors import SpecError
from trainmem.specs.engines import ENGINES
from trainmem.specs.grid import parse_value
from trainmem.specs.groups import FIELD_GROUPS
from trainmem.specs.hardware import GPUS
from trainmem.specs.settings import help_text, kind_of, settings_of
from trainmem.specs.training import (
    FSDP_STRATEGIES,
    TrainingConfig,
    apply_fsdp,
    trainer_sharding,
)

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "H100-80GB"
DEFAULT_ENGINE = "auto"
"""The CLI's ``--engine`` default: the formulas where they cover the model, else the generic
path."""
NO_GPU = "(none)"
"""The GPU choice that asks for no fit verdict (the CLI without ``--gpu``)."""
ALL_LINEAR = "all-linear"
"""The ``lora_targets`` choice that means every layer linear of the model, ticked alone (the
CLI's ``--lora-targets all-linear``; :func:`trainmem.estimate.lora_linears_of`)."""
NO_FSDP = "(none)"
"""The ``--fsdp`` choice that shards by ``--zero-stage`` alone (the CLI without ``--fsdp``)."""
FSDP_CHOICES: tuple[str, ...] = (NO_FSDP, *FSDP_STRATEGIES)
"""The ``--fsdp`` dropdown: :data:`NO_FSDP`, then the CLI's strategies
(:data:`~trainmem.specs.training.FSDP_STRATEGIES`)."""
MODEL_DEFAULT = "model default"
"""The choice that leaves a setting to the model (``attention``: eager for BLOOM / Gemma-2,
sdpa otherwise), the CLI without the option."""

GROUPS = FIELD_GROUPS
"""Every TrainingConfig field, grouped as the page shows them (and the CLI help)."""

_SETTINGS = settings_of(TrainingConfig)

CHOICES: dict[str, tuple[Any, ...]] = {
    name: (MODEL_DEFAULT, *s.choices) if s.defer == "model" else s.choices
    for name, (_, s) in _SETTINGS.items()
    if s.choices
}
"""Allowed values of the fields that take one of a list (``lora_targets``: several of it), the
:attr:`~trainmem.specs.settings.Setting.choices` the CLI offers and TrainingConfig accepts
(``attention``: :data:`MODEL_DEFAULT` first, the CLI without the option; ``lora_targets``:
:data:`ALL_LINEAR` last, as the CLI's ``--lora-targets all-linear``)."""
CHOICES["lora_targets"] = (*CHOICES["lora_targets"], ALL_LINEAR)

FLAG_DEFAULT = "default"
"""The choice of a three-valued flag (``zero_grad_set_to_none``, ``overlap_comm``...) that
leaves it to the framework and its releases (None; the CLI without the option)."""
TRISTATE_CHOICES: tuple[str, ...] = (FLAG_DEFAULT, "true", "false")
"""The dropdown of a three-valued flag (kind ``tristate``): :data:`FLAG_DEFAULT`, then the
flag's two values as ``--set`` spells them."""
for _f, _s in _SETTINGS.values():
    if kind_of(_f) == "tristate":
        CHOICES[_f.name] = TRISTATE_CHOICES

_NO_FLAG = tuple(name for name, (_, s) in _SETTINGS.items() if s.no_option)
"""Fields without an option of their own in the CLI (given there as ``--set KEY=VALUE``;
:attr:`~trainmem.specs.settings.Setting.no_option` says why)."""
_NEGATIVE_FLAG = {name: s.off_flag for name, (_, s) in _SETTINGS.items() if s.off_flag}
"""Booleans that default to True: the CLI flag that turns them off."""

DEFAULTS: dict[str, Any] = {
    name: None if s.defer == "model" else f.default for name, (f, s) in _SETTINGS.items()
}
"""Every TrainingConfig field with the page's default (the dataclass's; None where the model's
own is meant, ``seq_len`` and ``attention``, filled in by :func:`training_config`)."""


@dataclass(frozen=True, slots=True)
class Field:
    """One training setting as the page shows it.

    Attributes:
        name: the TrainingConfig field.
        kind: ``choice``, ``multi`` (several of ``choices``), ``bool``, ``tristate`` (one of
            :data:`TRISTATE_CHOICES`), ``int``, ``float`` or ``str``
            (:func:`~trainmem.specs.settings.kind_of`).
        choices: allowed values for ``choice`` / ``multi`` / ``tristate``.
        help: what the setting is and its default, as ``--help`` says it
            (:func:`~trainmem.specs.settings.help_text`; the allowed values are the input's).
        label: the CLI option it mirrors (``--micro-batch-size``), shown on the page.
    """

    name: str
    kind: str
    choices: tuple[Any, ...] = ()
    help: str = ""

    @property
    def label(self) -> str:
        """The CLI option name, e.g. ``--micro-batch-size``."""
        return "--" + self.name.replace("_", "-")


def field(name: str) -> Field:
    """The :class:`Field` of a TrainingConfig field name.

    Raises:
        SpecError: ``name`` is not a TrainingConfig field.
    """
    if name not in DEFAULTS:
        raise SpecError(name, "not a training setting; allowed: " + ", ".join(DEFAULTS))
    f, _ = _SETTINGS[name]
    kind = kind_of(f)  # a dropdown or a checkbox group shows its values itself
    return Field(name, kind, CHOICES.get(name, ()), help_text(f, choices=kind == "str"))


def coerce(name: str, raw: Any) -> Any:
    """The typed value of one setting from what a widget or a URL holds.

    ``"4"``, ``4.0`` -> ``4`` for an int field; ``"true"`` -> True (:data:`FLAG_DEFAULT` -> None
    for a three-valued flag); ``"q+v"`` or ``["q", "v"]``
    -> ``("q", "v")``; ``""`` / None (``[]`` for ``lora_targets``) -> the default (None there:
    the framework's); the text of a ``str`` field as ``--set``
    reads it (:func:`trainmem.specs.grid.parse_value`: ``"2.10"`` stays a version,
    ``"500000000"`` is a bucket size, ``"auto"`` stays text). Ranges are checked by
    TrainingConfig.

    Raises:
        SpecError: a value of the wrong type (the message names the field).
    """
    f = field(name)
    if raw is None or raw == "" or raw == MODEL_DEFAULT or (f.kind == "multi" and not raw):
        return DEFAULTS[name]  # none ticked: lora_targets left to the framework
    if f.kind == "tristate" and raw == FLAG_DEFAULT:
        return None
    if f.kind == "multi":
        parts = raw.split("+") if isinstance(raw, str) else list(raw)
        return tuple(str(p) for p in parts if p)
    if f.kind in ("bool", "tristate"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise SpecError(name, f"must be true or false, got {raw!r}")
    if f.kind == "int" or (f.kind == "choice" and isinstance(DEFAULTS[name], int)):
        try:
            number = float(raw)
        except (TypeError, ValueError):
            raise SpecError(name, f"must be an integer, got {raw!r}") from None
        if not number.is_integer():
            raise SpecError(name, f"must be an integer, got {raw!r}")
        return int(number)
    if f.kind == "float":
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise SpecError(name, f"must be a number, got {raw!r}") from None
    if f.kind == "str":  # free text or a mixed type: read as --set reads it
        return parse_value(name, str(raw))
    return str(raw)


def default_values() -> dict[str, Any]:
    """The page's starting state: the CLI's defaults, :data:`DEFAULT_MODEL` on
    :data:`DEFAULT_GPU`."""
    return {
        "model": DEFAULT_MODEL,
        "gpu": DEFAULT_GPU,
        "alloc_conf": "",
        "engine": DEFAULT_ENGINE,
        "fsdp": None,
        **DEFAULTS,
    }


def fsdp_of(raw: Any) -> str | None:
    """The ``--fsdp`` strategy a widget or a URL holds: None for none (:data:`NO_FSDP`, empty).

    Raises:
        SpecError: an unknown strategy (the message names ``fsdp`` and lists the strategies).
    """
    if raw is None or raw in ("", NO_FSDP):
        return None
    if raw not in FSDP_STRATEGIES:
        allowed = ", ".join(FSDP_STRATEGIES)
        raise SpecError("fsdp", f"unknown value {raw!r:.80}; allowed: {allowed} (or none)")
    return str(raw)


def training_config(
    values: Mapping[str, Any], default_seq_len: int, default_attention: str = "sdpa"
) -> TrainingConfig:
    """The validated TrainingConfig the values describe.

    Args:
        values: a values dict (missing settings take their defaults).
        default_seq_len: tokens per sequence when ``seq_len`` is None (the model's own).
        default_attention: the attention when ``attention`` is None (the model's own,
            :func:`trainmem.estimate.default_attention_of`).

    Raises:
        SpecError: a value of the wrong type or out of range (the message names the field).
    """
    settings = {name: coerce(name, values.get(name)) for name in DEFAULTS}
    # --fsdp as the CLI reads it; a widget off its default is the page's given setting (as
    # the page's CLI command gives it: cli_command)
    fsdp = fsdp_of(values.get("fsdp"))
    apply_fsdp(settings, fsdp, {k for k, v in settings.items() if v != DEFAULTS[k]})
    if settings["seq_len"] is None:
        settings["seq_len"] = default_seq_len
    if settings["attention"] is None:
        settings["attention"] = default_attention
    # the HF Trainer shards through accelerate's FSDP (--fsdp) or DeepSpeed, as on the CLI
    trainer_sharding(settings, fsdp)
    return TrainingConfig(**settings)


# ---------------------------------------------------------------------------------------
# URL query string and CLI command
# ---------------------------------------------------------------------------------------

_PAGE_KEYS = ("model", "gpu", "alloc_conf", "engine", "fsdp")
_FLAGGED_PAGE_KEYS = ("alloc_conf", "engine", "fsdp")
"""Page keys given to ``trainmem estimate`` as options of their own (``--alloc-conf``,
``--engine``, ``--fsdp``); the model is its argument, the GPU ``--gpu``."""


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "+".join(value)
    return str(value)


def changed(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``values`` that differ from :func:`default_values`, in page order."""
    base = default_values()
    return {k: v for k, v in values.items() if k in base and v != base[k]}


def to_query(values: Mapping[str, Any], pins: list[dict[str, Any]] | None = None) -> str:
    """The URL query string of a page state: non-default settings, dashed names
    (``model=gpt2&micro-batch-size=4``), plus one ``pin=<query>`` per pinned configuration."""
    items = [(k.replace("_", "-"), _text(v)) for k, v in changed(values).items()]
    items += [("pin", to_query(p)) for p in pins or []]
    return urlencode(items)


def from_query(
    query: str | Mapping[str, str],
) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """Page state from a URL query (the inverse of :func:`to_query`).

    Args:
        query: ``"model=gpt2&micro-batch-size=4"`` or a mapping of the parameters.

    Returns:
        (values, pinned values, problems): unknown keys and bad values are left at their
        defaults and described in ``problems``, one line each, so a broken link still opens.
    """
    pairs = parse_qsl(query) if isinstance(query, str) else list(query.items())
    values = default_values()
    pins: list[dict[str, Any]] = []
    problems: list[str] = []
    for key, raw in pairs:
        name = key.replace("-", "_")
        if name == "pin":
            pinned, _, bad = from_query(raw)
            pins.append(pinned)
            problems += bad
        elif name == "fsdp":
            try:
                values[name] = fsdp_of(raw)
            except SpecError as exc:
                problems.append(f"link: {exc}")
        elif name in _PAGE_KEYS:
            values[name] = raw
        elif name in DEFAULTS:
            try:
                values[name] = coerce(name, raw)
            except SpecError as exc:
                problems.append(f"link: {exc}")
        else:
            problems.append(f"link: unknown setting {key!r} ignored")
    return values, pins, problems


def cli_command(values: Mapping[str, Any], model_arg: str | None = None) -> str:
    """The ``trainmem estimate`` command for the same configuration (shell-quoted).

    Args:
        values: a values dict.
        model_arg: what to pass as the model (e.g. the name of an uploaded ``config.json``);
            default ``values["model"]``.
    """
    words = ["trainmem", "estimate", model_arg or str(values.get("model", DEFAULT_MODEL))]
    gpu = values.get("gpu")
    if gpu and gpu != NO_GPU:
        words += ["--gpu", str(gpu)]
    flags = dict(changed(values))
    pp = values.get("pipeline_parallel_size")
    if isinstance(pp, int) and pp > 1:
        # the CLI's own default under pipelining is pipeline_parallel_size micro-batches
        flags.setdefault(
            "gradient_accumulation_steps", values.get("gradient_accumulation_steps", 1)
        )
    for name, value in flags.items():
        if name in _PAGE_KEYS and name not in _FLAGGED_PAGE_KEYS:
            continue
        if name in _NO_FLAG:
            words += ["--set", f"{name.replace('_', '-')}={_text(value)}"]
        elif name in _NEGATIVE_FLAG and value is False:
            words.append(_NEGATIVE_FLAG[name])
        elif isinstance(value, bool):
            words.append("--" + name.replace("_", "-"))
        else:
            text = ",".join(value) if isinstance(value, tuple) else _text(value)
            words += ["--" + name.replace("_", "-"), text]
    return " ".join(shlex.quote(w) for w in words)


def engine_choices() -> list[str]:
    """The engine picker: ``trainmem estimate --engine``'s values
    (:data:`trainmem.estimate.ENGINES`), ``auto`` first."""
    return list(ENGINES)


def gpu_choices() -> list[str]:
    """The GPU picker: the catalog (:data:`trainmem.specs.hardware.GPUS`) and :data:`NO_GPU`;
    the field also takes a capacity as ``--gpu`` does (``32GB``, ``24GiB``)."""
    return [*GPUS, NO_GPU]
