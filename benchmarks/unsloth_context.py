"""``--framework unsloth`` against Unsloth's published long-context table: the longest sequence
trainmem says fits, per card size, beside the one Unsloth reports. NOT in the development
set: it checks mechanisms, no constant is fitted to it.

Source: the Unsloth README at tag ``May-2025`` ("Context length benchmarks", "Llama 3.1 (8B)
max. context length": Llama 3.1 (8B) Instruct, 4-bit QLoRA on all linear layers, rank 32,
batch size 1, sequences padded to the length; the column "Unsloth context length"). The
README of the release trainmem reads (2026.3.5, tag ``March-2026``) no longer has the table, so
the figures are from an older Unsloth (its offloaded checkpoint and fused loss existed then in
other forms): a check of magnitude, not of a release.

Inputs as read: ``llama-3.1-8b``, ``--framework unsloth`` (bf16, ``adamw-8bit``, the offloaded
checkpoint), ``--quantize-base nf4-dq`` (Unsloth's bnb-4bit checkpoints are double-quantized),
``--lora-rank 32 --lora-targets all-linear``, ``-b 1``; the card as ``<N>GB`` of usable memory
(the README does not say which cards or how much of them torch reports). The fused loss's
number of pieces is Unsloth's own (unsloth_zoo 2026.3.4 fused_losses/cross_entropy_loss.py
``get_chunk_size``: ``max(4 round(2 V t / free), 1)``), with ``free`` the capacity less what
the step holds when the loss starts (the measured step's schedule).

Run: ``python benchmarks/unsloth_context.py`` (about a minute).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from trainmem.errors import SpecError
from trainmem.estimate import estimate, resolve_model
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.hardware import custom_gpu
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
STEP = 256
"""Granularity of the search over sequence lengths (tokens)."""


def _ops(items: list[Item], i: int = 0) -> Iterator[Op]:
    for item in items:
        if isinstance(item, Repeat):
            for k in range(item.count):
                yield from _ops(list(item.body), item.index(k))
        else:
            yield item


def in_use_at_loss(seq_len: int) -> int:
    """Bytes allocated when the measured step's loss starts (its logits not yet made): what
    ``torch.cuda.mem_get_info`` leaves out of ``free`` at Unsloth's first fused-loss call,
    the CUDA context and cached blocks aside. The loss's own pieces do not change it."""
    training = TrainingConfig(seq_len=seq_len, **SETTINGS)  # type: ignore[arg-type]
    schedule = estimate(MODEL, training, simulate_allocator=False).schedules[0]
    live = 0
    for op in _ops(list(schedule.setup)):
        live += op.size_bytes if op.action == "alloc" else -op.size_bytes
    for op in _ops(list(schedule.step)):
        if op.action == "alloc" and op.key in ("logits16", "logits"):
            return live
        live += op.size_bytes if op.action == "alloc" else -op.size_bytes
    raise AssertionError("no loss in the step")


def pieces(seq_len: int, gpu: str) -> int:
    """Unsloth's ``n_chunks`` for this length on this card: ``max(4 round(2 V t / free), 1)``
    (``get_chunk_size``), ``free`` the card's capacity less :func:`in_use_at_loss`."""
    spec = custom_gpu(gpu)
    assert spec is not None
    free = spec.memory_bytes - in_use_at_loss(seq_len)
    if free <= 0:
        return 1
    return max(4 * round(2 * resolve_model(MODEL).vocab_size * seq_len / free), 1)


def fits(seq_len: int, gpu: str) -> bool:
    """Whether the step at ``seq_len`` fits ``gpu`` (the allocator simulator's verdict)."""
    try:
        n = pieces(seq_len, gpu)
        training = TrainingConfig(seq_len=seq_len, chunked_cross_entropy=n, **SETTINGS)  # type: ignore[arg-type]
        return estimate(MODEL, training, gpu=gpu).verdict in ("fits", "tight")
    except SpecError:
        return False


def longest(gpu: str, high: int) -> int:
    """The longest multiple of :data:`STEP` up to ``high`` that fits ``gpu`` (0: none)."""
    lo, hi = 0, high // STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * STEP, gpu):
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def main() -> int:
    print(f"{'card':>6} {'Unsloth':>9} {'trainmem':>9} {'ratio':>6}")
    for gb, published in ROWS:
        ours = longest(f"{gb}GB", 2 * published + 4 * STEP)
        ratio = ours / published
        print(f"{gb:>4}GB {published:>9,} {ours:>9,} {ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
