"""One entry point for every engine: resolve the model and settings, run an engine, return a
:class:`~trainmem.breakdown.MemoryEstimate`. The CLI, the planner and Python users call this.

Engines (Note [Which path runs]): ``auto`` (the default), ``analytic``, ``generic``, ``trace``.
The analytic path imports no torch; ``generic`` and ``trace`` import it lazily.

Note [Which path runs]
    ``auto`` runs the analytic formulas when they model the family and the settings (no
    :class:`~trainmem.errors.UnsupportedError` from the spec, the settings check or the
    engine), else the generic path (``trainmem.trace.generic``: the model built by transformers
    or diffusers, a few blocks traced and repeated to full depth) when torch and transformers
    import, else one line saying what to install. An explicit engine always wins. The
    estimate's ``engine`` field says which path ran. When both refuse, the refusal gives both
    reasons, the formulas' first; for a diffusers or timm model, which no formula family is,
    the generic path's reason alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trainmem.analytic.activation_shapes import tokens_per_sequence
from trainmem.analytic.buffers import device_context
from trainmem.analytic.engine import estimate_analytic
from trainmem.analytic.loss import unsloth_fused_loss
from trainmem.analytic.varying_lengths import after_steps, earlier_lengths
from trainmem.breakdown import MemoryEstimate, fold_category
from trainmem.errors import NotApplicableError, SpecError, TrainmemError, UnsupportedError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.assumptions import assumptions
from trainmem.specs.diffusers import check_image_options, is_diffusers_config
from trainmem.specs.engines import ENGINES as ENGINES  # re-exported for the callers
from trainmem.specs.frameworks import (
    parse_version,
    transformers_release_of,
)
from trainmem.specs.hardware import GPUSpec, check_precision_on_gpu
from trainmem.specs.hardware import resolve_gpu as resolve_gpu  # re-exported for the callers
from trainmem.specs.hf import checkpoint_dtype, is_timm_config, load_hf_config, load_model_spec
from trainmem.specs.load_dtype import (
    LOADS_FROM_PRETRAINED,
    diffusers_lora_load_dtype,
    resolve_load_dtype,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.quantization import float_quant_storage
from trainmem.specs.ranks import fsdp1_framework, fsdp1_no_shard, model_rank_map
from trainmem.specs.training import (
    LORA_TARGETS,
    TrainingConfig,
    adafactor_on_dtensors_untraced,
    check_training_for_model,
    derived,
    model_lora_linears,
    resolved_config,
)
from trainmem.traced_megatron import traced_megatron, untraced_megatron
from trainmem.traced_options import (
    TracedOption,
    active_options,
    paged_states,
    traced_settings,
    untraced_data_parallel,
    untraced_framework,
    untraced_fsdp1_quantized,
    untraced_offload,
)
from trainmem.traced_quantized import quantized_base_refusals
from trainmem.traced_releases import (
    litgpt_release_refusals,
    release_not_applied,
    release_refusals,
)
from trainmem.traced_transforms import (
    apply_deepspeed,
    apply_optimizer,
    deepspeed_refusals,
    older_torch_step,
    optimizer_standin,
    untraced_deepspeed,
)
from trainmem.traced_unsloth import check_unsloth_run, traced_unsloth
from trainmem.uncertainty import verdict_of
from trainmem.units import TiB

if TYPE_CHECKING:
    from collections.abc import Iterable

    from trainmem.allocator.replay import ReplayResult
    from trainmem.timeline import AllocEvent, EventFields, Timeline

TRACE_INSTALL = "pip install 'trainmem[trace]'"
"""What installs the generic path and the trace engine (torch + transformers)."""

DEFAULT_SEQ_LEN_CAP = 4096
"""Default sequence length is the model's own context length, capped here (a Llama-3.1 user
planning a run rarely means 131,072 tokens per sequence unless they say so)."""


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a ``config.json`` path or folder, or a spec itself.

    Raises:
        SpecError / UnsupportedError: see :func:`trainmem.specs.hf.load_model_spec`.
    """
    return model if isinstance(model, ModelSpec) else load_model_spec(model)


def lora_linears_of(model: str | ModelSpec) -> tuple[str, ...]:
    """``--lora-targets all-linear`` for ``model``: its layer linears by their
    :data:`~trainmem.specs.training.LORA_TARGETS` names (peft's ``all-linear``). From the
    ModelSpec where the formulas cover the family
    (:func:`~trainmem.specs.training.model_lora_linears`); else from the transformers model
    built on ``meta`` (:func:`trainmem.trace.lora.lora_linear_names`: Whisper has no
    ``gate``); every name where neither can be had here (no torch, a diffusers or timm
    config: the estimate then gives its own refusal)."""
    try:
        return model_lora_linears(resolve_model(model))
    except UnsupportedError:
        pass
    if isinstance(model, ModelSpec):  # pragma: no cover - resolve_model returned it
        return model_lora_linears(model)
    try:
        from trainmem.specs.hf import load_hf_config
        from trainmem.trace.hf_model import build_hf_model
        from trainmem.trace.lora import lora_linear_names

        raw = load_hf_config(model)
        if "model_type" not in raw:  # a diffusers or timm config
            return LORA_TARGETS
        return lora_linear_names(build_hf_model(raw)) or LORA_TARGETS
    except (TrainmemError, ImportError):
        return LORA_TARGETS


def formula_model(
    model: str | ModelSpec,
    command: str,
    does: str = "sweeps settings with the analytic formulas only (one estimate each)",
) -> ModelSpec:
    """:func:`resolve_model` for the commands that run the formulas only (``plan``, ``fit``,
    ``sweep``, which sweep settings; ``formulas``, the rules of thumb of the formula
    families): a family without formulas is refused with one line saying so and naming the
    command that runs it (not the engine's own hint, ``--engine generic``, an option these
    commands do not take), rather than traced once per setting.

    Args:
        model: preset name, config path or spec.
        command: the command's name, for the message.
        does: what the command does that needs the formulas, for the message.

    Raises:
        UnsupportedError: a family or option the formulas do not model.
    """
    try:
        return resolve_model(model)
    except UnsupportedError as exc:
        reason = str(exc).split("; ")[0]
        raise UnsupportedError(
            f"{reason}; `trainmem {command}` {does}; `trainmem estimate` runs the generic "
            "path for this model"
        ) from exc


def default_seq_len(model: ModelSpec) -> int:
    """The model's context length (``max_position_embeddings``) capped at
    :data:`DEFAULT_SEQ_LEN_CAP`; for ViT the value is unused (patches + 1)."""
    return min(model.max_position_embeddings, DEFAULT_SEQ_LEN_CAP)


def default_seq_len_of(model: str | ModelSpec) -> int:
    """:func:`default_seq_len` of a preset, config or spec; for a family the analytic engine does
    not model (the trace engine still runs it), the config's own context length
    (``max_position_embeddings`` / ``n_positions``), capped the same way, else 1024."""
    try:
        return default_seq_len(resolve_model(model))
    except UnsupportedError:
        from trainmem.specs.hf import load_hf_config

        config = load_hf_config(str(model))
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            value = config.get(key)
            if isinstance(value, int) and value > 0:
                return min(value, DEFAULT_SEQ_LEN_CAP)
        return 1024


def vision_sequence(spec: ModelSpec, training: TrainingConfig, *, given: bool) -> TrainingConfig:
    """``training`` with a vision encoder's ``seq_len`` set to the tokens its layers see, the
    patches of ``--resolution`` (or of the config's ``image_size``) plus [CLS]
    (:func:`~trainmem.analytic.activation_shapes.tokens_per_sequence`), so the printed and JSON
    configuration says what was computed; any other model unchanged.

    Raises:
        SpecError: ``seq_len`` given (``given``) for a vision encoder and not that count: the
            image size sets it (``--resolution``).
    """
    if spec.architecture != "vision-encoder":
        return training
    tokens = tokens_per_sequence(spec, training)
    if given and training.seq_len != tokens:
        height, width = training.image_size or (spec.image_size, spec.image_size)
        raise SpecError(
            "seq_len",
            f"{training.seq_len} for {spec.name}, a vision encoder: its sequence is its "
            f"image's {spec.patch_size}-pixel patches (+1 [CLS] where it has one), {tokens} at "
            f"{height}x{width} px; leave --seq-len out and set the image size with "
            "--resolution (e.g. --resolution 384 or 384x512)",
        )
    return derived(training, seq_len=tokens)


SEQ_LEN_DEFAULT: int = TrainingConfig().seq_len
"""TrainingConfig's own ``seq_len`` (1024, GPT-2's context): a library call that leaves it is
not a length chosen for an image (:func:`estimate` reads it so, as the CLI reads a missing
``--seq-len``)."""


def image_sequence(
    model: str | ModelSpec, training: TrainingConfig, *, given: bool
) -> TrainingConfig:
    """The sequence of a model whose input is an image, read one way by the CLI, the web page
    and :func:`estimate`: a vision encoder's tokens (:func:`vision_sequence`); a pixel model
    the formulas do not cover (SegFormer, ConvNeXt... on the generic path,
    :func:`~trainmem.specs.diffusers.takes_pixels`) takes no sequence at all, so a given
    ``seq_len`` is refused (it was accepted and ignored) and a default one set to
    :data:`SEQ_LEN_DEFAULT` (reported as none: :func:`report_pixels`); any other model
    unchanged.

    Args:
        model: preset name, config path or spec.
        training: the settings.
        given: whether the user chose ``seq_len`` (``--seq-len``, the page's box, a library
            value other than :data:`SEQ_LEN_DEFAULT`).

    Raises:
        SpecError: ``seq_len`` given for an image model and not what it takes (names
            ``--resolution``).
    """
    spec = model if isinstance(model, ModelSpec) else _loaded_spec(model)
    if spec is not None:
        return vision_sequence(spec, training, given=given)
    if pixel_config(model) is None:
        return speech_decoder_sequence(model, training, given=given)
    if given:
        raise SpecError(
            "seq_len",
            f"{training.seq_len} for {str(model):.80}, a model whose input is an image, not a "
            "token sequence; leave --seq-len out and set the image size with --resolution "
            "(e.g. --resolution 512 or 512x640)",
        )
    # unread by the model; TrainingConfig's own, so a later call reads it as not given
    return derived(training, seq_len=SEQ_LEN_DEFAULT)


def speech_decoder_sequence(
    model: str | ModelSpec, training: TrainingConfig, *, given: bool
) -> TrainingConfig:
    """A Whisper-like model's ``seq_len``, its decoder's tokens (the audio is the 30 s log-mel
    window, :func:`trainmem.trace.hf_model.hf_batch`): at most the config's
    ``max_target_positions``, which transformers 5.24 enforces
    (``modeling_whisper.py`` ``WhisperForConditionalGeneration.forward``: "Labels' sequence
    length ... cannot exceed the maximum allowed length of ... tokens", a ValueError). A longer
    one given is refused, as the run would be; a default one becomes that maximum, so the
    report says the length the trace ran (it said 1024 and traced 448). Any other model
    unchanged.

    Raises:
        SpecError: ``seq_len`` given above ``max_target_positions``.
    """
    if isinstance(model, ModelSpec):
        return training
    try:
        config = load_hf_config(model)
    except SpecError:
        return training
    most = config.get("max_target_positions")
    whisper_like = "num_mel_bins" in config and "max_source_positions" in config
    if not whisper_like or not isinstance(most, int) or training.seq_len <= most:
        return training
    if given:
        raise SpecError(
            "seq_len",
            f"{training.seq_len} for {str(model):.80}: its decoder takes at most {most} tokens "
            f"(max_target_positions; transformers' WhisperForConditionalGeneration refuses "
            f"longer labels), and the audio is its fixed 30 s window; give --seq-len {most} "
            "or less",
        )
    return derived(training, seq_len=most)


def pixel_config(model: str | ModelSpec) -> dict[str, object] | None:
    """The ``config.json`` of a transformers model whose input is an image and that the
    formulas do not model (:func:`~trainmem.specs.diffusers.takes_pixels`: SegFormer, ConvNeXt;
    not ViT, an analytic vision encoder), or of a timm model (``timm:resnet50``, an image
    classifier: :func:`~trainmem.specs.hf.is_timm_config`), or None."""
    if isinstance(model, ModelSpec) or _loaded_spec(model) is not None:
        return None
    from trainmem.specs.diffusers import takes_pixels
    from trainmem.specs.hf import is_timm_config, load_hf_config

    try:
        config = load_hf_config(model)
    except SpecError:
        return None
    return config if takes_pixels(config) or is_timm_config(config) else None


def report_pixels(est: MemoryEstimate, config: dict[str, object], training: TrainingConfig) -> None:
    """Report what a generic-path pixel model (:func:`pixel_config`) takes: its images'
    ``resolution`` in pixels (given, else its config's, as the trace fed it:
    :func:`trainmem.trace.hf_model.pixel_input_size`; a timm model's:
    :func:`trainmem.trace.timm_model.timm_image_size`), and no ``seq_len``, which it does not
    read."""
    from trainmem.specs.hf import is_timm_config

    if is_timm_config(config):
        from trainmem.trace.timm_model import timm_image_size

        height, width = timm_image_size(config, training)
    else:
        from trainmem.trace.hf_model import pixel_input_size

        height, width = pixel_input_size(config, training.image_size)
    est.config["seq_len"] = None
    est.config["resolution"] = height if height == width else f"{height}x{width}"


def default_attention_of(model: str | ModelSpec, transformers_version: str | None = None) -> str:
    """The attention a run of ``model`` uses when none is given: ``eager`` for the families
    transformers runs eager only (``ModelSpec.eager_only``, its family row's trait: BLOOM,
    Gemma-2, whose ``_supports_sdpa`` is False) or runs eager in the requested release
    (``transformers_version``: Phi-3 before 4.45, ``ModelSpec.has_sdpa``), ``sdpa`` otherwise
    (transformers' ``PreTrainedModel._check_and_adjust_attn_implementation`` default when
    torch has SDPA); ``sdpa`` for a family only the traced paths run.

    Raises:
        SpecError: ``transformers_version`` is not a version string.
    """
    release = transformers_release_of(transformers_version)
    try:
        spec = resolve_model(model)
    except UnsupportedError:
        return "sdpa"
    return "sdpa" if spec.has_sdpa(release) else "eager"


def route_diffusers(model: str | ModelSpec, training: TrainingConfig) -> bool:
    """True when ``model`` is a diffusers config (``_class_name``, no ``model_type``): only the
    trace engine builds it (``trainmem.trace.diffusers_model``). Checks ``resolution`` /
    ``frames`` / ``text_seq_len`` against it either way (refused for a language model).

    Raises:
        SpecError: a diffusers option on a language model, or a value the model cannot take.
    """
    config: dict[str, object] = {}
    if isinstance(model, str):
        from trainmem.specs.hf import load_hf_config  # the module's, as every reader here

        try:
            config = load_hf_config(model)
        except SpecError:
            config = {}  # the engine's own loading reports it
    vision = isinstance(model, ModelSpec) and model.architecture == "vision-encoder"
    # a timm model takes images (timm_model.make_timm_batch), at --resolution if given
    pixels = vision or is_timm_config(config)
    check_image_options(config, training, pixels=True if pixels else None)
    return is_diffusers_config(config)


def traced_deepspeed(training: TrainingConfig) -> bool:
    """A DeepSpeed run the traced paths model: the plain loop traced, then DeepSpeed's ZeRO-1/2/3
    (and its CPU offload) applied to it as the analytic engine's transforms
    (:mod:`trainmem.traced_transforms`),
    without pipeline, tensor or context parallelism (DeepSpeed's ``PipelineModule`` and
    Megatron-style layouts are not traced). LoRA's adapters are traced in the model's 16-bit
    dtype, as DeepSpeed casts them (``trainmem.trace.lora.cast_adapters``)."""
    return (
        training.framework == "deepspeed"
        and not deepspeed_refusals(training)
        and training.pipeline_parallel_size == 1
        and training.tensor_parallel_size == 1
        and training.context_parallel_size == 1
    )


def trace_unsupported_settings(training: TrainingConfig, engine: str = "trace") -> list[str]:
    """Settings the trace engine would silently ignore, as ``field=value`` (empty if none).

    Traced: LoRA through peft (``lora_*``), ``chunked_cross_entropy``,
    ``zero_grad_set_to_none``, and FSDP2 (``zero_stage=3`` with ``data_parallel_size > 1``,
    framework ``pytorch-amp`` or ``fsdp2``; ``trainmem.trace.fsdp``; ``reshard_after_forward``
    and HSDP's ``shard_group_size`` dividing ``data_parallel_size``, beside CP a multiple of
    ``context_parallel_size`` dividing the data x context ranks), DTensor
    tensor / sequence parallelism (``trainmem.trace.tensor_parallel``), ``compile``
    (``trainmem.trace.compile``),
    ``fp8-mixed`` (torchao, ``trainmem.trace.float8``), context parallelism (ring attention,
    ``trainmem.trace.parallel``), pipeline parallelism (``torch.distributed.pipelining``,
    ``trainmem.trace.pipeline``; its own refusals there), DeepSpeed ZeRO-1/2/3 (the plain loop
    traced, then re-sized and spliced by :func:`trainmem.traced_transforms.apply_deepspeed`;
    :func:`traced_deepspeed`), the optimizers whose kernels do not run on fake tensors (a
    stand-in traced, :func:`trainmem.traced_transforms.apply_optimizer`; paged ones with their
    large states outside the allocator), quantized bases (a stand-in per quantized linear,
    ``trainmem.trace.quantized``, peft's fp32 upcast included; what it does not model:
    :func:`trainmem.traced_quantized.quantized_base_refusals`), the loop settings
    ``keep_logits`` (loop ``step``) and ``zero_grad_before_backward``, the course's AdamW
    (``optimizer_implementation="cs336"``) and ``loss`` (the CS336 course model on the trace
    engine, ``trainmem.trace.course_model``; any transformers language model on the
    ``generic`` path, ``trainmem.trace.generic``). Plain DDP, CPU offload outside DeepSpeed,
    optimizer-in-backward, activation offloading and the ``previous`` loop (not beside
    pipelining) are the traced step of the run without
    them, rewritten by the analytic engine's rules (:mod:`trainmem.traced_options`; checked
    here on the settings :func:`~trainmem.traced_options.traced_settings` leaves); Megatron on
    one GPU or over data-parallel ranks at ZeRO 0 / 1 likewise (its loss traced, its buffer
    and optimizer as rules: :mod:`trainmem.traced_megatron`; anything else of it is one
    refusal, :func:`~trainmem.traced_megatron.untraced_megatron`). Other
    data-parallel layouts and the other frameworks are refused. The HF Trainer on one GPU (on
    more under DDP) runs as its plain loop with its default optimizer
    (:func:`_traced_hf_trainer`); Unsloth as its traced state and optimizer step with the
    formulas' micro-batches (:mod:`trainmem.traced_unsloth`, a model with a ModelSpec);
    DeepSpeed ZeRO-1/2/3 as the analytic engine's transforms
    (``trainmem.traced_transforms``); ``earlier_seq_lens`` as one more traced step per listed
    length (:func:`_estimate_traced`).
    """
    megatron = traced_megatron(training)  # Megatron's memory as rules (traced_megatron)
    if training.framework == "megatron" and not megatron:
        return [untraced_megatron(training)]
    training = traced_settings(training)  # the options applied to a traced step as rules
    defaults = TrainingConfig()
    checked = (
        "offload",
        "optimizer_in_backward",
        "activation_offloading",
        "fsdp_embedding_head_units",  # the trace wraps the layers alone (trace/fsdp.py)
    )
    out = [
        f"{name}={getattr(training, name)}"
        for name in checked
        if getattr(training, name) != getattr(defaults, name)
    ]
    if traced_deepspeed(training):  # DeepSpeed's offload: a transform of the traced step
        out = [x for x in out if not x.startswith("offload=")]
    out = [untraced_offload(training) if x.startswith("offload=") else x for x in out]
    out += quantized_base_refusals(training)  # the rest runs as a stand-in (trace/quantized.py)
    # FSDP2 over the data ranks, or over the context-parallel ranks alone (trace/parallel.py
    # parallelize; Note [Context parallelism needs FSDP over its ranks], specs/training.py)
    sharded = training.data_parallel_size > 1 or training.sharding_degree > 1
    fsdp = training.zero_stage == 3 and sharded
    fsdp1 = fsdp1_no_shard(training)  # FSDP1 NO_SHARD, run for real (trace.fsdp)
    group = training.shard_group_size
    deepspeed = traced_deepspeed(training)
    if deepspeed:  # DeepSpeed ZeRO-1/2/3 as transforms of the traced step (traced_transforms)
        out += [f"{name}={getattr(training, name)}"
                for name in ("reshard_after_forward", "shard_group_size")
                if getattr(training, name) != getattr(defaults, name)]  # fmt: skip
    elif not fsdp and not fsdp1:  # other data-parallel layouts; FSDP's settings need FSDP
        out += [
            untraced_data_parallel(training) if name == "data_parallel_size" else
            f"{name}={getattr(training, name)}"
            for name in (
                "data_parallel_size", "zero_stage", "reshard_after_forward", "shard_group_size"
            )
            if getattr(training, name) != getattr(defaults, name)
        ]  # fmt: skip
    elif group is not None and group < training.data_parallel_size * _fsdp_cp(training):
        # HSDP is traced on a (dp_replicate, dp_shard, cp) mesh (trainmem.trace.parallel), its
        # shard group spanning dp_shard x cp ranks (torchtitan's "dp_shard_cp")
        cp = _fsdp_cp(training)
        if training.data_parallel_size % group and cp == 1:
            out.append(f"shard_group_size={group} not dividing data_parallel_size")
        elif cp > 1 and (training.data_parallel_size * cp % group or group % cp):
            out.append(
                f"shard_group_size={group} with context_parallel_size={cp} (a shard group "
                "spans whole context-parallel groups, dp_shard x cp ranks: a multiple of "
                "context_parallel_size dividing data_parallel_size x context_parallel_size)"
            )
    if (
        not deepspeed
        and not megatron
        and not _traced_hf_trainer(training)
        and not _traced_torchtune(training)
        and not _traced_litgpt(training)
        and not traced_unsloth(training)  # as the formulas' rules (trainmem.traced_unsloth)
        and (
            training.framework not in ("pytorch-amp", "fsdp2", "accelerate-fsdp", "fsdp-qlora")
            or (training.framework == "fsdp2" and not fsdp)
            or (fsdp1_framework(training) and not fsdp and not fsdp1)
        )
    ):
        deepspeed_framework = training.framework == "deepspeed"
        out.append(untraced_deepspeed(training) if deepspeed_framework else
                   untraced_framework(training))  # fmt: skip
    out += _fsdp1_refusals(training)
    out += _lora_tensor_parallel_refusals(training, fsdp)
    # another transformers release: the installed code traced and the release's differences
    # applied (trainmem.traced_releases); what they do not model is refused in _traced_step,
    # which knows the model
    if adafactor_on_dtensors_untraced(training):  # an older torch_version
        out.append(
            f"optimizer=adafactor on DTensor-sharded parameters with torch_version="
            f"{training.torch_version} (the installed torch refuses its in-place steps there: "
            "Note [Adafactor on DTensor-sharded matrices])"
        )
    if training.training_loop == "previous" and training.pipeline_parallel_size > 1:
        out.append("loop=previous with pipeline parallelism")
    # the generic path computes --loss on the logits (trainmem.trace.generic); the trace
    # engine only for the course model (trainmem.trace.engine)
    return out


def _lora_tensor_parallel_refusals(training: TrainingConfig, fsdp: bool) -> list[str]:
    """What of LoRA under tensor parallelism the traced paths refuse: the trace shards peft's
    adapters as peft does under transformers' TP plan (Note [LoRA under tensor parallelism] in
    trainmem/trace/tensor_parallel.py), which has no sequence parallelism; beside SP (+4.6 %
    on the agreement model), FSDP2 (+4.4 %) or a quantized base (its stand-in is no
    shardable weight) the trace is not reconciled with the formulas, and other variants'
    adapters are not planned."""
    t = training
    if not (t.is_lora and t.tensor_parallel_size > 1):
        return []
    beside = [
        what
        for what, on in (
            ("sequence_parallel", t.sequence_parallel),
            ("zero_stage=3 over data-parallel ranks (FSDP2)", fsdp),
            (f"quantize_base={t.quantize_base}", t.quantize_base != "none"),
            (f"lora_variant={t.lora_variant}", t.lora_variant != "lora"),
        )
        if on
    ]
    if not beside:
        return []
    return [
        f"lora_rank with tensor_parallel_size={t.tensor_parallel_size} and "
        + ", ".join(beside)
        + " (traced: LoRA under tensor parallelism alone, as peft shards its adapters under "
        "transformers' TP plan; or --engine analytic)"
    ]


def _fsdp_cp(training: TrainingConfig) -> int:
    """The context-parallel ranks FSDP2 shards over beside the data ranks
    (``FrameworkConventions.fsdp_shards_over_context_parallel``), else 1."""
    if training.conventions.fsdp_shards_over_context_parallel:
        return training.context_parallel_size
    return 1


def _fsdp1_refusals(training: TrainingConfig) -> list[str]:
    """What of an FSDP1 run (:func:`~trainmem.specs.ranks.fsdp1_framework`) the traced paths
    refuse: a quantized base whose codes are not stored in a float dtype
    (:func:`~trainmem.specs.quantization.float_quant_storage`). Model parallelism beside FSDP1
    other than accelerate's context parallelism is no run of either framework, refused by
    :class:`~trainmem.specs.training.TrainingConfig` for both engines."""
    if not fsdp1_framework(training):
        return []
    out = []
    if training.quantize_base != "none" and float_quant_storage(training) is None:
        out.append(untraced_fsdp1_quantized(training))
    return out


def _traced_hf_trainer(training: TrainingConfig) -> bool:
    """The HF Trainer on one GPU, which the traced paths run as it runs: a plain loop with its
    conventions' optimizer (``TrainingConfig.step_implementation``: ``adamw_torch_fused``
    from torch 2.8, transformers training_args.py; ``adafactor``: transformers' own
    Adafactor, ``trainmem.trace.optimizers``). Not with parallelism (its FSDP / DeepSpeed are
    the accelerate and DeepSpeed rows)."""
    single = (
        training.data_parallel_size
        * training.tensor_parallel_size
        * training.context_parallel_size
        * training.pipeline_parallel_size
    ) == 1
    return training.conventions.hf_trainer_loop and single


def _traced_litgpt(training: TrainingConfig) -> bool:
    """litgpt's recipes on one GPU (under DDP too: the DDP rule takes the data-parallel size
    out first, ``trainmem.traced_options``), whose own ``GPT`` the traced paths build and run
    (``trainmem.trace.litgpt_model``, Note [litgpt's training step]) when litgpt is installed.
    Not traced: tensor, context or pipeline parallelism and sharded data parallelism (Fabric's
    FSDP and model-parallel strategies)."""
    single = (
        training.data_parallel_size
        * training.tensor_parallel_size
        * training.context_parallel_size
        * training.pipeline_parallel_size
    ) == 1
    return training.framework == "litgpt" and single


def _traced_torchtune(training: TrainingConfig) -> bool:
    """torchtune's single-device recipes (recipes/full_finetune_single_device.py,
    lora_finetune_single_device.py) and its distributed ones (full_finetune_distributed.py,
    lora_finetune_distributed.py: FSDP2 since 6deeda92, Sep 2024, ``training.shard_model``
    ``fully_shard``-ing each layer then the model, no mixed-precision policy: the weights are
    already in the recipe's dtype; ``zero_stage`` 3 over ``data_parallel_size`` ranks, traced
    for real as FSDP2, ``trainmem.trace.fsdp``) in the dtype they train in (``dtype: bf16`` /
    ``fp32``: ``--precision bf16-true`` / ``32-true``, the only ones TrainingConfig accepts
    with torchtune: ``FrameworkConventions.precisions``), which the
    traced paths run as a plain loop under torchtune's conventions as the trace reads them
    (``TrainingConfig.conventions``: LoRA adapters in the weight dtype, torchao NF4 saving no
    input, torchao's CPU offload, optimizer-in-backward and activation offloading as rules).
    The model is built by transformers; torchtune's builders are the same decoder
    architectures (Llama, Qwen2, Gemma, Mistral, Phi), and on the formula families the traced
    step agrees with the formulas' torchtune rows (tests/trace/test_traced_options.py). Not
    traced: tensor, context or pipeline parallelism (its own TP plans), and replicated data
    parallelism (torchtune's distributed recipes always shard)."""
    others = (
        training.tensor_parallel_size
        * training.context_parallel_size
        * training.pipeline_parallel_size
    )
    ranks = training.data_parallel_size
    layout = others == 1 and (ranks == 1 or training.zero_stage == 3)
    return training.framework == "torchtune" and layout


def finish(
    est: MemoryEstimate,
    *,
    gpu: GPUSpec | None,
    alloc_conf: str = "",
    simulate_allocator: bool = True,
    lean: bool = False,
) -> MemoryEstimate:
    """The one driver (Note [One description of the step]): from an engine's step schedules to
    the answer. For every distinct rank: ``schedule.peak()`` gives the peak allocated bytes and
    their split; the reported rank is the most loaded. Then each schedule is replayed once
    through the caching-allocator simulator on the GPU's capacity minus the CUDA context (free
    cache and retry included): its ``max_memory_reserved`` is the reported reserved memory, a
    sum of whole segments never above the capacity, and an out-of-memory there is the verdict.

    Args:
        est: an engine's draft (``schedules``, ``rank_labels``, details).
        gpu: the GPU for capacity and verdict, or None (unlimited, no verdict).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the simulator (``expandable_segments``,
            ``garbage_collection_threshold``...).
        simulate_allocator: False skips the replay (reserved = allocated): the planner's fast
            path.
        lean: leave out what a sweep's row does not read (``details["phase_peaks_bytes"]``,
            ``details["assumed"]``).

    Returns:
        ``est`` completed: breakdown at the peak, phase and reason, ``model_states_bytes``,
        ``details["per_rank"]``, ``timeline`` (the replayed events), ``oom_message``.

    Raises:
        SpecError: a bad ``alloc_conf``.
    """
    if not est.schedules:
        raise UnsupportedError("the engine produced no step schedule")
    peaks = [s.peak() for s in est.schedules]
    worst = max(range(len(peaks)), key=lambda k: peaks[k].peak_bytes)
    peak = peaks[worst]
    split: dict[str, int] = {}
    for category, size in peak.by_category.items():
        key = fold_category(category)
        split[key] = split.get(key, 0) + size
    ctx = est.breakdown.cuda_context
    labels = est.rank_labels or [{} for _ in est.schedules]
    per_rank: list[dict[str, object]] = [
        {**label, "allocated_bytes": p.peak_bytes, "peak_phase": p.phase}
        for label, p in zip(labels, peaks, strict=True)
    ]
    fragmentation = 0
    if simulate_allocator:
        for k, sched in enumerate(est.schedules):
            result = _replay(
                sched.replay_events(), ctx, gpu=gpu, alloc_conf=alloc_conf, full_stats=False
            )
            # a rank whose step fails has no reserved figure, as the whole run's peak has
            # none (MemoryEstimate.peak_dict); the reserved at the failure is not a peak
            per_rank[k]["reserved_bytes"] = None if result.oom else result.max_memory_reserved
            per_rank[k]["oom"] = result.oom
            if result.oom and est.oom_message is None and result.oom_message:
                est.oom_message = result.oom_message.splitlines()[0]
            if k == worst:
                if not result.oom:  # a failed step has no reserved figure to report
                    fragmentation = max(result.max_memory_reserved - peak.peak_bytes, 0)
                est.details["allocator_replay"] = {
                    "events": result.num_events,
                    "max_memory_allocated": result.max_memory_allocated,
                    "max_memory_reserved": result.max_memory_reserved,
                    "oom": result.oom,
                    "num_alloc_retries": result.memory_stats.get("num_alloc_retries", 0),
                }
                if sched.load:
                    est.details["load_phase"] = _load_phase(sched, result)
        est.replayed = True
    elif est.schedules[worst].load:
        est.details["load_phase"] = _load_phase(est.schedules[worst], None)
    est.breakdown = replace(
        est.breakdown,
        parameters=split.get("parameters", 0),
        gradients=split.get("gradients", 0),
        optimizer_states=split.get("optimizer_states", 0),
        activations=split.get("activations", 0),
        temporary=split.get("temporary", 0),
        fragmentation=fragmentation,
    )
    est.details["per_rank"] = per_rank
    est.reported_rank = worst
    est.peak_phase = "backward" if peak.phase == "zero_grad" else peak.phase
    if peak.label or not est.peak_reason:
        est.peak_reason = _reason(peak.phase, peak.label, peak.module)
    if len(peaks) > 1:
        stage = labels[worst].get("pipeline_stage", worst)
        est.peak_reason += f" (pipeline stage {stage}, the most loaded rank)"
    if est.oom_message:
        loading = est.details.get("load_phase", {}).get("oom", False)
        est.notes.append(
            ("loading the model does not fit" if loading else "the step does not fit")
            + ": the simulated caching allocator runs out of memory even after freeing its "
            "cache: " + est.oom_message
        )
    est.verdict = verdict_of(est)
    if not lean:
        _report_details(est, est.schedules[worst])
    if est.verdict == "tight":
        est.notes.append(
            "tight: it fits as predicted, but the high end of the uncertainty band (the "
            "benchmark's error spread for this kind of configuration) is above the GPU's usable "
            "capacity; leave headroom (a smaller micro-batch, activation checkpointing)"
        )
    return est


def _report_details(est: MemoryEstimate, reported: StepSchedule) -> None:
    """The details of the reported rank's step that only a report reads: its peak per phase
    and the settings assumed."""
    est.details["phase_peaks_bytes"] = reported.phase_peaks()
    est.details["assumed"] = _assumptions_of(est)
    if reported.load_rule:  # Note [The load phase]: a preset, turned off explicitly
        est.details["assumed"]["load"] = reported.load_rule


def _assumptions_of(est: MemoryEstimate) -> dict[str, str]:
    """:func:`~trainmem.specs.assumptions.assumptions` of ``est``'s settings and library."""
    library = est.details.get("generic", {}).get("library", "transformers")
    return assumptions(est.config, library)


def assumed_of(est: MemoryEstimate) -> dict[str, str]:
    """What ``est`` assumed (framework, loop, library versions): its ``details["assumed"]``,
    or for a lean estimate (a planner's probe, which skips the report's details) the same
    from its settings, so ``plan`` and ``fit`` say what ``estimate`` says."""
    assumed = est.details.get("assumed")
    return dict(assumed) if assumed else _assumptions_of(est)


def _load_phase(sched: StepSchedule, result: ReplayResult | None) -> dict[str, object]:
    """The load phase as the JSON's ``details.load_phase`` reports it (Note [The load phase] in
    trainmem.schedule): its rule, its own peak of allocated bytes (the schedule's, and the
    replay's with the allocator's rounding), the reserved bytes it leaves (the cache the step
    starts from) and whether it ran out of memory; without the replay only the peak."""
    out: dict[str, object] = {"rule": sched.load_rule, "peak_allocated_bytes": sched.load_peak()}
    if result is not None:
        out["max_memory_allocated"] = result.load_max_allocated
        out["max_memory_reserved"] = result.load_max_reserved
        out["oom"] = result.oom_phase == "load"
    return out


def _replay(
    timeline: Timeline | Iterable[AllocEvent | EventFields],
    ctx: int,
    *,
    gpu: GPUSpec | None,
    alloc_conf: str,
    record_history: bool = False,
    full_stats: bool = True,
) -> ReplayResult:
    from trainmem.allocator.replay import replay_timeline

    return replay_timeline(
        timeline,
        capacity_bytes=None if gpu is None else max(gpu.memory_bytes - ctx, 0),
        alloc_conf=alloc_conf,
        device_total_bytes=None if gpu is None else gpu.memory_bytes,
        record_history=record_history,
        continue_after_oom=False,
        full_stats=full_stats,
    )


def replay_estimate(
    est: MemoryEstimate,
    *,
    gpu: GPUSpec | None,
    alloc_conf: str = "",
    record_history: bool = False,
) -> ReplayResult:
    """Replay the reported rank's step (``est.timeline``, either engine's) through the allocator
    simulator again, e.g. with ``record_history`` for a memory snapshot; the same replay as
    :func:`finish`, so the same peaks.

    Raises:
        SpecError: the estimate carries no replayed step.
    """
    if est.timeline is None:
        raise SpecError("snapshot", "the estimate was made without the allocator replay")
    return _replay(
        est.timeline,
        est.breakdown.cuda_context,
        gpu=gpu,
        alloc_conf=alloc_conf,
        record_history=record_history,
    )


_PHASE_TEXT = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "zero_grad": "zero_grad",
    "init": "before the step",
}


def _reason(phase: str, label: str, module: str) -> str:
    """One sentence on the operation that sets the peak. Every reader prints it after the
    peak's phase ("peak falls in the backward: ..."), so the phase is named again only where
    the reported phase is not the schedule's (zero_grad is reported as the backward)."""
    where = _PHASE_TEXT.get(phase, phase)
    said = f"{where}: " if phase not in ("forward", "backward", "optimizer") else ""
    if not label:
        return f"{said}in {module or 'the model'}"
    return f"{said}{label} allocated" + (f" in {module}" if module else "")


def _validate_arguments(
    model: object, training: object, engine: object, context: object, alloc_conf: object
) -> None:
    """Types and ranges of :func:`estimate`'s own arguments (the specs check their fields)."""
    if not isinstance(model, str | ModelSpec):
        raise SpecError("model", f"must be a preset name, a path or a ModelSpec, got {model!r:.80}")
    if training is not None and not isinstance(training, TrainingConfig):
        raise SpecError("training", f"must be a TrainingConfig or None, got {training!r:.80}")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise SpecError("engine", f"unknown value {engine!r:.80}; allowed: {', '.join(ENGINES)}")
    if context is not None and (
        not isinstance(context, int) or isinstance(context, bool) or not 0 <= context <= TiB
    ):
        raise SpecError(
            "cuda_context_bytes", f"must be an int in [0, 2^40] bytes, got {context!r:.80}"
        )
    if not isinstance(alloc_conf, str):
        raise SpecError("alloc_conf", f"must be a string, got {alloc_conf!r:.80}")


def estimate(
    model: str | ModelSpec,
    training: TrainingConfig | None = None,
    *,
    gpu: str | GPUSpec | None = None,
    engine: str = "auto",
    cuda_context_bytes: int | None = None,
    alloc_conf: str = "",
    simulate_allocator: bool = True,
    lean: bool = False,
) -> MemoryEstimate:
    """Peak GPU memory of one steady-state training step on one GPU.

    Args:
        model: preset name (``trainmem models``), path to a HF ``config.json`` or its folder,
            or a :class:`~trainmem.specs.model.ModelSpec`.
        training: micro-batch size, sequence length, precision, optimizer...; None for the
            defaults (sequence length :func:`default_seq_len`).
        gpu: catalog GPU for the fit verdict, or None.
        engine: ``auto`` (Note [Which path runs]), ``analytic`` (closed form, instant),
            ``generic`` (a few blocks of the real model traced on fake tensors and repeated to
            full depth) or ``trace`` (the whole model traced); the last two need the ``trace``
            extra.
        cuda_context_bytes: memory outside the allocator; default per
            :mod:`trainmem.specs.hardware`.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the caching-allocator simulator; empty:
            the framework's (``FrameworkConventions.default_alloc_conf``: Unsloth's expandable
            segments), else torch's defaults.
        simulate_allocator: replay the step through the allocator simulator (reserved memory,
            the out-of-memory verdict); False is the planner's fast path (reserved = allocated).
        lean: for a sweep's row (the planner's): the analytic engine fills its step schedules
            from a template of their structure (Note [Schedule templates] in
            :mod:`trainmem.analytic.template`) and leaves out the details a row does not read
            (the rank map, the activation terms, the phase peaks, the assumed settings); the
            peak, the breakdown and the verdict are the same. Faster for the many
            configurations of a sweep that differ in micro-batch size and sequence length
            only, slower for a single one.

    Returns:
        The estimate; bytes throughout.

    Raises:
        SpecError: bad model, settings, GPU or engine name (message names the field).
        UnsupportedError: a model family the engine does not model.
    """
    _validate_arguments(model, training, engine, cuda_context_bytes, alloc_conf)
    given_seq_len = training is not None and training.seq_len != SEQ_LEN_DEFAULT
    if training is None:
        training = TrainingConfig(seq_len=default_seq_len_of(model))
    # an image model's sequence as the CLI reads it (Note [Vision encoders at another
    # resolution]): the patches of its image, or none for a pixel model on the generic path
    training = image_sequence(model, training, given=given_seq_len)
    load_dtype_note = None
    gpu_spec = resolve_gpu(gpu)
    if training.load_dtype is None and training.framework in LOADS_FROM_PRETRAINED:
        dtype, model_type, config = _checkpoint_dtype(model)
        training, load_dtype_note = resolve_load_dtype(
            training, dtype, model_type, config=config, gpu=gpu_spec
        )
    elif training.load_dtype is None and training.is_lora and isinstance(model, str):
        # Note [diffusers' LoRA scripts cast the frozen model]
        try:
            training, load_dtype_note = diffusers_lora_load_dtype(training, load_hf_config(model))
        except SpecError:  # an unreadable config: its own error comes later
            pass
    if not alloc_conf:  # the framework's (Unsloth's expandable segments); a given one wins
        torch = parse_version("torch_version", training.torch_version)
        alloc_conf = training.conventions.default_alloc_conf(torch)
    pieces_note = ""
    if gpu_spec is not None and training.conventions.unsloth_fused_cross_entropy:
        pieces = unsloth_loss_pieces(model, training, gpu_spec, cuda_context_bytes)
        if pieces > 1:
            training = replace(training, chunked_cross_entropy=pieces)
            pieces_note = (
                f"Unsloth's fused loss runs in {pieces} pieces of tokens on this GPU (its "
                "get_chunk_size from the free memory at the loss; --chunked-cross-entropy N "
                "sets them, as UNSLOTH_CE_LOSS_N_CHUNKS does)"
            )
    est = _dispatch(
        model, training, gpu, engine, cuda_context_bytes, alloc_conf, simulate_allocator, lean
    )
    if load_dtype_note and "assumed" in est.details:
        est.details["assumed"]["load_dtype"] = load_dtype_note
    est.notes[:0] = (
        setting_warnings(model, training)
        + ([pieces_note] if pieces_note else [])
        + _unread_seq_len(model, training, given=given_seq_len)
        + _unread_target_seq_len(model, training)
    )
    pixels = pixel_config(model) if est.engine != "analytic" else None
    if pixels is not None:
        report_pixels(est, pixels, training)
    return est


def _checkpoint_dtype(
    model: str | ModelSpec,
) -> tuple[str | None, str | None, Mapping[str, Any] | None]:
    """The dtype ``model``'s config says its checkpoint is in (``ModelSpec.checkpoint_dtype``;
    a transformers config outside the formula families read the same way), its
    ``model_type`` and the config itself (None for a ModelSpec); None for none, a diffusers or
    timm config, or one that cannot be read (its own error comes later)."""
    if isinstance(model, ModelSpec):
        return model.checkpoint_dtype, model.model_type, None
    try:
        config = load_hf_config(model)
    except SpecError:
        return None, None, None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None, None, None
    return checkpoint_dtype(config), model_type, config


def unsloth_chunk_count(vocab_size: int, tokens: int, free_bytes: int) -> int:
    """Unsloth's number of fused-loss pieces: ``max(4 round(2 V t / free), 1)``, Python's
    rounding (unsloth_zoo 2026.3.4 fused_losses/cross_entropy_loss.py ``get_chunk_size`` with
    ``_get_chunk_multiplier``'s ``target_gb = 0.5 free``); one piece when nothing is free
    (Unsloth raises there; the step does not fit anyway)."""
    if free_bytes <= 0:
        return 1
    return max(4 * round(2 * vocab_size * tokens / free_bytes), 1)


def unsloth_loss_pieces(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    cuda_context_bytes: int | None = None,
) -> int:
    """The pieces Unsloth's fused cross-entropy splits the tokens into on ``gpu`` (Note
    [Unsloth's fused cross-entropy]): ``chunked_cross_entropy`` when given
    (``UNSLOTH_CE_LOSS_N_CHUNKS``), else :func:`unsloth_chunk_count` with ``free`` the GPU's
    capacity less the CUDA context and what the analytic schedule holds when the first loss
    starts (``torch.cuda.mem_get_info`` at the first call, which ``_get_chunk_multiplier``
    caches, cached blocks aside);
    1 where the fused loss does not run.

    Raises:
        SpecError: as :func:`estimate`.
    """
    try:
        spec = resolve_model(model)
    except UnsupportedError:  # no ModelSpec: the engine says what it does not model
        return max(training.chunked_cross_entropy, 1)
    if training.chunked_cross_entropy or not unsloth_fused_loss(spec, training):
        return max(training.chunked_cross_entropy, 1)
    check_training_for_model(spec, training)
    first = estimate_analytic(
        spec, training, gpu=gpu, cuda_context_bytes=cuda_context_bytes, earlier_steps=False
    )
    context, _, _ = device_context(training, cuda_context_bytes, gpu=gpu)
    free = gpu.memory_bytes - context - _live_at_loss(first.schedules[0])
    tokens = training.micro_batch_size * training.seq_len
    return unsloth_chunk_count(spec.vocab_size, tokens, free)


def _live_at_loss(schedule: StepSchedule) -> int:
    """Bytes allocated when the first loss's logits are about to be made: the warm-up step's
    (in the setup: optimizer states made lazily by its step are not there yet), else the
    measured step's; 0 without a loss."""
    live = 0
    for op in _walk([*schedule.setup, *schedule.step]):
        if op.action == "alloc" and op.key in ("logits16", "logits"):
            return live
        live += op.size_bytes if op.action == "alloc" else -op.size_bytes
    return 0


def _walk(items: list[Item]) -> Iterator[Op]:
    """The ops of ``items``, repeats unrolled (sizes only: keys stay unformatted)."""
    for item in items:
        if isinstance(item, Repeat):
            for _ in range(item.count):
                yield from _walk(list(item.body))
        else:
            yield item


def _unread_seq_len(model: str | ModelSpec, training: TrainingConfig, *, given: bool) -> list[str]:
    """A warning when ``seq_len`` was given for a diffusers model, which reads none: its batch
    is the image's latents (``--resolution``, ``--frames``) and the prompt's tokens
    (``--text-seq-len``), :func:`trainmem.specs.diffusers.image_batch`."""
    if not given or isinstance(model, ModelSpec):
        return []
    from trainmem.specs.diffusers import is_diffusers_config
    from trainmem.specs.hf import load_hf_config

    try:
        config = load_hf_config(model)
    except SpecError:
        return []
    if not is_diffusers_config(config):
        return []
    return [
        f"warning: seq_len={training.seq_len} has no effect on a diffusers model: its batch is "
        "the image's latents (--resolution, --frames for video) and the prompt's tokens "
        "(--text-seq-len); leave --seq-len out"
    ]


def _unread_target_seq_len(model: str | ModelSpec, training: TrainingConfig) -> list[str]:
    """A warning when ``target_seq_len`` was given for a model that does not read it: a text
    encoder-decoder's decoder length is an input of its own (the formulas' T5,
    :attr:`~trainmem.specs.training.TrainingConfig.decoder_seq_len`; the generic path's labels,
    :func:`trainmem.trace.hf_model.reads_target_seq_len`: T5, mT5, BART, Pegasus, Marian...);
    a decoder-only or encoder model has no decoder, Whisper's and a vision / speech
    encoder-decoder's labels are ``seq_len`` long."""
    if not training.target_seq_len:
        return []
    spec = model if isinstance(model, ModelSpec) else _loaded_spec(model)
    if spec is not None and (spec.architecture == "encoder-decoder" or spec.cross_attention):
        return []
    if spec is None and not isinstance(model, ModelSpec) and _generic_reads_target(model):
        return []
    return [
        f"warning: target_seq_len={training.target_seq_len} has no effect on this model: only "
        "a text encoder-decoder's (T5, BART, Pegasus, Marian...) decoder length is modelled "
        "apart from seq_len (a decoder-only or encoder model has no decoder; Whisper's and a "
        "vision / speech encoder-decoder's labels are seq_len long); leave --target-seq-len out"
    ]


def _generic_reads_target(model: str) -> bool:
    """Whether the generic path's batch of the config ``model`` has labels ``target_seq_len``
    long (:func:`trainmem.trace.hf_model.reads_target_seq_len`); False when the config cannot be
    read or built, or transformers is missing (its own error comes later)."""
    try:
        raw = load_hf_config(model)
        if "model_type" not in raw:  # a diffusers or timm config
            return False
        from trainmem.trace.hf_model import hf_config_of, reads_target_seq_len

        return reads_target_seq_len(hf_config_of(raw))
    except (ImportError, SpecError, UnsupportedError):
        return False


def setting_warnings(model: str | ModelSpec, training: TrainingConfig) -> list[str]:
    """One line for each setting that is accepted but ignored or out of range for the model,
    so that nothing is dropped silently: a ZeRO stage without data parallelism (ZeRO
    partitions across the data-parallel group: one rank holds everything, Rajbhandari et al.
    2020, sec. 5), a sequence longer than the model's context (``max_position_embeddings``),
    an accelerate release no loop of the framework reads.
    """
    out = []
    if training.zero_stage > 0 and training.data_parallel_size == 1:
        out.append(
            f"warning: zero_stage={training.zero_stage} with data_parallel_size=1 shards "
            "nothing (ZeRO partitions across the data-parallel ranks): the answer is one GPU "
            "holding everything; pass --data-parallel-size N for the per-GPU share of N GPUs"
        )
    t = training
    units = t.zero_stage == 3 and t.sharding_degree > 1 and not t.conventions.zero_ipg_buckets
    if t.fsdp_embedding_head_units and not (units and t.pipeline_parallel_size == 1):
        out.append(
            "warning: fsdp_embedding_head_units applies to FSDP FULL_SHARD over more than one "
            "rank without pipelining (zero_stage=3, data_parallel_size > 1): ignored here"
        )
    if t.accelerate_version and not t.conventions.accelerate_optimizer_zero_grad:
        # Note [zero_grad's default by release]: only accelerate's prepared optimizer reads it
        out.append(
            f"warning: accelerate_version={t.accelerate_version} has no effect under "
            f"--framework {t.framework}: only --framework accelerate-fsdp's loop calls the "
            "zero_grad() of accelerate's prepared optimizer, whose default follows the release "
            "(the HF Trainer calls torch's model.zero_grad()): ignored here"
        )
    longer = [n for n in training.earlier_seq_len_list if n > training.seq_len]
    if longer:
        out.append(
            f"warning: earlier_seq_lens lists {len(longer)} length(s) above seq_len="
            f"{training.seq_len:,} (the longest {max(longer):,}): each counts as seq_len "
            "(Note [Steps of varying length]); give the longest length as --seq-len"
        )
    spec = model if isinstance(model, ModelSpec) else _loaded_spec(model)
    context = getattr(spec, "max_position_embeddings", 0) if spec is not None else 0
    # a vision encoder's table is interpolated to its image's patches (Note [Vision encoders
    # at another resolution]): more patches than the config's are what --resolution asks for
    interpolated = spec is not None and spec.architecture == "vision-encoder"
    if context and training.seq_len > context and not interpolated:
        out.append(
            f"warning: seq_len={training.seq_len:,} is beyond the model's context "
            f"({context:,} tokens, max_position_embeddings): the estimate is for the length "
            "given, which the model was not built for"
        )
    return out


def _dispatch(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu: str | GPUSpec | None,
    engine: str,
    cuda_context_bytes: int | None,
    alloc_conf: str,
    simulate_allocator: bool,
    lean: bool = False,
) -> MemoryEstimate:
    gpu_spec = resolve_gpu(gpu)
    if gpu_spec is not None:
        check_precision_on_gpu(training.precision, gpu_spec)
    diffusers = route_diffusers(model, training)
    if engine == "auto":
        return _estimate_auto(
            model,
            training,
            gpu_spec,
            cuda_context_bytes,
            alloc_conf,
            simulate_allocator,
            diffusers,
            lean,
        )
    if engine in ("trace", "generic"):
        return _estimate_traced(
            model,
            training,
            gpu_spec,
            engine,
            alloc_conf,
            simulate_allocator,
            diffusers,
            cuda_context_bytes,
        )
    if engine != "analytic":
        raise SpecError("engine", f"unknown value {engine!r}; allowed: {', '.join(ENGINES)}")
    est = _analytic(model, training, gpu_spec, cuda_context_bytes, simulate_allocator, lean)
    return finish(
        est, gpu=gpu_spec, alloc_conf=alloc_conf, simulate_allocator=simulate_allocator, lean=lean
    )


def _analytic(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu_spec: GPUSpec | None,
    cuda_context_bytes: int | None,
    simulate_allocator: bool,
    lean: bool,
) -> MemoryEstimate:
    """The analytic engine's draft for :func:`finish`; the steps of ``earlier_seq_lens`` /
    ``sample_lengths`` only where the allocator is replayed (they change only what it
    reserves: every earlier length is at most ``seq_len``)."""
    spec = resolve_model(model)
    check_training_for_model(spec, training)
    return estimate_analytic(
        spec,
        training,
        gpu=gpu_spec,
        cuda_context_bytes=cuda_context_bytes,
        lean=lean,
        earlier_steps=simulate_allocator,
    )


def _estimate_auto(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu_spec: GPUSpec | None,
    cuda_context_bytes: int | None,
    alloc_conf: str,
    simulate_allocator: bool,
    diffusers: bool,
    lean: bool = False,
) -> MemoryEstimate:
    """Note [Which path runs]."""
    try:
        est = _analytic(model, training, gpu_spec, cuda_context_bytes, simulate_allocator, lean)
    except UnsupportedError as exc:
        reason = str(exc).split("; ")[0]
        try:
            from trainmem.trace._torch import require_transformers

            require_transformers()
        except ImportError:
            raise UnsupportedError(
                f"{reason}; the generic path covers any family transformers builds and needs "
                f"torch and transformers: {TRACE_INSTALL}"
            ) from exc
        try:
            est = _estimate_traced(
                model,
                training,
                gpu_spec,
                "generic",
                alloc_conf,
                simulate_allocator,
                diffusers,
                cuda_context_bytes,
            )
        except UnsupportedError as generic_exc:  # neither path models it: both reasons
            why = without_analytic_advice(str(generic_exc))
            if diffusers or (isinstance(model, str) and _is_timm(model)):
                # no formula family was ever in question: the generic path's reason alone
                raise type(generic_exc)(why) from generic_exc
            raise UnsupportedError(f"the analytic formulas: {reason}; {why}") from generic_exc
        est.notes.insert(0, f"auto: {reason}; the generic path ran")
        return est
    return finish(
        est, gpu=gpu_spec, alloc_conf=alloc_conf, simulate_allocator=simulate_allocator, lean=lean
    )


_ANALYTIC_ADVICE = re.compile(
    r",? or (use )?--engine analytic"  # "..., or --engine analytic", "... or use --engine ..."
    r"|;? ?use --engine analytic( for this (configuration|model))?"
    r"|;? or --engine analytic(?=\))"
)


def without_analytic_advice(message: str) -> str:
    """A traced path's refusal without its advice to run ``--engine analytic``, which ``auto``
    has just tried (its refusal comes first in the combined message); what else the refusal
    says would work (another framework, another setting) is kept."""
    return _ANALYTIC_ADVICE.sub("", message).rstrip("; ")


def _is_timm(name: str) -> bool:
    """Whether ``name`` is a timm model (``timm:<name>`` or a timm config): the trace engine
    builds those on the generic path (``trainmem.trace.timm_model``)."""
    from trainmem.specs.hf import is_timm_config, load_hf_config

    try:
        return is_timm_config(load_hf_config(name))
    except SpecError:
        return False


def _loaded_spec(name: str) -> ModelSpec | None:
    """The spec the config ``name`` gives, or None when it cannot be read or modelled."""
    try:
        return resolve_model(name)
    except (SpecError, UnsupportedError):
        return None


#: Above this many layers the trace engine traces a few and composes the rest (issue 14: a 70B
#: rank in seconds); at or below it the whole model is traced, every op's event kept.
COMPOSE_ABOVE_LAYERS = 16


def _composes_layers(target: ModelSpec, training: TrainingConfig) -> bool:
    """Whether the trace engine takes the composed path (``trainmem.trace.generic``): a
    transformers decoder deeper than :data:`COMPOSE_ABOVE_LAYERS`, no pipeline (the pipeline
    trace composes per stage itself), and settings the composition supports."""
    return (
        not target.not_transformers
        and target.num_layers > COMPOSE_ABOVE_LAYERS
        and training.pipeline_parallel_size == 1
        and not trace_unsupported_settings(training, "generic")
    )


MAX_TRACED_TENSOR_BYTES = 2**50
"""The largest activation a traced path builds (1 PiB, thousands of GPUs' memory): beyond it
the fake tensors overflow torch's storage size or describe no run that can exist."""


def check_traceable_size(target: str | ModelSpec, training: TrainingConfig) -> None:
    """Refuse a micro-batch whose hidden states alone (tokens x hidden x 2 bytes) exceed
    :data:`MAX_TRACED_TENSOR_BYTES` before the traced paths build it (``-b 2147483647 -s
    2147483647`` was torch's "Storage size calculation overflowed" traceback).

    Raises:
        SpecError: naming the larger of ``micro_batch_size`` and ``seq_len``.
    """
    b, s = training.micro_batch_size, training.seq_len
    hidden = target.hidden_size if isinstance(target, ModelSpec) else 1
    size = b * s * hidden * 2
    if size > MAX_TRACED_TENSOR_BYTES:
        field = "seq_len" if s >= b else "micro_batch_size"
        raise SpecError(
            field,
            f"micro_batch_size {b:,} x seq_len {s:,} x hidden {hidden:,} x 2 bytes is "
            f"2^{size.bit_length() - 1} bytes in one activation, a tensor no device holds; "
            "allowed: at most 2^50 bytes (1 PiB) per tensor",
        )


def _check_traced_family(target: str | ModelSpec, engine: str) -> None:
    """Refuse a family no traced path builds: torchvision's (``ModelSpec.analytic_only``), and
    the CS336 course model on the generic path (it builds with transformers).

    Raises:
        UnsupportedError: naming the engine that models it.
    """
    if not isinstance(target, ModelSpec):
        return
    if target.analytic_only:
        raise UnsupportedError(
            f"{target.model_type} is modelled by the analytic engine only (no traced path "
            "builds it: its library is not a dependency); use --engine analytic"
        )
    if target.not_transformers and engine == "generic":
        raise UnsupportedError(
            "the generic path builds the model with transformers, and cs336_basics is not a "
            "transformers model (the CS336 course's own code); use --engine trace (the "
            "course model traced whole) or --engine analytic"
        )


def _untraced_hint(model: str | ModelSpec, diffusers: bool, unsupported: list[str]) -> str:
    """What runs instead of settings the traced paths do not model: the analytic engine for a
    model its formulas build, else dropping the settings (a diffusers, timm or other family
    only the traced paths build: ``--engine analytic`` would refuse the model itself)."""
    if not diffusers and (isinstance(model, ModelSpec) or _loaded_spec(model) is not None):
        return "use --engine analytic for this configuration"
    names = ", ".join(dict.fromkeys(u.split("=")[0] for u in unsupported))
    return (
        "the analytic formulas do not model this model either (no formula family); "
        f"change or drop {names}"
    )


def _estimate_traced(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu_spec: GPUSpec | None,
    engine: str,
    alloc_conf: str,
    simulate_allocator: bool,
    diffusers: bool = False,
    cuda_context_bytes: int | None = None,
) -> MemoryEstimate:
    """The ``trace`` engine (the whole model) or the ``generic`` path (a few blocks per list,
    ``trainmem.trace.generic``), each finished by :func:`finish`; a diffusers config is built
    by ``trainmem.trace.diffusers_model`` on either. With ``earlier_seq_lens`` each listed
    length's step is traced too and runs before the measured one, as the analytic engine
    splices its own (Note [Steps of varying length] in trainmem/analytic/varying_lengths.py)."""
    args = (gpu_spec, engine, diffusers, cuda_context_bytes)
    est = _traced_step(model, replace(training, earlier_seq_lens=None, sample_lengths=None), *args)
    lengths = earlier_lengths(training)
    if lengths:
        traced = {training.seq_len: est}  # each length traced once (drawn ones repeat)
        traced |= {
            n: _traced_step(
                model,
                replace(training, seq_len=n, earlier_seq_lens=None, sample_lengths=None),
                *args,
            )
            for n in dict.fromkeys(lengths)
            if n not in traced
        }
        earlier = [traced[n] for n in lengths]
        est.schedules = [
            after_steps([e.schedules[k] for e in earlier], measured, measured_state=True)
            for k, measured in enumerate(est.schedules)
        ]
        est.config = resolved_config(training)
        est.notes.append(
            f"earlier_seq_lens={','.join(map(str, lengths))}: each listed length's step traced "
            "and run before the measured one through one allocator (Note [Steps of varying "
            "length] in trainmem/analytic/varying_lengths.py)"
        )
    return finish(est, gpu=gpu_spec, alloc_conf=alloc_conf, simulate_allocator=simulate_allocator)


def _traced_step(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu_spec: GPUSpec | None,
    engine: str,
    diffusers: bool,
    cuda_context_bytes: int | None,
) -> MemoryEstimate:
    """:func:`_estimate_traced`'s estimate of one length, before :func:`finish`: the traced
    step with the options and transforms the traced paths apply as rules, and what no fake
    tensor shows (the CUDA context, NCCL communicators, paged states)."""
    unsupported = trace_unsupported_settings(training, engine)
    if unsupported:
        what = "the trace engine" if engine == "trace" else "the generic path (a trace)"
        raise UnsupportedError(
            f"{what} does not model "
            + ", ".join(unsupported)
            + " yet; "
            + _untraced_hint(model, diffusers, unsupported)
        )
    if isinstance(model, ModelSpec) and _loaded_spec(model.name) != model:
        raise UnsupportedError(
            f"the traced paths build the model from its config, and this ModelSpec differs from "
            f"the config {model.name!r} names (changed after loading); pass the path of a "
            "config.json with the changes instead"
        )
    target: str | ModelSpec = model
    if not diffusers:
        try:  # the traced paths run families the analytic engine does not model
            spec = resolve_model(model)
            check_training_for_model(spec, training)
            target = spec
        except UnsupportedError:
            target = model
        check_traceable_size(target, training)
        _check_traced_family(target, engine)
    timm = isinstance(target, str) and _is_timm(target)
    not_applied = release_not_applied(training, diffusers=diffusers, timm=timm)
    if not_applied:  # no transformers model code in the step: the installed release traced
        training = replace(training, transformers_version=None)
    deepspeed = traced_deepspeed(training)
    shape = target if isinstance(target, ModelSpec) else None
    _check_traced_framework(training, target, deepspeed=deepspeed, diffusers=diffusers)
    unmodelled = release_refusals(shape if not diffusers else None, training)
    if not diffusers and not timm:
        unmodelled += litgpt_release_refusals(training)  # litgpt on these: not applicable
    if unmodelled:
        what = "the trace engine" if engine == "trace" else "the generic path (a trace)"
        raise UnsupportedError(f"{what} does not model " + ", ".join(unmodelled))
    check_unsloth_run(shape, training)
    standin, run, options = _traced_run(training, deepspeed=deepspeed)
    litgpt = training.framework == "litgpt"  # its own GPT: trace.litgpt_model, generic only
    if engine == "generic" or litgpt or (isinstance(target, str) and _is_timm(target)):
        from trainmem.trace.generic import estimate_generic

        name = target if isinstance(target, str) else target.name
        est = estimate_generic(name, run, gpu=gpu_spec)
    elif diffusers:
        from trainmem.trace.diffusers_model import estimate_diffusers_trace

        assert isinstance(model, str)
        est = estimate_diffusers_trace(model, run, gpu=gpu_spec)
    elif isinstance(target, ModelSpec) and _composes_layers(target, run):
        from trainmem.trace.generic import estimate_generic

        est = estimate_generic(
            model if isinstance(model, str) else target.name,
            run,
            gpu=gpu_spec,
            layout=model_rank_map(target, training),
        )
        est.engine = "trace"
        composed = bool(est.details.get("generic", {}).get("block_lists"))
        how = (
            f"of its {target.num_layers} identical layers a few are traced and the middle one "
            "repeated to full depth (every layer's events repeat, Note [Composing the full "
            "depth] in trainmem/trace/compose.py)"
            if composed
            else "every layer traced (the next note says why the composition was not used)"
        )
        est.notes[0] = (
            f"trace engine: the model built by transformers on fake tensors; {how}; requested "
            "sizes, the CUDA context and the NCCL communicators are added, not traced"
        )
    elif training.pipeline_parallel_size > 1:
        from trainmem.trace.pipeline import estimate_pipeline_trace

        est = estimate_pipeline_trace(target, run, gpu=gpu_spec)
    else:
        from trainmem.trace.engine import estimate_trace

        est = estimate_trace(target, run, gpu=gpu_spec)
    if not est.schedules:  # the whole trace: its recorded stream as a flat schedule
        est.schedules = [StepSchedule.from_timeline(est.timeline).with_lazy_optimizer_states()]
    # a paged optimizer's large states, outside the allocator (from the traced tensors when the
    # model has no ModelSpec: Note [Traced tensors as model states] in traced_transforms)
    paged = paged_states(target, training, est.schedules[0]) if standin is not None else 0
    if deepspeed or standin is not None:
        _apply_traced_transforms(est, shape, training, deepspeed=deepspeed)
    if options:
        shape = target if isinstance(target, ModelSpec) else None
        for option in options:
            est.schedules = [option.apply(s, shape, training) for s in est.schedules]
            est.notes.append(option.note(training))
        _drop_traced_peak(est, training)
    # what no fake tensor shows, as the analytic engine counts it: the user's CUDA context (or
    # the default), the NCCL communicators and a paged optimizer's states beside the allocator
    ctx, outside, notes = device_context(training, cuda_context_bytes, paged, gpu=gpu_spec)
    est.breakdown = replace(est.breakdown, cuda_context=ctx)
    est.details["outside_allocator_bytes"] = outside
    est.notes.extend(notes + ([not_applied] if not_applied else []))
    return est


def _traced_run(
    training: TrainingConfig, *, deepspeed: bool
) -> tuple[TrainingConfig | None, TrainingConfig, list[TracedOption]]:
    """(the stand-in optimizer's settings or None, the settings the trace runs, the options
    applied to its step as rules): an optimizer the trace cannot run is a stand-in whose states
    are replaced (:mod:`trainmem.traced_transforms`); each option of
    :mod:`trainmem.traced_options` taken out; DeepSpeed as one rank's plain loop (its ZeRO-3
    partitioning is the transform's, not FSDP2's, which the trace would run over N ranks)."""
    standin = optimizer_standin(training)
    run = training if standin is None else standin
    options = active_options(run)
    run = traced_settings(run)
    if deepspeed:
        run = replace(run, data_parallel_size=1)
        if not OPTIMIZER_TABLE[run.optimizer].num_states:
            # plain SGD holds no per-parameter state to carry DeepSpeed's fp32 master copy
            # (traced_transforms._Sizes.of re-sizes each parameter's traced states): traced
            # with momentum, its momentum buffers then re-sized to the master copy alone
            run = replace(run, optimizer="sgd-momentum")
    return standin, run, options


def _check_traced_framework(
    training: TrainingConfig, target: str | ModelSpec, *, deepspeed: bool, diffusers: bool
) -> None:
    """Refuse a framework the traced model cannot run under: torchtune, Unsloth, LLaMA-Factory,
    axolotl, TRL or fsdp-qlora for a diffusers or timm model (torchtune's builders are language
    models, fsdp_qlora's train.py loads a causal LM, the others load transformers models),
    Megatron for a formula family that is not a causal LM (its ``GPTModel``; other configs:
    ``trainmem.trace.generic.recipe_for_config``), DeepSpeed's ``"auto"`` sizes without a
    ModelSpec (:func:`_check_deepspeed_without_spec`).

    Raises:
        NotApplicableError: torchtune, Unsloth, LLaMA-Factory, axolotl, TRL or fsdp-qlora on a
            diffusers or timm model, peft's ``lora_modules_to_save`` (a token embedding and LM
            head) on one, Megatron on a model that is not a causal LM, naming what would work.
        UnsupportedError: DeepSpeed's ``"auto"`` sizes without a ModelSpec.
    """
    language_only = {
        "torchtune": "torchtune's recipes train its own language-model builders",
        # unsloth 2026.3.5 models/loader.py: FastLanguageModel / FastModel load transformers
        "unsloth": "Unsloth's FastLanguageModel and FastModel load transformers models",
        # LLaMA-Factory v0.9.5 model/loader.py load_model and axolotl v0.18.0 loaders/model.py:
        # transformers Auto classes (language and vision-language models), no diffusers
        "llama-factory": "LLaMA-Factory loads transformers language and vision-language models",
        "axolotl": "axolotl loads transformers language and vision-language models",
        # Answer.AI fsdp_qlora train.py (05ed9f2, lines 557-606): AutoTokenizer and
        # AutoModelForCausalLM.from_pretrained / from_config, trained on text datasets
        "fsdp-qlora": "Answer.AI's fsdp_qlora train.py loads a causal language model "
        "(AutoModelForCausalLM) and trains it on tokenized text",
        # trl v0.26.0 trainer/sft_trainer.py SFTTrainer.__init__: a model id is loaded with
        # AutoModelForCausalLM (or, for a processor's model, the image-text-to-text class), and
        # its loss is a token loss over the tokenized dataset
        "trl": "TRL's SFTTrainer trains transformers causal language and vision-language "
        "models on tokenized text",
    }
    instead = {
        # accelerate's FSDP wraps any nn.Module, as diffusers' example scripts run it
        "fsdp-qlora": "--framework accelerate-fsdp (FSDP with --quantize-base nf4 and "
        "--lora-rank for QLoRA) or pytorch-amp",
    }
    if training.framework in language_only and (
        diffusers or (isinstance(target, str) and _is_timm(target))
    ):
        what = language_only[training.framework]
        use = instead.get(training.framework, "--framework pytorch-amp")
        raise NotApplicableError(
            f"framework={training.framework}: {what}, and this is a diffusers / timm model; use "
            f"{use}"
        )
    if (
        training.is_lora
        and training.lora_modules_to_save
        and (diffusers or (isinstance(target, str) and _is_timm(target)))
    ):
        # the names are a transformers model's get_input_embeddings / get_output_embeddings
        # (trace/lora.py modules_to_save); diffusers' add_adapter path took no modules_to_save,
        # so PixArt ran as if the option were not given (session 25, generic_options.py)
        raise NotApplicableError(
            "lora_modules_to_save="
            f"{','.join(training.lora_modules_to_save)}: a transformers model's token embedding "
            "and language-model head, which a diffusers / timm model has not; leave it out "
            "(LoRA alone) or train the whole model (--lora-rank 0)"
        )
    if deepspeed and not isinstance(target, ModelSpec):
        _check_deepspeed_without_spec(training)
    megatron = training.framework == "megatron"
    if megatron and isinstance(target, ModelSpec) and target.head != "causal-lm":
        raise NotApplicableError(
            f"framework=megatron: Megatron-LM trains decoder-only language models (megatron-"
            f"core's GPTModel), and {target.name} has a {target.head} head; traced with "
            "--framework megatron: a causal language model; for this model use --framework "
            "pytorch-amp, fsdp2 or deepspeed"
        )


def _check_deepspeed_without_spec(training: TrainingConfig) -> None:
    """Refuse the DeepSpeed ``"auto"`` sizes a model without a ModelSpec cannot give (they are
    read from the hidden size: Notes [DeepSpeed without a ModelSpec] and [Traced ZeRO-3] in
    trainmem/traced_transforms.py).

    Raises:
        UnsupportedError: ``reduce_bucket_size`` or, at ZeRO-3, ``stage3_prefetch_bucket_size``
            is ``"auto"``.
    """
    if training.reduce_bucket_size == "auto":
        raise UnsupportedError(
            'reduce_bucket_size="auto" is hidden_size^2 (the HF Trainer\'s fill-in), and this '
            "model has no ModelSpec to give its hidden size; set it to a number of elements "
            "(--set reduce-bucket-size=N, or in the ds_config.json)"
        )
    if training.zero_stage == 3 and training.stage3_prefetch_bucket_size == "auto":
        raise UnsupportedError(
            'stage3_prefetch_bucket_size="auto" is 0.9 hidden_size^2 (the HF Trainer\'s '
            "fill-in), and this model has no ModelSpec to give its hidden size; set it to a "
            "number of elements (--set stage3-prefetch-bucket-size=N, or in the ds_config.json)"
        )


def _apply_traced_transforms(
    est: MemoryEstimate, target: ModelSpec | None, training: TrainingConfig, *, deepspeed: bool
) -> None:
    """The traced plain-loop step as ``training`` asks: DeepSpeed ZeRO-1/2/3 or an optimizer the
    trace ran a stand-in for, applied as the analytic engine's transforms
    (:mod:`trainmem.traced_transforms`); the trace's own peak details (of the plain loop) are
    dropped, :func:`finish` names the new peak."""
    if deepspeed:
        est.schedules = [apply_deepspeed(s, target, training) for s in est.schedules]
        est.notes.append(
            f"DeepSpeed ZeRO-{training.zero_stage}: the plain loop was traced and DeepSpeed's "
            "mechanisms applied to the traced step as the analytic engine's transforms "
            "(gradient and optimizer-state partitions"
            + (
                ", weight partitions and each micro-batch's gathered layer and root"
                if training.zero_stage == 3
                else ""
            )
            + " over "
            f"{training.sharding_degree} ranks, fp32 master copy, gradient buckets, the step's "
            "gradient copies; trainmem/traced_transforms.py)"
            + (
                f"; offload={training.offload}: the offloaded states off the GPU and the step's "
                "temporaries on the CPU"
                if training.offload != "none"
                else ""
            )
        )
    else:
        est.schedules = [apply_optimizer(s, target, training) for s in est.schedules]
        why = (
            f"torch_version={training.torch_version}: its {training.step_implementation} "
            "step holds other temporaries than the installed torch's"
            if older_torch_step(training)
            else "its kernels do not run on fake tensors"
        )
        est.notes.append(
            f"{training.optimizer}: {why}, so the step was traced with torch's fused AdamW and "
            f"its states and step temporaries replaced by {training.optimizer}'s, as the "
            "analytic engine's optimizer transform sizes them (trainmem/traced_transforms.py)"
        )
    _drop_traced_peak(est, training)


def _drop_traced_peak(est: MemoryEstimate, training: TrainingConfig) -> None:
    """The estimate's settings as asked and without the traced step's own peak details (the
    rewritten step has another peak; :func:`finish` names it)."""
    est.config = resolved_config(training)
    est.peak_reason = ""
    for key in ("peak_allocated_bytes", "peak_op", "peak_module", "peak_by_category_bytes",
                "peak_contributors"):  # fmt: skip
        est.details.pop(key, None)
