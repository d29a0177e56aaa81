"""The analytic engine: peak memory of one steady-state training step in closed form.

Note [Where the peak falls]
    A steady-state step (the optimizer states already exist; ``zero_grad(set_to_none=True)``, the
    default since PyTorch 2.0, so no gradients exist during the forward of the first
    micro-batch) has four candidate peaks; the engine evaluates each and reports the largest:

    1. ``forward``: end of the forward pass. Under autocast with full checkpointing, the 16-bit
       weight copies cached by autocast are all still alive here (not saved, but cached until
       the autocast region exits).
    2. ``backward`` start: every saved activation plus the two fp32 (T, V) log-softmax gradients
       (the typical peak of LM training at small model size / long sequences).
    3. ``backward`` through the layers: activations of unprocessed layers fall by one layer while
       the gradients of processed layers grow by one layer; the sum is linear in the layer index,
       so its maximum is at the first or the last layer; plus the recomputed layer under
       checkpointing and the layer's gradient transients.
    4. ``optimizer``: weights + gradients + optimizer states + the step's temporaries (the peak for
       small micro-batches).

    With gradient accumulation > 1, gradients persist across micro-batches and are added to 1-3.
    The seeds' four-phase picture (shared/seeds, "How GPU gets utilized during model training")
    is this sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from trainmem.analytic.activations import (
    ActivationProfile,
    activation_profile,
    autocast_cached_weight_bytes,
    backward_layer_transients,
    compute_and_residual_bytes,
    layer_is_checkpointed,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
)
from trainmem.analytic.buffers import (
    deepspeed_backward_bucket_bytes,
    deepspeed_persistent_bucket_bytes,
    deepspeed_zero3_gather_bytes,
    gathered_layer_bytes,
    gradients_alive_in_forward,
    kept_gathered_layer_bytes,
    outside_allocator_bytes,
    reduce_scatter_layer_bytes,
    root_gathered_bytes,
)
from trainmem.analytic.temporaries import cublas_workspace_bytes, optimizer_step_temporary_bytes
from trainmem.analytic.tensor_states import StateLayout, state_layout
from trainmem.breakdown import MemoryBreakdown, MemoryEstimate
from trainmem.errors import SpecError
from trainmem.specs.hardware import DEFAULT_CUDA_CONTEXT_BYTES, GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

if TYPE_CHECKING:
    from trainmem.allocator.replay import ReplayResult
    from trainmem.timeline import Timeline

DEFAULT_CUBLAS_WORKSPACE_BYTES = 8_519_680
"""cuBLAS workspace per handle when no GPU is named (pre-Hopper default ``:4096:2:16:8``)."""


def estimate_analytic(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None = None,
    cuda_context_bytes: int | None = None,
    simulate_allocator: bool = True,
    alloc_conf: str = "",
) -> MemoryEstimate:
    """Peak GPU memory of one steady-state training step on one GPU, in closed form.

    Args:
        model: the transformer's shape.
        training: micro-batch, sequence length, precision, optimizer, checkpointing, attention.
        gpu: the GPU for the verdict and its cuBLAS workspace size; None for no verdict.
        cuda_context_bytes: memory outside the allocator; default
            :data:`~trainmem.specs.hardware.DEFAULT_CUDA_CONTEXT_BYTES`.
        simulate_allocator: replay the step's allocation timeline
            (:func:`~trainmem.analytic.step_timeline.analytic_timeline`) through the caching
            allocator simulator for fragmentation and the OOM verdict (tens of ms for the largest
            presets); False gives the closed form alone (fragmentation 0), for sweeps.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` for the simulator.

    Returns:
        A :class:`~trainmem.breakdown.MemoryEstimate` whose breakdown is taken at the peak.

    Source: Note [Where the peak falls]; model states: Note [Model states per precision];
    activations: Note [Activation terms] (Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.1).

    Model states per tensor (LoRA, quantized bases, ZeRO / FSDP sharding, offload): Note [Model
    states with PEFT and sharding] in :mod:`trainmem.analytic.tensor_states`.

    Tensor / sequence / context parallelism divide the activation terms
    (:func:`trainmem.analytic.activations.parallel_divisor`) and the layer linears and the
    vocabulary (Note [Model states with PEFT and sharding]); pipeline parallelism is evaluated
    per stage (:func:`pipeline_ranks`) and the most loaded rank is reported, with every rank's
    peak under ``details["per_rank"]``.

    Known limitations: HF transformers 5 code paths assumed; pipeline ranks are evaluated
    without the allocator replay (the replay simulates the unpipelined step).
    """
    layout = state_layout(model, training)
    n_params = layout.total("numel")
    n_trainable = sum(s.numel for s in layout.embedding + layout.head if s.trainable)
    n_trainable += model.num_layers * sum(s.numel for s in layout.layer if s.trainable)
    _check_parallel_shape(model, training)
    prof = activation_profile(model, training)
    ws = cublas_workspace_bytes(
        gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    )
    ranks = [
        _rank_peak(model, training, rank, layout=layout, prof=prof, workspace=ws)
        for rank in pipeline_ranks(model, training)
    ]
    worst = max(ranks, key=lambda r: r.peak_bytes)
    weights, states, totals = worst.parameters, worst.optimizer_states, worst.totals
    peak_name = max(totals, key=lambda k: totals[k])
    grads, acts, temps, reason = worst.candidates[peak_name]
    if len(ranks) > 1:
        reason += f" (pipeline stage {worst.rank.stage}, the most loaded rank)"
    phase = "backward" if peak_name.startswith("backward") else peak_name
    ctx = DEFAULT_CUDA_CONTEXT_BYTES if cuda_context_bytes is None else cuda_context_bytes
    fragmentation, notes, timeline = 0, [], None
    # issue 12: memory outside the caching allocator (paged optimizer states) joins the device
    # total through the context figure, never allocated / reserved
    outside = outside_allocator_bytes(layout, training)
    ctx += sum(outside.values())
    notes_outside = [
        f"{kind.replace('_', ' ')}: {size} bytes outside the caching allocator "
        f"({'CUDA managed memory' if kind.startswith('paged') else 'NCCL cudaMalloc'}): counted "
        "in the device total (with the CUDA context), not in max_memory_allocated"
        for kind, size in outside.items()
    ]
    replay_details: dict[str, object] = {}
    if simulate_allocator and training.pipeline_parallel_size > 1:
        notes = [
            "the caching-allocator simulation is not run for pipeline-parallel ranks yet: "
            "reserved = allocated (no fragmentation counted)"
        ]
    elif simulate_allocator:
        fragmentation, notes, replay_details, timeline = _allocator_replay(
            model, training, gpu=gpu, cuda_context_bytes=ctx, alloc_conf=alloc_conf
        )
    notes = notes_outside + notes  # issue 12
    breakdown = MemoryBreakdown(
        parameters=weights,
        gradients=grads,
        optimizer_states=states,
        activations=acts,
        temporary=temps,
        fragmentation=fragmentation,
        cuda_context=ctx,
    )
    return MemoryEstimate(
        model_name=model.name,
        engine="analytic",
        num_parameters=n_params,
        num_trainable_parameters=n_trainable,
        breakdown=breakdown,
        peak_phase=phase,
        peak_reason=reason,
        config=resolved_config(training),
        gpu_name=gpu.name if gpu else None,
        gpu_capacity_bytes=gpu.memory_bytes if gpu else None,
        details={
            "candidates_bytes": totals,
            "per_rank": [r.to_dict() for r in ranks],
            "rank_map": rank_map(model, training),
            "activation_terms_per_layer_bytes": prof.terms,
            "activation_terms_outside_layers_bytes": prof.head_terms,
            "activations_per_layer_bytes": prof.per_layer,
            "loss_backward_temporary_bytes": loss_backward_transient_bytes(model, training),
            "cublas_workspace_bytes": ws,
            "outside_allocator_bytes": outside,  # issue 12
            **replay_details,
        },
        notes=notes,
        timeline=timeline,
    )


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """One pipeline stage as a rank sees it.

    Attributes:
        stage: stage index (0 = first).
        num_layers: transformer layers held (ceil(L / p); all of them without pipelining).
        in_flight: micro-batches whose activations the stage holds at once (Korthikanti et al.
            2022 sec. 4.2.3: the first 1F1B stage holds p; interleaving adds (p - 1) / v; GPipe
            holds all of them).
        has_embedding: holds the input embeddings (first stage; the last stage too for tied
            embeddings, as Megatron keeps a copy for the output layer).
        has_head: holds the final norm, the output layer and the loss (last stage).
    """

    stage: int
    num_layers: int
    in_flight: float
    has_embedding: bool
    has_head: bool


def pipeline_ranks(model: ModelSpec, training: TrainingConfig) -> list[PipelineRank]:
    """The ranks whose memory differs: the first and the last pipeline stage (one rank without
    pipelining). Tensor, context and data-parallel ranks of a stage hold the same bytes."""
    p = training.pipeline_parallel_size
    L = model.num_layers
    m = training.gradient_accumulation_steps  # micro-batches per step
    if p == 1:
        return [PipelineRank(0, L, 1, True, True)]
    per_stage = -(-L // p)
    schedule = training.pipeline_schedule
    out = []
    for stage in (0, p - 1):
        if schedule == "gpipe":
            in_flight: float = m
        elif schedule == "interleaved-1f1b":
            in_flight = min(float(m), (p - stage) + (p - 1) / training.virtual_pipeline_stages)
        else:
            in_flight = min(m, p - stage)
        last = stage == p - 1
        out.append(
            PipelineRank(
                stage,
                per_stage if not last else L - per_stage * (p - 1),
                max(in_flight, 1),
                stage == 0 or (last and model.tie_word_embeddings),
                last,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _RankPeak:
    rank: PipelineRank
    parameters: int
    optimizer_states: int
    candidates: dict[str, tuple[int, int, int, str]]
    totals: dict[str, int]

    @property
    def peak_bytes(self) -> int:
        return max(self.totals.values())

    def to_dict(self) -> dict[str, object]:
        name = max(self.totals, key=lambda k: self.totals[k])
        return {
            "pipeline_stage": self.rank.stage,
            "num_layers": self.rank.num_layers,
            "micro_batches_in_flight": self.rank.in_flight,
            "allocated_bytes": self.peak_bytes,
            "peak_phase": name,
        }


def rank_map(model: ModelSpec, training: TrainingConfig) -> dict[str, object]:
    """How the world is laid out: sizes per dimension, Megatron's rank order (tensor fastest,
    then context, data, pipeline: megatron/core/parallel_state.py ``RankGenerator``), and the
    layers of every pipeline stage."""
    tp, cp = training.tensor_parallel_size, training.context_parallel_size
    dp, p = training.data_parallel_size, training.pipeline_parallel_size
    per_stage = -(-model.num_layers // p)
    stages = []
    for stage in range(p):
        first = stage * per_stage
        last = min(model.num_layers, first + per_stage) - 1
        stages.append(
            {
                "stage": stage,
                "layers": [first, last],
                "global_ranks": [stage * tp * cp * dp, (stage + 1) * tp * cp * dp - 1],
            }
        )
    return {
        "world_size": tp * cp * dp * p,
        "tensor_parallel_size": tp,
        "context_parallel_size": cp,
        "data_parallel_size": dp,
        "pipeline_parallel_size": p,
        "order": "tp-cp-dp-pp",
        "stages": stages,
    }


def _check_parallel_shape(model: ModelSpec, training: TrainingConfig) -> None:
    tp = training.tensor_parallel_size
    if model.num_heads % tp:
        raise SpecError(
            "tensor_parallel_size",
            f"{tp} must divide num_attention_heads={model.num_heads} (Megatron splits heads)",
        )
    if training.pipeline_parallel_size > model.num_layers:
        raise SpecError(
            "pipeline_parallel_size",
            f"{training.pipeline_parallel_size} stages for {model.num_layers} layers",
        )


def _rank_peak(
    model: ModelSpec,
    training: TrainingConfig,
    rank: PipelineRank,
    *,
    layout: StateLayout,
    prof: ActivationProfile,
    workspace: int,
) -> _RankPeak:
    """The candidate peaks of one rank (Note [Where the peak falls])."""
    emb_states = layout.embedding if rank.has_embedding else []
    if rank.has_embedding and rank.stage > 0:  # the last stage's copy of the tied embedding
        emb_states = [s for s in layout.embedding if s.name == "embedding/tokens"]
    head_states = layout.head if rank.has_head else []
    outer = emb_states + head_states
    L = rank.num_layers

    def total(field: str) -> int:
        return sum(getattr(s, field) for s in outer) + L * sum(
            getattr(s, field) for s in layout.layer
        )

    weights, grads_all, states = total("param_bytes"), total("grad_bytes"), total("state_bytes")
    trainable = [s for s in outer + layout.layer if s.trainable]
    n_trainable = sum(s.numel for s in outer if s.trainable) + L * sum(
        s.numel for s in layout.layer if s.trainable
    )
    dp = training.data_parallel_size
    stage = training.zero_stage if dp > 1 else 0
    c, _ = compute_and_residual_bytes(training)
    opt_tmp = 0
    if training.offload == "none" and trainable:
        # per-rank parameter slices: the temporaries follow the local shards
        local = sum(s.full_grad_bytes for s in outer) + L * sum(
            s.full_grad_bytes for s in layout.layer
        )
        local_elems = local // max(dtype_bytes(training.grad_dtype), 1)
        opt_tmp = optimizer_step_temporary_bytes(
            training,
            num_trainable_parameters=(  # issue 12: shards span the shard group (HYBRID_SHARD)
                -(-local_elems // training.sharding_degree) if stage >= 1 else local_elems
            ),
            largest_parameter=max(s.full_grad_bytes for s in trainable)
            // max(dtype_bytes(training.grad_dtype), 1),
        )
    del n_trainable
    loss_tmp = loss_backward_transient_bytes(model, training) if rank.has_head else 0
    loss_fwd = loss_forward_transient_bytes(model, training) if rank.has_head else 0
    mlp_tmp, attention_tmp, residual_tmp = backward_layer_transients(model, training)
    mlp_acts = sum(v for k, v in prof.terms.items() if k.startswith("mlp/"))
    layer0 = layout.layer
    # ZeRO-3 / FULL_SHARD: the current and the prefetched layer's gathered parameters; ZeRO-2/3:
    # one layer's unsharded gradients before the reduce-scatter (Rajbhandari et al. 2020, sec.
    # 5.2-5.3; FSDP ``forward_prefetch`` / ``backward_prefetch=BACKWARD_PRE``).
    gather = 2 * sum(s.full_param_bytes for s in layer0) if stage == 3 else 0
    if stage == 3 and training.is_fp8:
        # torchao float8 all-gather: linear weights travel and are gathered in float8 (1 byte)
        gather = (
            2
            * sum(
                (1 if s.name != "vector" and not s.name.startswith("lora_") else c) * s.numel
                for s in layer0
            )
            // training.tensor_parallel_size
        )
    elif stage == 3 and training.conventions.zero_ipg_buckets:  # issue 12: DeepSpeed prefetch
        gather = deepspeed_zero3_gather_bytes(layer0, model, training)
    elif stage == 3:  # issue 12: FSDP mixed-precision policies gather in the compute dtype
        gather = 2 * gathered_layer_bytes(layer0, training)
    offloads_grads = training.offload in ("optimizer+gradients", "optimizer+params")
    reduce = reduce_scatter_layer_bytes(layer0, training) if stage >= 2 or offloads_grads else 0
    if stage == 3:
        # FSDP2's root module (embeddings, final norm, LM head) is not resharded after forward:
        # its gathered parameters stay from the forward to the backward (``fully_shard`` on the
        # root, ``reshard_after_forward`` defaults to False there; found by the trace engine).
        gather += root_gathered_bytes(outer, training)  # issue 12: the shard stays beside it
    # QLoRA / int8 bases: each frozen quantized linear is dequantized to the compute dtype for its
    # matmul, forward and backward (bitsandbytes ``MatMul4Bit``), one at a time.
    dequant = 0
    if training.quantize_base != "none":
        dequant = (
            c
            * max((s.numel for s in layer0 if not s.trainable and s.name != "vector"), default=0)
            // training.tensor_parallel_size
        )

    g_layer = sum(s.grad_bytes for s in layer0)
    g_head = sum(s.grad_bytes for s in head_states)
    if model.tie_word_embeddings and rank.has_head:
        g_head += sum(s.grad_bytes for s in emb_states if s.name == "embedding/tokens")
    # gradients alive through the forward: accumulated from earlier micro-batches, or zeroed but
    # kept by zero_grad(set_to_none=False)
    keep_grads = gradients_alive_in_forward(training)  # issue 12: + Megatron's grad buffer
    g_prev = grads_all if keep_grads else 0
    # Activation offloading: saved activations go to CPU layer by layer; the current and the
    # prefetched layer stay (torchtune ``OffloadActivations``).
    layers_on_gpu = min(L, 2) if training.activation_offloading else L
    emb_acts = prof.embedding if rank.stage == 0 else 0
    head_acts = prof.head if rank.has_head else 0
    # other micro-batches in flight on this stage keep their whole activations (pipelining)
    others = round((rank.in_flight - 1) * (emb_acts + layers_on_gpu * prof.per_layer))
    acts_forward = emb_acts + layers_on_gpu * prof.per_layer + head_acts + others

    candidates: dict[str, tuple[int, int, int, str]] = {}  # name -> (grads, acts, temps, reason)
    weight_copies = 0
    if layer_is_checkpointed(training):  # issue 12: only trainable leaves are cached
        weight_copies = autocast_cached_weight_bytes(model, training) * L
    # issue 12: DeepSpeed gradient buckets (ZeRO-1/2 in backward, ZeRO-3 for the whole step)
    bucket_bwd = deepspeed_backward_bucket_bytes(model, training)
    bucket_all = deepspeed_persistent_bucket_bytes(model, training)
    # issue 12: FSDP SHARD_GRAD_OP / NO_SHARD keep each layer's gathered weights to its backward
    kept = kept_gathered_layer_bytes(layer0, training)
    if kept and stage == 3:
        gather = max(gather - 2 * kept, 0)  # the layers' gathers are the kept ones; root stays
    candidates["forward"] = (
        g_prev,
        acts_forward + weight_copies,
        workspace + gather + dequant + loss_fwd + L * kept + bucket_all,
        "end of forward: every saved activation is alive"
        + (", with the logits (and their fp32 copy) while the loss runs" if loss_fwd else ""),
    )
    if rank.has_head:
        candidates["backward_start"] = (
            g_prev,
            acts_forward,
            workspace + loss_tmp + gather + L * kept + bucket_all + bucket_bwd,
            "start of backward: saved activations plus the two (tokens x vocab) log-softmax "
            "gradients",
        )
    for name, j in (("backward_first_layer", 0), ("backward_last_layer", L - 1)):
        grads = max(g_prev, min(g_head + (j + 1) * g_layer, grads_all))
        if training.optimizer_in_backward:
            grads = min(g_head + g_layer, grads_all)  # each gradient is stepped and freed at once
        acts = emb_acts + min(L - j, layers_on_gpu) * prof.per_layer + prof.recompute + others
        reason = "backward through the layers: gradients grow while activations are freed" + (
            " and one layer is recomputed" if prof.recompute else ""
        )
        fixed = workspace + residual_tmp + gather + reduce + dequant + (L - j) * kept
        fixed += bucket_all + bucket_bwd  # issue 12
        # the layer's MLP backward (all its activations alive), then its attention backward
        # (the MLP's saved tensors already freed): whichever holds more
        if mlp_tmp >= attention_tmp - mlp_acts:
            candidates[name] = (grads, acts, fixed + mlp_tmp, reason)
        else:
            candidates[name] = (
                grads,
                acts - mlp_acts,
                fixed + attention_tmp,
                reason + " (in eager attention's backward)",
            )
    if not training.optimizer_in_backward:
        candidates["optimizer"] = (
            grads_all,
            0,
            workspace + opt_tmp + bucket_all,  # issue 12
            f"optimizer step: weights, gradients, optimizer states and the "
            f"{training.step_implementation} {training.optimizer} temporaries",
        )
    totals = {k: weights + states + g + a + t for k, (g, a, t, _) in candidates.items()}
    return _RankPeak(rank, weights, states, candidates, totals)


def replay_step(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None = None,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES,
    alloc_conf: str = "",
    record_history: bool = False,
    timeline: Timeline | None = None,
) -> ReplayResult:
    """Replay the analytic timeline (Note [Analytic timeline]) through the caching allocator
    simulator, with the GPU's capacity minus the CUDA context as the allocator's limit.

    Args:
        record_history: keep a PyTorch memory snapshot in ``result.snapshot`` (for
            :func:`trainmem.allocator.snapshot.write_snapshot`).
        timeline: the step's timeline if already built, else built here.

    Returns:
        The simulator's :class:`~trainmem.allocator.replay.ReplayResult` (bytes).
    """
    from trainmem.allocator.replay import replay_timeline
    from trainmem.analytic.step_timeline import analytic_timeline

    if timeline is None:
        per_handle = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
        timeline = analytic_timeline(model, training, cublas_workspace_bytes=per_handle)
    capacity = None if gpu is None else max(gpu.memory_bytes - cuda_context_bytes, 0)
    return replay_timeline(
        timeline,
        capacity_bytes=capacity,
        alloc_conf=alloc_conf,
        device_total_bytes=None if gpu is None else gpu.memory_bytes,
        record_history=record_history,
    )


def _allocator_replay(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None,
    cuda_context_bytes: int,
    alloc_conf: str,
) -> tuple[int, list[str], dict[str, object], Timeline]:
    """Fragmentation (reserved - allocated at their peaks), notes, details and the timeline from
    :func:`replay_step`."""
    from trainmem.analytic.step_timeline import analytic_timeline

    per_handle = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    timeline = analytic_timeline(model, training, cublas_workspace_bytes=per_handle)
    result = replay_step(
        model,
        training,
        gpu=gpu,
        cuda_context_bytes=cuda_context_bytes,
        alloc_conf=alloc_conf,
        timeline=timeline,
    )
    fragmentation = max(result.max_memory_reserved - result.max_memory_allocated, 0)
    notes: list[str] = []
    if result.oom and result.oom_message:
        notes.append(
            "the simulated caching allocator runs out of memory: "
            + result.oom_message.splitlines()[0]
        )
    details: dict[str, object] = {
        "allocator_replay": {
            "events": result.num_events,
            "max_memory_allocated": result.max_memory_allocated,
            "max_memory_reserved": result.max_memory_reserved,
            "oom": result.oom,
            "num_alloc_retries": result.memory_stats.get("num_alloc_retries", 0),
        }
    }
    return fragmentation, notes, details, timeline


def resolved_config(training: TrainingConfig) -> dict[str, object]:
    """Every training setting after defaults, JSON-able, plus derived dtypes."""
    out: dict[str, object] = asdict(training)
    out["weight_dtype"] = training.weight_dtype
    out["compute_dtype"] = training.compute_dtype
    # issue 12: the implementation that was computed (the framework's default when none given)
    out["optimizer_implementation"] = training.step_implementation
    return out
