"""The command-line options that describe a training run, shared by every command.

:func:`with_training_options` adds them to a typer command and hands the command one validated
:class:`~trainmem.specs.training.TrainingConfig` (``training=``), so ``estimate``, ``formulas``,
``plan``, ``fit``, ``sweep``, ``compare`` and ``compare-snapshot`` accept the same flags, spelled
once. The options of TrainingConfig fields are generated from the fields themselves (name,
default, :class:`~trainmem.specs.settings.Setting`: help, allowed values, flags; the panel from
:data:`~trainmem.specs.groups.FIELD_GROUPS`), as the web form is. Values come from, in order of
precedence: an explicit flag, ``--set KEY=VALUE``, a
config file (``--deepspeed-config``, ``--accelerate-config``, ``--axolotl-config``,
``--torchtune-config``, ``--training-args``), the TrainingConfig default. Whether a flag
was given is click's parameter source (:func:`explicit_options`), never a comparison with its
default, so ``-b 1`` wins over a file's 4 although 1 is the default; a flag and a ``--set`` of
the same field with different values are refused, naming both.

This module has no ``from __future__ import annotations``: typer reads the annotations below at
registration time.
"""

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, TypeVar, get_args, get_type_hints

import typer
from rich.markup import escape
from typer.models import OptionInfo

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.bounds import STRICT_INT, parse_strict_int
from trainmem.specs.engines import ENGINES
from trainmem.specs.frameworks import HF_TRAINER_STACKS
from trainmem.specs.groups import FIELD_GROUPS
from trainmem.specs.hardware import check_precision_on_gpu, get_gpu
from trainmem.specs.model import ModelSpec
from trainmem.specs.settings import Setting, help_text, kind_of, settings_of
from trainmem.specs.training import (
    FSDP_HELP,
    FSDP_STRATEGIES,
    LORA_TARGETS,
    TrainingConfig,
    apply_fsdp,
    check_framework_versions,
    check_training_for_model,
    model_lora_linears,
    trainer_sharding,
)

F = TypeVar("F", bound=Callable[..., Any])


def _choices(values: tuple[str, ...]) -> str:
    """Allowed values for a help text, separated so that rich can wrap them (a ``a|b|c`` run
    is one word and is cut with an ellipsis at the terminal's width)."""
    return " | ".join(values)


ModelArg = Annotated[
    str,
    typer.Argument(
        help="Preset name (see `trainmem models`), a HF or diffusers config.json / folder, a "
        "hub id, or timm:<name> (a timm vision model)."
    ),
]
OUTPUT_PANEL = "Model, GPU and output"
"""The ``--help`` panel of the options that are not training settings (GPU, engine, output)."""
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        "-g",
        help="GPU for the verdict (see `trainmem gpus`), or a capacity: 32GB, 24GiB.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
EngineOpt = Annotated[
    str,
    typer.Option("--engine", "-e", help=_choices(ENGINES), rich_help_panel=OUTPUT_PANEL),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print JSON (exact bytes) instead of a table.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
AllocConfOpt = Annotated[
    str,
    typer.Option(
        "--alloc-conf",
        help="PYTORCH_CUDA_ALLOC_CONF for the allocator simulator.",
        rich_help_panel=OUTPUT_PANEL,
    ),
]


def _p(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _o(*decls: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    return typer.Option(*decls, help=escape(help))


def strict_int(text: Any) -> Any:
    """A command-line integer: base-10 digits only (``1_000``, ``2.0``, ``1e12`` are refused,
    as is a number of more than 30 digits). Anything else is handed on as text, truncated, for
    :class:`TrainingConfig` to refuse in one line that names the field."""
    if not isinstance(text, str):  # typer passes the (int) default through the parser too
        return text
    return parse_strict_int(text) if STRICT_INT.fullmatch(text.strip()) else _clip(text)


def strict_float(text: Any) -> Any:
    """A command-line number: a plain decimal (``0.05``, ``5e-2``); ``nan``, ``inf`` and
    ``1_0`` are handed on as text, as :func:`strict_int` does."""
    if not isinstance(text, str):
        return text
    return float(text) if _FLOAT.fullmatch(text.strip()) else _clip(text)


_FLOAT = re.compile(r"[+-]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][+-]?[0-9]{1,3})?")


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _of(*decls: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    return typer.Option(*decls, help=escape(help), parser=strict_float, metavar="FLOAT")


def _field_option(field: dataclasses.Field[Any], s: Setting) -> inspect.Parameter:
    """The CLI option of one TrainingConfig field, from the field and its
    :class:`~trainmem.specs.settings.Setting`: ``--`` and the name with dashes (``/`` the
    :attr:`~trainmem.specs.settings.Setting.off_flag` of a boolean), the short flag, the help
    (:func:`~trainmem.specs.settings.help_text`), the default (None where the model or
    :func:`training_from_options` fills it in); its panel is set by :func:`_set_panels`."""
    kind = kind_of(field)
    flag = "--" + field.name.replace("_", "-")
    decls = [f"{flag}/{s.off_flag}" if s.off_flag else flag, *([s.short] if s.short else [])]
    extra: dict[str, Any] = {"show_default": not s.default_text}
    default: Any = None if s.defer else field.default
    if kind == "bool" or s.off_flag:  # a flag pair; None: the default resolved later
        annotation: Any = bool
    elif kind == "int" or (kind == "choice" and isinstance(s.choices[0], int)):
        annotation, extra["parser"], extra["metavar"] = int, strict_int, "INTEGER"
    elif kind == "float":
        annotation, extra["parser"], extra["metavar"] = float, strict_float, "FLOAT"
    else:  # a name, free text, or a comma-separated list (lora_targets)
        annotation = str
        if isinstance(default, tuple):
            default = ",".join(default)
    option = typer.Option(*decls, help=escape(help_text(field)), **extra)
    return _p(
        field.name,
        Annotated[annotation if default is not None else annotation | None, option],
        default,
    )


_FIELD_SETTINGS = settings_of(TrainingConfig)
_CLI_ONLY: dict[str, tuple[str, inspect.Parameter]] = {
    "fsdp": (
        "zero_stage",
        _p(
            "fsdp",
            Annotated[
                str | None,
                _o(
                    "--fsdp",
                    help=f"{_choices(FSDP_STRATEGIES)} ({FSDP_HELP})",
                ),
            ],
            None,
        ),
    ),
    "lora_alpha": (
        "lora_rank",
        _p(
            "lora_alpha",
            Annotated[float, _of("--lora-alpha", help="LoRA scaling (no effect on memory).")],
            16.0,
        ),
    ),
}
"""The options that set no field of their own, each after the field option it goes with."""

CONFIG_FILE_OPTIONS = (
    "deepspeed_config",
    "accelerate_config",
    "axolotl_config",
    "torchtune_config",
    "training_args",
)
"""The options that name a config file to read settings from."""
_NOT_FIELDS = ("fsdp", "lora_alpha", *CONFIG_FILE_OPTIONS, "settings")

PANELS: dict[str, str] = {
    **{name: panel for panel, names in FIELD_GROUPS.items() for name in names},
    "fsdp": "Parallelism and sharding",
    "lora_alpha": "LoRA / QLoRA",
    **dict.fromkeys(CONFIG_FILE_OPTIONS, "Config files and --set"),
    "settings": "Config files and --set",
}
"""The ``--help`` panel of each training option: the concerns of
:data:`trainmem.specs.groups.FIELD_GROUPS` (the web page's groups), so ``estimate --help`` is
a few panels instead of one flat list."""


def _field_options() -> list[inspect.Parameter]:
    """The field options in the page's order (:data:`~trainmem.specs.groups.FIELD_GROUPS`),
    leaving out the settings given only by ``--set`` or a config file
    (:attr:`~trainmem.specs.settings.Setting.no_option`), with :data:`_CLI_ONLY` after theirs."""
    out = []
    for name in (name for names in FIELD_GROUPS.values() for name in names):
        field, s = _FIELD_SETTINGS[name]
        if not s.no_option:
            out.append(_field_option(field, s))
        out += [param for after, param in _CLI_ONLY.values() if after == name]
    return out


TRAINING_OPTIONS: tuple[inspect.Parameter, ...] = (
    *_field_options(),
    _p(
        "deepspeed_config",
        Annotated[
            str | None, _o("--deepspeed-config", help="Read settings from a ds_config.json.")
        ],
        None,
    ),
    _p(
        "accelerate_config",
        Annotated[
            str | None, _o("--accelerate-config", help="Read settings from an accelerate config.")
        ],
        None,
    ),
    _p(
        "axolotl_config",
        Annotated[
            str | None,
            _o("--axolotl-config", help="Read settings from an axolotl config.yml."),
        ],
        None,
    ),
    _p(
        "torchtune_config",
        Annotated[
            str | None,
            _o(
                "--torchtune-config",
                help="Read settings from a torchtune recipe YAML (implies --framework torchtune).",
            ),
        ],
        None,
    ),
    _p(
        "training_args",
        Annotated[
            str | None,
            _o(
                "--training-args",
                help="Read settings from a HF TrainingArguments / TRL SFTConfig JSON "
                "(implies --framework hf-trainer).",
            ),
        ],
        None,
    ),
    _p(
        "settings",
        Annotated[
            list[str] | None,
            _o("--set", help="Any other setting as KEY=VALUE, e.g. --set tensor-parallel-size=8."),
        ],
        None,
    ),
)
"""Every option that describes the run: one per TrainingConfig field that has one (generated
from the field's :class:`~trainmem.specs.settings.Setting`), ``fsdp`` (a ZeRO stage by another
name), ``lora_alpha`` (no memory effect), the config files and ``settings`` (``--set``)."""


def _set_panels(params: tuple[inspect.Parameter, ...]) -> None:
    for param in params:
        for meta in get_args(param.annotation)[1:]:
            if isinstance(meta, OptionInfo):
                meta.rich_help_panel = PANELS.get(param.name, OUTPUT_PANEL)


_set_panels(TRAINING_OPTIONS)


def parse_lora_targets(
    text: str, model: ModelSpec | None = None, model_arg: str | None = None
) -> tuple[str, ...]:
    """``"q,v"`` -> ("q", "v"); ``all-linear`` -> every layer linear of ``model`` (peft's
    ``all-linear``, :func:`~trainmem.specs.training.model_lora_linears`); without a ModelSpec
    (a family only the generic path runs), those of the model ``model_arg`` names
    (:func:`trainmem.estimate.lora_linears_of`), or every name of
    :data:`~trainmem.specs.training.LORA_TARGETS` without either."""
    if text.strip() == "all-linear":
        if model is not None:
            return model_lora_linears(model)
        from trainmem.estimate import lora_linears_of  # Note [--help imports no engine]

        return LORA_TARGETS if model_arg is None else lora_linears_of(model_arg)
    targets = tuple(part.strip() for part in text.replace("+", ",").split(",") if part.strip())
    if not targets:
        raise SpecError(
            "lora_targets", "empty; allowed: " + ",".join(LORA_TARGETS) + ",lm_head or all-linear"
        )
    return targets


def model_spec_or_none(model: str) -> ModelSpec | None:
    """The model's shape, or None for a family only the traced paths run (nothing to check
    settings against).

    Raises:
        SpecError: an unknown preset or an unreadable config.
    """
    from trainmem.estimate import resolve_model  # Note [--help imports no engine]

    try:
        return resolve_model(model)
    except UnsupportedError:
        return None


def config_file_settings(
    deepspeed_config: str | None,
    accelerate_config: str | None,
    auto: dict[str, str],
    *,
    axolotl_config: str | None = None,
    torchtune_config: str | None = None,
    training_args: str | None = None,
    notes: list[str] | None = None,
    model: str | None = None,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    """TrainingConfig settings from the config files given: accelerate, then a trainer's own
    file (HF TrainingArguments, axolotl, torchtune), then DeepSpeed, a later file winning where
    two say something; ``auto`` receives the fields a DeepSpeed file leaves to the Trainer
    (:func:`~trainmem.specs.framework_configs.deepspeed_settings`), ``notes`` what the trainer
    files read and ignored (:mod:`trainmem.specs.trainer_configs`); ``model`` / ``spec`` are
    the MODEL, for axolotl's ``base_model`` and ``lora_target_linear``."""
    from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config
    from trainmem.specs.trainer_configs import (
        read_axolotl_config,
        read_torchtune_config,
        read_training_args,
    )

    from_files: dict[str, Any] = {}
    if accelerate_config:
        from_files.update(read_accelerate_config(accelerate_config, auto))
    if training_args:
        from_files.update(read_training_args(training_args, notes))
    if axolotl_config:
        # ``lora_target_linear``: the model's own linears (peft's all-linear), from the
        # ModelSpec or, for a family only the generic path runs, the model built on meta
        # (AFM-4.5B's ungated MLP has no gate); every name without a MODEL
        if spec is not None:
            linears: tuple[str, ...] | None = model_lora_linears(spec)
        elif model is not None:
            from trainmem.estimate import lora_linears_of  # Note [--help imports no engine]

            linears = lora_linears_of(model)
        else:
            linears = None
        from_files.update(read_axolotl_config(axolotl_config, notes, model, linears))
    if torchtune_config:
        from_files.update(read_torchtune_config(torchtune_config, notes))
    if deepspeed_config:
        from_files.update(read_deepspeed_config(deepspeed_config, auto))
    for key in from_files:
        auto.pop(key, None)
    return from_files


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    """A setting as the command line spells it (``q,v``, ``true``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(value) if isinstance(value, tuple) else str(value)


def training_from_options(
    model: str, values: dict[str, Any], gpu: str | None = None, notes: list[str] | None = None
) -> TrainingConfig:
    """A validated TrainingConfig from the values of :data:`TRAINING_OPTIONS` the user gave
    (missing ones take their defaults); ``seq_len`` defaults to the model's context length (at
    most 4096). A given value wins over ``--set`` and the config files, whatever it is (the
    default included); ``--set`` wins over the files. The settings are also checked against the
    model (:func:`~trainmem.specs.training.check_training_for_model`) and the GPU, when named
    (:func:`~trainmem.specs.hardware.check_precision_on_gpu`).

    Args:
        model: preset name or config path.
        values: the options given, by parameter name (:func:`explicit_options`).
        gpu: the GPU, to check the precision on.
        notes: if given, receives a sentence for each file setting a flag overrode and each
            ``"auto"`` the Trainer would fill in.

    Returns:
        The validated TrainingConfig.

    Raises:
        SpecError: a bad value (the message names the field and the allowed values), or a
            flag and a ``--set`` that give one field two values.
    """
    given = {p.name: values.get(p.name, p.default) for p in TRAINING_OPTIONS}
    spec = model_spec_or_none(model)
    alpha = given["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise SpecError("lora_alpha", f"must be a finite number, got {alpha!r}")
    settings = {k: v for k, v in given.items() if k not in _NOT_FIELDS}
    explicit = {k for k in values if k in settings}
    flags = {k: _flag(k) for k in explicit}  # the flag that gave each explicit field
    for key in apply_fsdp(settings, given["fsdp"], set(explicit)):
        explicit.add(key)
        flags.setdefault(key, "--fsdp")
    if given["lora_targets"] is not None:  # None: the framework's (TrainingConfig resolves it)
        settings["lora_targets"] = parse_lora_targets(given["lora_targets"], spec, model)
    if isinstance(given["lora_modules_to_save"], str):  # comma-separated, as --lora-targets
        names = given["lora_modules_to_save"].replace("+", ",").split(",")
        settings["lora_modules_to_save"] = tuple(n.strip() for n in names if n.strip())
    from_set = _from_set(given["settings"] or [], spec, settings, flags, model)
    auto: dict[str, str] = {}
    file_notes: list[str] = []
    from_files = config_file_settings(
        given["deepspeed_config"],
        given["accelerate_config"],
        auto,
        axolotl_config=given["axolotl_config"],
        torchtune_config=given["torchtune_config"],
        training_args=given["training_args"],
        notes=file_notes,
        model=model,
        spec=spec,
    )
    if notes is not None:
        notes.extend(file_notes)
    stack = from_set.get(
        "framework",
        settings["framework"]
        if "framework" in explicit
        else from_files.get("framework", settings["framework"]),
    )
    sharded = _file_sharding(stack, from_files.get("framework"))
    for key, value in from_files.items():
        if key == "framework" and sharded is not None:
            continue  # the stack's sharding: trainer_sharding below
        if key in explicit and value != settings[key] and notes is not None:
            notes.append(
                f"{flags[key]} {_shown(settings[key])} wins over the config file's "
                f"{key}={_shown(value)}"
            )
        elif key not in explicit and key not in from_set:
            settings[key] = value
    settings.update(from_set)
    # the HF Trainer's --fsdp is accelerate's FSDP plugin (MixedPrecision policy), its ZeRO
    # DeepSpeed's, whether the stack came from --framework or from a TrainingArguments /
    # axolotl file; LLaMA-Factory's and axolotl's own defaults go with it
    stack_name = trainer_sharding(settings, given["fsdp"], sharded)
    if stack_name is not None and notes is not None and settings["framework"] == "deepspeed":
        notes.append(
            f"--framework {stack_name} with ZeRO stage {settings['zero_stage']}: the Trainer "
            "shards through DeepSpeed (TrainingArguments(deepspeed=ds_config.json)), so "
            "this is --framework deepspeed's estimate; give --fsdp for accelerate's FSDP"
        )
    seq_len_given = settings["seq_len"] is not None
    _fill_deferred(settings, model, spec)
    training = TrainingConfig(**settings)
    check_framework_versions(training)
    if spec is not None:
        check_training_for_model(spec, training)
    from trainmem.estimate import image_sequence

    # a config file's text length (SFTConfig max_length, axolotl sequence_len) on a model whose
    # sequence is not a text length the user picks (an image's patches, Whisper's decoder at
    # most max_target_positions) is dropped with a warning, not refused as --seq-len is: the
    # refusal's advice ("leave --seq-len out") named a flag the user had not given
    from_file = "seq_len" in from_files and "seq_len" not in explicit and "seq_len" not in from_set
    read = image_sequence(spec or model, training, given=seq_len_given and not from_file)
    if from_file and read.seq_len != training.seq_len and notes is not None:
        notes.append(
            f"warning: seq_len={training.seq_len} from the config file does not apply to this "
            "model (an image model's sequence is its image's; Whisper's decoder takes at most "
            "max_target_positions tokens): the model's own is used"
        )
    training = read
    if gpu is not None:
        check_precision_on_gpu(training.precision, get_gpu(gpu))
    if notes is not None:
        notes.extend(_auto_notes(auto, training, flags, from_set))
    return training


def _file_sharding(stack: Any, from_file: Any) -> str | None:
    """A config file's sharding framework (``accelerate-fsdp`` / ``fsdp2`` from an accelerate
    config, ``deepspeed`` from a DeepSpeed one) run under an HF Trainer stack
    (:data:`HF_TRAINER_STACKS`) given otherwise: LLaMA-Factory's way to shard (v0.9.5
    ``accelerate launch --config_file examples/accelerate/fsdp_config.yaml`` or ``deepspeed:
    examples/deepspeed/ds_z3_config.json`` in its YAML). None otherwise."""
    if stack in HF_TRAINER_STACKS and from_file in ("accelerate-fsdp", "fsdp2", "deepspeed"):
        return str(from_file)
    return None


def _from_set(
    items: list[str],
    spec: ModelSpec | None,
    settings: dict[str, Any],
    flags: dict[str, str],
    model_arg: str | None = None,
) -> dict[str, Any]:
    """The settings of the ``--set`` options, each checked against the flag that gave the same
    field (``flags``: the explicit ones, with their values in ``settings``).

    Raises:
        SpecError: a key of :data:`ESTIMATE_KEYS`, or a field a flag gave another value.
    """
    from_set: dict[str, Any] = {}
    for item in items:
        for key, value in parse_set(item, spec, model_arg).items():
            if key in ESTIMATE_KEYS:
                raise SpecError("set", f"{key} cannot be set here; use its own option")
            if key in flags and value != settings[key]:
                raise SpecError(
                    "set",
                    f"{key} is given twice: {flags[key]} {_shown(settings[key])} and --set "
                    f"{key.replace('_', '-')}={_shown(value)}; give one",
                )
            from_set[key] = value
    return from_set


def _fill_deferred(settings: dict[str, Any], model: str, spec: ModelSpec | None) -> None:
    """Fill in the settings given nowhere whose default is not the dataclass's
    (:attr:`~trainmem.specs.settings.Setting.defer`): the model's sequence length and attention,
    the micro-batches a pipeline needs."""
    if settings["gradient_accumulation_steps"] is None:  # given nowhere
        pp = settings.get("pipeline_parallel_size")
        pipelined = isinstance(pp, int) and not isinstance(pp, bool) and pp > 1  # else refused
        # one micro-batch per step leaves a pipeline idle and torch's Schedule1F1B refuses it
        # ("Number of microbatches must be greater than or equal to the number of stages",
        # torch/distributed/pipelining/schedules.py): the fewest it runs
        settings["gradient_accumulation_steps"] = pp if pipelined else 1
    from trainmem.estimate import default_attention_of, default_seq_len_of

    if settings["seq_len"] is None:
        settings["seq_len"] = default_seq_len_of(model)
    if settings["attention"] is None:  # not given: the model's own (BLOOM, Gemma-2: eager only;
        # Phi-3 before transformers 4.45: ModelSpec.has_sdpa)
        release = settings.get("transformers_version")
        settings["attention"] = "sdpa" if spec is None else default_attention_of(spec, release)


def _auto_notes(
    auto: dict[str, str], training: TrainingConfig, flags: dict[str, str], from_set: dict[str, Any]
) -> list[str]:
    """One sentence per ``"auto"`` in a DeepSpeed config: the value it resolved to and whence."""
    out = []
    for field, key in auto.items():
        whence = flags.get(field, "--set" if field in from_set else "trainmem's default")
        out.append(
            f'ds_config {key} "auto": {field} {getattr(training, field)} ({whence}), as the HF '
            "Trainer fills it from its own arguments (transformers integrations/deepspeed.py "
            "trainer_config_process)"
        )
    return out


_EXPLICIT_SOURCES = ("COMMANDLINE", "ENVIRONMENT")
"""click ``ParameterSource`` names of a value the user gave (typer vendors its own click, so
the enum is compared by name)."""


def explicit_options(values: dict[str, Any], ctx: typer.Context | None) -> dict[str, Any]:
    """The options of ``values`` the user gave, as click records their source
    (``Context.get_parameter_source``: the command line or an environment variable), whatever
    their value; all of them without a context (a call from Python)."""
    if ctx is None:
        return dict(values)
    out = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in _EXPLICIT_SOURCES:
            out[name] = value
    return out


_CONTEXT = _p("typer_context", typer.Context, None)
"""The click context typer hands a command that asks for one (by this annotation), for the
parameter sources."""
_INJECTED = ("training", "config_notes", "framework_chosen")


def with_training_options(*, set_option: bool = True) -> Callable[[F], F]:
    """Decorator: add :data:`TRAINING_OPTIONS` to a typer command whose function takes ``model``
    and a keyword ``training``, and call it with the TrainingConfig they describe (and, if it
    takes a keyword ``config_notes``, with the notes of :func:`training_from_options`).

    Args:
        set_option: also offer ``--set KEY=VALUE`` (off for commands that give ``--set`` a
            meaning of their own, like ``compare``).
    """
    options = [p for p in TRAINING_OPTIONS if set_option or p.name != "settings"]

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        own = [p for p in signature.parameters.values() if p.name not in _INJECTED]
        wants_notes = "config_notes" in signature.parameters
        wants_chosen = "framework_chosen" in signature.parameters
        hints = get_type_hints(func, include_extras=True)
        for name in _INJECTED:
            hints.pop(name, None)

        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = kwargs.pop(_CONTEXT.name, None)
            values = {p.name: kwargs.pop(p.name) for p in options if p.name in kwargs}
            model = kwargs["model"] if "model" in kwargs else args[0]
            notes: list[str] = []
            given = explicit_options(values, ctx)
            training = training_from_options(model, given, kwargs.get("gpu"), notes)
            if wants_notes:
                kwargs["config_notes"] = notes
            if wants_chosen:
                kwargs["framework_chosen"] = framework_chosen(given)
            return func(*args, training=training, **kwargs)

        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*params, *options, _CONTEXT]
        )
        wrapper.__annotations__ = {
            **hints,
            **{p.name: p.annotation for p in (*options, _CONTEXT)},
        }
        return wrapper  # type: ignore[return-value]

    return decorate


def framework_chosen(given: dict[str, Any]) -> bool:
    """Whether the user chose the framework: ``--framework``, ``--set framework=...``, or a
    framework's own config file (a ds_config is DeepSpeed, an accelerate config accelerate)."""
    if "framework" in given or "framework" in " ".join(given.get("settings") or ()):
        return True
    return any(name.endswith("_config") or name == "training_args" for name in given)


#: ``--set`` keys that are not TrainingConfig fields: they choose how the estimate is made.
ESTIMATE_KEYS = ("engine", "gpu", "alloc_conf", "fsdp")

# Assignments are separated by ';' or whitespace, or by a ',' that starts a new KEY=...
_SPLIT = re.compile(r"[;\s]+|,(?=\s*[A-Za-z][\w-]*\s*=)")


def parse_set(
    text: str, model: ModelSpec | None = None, model_arg: str | None = None
) -> dict[str, Any]:
    """One ``--set`` option: ``"activation-checkpointing=full micro-batch-size=4"`` ->
    ``{"activation_checkpointing": "full", "micro_batch_size": 4}``.

    Keys are TrainingConfig fields (dashes or underscores) or :data:`ESTIMATE_KEYS`; values are
    typed like the field's default (:func:`trainmem.specs.grid.parse_value`);
    ``lora-targets`` takes ``q,v`` or ``q+v`` or ``all-linear`` (``model``'s linears,
    :func:`parse_lora_targets`).

    Raises:
        SpecError: an empty set, an item without ``=``, an unknown key or a mistyped value.
    """
    from trainmem.specs.grid import field_name, parse_value

    out: dict[str, Any] = {}
    for item in (p for p in _SPLIT.split(text.strip()) if p):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError("set", f"{item!r} is not KEY=VALUE")
        name = key.strip().replace("-", "_")
        if name in ESTIMATE_KEYS:
            out[name] = value.strip()
        elif name == "lora_targets":
            out[name] = parse_lora_targets(value.replace("+", ","), model, model_arg)
        else:
            try:
                name = field_name(key)
            except SpecError:
                raise SpecError(
                    "set",
                    f"unknown key {key.strip()!r} in {text!r} (TrainingConfig fields, "
                    "engine, gpu, alloc-conf or fsdp)",
                ) from None
            out[name] = parse_value(name, value)
    if not out:
        raise SpecError("set", "empty; give KEY=VALUE, e.g. activation-checkpointing=full")
    return out
