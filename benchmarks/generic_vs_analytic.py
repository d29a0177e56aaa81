"""Peak allocated of the analytic formulas against the generic path on every formula family
(tests/models/formula/, 2 layers, tiny widths; the tiny presets), at two batch shapes.

At b2 s64 the cuBLAS workspaces (2 x 8.1 MiB) dominate these tiny models, so the activation
terms weigh little; b4 s256 shows the activation terms. Usage::

    PYTHONPATH=src python benchmarks/generic_vs_analytic.py
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

FORMULA = Path(__file__).resolve().parents[1] / "tests" / "models" / "formula"


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    models = ["tiny-llama-test", "tiny-gpt2-test", *map(str, sorted(FORMULA.glob("*.json")))]
    print("| model | b2 s64 analytic vs generic | b4 s256 analytic vs generic |")
    print("|---|---|---|")
    for model in models:
        cells = []
        for b, s in ((2, 64), (4, 256)):
            # Gemma-2 has no SDPA attention in transformers (``_supports_sdpa = False``)
            attention = "eager" if Path(model).stem == "gemma2" else "sdpa"
            training = TrainingConfig(micro_batch_size=b, seq_len=s, attention=attention)
            try:
                a = estimate(model, training, engine="analytic", simulate_allocator=False)
                g = estimate(model, training, engine="generic", simulate_allocator=False)
            except Exception as exc:  # noqa: BLE001 - a table cell, not a failure
                cells.append(f"error: {str(exc)[:60]}")
                continue
            x, y = a.breakdown.allocated_bytes, g.breakdown.allocated_bytes
            cells.append(f"{(x - y) / y * 100:+.2f}% ({x} vs {y} B)")
        print(f"| {Path(model).stem} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
