"""Analytic estimates per second, closed form and with the allocator replay.

Usage: ``python benchmarks/analytic_speed.py``. The issue's bar: llama-3.1-405b well under 10 ms
in-process for the closed form (the replay, default for ``trainmem estimate``, is reported too).
"""

from __future__ import annotations

import time

from trainmem.estimate import estimate as estimate_analytic
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


def per_call_seconds(preset: str, simulate_allocator: bool, repeats: int) -> float:
    model = load_model_spec(preset)
    training = TrainingConfig(seq_len=4096)
    estimate_analytic(model, training, simulate_allocator=simulate_allocator)  # warm caches
    start = time.perf_counter()
    for _ in range(repeats):
        estimate_analytic(model, training, simulate_allocator=simulate_allocator)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    for preset in ("gpt2", "llama-3.1-8b", "llama-3.1-405b"):
        closed = per_call_seconds(preset, False, 200)
        replay = per_call_seconds(preset, True, 3)
        print(
            f"{preset:16} closed form {1e3 * closed:7.3f} ms ({1 / closed:8.0f}/s)   "
            f"with allocator replay {1e3 * replay:8.1f} ms"
        )


if __name__ == "__main__":
    main()
