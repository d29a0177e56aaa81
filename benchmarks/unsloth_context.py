"""``--framework unsloth`` against Unsloth's published long-context table: the longest sequence
trainmem says fits, per card size, beside the one Unsloth reports. NOT in the development
set: it checks mechanisms, no constant is fitted to it.

Source: the Unsloth README at tag ``May-2025`` ("Context length benchmarks", "Llama 3.1 (8B)
max. context length": Llama 3.1 (8B) Instruct, 4-bit QLoRA on all linear layers, rank 32,
batch size 1, sequences padded to the length; the column "Unsloth context length"). The
table came with the Llama 3.3 release (December 2024) and entered the README in e3162dc5
(2025-01-14, ``__version__ = "2025.1.5"``); the README of 2026.3.5 (tag ``March-2026``) no
longer has it. So trainmem runs it as ``--unsloth-version 2025.1.5`` (:data:`TABLE_RELEASE`:
the older offloaded checkpoint, the LoRA kernels' product tensor, no dequantization buffer,
Cut Cross Entropy) and, beside it, as the default release.

Inputs as read: ``llama-3.1-8b``, ``--framework unsloth`` (bf16, ``adamw-8bit``, the offloaded
checkpoint), ``--quantize-base nf4-dq`` (Unsloth's bnb-4bit checkpoints are double-quantized),
``--lora-rank 32 --lora-targets all-linear``, ``-b 1``; the card as ``<N>GB`` of usable memory
(the README does not say which cards or how much of them torch reports). At the default
release the fused loss's number of pieces is Unsloth's own, as ``estimate`` takes it on a given
GPU (``trainmem.estimate.unsloth_loss_pieces``: unsloth_zoo 2026.3.4 ``get_chunk_size``,
``max(4 round(2 V t / free), 1)``, ``free`` the capacity less what the schedule holds when the
first loss starts); Cut Cross Entropy has none. The table's "Llama 3.3 (70B) max. context
length" rows (the same settings, "on a 80GB A100") run as ``llama-3.1-70b``, whose
architecture Llama 3.3 70B shares.

The 8B column is exactly linear in the card size: 2,972 + 18,876 (N - 8) / 4 tokens (every
step of 4 GB adds 18,876), so it was extrapolated from one or two runs, and what it checks is
a slope, 4,719 tokens per GB (211,900 B per token with N GB = N x 10^9 B: about 25.9
(b, s, h) bf16 tensors), and an intercept (about 7.37e9 B fixed). trainmem at 2025.1.5
(session 16): 4,837 tokens per GB from 12 to 80 GB (2.5 % less per token), the same intercept
within 3 % of a card. Read as N GiB every ratio grows (1.10-1.28, 8 GiB 2.33): the figures
support decimal gigabytes.

Run: ``python benchmarks/unsloth_context.py`` (about 10 seconds).
"""

from __future__ import annotations

import sys

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

MODEL = "llama-3.1-8b"
SETTINGS: dict[str, object] = {
    "framework": "unsloth",
    "quantize_base": "nf4-dq",
    "lora_rank": 32,
    "lora_targets": ("q", "k", "v", "o", "gate", "up", "down"),
    "micro_batch_size": 1,
}
#: (model, card GB, Unsloth's published longest context).
ROWS: list[tuple[str, int, int]] = [
    (MODEL, 8, 2_972),
    (MODEL, 12, 21_848),
    (MODEL, 16, 40_724),
    (MODEL, 24, 78_475),
    (MODEL, 40, 153_977),
    (MODEL, 48, 191_728),
    (MODEL, 80, 342_733),
    ("llama-3.1-70b", 48, 12_106),
    ("llama-3.1-70b", 80, 89_389),
]
TABLE_RELEASE = "2025.1.5"
"""The Unsloth of the tree the table was added in (e3162dc5, 2025-01-14)."""
STEP = 256
"""Granularity of the search over sequence lengths (tokens)."""


def fits(model: str, seq_len: int, gpu: str, release: str | None = None) -> bool:
    """Whether the step at ``seq_len`` fits ``gpu`` (the allocator simulator's verdict) with
    Unsloth ``release`` (None: trainmem's default)."""
    try:
        training = TrainingConfig(seq_len=seq_len, unsloth_version=release, **SETTINGS)  # type: ignore[arg-type]
        return estimate(model, training, gpu=gpu).verdict in ("fits", "tight")
    except SpecError:
        return False


def longest(model: str, gpu: str, high: int, release: str | None = None) -> int:
    """The longest multiple of :data:`STEP` up to ``high`` that fits ``gpu`` (0: none)."""
    lo, hi = 0, high // STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(model, mid * STEP, gpu, release):
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def main() -> int:
    print(
        f"{'model':>14} {'card':>5} {'Unsloth':>9} {TABLE_RELEASE:>9} {'ratio':>6} "
        f"{'default':>9} {'ratio':>6}"
    )
    for model, gb, published in ROWS:
        high = 2 * published + 4 * STEP
        table = longest(model, f"{gb}GB", high, TABLE_RELEASE)
        default = longest(model, f"{gb}GB", high)
        print(
            f"{model:>14} {gb:>3}GB {published:>9,} {table:>9,} {table / published:>6.2f} "
            f"{default:>9,} {default / published:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
