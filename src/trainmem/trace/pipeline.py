"""Pipeline parallelism traced with ``torch.distributed.pipelining``: one pipeline rank's stage
modules, the real schedule, one steady-state step under the recorder.

Note [Tracing pipeline parallelism]
    ``pipeline_parallel_size=p`` is traced as torchtitan runs it (``pipeline_llm``,
    torchtitan/distributed/pipeline_parallel.py; ``pipeline_module_split``):

    - Split: the model's layers go to stages as :func:`~trainmem.specs.ranks.stage_layers`
      says (torchtitan's or Megatron's split, the framework's convention;
      ``p * virtual_pipeline_stages`` stages for interleaved 1F1B, rank ``r`` running stages
      ``r, r + p, ...``; Note [One rank map] in :mod:`trainmem.specs.ranks`). A stage module
      keeps the transformers model with only its layers: the first stage keeps the token
      embedding, the last the final norm and ``lm_head`` (:class:`StageModule`; torchtitan sets
      the others to None, here the norm of a non-last stage is an ``nn.Identity`` and the
      embedding of a non-first one is skipped by passing ``inputs_embeds``, so transformers'
      own ``LlamaModel.forward`` runs the layers).
    - Each stage module is parallelized as a whole model (TP / SP, then FSDP2 with
      ``reshard_after_forward=False`` on the layers: torchtitan's ``apply_fsdp`` default under
      PP), after activation checkpointing and compile (applied to the whole model first).
    - ``torch.distributed.pipelining.PipelineStage`` per stage, with static input / output
      shapes (``input_args`` / ``output_args``; the boundary is the residual stream
      [b, s, h], sequence-sharded under SP as torchtitan hands local tensors between its
      modules), and the schedule torchtitan builds (``build_pipeline_schedule``):
      ``Schedule1F1B``, ``ScheduleGPipe`` or ``ScheduleInterleaved1F1B`` over
      ``n_microbatches = gradient_accumulation_steps`` micro-batches, the loss divided by it
      (``rescale_accumulated_loss``) and ``scale_grads=False``.
    - The pipeline process group is the ``pp`` dimension of the fake mesh (outermost, as
      torchtitan's ``ParallelDims``); sends and receives return at once (``FakeWork``), so the
      rank runs its own schedule alone. The warm-up vote that picks static vs dynamic shape
      inference (``_warmup_p2p``) receives nothing under the fake group, so the static mode the
      shapes allow is set directly (a real torchtitan run infers the same shapes at its first
      step).
    - The recorded step is ``schedule.step(...)``, ``optimizer.step()``, ``zero_grad()``:
      whatever the runtime keeps (``fwd_cache`` outputs, the last stage's ``output_chunks``
      and the merged copy ``step()`` returns, receive buffers, input gradients waiting to be
      sent, FSDP's unsharded gradients accumulated across micro-batches and reduced by
      ``perform_reduce_grad``) is allocated by torch's own code and recorded. What lives from
      one step to the next (the receive buffers made at the first step, the previous step's
      ``output_chunks``, cleared by ``clear_runtime_states`` at the next ``step()``) is
      registered as live after the warm-up.

    Ranks traced: the first and the last pipeline rank and the middle rank holding the most
    layers when it holds more than the first (ranks of other mesh dimensions of one stage hold
    the same shapes; Note [Tracing one rank of a mesh]).

    Context parallelism runs as torchtitan runs it under PP: ``context_parallel`` around the
    step shards the step's input ids and labels along the sequence in place, so every stage's
    static shapes, receive buffers and output chunks cover ``s / cp`` tokens.

    Not traced: LoRA with PP, the chunked loss, models that are
    not transformers causal LMs with ``model.embed_tokens`` / ``model.layers`` / ``model.norm``
    / ``lm_head``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.ranks import RankMap, rank_map
from trainmem.specs.training import TrainingConfig, check_torch_pipeline_microbatches
from trainmem.trace._torch import require_torch
from trainmem.trace.engine import megatron_loss_traced
from trainmem.trace.megatron_pipeline import drop_loss_graphs, free_sent_outputs

torch = require_torch()

__all__ = [
    "PipelineRank",
    "PipelineRun",
    "RankCapture",
    "RankTrace",
    "capture_rank",
    "pipeline_estimate",
    "signal_phases",
    "StageModule",
    "estimate_pipeline",
    "estimate_pipeline_trace",
    "check_pipeline_settings",
    "pipeline_ranks",
    "split_stages",
    "trace_pipeline_rank",
    "uses_pipeline",
]

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}
"""``pipeline_schedule`` -> class in ``torch.distributed.pipelining.schedules``."""


def uses_pipeline(training: TrainingConfig) -> bool:
    """True when the step is traced as a pipeline (``pipeline_parallel_size > 1``)."""
    return training.pipeline_parallel_size > 1


def check_pipeline_settings(training: TrainingConfig) -> None:
    """Refuse what the pipeline trace does not run, naming the field.

    Args:
        training: the settings.

    Raises:
        SpecError: fewer micro-batches than ``Schedule1F1B`` accepts.
        UnsupportedError: a setting not traced together with pipeline parallelism.
    """
    check_torch_pipeline_microbatches(training)
    for name, refused in (("chunked_cross_entropy", training.chunked_cross_entropy > 0),):
        if refused:
            raise UnsupportedError(
                f"{name}: the trace does not run it together with pipeline parallelism yet; "
                "use --engine analytic for this configuration"
            )


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline rank: its index and the stages it runs.

    Attributes:
        rank: pipeline rank (the ``pp`` coordinate).
        stages: stage indices it runs.
        layers: the layers of each of its stages.
        num_stages: stages of the whole pipeline.
    """

    rank: int
    stages: tuple[int, ...]
    layers: tuple[range, ...]
    num_stages: int

    @property
    def num_layers(self) -> int:
        """Layers the rank holds."""
        return sum(len(r) for r in self.layers)


def pipeline_ranks(layout: RankMap) -> list[PipelineRank]:
    """The pipeline ranks traced: the ranks whose memory differs (Note [One rank map] in
    :mod:`trainmem.specs.ranks`: first, last, and the first middle rank holding the most layers
    when it holds more than the first).

    Args:
        layout: the world's rank map, with the model's layer count.

    Returns:
        The ranks, ascending.
    """
    return [
        PipelineRank(
            r.pipeline_rank,
            r.stages,
            tuple(layers for layers in r.layers if layers is not None),
            len(layout.stages),
        )
        for r in layout.ranks
    ]


class StageModule(torch.nn.Module):  # type: ignore[misc,name-defined]
    """One pipeline stage of a transformers causal LM (Note [Tracing pipeline parallelism]).

    ``model`` is a shallow copy of the base model (``LlamaModel``-like) holding only the
    stage's layers; ``lm_head`` is the head on the last stage, else None. The forward takes
    ``input_ids`` [b, s] on the first stage, the residual stream [b, s, h] elsewhere (the
    local sequence shard [b, s / t, h] under sequence parallelism, made a ``DTensor`` again
    for the layers), and returns the residual stream, or the logits on the last stage.
    ``use_cache=False``: no transformers key/value cache in the stages (torchtitan's model
    keeps none; a pipelined training step never decodes).
    """

    pipeline_stage = True
    """Marks a stage for the tensor-parallel plan (an embedding / head may be absent)."""

    def __init__(self, causal_lm: Any, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        base = causal_lm.model
        body = copy.copy(base)  # its own child table: the stage's layers only
        body._modules = dict(base._modules)
        body.layers = torch.nn.ModuleList([base.layers[i] for i in layers])
        if not first:
            body.embed_tokens = None
        if not last:
            body.norm = torch.nn.Identity()
        self.model = body
        self.lm_head = causal_lm.lm_head if last else None
        self.config = causal_lm.config
        self.first, self.last = first, last
        self.sequence_mesh: Any = None  # the tp mesh under sequence parallelism

    def forward(self, x: Any) -> Any:
        """Run the stage on one micro-batch.

        Args:
            x: ``input_ids`` (first stage) or the previous stage's output.

        Returns:
            The residual stream (a local tensor) or the logits (last stage).
        """
        if self.first:
            out = self.model(input_ids=x, use_cache=False)
        else:
            if self.sequence_mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
            out = self.model(inputs_embeds=x, use_cache=False)
        h = out.last_hidden_state
        if self.lm_head is None:
            return h.to_local() if hasattr(h, "to_local") else h
        return self.lm_head(h)


def split_stages(causal_lm: Any, training: TrainingConfig, rank: PipelineRank) -> Any:
    """The stage modules of one pipeline rank, in a ``ModuleDict`` keyed ``stage<index>``.

    Args:
        causal_lm: the whole transformers causal LM (on ``meta``).
        training: the pipeline settings.
        rank: which rank.

    Returns:
        The ``nn.ModuleDict``.

    Raises:
        UnsupportedError: the model is not a causal LM with ``model.layers`` and ``lm_head``.
    """
    if getattr(causal_lm, "peft_config", None):
        # peft injects its adapters into the base model's linears in place: the stages are
        # cut from the base model, the adapted linears with them
        causal_lm = causal_lm.get_base_model()
    base = getattr(causal_lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        getattr(causal_lm, "lm_head", None) is None
        or base is None
        or not all(isinstance(getattr(base, n, None), torch.nn.Module) for n in needed)
    ):
        raise UnsupportedError(
            "pipeline_parallel_size: the trace splits transformers causal LMs shaped like Llama "
            "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head) into "
            f"stages; {type(causal_lm).__name__} is not one; use --engine analytic"
        )
    stages = {}
    for s, layers in zip(rank.stages, rank.layers, strict=True):
        stages[f"stage{s}"] = StageModule(
            causal_lm, layers, first=s == 0, last=s == rank.num_stages - 1
        )
    return torch.nn.ModuleDict(stages)


def boundary_dtype(training: TrainingConfig, stage: Any) -> Any:
    """dtype of the residual stream between stages: the compute dtype when FSDP2's
    mixed-precision policy casts the parameters (``trainmem.trace.fsdp``), else the dtype of
    the stage's weights (autocast keeps the residual additions in it)."""
    from trainmem.trace.fsdp import uses_fsdp

    if uses_fsdp(training) and (
        (training.framework == "fsdp2" and training.is_mixed) or training.is_fp8
    ):
        return getattr(torch, training.compute_dtype)
    return next(p for p in stage.parameters()).dtype


@dataclass
class PipelineRun:
    """The schedule of one rank and what it needs to run a step.

    Attributes:
        schedule: the ``torch.distributed.pipelining`` schedule.
        stages: the rank's ``PipelineStage`` objects.
        batch: ``{"input_ids", "labels"}`` of the whole step ([m * b, s]); a denoiser's:
            every input of the whole step (the recorder holds them as inputs).
        signal: where the phase callback of the step in progress is kept.
        return_outputs: ``schedule.step(return_outputs=...)``.
        inputs: the first stage's keyword inputs of the whole step, when they are not
            ``input_ids`` (a denoiser's or a ViT's, ``trainmem.trace.frontend_pipeline``).
        target: the last stage's loss target of the whole step then.
    """

    schedule: Any
    stages: list[Any]
    batch: dict[str, Any]
    signal: list[Callable[[str], None]] = field(default_factory=lambda: [lambda _p: None])
    return_outputs: bool = True
    inputs: dict[str, Any] | None = None
    target: Any = None

    def runtime_state(self) -> list[tuple[Any, MemoryCategory, str]]:
        """What the runtime keeps between steps (Note [Tracing pipeline parallelism])."""
        out: list[tuple[Any, MemoryCategory, str]] = []
        for st in self.stages:
            for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
                for info in infos:
                    if getattr(info, "buffer", None) is not None:
                        out.append((info.buffer, MemoryCategory.TEMPORARY, "pipeline"))
            flat, _ = torch.utils._pytree.tree_flatten(list(st.output_chunks))
            out += [(t, MemoryCategory.ACTIVATION, "pipeline") for t in flat if _is_tensor(t)]
        return out


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def build_schedule(
    stage_modules: Any,
    rank: PipelineRank,
    training: TrainingConfig,
    pp_group: Any,
    loss_function: Callable[..., Any],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None,
) -> PipelineRun:
    """``PipelineStage`` objects and the schedule of one rank, with phase signals around each
    micro-batch's forward (and loss) and backward. Call inside the fake mode.

    Args:
        stage_modules: :func:`split_stages`'s, parallelized.
        rank: the pipeline rank.
        training: micro-batch, sequence, micro-batch count, schedule.
        pp_group: the pipeline process group.
        loss_function: ``loss_function(logits=, labels=, vocab_size=)`` (transformers').
        autocast: factory of the autocast context of forward + loss, or None.

    Returns:
        The :class:`PipelineRun`.
    """
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining.stage import InferenceMode  # type: ignore[attr-defined]

    b, m = training.micro_batch_size, training.gradient_accumulation_steps
    s = training.seq_len // training.context_parallel_size  # the rank's sequence shard
    tp = training.tensor_parallel_size
    local_s = s // tp if training.sequence_parallel else s
    stages = []
    for index, module in zip(rank.stages, stage_modules.values(), strict=True):
        h = module.config.hidden_size
        dtype = boundary_dtype(training, module)
        # example tensors for the static shapes; requires_grad: a gradient flows back through
        # them (pipelining derives the gradient receive buffers from it)
        boundary = torch.empty(b, local_s, h, dtype=dtype, requires_grad=True)
        inputs = torch.empty(b, s, dtype=torch.long) if module.first else boundary
        if module.last:
            vocab = -(-module.config.vocab_size // tp)
            compute = getattr(torch, training.compute_dtype)
            outputs = torch.empty(b, s, vocab, dtype=compute, requires_grad=True)
        else:
            outputs = boundary
        stage = PipelineStage(
            module,
            index,
            rank.num_stages,
            torch.device("cpu"),
            input_args=inputs,
            output_args=outputs,
            group=pp_group,
        )
        # the process runs as pp rank 0 for every traced rank (one fake group, one mesh: DTensor
        # caches compare meshes without their groups); the schedule reads the rank from here
        stage.group_rank = rank.rank
        if training.conventions.pipeline_sent_outputs_freed:
            free_sent_outputs(stage)  # Note [Megatron's stage buffers in the trace]
        stages.append(stage)
    vocab_size = next(iter(stage_modules.values())).config.vocab_size

    def loss_fn(logits: Any, labels: Any) -> Any:
        # torchtitan: rescale_accumulated_loss(loss_fn, n_microbatches)
        return loss_function(logits=logits, labels=labels, vocab_size=vocab_size) / m

    cls = getattr(schedules, SCHEDULES[training.pipeline_schedule])
    single = training.pipeline_schedule != "interleaved-1f1b"
    schedule = cls(stages[0] if single else stages, m, loss_fn=loss_fn, scale_grads=False)

    def static_shapes(stages_: list[Any], *_: Any) -> None:
        for st in stages_:
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static_shapes
    if training.conventions.pipeline_sent_outputs_freed:
        drop_loss_graphs(schedule, stages)  # Note [Megatron's stage buffers in the trace]
    # Note [Megatron's last pipeline stage]: GPTModel returns the loss, no logits are kept
    run = PipelineRun(schedule, stages, {}, return_outputs=not megatron_loss_traced(training))
    signal_phases(run, autocast)
    # the whole sequence: context parallelism shards the batch in place (context_parallel)
    ids = torch.randint(0, vocab_size, (m * b, training.seq_len))
    run.batch = {"input_ids": ids, "labels": ids.clone()}
    return run


def signal_phases(
    run: PipelineRun, autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None
) -> None:
    """Phase signals around each micro-batch's forward (and loss, under ``autocast``) and
    backward of ``run``'s stages and schedule, in place."""
    schedule, stages = run.schedule, run.stages
    amp = autocast or contextlib.nullcontext

    def region(fn: Callable[..., Any], start: str, end: str, cast: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            run.signal[0](start)
            with amp() if cast else contextlib.nullcontext(), warnings.catch_warnings():
                # under SP a non-last stage returns DTensor.to_local() of its last layer's
                # output, a view; torchtitan's layers hand local tensors around, and its stage
                # returns the residual addition itself: same storage, no warning there
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* view tensor")
                out = fn(*args, **kwargs)
            run.signal[0](end)
            return out

        return wrapped

    for st in stages:
        st.forward_one_chunk = region(  # type: ignore[method-assign]
            st.forward_one_chunk, "forward", "forward_end", True
        )
        st.backward_one_chunk = region(  # type: ignore[method-assign]
            st.backward_one_chunk, "backward", "backward_end", False
        )
    schedule._maybe_compute_loss = region(
        schedule._maybe_compute_loss, "forward", "forward_end", True
    )


@contextlib.contextmanager
def _named_fsdp_groups() -> Iterator[None]:
    """Name the module of each FSDP2 group while pipelining runs its collectives outside any
    forward and autograd node, so the recorder would see no module: ``perform_reduce_grad``'s
    post-backward (reduce-scatter of the gradients accumulated over the micro-batches), and
    the ``UNSHARD`` actions of the runtime schedules (interleaved 1F1B: ``submodule.unshard(
    async_op=True)`` per FSDP module of a stage, waited on before the stage computes,
    torch/distributed/pipelining/schedules.py ``_PipelineScheduleRuntime._step_microbatches``),
    whose all-gathered parameters must belong to their layer for the few-layer composition to
    repeat them (Note [Composing the full depth])."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from trainmem.trace.module_paths import ModulePathTracker

    originals = {
        name: getattr(FSDPParamGroup, name)
        for name in ("post_backward", "unshard", "wait_for_unshard")
    }

    def named(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            tracker = ModulePathTracker.active
            if tracker is None or not self.modules:
                return original(self, *args, **kwargs)
            with tracker.inside(self.modules[0]):
                return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(FSDPParamGroup, name, named(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(FSDPParamGroup, name, original)


def pipeline_step(
    run: PipelineRun, optimizer: Any, *, set_to_none: bool = True
) -> Callable[[Callable[[str], None] | None], None]:
    """One training step of a pipeline rank, as torchtitan's ``train_step`` runs it under PP:
    ``schedule.step`` (input ids on the first stage, labels and a loss list on the last), then
    ``optimizer.step()`` and ``zero_grad``.

    Args:
        run: :func:`build_schedule`'s.
        optimizer: the optimizer over the rank's parameters.
        set_to_none: ``zero_grad(set_to_none=...)``.

    Returns:
        ``step(on_phase)`` for :func:`trainmem.trace.capture.capture_step`.
    """
    first = any(st.is_first for st in run.stages)
    last = any(st.is_last for st in run.stages)

    def step(on_phase: Callable[[str], None] | None) -> None:
        signal = on_phase or (lambda _phase: None)
        run.signal[0] = signal
        lm = run.inputs is None  # a language model: token ids in, labels as the target
        args = (run.batch["input_ids"],) if first and lm else ()
        kwargs = run.inputs if first and not lm else {}
        target = (run.batch["labels"] if lm else run.target) if last else None
        losses: list[Any] | None = [] if last else None
        with _named_fsdp_groups():
            run.schedule.step(
                *args,
                target=target,
                losses=losses,
                return_outputs=run.return_outputs,
                **(kwargs or {}),
            )
        del losses
        signal("optimizer")
        optimizer.step()
        signal("zero_grad")
        optimizer.zero_grad(set_to_none=set_to_none)
        signal("end")
        run.signal[0] = lambda _phase: None

    return step


@dataclass
class RankTrace:
    """One pipeline rank traced.

    Attributes:
        rank: the pipeline rank.
        global_rank: the rank it plays in the traced mesh (other mesh coordinates 0).
        capture: the recorded step.
        report: its timeline and peak.
        runs: the block runs cut in its stage modules (generic path), else empty.
        params: the trainable parameters of the (cut) stage modules in optimizer order
            (``trainmem.trace.compose.ParamInfo``).
        module_names: module paths of the stage modules.
    """

    rank: PipelineRank
    global_rank: int
    capture: Any
    report: Any
    runs: list[Any]
    params: list[Any]
    module_names: set[str]


def trace_pipeline_rank(
    build_model: Callable[[], Any],
    training: TrainingConfig,
    rank: PipelineRank,
    *,
    fake: bool = True,
    emulate_cuda: bool = True,
    workspace_bytes: int,
    cut: Callable[[Any], list[Any]] | None = None,
    mesh: Any,
) -> RankTrace:
    """Build one pipeline rank's stages and record its steady-state step (Note [Tracing
    pipeline parallelism]).

    Args:
        build_model: returns the whole transformers causal LM (called on ``meta`` when
            ``fake``).
        training: the settings.
        rank: which pipeline rank.
        fake: False runs real CPU tensors.
        emulate_cuda: CUDA kernels' allocations and the cuBLAS workspaces.
        workspace_bytes: one cuBLAS workspace.
        cut: ``cut(stage_modules) -> runs`` cuts the stages' layer lists (generic path).
        mesh: the device mesh of :func:`trainmem.trace.parallel.trace_mesh` as rank 0, shared
            by every pipeline rank traced (see :func:`build_schedule`).

    Returns:
        The :class:`RankTrace`.

    Raises:
        TraceError: the step failed.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.compile import compile_layers
    from trainmem.trace.engine import (
        _autocast_factory,
        _maybe_float8,
        _torch_dtype,
        apply_activation_checkpointing,
    )
    from trainmem.trace.hf_model import materialize_fake
    from trainmem.trace.parallel import mesh_size, parallelize

    check_pipeline_settings(training)
    # the rank this process plays in the traced mesh (pp outermost)
    global_rank = rank.rank * (mesh_size(training) // training.pipeline_parallel_size)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    with torch.device("meta") if fake else contextlib.nullcontext():
        full = build_model()
    loss_function = full.loss_function
    if megatron_loss_traced(training):  # Note [Megatron's last pipeline stage]
        from trainmem.trace.megatron_loss import megatron_loss

        loss_function = megatron_loss
    full.train()
    apply_activation_checkpointing(
        full, training.activation_checkpointing, reentrant=training.layer_checkpoint_reentrant
    )
    stages = split_stages(full, training, rank)
    runs = cut(stages) if cut is not None else []
    if fake_mode is not None:
        materialize_fake(stages, fake_mode)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx:
        _maybe_float8(stages, training)
    if not fake and training.weight_dtype != "float32":
        stages.to(_torch_dtype(training.weight_dtype))
    stages.train()
    names = mesh.mesh_dim_names or ()
    for module in stages.values():
        if training.compile:
            compile_layers(module, checkpointing=training.activation_checkpointing)
        parallelize(module, mesh, training, fake_mode)
        if training.sequence_parallel:
            module.sequence_mesh = mesh["tp"]
    pp_mesh = mesh["pp"] if len(names) > 1 else mesh
    module_names = {n for n, _ in stages.named_modules(remove_duplicate=False)}
    with ctx:
        run = build_schedule(
            stages,
            rank,
            training,
            pp_mesh.get_group(),
            loss_function,
            _autocast_factory(training),
        )
    traced = capture_rank(
        stages,
        run,
        training,
        fake_mode=fake_mode,
        emulate_cuda=emulate_cuda,
        workspace_bytes=workspace_bytes,
        mesh=mesh,
    )
    return RankTrace(
        rank, global_rank, traced.capture, traced.report, runs, traced.params, module_names
    )


@dataclass
class RankCapture:
    """One pipeline rank's recorded step (:func:`capture_rank`)."""

    capture: Any
    report: Any
    params: list[Any]


def capture_rank(
    stages: Any,
    run: PipelineRun,
    training: TrainingConfig,
    *,
    fake_mode: Any,
    emulate_cuda: bool,
    workspace_bytes: int,
    mesh: Any,
) -> RankCapture:
    """The optimizer over a rank's stage modules and its recorded steady-state step (Note
    [Tracing pipeline parallelism]).

    Args:
        stages: the rank's stage modules (an ``nn.ModuleDict``), parallelized.
        run: their schedule (:func:`build_schedule`, or a denoiser's).
        training: the settings.
        fake_mode: the ``FakeTensorMode`` of the tensors, or None for real tensors.
        emulate_cuda: CUDA kernels' allocations and the cuBLAS workspaces.
        workspace_bytes: one cuBLAS workspace.
        mesh: the traced device mesh (context parallelism around the step).

    Returns:
        The capture, its peak report and the trainable parameters
        (``trainmem.trace.compose.ParamInfo``).

    Raises:
        TraceError: the step failed.
    """
    from trainmem.errors import TraceError
    from trainmem.trace.capture import capture_step
    from trainmem.trace.compose import trainable_params
    from trainmem.trace.engine import _stacked, _step_context, peak_report
    from trainmem.trace.optimizers import build_optimizer
    from trainmem.trace.parallel import context_parallel

    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        params = [p for p in dict.fromkeys(stages.parameters()) if p.requires_grad]
        opt = build_optimizer(params, training)
    infos = trainable_params(stages)
    fused = bool(opt.defaults.get("fused")) if hasattr(opt, "defaults") else False
    fake = fake_mode is not None
    try:
        capture = capture_step(
            stages,
            [run.batch],
            opt,
            fake_mode=fake_mode,
            host_optimizer_step=emulate_cuda,
            fused=fused,
            context=lambda: _stacked(
                _step_context(training, emulate_cuda, opt if fake else None),
                context_parallel(mesh, [run.batch], training),
            ),
            step=pipeline_step(run, opt, set_to_none=bool(training.zero_grad_set_to_none)),
            runtime_state=run.runtime_state,
        )
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as exc:
        if isinstance(exc, (UnsupportedError, SpecError)):
            raise
        raise TraceError(f"the traced pipeline step failed: {type(exc).__name__}: {exc}") from exc
    report = peak_report(capture, emulate_cuda, workspace_bytes)
    return RankCapture(capture, report, infos)


_RANK_DETAILS = (
    "peak_allocated_bytes",
    "peak_op",
    "peak_module",
    "peak_by_category_bytes",
    "phase_peaks_bytes",
    "activation_bytes_by_module",
    "peak_contributors",
    "num_events",
)
"""Trace details of one traced rank (dropped: the driver reports the most loaded one)."""


def _trace_rank(
    build_model: Callable[[], Any],
    training: TrainingConfig,
    rank: PipelineRank,
    workspace_bytes: int,
    mesh: Any,
    cut_layers: bool,
    copies: int | None,
    notes: list[str],
) -> tuple[RankTrace, Any]:
    """One rank's trace and step schedule: composed to full depth from a few layers per stage
    (``cut_layers``), or the whole stages' recorded stream; a composition that fails falls back
    to the whole stages, with a note."""
    from trainmem.schedule import StepSchedule
    from trainmem.trace.blocks import truncate
    from trainmem.trace.compose import CompositionError, compose

    def cut(stages: Any) -> list[Any]:
        return truncate(stages, copies)

    traced = trace_pipeline_rank(
        build_model,
        training,
        rank,
        workspace_bytes=workspace_bytes,
        cut=cut if cut_layers else None,
        mesh=mesh,
    )
    if traced.runs:
        try:
            schedule = compose(
                traced.report.timeline,
                traced.runs,
                traced.params,
                module_names=traced.module_names,
            )
            return traced, schedule.with_lazy_optimizer_states()
        except CompositionError as exc:
            reason = " ".join(str(exc).split())[:160]
            notes.append(
                f"pipeline rank {rank.rank}: its cut stages could not stand for the "
                f"whole ({reason}); every layer of the stage was traced instead"
            )
            traced = trace_pipeline_rank(
                build_model, training, rank, workspace_bytes=workspace_bytes, mesh=mesh
            )
    return traced, StepSchedule.from_timeline(traced.report.timeline).with_lazy_optimizer_states()


def estimate_pipeline(
    name: str,
    build_model: Callable[[], Any],
    training: TrainingConfig,
    *,
    gpu: Any = None,
    generic: bool = False,
    copies: int | None = None,
    compose: bool | None = None,
) -> Any:
    """Trace every pipeline rank whose memory differs and hand the driver one schedule each
    (Note [Tracing pipeline parallelism]).

    Args:
        name: the model's name.
        build_model: returns the whole transformers causal LM.
        training: the settings (``pipeline_parallel_size > 1``).
        gpu: the GPU (cuBLAS workspace size, verdict).
        generic: the generic path (``engine="generic"``).
        copies: units kept per run when composing.
        compose: cut each stage's layers to a few and compose the full depth
            (``trainmem.trace.compose``, which checks itself and falls back to every layer of
            the stage); default: ``generic``.

    Returns:
        A draft :class:`~trainmem.breakdown.MemoryEstimate` with one schedule per traced rank;
        :func:`trainmem.estimate.finish` completes it.
    """
    from trainmem.trace.compose import count_parameters
    from trainmem.trace.engine import DEFAULT_CUBLAS_WORKSPACE_BYTES
    from trainmem.trace.parallel import trace_mesh

    check_pipeline_settings(training)
    with torch.device("meta"):
        full = build_model()
    n_all, n_train = count_parameters(full)
    causal_lm = full.get_base_model() if getattr(full, "peft_config", None) else full
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        split_stages(full, training, PipelineRank(0, (0,), (range(0),), 1))  # raises
    layout = rank_map(
        training,
        len(layers or ()),
        tied_embeddings=bool(getattr(full.config, "tie_word_embeddings", False)),
    )
    del full, causal_lm, layers
    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    notes: list[str] = []
    traces: list[RankTrace] = []
    schedules = []

    cut_layers = generic if compose is None else compose
    with trace_mesh(training) as mesh:
        for rank in pipeline_ranks(layout):
            traced, schedule = _trace_rank(
                build_model,
                training,
                rank,
                ws,
                mesh,
                cut_layers,
                copies,
                notes,
            )
            traces.append(traced)
            schedules.append(schedule)
    return pipeline_estimate(
        name,
        training,
        layout,
        traces,
        schedules,
        gpu=gpu,
        workspace_bytes=ws,
        counts=(n_all, n_train),
        generic=generic,
        few=cut_layers,
        notes=notes,
    )


def pipeline_estimate(
    name: str,
    training: TrainingConfig,
    layout: RankMap,
    traces: list[RankTrace],
    schedules: list[Any],
    *,
    gpu: Any,
    workspace_bytes: int,
    counts: tuple[int, int],
    generic: bool,
    few: bool,
    notes: list[str],
) -> Any:
    """The draft estimate of the traced pipeline ranks: one schedule per rank, the layout and
    the schedule in the details.

    Args:
        name: the model's name.
        training: the settings.
        layout: the world's rank map.
        traces: the traced ranks, first pipeline rank first.
        schedules: their step schedules.
        gpu: the GPU (cuBLAS workspace size, verdict).
        workspace_bytes: one cuBLAS workspace.
        counts: (parameters, trainable parameters) of the whole model.
        generic: the generic path (``engine="generic"``).
        few: a few layers per stage were traced and repeated.
        notes: notes of the ranks' traces.

    Returns:
        The draft :class:`~trainmem.breakdown.MemoryEstimate`.
    """
    from trainmem.trace.engine import _estimate

    ws = workspace_bytes
    est = _estimate(name, traces[0].capture, traces[0].report, training, gpu, ws, layout)
    if generic:
        est.engine = "generic"
    est.num_parameters, est.num_trainable_parameters = counts
    for k in _RANK_DETAILS:
        est.details.pop(k, None)
    m = training.gradient_accumulation_steps
    labels = [place.to_json() for place in layout.ranks]
    est.details["per_rank"] = labels
    est.details["traced_micro_batches"] = m
    est.details["pipeline"] = {
        "schedule": training.pipeline_schedule,
        "micro_batches": m,
        "stage_layers": [s.to_json()["layers"] for s in layout.stages],
    }
    est.recorded_timeline = None
    est.peak_reason = ""
    est.schedules = schedules
    est.rank_labels = labels
    repeated = " (a few layers per stage, repeated to full depth)" if few else ""
    est.notes = [
        "trace engine: torch.distributed.pipelining's schedule run over every micro-batch of "
        f"the step on the first, the last and the most loaded pipeline rank{repeated}; "
        "requested sizes, the CUDA context and the NCCL communicators are added, not traced",
        *notes,
    ]
    return est


def estimate_pipeline_trace(
    model_spec_or_name: Any, training: TrainingConfig, *, gpu: Any = None
) -> Any:
    """The trace engine for ``pipeline_parallel_size > 1``: a preset / HF config split into
    stages and traced under ``torch.distributed.pipelining`` (Note [Tracing pipeline
    parallelism]); a few layers per stage traced and repeated to full depth, checked against
    the traced stream (``trainmem.trace.compose``), else every layer of the stage.

    Args:
        model_spec_or_name: a preset name, config path or hub id, or a ``ModelSpec``.
        training: the settings.
        gpu: the GPU (cuBLAS workspace size, verdict).

    Returns:
        The draft :class:`~trainmem.breakdown.MemoryEstimate` (``engine="trace"``).
    """
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.hf_model import build_hf_training_model

    name = model_spec_or_name if isinstance(model_spec_or_name, str) else model_spec_or_name.name
    raw = load_hf_config(name)
    return estimate_pipeline(
        name, lambda: build_hf_training_model(raw, training), training, gpu=gpu, compose=True
    )
