"""The generic path: any model transformers (or diffusers) can build, traced with a few blocks per
list and composed to full depth.

Note [Generic path]
    1. Build the whole model on ``meta`` from its config (exact parameter count, tied weights,
       buffers): ``trainmem.trace.hf_model.build_hf_training_model``, or a diffusers builder.
    2. Find its block lists and cut each to a few units per run of identical blocks, keeping one
       unit of each distinct kind (Note [Runs of blocks], ``trainmem.trace.blocks``).
    3. Trace the cut model's steady-state step with the trace engine
       (``trainmem.trace.engine.run_trace``: fake tensors, CUDA emulation, LoRA, checkpointing,
       FSDP2...).
    4. Compose the full-depth :class:`~trainmem.schedule.StepSchedule`, the middle identical
       units as one :class:`~trainmem.schedule.Repeat` (Note [Composing the full depth],
       ``trainmem.trace.compose``), so an 80-layer model traces like a 5-layer one. The driver
       (``trainmem.estimate.finish``) takes it from there, like the other engines' schedules.
    Where the stream does not split into identical units, the whole model is traced instead and
    the estimate's notes say so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import NotApplicableError, TraceError, UnsupportedError
from trainmem.schedule import StepSchedule
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import REMOTE_CODE_LOSS_IN_LOGITS_DTYPE, REMOTE_CODE_OWN_LOSS
from trainmem.specs.ranks import RankMap, fsdp1_framework
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

from trainmem.specs.hardware import DEFAULT_CUBLAS_WORKSPACE_BYTES  # noqa: E402
from trainmem.trace.blocks import Run, truncate  # noqa: E402
from trainmem.trace.compose import (  # noqa: E402
    CompositionError,
    compose,
    count_parameters,
    trainable_params,
)
from trainmem.trace.engine import (  # noqa: E402
    _estimate,
    default_forward_loss,
    run_trace,
)
from trainmem.trace.module_paths import clean_module_path  # noqa: E402
from trainmem.trace.prefix import (  # noqa: E402
    prepended_tokens,
    refuse_prefix_tuning,
    with_prompt_labels,
)

__all__ = ["Recipe", "estimate_generic", "recipe_for_config", "trace_generic"]

_TRUNCATED_DETAILS = (
    "peak_allocated_bytes",
    "peak_op",
    "peak_module",
    "peak_by_category_bytes",
    "phase_peaks_bytes",
    "activation_bytes_by_module",
    "peak_contributors",
    "num_events",
    "host_optimizer_state_bytes",
)
"""Trace details that describe the cut model, not the full one (dropped)."""


@dataclass(frozen=True)
class Recipe:
    """How to build and feed a model for the generic path.

    Attributes:
        name: label of the result.
        build: returns the full model (called under ``torch.device("meta")``), LoRA applied.
        make_batch: ``make_batch(model) -> batch`` (dict of kwargs, tuple or tensor), called
            inside the fake mode.
        loss_fn: ``loss_fn(output, batch) -> scalar``; None reads ``output.loss``.
        forward_loss: ``forward_loss(model, batch) -> loss`` replacing forward + loss, or None.
        library: what builds it, for the notes.
        resident: frozen models held on the GPU beside it (``run_trace``'s ``resident``).
        hold_output: the loop binds each micro-batch's output through its backward
            (``run_trace``'s ``hold_output``; litgpt).
        batch_notes: what ``make_batch`` says about the batch it built (a vision-language
            model's image), for the estimate's notes.
    """

    name: str
    build: Callable[[], Any]
    make_batch: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], Any] | None = None
    forward_loss: Callable[[Any, Any], Any] | None = None
    library: str = "transformers"
    resident: tuple[tuple[str, int, str], ...] = ()
    hold_output: bool = False
    batch_notes: list[str] = dataclasses.field(default_factory=list)


def recipe_for_config(
    name: str, raw: Mapping[str, Any], training: TrainingConfig, *, images: bool = True
) -> Recipe:
    """The recipe of a ``config.json``: transformers for a ``model_type``, diffusers for a
    ``_class_name`` without one (``trainmem.trace.diffusers_model``), timm for an
    ``architecture`` without either (``trainmem.trace.timm_model``).

    Args:
        name: the model's name for reports.
        raw: the parsed config.
        training: the settings (dropout, attention, dtype, LoRA, sequence length...).
        images: False: a vision-language model trains on text only.

    Returns:
        The :class:`Recipe`.

    Raises:
        UnsupportedError: a diffusers config while the diffusers builder is not available.
        NotApplicableError: a language model's option (litgpt, a padded token batch, a loss on
            token logits) on a diffusers or timm model.
    """
    from trainmem.specs.diffusers import frozen_components, is_diffusers_config
    from trainmem.specs.hf import is_timm_config

    if training.framework == "litgpt" and (is_timm_config(raw) or is_diffusers_config(raw)):
        raise NotApplicableError(
            "framework=litgpt: litgpt trains its own GPT language models, and this is a "
            "diffusers / timm model; use --framework pytorch-amp"
        )
    if training.framework == "megatron":
        from trainmem.trace.megatron_loss import megatron_model_refusal

        why = (
            "framework=megatron: Megatron-LM trains decoder-only language models (megatron-"
            "core's GPTModel), and this is a diffusers / timm model; use --framework "
            "pytorch-amp, fsdp2 or deepspeed"
            if is_timm_config(raw) or is_diffusers_config(raw)
            else megatron_model_refusal(raw)
        )
        if why:
            raise NotApplicableError(why)
    if training.padding_mask and (is_timm_config(raw) or is_diffusers_config(raw)):
        raise NotApplicableError(
            "padding_mask=True: a padded batch's attention mask is built for a language "
            "model's token inputs; a diffusers or timm model takes none: leave it off"
        )
    if training.loss not in (None, "cross-entropy") and is_diffusers_config(raw):
        raise NotApplicableError(
            f"loss={training.loss} is computed on a language model's logits; a diffusers model "
            "trains with its example scripts' loss on the prediction: leave --loss unset"
        )
    if training.loss not in (None, "cross-entropy") and is_timm_config(raw):
        raise NotApplicableError(
            f"loss={training.loss} is computed on a language model's token logits; a timm "
            "model trains with its classification cross-entropy: leave --loss unset"
        )
    if is_timm_config(raw):
        from trainmem.trace import timm_model as tm

        tm.check_timm_settings(training)
        told: list[str] = []
        return Recipe(
            name,
            lambda: tm.build_timm_model(raw, training),
            lambda model: tm.make_timm_batch(model, training, told),
            forward_loss=tm.timm_forward_loss,
            library="timm",
            batch_notes=told,
        )
    if is_diffusers_config(raw):
        try:
            from trainmem.trace import diffusers_model as dm
        except ImportError as exc:
            raise UnsupportedError(
                f"{raw.get('_class_name')!s:.80} is a diffusers model; this version of trainmem "
                "has no diffusers builder (trainmem.trace.diffusers_model)"
            ) from exc
        dm.check_diffusers_settings(training, generic=True)
        dm.diffusers_class(raw)  # a class that is not a denoiser is refused before the build
        if training.controlnet or training.train_text_encoder:
            return _pipeline_recipe(name, raw, training)
        from trainmem.trace.frozen_encode import encode_in_step

        loss = dm.diffusers_loss_for(raw)
        return Recipe(
            name,
            lambda: dm.build_diffusers_model(raw, training, device="meta"),
            lambda model: dm.make_diffusers_batch(model, training),
            loss_fn=loss,
            # Note [The frozen VAE encodes inside the step]
            forward_loss=encode_in_step(raw, training, loss),
            library="diffusers",
            resident=tuple(frozen_components(raw, training)),
        )
    from trainmem.trace.hf_model import build_hf_training_model, hf_loss, make_hf_batch
    from trainmem.trace.remote_code import remote_code_loss, remote_code_upcast_loss

    if training.framework == "litgpt":
        return _litgpt_recipe(name, raw, training)
    if training.recipe_loss not in (None, "cross-entropy"):  # cross-entropy: the model's own
        return _own_loss_recipe(name, raw, training)
    said: list[str] = []
    forward_loss = default_forward_loss(training)
    # a remote-code family's own loss (Qwen-1's on its 16-bit logits, ChatGLM's on their fp32
    # copy), not the stand-in's, where the model's own loss runs (as analytic/loss.py
    # model_loss_in_logits_dtype and shifted_logits_bytes)
    own_loss = (
        forward_loss is None
        and training.conventions.hf_model_code
        and raw.get("model_type") in REMOTE_CODE_OWN_LOSS
    )
    remote_loss = (
        remote_code_loss
        if raw.get("model_type") in REMOTE_CODE_LOSS_IN_LOGITS_DTYPE
        else remote_code_upcast_loss
    )

    def batch(model: Any) -> Any:
        out = _padded(
            make_hf_batch(
                model,
                training.micro_batch_size,
                training.seq_len,
                training.target_seq_len,
                training.image_size,
                said,
                images,
            ),
            training,
        )
        if own_loss:
            out.pop("labels", None)
        return out

    return Recipe(
        name,
        lambda: build_hf_training_model(raw, training),
        batch,
        # peft pads the labels of the prompts it prepends (with_prompt_labels), here the ids
        loss_fn=with_prompt_labels(remote_loss, training) if own_loss else hf_loss,
        forward_loss=forward_loss,
        batch_notes=said,
    )


def _litgpt_recipe(name: str, raw: Mapping[str, Any], training: TrainingConfig) -> Recipe:
    """litgpt's own ``GPT`` for the config's shape, its forward and loss as its recipes run
    them (Note [litgpt's training step], ``trace/litgpt_model.py``).

    Raises:
        UnsupportedError: litgpt is not installed (naming how:
            :data:`~trainmem.specs.frameworks.LITGPT_INSTALL`),
            or the model is not one litgpt's ``GPT`` is built for here.
    """
    from trainmem.specs.hf import model_spec_from_hf

    try:
        from trainmem.trace import litgpt_model as lm

        lm.require_litgpt()
    except ImportError as exc:
        raise UnsupportedError(str(exc)) from exc
    lm.check_litgpt_release(training)
    spec = model_spec_from_hf(raw, name)
    lm.litgpt_config_kwargs(spec, training)  # an unmapped model is refused before the build
    return Recipe(
        name,
        lambda: lm.build_litgpt_model(spec, training),
        lambda model: lm.make_litgpt_batch(model, training),
        loss_fn=lm.litgpt_loss,
        library="litgpt",
        # litgpt's loop binds ``logits = model(...)`` (through the backward at least, as the
        # formulas' ``logits_fp32_output`` head term holds them, whatever the loop setting)
        hold_output=True,
    )


def _pipeline_recipe(name: str, raw: Mapping[str, Any], training: TrainingConfig) -> Recipe:
    """A diffusers denoiser trained with more of its pipeline inside the step: a ControlNet
    beside it (Note [ControlNet training step], Note [FLUX and SD3 ControlNet training steps],
    ``trace/controlnet.py``) or its text encoders (Note [Text-encoder training step],
    ``trace/text_encoders.py``); the scripts' loss (``diffusers_model.pipeline_loss``)."""
    from trainmem.specs.diffusers import frozen_components
    from trainmem.trace import controlnet as cn
    from trainmem.trace import diffusers_model as dm
    from trainmem.trace import text_encoders as te
    from trainmem.trace.frozen_encode import encode_in_step

    wrap: Callable[[Mapping[str, Any], Any, TrainingConfig], Any] = te.build_text_encoder_step
    batch: Callable[[Any, TrainingConfig], Any] = te.make_text_batch
    if training.controlnet:
        wrap, batch = cn.build_controlnet_step, cn.make_controlnet_batch
    loss = dm.pipeline_loss(raw, training)
    return Recipe(
        name,
        lambda: wrap(raw, dm.build_diffusers_model(raw, training, device="meta"), training),
        lambda step: batch(step, training),
        loss_fn=loss,
        # Note [The frozen VAE encodes inside the step] (a ControlNet's step)
        forward_loss=None if training.train_text_encoder else encode_in_step(raw, training, loss),
        library="diffusers",
        resident=tuple(frozen_components(raw, training)),
    )


def _padded(batch: Any, training: TrainingConfig) -> Any:
    """``batch`` with the [b, s] int64 ``attention_mask`` of a padded batch
    (``TrainingConfig.padding_mask``; the model then builds its [b, 1, s, s] mask, as the
    trace's mask patches are off: ``trainmem.trace.engine``); unchanged without padding."""
    if not training.padding_mask:
        return batch
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if ids is None:
        raise UnsupportedError(
            "padding_mask=True: a padded batch's attention mask is built for token inputs "
            "(input_ids); this model takes none, leave padding_mask off"
        )
    batch["attention_mask"] = torch.ones_like(ids)
    return batch


def _own_loss_recipe(name: str, raw: Mapping[str, Any], training: TrainingConfig) -> Recipe:
    """A transformers language model whose loss the loop computes on its logits
    (``TrainingConfig.recipe_loss``: ``logits-sum`` / ``logits-mean``, a profiling script's
    stand-in, the CS336 course's written-out cross-entropy, torchtune < 0.3's transposed one;
    ``trainmem.trace.course_model.course_loss``)
    instead of the model's own from the labels: the batch without ``labels``, the loss on
    ``output.logits`` and the token ids.

    Raises:
        UnsupportedError: with ``chunked_cross_entropy`` (its own loss), or a model whose batch
            has no token ids (the losses read token logits).
    """
    from trainmem.trace.course_model import course_loss
    from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch

    kind = str(training.recipe_loss)
    if training.chunked_cross_entropy:
        raise UnsupportedError(
            f"loss={kind} with chunked_cross_entropy: the chunked loss is a cross-entropy of "
            "its own; allowed: chunked_cross_entropy 0 or the model's own loss"
        )
    fn = course_loss(kind)
    if kind == "cs336-cross-entropy" and prepended_tokens(training):
        raise UnsupportedError(
            f"loss={kind} with prompt_learning={training.prompt_learning}: the course's "
            "cross-entropy gathers every target and has no ignored label for the prompts peft "
            "prepends (Note [Prefix tuning]); allowed: loss cross-entropy, "
            "transposed-cross-entropy, logits-sum or logits-mean, or prefix tuning"
        )

    def batch(model: Any) -> Any:
        out = make_hf_batch(
            model, training.micro_batch_size, training.seq_len, training.target_seq_len
        )
        if not isinstance(out, dict) or "input_ids" not in out:
            raise UnsupportedError(
                f"loss={kind} reads token logits, and {name} takes no input_ids; use the "
                "model's own loss (no --loss) on the generic path"
            )
        out.pop("labels", None)
        return out

    return Recipe(
        name,
        lambda: build_hf_training_model(raw, training),
        batch,
        loss_fn=with_prompt_labels(lambda output, b: fn(output.logits, b["input_ids"]), training),
    )


def trace_generic(
    recipe: Recipe,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None = None,
    copies: int | None = None,
    layout: RankMap | None = None,
) -> MemoryEstimate:
    """Trace a cut copy of the model and compose its full-depth step (Note [Generic path]).

    Args:
        recipe: how to build and feed the model.
        training: the step's settings.
        gpu: the GPU for the cuBLAS workspace size and the verdict.
        copies: units kept per run (default ``trainmem.trace.blocks.kept_units``: 5 single
            blocks, 7 under FSDP1, Note [FSDP1's gathers three layers on]).
        layout: the world's rank map (:func:`trainmem.specs.ranks.model_rank_map`); default
            one without the model's layer count.

    Returns:
        A draft :class:`~trainmem.breakdown.MemoryEstimate` (``engine="generic"``) whose
        ``schedules`` hold the composed step; :func:`trainmem.estimate.finish` completes it.

    Raises:
        UnsupportedError / TraceError: the model cannot be built or traced.
    """
    t0 = time.perf_counter()
    if training.pipeline_parallel_size > 1 and recipe.library == "transformers":
        from trainmem.trace.pipeline import estimate_pipeline

        est = estimate_pipeline(
            recipe.name, recipe.build, training, gpu=gpu, generic=True, copies=copies
        )
        est.notes[0] = (
            "generic path: each pipeline rank's stages built by transformers on fake tensors, a "
            "few layers per stage traced under torch.distributed.pipelining and repeated to "
            "full depth; requested sizes, the CUDA context and the NCCL communicators are "
            "added, not traced"
        )
        return est
    if training.pipeline_parallel_size > 1 and recipe.library in ("diffusers", "timm"):
        # Note [Pipeline stages cut by torch's frontend]
        from trainmem.trace.diffusers_pipeline import denoiser_inputs
        from trainmem.trace.frontend_pipeline import estimate_frontend_pipeline
        from trainmem.trace.timm_pipeline import timm_pipeline_inputs

        diffusers = recipe.library == "diffusers"
        inputs = denoiser_inputs(recipe) if diffusers else timm_pipeline_inputs()
        return estimate_frontend_pipeline(recipe, inputs, training, gpu=gpu)
    if recipe.library != "transformers":  # Note [Prefix tuning]: peft's, on transformers LMs
        refuse_prefix_tuning(training, f"a {recipe.library} model")
    with torch.device("meta"):
        model = recipe.build()
    n_all, n_train = count_parameters(model)
    runs = truncate(model, copies, reach=_reach(training))
    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES

    def traced(m: Any) -> tuple[Any, Any]:
        return run_trace(
            lambda: m,
            lambda: recipe.make_batch(m),
            training,
            loss_fn=recipe.loss_fn,
            workspace_bytes=ws,
            forward_loss=recipe.forward_loss,
            resident=recipe.resident,
            hold_output=recipe.hold_output,
        )

    notes: list[str] = []
    try:
        capture, report = traced(model)
        ran = capture.root if capture.root is not None else model  # (FSDP1's root wrapper)
        names = {clean_module_path(n) for n, _ in ran.named_modules(remove_duplicate=False)}
        schedule = compose(report.timeline, runs, trainable_params(ran), module_names=names)
    except (CompositionError, TraceError, IndexError, KeyError) as exc:
        if not runs:  # nothing was cut: the whole model's own failure
            raise
        # a forward that indexes its block list by the config's count, or a stream that does
        # not split into identical units: trace every block instead
        reason = " ".join(str(exc).split())[:160]
        notes.append(
            f"generic path: the cut model could not stand for the whole ({type(exc).__name__}: "
            f"{reason}); the whole model was traced instead"
        )
        with torch.device("meta"):
            full = recipe.build()
        capture, report = traced(full)
        schedule = StepSchedule.from_timeline(report.timeline)
        runs = []
    est = _estimate(recipe.name, capture, report, training, gpu, ws, layout)
    est.engine = "generic"
    est.num_parameters, est.num_trainable_parameters = n_all, n_train
    for k in _TRUNCATED_DETAILS:
        est.details.pop(k, None)
    # no wall time in the details: the same command gives byte-identical JSON
    est.details["generic"] = {"block_lists": _describe(runs), "library": recipe.library}
    logging.getLogger("trainmem").debug(
        "generic path for %s in %.3f s", recipe.name, time.perf_counter() - t0
    )
    est.recorded_timeline = None
    est.peak_reason = ""  # the cut model's; finish() names the full step's peak
    est.schedules = [schedule.with_lazy_optimizer_states()]
    est.notes = [
        "generic path: the model built by "
        + recipe.library
        + " on fake tensors, a few blocks per list traced and repeated to full depth; "
        "requested sizes, the CUDA context and the NCCL communicators are added, not traced",
        *dict.fromkeys(recipe.batch_notes),  # (the cut model's and the whole's batch: one)
        *notes,
    ]
    return est


def _reach(training: TrainingConfig) -> int:
    """The most layers between the one that allocates a tensor and the one that frees it, for
    the cut (``trainmem.trace.blocks.truncate``): 3 under FSDP1, else 2.

    Note [FSDP1's gathers three layers on]
        FSDP1's rate limiter (torch 2.13 distributed/fsdp/_limiter_utils.py
        ``_FreeEventQueue``, shared by every unit of the root) dequeues one free event per
        ``_unshard`` once two are queued, and the trace releases a layer's gathered flat
        parameter when its event is dequeued (Note [FSDP1 streams on the trace],
        trainmem/trace/fsdp.py). The backward's end enqueues three events (layer 0's and the
        root's reshards among them) that no unshard dequeues before the next step, so the
        steady-state step starts with three queued, and each unshard dequeues the one three
        reshards back: layer k's gather is freed at layer k + 3's unshard in the forward, and
        at layer k - 3's in the backward (traced on the 8-layer Qwen2 formula config, 4 ranks).
        With the default five kept units the repeated middle unit's gather is freed by no
        repeated unit (the full model would keep every middle layer's gather), so under FSDP1
        seven are kept: the middle one frees the gather three units back, the units after it
        those three units back (trainmem/trace/compose.py). NO_SHARD frees no gather: the
        same cut, which composes as well.
    """
    return 3 if fsdp1_framework(training) else 2


def _describe(runs: list[Run]) -> list[dict[str, Any]]:
    return [
        {
            "list": r.list_path,
            "first_block": r.first,
            "blocks_per_unit": r.unit,
            "units": r.reps,
            "units_traced": r.kept,
        }
        for r in runs
    ]


def _trace_config(
    name: str, raw: Mapping[str, Any], training: TrainingConfig, **where: Any
) -> MemoryEstimate:
    """:func:`trace_generic` of the config's recipe. A vision-language model whose step fails
    with the image trainmem built for it, no ``--resolution`` given, is traced on text only,
    and the notes say why (a forward that reads values the fake batch does not keep, such as
    a boolean index over the whole embedding); with ``--resolution`` the failure stands."""
    from trainmem.trace.hf_inputs import IMAGE_BATCH_NOTE

    recipe = recipe_for_config(name, raw, training)
    try:
        return trace_generic(recipe, training, **where)
    except TraceError as exc:
        imaged = any(n.startswith(IMAGE_BATCH_NOTE) for n in recipe.batch_notes)
        if not imaged or training.image_size is not None:
            raise
        reason = " ".join(str(exc).split())[:160]
    est = trace_generic(recipe_for_config(name, raw, training, images=False), training, **where)
    est.notes.append(
        "vision-language model: the batch is text only (input_ids), no image tokens: the step "
        f"with {recipe.batch_notes[-1][len(IMAGE_BATCH_NOTE) :].split(' (')[0]} failed on "
        f"fake tensors ({reason}); the vision tower gets no gradient"
    )
    return est


def estimate_generic(
    name: str,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None = None,
    copies: int | None = None,
    layout: RankMap | None = None,
) -> MemoryEstimate:
    """The generic path for a preset name, ``config.json`` path or folder.

    Args:
        name: what :func:`trainmem.specs.hf.load_hf_config` reads.
        training: the step's settings.
        gpu: the GPU for the verdict and the cuBLAS workspace size.
        copies: units kept per run (tests force fewer to exercise the repeat on short models).
        layout: the world's rank map (:func:`trainmem.specs.ranks.model_rank_map`); default
            one without the model's layer count.

    Returns:
        The draft estimate (see :func:`trace_generic`).
    """
    from trainmem.specs.diffusers import is_diffusers_config
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.remote_code import REMOTE_CODE_TYPES, stand_in_config

    raw = load_hf_config(name)
    try:
        est = _trace_config(name, raw, training, gpu=gpu, copies=copies, layout=layout)
        if is_diffusers_config(raw):
            from trainmem.trace.diffusers_model import describe_diffusers_batch

            describe_diffusers_batch(est, raw, training)
        if raw.get("model_type") in REMOTE_CODE_TYPES:
            stand_in = stand_in_config(raw)["architectures"][0]
            est.notes.append(
                f"remote-code model_type {raw.get('model_type')!r} traced as transformers' "
                f"{stand_in}, the class with the same tensors (Note [Remote-code stand-ins], "
                "trainmem/trace/remote_code.py); no remote code ran"
            )
        return est
    except UnsupportedError as exc:
        cause = str(exc.__cause__ or "")
        if training.attention == "eager" or "scaled_dot_product_attention" not in cause:
            raise
    # transformers has no SDPA path for this class (BLOOM's ALiBi, Mamba has no attention):
    # a real run of it uses eager attention, so the trace does too
    eager = dataclasses.replace(training, attention="eager")
    est = _trace_config(name, raw, eager, gpu=gpu, copies=copies, layout=layout)
    est.notes.append(
        "transformers has no SDPA attention for this model class; eager attention traced "
        "(--attention eager)"
    )
    return est
