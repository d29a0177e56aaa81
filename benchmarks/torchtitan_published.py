"""The analytic engine against torchtitan's published memory (docs/performance.md, Dec 2024:
torch 1963fc8, torchao eab345c, torchtitan 9dec370; H100 96 GB; memory = torchtitan's logged
``max_reserved`` GiB, the maximum over ranks). These rows are NOT in the development set: they
check mechanisms, no constant is fitted to them.

Run: ``python benchmarks/torchtitan_published.py [--write-results]`` (a few seconds);
``--write-results`` replaces its marked section of benchmarks/RESULTS.md.

Inputs as torchtitan ran them:
- ``framework="fsdp2"``, ``zero_stage=3`` over the data-parallel ranks, ``-c selective`` is
  torchtitan's op-level SAC, float8 rows ``precision="fp8-mixed"`` with ``compile=True``.
- Pipeline rows: torchtitan's ``build_pipeline_schedule`` sets ``n_microbatches`` to the number
  of stages when not given (``pipeline_parallel_degree * len(stages)``), and
  ``generate_split_points`` gives single-stage schedules (1F1B) one stage per rank and
  multi-stage ones (interleaved 1F1B) two (torchtitan/parallelisms/pipelining_utils.py of that
  date). So local batch 32 on PP 8 runs 8 micro-batches of 4 under 1F1B and 16 micro-batches of
  2 (two stages per rank) under interleaved 1F1B; Table 6's local batch 8 runs 8 of 1.
- ``run_llama_train.sh`` launches with ``PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"``:
  the last column replays the step with it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN = "<!-- torchtitan-published:begin (benchmarks/torchtitan_published.py) -->"
END = "<!-- torchtitan-published:end -->"
GPU = "H100-94GB"
EXPANDABLE = "expandable_segments:True"

_SAC = {"micro_batch_size": 2, "seq_len": 8192, "activation_checkpointing": "selective"}
_FULL = {"activation_checkpointing": "full", "compile": True, "precision": "fp8-mixed"}
_3D = {"data_parallel_size": 8, "tensor_parallel_size": 8, "sequence_parallel": True}
_3D |= {"pipeline_parallel_size": 8}

#: (row, model, settings, measured GiB, reserved GiB on main 531d149 before this change;
#: None: out of memory there).
ROWS: list[tuple[str, str, dict[str, object], float, float | None]] = [
    ("T1 8B FSDP 8", "llama-3.1-8b", {"data_parallel_size": 8, **_SAC}, 82.4, 78.9),
    (
        "T1 8B FSDP 8 + compile",
        "llama-3.1-8b",
        {"data_parallel_size": 8, "compile": True, **_SAC},
        77.0,
        80.2,
    ),
    (
        "T1 8B FSDP 8 + compile + fp8",
        "llama-3.1-8b",
        {"data_parallel_size": 8, "compile": True, "precision": "fp8-mixed", **_SAC},
        76.8,
        79.8,
    ),
    ("T3 8B FSDP 128", "llama-3.1-8b", {"data_parallel_size": 128, **_SAC}, 67.0, 67.8),
    (
        "T3 8B FSDP 128 + compile",
        "llama-3.1-8b",
        {"data_parallel_size": 128, "compile": True, **_SAC},
        62.0,
        69.1,
    ),
    (
        "T3 8B FSDP 128 + compile + fp8",
        "llama-3.1-8b",
        {"data_parallel_size": 128, "compile": True, "precision": "fp8-mixed", **_SAC},
        61.8,
        68.7,
    ),
    *(
        (
            f"T2 8B FSDP {dp} x CP {cp}, s {s}",
            "llama-3.1-8b",
            {"data_parallel_size": dp, "context_parallel_size": cp, "seq_len": s, **_FULL},
            meas,
            before,
        )
        for dp, cp, s, meas, before in (
            (8, 1, 32768, 83.9, 91.5),
            (4, 2, 65536, 84.2, None),
            (2, 4, 131072, 84.0, None),
            (1, 8, 262144, 84.5, None),
        )
    ),
    (
        "T4 70B FSDP 32 x TP 8 + SP, b16",
        "llama-3.1-70b",
        {
            "data_parallel_size": 32,
            "tensor_parallel_size": 8,
            "sequence_parallel": True,
            "micro_batch_size": 16,
            "seq_len": 8192,
            **_FULL,
        },
        71.9,
        65.1,
    ),
    (
        "T5 405B 3D, 1F1B (8 x b4)",
        "llama-3.1-405b",
        {**_3D, "micro_batch_size": 4, "gradient_accumulation_steps": 8, "seq_len": 8192, **_FULL},
        82.5,
        65.9,
    ),
    (
        "T5 405B 3D, interleaved 1F1B (16 x b2)",
        "llama-3.1-405b",
        {
            **_3D,
            "pipeline_schedule": "interleaved-1f1b",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 16,
            "seq_len": 8192,
            **_FULL,
        },
        72.7,
        65.9,
    ),
    *(
        (
            f"T6 405B FSDP {dp} x CP {cp} x TP 8 x PP 8, s {s}",
            "llama-3.1-405b",
            {
                **_3D,
                "data_parallel_size": dp,
                "context_parallel_size": cp,
                "micro_batch_size": 1,
                "gradient_accumulation_steps": 8,
                "seq_len": s,
                **_FULL,
            },
            meas,
            before,
        )
        for dp, cp, s, meas, before in (
            (8, 1, 32768, 75.3, 65.9),
            (4, 2, 65536, 75.9, 65.9),
            (2, 4, 131072, 77.1, 65.1),
            (1, 8, 262144, 84.9, 71.7),
        )
    ),
]


NOTES = [
    "What changed (each rule cited in the source, tested by hand derivation):",
    "- compile under op-level SAC: the trace compiles the checkpointed layer as dynamo does "
    "(the SAC policy as partitioner tags; before, AOTAutograd traced through the checkpoint "
    "and dropped it: llama-3.2-1b b2 s8192 FSDP 8, 44.6 -> 33.4 GiB, eager 34.4); the "
    "min-cut keeps no MUST_SAVE output the backward does not read (down_proj's): 8B "
    "allocated 68.7 -> 64.6 GiB with compile (measured reserved: -5.4 GiB).",
    "- context parallelism: the replay split terms into whole-sequence tensors (blocks twice "
    "the rank's), and FSDP 1 x CP 8 counted as unsharded (+12.8 GiB); no row runs out of "
    "memory now.",
    "- pipeline parallelism: torch.distributed.pipelining's stage outputs (fwd_cache), the "
    "last stage's logits of every micro-batch (output_chunks, kept to the next step, plus "
    "the merged copy), per-micro-batch receive buffers; torchtitan's stage split and "
    "micro-batch count (interleaved: 16 x b2, two stages per rank); interleaved in-flight "
    "from torch's warmup formula.",
    "- replay: FSDP2's all-gather and reduce-scatter outputs on their own streams (per-stream "
    "pools), the logits and their fp32 copy as two tensors, loss parallel's three backward "
    "tensors, op-level SAC's saved tensors one by one.",
    "Before, the interleaved row ran 8 x b4 (the lead's input): the engine gave both "
    "schedules the same peak.",
    "- pipeline x tensor parallelism (found by tracing torch.distributed.pipelining, "
    "trainmem.trace.pipeline): the token embedding's gradient is a whole-vocabulary partial "
    "DTensor on each TP rank (embedding_dense_backward has no vocabulary-sharded strategy), "
    "which FSDP2 accumulates in fp32 across the micro-batches: [V, h] fp32 = 7.8 GiB on "
    "stage 0 instead of its [V / 8, h] shard; perform_reduce_grad reduces FSDP2's groups "
    "one at a time. The 1F1B rows went from -19% / -11..-21% to -7% / +2..-9% (reserved). "
    "The traced T5 1F1B step (b4 s8192, 8 micro-batches, 55 s) peaks at 66.4 GiB allocated "
    "on stage 0 (the formulas 67.4), 61.3 on stage 1 (60.1), 58.0 on stage 7 (57.7); its "
    "replayed reserved, 71.2 GiB, is further from the measured 82.5 than the formulas' 77.0. "
    "The traced T5 interleaved step (16 x b2, 113 s): 61.6 / 54.7 / 56.1 GiB allocated on "
    "pipeline ranks 0 / 1 / 7 (the formulas 60.5 / 53.9 / 55.4), reserved at most 70.5 "
    "(measured 72.7).",
    "Open: which allocator setting the runs used (run_llama_train.sh sets expandable "
    "segments; both columns shown); T5 1F1B is still 5% under and T6 CP 8 8% under (T6 CP 8 "
    "grows by 7.8 GiB in the measurements, not in the model).",
    "- T4's reserved moved from 72.3 (+1%) to 81.0 GiB (+13%) when the float8 tensor-parallel "
    "rule (Note [Float8 tensor-parallel inputs]) halved its all-gathered inputs: allocated did "
    "not move (57.6 GiB), the replay's fragmentation did. The trace engine on the same row "
    "(composed, 14 s) peaks at 57.8 GiB allocated and replays to 72.2 GiB reserved (67.2 with "
    "expandable segments): the analytic schedule's blocks, not its bytes, are off. Its layer "
    "terms are split into tensors by size alone and differ from the trace's tensors (the MLP "
    "backward transient is one 2688 MiB block where the trace has three bf16 [t, i / 8] "
    "tensors of 896 MiB; a 1792 MiB term is taken as one fp32 [t, i / 8] tensor; the loss "
    "parallel head is one 10.3 GiB block); splitting the MLP transient alone leaves the "
    "reserved peak where it is. Open: give every term its tensors' shapes, then compare the "
    "two replays' segments.",
    "- The same float8 x compile rules moved other rows (all run compile + fp8): T5 "
    "interleaved allocated 60.5 -> 62.4 GiB (reserved -2% -> +3%; the traced figures quoted "
    "above predate these rules), T5 1F1B and T6 allocated 67.4 -> 66.5, and T2 reserved "
    "79.4 -> 77.3 GiB (-5% -> -8%) with its allocated unchanged, again the replay's blocks.",
    "- Session 8, pipeline rules checked against the trace (Note [New gradients under pipeline "
    "parallelism]: each micro-batch's new bf16 gradients of a layer until FSDP2's post-backward; "
    "Schedule1F1B's second backward finds one micro-batch fewer when the warmup ran them all, "
    "m <= p - stage, as T5 1F1B's 8 micro-batches on PP 8 do on stage 0): T5 1F1B allocated "
    "66.5 -> 65.1 GiB, reserved -7% -> -5%; T5 interleaved reserved +3% -> +4%; T6 allocated "
    "66.5 -> 65.1, reserved +2..-9% -> +4..-8%. The trace figures quoted above predate them.",
]


def _replayed(model: str, training: TrainingConfig, alloc_conf: str) -> tuple[float, float, bool]:
    """Max over ranks of (peak allocated GiB, replayed max_memory_reserved GiB), and whether
    the replay ran out of memory."""
    est = estimate(model, training, gpu=GPU, alloc_conf=alloc_conf)
    ranks = est.details["per_rank"]
    oom = any(r.get("oom") for r in ranks)
    allocated = max(int(r["allocated_bytes"]) for r in ranks) / 2**30
    return allocated, max(int(r.get("reserved_bytes", 0)) for r in ranks) / 2**30, oom


def _cell(gib: float | None, measured: float, oom: bool = False) -> str:
    if gib is None or oom:
        return "OOM"
    return f"{gib:.1f} ({100 * (gib - measured) / measured:+.0f}%)"


def rows() -> list[str]:
    """One markdown row per published measurement."""
    out = [
        "| row | measured GiB | before (main 531d149) | after: allocated | after: reserved "
        "| after: reserved, expandable segments |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, model, settings, measured, before in ROWS:
        training = TrainingConfig(framework="fsdp2", zero_stage=3, **settings)  # type: ignore[arg-type]
        allocated, after, oom = _replayed(model, training, "")
        _, exp, exp_oom = _replayed(model, training, EXPANDABLE)
        out.append(
            f"| {name} | {measured:.1f} | {_cell(before, measured)} | {allocated:.1f} | "
            f"{_cell(after, measured, oom)} | {_cell(exp, measured, exp_oom)} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    table = rows()
    print("\n".join(table))
    if args.write_results:
        section = "\n".join(
            [
                BEGIN,
                "## torchtitan's published memory (held out: a check on mechanisms)",
                "",
                "Max over ranks of the replayed reserved memory, analytic engine, H100 94 GB, "
                "against torchtitan docs/performance.md (Dec 2024). Before: main at 531d149 "
                "(the lead's run). Generated by `python benchmarks/torchtitan_published.py "
                "--write-results`; inputs and sources in the script's docstring.",
                "",
                *table,
                "",
                *NOTES,
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
