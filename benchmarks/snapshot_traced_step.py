"""Benchmark: trainmem's traced step against the real step recorded in GPU memory snapshots.

For the snapshots of ../shared/validation/snapshots whose model and configuration are known
with high confidence from their generating script (the CS336 course transformer, see its
README and index.csv), the same step is traced by the trace engine under CUDA emulation: the
model as a ``cs336_basics`` config (:func:`course_config`), which the engine builds from the
course code (``trainmem.trace.course_model``), and the script's loop as settings
(:func:`training_of`), i.e. ``estimate(config, training, engine="trace")``, and compared with the
real trace: peak allocated (the real one is the 512-byte-rounded requested peak, a lower bound of
``max_memory_allocated``), peak reserved after replaying the traced timeline through the
allocator simulator, and the allocation-size streams aligned (difflib, rounded sizes) with the
first point where they part. Target (issue 13): allocated within 2 %, reserved within 3 %. Run::

    PYTHONPATH=src python benchmarks/snapshot_traced_step.py [--write-results] [IDS...]

Each configuration takes 5-10 s to trace (two CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from snapshot_replay import DEFAULT_CORPUS, commit  # noqa: E402

from trainmem.allocator.snapshot import read_snapshot, snapshot_stats  # noqa: E402
from trainmem.allocator.snapshot_replay import busiest_device  # noqa: E402
from trainmem.allocator.stream_compare import align_sizes, real_allocations  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN = "<!-- snapshot-traced-step:begin (benchmarks/snapshot_traced_step.py --write-results) -->"
END = "<!-- snapshot-traced-step:end -->"
GiB = 2**30


@dataclass(frozen=True)
class Case:
    """One snapshot whose step is reproduced. Sizes from index.csv (read off the script)."""

    id: str
    vocab: int
    d_model: int
    layers: int
    heads: int
    d_ff: int
    batch: int
    seq_len: int
    optimizer: str  # "course-adamw", "torch-adamw" or "none" (forward + loss + backward only)
    grads_kept: bool  # gradients never set to None between steps
    precision: str  # TrainingConfig.precision
    what: str
    loss: str = "ce"  # "ce" (the course's), "torch-ce" (F.cross_entropy), "mean" or "sum"


CASES = [
    Case("S001", 10000, 768, 12, 12, 3072, 32, 256, "none", True, "32-true",
         "fp32 fwd + course CE + bwd; grads accumulate over 5 warm-up steps"),
    Case("S002", 10000, 1024, 24, 16, 4096, 4, 128, "course-adamw", False, "32-true",
         "fp32 full step, course AdamW, grads set to None before"),
    # index.csv says fp32 (medium confidence on the flag); the frames say bf16 autocast: 16-bit
    # Q.K^T (134 MB), then the softmax's exp / sum / div cast to fp32 (268 MB each).
    Case("S003", 10000, 1024, 24, 16, 4096, 4, 1024, "course-adamw", False, "bf16-mixed",
         "bf16 autocast full step (the frames show it), course AdamW"),
    # S009, S013, S014 call zero_grad between the forward and the backward: last step's
    # gradients live through the forward (zero_grad_before_backward; ``grads_kept`` True).
    Case("S009", 10000, 1280, 36, 20, 5120, 4, 256, "course-adamw", True, "32-true",
         "fp32 full step, loss = logits.sum(), course AdamW", "sum"),
    Case("S013", 10000, 2560, 32, 32, 10240, 4, 128, "course-adamw", True, "32-true",
         "fp32 full step, loss = logits.mean(), course AdamW", "mean"),
    Case("S014", 10000, 2560, 32, 32, 10240, 4, 128, "course-adamw", True, "bf16-mixed",
         "bf16 autocast full step, loss = logits.mean(), course AdamW", "mean"),
    # scripts read at the commits index.csv names; frames checked: the course's nn_utils loss
    # in S025, torch's F.cross_entropy and foreach AdamW (_multi_tensor_adam) in S026
    Case("S025", 10000, 2560, 32, 32, 6848, 4, 128, "none", False, "32-true",
         "fp32 fwd + course CE + bwd, no optimizer, d_ff = 8/3 d_model (6848)"),
    Case("S026", 10000, 2560, 32, 32, 10240, 4, 512, "torch-adamw", False, "bf16-mixed",
         "bf16 autocast full step, F.cross_entropy, torch AdamW (foreach)", "torch-ce"),
]  # fmt: skip
"""``Case.optimizer`` ``torch-adamw`` is torch.optim.AdamW (its foreach default),
``Case.loss`` ``torch-ce`` is F.cross_entropy."""


def course_config(case: Case) -> dict[str, Any]:
    """The case's model as a ``cs336_basics`` config.json: ``BasicsTransformerLM(vocab_size,
    context_length, d_model, num_layers, num_heads, d_ff, rope_theta)``; the scripts build the
    model with ``context_length`` = their sequence length."""
    return {
        "model_type": "cs336_basics",
        "vocab_size": case.vocab,
        "context_length": case.seq_len,
        "d_model": case.d_model,
        "num_layers": case.layers,
        "num_heads": case.heads,
        "d_ff": case.d_ff,
        "rope_theta": 10000.0,
    }


ZERO_GRAD_BEFORE_BACKWARD = frozenset({"S009", "S013", "S014"})
"""Scripts that call ``optimizer.zero_grad()`` between the forward and the backward (index.csv
"recorded": fwd, loss, zero_grad, bwd, step)."""

_LOSSES = {
    "ce": None,  # the family's own: the course's nn_utils.cross_entropy
    "torch-ce": "cross-entropy",
    "sum": "logits-sum",
    "mean": "logits-mean",
}


def training_of(case: Case) -> TrainingConfig:
    """The case's script as trainmem's settings: the course's attention is eager
    (written out), no dropout layers; the course AdamW (``cs336``) or torch's AdamW (its
    foreach default); S001 has no optimizer (``sgd``: no states, no temporaries) and never
    zeroes its gradients (``zero_grad_set_to_none=False`` holds the same memory); every script
    keeps ``logits = model(x)`` until its step function returns."""
    before = case.id in ZERO_GRAD_BEFORE_BACKWARD
    return TrainingConfig(
        micro_batch_size=case.batch,
        seq_len=case.seq_len,
        precision=case.precision,
        optimizer="sgd" if case.optimizer == "none" else "adamw",
        optimizer_implementation="cs336" if case.optimizer == "course-adamw" else None,
        attention="eager",
        dropout=False,
        zero_grad_set_to_none=not case.grads_kept or before,
        zero_grad_before_backward=before,
        loss=_LOSSES[case.loss],
        keep_logits=True,
    )


def run_case(case: Case, corpus: Path) -> dict[str, Any]:
    import json
    import tempfile

    snap = read_snapshot(corpus / f"{case.id}.pickle")
    device = busiest_device(snap)
    real = snapshot_stats(snap, device)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(course_config(case), f)
    t0 = time.perf_counter()
    est = estimate(f.name, training_of(case), engine="trace")
    seconds = time.perf_counter() - t0
    timeline = est.timeline
    assert timeline is not None
    # the driver's replay: the recorded state without the optimizer states, a warm-up step that
    # creates them lazily, then the recorded step (Note [Lazy optimizer states])
    replay = est.details["allocator_replay"]
    step = timeline.events[timeline.steady_state_start :]
    predicted_sizes = [e.size_bytes for e in step if e.action == "alloc"]
    entries = snap["device_traces"][device]
    real_sizes = [r.size_bytes for r in real_allocations(entries)]
    # The real trace may start in the middle of a step; align on the traced step's stream.
    aligned = align_sizes(real_sizes, predicted_sizes)
    return {
        "case": case,
        "seconds": seconds,
        "real_alloc": real["peak_requested_rounded_bytes"],
        "real_res": real["peak_reserved_bytes"],
        "traced_alloc": replay["max_memory_allocated"],
        "traced_res": replay["max_memory_reserved"],
        "peak_phase": est.peak_phase,
        "aligned": aligned,
        "n_real": len(real_sizes),
        "n_pred": len(predicted_sizes),
    }


def pct(a: int, b: int) -> str:
    return f"{100 * (a - b) / b:+.2f} %"


MISS_CAUSES: dict[str, str] = {}
"""Why a row misses, where looked at (the replay's reserved peak, by hand)."""


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Traced step against the real step (course transformer snapshots)",
        "",
        f"Generated by `benchmarks/snapshot_traced_step.py` on {datetime.now(UTC):%Y-%m-%d} at "
        f"commit {commit()}. The course model as a `cs336_basics` config traced by the "
        'trace engine (`estimate(..., engine="trace")`, which builds the course code: '
        "`trainmem/trace/course_model.py`) with each script's loop as settings (`training_of`: "
        "the course's AdamW, its cross-entropy / `F.cross_entropy` / `logits.sum()`, "
        "`keep_logits`, `zero_grad_before_backward`), CUDA emulation, and the driver's replay "
        "of its schedule through the allocator simulator from an empty cache: the weights, a "
        "warm-up step that creates the optimizer states lazily, then the recorded step "
        "(Note [Lazy optimizer states]). Real: the snapshot's "
        "rounded requested peak (a lower bound of `max_memory_allocated`) and its exact peak "
        "reserved.",
        "",
        "| id | configuration | real alloc GiB | traced alloc GiB | error | real reserved GiB "
        "| traced reserved GiB | error | allocations paired (real / traced) | traced peak in |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        c: Case = r["case"]
        a = r["aligned"]
        lines.append(
            f"| {c.id} | d={c.d_model} L={c.layers} V={c.vocab} B={c.batch} T={c.seq_len}; "
            f"{c.what} | {r['real_alloc'] / GiB:.3f} | {r['traced_alloc'] / GiB:.3f} | "
            f"{pct(r['traced_alloc'], r['real_alloc'])} | {r['real_res'] / GiB:.3f} | "
            f"{r['traced_res'] / GiB:.3f} | {pct(r['traced_res'], r['real_res'])} | "
            f"{a['matched']} of {r['n_real']} / {r['n_pred']} | {r['peak_phase']} |"
        )
    lines += [
        "",
        "- The configuration had to match the script, not just the sizes: the course's "
        "cross-entropy materialises four logits-sized tensors (with `F.cross_entropy` S001 is "
        "-6 %; with the log-softmax inlined into one function, +2.4 %: a local keeps one more "
        "alive), and its for-loop AdamW has per-parameter temporaries where torch's foreach "
        "AdamW holds whole-model lists (S002 +21 % with the default optimizer). S001's "
        "gradients persist across steps (`zero_grad_set_to_none=False` reproduces them); the "
        "scripts hold `logits = model(x)` to the end of the step (`keep_logits`).",
        "- Fixed in the trace engine: under fake tensors `gather`'s backward took its "
        "out-of-place branch (FunctionsManual.cpp `gather_backward`, `areAnyTensorSubclassLike`), "
        "one (t, V) tensor more than a GPU at the course cross-entropy's backward "
        "(`trainmem/trace/cuda_scatter.py`; S001 +2.35 % before); the same for `max(dim)`'s "
        "backward (ReduceOps.cpp `value_selecting_reduction_backward_symint`), one (b, heads, "
        "s, s) tensor more per layer at the written-out softmax's max (S026).",
        "- Fixed in the trace engine: the autograd engine sums two gradients of one tensor in "
        "place on a GPU (input_buffer.cpp `accumulate`: `old_var.add_(var)` when it holds the "
        "last reference) but out of place under any dispatch mode; the trace now sums in place "
        "where the GPU does (`trainmem/trace/cuda_accumulate.py`): S026's backward had 7 fp32 "
        "(b, s, d) allocations per layer more than the real stream, now none.",
        "- Fixed in the driver: the replay allocated the optimizer states with the weights; "
        "torch creates them in the first `optimizer.step()`, in the blocks the first backward "
        "freed, and the run's reserved peak comes from that layout (S026: 76.91 GiB, +5.7 %, "
        "before; `StepSchedule.with_lazy_optimizer_states`).",
        "- Left as explained differences of the streams: CUDA's reduction kernel allocates a "
        "staging buffer and semaphores for a reduction split across blocks (Reduce.cuh "
        "`gpu_reduce_kernel`, `should_global_reduce`; its size depends on the GPU's SM count): "
        "S026's stream has a 40 MiB buffer and an 80-byte semaphore block at each RMSNorm "
        "weight-gradient sum (65 per step), which the CPU trace does not make; S026's script "
        "casts the logits to fp32 before `F.cross_entropy` (the frames put an fp32 copy on the "
        "line before the log-softmax), where the traced `F.cross_entropy` runs the log-softmax "
        "in bf16 and `nll_loss`'s fp32 cast after it (39 + 78 MiB instead of 78 + 78 MiB).",
        "- Read off the frames, not index.csv: S003 ran under bf16 autocast (16-bit Q.K^T, the "
        "softmax's exp/sum/div cast to fp32), not fp32 (+27.6 % traced as fp32); S009, S013 "
        "and S014 call `zero_grad` between the forward and the backward, so the previous "
        "step's gradients are alive through the forward, where their peak is "
        "(`zero_grad_before_backward`).",
        "- Reserved is replayed from an empty cache with one warm-up step; the real runs are "
        "warm (several steps), which accounts for small reserved differences.",
        *(
            f"- {r['case'].id} misses the reserved bar: {MISS_CAUSES[r['case'].id]}"
            for r in rows
            if r["case"].id in MISS_CAUSES
            and abs(r["traced_res"] - r["real_res"]) > 0.03 * r["real_res"]
        ),
        "- Not compared: snapshots compiled with `torch.compile` (S005, S006), inference-only "
        "recordings (the trace engine traces training steps), students' own models (S007, "
        "S030, S031, S044) and those whose batch or sequence length the script leaves open.",
    ]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    old = RESULTS.read_text()
    block = f"{BEGIN}\n{text}{END}\n"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        new = head + block + tail.lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    RESULTS.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ids", nargs="*")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.ids or c.id in args.ids]
    rows = []
    for case in cases:
        row = run_case(case, args.corpus)
        rows.append(row)
        print(
            f"{case.id}: allocated real {row['real_alloc'] / GiB:.3f} traced "
            f"{row['traced_alloc'] / GiB:.3f} GiB ({pct(row['traced_alloc'], row['real_alloc'])}); "
            f"reserved real {row['real_res'] / GiB:.3f} traced {row['traced_res'] / GiB:.3f} GiB "
            f"({pct(row['traced_res'], row['real_res'])}); {row['seconds']:.0f} s",
            flush=True,
        )
    text = render(rows)
    print()
    print(text)
    if args.write_results:
        write_section(text)
    ok = all(
        abs(r["traced_alloc"] - r["real_alloc"]) <= 0.02 * r["real_alloc"]
        and abs(r["traced_res"] - r["real_res"]) <= 0.03 * r["real_res"]
        for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
