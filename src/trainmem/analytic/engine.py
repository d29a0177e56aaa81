"""The analytic engine: peak memory of one steady-state training step in closed form.

Note [Where the peak falls]
    A steady-state step (the optimizer states already exist; ``zero_grad(set_to_none=True)``, the
    default since PyTorch 2.0, so no gradients exist during the forward of the first
    micro-batch) peaks at one of four places, all of them points of the one step schedule
    (Note [Analytic step schedule]); ``StepSchedule.peak()`` finds the highest:

    1. end of forward: every saved activation is alive (under autocast with checkpointing, the
       16-bit weight copies cached by autocast too; they are cached until the region exits),
       with the logits while the loss runs;
    2. start of backward: every saved activation plus the two fp32 (T, V) log-softmax gradients
       (the typical peak of LM training at small model size / long sequences);
    3. backward through the layers: activations of unprocessed layers fall by one layer while
       the gradients of processed layers grow by one layer, plus the recomputed layer under
       checkpointing and the layer's gradient transients;
    4. optimizer step: weights + gradients + optimizer states + the step's temporaries (the peak
       for small micro-batches).

    With gradient accumulation > 1, gradients persist across micro-batches and add to 1-3.
    The seeds' four-phase picture (shared/seeds, "How GPU gets utilized during model training")
    is this sequence.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.analytic.activations import ActivationProfile, activation_profile
from trainmem.analytic.buffers import device_context
from trainmem.analytic.host_memory import host_memory
from trainmem.analytic.loss import loss_backward_transient_bytes, loss_kind
from trainmem.analytic.params import num_parameters
from trainmem.analytic.prompt_encoder import check_prompt_learning
from trainmem.analytic.schedule import PipelineRank, rank_schedule
from trainmem.analytic.template import templated_schedules
from trainmem.analytic.temporaries import cublas_workspace_bytes
from trainmem.analytic.tensor_states import StateLayout, saved_modules, state_layout
from trainmem.analytic.varying_lengths import after_earlier_steps
from trainmem.breakdown import MemoryBreakdown, MemoryEstimate
from trainmem.errors import SpecError
from trainmem.specs.hardware import DEFAULT_CUBLAS_WORKSPACE_BYTES, GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.ranks import RankMap, model_rank_map
from trainmem.specs.training import (
    TrainingConfig,
    pipeline_sizes,
    resolved_config,
)


def estimate_analytic(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | None = None,
    cuda_context_bytes: int | None = None,
    lean: bool = False,
    earlier_steps: bool = True,
) -> MemoryEstimate:
    """The analytic engine's answer before the driver derives the peak: one step schedule per
    distinct rank (Note [Analytic step schedule]) and the engine's details.

    Args:
        model: the transformer's shape.
        training: micro-batch, sequence length, precision, optimizer, checkpointing, attention.
        gpu: the GPU for its cuBLAS workspace size; None for the pre-Hopper default.
        cuda_context_bytes: memory outside the allocator; default
            :data:`~trainmem.specs.hardware.DEFAULT_CUDA_CONTEXT_BYTES`.
        lean: for a sweep's row: the schedules filled from a template of their structure
            (the same schedules, Note [Schedule templates]: for many configurations that
            differ in micro-batch size and sequence length only) and none of the details the
            row does not read (the rank map, the activation terms, the host memory).
        earlier_steps: splice the steps of ``earlier_seq_lens`` / ``sample_lengths`` before
            the measured one (Note [Steps of varying length]); False for a closed-form answer
            that replays nothing: every earlier length is at most ``seq_len``, so its steps
            change only the caching allocator's reserved bytes, never the allocated peak.

    Returns:
        A draft :class:`~trainmem.breakdown.MemoryEstimate` whose ``schedules`` hold one
        :class:`~trainmem.schedule.StepSchedule` per rank whose memory differs (first and last
        pipeline stage); :func:`trainmem.estimate.estimate` turns it into the answer.

    Raises:
        SpecError: a parallel layout the model cannot take (heads not divisible by the tensor-
            parallel size, a pipeline stage without layers).

    Source: Note [Where the peak falls]; model states: Note [Model states per precision];
    activations: Note [Activation terms] (Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.1);
    model states per tensor (LoRA, quantized bases, ZeRO / FSDP sharding, offload): Note [Model
    states with PEFT and sharding] in :mod:`trainmem.analytic.tensor_states`. Tensor / sequence
    / context parallelism divide the activation terms
    (:func:`trainmem.analytic.activation_parallelism.parallel_divisor`) and the layer linears and
    the vocabulary; pipeline parallelism is evaluated per stage (:func:`pipeline_ranks`).
    """
    check_prompt_learning(model, training)
    model = model_as_built(model, training)
    _check_parallel_shape(model, training)
    layout = state_layout(model, training)
    n_params, n_trainable = _parameter_counts(model, training, layout)
    per_handle = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    world = model_rank_map(model, training)
    ranks = pipeline_ranks(model, training)
    # a sweep's row records a template at once, one estimate once it met the structure before
    # (Note [When a template is recorded])
    filled = templated_schedules(model, training, ranks, per_handle, eager=lean, details=not lean)
    prof: ActivationProfile | None = None
    loss_backward: int | None = None
    if filled is None:
        prof = activation_profile(model, training)
        schedules = [
            rank_schedule(
                model, training, rank, layout=layout, prof=prof, workspace_per_handle=per_handle
            )
            for rank in ranks
        ]
    else:  # the profile and the loss's transients the details report, filled with them
        schedules, prof, loss_backward = filled  # (None, None: a sweep's row)
    if earlier_steps and training.earlier_seq_len_list:  # Note [Steps of varying length]
        schedules = [
            after_earlier_steps(
                model, training, rank, sched, layout=layout, workspace_per_handle=per_handle
            )
            for rank, sched in zip(ranks, schedules, strict=True)
        ]
    # memory outside the caching allocator (paged optimizer states, NCCL communicators) joins
    # the device total beside the CUDA context, never allocated / reserved
    ctx, outside, notes = device_context(
        training, cuda_context_bytes, layout.total("paged_state_bytes"), gpu
    )
    if training.compile:
        notes.append(
            "--compile: the formulas keep what inductor's min-cut partition saves for RMSNorm and "
            "gated-MLP layers (checked against a traced Llama layer); other layer kinds keep "
            "eager's tensors; --engine trace partitions the real graph"
        )
    details: dict[str, object] = {"outside_allocator_bytes": outside}
    if not lean:
        assert prof is not None  # built, or filled with the details
        details = _details(model, training, prof, per_handle, outside, world, loss_backward)
    if training.offload != "none" and not lean:  # Note [Host memory of offloaded states]
        host = host_memory(model, training)
        details["host_memory"] = host.as_details()
        notes.append(f"host RAM of the offload: {host.source}")
    return MemoryEstimate(
        model_name=model.name,
        engine="analytic",
        num_parameters=n_params,
        num_trainable_parameters=n_trainable,
        breakdown=MemoryBreakdown(0, 0, 0, 0, 0, cuda_context=ctx),
        peak_phase="",
        peak_reason="",
        config=_config(model, training),
        gpu_name=gpu.name if gpu else None,
        gpu_capacity_bytes=gpu.memory_bytes if gpu else None,
        details=details,
        notes=notes,
        schedules=schedules,
        rank_labels=[
            {**place.to_json(), "micro_batches_in_flight": r.in_flight}
            for place, r in zip(world.ranks, ranks, strict=True)
        ],
    )


def _details(
    model: ModelSpec,
    training: TrainingConfig,
    prof: ActivationProfile,
    per_handle: int,
    outside: object,
    world: RankMap,
    loss_backward: int | None,
) -> dict[str, object]:
    """The engine's details of one configuration: the rank map, the activation terms, the
    loss's backward temporaries (``loss_backward``: filled with the schedules, else None), the
    cuBLAS workspaces and what is outside the allocator."""
    if loss_backward is None:
        loss_backward = loss_backward_transient_bytes(model, training)
    return {
        "rank_map": world.to_json(),
        "activation_terms_per_layer_bytes": prof.terms,
        "activation_terms_outside_layers_bytes": prof.head_terms,
        "activations_per_layer_bytes": prof.per_layer,
        "loss_backward_temporary_bytes": loss_backward,
        "cublas_workspace_bytes": cublas_workspace_bytes(per_handle),
        "outside_allocator_bytes": outside,
    }


def model_as_built(model: ModelSpec, training: TrainingConfig) -> ModelSpec:
    """``model`` as the framework builds it: a config's tied output head untied where the
    framework's model code has its own (``FrameworkConventions.untied_output_head``: litgpt's
    ``GPT.lm_head``, litgpt/model.py @43c44323) or peft trains a copy of the embedding or the
    head (``lora_modules_to_save``: the copies are untied, Note [peft modules_to_save] in
    :mod:`trainmem.analytic.tensor_states`), else ``model`` itself."""
    if not model.tie_word_embeddings:
        return model
    if saved_modules(training) and model.head == "causal-lm":
        return replace(model, tie_word_embeddings=False, untied_from_config=True)
    if training.conventions.untied_output_head:
        return replace(model, tie_word_embeddings=False)
    return model


def _parameter_counts(
    model: ModelSpec, training: TrainingConfig, layout: StateLayout
) -> tuple[int, int]:
    """(parameters, trainable parameters) of the model (cached with ``layout``, which is per
    model and per setting these read)."""
    cached = layout.cache.get("parameter_counts")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    n_params = layout.total("numel")
    n_trainable = sum(s.numel for s in layout.embedding + layout.head if s.trainable)
    n_trainable += model.num_blocks * sum(s.numel for s in layout.layer if s.trainable)
    # blocks of several kinds are held as identical mean blocks (tensor_states._layer_tensors),
    # whose rounding loses a few elements: report the exact count
    # (the config's count: not the head a tied config gets from peft's modules_to_save copies)
    config = replace(model, tie_word_embeddings=True) if model.untied_from_config else model
    rounding = num_parameters(config) - n_params
    n_params += rounding
    if not training.frozen_base:
        n_trainable += rounding
    layout.cache["parameter_counts"] = (n_params, n_trainable)
    return n_params, n_trainable


def _config(model: ModelSpec, training: TrainingConfig) -> dict[str, object]:
    """:func:`~trainmem.specs.training.resolved_config` with the loss that runs (the model's
    own when none was given: :func:`~trainmem.analytic.loss.loss_kind`)."""
    out = resolved_config(training)
    if model.head == "causal-lm":  # the only head with a loss setting
        out["loss"] = loss_kind(model, training)
    return out


def _interleaved_in_flight(rank: int, p: int, m: int, v: int) -> float:
    """Micro-batches (in units of the rank's whole layer set) whose activations rank ``rank``
    holds at once under interleaved 1F1B: torch's ``ScheduleInterleaved1F1B`` runs
    ``warmup = min((v - 1) * m_round + 2 * (p - 1 - rank), m * v)`` chunk forwards, then
    alternates forward and backward (forward first), so ``warmup + 1`` chunk forwards are alive
    while any steady-state op remains; ``m_round = m // max(1, m // p)`` micro-batches per
    round (torch/distributed/pipelining/schedules.py ``_get_warmup_ops``,
    ``_calculate_single_rank_operations``). With ``m`` a multiple of ``p`` this is Narayanan
    et al. 2021's ``p - rank + (p - 1) / v`` for ``v = 2``."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    chunks = warmup + 1 if warmup < m * v else warmup
    return chunks / v


def pipeline_ranks(model: ModelSpec, training: TrainingConfig) -> list[PipelineRank]:
    """The ranks whose memory differs (Note [One rank map] in :mod:`trainmem.specs.ranks`: the
    first and the last pipeline stage, and the first middle rank holding the most layers when
    it holds more than the first; one rank without pipelining), each with the micro-batches
    whose activations it holds at once. Tensor, context and data-parallel ranks of a stage hold
    the same bytes."""
    p = training.pipeline_parallel_size
    m = training.gradient_accumulation_steps  # micro-batches per step
    schedule = training.pipeline_schedule
    out = []
    for place in model_rank_map(model, training).ranks:
        stage = place.pipeline_rank
        if p == 1:
            in_flight: float = 1
        elif schedule == "gpipe":
            in_flight = m
        elif schedule == "interleaved-1f1b":
            in_flight = _interleaved_in_flight(stage, p, m, training.virtual_pipeline_stages)
        else:
            in_flight = min(m, p - stage)
        layers = place.num_layers
        assert layers is not None  # the layer count is known here
        out.append(
            PipelineRank(stage, layers, max(in_flight, 1), place.has_embedding, place.has_head)
        )
    return out


def _check_parallel_shape(model: ModelSpec, training: TrainingConfig) -> None:
    tp = training.tensor_parallel_size
    if model.num_heads % tp:
        raise SpecError(
            "tensor_parallel_size",
            f"{tp} must divide num_attention_heads={model.num_heads} (Megatron splits heads)",
        )
    p, layers = training.pipeline_parallel_size, model.num_blocks
    if p > 1 and p not in (allowed := pipeline_sizes(layers)):
        raise SpecError(
            "pipeline_parallel_size",
            f"{p} stages leave a stage without layers ({layers} layers split "
            f"{-(-layers // p)} per stage); allowed: {', '.join(map(str, allowed))}",
        )
