"""Temporary buffers of the optimizer step and the fixed workspaces, in bytes.

Note [Optimizer-step temporaries]
    torch.optim's ``foreach`` Adam/AdamW (the CUDA default, torch/optim/adam.py
    ``_multi_tensor_adam``) updates moments in place but materialises
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` for a whole parameter group: one extra
    copy of the group's parameters in the state dtype. The ``for-loop`` implementation
    (``_single_tensor_adam``) builds ``denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)``: two
    tensors the size of the largest parameter. ``fused`` (``_fused_adamw_``) needs none.
    Measured on GPT-2 small fp32 (shared/notes/tracing-without-a-gpu.md sec. 4): optimizer-phase
    peak 1.85 GiB fused, 2.14 for-loop, 2.32 foreach over 1.854 GiB of model states, i.e. +0,
    +2 x 0.144 GiB (wte) and +0.4636 GiB (one copy of the parameters).
    Before torch 2.1 the foreach step held two such copies: torch 2.0.1 adam.py / adamw.py
    ``_multi_tensor_adam(w)`` builds ``exp_avg_sq_sqrt = torch._foreach_sqrt(...)`` and then
    ``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)`` out of place, both alive at
    ``_foreach_addcdiv_``; torch 2.1.0 adds ``eps`` in place (pytorch PRs #104780 Adam and
    #104898 AdamW, July 2023, issue #97712 "Foreach optimizers use higher memory due to
    intermediates"). ``OptimizerRow.older_torch`` carries it; ``--torch-version`` selects it.
    HF Adafactor (transformers/optimization.py ``Adafactor.step``, 4.4x to 5.x) works one
    parameter at a time in fp32: ``grad.float()`` and ``p.float()`` copy a 16-bit gradient and
    weight (kept to the end of the parameter's step), ``update = (grad**2) + eps`` holds two
    fp32 tensors while the sum is built, the factored ``update = _approx_sq_grad(...)`` again two
    (the new product beside the old ``update``), and ``p_data_fp32.add_(-update)`` two
    (``-update`` beside ``update``): 2 fp32 temporaries of the largest trainable parameter, plus
    one for each of its gradient and weight stored in 16 bits; and ``update`` stays bound past
    the parameter's iteration until the next one's ``(grad**2) + eps`` is built, so each
    parameter's peak also holds the previous parameter's fp32 ``update``
    (:func:`carried_step_bytes`). Under FSDP1 with ``use_orig_params=False`` (accelerate's,
    fsdp_qlora's) the parameters the loop steps are the units' flat parameters (local shards):
    the root's (embedding, final norm, head) and each layer's whole. bf16-true 2-layer
    1024-wide Llama (vocabulary 4096) on one GPU (NO_SHARD): a layer's flat parameter holds
    4 x 1024^2 + 3 x 1024 x 2816 + 2 x 1024 = 12,847,104 elements, so the second layer's step
    peaks at 4 B x (2 + 2) x 12,847,104 + 4 B x 12,847,104 (the first layer's ``update``) =
    256,942,080 B, where the per-tensor reading had 4 B x 4 x 4,194,304 (the embedding) =
    67,108,864 B (Note [Factored states of flat parameters] for its states).
    ``torch.optim.Adafactor`` builds
    one ``var_estimate`` (``row_var @ col_var``) per parameter in its dtype, for all of them at
    once with foreach; Lion (lion-pytorch / torch) two; bitsandbytes 8-bit kernels, torchao's
    low-bit AdamW (compiled per parameter) and Megatron's / DeepSpeed's fused Adam update in
    place.
    The CS336 course's AdamW (``cs336``: cs336_basics/optimizer.py ``AdamW.step``) loops over
    the parameters and writes every update out of place: ``m_t = beta_1 * prev_m_t + ((1 -
    beta_1) * grad)``, ``v_t = beta_2 * prev_v_t + ((1 - beta_2) * torch.square(grad))`` are new
    tensors (the old moments stay referenced by ``prev_m_t`` / ``prev_v_t`` and by the state
    until ``state["m"] = m_t``), then ``p.data -= alpha_t * m_t / (torch.sqrt(v_t) + eps)``
    holds ``alpha_t * m_t``, the denominator (``sqrt`` freed once ``+ eps`` has run) and the
    quotient: five tensors of the parameter at once beside its states (m_t, v_t and three),
    against the torch for-loop's two.
    An EMA of the weights (``TrainingConfig.ema``, Note [EMA weights] in ``tensor_states.py``)
    is stepped after the optimizer: diffusers' ``EMAModel.step`` (diffusers 0.42.1
    src/diffusers/training_utils.py, default ``foreach=False``) runs ``s_param.sub_(
    one_minus_decay * (s_param - param))`` one parameter at a time: ``s_param - param`` and its
    product with the scalar are two tensors of the parameter, in the wider of the EMA's and the
    weight's dtypes (type promotion). With ``ema_device="cpu"`` the whole copy is first moved
    to the GPU (``ema_unet.to(device="cuda")``), so it is a temporary of the step too. The
    optimizer's temporaries are freed when ``optimizer.step()`` returns, so the step's peak
    temporary is the larger of the two.
"""

from __future__ import annotations

from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.specs.frameworks import parse_version
from trainmem.specs.optimizers import CS336_ADAMW_TEMPORARIES as CS336_ADAMW_TEMPORARIES
from trainmem.specs.optimizers import OPTIMIZER_TABLE, StepTemporaries
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def optimizer_step_temporary_bytes(
    training: TrainingConfig, *, num_trainable_parameters: int, largest_parameter: int
) -> int:
    """Peak temporary bytes of ``optimizer.step()`` and, with ``ema``, the EMA update after it.
    See Note [Optimizer-step temporaries].

    Args:
        training: optimizer, implementation and precision.
        num_trainable_parameters: elements updated by the optimizer (one group assumed).
        largest_parameter: elements of the largest trainable tensor.

    Returns:
        Bytes.
    """
    step = _optimizer_only_temporary_bytes(
        training,
        num_trainable_parameters=num_trainable_parameters,
        largest_parameter=largest_parameter,
    )
    if not training.ema:
        return step
    return max(
        step, ema_step_temporary_bytes(training, num_trainable_parameters, largest_parameter)
    )


EMA_STEP_TEMPORARIES = 2
"""Parameter-sized temporaries of diffusers' per-parameter ``EMAModel.step``: ``s_param - param``
and ``one_minus_decay * (...)`` (Note [Optimizer-step temporaries])."""


def ema_step_temporary_bytes(
    training: TrainingConfig, num_trainable_parameters: int, largest_parameter: int
) -> int:
    """Peak temporary bytes of diffusers' ``EMAModel.step`` (``foreach=False``, its default),
    with the copy moved to the GPU for it when ``ema_device="cpu"``.

    Args:
        training: ``ema_dtype``, ``ema_device`` and the weights' dtype.
        num_trainable_parameters: elements of the EMA copy.
        largest_parameter: elements of the largest trainable tensor.

    Returns:
        Bytes.

    Source: diffusers 0.42.1 src/diffusers/training_utils.py ``EMAModel.step``.
    """
    weight = lora_adapter_dtype(training) if training.frozen_base else training.weight_dtype
    ema = dtype_bytes(training.ema_dtype or weight)
    wide = max(ema, dtype_bytes(weight))  # s_param - param promotes to the wider dtype
    moved = ema * num_trainable_parameters if training.ema_device == "cpu" else 0
    return moved + EMA_STEP_TEMPORARIES * wide * largest_parameter


def _optimizer_only_temporary_bytes(
    training: TrainingConfig, *, num_trainable_parameters: int, largest_parameter: int
) -> int:
    """The step temporaries of the optimizer's row (:data:`~trainmem.specs.optimizers.
    OPTIMIZER_TABLE`) for the implementation that runs, in the dtype the row names."""
    tmp = _step_temporaries(training)
    copies = tmp.group_copies * num_trainable_parameters + tmp.largest_copies * largest_parameter
    if tmp.upcasts_16bit:  # transformers' Adafactor.step, Note [Optimizer-step temporaries]
        weight = lora_adapter_dtype(training) if training.frozen_base else training.weight_dtype
        grad = weight if training.frozen_base else training.grad_dtype
        upcasts = (dtype_bytes(grad) < 4) + (dtype_bytes(weight) < 4)
        copies += upcasts * largest_parameter
    kernels = -(-tmp.largest_bytes_per_256 * largest_parameter // 256)  # torchao's compiled step
    return _temporary_dtype_bytes(training, tmp) * copies + kernels


def _step_temporaries(training: TrainingConfig) -> StepTemporaries:
    """The optimizer row's temporaries for the implementation (and class) that runs."""
    return OPTIMIZER_TABLE[training.optimizer].step_temporaries(
        training.step_implementation,
        transformers_class=training.adafactor_implementation == "transformers",
        torch_version=parse_version("torch_version", training.torch_version),
    )


def steps_per_parameter(training: TrainingConfig) -> bool:
    """The optimizer steps one parameter at a time whatever ``optimizer_implementation``
    says: torchao's low-bit AdamW, whose compiled ``single_param_adam`` runs per parameter
    (Note [torchao low-bit AdamW step] in ``specs/optimizers.py``), and transformers'
    Adafactor, a Python loop over ``group["params"]`` (transformers/optimization.py
    ``Adafactor.step``)."""
    tmp = _step_temporaries(training)
    return tmp.largest_bytes_per_256 > 0 or tmp.upcasts_16bit


def carried_step_bytes(training: TrainingConfig, elements: int) -> int:
    """Bytes of one parameter's step a per-parameter loop keeps until the next parameter's
    step has made its own (``StepTemporaries.carried_fp32_copies``): transformers' Adafactor
    binds ``update`` (fp32, the parameter's size: ``exp_avg_sq.rsqrt().mul_(grad)`` or the
    factored ``_approx_sq_grad(...)``) to the end of the parameter's iteration, and the next
    iteration rebinds it only once ``(grad**2) + eps`` exists, after ``grad.float()`` and
    ``p.float()``: so that parameter's peak has the previous ``update`` beside it
    (transformers/optimization.py ``Adafactor.step``, 4.4x to 5.24; Note
    [Optimizer-step temporaries]). 0 for every other step.

    Args:
        training: optimizer, implementation and torch release.
        elements: elements of the previous parameter (its local shard).

    Returns:
        Bytes.
    """
    return 4 * _step_temporaries(training).carried_fp32_copies * elements


def _temporary_dtype_bytes(training: TrainingConfig, tmp: StepTemporaries) -> int:
    if tmp.dtype == "float32":
        return 4
    if tmp.dtype == "weight":  # the stepped tensor's: DeepSpeed's / Megatron's fp32 master copy
        return 4 if training.fp32_master_copy else dtype_bytes(training.weight_dtype)
    return dtype_bytes(training.optimizer_state_dtype)


def cublas_workspace_bytes(per_handle_bytes: int, num_handles: int = 2) -> int:
    """cuBLAS workspaces held through the caching allocator: one per (handle, stream); training
    has two, the forward thread's and the autograd device thread's.

    Source: shared/specs/cuda-caching-allocator.md sec. 5.3; PyTorch
    aten/src/ATen/cuda/CublasHandlePool.cpp ``getChosenWorkspaceSize`` (default
    ``:4096:2:16:8`` = 8,519,680 B; 32 MiB on compute capability 9.x since PR #89027).
    """
    return per_handle_bytes * num_handles
