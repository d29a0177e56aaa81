"""One entry point for every engine: resolve the model and settings, run an engine, return a
:class:`~trainmem.breakdown.MemoryEstimate`. The CLI, the planner and Python users call this.

The analytic path imports no torch; ``engine="trace"`` imports it lazily.
"""

from __future__ import annotations

from typing import Literal

from trainmem.analytic.engine import estimate_analytic
from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError
from trainmem.specs.hardware import GPUSpec, get_gpu
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

Engine = Literal["analytic", "trace"]
ENGINES: tuple[str, ...] = ("analytic", "trace")

DEFAULT_SEQ_LEN_CAP = 4096
"""Default sequence length is the model's own context length, capped here (a Llama-3.1 user
planning a run rarely means 131,072 tokens per sequence unless they say so)."""


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a ``config.json`` path or folder, or a spec itself.

    Raises:
        SpecError / UnsupportedError: see :func:`trainmem.specs.hf.load_model_spec`.
    """
    return model if isinstance(model, ModelSpec) else load_model_spec(model)


def default_seq_len(model: ModelSpec) -> int:
    """The model's context length (``max_position_embeddings``) capped at
    :data:`DEFAULT_SEQ_LEN_CAP`; for ViT the value is unused (patches + 1)."""
    return min(model.max_position_embeddings, DEFAULT_SEQ_LEN_CAP)


def resolve_gpu(gpu: str | GPUSpec | None) -> GPUSpec | None:
    """A catalog GPU from its name (``"A100-80GB"``, ``"h100"``), a GPUSpec, or None."""
    if gpu is None or isinstance(gpu, GPUSpec):
        return gpu
    return get_gpu(gpu)


def estimate(
    model: str | ModelSpec,
    training: TrainingConfig | None = None,
    *,
    gpu: str | GPUSpec | None = None,
    engine: str = "analytic",
    cuda_context_bytes: int | None = None,
    alloc_conf: str = "",
) -> MemoryEstimate:
    """Peak GPU memory of one steady-state training step on one GPU.

    Args:
        model: preset name (``trainmem models``), path to a HF ``config.json`` or its folder,
            or a :class:`~trainmem.specs.model.ModelSpec`.
        training: micro-batch size, sequence length, precision, optimizer...; None for the
            defaults (sequence length :func:`default_seq_len`).
        gpu: catalog GPU for the fit verdict, or None.
        engine: ``analytic`` (closed form, instant) or ``trace`` (runs the real model on fake
            tensors; needs the ``trace`` extra).
        cuda_context_bytes: memory outside the allocator; default per
            :mod:`trainmem.specs.hardware`.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the caching-allocator simulator.

    Returns:
        The estimate; bytes throughout.

    Raises:
        SpecError: bad model, settings, GPU or engine name (message names the field).
        UnsupportedError: a model family the engine does not model.
    """
    spec = resolve_model(model)
    if training is None:
        training = TrainingConfig(seq_len=default_seq_len(spec))
    gpu_spec = resolve_gpu(gpu)
    if engine == "analytic":
        return estimate_analytic(
            spec, training, gpu=gpu_spec, cuda_context_bytes=cuda_context_bytes,
            alloc_conf=alloc_conf,
        )
    if engine == "trace":
        from trainmem.trace.engine import estimate_trace

        return estimate_trace(spec, training, gpu=gpu_spec)
    raise SpecError("engine", f"unknown value {engine!r}; allowed: {', '.join(ENGINES)}")
