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

from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

BNB_BLOCKWISE_BLOCK_SIZE = 256
"""Block size of bitsandbytes' block-wise quantized optimizer states (one fp32 absmax per 256
values). Source: bitsandbytes/functional.py ``create_dynamic_map`` /
``optimizer_update_8bit_blockwise``
(blocksize 256 for 8-bit optimizer states)."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit states for tensors with fewer elements than this
(``Optimizer8bit`` ``min_8bit_size=4096``, bitsandbytes/optim/optimizer.py)."""


def optimizer_state_bytes_per_parameter(training: TrainingConfig) -> float:
    """Optimizer-state bytes per trainable parameter of a large (>= 4096 elements) tensor.

    Source: torch/optim/{sgd,adam,adamw,adafactor}.py state dicts (``momentum_buffer``;
    ``exp_avg``, ``exp_avg_sq``), lucidrains/lion-pytorch and torch ``Lion`` semantics (one
    ``exp_avg``), bitsandbytes ``AdamW8bit`` (``state1``/``state2`` uint8 + ``absmax1``/``absmax2``
    fp32 per 256-value block).

    Adafactor's factored second moment (row + column vectors) is not per parameter; see
    :func:`optimizer_state_bytes`.
    """
    w = dtype_bytes(training.optimizer_state_dtype)
    master = 4.0 if training.fp32_master_copy else 0.0
    opt = training.optimizer
    if opt == "sgd":
        return master
    if opt in ("sgd-momentum", "lion"):
        return master + w
    if opt in ("adam", "adamw"):
        return master + 2 * w
    if opt == "paged-adamw":
        # bitsandbytes 32-bit optimizer: ``get_state_buffer(p, dtype=torch.float32)``
        return master + 2 * 4
    if opt in ("adamw-8bit", "paged-adamw-8bit"):
        return master + 2 * (1 + 4 / BNB_BLOCKWISE_BLOCK_SIZE)
    if opt == "adafactor":
        return master  # factored: see optimizer_state_bytes
    if opt == "adamw-4bit":  # torchao: packed 4-bit codes + fp32 scale per 128 (two states)
        return master + 2 * (0.5 + 4 / 128)
    if opt == "adamw-fp8":  # torchao: float8 codes + fp32 scale per 256 (two states)
        return master + 2 * (1 + 4 / 256)
    raise AssertionError(opt)  # TrainingConfig validated the name


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
    w = dtype_bytes(training.optimizer_state_dtype)
    num_matrix = sum(r * c * n for r, c, n in matrix_shapes)
    # DeepSpeed / Megatron: an fp32 master copy of every trainable parameter (Note [Model
    # states per precision]); DeepSpeed's ZeRO-1/2 keep one of fp32 weights too
    master = 4 * (num_matrix + num_vector_parameters) if training.fp32_master_copy else 0
    if training.optimizer == "adafactor":
        return master + w * (sum((r + c) * n for r, c, n in matrix_shapes) + num_vector_parameters)
    if training.optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        # Per large tensor: two uint8 states + two fp32 absmax per started block of 256
        # (bitsandbytes ``blocks = ceil(n / blocksize)``); small tensors: two fp32 states.
        small = sum(r * c * n for r, c, n in matrix_shapes if r * c < BNB_MIN_8BIT_SIZE)
        small += num_vector_parameters
        large = sum(
            n * (2 * r * c + 2 * 4 * -(-(r * c) // BNB_BLOCKWISE_BLOCK_SIZE))
            for r, c, n in matrix_shapes
            if r * c >= BNB_MIN_8BIT_SIZE
        )
        return master + large + small * 2 * 4
    if training.optimizer in TORCHAO_LOW_BIT_BLOCK:
        return master + torchao_low_bit_state_bytes(training, matrix_shapes, num_vector_parameters)
    per = optimizer_state_bytes_per_parameter(training)
    return round((num_matrix + num_vector_parameters) * per)


TORCHAO_LOW_BIT_BLOCK: dict[str, int] = {"adamw-4bit": 128, "adamw-fp8": 256}
"""Quantization block of torchao's low-bit AdamW states (torchao optim/adam.py: ``AdamW4bit(...,
block_size=128)``, ``AdamWFp8(..., block_size=256)``)."""
TORCHAO_MIN_QUANTIZED_SIZE = 4096
"""torchao quantizes a state only for tensors of at least 4096 elements whose size the block
divides (optim/adam.py ``_new_buffer``: ``p.numel() >= 4096 and p.numel() % block_size == 0``);
other tensors keep ``torch.zeros_like(p)`` states."""


def torchao_low_bit_state_bytes(
    training: TrainingConfig, matrix_shapes: list[tuple[int, int, int]], num_vector_parameters: int
) -> int:
    """Bytes of torchao ``AdamW4bit`` / ``AdamWFp8`` states (exp_avg and exp_avg_sq), without a
    master copy.

    Per quantized tensor of n elements, each of the two states holds codes and one fp32 scale
    per block: 4-bit ``OptimState4bit`` n / 2 bytes of packed codes + 4 n / 128; FP8
    ``OptimStateFp8`` n bytes of float8_e4m3fn codes + 4 n / 256. Other tensors (under 4096
    elements, or not a multiple of the block) keep two states in the parameter's dtype. The
    16- / 256-entry quantization maps are shared per tensor and ignored (< 1 KiB).

    Source: torchao optim/adam.py ``_AdamBase._new_buffer``, optim/subclass_4bit.py
    ``OptimState4bit.zeros``, optim/subclass_fp8.py ``OptimStateFp8.zeros`` (README: "AdamW4bit
    ... block_size 128", "AdamWFp8 ... block_size 256").
    """
    block = TORCHAO_LOW_BIT_BLOCK[training.optimizer]
    w = dtype_bytes(training.optimizer_state_dtype)

    def one(numel: int) -> int:
        if numel < TORCHAO_MIN_QUANTIZED_SIZE or numel % block:
            return 2 * w * numel
        if training.optimizer == "adamw-4bit":
            return 2 * (numel // 2 + 4 * (numel // block))
        return 2 * (numel + 4 * (numel // block))

    # the 1-D elements are one tensor (tensor_states asks per tensor)
    total = one(num_vector_parameters) if num_vector_parameters else 0
    return total + sum(n * one(r * c) for r, c, n in matrix_shapes)


def zero_paper_model_state_bytes(num_parameters: int, k: int = 12) -> int:
    """Model states of mixed-precision Adam as the ZeRO paper counts them: (2 + 2 + K) * Psi.

    Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", arXiv:1910.02054, sec. 3.1 (K = 12: fp32 parameters, momentum, variance).
    """
    psi = num_parameters
    return (2 + 2 + k) * psi
