"""The command-line options that describe a training run, shared by every command.

:func:`with_training_options` adds them to a typer command and hands the command one validated
:class:`~trainmem.specs.training.TrainingConfig` (``training=``), so ``estimate``, ``formulas``,
``plan``, ``fit``, ``sweep``, ``compare`` and ``compare-snapshot`` accept the same flags, spelled
once. Values come from, in order of precedence: an explicit flag, ``--set KEY=VALUE``, a
config file (``--deepspeed-config``, ``--accelerate-config``, ``--axolotl-config``,
``--torchtune-config``, ``--training-args``), the TrainingConfig default. Whether a flag
was given is click's parameter source (:func:`explicit_options`), never a comparison with its
default, so ``-b 1`` wins over a file's 4 although 1 is the default; a flag and a ``--set`` of
the same field with different values are refused, naming both.

This module has no ``from __future__ import annotations``: typer reads the annotations below at
registration time.
"""

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
from trainmem.estimate import ENGINES, default_attention_of, default_seq_len_of, resolve_model
from trainmem.planner.sweep import STRICT_INT, parse_strict_int
from trainmem.specs.groups import FIELD_GROUPS
from trainmem.specs.hardware import check_precision_on_gpu, get_gpu
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import (
    ACTIVATION_CHECKPOINTING,
    ATTENTIONS,
    EMA_DEVICES,
    EMA_DTYPES,
    FRAMEWORKS,
    FROZEN_ON_GPU,
    LORA_TARGETS,
    LOSSES,
    OFFLOADS,
    OPTIMIZER_IMPLEMENTATIONS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    QUANTIZE_BASE,
    TrainingConfig,
    check_training_for_model,
    fsdp_settings,
    model_lora_linears,
)

F = TypeVar("F", bound=Callable[..., Any])


def _choices(values: tuple[str, ...]) -> str:
    """Allowed values for a help text, separated so that rich can wrap them (a ``a|b|c`` run
    is one word and is cut with an ellipsis at the terminal's width)."""
    return " | ".join(values)


ModelArg = Annotated[
    str, typer.Argument(help="Preset name (see `trainmem models`), or a HF config.json / folder.")
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


def _oi(*decls: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    return typer.Option(*decls, help=escape(help), parser=strict_int, metavar="INTEGER")


def _of(*decls: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    return typer.Option(*decls, help=escape(help), parser=strict_float, metavar="FLOAT")


TRAINING_OPTIONS: tuple[inspect.Parameter, ...] = (
    _p(
        "micro_batch_size",
        Annotated[int, _oi("--micro-batch-size", "-b", help="Sequences per GPU per step.")],
        1,
    ),
    _p(
        "seq_len",
        Annotated[
            int | None,
            _oi("--seq-len", "-s", help="Tokens per sequence [default: model context, max 4096]."),
        ],
        None,
    ),
    _p(
        "target_seq_len",
        Annotated[
            int,
            _oi(
                "--target-seq-len",
                help="Decoder (target) tokens per sequence of an encoder-decoder such as T5 "
                "[default: 0, the same as --seq-len].",
            ),
        ],
        0,
    ),
    _p(
        "precision",
        Annotated[
            str, _o("--precision", "-p", help=f"Lightning precision: {_choices(PRECISIONS)}.")
        ],
        "bf16-mixed",
    ),
    _p("optimizer", Annotated[str, _o("--optimizer", "-o", help=_choices(OPTIMIZERS))], "adamw"),
    _p(
        "optimizer_implementation",
        Annotated[
            str | None,
            _o(
                "--optimizer-implementation",
                help=_choices(OPTIMIZER_IMPLEMENTATIONS)
                + " [default: the framework's for --torch-version]",
            ),
        ],
        None,
    ),
    _p(
        "torch_version",
        Annotated[
            str | None,
            _o("--torch-version", help="torch release where a default depends on it [>= 2.8]."),
        ],
        None,
    ),
    _p(
        "transformers_version",
        Annotated[
            str | None,
            _o(
                "--transformers-version",
                help="transformers release whose model code runs (before 4.49: GPT-2-era "
                "losses on 16-bit logits, a shifted copy of the logits) [default: installed].",
            ),
        ],
        None,
    ),
    _p(
        "bitsandbytes_version",
        Annotated[
            str | None,
            _o(
                "--bitsandbytes-version",
                help="bitsandbytes release (4-bit matmuls save their input before 0.43.2).",
            ),
        ],
        None,
    ),
    _p(
        "deepspeed_version",
        Annotated[
            str | None,
            _o(
                "--deepspeed-version",
                help="DeepSpeed release (bf16 accumulates in fp32 without ZeRO before 0.17.6).",
            ),
        ],
        None,
    ),
    _p(
        "activation_checkpointing",
        Annotated[
            str, _o("--activation-checkpointing", "-c", help=_choices(ACTIVATION_CHECKPOINTING))
        ],
        "none",
    ),
    _p(
        "attention",
        Annotated[
            str | None,
            _o(
                "--attention",
                help=_choices(ATTENTIONS)
                + " [sdpa; eager for families transformers runs eager only]",
            ),
        ],
        None,
    ),
    _p(
        "gradient_accumulation_steps",
        Annotated[
            int | None,
            _oi(
                "--gradient-accumulation-steps",
                help="Micro-batches per optimizer step [1; with pipeline parallelism the "
                "pipeline-parallel size, the fewest torch's Schedule1F1B runs].",
            ),
        ],
        None,
    ),
    _p(
        "dropout",
        Annotated[bool, _o("--dropout/--no-dropout", help="Apply the model's dropout.")],
        True,
    ),
    _p(
        "data_parallel_size",
        Annotated[
            int, _oi("--data-parallel-size", help="Ranks the model states are sharded over.")
        ],
        1,
    ),
    _p("zero_stage", Annotated[int, _oi("--zero-stage", help="ZeRO stage 0|1|2|3.")], 0),
    _p(
        "fsdp",
        Annotated[
            str | None,
            _o(
                "--fsdp",
                help="full-shard | shard-grad-op | hybrid-shard | no-shard (sets the ZeRO stage it "
                "shards like; with --framework hf-trainer it is accelerate-fsdp, the Trainer's "
                "FSDP)",
            ),
        ],
        None,
    ),
    _p(
        "shard_group_size",
        Annotated[
            int | None,
            _o(
                "--shard-group-size",
                help="Ranks a shard spans (HYBRID_SHARD: one node) [default: all data-parallel].",
            ),
        ],
        None,
    ),
    _p("offload", Annotated[str, _o("--offload", help=_choices(OFFLOADS))], "none"),
    _p(
        "lora_rank",
        Annotated[int, _oi("--lora-rank", help="LoRA rank r (0: full fine-tuning).")],
        0,
    ),
    _p(
        "lora_alpha",
        Annotated[float, _of("--lora-alpha", help="LoRA scaling (no effect on memory).")],
        16.0,
    ),
    _p(
        "lora_targets",
        Annotated[
            str, _o("--lora-targets", help=",".join(LORA_TARGETS) + ",lm_head or all-linear")
        ],
        "q,v",
    ),
    _p("lora_dropout", Annotated[float, _of("--lora-dropout", help="peft lora_dropout.")], 0.0),
    _p(
        "quantize_base",
        Annotated[str, _o("--quantize-base", help=_choices(QUANTIZE_BASE) + " (QLoRA and kin)")],
        "none",
    ),
    _p(
        "tensor_parallel_size",
        Annotated[
            int,
            _oi(
                "--tensor-parallel-size",
                help="Tensor parallelism t (torch DTensor; Megatron's with --framework megatron).",
            ),
        ],
        1,
    ),
    _p(
        "sequence_parallel",
        Annotated[bool, _o("--sequence-parallel", help="Sequence parallelism (needs t > 1).")],
        False,
    ),
    _p(
        "pipeline_parallel_size",
        Annotated[int, _oi("--pipeline-parallel-size", help="Pipeline stages p.")],
        1,
    ),
    _p(
        "pipeline_schedule",
        Annotated[str, _o("--pipeline-schedule", help=_choices(PIPELINE_SCHEDULES))],
        "1f1b",
    ),
    _p(
        "context_parallel_size",
        Annotated[int, _oi("--context-parallel-size", help="Sequence split over this many ranks.")],
        1,
    ),
    _p(
        "framework",
        Annotated[
            str, _o("--framework", help=_choices(FRAMEWORKS) + " (bytes per parameter, loss)")
        ],
        "pytorch-amp",
    ),
    _p(
        "chunked_cross_entropy",
        Annotated[
            int, _oi("--chunked-cross-entropy", help="Loss in N chunks of tokens (0: whole).")
        ],
        0,
    ),
    _p(
        "optimizer_in_backward",
        Annotated[
            bool, _o("--optimizer-in-backward", help="Step and free each gradient in backward.")
        ],
        False,
    ),
    _p(
        "activation_offloading",
        Annotated[bool, _o("--activation-offloading", help="Saved activations offloaded to CPU.")],
        False,
    ),
    _p(
        "zero_grad_set_to_none",
        Annotated[
            bool,
            _o(
                "--zero-grad-set-to-none/--zero-grad-keep",
                help="zero_grad(set_to_none=...); keep = torch < 2.0 behaviour, or a loop "
                "that never zeroes its gradients.",
            ),
        ],
        True,
    ),
    _p(
        "zero_grad_before_backward",
        Annotated[
            bool,
            _o(
                "--zero-grad-before-backward",
                help="zero_grad() between the loss and backward(): last step's gradients "
                "live through the forward.",
            ),
        ],
        False,
    ),
    _p(
        "loss",
        Annotated[
            str | None,
            _o(
                "--loss",
                help=_choices(LOSSES) + " [default: the model's own; cs336_basics: the "
                "course's cs336-cross-entropy]",
            ),
        ],
        None,
    ),
    _p(
        "keep_logits",
        Annotated[
            bool,
            _o(
                "--keep-logits",
                help="The loop holds `logits = model(x)` until the step ends (through "
                "backward and the optimizer step).",
            ),
        ],
        False,
    ),
    _p(
        "compile",
        Annotated[bool, _o("--compile", help="torch.compile: fused pointwise chains (see docs).")],
        False,
    ),
    _p(
        "resolution",
        Annotated[
            str | None,
            _o(
                "--resolution",
                help="diffusers models: image side in pixels, or HEIGHTxWIDTH (480x832) "
                "[default: the model's, e.g. 1024].",
            ),
        ],
        None,
    ),
    _p(
        "frames",
        Annotated[
            int | None,
            _oi("--frames", help="diffusers video models: frames per clip [default: the model's]."),
        ],
        None,
    ),
    _p(
        "text_seq_len",
        Annotated[
            int | None,
            _oi(
                "--text-seq-len",
                help="diffusers models: prompt tokens [default: FLUX 512, SD3 333, SDXL 77].",
            ),
        ],
        None,
    ),
    _p(
        "ema",
        Annotated[
            bool,
            _o(
                "--ema",
                help="An EMA copy of the trainable weights (diffusers EMAModel), stepped after "
                "the optimizer.",
            ),
        ],
        False,
    ),
    _p(
        "ema_dtype",
        Annotated[
            str | None,
            _o(
                "--ema-dtype",
                help=_choices(EMA_DTYPES) + " [default: the trainable parameters' dtype]",
            ),
        ],
        None,
    ),
    _p(
        "ema_device",
        Annotated[
            str,
            _o(
                "--ema-device",
                help=_choices(EMA_DEVICES) + " (cpu: diffusers' --offload_ema, on the GPU "
                "only for its step)",
            ),
        ],
        "cuda",
    ),
    _p(
        "frozen_on_gpu",
        Annotated[
            str,
            _o(
                "--frozen-on-gpu",
                help=_choices(FROZEN_ON_GPU) + " diffusers models: the pipeline's VAE / text "
                "encoders kept on the GPU [none: latents and embeddings precomputed]",
            ),
        ],
        "none",
    ),
    _p(
        "nccl_buffer_bytes",
        Annotated[
            int | None,
            _oi(
                "--nccl-buffer-bytes",
                help="Device memory of one NCCL communicator, measured on your cluster "
                "[default: 688 MiB on A100, 1.06 GB on H100 (NCCL issues #964, #1685)].",
            ),
        ],
        None,
    ),
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

"""Every option that describes the run; names are TrainingConfig fields except ``fsdp`` (a ZeRO
stage by another name), ``lora_alpha`` (no memory effect), the config files and ``settings``
(``--set``)."""

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


def _set_panels(params: tuple[inspect.Parameter, ...]) -> None:
    for param in params:
        for meta in get_args(param.annotation)[1:]:
            if isinstance(meta, OptionInfo):
                meta.rich_help_panel = PANELS.get(param.name, OUTPUT_PANEL)


_set_panels(TRAINING_OPTIONS)


def parse_lora_targets(text: str, model: ModelSpec | None = None) -> tuple[str, ...]:
    """``"q,v"`` -> ("q", "v"); ``all-linear`` -> every layer linear of ``model`` (peft's
    ``all-linear``, :func:`~trainmem.specs.training.model_lora_linears`), or every name of
    :data:`~trainmem.specs.training.LORA_TARGETS` without a model."""
    if text.strip() == "all-linear":
        return LORA_TARGETS if model is None else model_lora_linears(model)
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
        linears = None if spec is None else model_lora_linears(spec)
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
    for key, value in fsdp_settings(given["zero_stage"], given["fsdp"]).items():
        if key == "zero_stage" or settings.get(key) is None:
            settings[key] = value
        if given["fsdp"] is not None:
            explicit.add(key)
            flags.setdefault(key, "--fsdp")
    settings["lora_targets"] = parse_lora_targets(given["lora_targets"], spec)
    from_set: dict[str, Any] = {}
    for item in given["settings"] or []:
        for key, value in parse_set(item, spec).items():
            if key in ESTIMATE_KEYS:
                raise SpecError("set", f"{key} cannot be set here; use its own option")
            if key in explicit and value != settings[key]:
                raise SpecError(
                    "set",
                    f"{key} is given twice: {flags[key]} {_shown(settings[key])} and --set "
                    f"{key.replace('_', '-')}={_shown(value)}; give one",
                )
            from_set[key] = value
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
    for key, value in from_files.items():
        if key in explicit and value != settings[key] and notes is not None:
            notes.append(
                f"{flags[key]} {_shown(settings[key])} wins over the config file's "
                f"{key}={_shown(value)}"
            )
        elif key not in explicit and key not in from_set:
            settings[key] = value
    settings.update(from_set)
    if given["fsdp"] is not None and settings["framework"] == "hf-trainer":
        # the HF Trainer's --fsdp is accelerate's FSDP plugin (MixedPrecision policy), whether
        # hf-trainer came from --framework or from a TrainingArguments / axolotl file
        settings["framework"] = "accelerate-fsdp"
    if settings["gradient_accumulation_steps"] is None:  # given nowhere
        pp = settings.get("pipeline_parallel_size")
        pipelined = isinstance(pp, int) and not isinstance(pp, bool) and pp > 1  # else refused
        # one micro-batch per step leaves a pipeline idle and torch's Schedule1F1B refuses it
        # ("Number of microbatches must be greater than or equal to the number of stages",
        # torch/distributed/pipelining/schedules.py): the fewest it runs
        settings["gradient_accumulation_steps"] = pp if pipelined else 1
    if settings["seq_len"] is None:
        settings["seq_len"] = default_seq_len_of(model)
    if settings["attention"] is None:  # not given: the model's own (BLOOM, Gemma-2: eager only)
        settings["attention"] = "sdpa" if spec is None else default_attention_of(spec)
    training = TrainingConfig(**settings)
    if spec is not None:
        check_training_for_model(spec, training)
    if gpu is not None:
        check_precision_on_gpu(training.precision, get_gpu(gpu))
    if notes is not None:
        notes.extend(_auto_notes(auto, training, flags, from_set))
    return training


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


def parse_set(text: str, model: ModelSpec | None = None) -> dict[str, Any]:
    """One ``--set`` option: ``"activation-checkpointing=full micro-batch-size=4"`` ->
    ``{"activation_checkpointing": "full", "micro_batch_size": 4}``.

    Keys are TrainingConfig fields (dashes or underscores) or :data:`ESTIMATE_KEYS`; values are
    typed like the field's default (:func:`trainmem.planner.sweep.parse_value`);
    ``lora-targets`` takes ``q,v`` or ``q+v`` or ``all-linear`` (``model``'s linears,
    :func:`parse_lora_targets`).

    Raises:
        SpecError: an empty set, an item without ``=``, an unknown key or a mistyped value.
    """
    from trainmem.planner.sweep import field_name, parse_value

    out: dict[str, Any] = {}
    for item in (p for p in _SPLIT.split(text.strip()) if p):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError("set", f"{item!r} is not KEY=VALUE")
        name = key.strip().replace("-", "_")
        if name in ESTIMATE_KEYS:
            out[name] = value.strip()
        elif name == "lora_targets":
            out[name] = parse_lora_targets(value.replace("+", ","), model)
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
