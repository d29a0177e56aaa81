"""The analytic engine against the trace engine, per rank, on the large-scale stack (issue 14):
FSDP2 x TP x SP x CP, torch.compile and float8 on llama-3.2-1b (16 layers, tied embeddings),
micro-batch 1, sequence 2048, torchtitan's conventions (``framework="fsdp2"``); pipeline
parallelism (1F1B, interleaved 1F1B, GPipe) per pipeline rank.

Then llama-3.1-8b / 70b / 405b at b=1, s=8192 (:data:`LARGE_CELLS`), a few layers traced and
repeated to full depth.

Run: ``python benchmarks/parallel_analytic_vs_trace.py [--write-results]`` (about ten minutes);
``--write-results`` replaces its marked section of benchmarks/RESULTS.md. Cells the trace
engine cannot run say why.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import TrainmemError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN = "<!-- parallel-analytic-vs-trace:begin (benchmarks/parallel_analytic_vs_trace.py) -->"
END = "<!-- parallel-analytic-vs-trace:end -->"
MODEL = "llama-3.2-1b"
FSDP = {"data_parallel_size": 2, "zero_stage": 3, "framework": "fsdp2"}
PP = {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4}
"""Pipeline cells: torch.distributed.pipelining traced on every pipeline rank whose memory
differs (the first, the last, the most loaded); one row per rank."""
CELLS: list[tuple[str, dict[str, object]]] = [
    ("single GPU", {}),
    ("FSDP 2", FSDP),
    ("FSDP 2 x TP 2 + SP", {**FSDP, "tensor_parallel_size": 2, "sequence_parallel": True}),
    (
        "FSDP 2 x TP 2 + SP, full AC",
        {
            **FSDP,
            "tensor_parallel_size": 2,
            "sequence_parallel": True,
            "activation_checkpointing": "full",
        },
    ),
    ("FSDP 2 x CP 2", {**FSDP, "context_parallel_size": 2}),
    # the plain loop's ZeRO-3 (FSDP2 on fp32 weights under bf16 autocast): its shard group
    # spans the CP ranks and autocast's saved weight casts are whole on each (issue 26)
    (
        "FSDP 2 x CP 2, plain loop (pytorch-amp, autocast)",
        {"data_parallel_size": 2, "zero_stage": 3, "context_parallel_size": 2},
    ),
    ("FSDP 2, compile", {**FSDP, "compile": True}),
    (
        "FSDP 2, op-level SAC + compile",
        {**FSDP, "compile": True, "activation_checkpointing": "selective"},
    ),
    ("FSDP 2, full AC + compile", {**FSDP, "compile": True, "activation_checkpointing": "full"}),
    ("FSDP 2, float8", {**FSDP, "precision": "fp8-mixed"}),
    (
        "FSDP 2 x TP 2 + SP, compile + float8",
        {**FSDP, "tensor_parallel_size": 2, "sequence_parallel": True, "compile": True,
         "precision": "fp8-mixed"},
    ),
    ("FSDP 2 x PP 2, 1F1B", {**FSDP, **PP}),
    (
        "FSDP 2 x PP 4, 1F1B",
        {**FSDP, **PP, "pipeline_parallel_size": 4, "gradient_accumulation_steps": 8},
    ),
    ("FSDP 2 x PP 2, interleaved 1F1B", {**FSDP, **PP, "pipeline_schedule": "interleaved-1f1b"}),
    ("FSDP 2 x PP 2, GPipe", {**FSDP, **PP, "pipeline_schedule": "gpipe"}),
    (
        "FSDP 2 x TP 2 + SP x PP 2, full AC",
        {**FSDP, **PP, "tensor_parallel_size": 2, "sequence_parallel": True,
         "activation_checkpointing": "full"},
    ),
    (
        "FSDP 2 x TP 2 + SP x PP 2, compile + float8",
        {**FSDP, **PP, "tensor_parallel_size": 2, "sequence_parallel": True, "compile": True,
         "precision": "fp8-mixed"},
    ),
    (
        "FSDP 2 x PP 2, full AC + compile + float8",
        {**FSDP, **PP, "activation_checkpointing": "full", "compile": True,
         "precision": "fp8-mixed"},
    ),
    ("FSDP 2 x CP 2 x PP 2, 1F1B", {**FSDP, **PP, "context_parallel_size": 2}),
    (
        "FSDP 2 x CP 2 x PP 2, interleaved 1F1B",
        {**FSDP, **PP, "context_parallel_size": 2, "pipeline_schedule": "interleaved-1f1b"},
    ),
    (
        "FSDP 2 x TP 2 + SP x CP 2 x PP 2",
        {**FSDP, **PP, "context_parallel_size": 2, "tensor_parallel_size": 2,
         "sequence_parallel": True},
    ),
]  # fmt: skip


# -- llama-3.1-8b / 70b / 405b at realistic sizes (issue 14) -------------------------------
# A few layers of each run traced and repeated to full depth: the generic path
# (trainmem.trace.generic) without pipelining, a few layers per stage with it
# (trainmem.trace.pipeline); each cell in seconds to a minute.
LARGE_SEQ_LEN = 8192
F8 = {"data_parallel_size": 8, "zero_stage": 3, "framework": "fsdp2"}
F4 = {"data_parallel_size": 4, "zero_stage": 3, "framework": "fsdp2"}
TP2 = {"tensor_parallel_size": 2, "sequence_parallel": True}
TP8 = {"tensor_parallel_size": 8, "sequence_parallel": True}
AC = {"activation_checkpointing": "full"}
SAC = {"activation_checkpointing": "selective"}
IL = {"pipeline_schedule": "interleaved-1f1b"}
F8C = {"compile": True, "precision": "fp8-mixed"}
LARGE_CELLS: list[tuple[str, str, dict[str, object]]] = [
    ("llama-3.1-8b", "FSDP 8", F8),
    ("llama-3.1-8b", "FSDP 8, full AC", {**F8, **AC}),
    ("llama-3.1-8b", "FSDP 8, op-level SAC", {**F8, **SAC}),
    ("llama-3.1-8b", "FSDP 8, compile", {**F8, "compile": True}),
    ("llama-3.1-8b", "FSDP 8, full AC + compile", {**F8, **AC, "compile": True}),
    ("llama-3.1-8b", "FSDP 8, float8", {**F8, "precision": "fp8-mixed"}),
    ("llama-3.1-8b", "FSDP 4 x TP 2 + SP", {**F4, **TP2}),
    ("llama-3.1-8b", "FSDP 4 x TP 2 + SP, full AC", {**F4, **TP2, **AC}),
    ("llama-3.1-8b", "FSDP 4 x TP 2 + SP, op-level SAC", {**F4, **TP2, **SAC}),
    ("llama-3.1-8b", "FSDP 4 x TP 2 + SP, compile + float8", {**F4, **TP2, **F8C}),
    ("llama-3.1-8b", "FSDP 4 x CP 2", {**F4, "context_parallel_size": 2}),
    ("llama-3.1-8b", "FSDP 4 x PP 2, 1F1B", {**F4, "pipeline_parallel_size": 2,
                                              "gradient_accumulation_steps": 8}),
    ("llama-3.1-8b", "FSDP 4 x PP 2, interleaved 1F1B", {**F4, **IL, "pipeline_parallel_size": 2,
                                                          "gradient_accumulation_steps": 8}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP", {**F8, **TP8}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP, full AC", {**F8, **TP8, **AC}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP, op-level SAC", {**F8, **TP8, **SAC}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP, full AC + compile + float8", {**F8, **TP8, **AC, **F8C}),
    ("llama-3.1-70b", "FSDP 8 x TP 4 + SP x CP 2, full AC",
     {**F8, "tensor_parallel_size": 4, "sequence_parallel": True, "context_parallel_size": 2,
      **AC}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP x PP 4, 1F1B, full AC",
     {**F8, **TP8, **AC, "pipeline_parallel_size": 4, "gradient_accumulation_steps": 8}),
    ("llama-3.1-70b", "FSDP 8 x TP 8 + SP x PP 4, interleaved 1F1B, full AC",
     {**F8, **TP8, **AC, **IL, "pipeline_parallel_size": 4, "gradient_accumulation_steps": 8}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP, full AC", {**F8, **TP8, **AC}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP, op-level SAC", {**F8, **TP8, **SAC}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP x CP 2, full AC",
     {**F8, **TP8, **AC, "context_parallel_size": 2}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP x PP 8, 1F1B, full AC",
     {**F8, **TP8, **AC, "pipeline_parallel_size": 8, "gradient_accumulation_steps": 16}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP x PP 8, 1F1B, full AC + compile + float8",
     {**F8, **TP8, **AC, **F8C, "pipeline_parallel_size": 8, "gradient_accumulation_steps": 16}),
    ("llama-3.1-405b", "FSDP 8 x TP 8 + SP x PP 8, interleaved 1F1B, full AC",
     {**F8, **TP8, **AC, **IL, "pipeline_parallel_size": 8, "gradient_accumulation_steps": 16}),
]  # fmt: skip
"""Large-model cells: (preset, cell, settings) at b=1, s=:data:`LARGE_SEQ_LEN`."""


def large_rows() -> list[str]:
    """One markdown row per large-model cell (per traced pipeline rank): analytic and traced
    peak allocated, the error, the seconds the trace took."""
    import time

    out = [
        "| model | cell | analytic GiB | trace GiB | error | trace s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, name, settings in LARGE_CELLS:
        training = TrainingConfig(micro_batch_size=1, seq_len=LARGE_SEQ_LEN, **settings)  # type: ignore[arg-type]
        analytic = _stages(estimate(model, training, simulate_allocator=False))
        engine = "trace" if training.pipeline_parallel_size > 1 else "generic"
        start = time.monotonic()
        try:
            traced = _stages(estimate(model, training, engine=engine, simulate_allocator=False))
        except TrainmemError as err:
            a = max(analytic.values())
            out.append(f"| {model} | {name} | {a / 2**30:.2f} | not traced: {err} | - | - |")
            continue
        seconds = time.monotonic() - start
        for stage, b in traced.items():
            a = analytic[stage]
            label = f"{name}, stage {stage}" if len(traced) > 1 else name
            out.append(
                f"| {model} | {label} | {a / 2**30:.2f} | {b / 2**30:.2f} | "
                f"{100 * (a - b) / b:+.1f}% | {seconds:.0f} |"
            )
    return out


def _stages(est: MemoryEstimate) -> dict[int, int]:
    """Pipeline stage -> peak allocated bytes of its rank (stage 0 without pipelining)."""
    return {
        int(r.get("pipeline_stage", 0)): int(r["allocated_bytes"]) for r in est.details["per_rank"]
    }


def rows() -> list[str]:
    """One markdown row per cell (per pipeline rank for the pipeline cells): analytic and traced
    peak allocated, the error."""
    out = ["| cell | analytic GiB | trace GiB | error |", "|---|---:|---:|---:|"]
    for name, settings in CELLS:
        training = TrainingConfig(micro_batch_size=1, seq_len=2048, **settings)  # type: ignore[arg-type]
        analytic = _stages(estimate(MODEL, training, simulate_allocator=False))
        try:
            traced = _stages(estimate(MODEL, training, engine="trace", simulate_allocator=False))
        except TrainmemError as err:
            a = max(analytic.values())
            out.append(f"| {name} | {a / 2**30:.2f} | not traced: {err} | - |")
            continue
        for stage, b in traced.items():
            a = analytic[stage]
            label = f"{name}, stage {stage}" if len(traced) > 1 else name
            out.append(
                f"| {label} | {a / 2**30:.2f} | {b / 2**30:.2f} | {100 * (a - b) / b:+.1f}% |"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    table = rows()
    print("\n".join(table))
    large = large_rows()
    print("\n".join(large))
    if args.write_results:
        section = "\n".join(
            [
                BEGIN,
                "## Analytic vs trace on the large-scale stack (llama-3.2-1b, per rank)",
                "",
                "Peak allocated of one rank (the most loaded; every traced pipeline rank in the "
                "PP cells: 4 micro-batches on PP 2, 8 on PP 4), b=1, s=2048, `framework=fsdp2` "
                "(torchtitan's conventions) except the plain-loop cell (`pytorch-amp`: FSDP2 on "
                "fp32 weights under bf16 autocast). Generated by "
                "`python benchmarks/parallel_analytic_vs_trace.py --write-results`.",
                "",
                *table,
                "",
                "### llama-3.1-8b / 70b / 405b (per rank, b=1, s=8192)",
                "",
                "A few layers of each run traced and repeated to full depth (the generic path; "
                "with pipelining a few layers per stage, every micro-batch of the step: 8 on "
                "PP 2 and PP 4, 16 on PP 8), `framework=fsdp2`.",
                "",
                *large,
                END,
            ]
        )
        text = RESULTS.read_text()
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
        else:
            text = text.rstrip() + "\n\n" + section + "\n"
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
