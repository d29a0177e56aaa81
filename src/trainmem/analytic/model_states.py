"""Model states: parameters, gradients and optimizer states, in bytes, for one GPU.

Legend: P = trainable parameters, F = frozen parameters, w = bytes per stored weight
(``TrainingConfig.weight_dtype``).

Note [Model states per precision]
    PyTorch AMP (``16-mixed``/``bf16-mixed``) keeps fp32 weights, which double as master weights,
    and fp32 gradients (``param.grad`` has the parameter's dtype); Adam keeps ``exp_avg`` and
    ``exp_avg_sq`` in the parameter's dtype: 4 + 4 + 8 = 16 bytes per parameter. The ZeRO paper
    (Rajbhandari et al. 2020, arXiv:1910.02054, sec. 3.1) counts Megatron/DeepSpeed-style mixed
    precision, 2 (fp16 weights) + 2 (fp16 gradients) + K * P with K = 12 (fp32 master weights,
    momentum, variance): also 16 bytes per parameter, but split differently. ``*-true`` precisions
    keep everything, optimizer states included, in the one dtype (Lightning ``HalfPrecision``,
    torchtune/litgpt ``bf16-true``): 2 + 2 + 4 = 8 bytes per parameter for AdamW. With
    ``framework="deepspeed"`` / ``"megatron"`` the ZeRO paper's split is modelled: 16-bit weights
    and gradients (fp32 gradients for Megatron), the fp32 master copy counted as optimizer state
    (Note [Framework conventions] in ``specs/training.py``). DeepSpeed's ZeRO-1/2 optimizer
    keeps an fp32 copy of its partition of fp32 (``32-true``) weights too: 4 + 4 + (4 + 8) / N
    bytes per parameter for AdamW over N ranks at stage 1, 4 + (4 + 4 + 8) / N at stage 2
    (``TrainingConfig.fp32_master_copy``, deepspeed/runtime/zero/stage_1_and_2.py
    ``single_partition_of_fp32_groups``).

    The 16-bit weight copies that autocast makes for the forward pass are per-step tensors, not
    model states; they are counted with the activations (see ``activations.py``).
"""

from __future__ import annotations

from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def optimizer_state_bytes_per_parameter(training: TrainingConfig) -> float:
    """Optimizer-state bytes per trainable parameter of a large (>= 4096 elements) tensor: the
    optimizer's row of :data:`~trainmem.specs.optimizers.OPTIMIZER_TABLE` (its states, their
    dtype, or its block-wise codes and one fp32 scale per block), plus an fp32 master copy.

    Source: torch/optim/{sgd,adam,adamw,adafactor}.py state dicts (``momentum_buffer``;
    ``exp_avg``, ``exp_avg_sq``), lucidrains/lion-pytorch and torch ``Lion`` semantics (one
    ``exp_avg``), bitsandbytes ``AdamW8bit`` (``state1``/``state2`` uint8 + ``absmax1``/``absmax2``
    fp32 per 256-value block), torchao ``AdamW4bit`` / ``AdamWFp8`` (each row's ``source``).

    Adafactor's factored second moment (row + column vectors) is not per parameter; see
    :func:`optimizer_state_bytes`.
    """
    row = OPTIMIZER_TABLE[training.optimizer]
    master = 4.0 if training.fp32_master_copy else 0.0
    if row.factored:
        return master  # factored: see optimizer_state_bytes
    q = row.blockwise
    if q is not None:
        return master + row.num_states * (q.code_bits / 8 + q.scale_bytes / q.block_size)
    return master + row.num_states * row.wide_state_bytes(training.optimizer_state_dtype)


def optimizer_state_bytes(
    training: TrainingConfig,
    matrix_shapes: list[tuple[int, int, int]],
    num_vector_parameters: int,
) -> int:
    """Optimizer states of the trainable parameters, in bytes.

    Args:
        training: the optimizer and precision.
        matrix_shapes: ``(rows, cols, count)`` of every trainable 2-D weight.
        num_vector_parameters: elements of trainable 1-D tensors (biases, norm weights).

    Returns:
        Bytes of optimizer state.

    Source: as :func:`optimizer_state_bytes_per_parameter`; Adafactor follows
    transformers.optimization.Adafactor (default ``beta1=None``: no first moment;
    ``exp_avg_sq_row`` [rows] + ``exp_avg_sq_col`` [cols] for matrices, full ``exp_avg_sq`` for
    vectors, in the gradient's dtype) (Shazeer & Stern 2018, arXiv:1804.04235, sec. 3).
    bitsandbytes 8-bit optimizers keep 32-bit states for tensors under 4096 elements
    (``BNB_MIN_8BIT_SIZE``); we treat every 1-D tensor as such.
    """
    row = OPTIMIZER_TABLE[training.optimizer]
    w = dtype_bytes(training.optimizer_state_dtype)
    num_matrix = sum(r * c * n for r, c, n in matrix_shapes)
    # DeepSpeed / Megatron: an fp32 master copy of every trainable parameter (Note [Model
    # states per precision]); DeepSpeed's ZeRO-1/2 keep one of fp32 weights too
    master = 4 * (num_matrix + num_vector_parameters) if training.fp32_master_copy else 0
    if row.factored:
        return master + w * (sum((r + c) * n for r, c, n in matrix_shapes) + num_vector_parameters)
    if row.blockwise is not None:
        return master + blockwise_state_bytes(training, matrix_shapes, num_vector_parameters)
    per = optimizer_state_bytes_per_parameter(training)
    return round((num_matrix + num_vector_parameters) * per)


def flat_state_bytes(training: TrainingConfig, numel: int, *, flat_numel: int | None = None) -> int:
    """Optimizer states (with the fp32 master copy) of ``numel`` elements of a flat 1-D tensor
    the optimizer steps as one (:func:`~trainmem.specs.ranks.flat_optimizer_tensors`), in
    bytes.

    Note [Optimizer states of flat tensors]
        DeepSpeed's optimizer wrappers (ZeRO-1/2/3, ``BF16_Optimizer``, ``FP16_Optimizer``)
        hand the client optimizer one flat fp32 partition per parameter group (ZeRO-3: per
        sub-group), and FSDP1 with ``use_orig_params=False`` each unit's 1-D
        ``FlatParameter`` (shard); sources at :func:`~trainmem.specs.ranks.
        flat_optimizer_tensors`. So the optimizer never sees a matrix, nor a small tensor:
        - Adafactor is not factored (transformers/optimization.py ``_get_options``:
          ``factored = len(param_shape) >= 2``; torch.optim.Adafactor likewise): a full second
          moment, one state element per trainable element (the vector path of
          :func:`optimizer_state_bytes`);
        - bitsandbytes' 8-bit optimizers quantize the whole flat tensor when it has at least
          ``min_8bit_size`` (4096) elements (bitsandbytes/optim/optimizer.py
          ``Optimizer2State.init_state``: ``if p.numel() < config["min_8bit_size"]: dtype =
          torch.float32``), biases and norm weights included: ``states`` x (1 byte of code + 4 /
          256 bytes of absmax) per element, the last block's rounding spread over the
          tensors (< 8 bytes per flat tensor and state).
        A flat tensor's size is ``flat_numel`` when known (FSDP1 under LoRA, where each
        adapter is a unit of its own: its shard), else taken as at least 4096 elements (a
        DeepSpeed partition, an FSDP1 decoder layer's shard). torchao's rows quantize only a
        tensor the block divides, so they depend on the partition's padded size, not
        modelled: their per-tensor rule stays (:func:`blockwise_state_bytes`).

    Args:
        training: the optimizer and precision.
        numel: trainable elements of the flat tensor sized here (a share of it).
        flat_numel: elements of the whole flat tensor on this rank, or None (large).

    Returns:
        Bytes of optimizer state of ``numel`` elements.
    """
    row = OPTIMIZER_TABLE[training.optimizer]
    q = row.blockwise
    small = flat_numel is not None and q is not None and flat_numel < q.min_numel
    if q is None or q.block_must_divide or small:
        return optimizer_state_bytes(training, [], numel)  # a 1-D tensor's states
    return round(numel * optimizer_state_bytes_per_parameter(training))


def blockwise_state_bytes(
    training: TrainingConfig, matrix_shapes: list[tuple[int, int, int]], num_vector_parameters: int
) -> int:
    """Bytes of block-wise quantized states (bitsandbytes 8-bit, torchao ``AdamW4bit`` /
    ``AdamWFp8``), without a master copy.

    Per quantized tensor of n elements, each state holds codes and one fp32 scale per started
    block: bitsandbytes 8-bit n bytes of uint8 codes + 4 ceil(n / 256) (blocks = ceil(n /
    blocksize)); torchao 4-bit ``OptimState4bit`` n / 2 bytes of packed codes + 4 n / 128, FP8
    ``OptimStateFp8`` n bytes of float8_e4m3fn codes + 4 n / 256. Other tensors keep full
    states: bitsandbytes fp32 under 4096 elements (and, as modelled, every 1-D tensor); torchao
    the parameter's dtype under 4096 elements or when the block does not divide n. The 16- /
    256-entry quantization maps are shared per tensor and ignored (< 1 KiB).

    Source: bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``; torchao
    optim/adam.py ``_AdamBase._new_buffer``, optim/subclass_4bit.py ``OptimState4bit.zeros``,
    optim/subclass_fp8.py ``OptimStateFp8.zeros`` (README: "AdamW4bit ... block_size 128",
    "AdamWFp8 ... block_size 256"); the parameters of each are its row's ``blockwise``.
    """
    row = OPTIMIZER_TABLE[training.optimizer]
    q = row.blockwise
    assert q is not None, row.name
    wide = dtype_bytes(q.small_dtype or training.optimizer_state_dtype)
    states = row.num_states

    def one(numel: int) -> int:
        return q.tensor_bytes(numel, states, wide)

    # the 1-D elements are one tensor (tensor_states asks per tensor)
    if q.vectors_quantized:
        total = one(num_vector_parameters) if num_vector_parameters else 0
    else:
        total = states * wide * num_vector_parameters
    return total + sum(n * one(r * c) for r, c, n in matrix_shapes)


def zero_paper_model_state_bytes(num_parameters: int, k: int = 12) -> int:
    """Model states of mixed-precision Adam as the ZeRO paper counts them: (2 + 2 + K) * Psi.

    Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", arXiv:1910.02054, sec. 3.1 (K = 12: fp32 parameters, momentum, variance).
    """
    psi = num_parameters
    return (2 + 2 + k) * psi
