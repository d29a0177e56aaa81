"""TrainingConfig: how a model is trained (one data-parallel rank's view).

Precision names follow PyTorch Lightning (``Trainer(precision=...)``):

==============  ===============  ==============  =====================================
precision       weights/grads    compute         notes
==============  ===============  ==============  =====================================
``32-true``     float32          float32         plain fp32
``16-mixed``    float32          float16         torch.autocast + GradScaler (AMP)
``bf16-mixed``  float32          bfloat16        torch.autocast
``16-true``     float16          float16         whole model cast with ``.half()``
``bf16-true``   bfloat16         bfloat16        whole model cast; optimizer states in bf16
==============  ===============  ==============  =====================================

Source: Lightning ``lightning/fabric/plugins/precision`` (``MixedPrecision``, ``HalfPrecision``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainmem.errors import SpecError

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
Optimizer = Literal[
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adafactor",
    "lion",
    "adamw-8bit",
    "paged-adamw-8bit",
]
ActivationCheckpointing = Literal["none", "selective", "full"]
Attention = Literal["eager", "sdpa", "flash"]
OptimizerImplementation = Literal["foreach", "fused", "for-loop"]

PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
OPTIMIZERS: tuple[str, ...] = (
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adafactor",
    "lion",
    "adamw-8bit",
    "paged-adamw-8bit",
)
ACTIVATION_CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
OPTIMIZER_IMPLEMENTATIONS: tuple[str, ...] = ("foreach", "fused", "for-loop")

#: (weight dtype, compute dtype) per precision; torch dtype spellings.
_PRECISION_DTYPES: dict[str, tuple[str, str]] = {
    "32-true": ("float32", "float32"),
    "16-mixed": ("float32", "float16"),
    "bf16-mixed": ("float32", "bfloat16"),
    "16-true": ("float16", "float16"),
    "bf16-true": ("bfloat16", "bfloat16"),
}


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(field, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """One training step on one GPU: the settings that change its memory.

    Raises:
        SpecError: a field outside its allowed values (the message lists them).
    """

    micro_batch_size: int = 1
    """Sequences per forward pass on one GPU (b)."""
    seq_len: int = 1024
    """Tokens per sequence (s). For ViT this is ignored: the sequence is patches + 1."""
    precision: Precision = "bf16-mixed"
    """Lightning precision name, see the module docstring."""
    optimizer: Optimizer = "adamw"
    """Optimizer whose states are kept per trainable parameter."""
    optimizer_implementation: OptimizerImplementation = "foreach"
    """torch.optim implementation: ``foreach`` (the CUDA default), ``fused``, ``for-loop``."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """``none``; ``selective`` (recompute attention core, Korthikanti et al. 2022 sec. 5);
    ``full`` (keep only each layer's input)."""
    attention: Attention = "sdpa"
    """``eager`` (materialised a*s*s scores), ``sdpa`` (PyTorch SDPA, flash/efficient kernels on
    CUDA), ``flash`` (flash-attn 2)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; gradients persist across them."""
    dropout: bool = True
    """Apply the model's own dropout probabilities (False: treat them as 0)."""

    def __post_init__(self) -> None:
        for field in ("micro_batch_size", "seq_len", "gradient_accumulation_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(field, f"must be a positive integer, got {value!r}")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice(
            "optimizer_implementation", self.optimizer_implementation, OPTIMIZER_IMPLEMENTATIONS
        )
        _check_choice(
            "activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING
        )
        _check_choice("attention", self.attention, ATTENTIONS)

    @property
    def weight_dtype(self) -> str:
        """Dtype of the stored parameters and their gradients (torch spelling)."""
        return _PRECISION_DTYPES[self.precision][0]

    @property
    def compute_dtype(self) -> str:
        """Dtype of matmul inputs/outputs and most activations (torch spelling)."""
        return _PRECISION_DTYPES[self.precision][1]

    @property
    def is_mixed(self) -> bool:
        """True for autocast precisions (fp32 weights, 16-bit compute)."""
        return self.precision.endswith("-mixed")
