"""The trace engine: run the real training step on fake tensors and read the memory off it.

``estimate_trace`` builds a preset / HF config with transformers; ``trace`` takes any
``nn.Module``. Both return the :class:`~trainmem.breakdown.MemoryEstimate` the analytic engine
returns (``engine="trace"``), with the :class:`~trainmem.timeline.Timeline` attached.

What is emulated so that the fake CPU step allocates what a CUDA step allocates
(shared/notes/tracing-without-a-gpu.md):
- SDPA kernel choice and saved tensors: ``trainmem.trace.cuda_sdpa``;
- fused dropout with a bool mask: ``trainmem.trace.cuda_dropout``;
- softmax / log-softmax saving their input on a ``torch_version`` before 1.11:
  ``trainmem.trace.older_softmax``;
- the Mamba kernels (``mamba_ssm``, ``causal_conv1d``) transformers calls on a GPU:
  ``trainmem.trace.mamba_kernels``; the linear-attention ones (``fla``'s gated delta rule and
  KDA, and the short convolutions): ``trainmem.trace.fla_kernels``;
- CUDA autocast cast lists and weight-cast cache: ``trainmem.trace.cuda_autocast``;
- foreach / fused / for-loop optimizers as asked (``trainmem.trace.optimizers``); Adam's scalar
  ``step`` states stay in host memory unless fused (``torch/optim/adam.py``);
- transformers' mask heuristics: ``trainmem.trace.hf_model.hf_mask_patches``;
- one rank of a device mesh under a fake process group (``trainmem.trace.parallel``): FSDP2
  (``trainmem.trace.fsdp``), DTensor tensor / sequence parallelism
  (``trainmem.trace.tensor_parallel``);
- torch.compile (AOTAutograd + inductor's min-cut partitioner): ``trainmem.trace.compile``;
- float8 training (torchao ``Float8Linear``): ``trainmem.trace.float8``;
- scalars an optimizer reads with ``.item()`` (Adafactor): ``trainmem.trace.host_scalars``;
- the cuBLAS workspace (allocated through the caching allocator on the first matmul, so part of
  ``max_memory_allocated``): two ``init`` blocks of ``GPUSpec.cublas_workspace_bytes``, one
  per cuBLAS handle (the forward thread's and autograd's device thread's).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from types import MethodType
from typing import Any

from trainmem.breakdown import MemoryBreakdown, MemoryCategory, MemoryEstimate
from trainmem.errors import SpecError, TraceError, TrainmemError, UnsupportedError
from trainmem.specs.hardware import (
    DEFAULT_CUBLAS_WORKSPACE_BYTES,
    DEFAULT_CUDA_CONTEXT_BYTES,
    GPUSpec,
    resolve_gpu,
)
from trainmem.specs.hf_table import family_row
from trainmem.specs.model import ModelSpec
from trainmem.specs.ranks import RankMap
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainmem.trace.attribution import PeakReport, analyse  # noqa: E402
from trainmem.trace.capture import Capture, capture_step  # noqa: E402
from trainmem.trace.cuda_accumulate import cuda_grad_accumulation  # noqa: E402
from trainmem.trace.cuda_autocast import cuda_autocast_policy  # noqa: E402
from trainmem.trace.cuda_dropout import cuda_dropout  # noqa: E402
from trainmem.trace.cuda_scatter import cuda_scatter_backward  # noqa: E402
from trainmem.trace.cuda_sdpa import cuda_sdpa  # noqa: E402
from trainmem.trace.fla_kernels import linear_attention_kernels  # noqa: E402
from trainmem.trace.mamba_kernels import mamba_kernels  # noqa: E402
from trainmem.trace.model_errors import refusal_of  # noqa: E402
from trainmem.trace.older_softmax import older_softmax_backward  # noqa: E402
from trainmem.trace.optimizers import EMAStep, build_optimizer  # noqa: E402

__all__ = ["default_forward_loss", "estimate_trace", "run_trace", "trace"]


MAX_TRACED_MICRO_BATCHES = 2
"""With gradient accumulation, micro-batches 2..k allocate identically (gradients exist from
the first), so at most two are traced."""


def _torch_dtype(name: str) -> Any:
    return getattr(torch, name)


@contextlib.contextmanager
def _emulation(training: TrainingConfig, emulate_cuda: bool) -> Iterator[None]:
    from trainmem.trace.hf_model import hf_mask_patches

    with contextlib.ExitStack() as stack:
        if not training.padding_mask:  # padded: the model builds its attention mask
            with contextlib.suppress(ImportError):
                stack.enter_context(hf_mask_patches())
        if _uses_autocast(training):
            stack.enter_context(cuda_autocast_policy())
        # native_dropout also runs on real CPU tensors, so the proof covers this emulation too.
        stack.enter_context(cuda_dropout())
        if training.softmax_saves_input:
            # Note [Softmax saving its input before torch 1.11]
            stack.enter_context(older_softmax_backward())
        if emulate_cuda and training.attention != "eager":
            force = "flash" if training.attention == "flash" else None
            stack.enter_context(cuda_sdpa(force))
        if emulate_cuda:
            stack.enter_context(mamba_kernels())  # Note [Traced Mamba kernels]
            # Note [Traced linear-attention kernels]
            stack.enter_context(linear_attention_kernels())
            stack.enter_context(cuda_scatter_backward())
            stack.enter_context(cuda_grad_accumulation())
        yield


@contextlib.contextmanager
def _step_context(training: TrainingConfig, emulate_cuda: bool, optimizer: Any) -> Iterator[None]:
    from trainmem.trace.host_scalars import host_scalars
    from trainmem.trace.known_values import known_values
    from trainmem.trace.module_conversions import unchanged_conversions_kept
    from trainmem.trace.parallel import loss_context

    with _emulation(training, emulate_cuda), loss_context(training):
        with host_scalars(optimizer) if optimizer is not None else contextlib.nullcontext():
            with known_values():  # Note [Known values of a synthetic batch]
                with unchanged_conversions_kept():  # Note [Module.to on fake parameters]
                    yield


def _maybe_float8(model: Any, training: TrainingConfig) -> None:
    if training.is_fp8:
        from trainmem.trace.float8 import apply_float8
        from trainmem.trace.fsdp import uses_fsdp

        apply_float8(model, training, fsdp=uses_fsdp(training))


def _uses_autocast(training: TrainingConfig) -> bool:
    """torch.autocast around forward + loss: the framework's AMP, float8 training without
    FSDP2 (torchtitan's ``maybe_enable_amp``; with FSDP2 its MixedPrecisionPolicy casts), or
    accelerate's ``native_amp`` over its FSDP1 units' 16-bit parameters (Note [Tracing
    FSDP1])."""
    from trainmem.trace.fsdp import accelerate_native_amp, uses_fsdp

    fp8 = training.is_fp8 and not uses_fsdp(training)
    return training.uses_autocast or fp8 or accelerate_native_amp(training)


def accelerate_fp32_outputs(model: Any, training: TrainingConfig) -> None:
    """Wrap ``model.forward`` with accelerate's own ``convert_outputs_to_fp32`` when the run's
    framework prepares the model through accelerate under ``native_amp``
    (``TrainingConfig.accelerate_fp32_outputs``), as accelerator.py ``prepare_model`` does
    (``model._original_forward = model.forward``; ``MethodType(convert_outputs_to_fp32(
    model.forward.__func__), model)``): the forward returns its 16-bit output tensors as fp32
    copies (Note [accelerate's fp32 outputs], trainmem/analytic/loss.py). The autocast region
    is the step's own (:func:`_autocast_factory`), around the converted forward and the loss.

    Args:
        model: the model, before any FSDP wrap; changed in place.
        training: framework, precision and transformers release.

    Raises:
        TraceError: accelerate is not installed (peft, the ``trace`` extra, requires it).
    """
    if not training.accelerate_fp32_outputs:
        return
    try:
        from accelerate.utils import convert_outputs_to_fp32  # type: ignore[import-untyped,import-not-found]
    except ImportError as exc:  # pragma: no cover - peft installs accelerate
        raise TraceError(f"accelerate's fp32 outputs need accelerate installed: {exc}") from exc
    forward = model.forward
    model._original_forward = forward
    if hasattr(forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(forward)


def _autocast_factory(training: TrainingConfig) -> Callable[[], Any] | None:
    if not _uses_autocast(training):  # FSDP2's MixedPrecisionPolicy casts instead (trace.fsdp)
        return None
    dtype = _torch_dtype(training.compute_dtype)
    return lambda: torch.autocast("cpu", dtype=dtype)


def apply_activation_checkpointing(model: Any, mode: str, *, reentrant: bool = False) -> None:
    """Checkpoint each transformer layer (``full``) or only its non-matmul ops (``selective``).

    HF models: ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": False})`` (``transformers/modeling_utils.py``); diffusers models:
    ``model.enable_gradient_checkpointing(func)`` (``diffusers/models/modeling_utils.py``, the
    blocks its forward checkpoints); timm models, ``full`` and non-reentrant:
    ``model.set_grad_checkpointing(True)``, what timm's train.py ``--grad-checkpointing`` calls
    (its blocks through timm/models/_manipulate.py ``checkpoint`` / ``checkpoint_seq``,
    ``use_reentrant=False`` unless ``TIMM_REENTRANT_CKPT``; timm 1.0.31). Other models: every
    element of every ``nn.ModuleList`` is wrapped in ``torch.utils.checkpoint.checkpoint``;
    timm models, ``selective``: each transformer block (Note [timm's transformer blocks]).
    ``selective`` is op-level selective checkpointing as in torchtitan: attention outputs and
    every other matmul output are saved, everything else is recomputed
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``; torchtitan
    ``_get_custom_policy``).

    Args:
        model: the ``nn.Module``.
        mode: ``none``, ``full`` or ``selective``.
        reentrant: ``full`` runs torch's reentrant checkpoint (``use_reentrant=True``:
            ``TrainingConfig.layer_checkpoint_reentrant``, fsdp_qlora's
            ``CheckpointImpl.REENTRANT`` or transformers' reentrant gradient checkpointing).
    """
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    kwargs: dict[str, Any] = {"use_reentrant": reentrant and mode == "full"}
    if mode == "selective":
        from trainmem.trace.sac import ignore_profiler_ops, selective_policy

        ignore_profiler_ops()  # Note [Profiler ops under selective checkpointing]

        def make_contexts() -> Any:
            return create_selective_checkpoint_contexts(selective_policy())

        kwargs["context_fn"] = make_contexts
    from trainmem.trace.timm_parallel import apply_timm_selective_checkpointing, is_timm_model

    if mode == "selective" and is_timm_model(model):
        apply_timm_selective_checkpointing(model, kwargs)  # Note [timm's transformer blocks]
        return
    if hasattr(model, "activation_checkpointing_enable") and getattr(
        model, "supports_gradient_checkpointing", False
    ):  # transformers 5.24's name; gradient_checkpointing_enable is its deprecated alias
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return
    if hasattr(model, "gradient_checkpointing_enable") and getattr(
        model, "supports_gradient_checkpointing", False
    ):  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    if getattr(model, "_supports_gradient_checkpointing", False) and hasattr(
        model, "enable_gradient_checkpointing"
    ):  # diffusers ModelMixin: each block through its _gradient_checkpointing_func
        model.enable_gradient_checkpointing(
            lambda module, *args: checkpoint(module.__call__, *args, **kwargs)
        )
        return
    if mode == "full" and not reentrant and hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)  # timm
        return
    wrapped = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for layer in module:
                forward = layer.forward
                layer.forward = functools.partial(checkpoint, forward, **kwargs)
                wrapped += 1
    if wrapped == 0:
        raise UnsupportedError(
            "activation checkpointing needs an nn.ModuleList of layers (or a HF model); "
            "apply torch.utils.checkpoint inside build_model instead"
        )


_MODEL_CODE_ERRORS = (
    RuntimeError,
    TypeError,
    NotImplementedError,
    ValueError,
    IndexError,
    KeyError,
    AttributeError,
    NameError,
    AssertionError,
)
"""What a model's forward / backward raises when it cannot run the traced step (wrapped in
:class:`~trainmem.errors.TraceError`, one line naming the cause)."""


def run_trace(
    build_model: Callable[[], Any],
    make_batch: Callable[..., Any],
    training: TrainingConfig,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    fake: bool = True,
    emulate_cuda: bool = True,
    workspace_bytes: int = DEFAULT_CUBLAS_WORKSPACE_BYTES,
    forward_loss: Callable[[Any, Any], Any] | None = None,
    resident: Sequence[tuple[str, int, str]] = (),
    hold_output: bool = False,
) -> tuple[Capture, PeakReport]:
    """Build, warm up and record one steady-state step; the engine's core.

    Args:
        build_model: returns the ``nn.Module``; called under ``torch.device("meta")`` when
            ``fake`` (so no weights are initialised), then given fake storage.
        make_batch: returns one micro-batch (dict of kwargs, tuple of args or a tensor); called
            inside the fake mode; may take the ``TrainingConfig`` as its only argument.
        training: the step's settings.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default reads ``output.loss``.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; default from ``training``.
        fake: False runs on real CPU tensors (the proof in tests/trace/).
        emulate_cuda: route SDPA to the CUDA kernels, keep Adam's ``step`` in host memory and
            add the cuBLAS workspace; False keeps the CPU behaviour (a real CPU run cannot call
            CUDA kernels).
        workspace_bytes: cuBLAS workspace added when ``emulate_cuda``.
        forward_loss: ``forward_loss(model, batch) -> loss`` (or ``(loss, output)``) replacing
            the forward + loss
            (default: :func:`default_forward_loss` of ``training``).
        resident: ``(name, elements, dtype)`` of frozen models held on the GPU beside the
            traced one (a diffusers pipeline's VAE and text encoders,
            :func:`trainmem.specs.diffusers.frozen_components`): one fake tensor each,
            registered as a parameter from setup (``fake`` only).
        hold_output: hold each micro-batch's output through its backward
            (:func:`trainmem.trace.step.run_step`; litgpt's loop, trace/litgpt_model.py).

    Returns:
        ``(capture, report)``.

    Raises:
        TraceError: the step failed under fake tensors (the message names the op).
        UnsupportedError: ``resident`` tensors on a real (not fake) run.
    """
    from trainmem.trace.parallel import trace_mesh, uses_mesh

    if resident and not fake:
        raise UnsupportedError("resident: frozen models are only held as fake tensors")

    if training.pipeline_parallel_size > 1:  # the stages are split by trainmem.trace.pipeline
        raise UnsupportedError(
            "pipeline_parallel_size: the trace splits transformers causal LMs into pipeline "
            "stages (estimate(..., engine='trace')), not a model built here; trace one stage's "
            "module with pipeline_parallel_size=1, or use --engine analytic"
        )
    if not uses_mesh(training):
        return _run_trace(
            build_model, make_batch, training, loss_fn=loss_fn, optimizer=optimizer, fake=fake,
            emulate_cuda=emulate_cuda, workspace_bytes=workspace_bytes, forward_loss=forward_loss,
            resident=resident, hold_output=hold_output,
        )  # fmt: skip
    with trace_mesh(training) as mesh:
        return _run_trace(
            build_model, make_batch, training, loss_fn=loss_fn, optimizer=optimizer, fake=fake,
            emulate_cuda=emulate_cuda, workspace_bytes=workspace_bytes, forward_loss=forward_loss,
            mesh=mesh, resident=resident, hold_output=hold_output,
        )  # fmt: skip


def _run_trace(
    build_model: Callable[[], Any],
    make_batch: Callable[..., Any],
    training: TrainingConfig,
    *,
    loss_fn: Callable[[Any, Any], Any] | None,
    optimizer: Callable[[Any], Any] | None,
    fake: bool,
    emulate_cuda: bool,
    workspace_bytes: int,
    forward_loss: Callable[[Any, Any], Any] | None,
    mesh: Any = None,
    resident: Sequence[tuple[str, int, str]] = (),
    hold_output: bool = False,
) -> tuple[Capture, PeakReport]:
    from trainmem.trace.diffusers_parallel import mixed_parameters
    from trainmem.trace.fsdp import fsdp1_streams
    from trainmem.trace.hf_model import materialize_fake
    from trainmem.trace.parallel import add_position_ids, context_parallel, parallelize

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    if fake:
        with torch.device("meta"):
            model = build_model()
        assert fake_mode is not None
        materialize_fake(model, fake_mode)  # (would drop float8's weight subclass: after it)
        with fake_mode:
            _maybe_float8(model, training)
    else:
        model = build_model()
        _maybe_float8(model, training)
    weight_dtype = _torch_dtype(training.weight_dtype)
    peft_adapters = training.is_lora or training.is_prompt_learning
    if not fake and weight_dtype != torch.float32 and not peft_adapters:
        model = model.to(weight_dtype)  # (peft keeps its adapters / prefix fp32 on purpose)
    model.train()
    apply_activation_checkpointing(
        model, training.activation_checkpointing, reentrant=training.layer_checkpoint_reentrant
    )
    if training.compile:
        from trainmem.trace.compile import compile_layers

        compile_layers(model, checkpointing=training.activation_checkpointing)
    accelerate_fp32_outputs(model, training)  # before the FSDP1 wrap, as accelerate 1.x
    if mesh is not None:
        model = parallelize(model, mesh, training, fake_mode)
    takes_training = _takes_argument(make_batch)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        k = min(training.gradient_accumulation_steps, MAX_TRACED_MICRO_BATCHES)
        batches = [make_batch(training) if takes_training else make_batch() for _ in range(k)]
        for b in batches:
            add_position_ids(b, training)
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        opt = optimizer(params) if optimizer is not None else build_optimizer(params, training)
        if training.ema:  # Note [EMA weights]: EMAModel copies the weights before training
            names = {id(p): n for n, p in model.named_parameters()}
            modules = dict(model.named_modules())
            owners = [modules.get(names.get(id(p), "").rpartition(".")[0]) for p in params]
            opt = EMAStep(opt, [(names.get(id(p), ""), p) for p in params], training, owners)
        held = [  # a pipeline's frozen models (TrainingConfig.frozen_on_gpu)
            (torch.empty(n, dtype=_torch_dtype(dtype)), MemoryCategory.PARAMETER, f"({name})")
            for name, n, dtype in resident
        ]

    def runtime_state() -> Iterator[tuple[Any, MemoryCategory, str]]:
        yield from held
        if isinstance(opt, EMAStep):
            yield from opt.runtime_state()

    fused = bool(opt.defaults.get("fused")) if hasattr(opt, "defaults") else False
    try:
        capture = capture_step(
            model,
            batches,
            opt,
            loss_fn=loss_fn,
            autocast=_autocast_factory(training),
            accumulation_divisor=training.gradient_accumulation_steps,
            fake_mode=fake_mode,
            host_optimizer_step=emulate_cuda,
            fused=fused,
            context=lambda: _stacked(
                _step_context(training, emulate_cuda, opt if fake else None),
                context_parallel(mesh, batches, training, model),
                mixed_parameters(model) if mesh is not None else contextlib.nullcontext(),
                fsdp1_streams(model),  # Note [FSDP1 streams on the trace]
            ),
            set_to_none=bool(training.zero_grad_set_to_none),  # resolved by TrainingConfig
            forward_loss=forward_loss,
            keep_output=training.training_loop == "step",
            # Note [The current micro-batch's bound output]: the loop's own binding
            hold_output=hold_output or training.training_loop == "previous",
            zero_grad_before_backward=training.zero_grad_before_backward,
            runtime_state=runtime_state if held or isinstance(opt, EMAStep) else None,
        )
    except _MODEL_CODE_ERRORS as exc:
        if isinstance(exc, TrainmemError):  # trainmem's own refusals keep their message
            raise
        refused = refusal_of(exc, model, training.micro_batch_size)
        if refused is not None:  # an error the GPU run meets too: the setting that would work
            raise refused from exc
        # the model's own code failing on the batch or settings (a diffusers forward that
        # unpacks another layout, a value check): one line, never a traceback
        raise TraceError(f"the traced step failed: {type(exc).__name__}: {exc}") from exc
    return capture, peak_report(capture, emulate_cuda, workspace_bytes)


def peak_report(capture: Capture, emulate_cuda: bool, workspace_bytes: int) -> PeakReport:
    """The recorded step's timeline and peak, with the cuBLAS workspaces when ``emulate_cuda``.

    Args:
        capture: the recorded step.
        emulate_cuda: add the workspaces a CUDA run allocates.
        workspace_bytes: one workspace.

    Returns:
        The :class:`~trainmem.trace.attribution.PeakReport`.
    """
    extra = []
    if emulate_cuda:
        # two cuBLAS handles, so two workspaces: the forward thread's and the autograd device
        # thread's (shared/specs/cuda-caching-allocator.md, "cuBLAS workspace")
        extra.append(("cublas_workspace", workspace_bytes, MemoryCategory.TEMPORARY))
        extra.append(("cublas_workspace_backward", workspace_bytes, MemoryCategory.TEMPORARY))
    return analyse(capture.recorder.events, extra)


@contextlib.contextmanager
def _stacked(*contexts: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def default_forward_loss(training: TrainingConfig) -> Callable[[Any, Any], Any] | None:
    """The forward + loss ``training`` asks for beyond ``model(**batch).loss``, or None.

    Args:
        training: ``cut_cross_entropy``, ``chunked_cross_entropy``, the framework's
            ``loss_upcast`` and ``compile`` (the chunks' loss compiled, as torchtune's recipes
            compile it); ``torchtitan_compiles_loss`` (torchtitan >= 0.1 compiles its whole loss);
            ``training_loop`` (a loop that binds the output holds the chunks' logits).

    Returns:
        Cut Cross Entropy (``trainmem.trace.cut_loss``), the chunked cross-entropy
        (``trainmem.trace.chunked_loss``), Megatron's vocabulary-parallel one
        (``trainmem.trace.megatron_loss``: ``framework="megatron"``,
        :func:`megatron_loss_traced`) or None.
    """
    titan = training.torchtitan_compiles_loss
    if training.cut_cross_entropy:
        # Note [Cut Cross Entropy on a traced step] (trainmem/trace/cut_loss.py)
        from trainmem.trace.cut_loss import cut_cross_entropy_forward

        return cut_cross_entropy_forward(keep_output=training.training_loop != "drop")
    if megatron_loss_traced(training):
        from trainmem.trace.megatron_loss import megatron_cross_entropy_forward

        return megatron_cross_entropy_forward()
    if training.chunked_cross_entropy == 0 and not titan:
        return None
    from trainmem.trace.chunked_loss import chunked_cross_entropy_forward
    from trainmem.trace.prefix import with_prompt_labels

    keep = training.training_loop != "drop"  # the loop binds the output
    if titan:
        # Note [torchtitan's compiled cross-entropy] (trainmem/analytic/loss.py): the whole
        # logits one chunk, their upcast and the loss compiled together
        return chunked_cross_entropy_forward(1, upcast=True, compiled=True, keep_output=keep)
    chunked = chunked_cross_entropy_forward(
        training.chunked_cross_entropy,
        upcast=training.loss_upcast,
        compiled=training.compile,
        keep_output=keep,
    )
    # the model runs without its labels: peft's padding of them for prepended prompts
    return with_prompt_labels(chunked, training, key="labels")


def megatron_loss_traced(training: TrainingConfig) -> bool:
    """The loss is Megatron's vocabulary-parallel cross-entropy
    (``FrameworkConventions.vocab_parallel_cross_entropy``), unchunked and not replaced by
    ``TrainingConfig.loss``, as :func:`trainmem.analytic.loss.megatron_cross_entropy` has it
    for a causal LM (Note [Megatron's cross-entropy on a traced step],
    trainmem/trace/megatron_loss.py)."""
    return (
        training.conventions.vocab_parallel_cross_entropy
        and training.chunked_cross_entropy == 0
        and training.recipe_loss in (None, "cross-entropy")
    )


def _takes_argument(fn: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        for p in sig.parameters.values()
    )


def _estimate(
    name: str,
    capture: Capture,
    report: PeakReport,
    training: TrainingConfig,
    gpu: GPUSpec | None,
    workspace_bytes: int,
    layout: RankMap | None = None,
) -> MemoryEstimate:
    """The trace's draft estimate of its first rank; ``layout``: the world's rank map (default:
    one without the model's layer count, :func:`trainmem.specs.ranks.rank_map`)."""
    from trainmem.specs.ranks import rank_map
    from trainmem.specs.training import resolved_config
    from trainmem.trace.parallel import mesh_dims

    logging.getLogger("trainmem").debug(
        "traced %s in %.3f s (warm-up step %.3f s)",
        name,
        capture.trace_seconds,
        capture.warmup_seconds,
    )
    if layout is None:
        layout = rank_map(training, None)
    label = layout.ranks[0].to_json()
    per_rank = [
        {
            **label,
            "allocated_bytes": report.peak_bytes,
            "peak_phase": report.peak_phase,
            "peak_op": report.peak_op,
        }
    ]
    b = report.breakdown
    breakdown = MemoryBreakdown(
        parameters=b.parameters,
        gradients=b.gradients,
        optimizer_states=b.optimizer_states,
        activations=b.activations,
        temporary=b.temporary,
        fragmentation=0,
        cuda_context=DEFAULT_CUDA_CONTEXT_BYTES,
    )
    where = f" in {report.peak_module}" if report.peak_module else ""
    reason = (
        f"{report.peak_phase} peak at {report.peak_op or 'a registered block'}{where}: "
        f"{report.peak_bytes} B of tensors live"
    )
    return MemoryEstimate(
        model_name=name,
        engine="trace",
        num_parameters=capture.num_parameters,
        num_trainable_parameters=capture.num_trainable_parameters,
        breakdown=breakdown,
        peak_phase=report.peak_phase,
        peak_reason=reason,
        config=resolved_config(training),
        gpu_name=gpu.name if gpu else None,
        gpu_capacity_bytes=gpu.memory_bytes if gpu else None,
        details={
            "peak_allocated_bytes": report.peak_bytes,
            "per_rank": per_rank,
            "rank_map": layout.to_json(),
            "traced_mesh": mesh_dims(training),
            "peak_op": report.peak_op,
            "peak_module": report.peak_module,
            "peak_by_category_bytes": report.by_category_bytes,
            "phase_peaks_bytes": report.phase_peaks_bytes,
            "activation_bytes_by_module": report.activation_bytes_by_module,
            "peak_contributors": [
                {"module": m, "category": c, "bytes": n} for m, c, n in report.peak_contributors
            ],
            "cublas_workspace_bytes": workspace_bytes,
            "host_optimizer_state_bytes": capture.host_state_bytes,
            "traced_micro_batches": min(
                training.gradient_accumulation_steps, MAX_TRACED_MICRO_BATCHES
            ),
            "num_events": len(report.timeline),
            # No wall times here: the same command must give byte-identical JSON. They go to
            # the "trainmem" logger (debug level) instead.
        },
        recorded_timeline=report.timeline,
        rank_labels=[label],
        notes=[
            "trace engine: requested sizes, no 512 B rounding or fragmentation (allocator "
            "simulator's job); the CUDA context and the NCCL communicators are added, not traced",
        ],
    )


def _training(training: object) -> TrainingConfig:
    """``training`` itself, ``TrainingConfig()`` for None.

    Raises:
        SpecError: anything else (a dict of settings, a name).
    """
    if training is None:
        return TrainingConfig()
    if not isinstance(training, TrainingConfig):
        raise SpecError(
            "training",
            f"must be a trainmem.TrainingConfig (or None for the defaults), got "
            f"{type(training).__name__}",
        )
    return training


def estimate_trace(
    model_spec_or_name: ModelSpec | str,
    training: TrainingConfig,
    *,
    gpu: GPUSpec | str | None = None,
) -> MemoryEstimate:
    """Peak GPU memory of one steady-state training step of a preset / HF config, traced.

    The model is built by transformers from the config (``trainmem.specs.hf.load_hf_config``) on
    ``meta``, given fake storage, warmed up one step, and its second step recorded.

    Args:
        model_spec_or_name: a preset name, config path or hub id, or a
            :class:`~trainmem.specs.model.ModelSpec` (its ``name`` is loaded).
        training: micro-batch, sequence length, precision, optimizer, checkpointing, attention,
            gradient accumulation, dropout.
        gpu: the GPU for the verdict and the cuBLAS workspace size (a name or a GPUSpec).

    Returns:
        A :class:`~trainmem.breakdown.MemoryEstimate` with ``engine="trace"``, the breakdown at
        the traced peak, ``details`` (per-module tables, phase peaks, timings) and ``timeline``.

    Raises:
        SpecError: an unknown GPU, or a ``training`` that is not a TrainingConfig.
        UnsupportedError: model type or optimizer the trace cannot run.
        TraceError: the step failed under fake tensors.

    Source: shared/notes/tracing-without-a-gpu.md (method, measured exactness); CUDA behaviour
    from the modules named in this module's docstring.

    Known limitations: no fragmentation (allocator simulator) or CUDA context (a default
    allowance); attention kernels' internal workspaces (flash backward's fp32 dq accumulator)
    are not allocated by the ATen meta kernels and are missing; GradScaler not run; 8-bit
    optimizers unsupported.
    """
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.hf_model import build_hf_training_model, hf_loss, make_hf_batch

    training = _training(training)
    gpu = resolve_gpu(gpu)
    name = model_spec_or_name if isinstance(model_spec_or_name, str) else model_spec_or_name.name
    raw = load_hf_config(name)
    if training.pipeline_parallel_size > 1:
        raise UnsupportedError(
            "pipeline_parallel_size: pipeline stages are traced by "
            "trainmem.trace.pipeline.estimate_pipeline_trace (trainmem.trace.estimate_trace "
            "and estimate(..., engine='trace') route there)"
        )
    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    if family_row(raw.get("model_type")).not_transformers:
        from trainmem.trace.prefix import refuse_prefix_tuning

        refuse_prefix_tuning(training, "the CS336 course model")
        return _estimate_course(name, raw, training, gpu, ws, _layout(model_spec_or_name, training))
    if training.recipe_loss not in (None, "cross-entropy"):
        raise UnsupportedError(
            f"loss={training.recipe_loss} is traced for the CS336 course model only (a "
            "transformers model computes its own cross-entropy from the labels); use --engine "
            "analytic"
        )
    holder: dict[str, Any] = {}

    def build() -> Any:
        model = build_hf_training_model(raw, training)
        holder["model"] = model
        return model

    def batch() -> Any:
        return make_hf_batch(
            holder["model"],
            training.micro_batch_size,
            training.seq_len,
            training.target_seq_len,
            training.image_size,
        )

    capture, report = run_trace(
        build,
        batch,
        training,
        loss_fn=hf_loss,
        workspace_bytes=ws,
        forward_loss=default_forward_loss(training),
    )
    layout = _layout(model_spec_or_name, training)
    return _estimate(name, capture, report, training, gpu, ws, layout)


def _layout(model: ModelSpec | str, training: TrainingConfig) -> RankMap:
    """The rank map of a traced model: with its blocks and tied embeddings when a
    :class:`~trainmem.specs.model.ModelSpec` describes it, else without the layer count."""
    from trainmem.specs.ranks import model_rank_map, rank_map

    return rank_map(training, None) if isinstance(model, str) else model_rank_map(model, training)


def _estimate_course(
    name: str,
    raw: dict[str, Any],
    training: TrainingConfig,
    gpu: GPUSpec | None,
    ws: int,
    layout: RankMap,
) -> MemoryEstimate:
    """The CS336 course model (``model_type: "cs336_basics"``) traced: built from its config by
    :mod:`trainmem.trace.course_model`, fed (b, s) token ids that are also its targets, with the
    loss ``training.loss`` names (the course's cross-entropy when None, the family's own)."""
    from trainmem.trace.course_model import build_course_model, course_loss

    if training.chunked_cross_entropy:
        raise UnsupportedError(
            "chunked_cross_entropy is not traced for the CS336 course model (its loss is "
            "computed on the whole logits); use --engine analytic"
        )
    vocab = int(raw["vocab_size"])
    b, s = training.micro_batch_size, training.seq_len
    capture, report = run_trace(
        lambda: build_course_model(raw),
        lambda: torch.randint(0, vocab, (b, s)),
        training,
        loss_fn=course_loss(training.loss or "cs336-cross-entropy"),
        workspace_bytes=ws,
    )
    est = _estimate(name, capture, report, training, gpu, ws, layout)
    est.config["loss"] = training.loss or "cs336-cross-entropy"
    return est


def trace(
    build_model: Callable[[], Any],
    make_batch: Callable[..., Any],
    *,
    training: TrainingConfig | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    gpu: GPUSpec | str | None = None,
    name: str = "custom",
) -> MemoryEstimate:
    """Trace one steady-state training step of any ``nn.Module``.

    Args:
        build_model: returns the model; runs under ``torch.device("meta")`` so it allocates
            nothing (build layers in ``__init__`` as usual; no data-dependent init).
        make_batch: returns one micro-batch: a dict (``model(**batch)``), a tuple
            (``model(*batch)``) or a tensor; may accept the ``TrainingConfig``. Runs on fake
            tensors, so use ``torch.randn`` / ``torch.randint``, never real data.
        training: defaults to ``TrainingConfig()`` (bf16-mixed AdamW foreach).
        loss_fn: ``loss_fn(output, batch) -> scalar``; default ``output.loss`` or a scalar output.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; default from ``training``.
        gpu: the GPU for the verdict and the cuBLAS workspace size: a name as ``estimate``
            takes it (``"RTX-4090"``, ``"24GB"``) or a GPUSpec.
        name: label of the result.

    Returns:
        The :class:`~trainmem.breakdown.MemoryEstimate` (``engine="trace"``, ``timeline``).

    Raises:
        SpecError: an unknown GPU, or a ``training`` that is not a TrainingConfig.
        TraceError: the step failed on fake tensors, or no loss could be found.
    """
    training = _training(training)
    gpu = resolve_gpu(gpu)
    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    capture, report = run_trace(
        build_model, make_batch, training, loss_fn=loss_fn, optimizer=optimizer, workspace_bytes=ws
    )
    return _estimate(name, capture, report, training, gpu, ws)
