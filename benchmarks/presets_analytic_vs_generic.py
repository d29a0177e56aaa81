"""Peak allocated of the analytic formulas against the generic path (the real transformers
model, a few blocks traced on fake tensors and composed to full depth) on full-size presets,
over the settings users run most: FSDP over 8 GPUs with and without checkpointing, LoRA in
bf16-true, plain bf16-mixed, op-level selective checkpointing.

The generic path runs the model's own code, so a cell off by more than 1% is a formula the
analytic engine gets wrong for that family (or a setting the two read differently); each fix
so far is listed in docs/session-notes.md. Usage::

    PYTHONPATH=src python benchmarks/presets_analytic_vs_generic.py [PRESET ...] [--only TEXT]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

PRESETS = (
    "llama-3.1-8b",
    "llama-2-7b",
    "mistral-7b-v0.1",
    "qwen2.5-7b",
    "gemma-7b",
    "phi-3-mini-4k",
    "falcon-7b",
    "olmo-2-7b",
    "starcoder2-7b",
    "qwen3-30b-a3b",
)
FSDP8 = dict(data_parallel_size=8, zero_stage=3, framework="fsdp2")
SETTINGS: dict[str, dict[str, object]] = {
    "FSDP 8, full AC, b4 s2048": dict(
        micro_batch_size=4, seq_len=2048, activation_checkpointing="full", **FSDP8
    ),
    "FSDP 8, b1 s4096": dict(micro_batch_size=1, seq_len=4096, **FSDP8),
    "LoRA r16 bf16-true, b2 s2048": dict(
        micro_batch_size=2, seq_len=2048, precision="bf16-true", lora_rank=16
    ),
    "SGD, b2 s2048": dict(micro_batch_size=2, seq_len=2048, optimizer="sgd"),
    "SGD, selective AC, b2 s2048": dict(
        micro_batch_size=2, seq_len=2048, optimizer="sgd", activation_checkpointing="selective"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--only", default="", help="run only the settings whose name has this")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print("| preset | setting | analytic GiB | generic GiB | analytic vs generic |")
    print("|---|---|---:|---:|---:|")
    for preset in args.presets:
        for name, kw in SETTINGS.items():
            if args.only not in name:
                continue
            training = TrainingConfig(**{"precision": "bf16-mixed", **kw})  # type: ignore[arg-type]
            start = time.monotonic()
            try:
                a = estimate(preset, training, engine="analytic", simulate_allocator=False)
                g = estimate(preset, training, engine="generic", simulate_allocator=False)
            except Exception as exc:  # noqa: BLE001 - a table cell, not a failure
                print(f"| {preset} | {name} | - | - | {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            x, y = a.breakdown.allocated_bytes, g.breakdown.allocated_bytes
            flag = " **" if abs(x - y) > 0.01 * y else ""
            print(
                f"| {preset} | {name} | {x / 2**30:.2f} | {y / 2**30:.2f} | "
                f"{100 * (x - y) / y:+.2f}%{flag} ({time.monotonic() - start:.0f} s) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
