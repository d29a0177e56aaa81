"""Pipeline parallelism cut by torch's own pipeline frontend (a diffusers denoiser, a timm ViT).

Note [Pipeline stages cut by torch's frontend]
    ``pipeline_parallel_size=p`` on a model whose blocks do not hand each other one residual
    stream alone runs the same machinery as a language model's (Note [Tracing pipeline
    parallelism] in trainmem/trace/pipeline.py: the rank map's layer split, one traced rank per
    distinct memory, the real ``torch.distributed.pipelining`` schedule over
    ``gradient_accumulation_steps`` micro-batches under the fake process group, the loss
    divided by their count, ``scale_grads=False``, the recorded ``schedule.step`` /
    ``optimizer.step`` / ``zero_grad``). What differs is how the stages are cut: by torch's
    tracer frontend, ``torch.distributed.pipelining.pipeline(model, mb_args, mb_kwargs,
    split_spec)`` (torch/distributed/pipelining/_IR.py: ``torch.export`` of the whole model on
    one micro-batch, split before the split points' modules, every tensor that crosses a cut
    passed as a stage output / input), with a ``SplitPoint.BEGINNING`` at the first block of
    each stage but the first. The blocks are the model kind's repeated blocks in model order
    (:class:`FrontendInputs` ``blocks``), split as :func:`~trainmem.specs.ranks.stage_layers`
    splits layers. The first stage holds what runs before its blocks (a patch embedding,
    embedders, a class token and position table), the last what runs after (the final norm,
    the output layers or head); ``_PipelineStage`` (``pipe.build_stage``) takes its receive
    buffers' shapes and dtypes from the exported graph. The step's inputs are the whole
    step's batch (``m x micro_batch_size`` samples), chunked along the batch by the schedule,
    tensors without a batch dimension replicated (``_Replicate``); the loss is the model
    kind's training loss on the last stage's output, its target chunked with the inputs.

    torch.export runs on the fake model (no weight is materialised); under autocast it is
    traced inside the autocast context, so the boundary dtypes are those of the autocast step.
    Not traced together with it (refused by name): activation checkpointing and compile
    (torch.export traces through them, the graph would not run them as the eager step does),
    tensor / context / data sharding (the exported stage modules are graph modules without
    the model's block names), the interleaved schedule, and what the model kind refuses
    beside it (:class:`FrontendInputs` ``beside``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from trainmem.errors import TraceError, UnsupportedError
from trainmem.specs.ranks import rank_map, stage_layers
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["FrontendInputs", "check_frontend_pipeline", "estimate_frontend_pipeline"]


@dataclasses.dataclass(frozen=True)
class FrontendInputs:
    """How a model kind is fed to torch's pipeline frontend (Note [Pipeline stages cut by
    torch's frontend]).

    Attributes:
        kind: the model kind, for messages (``"a diffusers model"``).
        blocks: ``blocks(model)``: the repeated blocks in model order, each stage but the
            first cut before its first block.
        make_batch: ``make_batch(model, training)``: one batch of ``training.micro_batch_size``
            samples (call inside the fake mode).
        forward_kwargs: ``forward_kwargs(batch)``: the model's keyword arguments.
        target_key: ``target_key(batch)``: the batch's key of the loss target.
        loss_fn: ``loss_fn(output, {target_key: target})``: the loss of one micro-batch.
        beside: ``beside(training)``: the model kind's own settings not traced beside it, as
            ``(what, on)`` pairs.
    """

    kind: str
    blocks: Callable[[Any], list[Any]]
    make_batch: Callable[[Any, TrainingConfig], dict[str, Any]]
    forward_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]]
    target_key: Callable[[Mapping[str, Any]], str]
    loss_fn: Callable[[Any, Any], Any]
    beside: Callable[[TrainingConfig], list[tuple[str, bool]]] = lambda _t: []


def check_frontend_pipeline(training: TrainingConfig, inputs: FrontendInputs) -> None:
    """Refuse what is not traced beside pipeline stages cut by torch's frontend (Note [Pipeline
    stages cut by torch's frontend]), naming the field and what runs instead.

    Args:
        training: the settings (``pipeline_parallel_size > 1``).
        inputs: the model kind's inputs (its own refusals in ``beside``).

    Raises:
        UnsupportedError: a setting not traced together with it.
    """
    t = training
    beside = [
        what
        for what, on in (
            (
                f"activation_checkpointing={t.activation_checkpointing}",
                t.activation_checkpointing != "none",
            ),
            ("compile", t.compile),
            (f"tensor_parallel_size={t.tensor_parallel_size}", t.tensor_parallel_size > 1),
            (f"context_parallel_size={t.context_parallel_size}", t.context_parallel_size > 1),
            (f"zero_stage={t.zero_stage}", t.zero_stage > 0),
            *inputs.beside(t),
            (f"pipeline_schedule={t.pipeline_schedule}", t.pipeline_schedule == "interleaved-1f1b"),
        )
        if on
    ]
    if beside:
        raise UnsupportedError(
            f"pipeline_parallel_size={t.pipeline_parallel_size} on {inputs.kind} is traced "
            "by torch's pipeline frontend (torch.export, split at the blocks), without "
            + ", ".join(beside)
            + "; traced: pipeline parallelism alone (1f1b or gpipe, with LoRA or not), or "
            "these settings without it"
        )


def _split_points(
    model: Any, training: TrainingConfig, inputs: FrontendInputs
) -> tuple[int, dict[str, Any]]:
    """(number of blocks, the split spec: the first block of every stage but the first)."""
    from torch.distributed.pipelining import SplitPoint

    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in inputs.blocks(model)]
    stages = stage_layers(len(blocks), training)
    if any(len(r) == 0 for r in stages):
        raise UnsupportedError(
            f"pipeline_parallel_size={training.pipeline_parallel_size}: {type(model).__name__} "
            f"has {len(blocks)} blocks, fewer than its stages; use fewer stages"
        )
    return len(blocks), {blocks[r.start]: SplitPoint.BEGINNING for r in stages[1:]}


def _chunk_specs(micro: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """Per input: split along dim 0 where the whole step's tensor holds every micro-batch's
    samples, else replicated (a tensor without a batch dimension)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    return {
        k: TensorChunkSpec(0) if whole[k].shape[0] != micro[k].shape[0] else _Replicate
        for k in whole
    }


def _trace_rank(
    recipe: Any,
    inputs: FrontendInputs,
    training: TrainingConfig,
    rank: Any,
    *,
    mesh: Any,
    workspace_bytes: int,
) -> Any:
    """One pipeline rank of the model built, split and traced (a
    :class:`~trainmem.trace.pipeline.RankTrace`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import pipeline, schedules

    from trainmem.trace.engine import _autocast_factory, _emulation
    from trainmem.trace.hf_model import materialize_fake
    from trainmem.trace.pipeline import (
        SCHEDULES,
        PipelineRun,
        RankTrace,
        capture_rank,
        signal_phases,
    )

    m = training.gradient_accumulation_steps
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.device("meta"):
        model = recipe.build()
    model.train()
    _, split_spec = _split_points(model, training, inputs)
    materialize_fake(model, fake_mode)
    autocast = _autocast_factory(training)
    whole_training = dataclasses.replace(training, micro_batch_size=m * training.micro_batch_size)
    with fake_mode:
        micro = inputs.make_batch(model, training)
        whole = inputs.make_batch(model, whole_training)
        try:
            # the step's own emulation (CUDA's autocast cast lists...), so that the graph's
            # dtypes are the recorded step's
            with _emulation(training, True), autocast() if autocast else contextlib.nullcontext():
                pipe = pipeline(model, mb_args=(), mb_kwargs=inputs.forward_kwargs(micro),
                                split_spec=split_spec)  # fmt: skip
        except Exception as exc:  # torch.export's refusals are of many kinds
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise TraceError(
                f"pipeline_parallel_size: torch.export could not trace {type(model).__name__} "
                f"for torch's pipeline frontend ({reason})"
            ) from exc
        pp_group = mesh.get_group()
        stages = [pipe.build_stage(s, torch.device("cpu"), pp_group) for s in rank.stages]
    for stage in stages:
        stage.group_rank = rank.rank  # as trainmem.trace.pipeline.build_schedule
    modules = torch.nn.ModuleDict(
        {f"stage{s}": st.submod for s, st in zip(rank.stages, stages, strict=True)}
    )
    first: Any = pipe.get_stage_module(0)
    names = [n.target for n in first.graph.nodes if n.op == "placeholder"]
    whole_kwargs = inputs.forward_kwargs(whole)
    missing = [k for k in names if not isinstance(whole_kwargs.get(k), torch.Tensor)]
    if missing:
        raise UnsupportedError(
            f"pipeline_parallel_size: {type(model).__name__}'s first stage takes "
            f"{', '.join(missing)}, which its batch does not hold as a tensor"
        )
    step_inputs = {k: whole_kwargs[k] for k in names}
    micro_kwargs = inputs.forward_kwargs(micro)
    key = inputs.target_key(micro)

    def loss_fn(output: Any, target: Any) -> Any:
        # torchtitan's rescale_accumulated_loss, as trainmem.trace.pipeline.build_schedule
        return inputs.loss_fn(output, {key: target}) / m

    cls = getattr(schedules, SCHEDULES[training.pipeline_schedule])
    schedule = cls(
        stages[0],
        m,
        loss_fn=loss_fn,
        kwargs_chunk_spec=_chunk_specs({k: micro_kwargs[k] for k in names}, step_inputs),
        scale_grads=False,
    )
    # every input of the step is the batch the recorder holds (INPUT), the target among them
    batch = {**step_inputs, key: whole[key]}
    run = PipelineRun(schedule, stages, batch, inputs=step_inputs, target=whole[key])
    signal_phases(run, autocast)
    traced = capture_rank(
        modules,
        run,
        training,
        fake_mode=fake_mode,
        emulate_cuda=True,
        workspace_bytes=workspace_bytes,
        mesh=None,
    )
    module_names = {n for n, _ in modules.named_modules(remove_duplicate=False)}
    return RankTrace(rank, 0, traced.capture, traced.report, [], traced.params, module_names)


def estimate_frontend_pipeline(
    recipe: Any, inputs: FrontendInputs, training: TrainingConfig, *, gpu: Any = None
) -> Any:
    """Trace every pipeline rank whose memory differs of a model cut by torch's pipeline
    frontend (Note [Pipeline stages cut by torch's frontend]); every block of a stage is
    traced.

    Args:
        recipe: the generic path's recipe (``trainmem.trace.generic.Recipe``: name, build).
        inputs: how the model kind is fed to the frontend.
        training: the settings (``pipeline_parallel_size > 1``).
        gpu: the GPU (cuBLAS workspace size, verdict).

    Returns:
        A draft :class:`~trainmem.breakdown.MemoryEstimate` with one schedule per traced rank.

    Raises:
        UnsupportedError: a setting not traced with it, or fewer blocks than stages.
        TraceError: torch.export or the step failed.
    """
    from trainmem.schedule import StepSchedule
    from trainmem.trace.compose import count_parameters
    from trainmem.trace.engine import DEFAULT_CUBLAS_WORKSPACE_BYTES
    from trainmem.trace.parallel import trace_mesh
    from trainmem.trace.pipeline import check_pipeline_settings, pipeline_estimate, pipeline_ranks

    check_pipeline_settings(training)
    check_frontend_pipeline(training, inputs)
    with torch.device("meta"):
        full = recipe.build()
    counts = count_parameters(full)
    num_blocks, split_spec = _split_points(full, training, inputs)
    balance = stage_balance_note(full, training, inputs, split_spec)
    del full
    layout = rank_map(training, num_blocks)
    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    traces, schedules = [], []
    with trace_mesh(training) as mesh:
        for rank in pipeline_ranks(layout):
            traced = _trace_rank(recipe, inputs, training, rank, mesh=mesh, workspace_bytes=ws)
            traces.append(traced)
            timeline = traced.report.timeline
            schedules.append(StepSchedule.from_timeline(timeline).with_lazy_optimizer_states())
    est = pipeline_estimate(
        recipe.name,
        training,
        layout,
        traces,
        schedules,
        gpu=gpu,
        workspace_bytes=ws,
        counts=counts,
        generic=True,
        few=False,
        notes=[],
    )
    est.notes[0] = (
        f"generic path: the {recipe.library} model exported by torch.export on fake tensors and "
        "split at its blocks by torch.distributed.pipelining's frontend, every block of each "
        "traced pipeline rank's stages traced under its schedule; requested sizes, the CUDA "
        "context and the NCCL communicators are added, not traced"
    )
    # what built the model, as the generic path records it: the assumptions name its library
    # (timm, diffusers) rather than transformers (trainmem.estimate assumed_of)
    est.details["generic"] = {"block_lists": [], "library": recipe.library}
    if balance:
        est.notes.append(balance)
    return est


def stage_balance_note(
    model: Any, training: TrainingConfig, inputs: FrontendInputs, split_spec: dict[str, Any]
) -> str | None:
    """What the estimate assumes of the stages' sizes when the model's blocks differ in size
    (MaxViT, Swin: wider blocks deeper in), else None: the stages are cut at equal block
    counts (:func:`_split_points`, as the rank map splits layers and torchtitan's
    ``pipeline_module_split`` its layers), not balanced by parameters, which torch's frontend
    would cut wherever told (``split_spec`` names any module). Each stage's parameters are
    those of the modules from its first block to the next stage's, in model order (the order
    ``torch.export`` runs them in timm's models), the stem on the first, the head on the last.
    """
    sizes = [sum(p.numel() for p in b.parameters()) for b in inputs.blocks(model)]
    if len(set(sizes)) < 2:
        return None
    stages = [0]
    for name, module in model.named_modules():
        if name in split_spec:
            stages.append(0)
        stages[-1] += sum(p.numel() for p in module.parameters(recurse=False))
    counts = [len(r) for r in stage_layers(len(sizes), training)]
    return (
        f"pipeline stages: {type(model).__name__}'s {len(sizes)} attention blocks differ in "
        f"size ({min(sizes):,} to {max(sizes):,} parameters) and are split by count "
        f"({' / '.join(map(str, counts))} per stage, as layers are), not by size: the stages "
        f"hold {' / '.join(f'{n:,}' for n in stages)} parameters; a split balanced by "
        "parameters (torch's frontend cuts at any module) is not modelled"
    )
