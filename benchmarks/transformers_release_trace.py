"""An older transformers release on the generic path against a real trace of that release:
``--transformers-version`` traces the installed transformers' model code and applies the
differences the formulas know (Note [An older transformers release on a traced step] in
trainmem/traced_releases.py); this runs the same cells with the older release installed for real.

Needs a throwaway venv with the older release (not a trainmem dependency)::

    python3 -m venv /tmp/tfrel-venv
    /tmp/tfrel-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl   # or torch==2.13.0
    /tmp/tfrel-venv/bin/pip install transformers==4.40.0 peft==0.10.0 typer rich pydantic
    PYTHONPATH=src .venv/bin/python benchmarks/transformers_release_trace.py \\
        --python /tmp/tfrel-venv/bin/python [--version 4.40.0] [--cells none,lora]

The real trace is this package's generic path run in that venv (``PYTHONPATH=src``: its
transformers is the requested release, traced as installed); the other two columns run here, on
the installed transformers: the generic path with ``--transformers-version`` and the formulas.
Cells: the agreement Llama (tests/models/agreement/llama_h1024.json), bf16-mixed AdamW; peak
allocated bytes and each column's error against the real trace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from trainmem.estimate import default_attention_of, estimate
from trainmem.specs.training import TrainingConfig

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "tests" / "models" / "agreement" / "llama_h1024.json"

CELLS: dict[str, dict[str, object]] = {
    "1x128": {"micro_batch_size": 1, "seq_len": 128},
    "none": {"micro_batch_size": 4, "seq_len": 512},
    "full": {"micro_batch_size": 4, "seq_len": 512, "activation_checkpointing": "full"},
    "selective": {"micro_batch_size": 4, "seq_len": 512, "activation_checkpointing": "selective"},
    "lora": {"micro_batch_size": 4, "seq_len": 512, "lora_rank": 8},
    # for a model of 256 positions (a tiny Qwen2 of tests/models/formula/qwen2.json's shape)
    "4x128": {"micro_batch_size": 4, "seq_len": 128},
    "4x128-full": {"micro_batch_size": 4, "seq_len": 128, "activation_checkpointing": "full"},
    "4x128-lora": {"micro_batch_size": 4, "seq_len": 128, "lora_rank": 8},
}

_FLAGS = {
    "micro_batch_size": "--micro-batch-size",
    "seq_len": "--seq-len",
    "activation_checkpointing": "--activation-checkpointing",
    "lora_rank": "--lora-rank",
}


def real_peak(python: str, model: Path, cell: dict[str, object]) -> int:
    """Peak allocated bytes of the generic path run in ``python``'s venv (its release)."""
    cmd = [python, "-m", "trainmem", "estimate", str(model), "--engine", "generic"]
    cmd += ["--precision", "bf16-mixed", "--json"]
    for key, value in cell.items():
        cmd += [_FLAGS[key], str(value)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)["peak"]["allocated_bytes"])


def here_peak(engine: str, model: Path, cell: dict[str, object], version: str) -> int:
    """Peak allocated bytes on the installed transformers with ``--transformers-version``."""
    # the attention the CLI picks (eager for Phi-3 before 4.45), as the real run's CLI does
    attention = default_attention_of(str(model), version)
    t = TrainingConfig(
        precision="bf16-mixed",
        transformers_version=version,
        **{"attention": attention, **cell},  # type: ignore[arg-type]
    )
    return estimate(str(model), t, engine=engine).breakdown.allocated_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the venv's python with the release")
    parser.add_argument("--version", default="4.40.0", help="the release installed there")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--cells", default="1x128,none,full,lora", help=", ".join(CELLS))
    args = parser.parse_args(argv)
    print(f"{'cell':6} {'real ' + args.version:>14} {'generic':>22} {'formulas':>22}")
    for name in args.cells.split(","):
        cell = CELLS[name]
        real = real_peak(args.python, args.model, cell)
        row = [f"{name:6} {real:>14,}"]
        for engine in ("generic", "analytic"):
            got = here_peak(engine, args.model, cell, args.version)
            row.append(f"{got:>13,} ({got / real - 1:+.2%})")
        print(" ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
