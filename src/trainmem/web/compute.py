"""What the page computes: one estimate per page state (cached), and :func:`numbers`, the one
place that reads a :class:`~trainmem.breakdown.MemoryEstimate` for display.

Everything the page shows comes from :func:`trainmem.estimate.estimate` (analytic engine) and
``MemoryEstimate.to_dict()``; if a key of that dict is renamed, :func:`numbers` is the only line
to change. The planner (``fit`` / ``plan``) and the uncertainty band are called the way the CLI
calls them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import (
    ENGINES,
    default_attention_of,
    default_seq_len_of,
    estimate,
    image_sequence,
    lora_linears_of,
    resolve_model,
)
from trainmem.specs.hf import TIMM_PREFIX, list_presets
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import (
    TrainingConfig,
    check_framework_versions,
    check_training_for_model,
)
from trainmem.web.form import ALL_LINEAR, DEFAULT_ENGINE, NO_GPU, coerce, training_config

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, slots=True)
class Numbers:
    """The figures of one estimate the page shows; bytes are ints.

    Attributes:
        model: the model's name.
        breakdown_bytes: category -> bytes at the peak (``BREAKDOWN_KEYS`` order).
        allocated_bytes / reserved_bytes / device_total_bytes: the three peaks; reserved and
            device total are None when the simulated allocator runs out of memory.
        phase / reason: where the peak falls and why.
        fits: whether the step runs, None without a GPU.
        verdict: ``fits`` / ``tight`` / ``does not fit`` (``trainmem.uncertainty.VERDICTS``),
            None without a GPU.
        margin_bytes: usable capacity minus the device total (None without a GPU or on OOM).
        oom: PyTorch's out-of-memory message of the simulated allocator, or None.
        assumed: the framework and library versions the estimate stands for
            (``details["assumed"]``, :func:`trainmem.specs.assumptions.assumptions`).
        cuda_context_bytes: memory outside the allocator (CUDA context, NCCL).
        gpu_name / capacity_bytes: the GPU and its usable capacity (None without a GPU).
        per_rank: one dict per pipeline stage (``allocated_bytes``, ``num_layers``...).
        notes: the estimate's notes.
        load_phase: ``details.load_phase`` (loading the model before the step: its rule, peak
            allocated, reserved, out of memory; Note [The load phase]), or None without one.
    """

    model: str
    num_parameters: int
    num_trainable_parameters: int
    breakdown_bytes: dict[str, int]
    allocated_bytes: int
    reserved_bytes: int | None
    device_total_bytes: int | None
    phase: str
    reason: str
    fits: bool | None
    verdict: str | None
    margin_bytes: int | None
    oom: str | None
    cuda_context_bytes: int
    gpu_name: str | None
    capacity_bytes: int | None
    per_rank: list[dict[str, Any]]
    notes: list[str]
    assumed: dict[str, str]
    load_phase: dict[str, Any] | None = None


def numbers(est: MemoryEstimate) -> Numbers:
    """The page's figures from ``est.to_dict()`` (schema ``breakdown.SCHEMA_VERSION``)."""
    d = est.to_dict()
    peak, gpu = d["peak"], d["gpu"]
    return Numbers(
        model=d["model"],
        num_parameters=d["num_parameters"],
        num_trainable_parameters=d["num_trainable_parameters"],
        breakdown_bytes=dict(d["breakdown_bytes"]),
        allocated_bytes=peak["allocated_bytes"],
        reserved_bytes=peak["reserved_bytes"],
        device_total_bytes=peak["device_total_bytes"],
        phase=peak["phase"],
        reason=peak["reason"],
        fits=d["fits"],
        verdict=d["verdict"],
        margin_bytes=d["margin_bytes"],
        oom=peak["oom"],
        cuda_context_bytes=d["breakdown_bytes"]["cuda_context"],
        gpu_name=gpu["name"],
        capacity_bytes=gpu["capacity_bytes"],
        per_rank=list(d.get("per_rank") or []),
        notes=list(d["notes"]),
        assumed=dict(d["details"].get("assumed") or {}),
        load_phase=d["details"].get("load_phase"),
    )


@dataclass(frozen=True, slots=True)
class Request:
    """One resolved page state: what :func:`trainmem.estimate.estimate` is called with.

    Attributes:
        model: a preset name or hub id, or the ModelSpec of an uploaded config.json.
        model_arg: how the CLI command names the model.
        training: the validated settings.
        gpu: catalog name or a capacity (``32GB``, ``24GiB``), or None for no verdict.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the allocator simulator.
        engine: ``trainmem estimate --engine`` (:data:`trainmem.estimate.ENGINES`).
    """

    model: str | ModelSpec
    model_arg: str
    training: TrainingConfig
    gpu: str | None
    alloc_conf: str
    engine: str = DEFAULT_ENGINE


def resolve_request(values: Mapping[str, Any], uploaded: ModelSpec | str | None = None) -> Request:
    """The :class:`Request` of a values dict (``trainmem.web.form``).

    Args:
        values: the page state.
        uploaded: the spec of an uploaded config.json, or its path for a family without
            formulas (the generic path runs it); it replaces ``values["model"]``.

    Raises:
        SpecError: an unknown model or GPU, or a bad setting (the message names the field).
        UnsupportedError: a model family the analytic engine does not model.
    """
    if uploaded is not None:
        model: str | ModelSpec = uploaded
        model_arg = Path(uploaded if isinstance(uploaded, str) else uploaded.name).name
    else:
        name = str(values.get("model") or "").strip()
        presets = {p.lower(): p for p in list_presets()}
        name = presets.get(name.lower(), name)  # presets ignore case, as on the CLI
        timm = name.lower().startswith(TIMM_PREFIX)  # the CLI's timm:<name>
        if name not in presets.values() and not _HUB_ID.match(name) and not timm:
            raise SpecError(
                "model",
                f"{name!r} is not a preset; pick one from the list, give a Hugging Face hub "
                "id (org/name) or timm:<name>, or upload a config.json",
            )
        model = model_arg = name
    gpu = str(values.get("gpu") or NO_GPU).strip()
    engine = str(values.get("engine") or DEFAULT_ENGINE)
    if engine not in ENGINES:
        raise SpecError("engine", f"unknown value {engine!r:.80}; allowed: {', '.join(ENGINES)}")
    if coerce("lora_targets", values.get("lora_targets")) == (ALL_LINEAR,):
        values = {**values, "lora_targets": lora_linears_of(model)}  # as the CLI reads it
    training = training_config(
        values,
        default_seq_len=default_seq_len_of(model),
        default_attention=default_attention_of(
            model, coerce("transformers_version", values.get("transformers_version"))
        ),
    )
    # an image model's sequence as the CLI reads it: a vision encoder's patches at
    # --resolution; a seq_len typed in its box is refused, as --seq-len is
    given = coerce("seq_len", values.get("seq_len")) is not None
    training = image_sequence(model, training, given=given)
    # the checks the CLI makes where the options become a configuration
    # (trainmem.cli.options.training_from_options): a framework's release beside another
    # framework, and the settings against a formula family's shape (its LoRA linears)
    check_framework_versions(training)
    spec = _formula_spec(model)
    if spec is not None:
        check_training_for_model(spec, training)
    return Request(
        model=model,
        model_arg=model_arg,
        training=training,
        gpu=None if gpu == NO_GPU else gpu,
        alloc_conf=str(values.get("alloc_conf") or ""),
        engine=engine,
    )


def _formula_spec(model: str | ModelSpec) -> ModelSpec | None:
    """The model's shape, or None for a family only the generic path runs (as the CLI's
    ``model_spec_or_none``)."""
    try:
        return resolve_model(model)
    except UnsupportedError:
        return None


@lru_cache(maxsize=16)
def _cached(
    model: str | ModelSpec, training: TrainingConfig, gpu: str | None, alloc_conf: str, engine: str
) -> MemoryEstimate:
    return estimate(model, training, gpu=gpu, alloc_conf=alloc_conf, engine=engine)


def run(req: Request) -> MemoryEstimate:
    """The estimate of ``req`` by its engine (``auto``: the formulas where they cover the
    model, else the generic path; the last 16 are cached; do not mutate the result).

    Raises:
        SpecError / UnsupportedError: as :func:`trainmem.estimate.estimate`.
    """
    return _cached(req.model, req.training, req.gpu, req.alloc_conf, req.engine)


def fix_rows(req: Request, limit: int = 6) -> list[dict[str, Any]]:
    """``trainmem fit``: the cheapest changes that make the run fit (``Fix.to_dict()`` rows),
    [] when it fits or no GPU is chosen."""
    if req.gpu is None:
        return []
    from trainmem.planner.evaluate import require_gpu
    from trainmem.planner.fixes import fixes
    from trainmem.planner.traced import traced_fit, traced_run

    if isinstance(req.model, str) and traced_run(req.model, req.training):  # each one traced
        _, found = traced_fit(req.model, req.training, require_gpu(req.gpu), limit=min(limit, 3))
        return [f.to_dict() for f in found]
    return [f.to_dict() for f in fixes(req.model, req.training, req.gpu, limit=limit)]


def plan_rows(req: Request) -> list[dict[str, Any]]:
    """``trainmem plan``: the largest micro-batch size and sequence length that fit
    (``PlanResult.to_dict()`` rows); [] without a GPU."""
    if req.gpu is None:
        return []
    from trainmem.planner.evaluate import require_gpu
    from trainmem.planner.search import max_micro_batch_size, max_seq_len
    from trainmem.planner.traced import (
        traced_max_micro_batch_size,
        traced_only,
        traced_probe,
    )

    if isinstance(req.model, str) and traced_only(req.model):  # the micro-batch, traced
        gpu = require_gpu(req.gpu)
        probe = traced_probe(req.model, gpu)
        return [traced_max_micro_batch_size(req.training, gpu, probe).to_dict()]
    spec = resolve_model(req.model)
    rows = [max_micro_batch_size(spec, req.training, req.gpu).to_dict()]
    if spec.architecture != "vision-encoder":
        rows.append(max_seq_len(spec, req.training, req.gpu).to_dict())
    return rows


def timeline_points(est: MemoryEstimate, max_positions: int = 400) -> list[dict[str, Any]]:
    """Live bytes per category (and their total) over the steady-state step, for the
    interactive plot: one row per (position, series) with the GiB drawn, the exact bytes, the
    phase and the event at that position.

    Positions are grouped in at most ``max_positions`` buckets; each bucket keeps its position
    with the largest total, so the peak and every local spike wider than a bucket survive.
    Source: :func:`trainmem.report.plots.timeline_series` (what the static plot draws).
    """
    from trainmem.report.plots import timeline_series
    from trainmem.units import GiB

    if est.timeline is None or not len(est.timeline):
        return []
    data = timeline_series(est.timeline, reserved=False)
    total = data.total_bytes
    n = len(total)
    step = max(1, -(-n // max_positions))
    keep = [max(range(i, min(i + step, n)), key=total.__getitem__) for i in range(0, n, step)]
    series = {**data.live_bytes, "total": total}
    rows = []
    for x in keep:
        ev = data.events[x - 1] if x > 0 else None
        at = (
            f"{ev.action} {ev.size_bytes:,} B of {ev.category.value} in {ev.module or '-'}"
            if ev is not None
            else "state carried into the step"
        )
        phase = data.phases[x - 1] if x > 0 else "start"
        for name, values in series.items():
            rows.append(
                {
                    "event": x,
                    "memory": name,
                    "GiB": values[x] / GiB,
                    "bytes": f"{values[x]:,}",
                    "phase": phase,
                    "at": at,
                }
            )
    return rows


def band(est: MemoryEstimate) -> dict[str, Any]:
    """Low / expected / high device total from the benchmark's errors
    (:func:`trainmem.uncertainty.uncertainty_band`)."""
    from trainmem.uncertainty import uncertainty_band

    return uncertainty_band(est, metric="device_total")
