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
(the README does not say which cards or how much of them torch reports). The fused loss's
number of pieces is Unsloth's own, as ``estimate`` takes it on a given GPU
(``trainmem.estimate.unsloth_loss_pieces``: unsloth_zoo 2026.3.4 ``get_chunk_size``,
``max(4 round(2 V t / free), 1)``, ``free`` the capacity less what the schedule holds when the
first loss starts).

Run: ``python benchmarks/unsloth_context.py`` (a few seconds).
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
#: (card GB, Unsloth's published longest context).
ROWS: list[tuple[int, int]] = [
    (8, 2_972),
    (12, 21_848),
    (16, 40_724),
    (24, 78_475),
    (40, 153_977),
    (48, 191_728),
    (80, 342_733),
]
TABLE_RELEASE = "2025.1.5"
"""The Unsloth of the tree the table was added in (e3162dc5, 2025-01-14)."""
STEP = 256
"""Granularity of the search over sequence lengths (tokens)."""


def fits(seq_len: int, gpu: str, release: str | None = None) -> bool:
    """Whether the step at ``seq_len`` fits ``gpu`` (the allocator simulator's verdict) with
    Unsloth ``release`` (None: trainmem's default)."""
    try:
        training = TrainingConfig(seq_len=seq_len, unsloth_version=release, **SETTINGS)  # type: ignore[arg-type]
        return estimate(MODEL, training, gpu=gpu).verdict in ("fits", "tight")
    except SpecError:
        return False


def longest(gpu: str, high: int, release: str | None = None) -> int:
    """The longest multiple of :data:`STEP` up to ``high`` that fits ``gpu`` (0: none)."""
    lo, hi = 0, high // STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * STEP, gpu, release):
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def main() -> int:
    print(f"{'card':>6} {'Unsloth':>9} {TABLE_RELEASE:>9} {'ratio':>6} {'default':>9} {'ratio':>6}")
    for gb, published in ROWS:
        high = 2 * published + 4 * STEP
        table = longest(f"{gb}GB", high, TABLE_RELEASE)
        default = longest(f"{gb}GB", high)
        print(
            f"{gb:>4}GB {published:>9,} {table:>9,} {table / published:>6.2f} "
            f"{default:>9,} {default / published:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
