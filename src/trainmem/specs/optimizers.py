"""The optimizer table: one row per optimizer trainmem models, read by every stage.

A row says what an optimizer keeps per trainable parameter and what its step allocates:

- ``states``: the per-parameter state tensors (``exp_avg``, ``exp_avg_sq``...), in the row's
  fixed ``state_dtype`` or, when that is None, in ``TrainingConfig.optimizer_state_dtype``
  (the parameter's dtype, fp32 beside master weights);
- ``factored``: Adafactor's row and column second-moment vectors instead of full states;
- ``blockwise``: block-wise quantized states (bitsandbytes 8-bit, torchao 4-bit / FP8): code
  bits, block size, scale bytes, and which tensors keep unquantized states;
- ``temporaries``: the parameter-sized temporaries of ``optimizer.step()`` for each
  implementation the optimizer runs with (Note [Optimizer-step temporaries] in
  ``analytic/temporaries.py``); its keys are the accepted ``optimizer_implementation`` values;
- ``paged``: bitsandbytes paged states (CUDA managed memory, outside the caching allocator);
- ``torch_optim``: the ``torch.optim`` class the generic (trace) path builds, or None when it
  cannot run on fake CPU tensors (``untraceable`` says why);
- ``source``: the file of torch.optim / bitsandbytes / torchao / transformers the row mirrors.

Adding an optimizer is one row here plus its expected bytes in
``tests/analytic/test_optimizer_table.py`` (which fails for a row without them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from trainmem.units import dtype_bytes

__all__ = [
    "BNB_BLOCKWISE_BLOCK_SIZE",
    "BNB_MIN_8BIT_SIZE",
    "CS336_ADAMW_TEMPORARIES",
    "OPTIMIZER_TABLE",
    "TORCHAO_4BIT_STEP_BYTES_PER_256",
    "TORCHAO_8BIT_STEP_BYTES_PER_256",
    "TORCHAO_FP8_STEP_BYTES_PER_256",
    "TORCHAO_MIN_QUANTIZED_SIZE",
    "Blockwise",
    "OlderTorch",
    "Optimizer",
    "OptimizerRow",
    "StepTemporaries",
]

BNB_BLOCKWISE_BLOCK_SIZE = 256
"""Block size of bitsandbytes' block-wise quantized optimizer states (one fp32 absmax per 256
values). Source: bitsandbytes/functional.py ``create_dynamic_map`` /
``optimizer_update_8bit_blockwise``
(blocksize 256 for 8-bit optimizer states)."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit states for tensors with fewer elements than this
(``Optimizer8bit`` ``min_8bit_size=4096``, bitsandbytes/optim/optimizer.py)."""

TORCHAO_MIN_QUANTIZED_SIZE = 4096
"""torchao quantizes a state only for tensors of at least 4096 elements whose size the block
divides (optim/adam.py ``_new_buffer``: ``p.numel() >= 4096 and p.numel() % block_size == 0``);
other tensors keep ``torch.zeros_like(p)`` states."""

CS336_ADAMW_TEMPORARIES = 5
"""Parameter-sized temporaries of the CS336 course's AdamW at its peak (Note [Optimizer-step
temporaries] in ``analytic/temporaries.py``)."""

Optimizer = Literal[
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adafactor",
    "lion",
    "adamw-8bit",
    "paged-adamw-8bit",
    "paged-adamw",
    "ao-adamw-8bit",
    "adamw-4bit",
    "adamw-fp8",
]
"""``TrainingConfig.optimizer``: the keys of :data:`OPTIMIZER_TABLE` (a test keeps them equal)."""
TemporaryDtype = Literal["state", "weight", "float32"]


@dataclass(frozen=True, slots=True)
class Blockwise:
    """Block-wise quantized optimizer states: each state of a quantized tensor of n elements is
    ``n * code_bits / 8`` bytes of codes plus ``scale_bytes`` per started block of
    ``block_size`` values; other tensors keep unquantized states.

    Attributes:
        code_bits: bits per quantized value (8: uint8 / float8 codes; 4: two codes per byte).
        block_size: values per absmax / scale.
        scale_bytes: bytes of one absmax / scale (fp32: 4).
        min_numel: tensors with fewer elements keep unquantized states.
        block_must_divide: only tensors whose element count the block divides are quantized
            (torchao); bitsandbytes quantizes a partial last block.
        small_dtype: dtype of the unquantized states: ``float32`` (bitsandbytes' 32-bit
            fallback), or None for ``TrainingConfig.optimizer_state_dtype`` (torchao's
            ``torch.zeros_like(p)``).
        vectors_quantized: 1-D tensors are quantized like matrices when large enough (torchao);
            False: every 1-D tensor (bias, norm weight) keeps unquantized states, as the
            bitsandbytes rows assume (they are under ``min_numel`` in the models trainmem
            knows).
    """

    code_bits: int
    block_size: int
    scale_bytes: int
    min_numel: int
    block_must_divide: bool
    small_dtype: str | None
    vectors_quantized: bool

    def tensor_bytes(self, numel: int, num_states: int, wide_bytes: int) -> int:
        """Bytes of ``num_states`` states of one tensor of ``numel`` elements, whose unquantized
        states take ``wide_bytes`` bytes per element (quantized blocks: ``ceil(numel /
        block_size)``, bitsandbytes ``blocks = ceil(n / blocksize)``)."""
        if numel < self.min_numel or (self.block_must_divide and numel % self.block_size):
            return num_states * wide_bytes * numel
        blocks = -(-numel // self.block_size)
        return num_states * (numel * self.code_bits // 8 + self.scale_bytes * blocks)


@dataclass(frozen=True, slots=True)
class StepTemporaries:
    """Parameter-sized temporaries one ``optimizer.step()`` implementation holds at its peak.

    Attributes:
        group_copies: copies of every trainable parameter at once (a foreach step over one
            parameter group).
        largest_copies: copies of the largest trainable tensor (a per-parameter loop).
        dtype: the copies' dtype: the optimizer states' (``state``), the weights' (``weight``)
            or fp32.
        upcasts_16bit: one more fp32 copy of the largest parameter for each of its gradient and
            weight stored in fewer than 4 bytes (transformers' Adafactor ``grad.float()`` /
            ``p.float()``).
        largest_bytes_per_256: bytes per 256 elements of the largest trainable tensor whatever
            the training's dtypes (torchao's compiled step: the new codes and scales, Note
            [torchao low-bit AdamW step]).
        carried_fp32_copies: fp32 copies of a parameter a per-parameter loop keeps bound
            until the next parameter's step has built its own (transformers' Adafactor's
            ``update``, Note [Optimizer-step temporaries]): the next parameter's peak has them
            beside it.
    """

    group_copies: int = 0
    largest_copies: int = 0
    dtype: TemporaryDtype = "state"
    upcasts_16bit: bool = False
    largest_bytes_per_256: int = 0
    carried_fp32_copies: int = 0


@dataclass(frozen=True, slots=True)
class OlderTorch:
    """Step temporaries of releases before ``before``, where they differ from today's.

    Attributes:
        before: the first torch release (major, minor) with today's temporaries.
        temporaries: by implementation, what the older releases hold instead.
        source: the change, with its pull request.
    """

    before: tuple[int, int]
    temporaries: Mapping[str, StepTemporaries]
    source: str


NO_TEMPORARIES = StepTemporaries()
"""An in-place step (fused kernels, bitsandbytes' and torchao's per-parameter kernels)."""

TORCH_IMPLEMENTATIONS: tuple[str, ...] = ("foreach", "fused", "for-loop")
"""torch.optim's three implementations; a row without that choice accepts (and ignores) them."""


def _every(temporaries: StepTemporaries) -> Mapping[str, StepTemporaries]:
    return dict.fromkeys(TORCH_IMPLEMENTATIONS, temporaries)


@dataclass(frozen=True, slots=True)
class OptimizerRow:
    """One optimizer: its states per trainable parameter, its step's temporaries, how it is
    traced, and the file it mirrors."""

    name: str
    """The ``TrainingConfig.optimizer`` value."""
    source: str
    """The file (torch.optim / bitsandbytes / torchao / transformers / lion-pytorch) mirrored."""
    states: tuple[str, ...]
    """State tensors kept per trainable parameter (torch's state-dict names); one element each
    per parameter element unless ``factored`` or ``blockwise``."""
    temporaries: Mapping[str, StepTemporaries]
    """Step temporaries by implementation (``foreach``, ``fused``, ``for-loop``, ``cs336``); the
    keys are the ``optimizer_implementation`` values the optimizer accepts."""
    state_dtype: str | None = None
    """Fixed dtype of the states (bitsandbytes 32-bit: ``get_state_buffer(p,
    dtype=torch.float32)``); None: ``TrainingConfig.optimizer_state_dtype``."""
    factored: bool = False
    """Adafactor: ``exp_avg_sq_row`` [rows] + ``exp_avg_sq_col`` [cols] per matrix, a full
    ``exp_avg_sq`` per vector, no first moment (``beta1=None``)."""
    blockwise: Blockwise | None = None
    """Block-wise quantized states, or None for full-precision ones."""
    paged: bool = False
    """bitsandbytes paged optimizer: the large states (codes only for 8-bit) live in CUDA
    managed memory (``F.get_paged``), outside the caching allocator."""
    transformers_temporaries: StepTemporaries | None = None
    """The temporaries of transformers' own class when it runs instead of torch.optim's
    (``TrainingConfig.adafactor_implementation``), whatever the implementation."""
    torch_optim: str | None = None
    """The ``torch.optim`` class the generic (trace) path builds; None: not traceable."""
    torch_kwargs: Mapping[str, float] = field(default_factory=dict)
    """Hyperparameters passed to it (no effect on memory; torch's defaults otherwise)."""
    torch_fused: bool = False
    """torch.optim has a ``fused=True`` kernel for it."""
    untraceable: str = ""
    """Why the generic path refuses it (the error message), when ``torch_optim`` is None."""
    deepspeed_cpu: bool = False
    """DeepSpeed has a CPU optimizer for it (ops/adam/cpu_adam.py, ops/lion/cpu_lion.py; SGD
    runs as torch.optim on the CPU): ``len(states)`` fp32 states per element on the host."""
    eight_bit: Optimizer | None = None
    """The 8-bit optimizer that replaces its states (a fix the planner and the CLI suggest)."""
    family: str = ""
    """Its kind in the uncertainty table (``optimizer=`` label); empty: its own name."""
    older_torch: OlderTorch | None = None
    """Other step temporaries in torch releases before a change, or None."""

    def __post_init__(self) -> None:
        if self.paged and self.state_dtype is None and self.blockwise is None:
            raise ValueError(f"{self.name}: paged states need a fixed dtype or block codes")
        if self.torch_optim is None and not self.untraceable:
            raise ValueError(f"{self.name}: say why it cannot be traced")

    @property
    def num_states(self) -> int:
        """State tensors per trainable parameter."""
        return len(self.states)

    @property
    def uncertainty_family(self) -> str:
        """:attr:`family`, or the optimizer's own name."""
        return self.family or self.name

    def wide_state_bytes(self, optimizer_state_dtype: str) -> int:
        """Bytes per element of one unquantized state, given the training's
        ``optimizer_state_dtype`` (the row's fixed dtype wins)."""
        return dtype_bytes(self.state_dtype or optimizer_state_dtype)

    def paged_bytes_per_element(self) -> int:
        """Bytes per element a paged optimizer keeps in managed memory: every state's codes
        (8-bit: the fp32 absmax stays in the allocator) or full states; 0 when not paged.

        Source: bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state`` /
        ``get_state_buffer``."""
        if not self.paged:
            return 0
        if self.blockwise is not None:
            return self.num_states * self.blockwise.code_bits // 8
        return self.num_states * dtype_bytes(self.state_dtype or "")

    def step_temporaries(
        self,
        implementation: str,
        *,
        transformers_class: bool = False,
        torch_version: tuple[int, ...] | None = None,
    ) -> StepTemporaries:
        """The temporaries of ``implementation`` (:data:`NO_TEMPORARIES` for one the row does
        not list); transformers' class's when it runs (``transformers_class``) and the row has
        one; an older torch's (:attr:`older_torch`) for a ``torch_version`` before its change
        (None: a current release)."""
        if transformers_class and self.transformers_temporaries is not None:
            return self.transformers_temporaries
        if self.older_step(implementation, torch_version):
            assert self.older_torch is not None
            return self.older_torch.temporaries[implementation]
        return self.temporaries.get(implementation, NO_TEMPORARIES)

    def older_step(self, implementation: str, torch_version: tuple[int, ...] | None) -> bool:
        """The step of ``implementation`` on ``torch_version`` holds :attr:`older_torch`'s
        temporaries, not a current release's (None: a current release): what the traced paths,
        running the installed torch's step, replace by the table's (Note [Traced optimizer
        states] in trainmem/traced_transforms.py)."""
        older = self.older_torch
        return (
            older is not None
            and torch_version is not None
            and torch_version < older.before
            and implementation in older.temporaries
        )


_ADAM_TEMPORARIES: Mapping[str, StepTemporaries] = {
    "foreach": StepTemporaries(group_copies=1),  # _foreach_sqrt(exp_avg_sqs) for the group
    "fused": NO_TEMPORARIES,  # _fused_adamw_
    "for-loop": StepTemporaries(largest_copies=2),  # denom = (exp_avg_sq.sqrt() / ...).add_(eps)
    "cs336": StepTemporaries(largest_copies=CS336_ADAMW_TEMPORARIES),  # out-of-place update
}
"""torch/optim/adam.py ``_multi_tensor_adam`` / ``_single_tensor_adam`` / ``_fused_adam``;
cs336_basics/optimizer.py ``AdamW.step``."""

_ADAM_BEFORE_2_1 = OlderTorch(
    before=(2, 1),
    temporaries={"foreach": StepTemporaries(group_copies=2)},
    source=(
        "torch 2.0.1 torch/optim/adam.py / adamw.py _multi_tensor_adam(w): exp_avg_sq_sqrt = "
        "_foreach_sqrt(exp_avg_sqs); denom = _foreach_add(exp_avg_sq_sqrt, eps), both alive at "
        "_foreach_addcdiv_; torch 2.1.0 adds eps in place (_foreach_add_), pytorch PRs #104780 "
        "(Adam) and #104898 (AdamW), July 2023, issue #97712"
    ),
)
"""Foreach Adam / AdamW before torch 2.1: two parameter-sized intermediates for the group."""

_BNB_8BIT = Blockwise(
    code_bits=8,
    block_size=BNB_BLOCKWISE_BLOCK_SIZE,
    scale_bytes=4,
    min_numel=BNB_MIN_8BIT_SIZE,
    block_must_divide=False,
    small_dtype="float32",
    vectors_quantized=False,
)
"""bitsandbytes ``Optimizer2State`` with ``optim_bits=8``: ``state1`` / ``state2`` uint8 and
``absmax1`` / ``absmax2`` fp32 per 256-value block (bitsandbytes/optim/optimizer.py
``init_state``); 32-bit states under ``min_8bit_size``."""


def _torchao(code_bits: int, block_size: int) -> Blockwise:
    """torchao optim/adam.py ``_AdamBase._new_buffer``: quantized states for tensors of at
    least 4096 elements the block divides, ``torch.zeros_like(p)`` otherwise."""
    return Blockwise(
        code_bits=code_bits,
        block_size=block_size,
        scale_bytes=4,
        min_numel=TORCHAO_MIN_QUANTIZED_SIZE,
        block_must_divide=True,
        small_dtype=None,
        vectors_quantized=True,
    )


# Note [torchao low-bit AdamW step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torchao's AdamW8bit / AdamW4bit / AdamWFp8 (torchao 0.18.0 optim/adam.py ``_AdamBase.step``;
# the same ``single_param_adam`` and quant_utils.py at v0.7.0, Nov 2024, as
# prototype/low_bit_optim) step one parameter at a time through
# ``torch.compile(single_param_adam, fullgraph=True, dynamic=False)``: the states are
# dequantized, updated in fp32 and requantized per block (``scale_tensor``: an absmax per
# block of 256 / 128 values, then ``quantize_8bit_with_qmap`` / ``quantize_4bit_with_qmap``'s
# binary search) inside one Inductor graph. What that graph allocates was read from the
# wrapper Inductor writes for the GPU's scheduler (the SIMD / Triton scheduling, run on the
# CPU with ``torch._inductor.config.cpu_backend = "triton"``, torch 2.13; per-parameter
# numbers independent of the parameter's dtype, bf16 and fp32 alike):
#
# - 8-bit: one reduction kernel computes both absmaxes, the fp32 update of the parameter and
#   both states' new codes; the fp32 copies (parameter, gradient, exp_avg, exp_avg_sq, the
#   scaled states) stay in registers (kernel-local buffers). It writes the new codes to two
#   uint8 buffers of n bytes and the scales to two fp32 buffers of n/256, copied into the
#   states by later kernels: 2n + 2 x 4n/256 bytes at the peak.
# - 4-bit: the packed codes are first unpacked to two uint8 buffers of n bytes; the packing
#   (``(codes[::2] << 4) | codes[1::2]``) reads every other element, so the main kernel
#   writes the scaled states (two fp32 buffers of 4n) and the unrounded codes (two int64
#   buffers of 8n) for the packing kernels: 2n + 8n + 16n + 2 x 4n/128 = 26n + n/16 bytes.
# - FP8: the float8 cast needs no code search; only the two fp32 scale vectors (2 x 4n/256)
#   leave the kernels.
#
# benchmarks/torchao_optim_step.py runs that wrapper's ``call`` on CPU tensors (kernels as
# no-ops) under torch.profiler: 2.031 / 26.062 / 0.031 B per element, as derived, for bf16 and
# fp32 parameters of 1024 x 1024.
#
# bitsandbytes' AdamW8bit updates codes and absmax in place (``optimizer_update_8bit_blockwise``,
# no temporaries), hence a separate row ``ao-adamw-8bit``. The C++ (CPU) backend keeps more:
# measured with torch.profiler on the CPU, 8 B per element for the compiled 8-bit step (the two
# scaled fp32 states, which the code search reads eight times) and 57 B per element eager; that
# is not what a GPU runs. Not seen in measurements: torchao's README @1e7f132 (torch 2.4) peaks
# are set by the forward / backward, not the step (ViT-H: bnb 8.32 GB, ao 8-bit 8.33 GB).
# A parameter the block does not divide keeps plain states (``_new_buffer``), updated in
# place; the largest tensor is assumed quantized.
TORCHAO_8BIT_STEP_BYTES_PER_256 = 2 * 256 + 2 * 4
"""Note [torchao low-bit AdamW step]: two uint8 code buffers and two fp32 scales per 256."""
TORCHAO_4BIT_STEP_BYTES_PER_256 = (2 * 1 + 2 * 4 + 2 * 8) * 256 + 2 * 4 * 2
"""Note [torchao low-bit AdamW step]: unpacked uint8 codes, fp32 scaled states and int64
codes of both states, and two fp32 scales per 128."""
TORCHAO_FP8_STEP_BYTES_PER_256 = 2 * 4
"""Note [torchao low-bit AdamW step]: the two fp32 scales per 256."""


_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_KERNELS = (
    "needs bitsandbytes / torchao CUDA kernels, which cannot run on fake CPU tensors; "
    "use --engine analytic"
)
_ADAMW_8BIT: Optimizer = "adamw-8bit"


def _adam(name: Optimizer, torch_optim: str) -> OptimizerRow:
    """torch.optim's Adam / AdamW (the same states and step)."""
    return OptimizerRow(
        name,
        f"torch/optim/{name}.py",
        states=_ADAM_STATES,
        temporaries=_ADAM_TEMPORARIES,
        older_torch=_ADAM_BEFORE_2_1,
        torch_optim=torch_optim,
        torch_kwargs={"lr": 1e-4},
        torch_fused=True,
        deepspeed_cpu=True,
        eight_bit=_ADAMW_8BIT,
        family="adam",
    )


def _kernels(
    name: Optimizer,
    source: str,
    *,
    blockwise: Blockwise | None = None,
    state_dtype: str | None = None,
    paged: bool = False,
    family: str = "",
    step_bytes_per_256: int = 0,
) -> OptimizerRow:
    """A bitsandbytes / torchao AdamW: two states (bitsandbytes ``state1`` / ``state2``,
    torchao ``exp_avg`` / ``exp_avg_sq``) updated by its own kernels (bitsandbytes: in place, no
    step temporaries; torchao: ``step_bytes_per_256`` of the largest tensor, Note [torchao
    low-bit AdamW step]); not traceable on fake CPU tensors."""
    return OptimizerRow(
        name,
        source,
        states=_ADAM_STATES,
        state_dtype=state_dtype,
        blockwise=blockwise,
        paged=paged,
        temporaries=_every(StepTemporaries(largest_bytes_per_256=step_bytes_per_256)),
        untraceable=f"{name} {_KERNELS}",
        family=family,
    )


_ROWS: tuple[OptimizerRow, ...] = (
    OptimizerRow(
        "sgd",
        "torch/optim/sgd.py (no state without momentum)",
        states=(),
        temporaries=_every(NO_TEMPORARIES),
        torch_optim="SGD",
        torch_kwargs={"lr": 1e-3},
        torch_fused=True,
        deepspeed_cpu=True,
    ),
    OptimizerRow(
        "sgd-momentum",
        "torch/optim/sgd.py (``momentum_buffer``, updated in place)",
        states=("momentum_buffer",),
        temporaries=_every(NO_TEMPORARIES),
        torch_optim="SGD",
        torch_kwargs={"lr": 1e-3, "momentum": 0.9},
        torch_fused=True,
        deepspeed_cpu=True,
    ),
    _adam("adam", "Adam"),
    _adam("adamw", "AdamW"),
    OptimizerRow(
        "adafactor",
        "torch/optim/_adafactor.py (``var_estimates = [row_var @ col_var ...]``, vectors "
        "``v.clone()``, one per parameter, all at once with foreach); transformers/"
        "optimization.py ``Adafactor`` (Shazeer & Stern 2018, arXiv:1804.04235, sec. 3)",
        states=("exp_avg_sq_row", "exp_avg_sq_col"),
        factored=True,
        temporaries={
            "foreach": StepTemporaries(group_copies=1, dtype="weight"),
            "fused": StepTemporaries(largest_copies=1, dtype="weight"),
            "for-loop": StepTemporaries(largest_copies=1, dtype="weight"),
        },
        # grad**2 + eps, the factored update and -update: two fp32 tensors at a time, plus
        # the fp32 copies of a 16-bit gradient and weight; the last parameter's fp32 update
        # stays bound until the next parameter's ``update = (grad**2) + eps`` is built
        transformers_temporaries=StepTemporaries(
            largest_copies=2, dtype="float32", upcasts_16bit=True, carried_fp32_copies=1
        ),
        torch_optim="Adafactor",
        torch_kwargs={"lr": 1e-2},
    ),
    OptimizerRow(
        "lion",
        "lucidrains/lion-pytorch lion_pytorch.py (one ``exp_avg``; the update builds two "
        "tensors of the parameter)",
        states=("exp_avg",),
        temporaries=_every(StepTemporaries(largest_copies=2)),
        untraceable=(
            "Lion is not in torch.optim; trace it with trainmem.trace(..., optimizer=...) and "
            "your own Lion implementation, or use --engine analytic"
        ),
        deepspeed_cpu=True,
    ),
    _kernels(
        "adamw-8bit",
        "bitsandbytes/optim/adamw.py ``AdamW8bit``, optim/optimizer.py ``Optimizer2State``",
        blockwise=_BNB_8BIT,
        family="8-bit",
    ),
    _kernels(
        "paged-adamw-8bit",
        "bitsandbytes/optim/adamw.py ``PagedAdamW8bit`` (``is_paged=True``)",
        blockwise=_BNB_8BIT,
        paged=True,
        family="8-bit",
    ),
    _kernels(
        "paged-adamw",
        "bitsandbytes/optim/adamw.py ``PagedAdamW`` / ``PagedAdamW32bit`` (``optim_bits=32``: "
        "``get_state_buffer(p, dtype=torch.float32)``)",
        state_dtype="float32",
        paged=True,
    ),
    _kernels(
        "ao-adamw-8bit",
        "torchao optim/adam.py ``AdamW8bit(block_size=256)``, optim/subclass_8bit.py "
        "``OptimState8bit.zeros`` (uint8 codes + an fp32 scale per block)",
        blockwise=_torchao(code_bits=8, block_size=256),
        family="8-bit",
        step_bytes_per_256=TORCHAO_8BIT_STEP_BYTES_PER_256,
    ),
    _kernels(
        "adamw-4bit",
        "torchao optim/adam.py ``AdamW4bit(block_size=128)``, optim/subclass_4bit.py "
        "``OptimState4bit.zeros`` (packed 4-bit codes + an fp32 scale per block)",
        blockwise=_torchao(code_bits=4, block_size=128),
        step_bytes_per_256=TORCHAO_4BIT_STEP_BYTES_PER_256,
    ),
    _kernels(
        "adamw-fp8",
        "torchao optim/adam.py ``AdamWFp8(block_size=256)``, optim/subclass_fp8.py "
        "``OptimStateFp8.zeros`` (float8_e4m3fn codes + an fp32 scale per block)",
        blockwise=_torchao(code_bits=8, block_size=256),
        step_bytes_per_256=TORCHAO_FP8_STEP_BYTES_PER_256,
    ),
)

OPTIMIZER_TABLE: Mapping[str, OptimizerRow] = {row.name: row for row in _ROWS}
"""``TrainingConfig.optimizer`` -> its row, in the order the CLI and the page list them."""
