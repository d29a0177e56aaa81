"""Benchmark: replay a one-million-event timeline through the caching-allocator simulator.

Target (issue 4): under 10 s for 1,000,000 events on one CPU core. Run::

    python benchmarks/allocator_replay.py [--events 1000000] [--alloc-conf expandable_segments:True]

The timeline imitates training steps of a small transformer: persistent parameters, then per step
a forward pass that saves activations of mixed sizes (small-pool and large-pool) and frees its
temporaries, a backward pass that frees the activations in reverse order while gradients and
temporaries come and go, and an optimizer step. It is deterministic (seeded).
"""

from __future__ import annotations

import argparse
import random
import time

from trainmem.allocator.replay import replay_timeline
from trainmem.breakdown import MemoryCategory
from trainmem.timeline import AllocEvent, Timeline

KiB, MiB = 1024, 1024 * 1024


def synthetic_timeline(num_events: int, *, num_layers: int = 24, seed: int = 0) -> Timeline:
    """A training-like timeline of about ``num_events`` events (persistent blocks stay live)."""
    rng = random.Random(seed)
    events: list[AllocEvent] = []
    next_id = 0
    act, tmp, par, grad = (
        MemoryCategory.ACTIVATION,
        MemoryCategory.TEMPORARY,
        MemoryCategory.PARAMETER,
        MemoryCategory.GRADIENT,
    )

    def alloc(size: int, category: MemoryCategory, phase: str) -> int:
        nonlocal next_id
        next_id += 1
        events.append(AllocEvent("alloc", next_id, size, category, phase))  # type: ignore[arg-type]
        return next_id

    def free(block_id: int, size: int, category: MemoryCategory, phase: str) -> None:
        events.append(AllocEvent("free", block_id, size, category, phase))  # type: ignore[arg-type]

    layer_param_sizes = [4 * MiB, 4 * MiB, 16 * MiB, 16 * MiB, 3 * KiB, 3 * KiB]
    params = [(alloc(s, par, "init"), s) for _ in range(num_layers) for s in layer_param_sizes]
    grads: list[tuple[int, int]] = []
    while len(events) < num_events:
        saved: list[tuple[int, int]] = []
        for _ in range(num_layers):  # forward
            for _ in range(8):
                size = rng.choice([6 * MiB, 6 * MiB, 24 * MiB, 2 * KiB, 48 * KiB, 1 * MiB + 512])
                size += rng.randrange(0, 4096)
                saved.append((alloc(size, act, "forward"), size))
            for _ in range(4):
                size = rng.choice([12 * MiB, 512 * KiB, 3 * MiB])
                free(alloc(size, tmp, "forward"), size, tmp, "forward")
        for _ in range(num_layers):  # backward
            for _ in range(8):
                block_id, size = saved.pop()
                t = rng.choice([6 * MiB, 24 * MiB, 64 * KiB])
                t_id = alloc(t, tmp, "backward")
                free(block_id, size, act, "backward")
                free(t_id, t, tmp, "backward")
        if not grads:
            grads = [(alloc(s, grad, "backward"), s) for _, s in params]
        for _, s in params:  # optimizer: a temporary per parameter (foreach-like)
            free(alloc(s, tmp, "optimizer"), s, tmp, "optimizer")
    return Timeline(events=events[:num_events], name="synthetic")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--alloc-conf", default="")
    args = parser.parse_args()
    t0 = time.perf_counter()
    timeline = synthetic_timeline(args.events)
    t1 = time.perf_counter()
    result = replay_timeline(timeline, capacity_bytes=None, alloc_conf=args.alloc_conf)
    t2 = time.perf_counter()
    print(f"built {len(timeline):,} events in {t1 - t0:.2f} s")
    print(
        f"replayed in {t2 - t1:.2f} s ({(t2 - t1) / len(timeline) * 1e6:.2f} us/event); "
        f"max_memory_allocated={result.max_memory_allocated:,} B, "
        f"max_memory_reserved={result.max_memory_reserved:,} B"
    )
    print("PASS" if t2 - t1 < 10 else "FAIL", "(target: < 10 s for 1,000,000 events)")


if __name__ == "__main__":
    main()
