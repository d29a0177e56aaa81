"""Benchmark: the analytic engine's step schedule against the real step recorded in GPU memory
snapshots (issue 13).

For the snapshots of ../shared/validation/snapshots whose model and configuration are known
(the CS336 course transformer: the cases of ``snapshot_traced_step.py`` and S025, S026), the
course model is given to the analytic engine as what it is, a ``cs336_basics`` config
(:func:`course_config`: ``BasicsTransformerLM``'s constructor arguments, the family of
``trainmem.specs.hf_table``), with the script's training loop as settings
(:func:`training_of`): the course's AdamW (``optimizer_implementation="cs336"``) or torch's,
the course's cross-entropy (the family's own loss), ``F.cross_entropy`` or ``logits.sum()`` /
``.mean()`` (``loss``), the logits held until the step ends (``keep_logits``), ``zero_grad``
between the forward and the backward (``zero_grad_before_backward``) or never
(``zero_grad_set_to_none=False``). Its schedule, replayed through the allocator simulator
(``estimate(..., engine="analytic")`` -> ``finish``), is compared with the real trace: peak
allocated (the real one is the 512-byte-rounded requested peak, a lower bound of
``max_memory_allocated``; the predicted one is the schedule's peak of live requested bytes,
what ``estimate`` reports), peak reserved and the peak of each phase (the real phases read off
the recorded stacks, ``stream_compare.phase_of``). For comparison, the same step with the
course model given as a transformers Llama config (``benchmarks/cs336_configs``, what the
engine could do before the family existed).

Every course-code difference is an engine rule read from a ModelSpec trait or a setting, each
cited to the course file it mirrors (cs336-basics ``cs336_basics/model.py``, ``nn_utils.py``,
``optimizer.py``, as copied in the students' repositories, e.g. Wedsonlin/assignment2-systems,
stanford-cs336/spring2024-assignment2-systems); the scripts per snapshot in index.csv. Run::

    PYTHONPATH=src python benchmarks/snapshot_analytic_step.py [--write-results] [IDS...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from snapshot_replay import DEFAULT_CORPUS, commit  # noqa: E402
from snapshot_traced_step import CASES as TRACED_CASES  # noqa: E402
from snapshot_traced_step import Case, course_config, training_of  # noqa: E402

from trainmem.allocator.caching import round_size_default  # noqa: E402
from trainmem.allocator.replay import replay_timeline  # noqa: E402
from trainmem.allocator.snapshot import read_snapshot, snapshot_stats  # noqa: E402
from trainmem.allocator.snapshot_replay import busiest_device  # noqa: E402
from trainmem.allocator.stream_compare import phase_summary  # noqa: E402
from trainmem.estimate import estimate, resolve_model  # noqa: E402
from trainmem.specs.hf import model_spec_from_hf  # noqa: E402
from trainmem.specs.model import ModelSpec  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
CONFIGS = Path(__file__).resolve().parent / "cs336_configs"
BEGIN = (
    "<!-- snapshot-analytic-step:begin (benchmarks/snapshot_analytic_step.py --write-results) -->"
)
END = "<!-- snapshot-analytic-step:end -->"
GiB = 2**30
ALLOCATED_TOLERANCE = 0.02  # issue 13's bar
RESERVED_TOLERANCE = 0.03

CASES = TRACED_CASES
"""The cases of ``snapshot_traced_step.py``."""

_SIZES = {
    (768, 3072): "small",
    (1024, 4096): "medium",
    (1280, 5120): "large",
    (2560, 10240): "2.7b",
    (2560, 6848): "2.7b-ff6848",
}


def config_path(case: Case) -> Path:
    """The llama-shaped config.json of the case's course model size."""
    return CONFIGS / f"cs336-{_SIZES[case.d_model, case.d_ff]}.json"


def resolve_llama(case: Case) -> ModelSpec:
    """The case's model as the Llama-shaped config it was given before the family existed."""
    return resolve_model(str(config_path(case)))


def course_model(case: Case) -> ModelSpec:
    """:func:`course_config` read by the family table."""
    return model_spec_from_hf(course_config(case), name=f"cs336_basics {case.id}")


def llama_training_of(case: Case) -> TrainingConfig:
    """The settings the engine took before the family existed (the Llama-shaped config): the
    torch for-loop AdamW for the course's, no loss or loop options."""
    return replace(
        training_of(case),
        optimizer_implementation="for-loop" if case.optimizer == "course-adamw" else None,
        zero_grad_set_to_none=not case.grads_kept,
        zero_grad_before_backward=False,
        loss=None,
        keep_logits=False,
    )


# -- the real snapshot ----------------------------------------------------------------------


def real_numbers(snapshot_id: str, corpus: Path) -> dict[str, Any]:
    """Peak allocated (512-rounded requested), peak reserved and the peak of each phase of a
    real snapshot; a phase peak is the live bytes at the trace start (rebuilt from the final
    segments, as ``snapshot_stats`` does) plus the highest excursion inside that phase."""
    snap = read_snapshot(corpus / f"{snapshot_id}.pickle")
    device = busiest_device(snap)
    stats = snapshot_stats(snap, device)
    entries = snap["device_traces"][device]
    delta = 0
    for e in entries:
        if e.get("action") == "alloc":
            delta += round_size_default(int(e["size"]))
        elif e.get("action") == "free_completed":
            delta -= round_size_default(int(e["size"]))
    final = sum(
        round_size_default(int(blk.get("requested_size", blk["size"])))
        for seg in snap["segments"]
        if seg.get("device", 0) == device
        for blk in seg.get("blocks", [])
        if blk.get("state") in ("active_allocated", "active_pending_free")
    )
    start = final - delta
    phases = {k: start + row["peak_live_delta_bytes"] for k, row in phase_summary(entries).items()}
    return {
        "allocated": stats["peak_requested_rounded_bytes"],
        "reserved": stats["peak_reserved_bytes"],
        "phases": phases,
    }


def _predict(path: str | ModelSpec, training: TrainingConfig) -> dict[str, Any]:
    est = estimate(path, training, engine="analytic")
    events = list(est.schedules[0].events())
    replay = replay_timeline(events, capacity_bytes=None)
    at = events[replay.peak_reserved_event_index or 0]
    return {
        "allocated": est.breakdown.allocated_bytes,
        "reserved": est.details["allocator_replay"]["max_memory_reserved"],
        "phases": est.schedules[0].phase_peaks(),
        "peak": est.peak_reason,
        "reserved_peak": f"{at.phase} ({at.category.value} of {at.module or 'the model'}, "
        f"{at.size_bytes / 2**20:.1f} MiB), {gib(replay.fragmentation_bytes)} GiB cached "
        "but unused there",
    }


def predict(case: Case) -> dict[str, Any]:
    """The analytic engine's numbers for the case as the ``cs336_basics`` family
    (``analytic``) and as the Llama-shaped config it was given before (``llama``)."""
    return {
        "case": case,
        "analytic": _predict(course_model(case), training_of(case)),
        "llama": _predict(str(config_path(case)), llama_training_of(case)),
    }


def run_case(case: Case, corpus: Path) -> dict[str, Any]:
    """Real and analytic numbers of one case."""
    return {**predict(case), "real": real_numbers(case.id, corpus)}


def pct(a: int, b: int) -> str:
    return f"{100 * (a - b) / b:+.2f} %"


def gib(x: int) -> str:
    return f"{x / GiB:.3f}"


def print_case(r: dict[str, Any]) -> None:
    c: Case = r["case"]
    real, an, ll = r["real"], r["analytic"], r["llama"]
    print(f"{c.id}: {c.what} (d={c.d_model} L={c.layers} B={c.batch} T={c.seq_len})")
    for what in ("allocated", "reserved"):
        print(
            f"  {what:9s} real {gib(real[what])} GiB | analytic {gib(an[what])} "
            f"({pct(an[what], real[what])}) | as Llama {gib(ll[what])} "
            f"({pct(ll[what], real[what])})"
        )
    for phase, value in real["phases"].items():
        a = an["phases"].get(phase)
        if a is not None:
            print(f"  {phase:9s} real {gib(value)} | analytic {gib(a)} ({pct(a, value)})")


def within(a: int, b: int, tol: float) -> bool:
    return abs(a - b) <= tol * b


def meets(r: dict[str, Any], key: str = "analytic") -> bool:
    """Issue 13's bar: allocated within 2 %, reserved within 3 %."""
    return within(r[key]["allocated"], r["real"]["allocated"], ALLOCATED_TOLERANCE) and within(
        r[key]["reserved"], r["real"]["reserved"], RESERVED_TOLERANCE
    )


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Analytic step against the real step (course transformer snapshots)",
        "",
        f"Generated by `benchmarks/snapshot_analytic_step.py` on {datetime.now(UTC):%Y-%m-%d} "
        f"at commit {commit()}. The course model as the `cs336_basics` family (the course's "
        "written-out attention softmax, `x * sigmoid(x)` SiLU, RoPE buffer and cross-entropy "
        "as engine rules) with each script's loop as settings (`--optimizer-implementation "
        "cs336`, `--loss`, `--keep-logits`, `--zero-grad-before-backward`, `--zero-grad-keep`; "
        '`training_of` in the script); `estimate(..., engine="analytic")` and its replay '
        "through the allocator simulator. Real: the snapshot's rounded requested peak (a lower "
        "bound of `max_memory_allocated`) and its exact peak reserved. *As Llama*: the same "
        "step with the course model given as a transformers Llama config "
        "(`benchmarks/cs336_configs`) and no loop settings, what the engine did before. Bar "
        "(issue 13): allocated within 2 %, reserved within 3 %.",
        "",
        "| id | configuration | real alloc GiB | analytic | error | as Llama | error "
        "| real reserved GiB | analytic | error | as Llama | error | analytic peak in |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c: Case = r["case"]
        real, an, ll = r["real"], r["analytic"], r["llama"]
        lines.append(
            f"| {c.id} | d={c.d_model} L={c.layers} B={c.batch} T={c.seq_len}; {c.what} "
            f"| {gib(real['allocated'])} | {gib(an['allocated'])} "
            f"| {pct(an['allocated'], real['allocated'])} | {gib(ll['allocated'])} "
            f"| {pct(ll['allocated'], real['allocated'])} | {gib(real['reserved'])} "
            f"| {gib(an['reserved'])} | {pct(an['reserved'], real['reserved'])} "
            f"| {gib(ll['reserved'])} | {pct(ll['reserved'], real['reserved'])} "
            f"| {an['peak'].split(':')[0].split(',')[0]} |"
        )
    n = len(rows)
    met_a = sum(within(r["analytic"]["allocated"], r["real"]["allocated"], 0.02) for r in rows)
    met_r = sum(within(r["analytic"]["reserved"], r["real"]["reserved"], 0.03) for r in rows)
    met = sum(meets(r) for r in rows)
    before = sum(meets(r, "llama") for r in rows)
    lines += [
        "",
        f"Bar met by the analytic engine alone: allocated on {met_a}/{n}, reserved on "
        f"{met_r}/{n}, both on {met}/{n} snapshots (as Llama: both on {before}/{n}). Peak of "
        "each phase:",
        "",
        "| id | phase | real GiB | analytic | error |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        for phase, value in r["real"]["phases"].items():
            a = r["analytic"]["phases"].get(phase)
            if a is not None:
                lines.append(
                    f"| {r['case'].id} | {phase} | {gib(value)} | {gib(a)} | {pct(a, value)} |"
                )
    misses = [r for r in rows if not meets(r)]
    if misses:
        lines += ["", "Where the rows that miss have their replayed reserved peak:", ""]
        lines += [
            f"- {r['case'].id}: allocated {pct(r['analytic']['allocated'], r['real']['allocated'])}"
            f", reserved {pct(r['analytic']['reserved'], r['real']['reserved'])}; the reserved "
            f"peak is in the {r['analytic']['reserved_peak']} (real: "
            f"{gib(r['real']['reserved'] - r['real']['allocated'])} GiB between the peaks). "
            + MISS_CAUSES.get(r["case"].id, "")
            for r in misses
        ]
    lines += ["", "The course code's tensors, as engine rules (docs/formulas.md):", ""]
    lines += [f"- {text}" for text in RULES]
    lines += [
        "",
        "- The explicit settings matter: S009, S013 and S014 call `zero_grad` between the "
        "forward and the backward (the previous step's gradients are alive through the "
        "forward, where their peak is); S001 never zeroes them; every script holds `logits` "
        "until its step function returns; S009/S013/S014 use `logits.sum()` / `.mean()` as "
        "the loss and S026 `F.cross_entropy` with torch's AdamW.",
        "- Reserved is replayed from an empty cache; the real runs are warm (several steps).",
    ]
    return "\n".join(lines) + "\n"


MISS_CAUSES = {
    "S002": "The step's bytes are the real ones (allocated -0.00 %, every phase within "
    "0.6 %) and the optimizer's allocations match the real ones in count and size (five "
    "39 MiB tensors per embedding-sized parameter, read off optimizer.py's recorded lines); "
    "the replay keeps more cached blocks too small for them. Not found: which earlier "
    "allocation order leaves the real cache less fragmented (the schedule has no per-op "
    "transients of the norms and RoPE, and frees a layer's backward transients as one block).",
}
"""Why a row misses, where known (checked by hand against the recorded stacks)."""

RULES = (
    "Attention (`ModelSpec.attention_written_out`, `written_out_attention_terms`): "
    "`nn_utils.softmax` saves exp's fp32 output and the quotient, (4 + c) a s^2 b per layer, "
    "with max's int64 indices, the fp32 row sums and the (s, s) boolean causal mask; in the "
    "forward the masked and max-shifted scores (and exp's fp32 input copy under autocast) are "
    "alive at exp; its division's backward holds five fp32 a s^2 b tensors (Note [Backward "
    "of a written-out softmax]).",
    "SiLU (`ModelSpec.activation_written_out`): `x * sigmoid(x)` saves sigmoid's output "
    "too: + c i t per layer.",
    "RoPE (`ModelSpec.rotary_buffer`): a fp32 (2, context_length, d/2) buffer allocated with "
    "the model instead of per-step tables.",
    "Loss (`--loss`, the family's own `cs336-cross-entropy`): max(3c + cast + e, c + 3e) "
    "bytes per logit at the peak (16 fp32, 14 under bf16 autocast), saving exp's output "
    "(Note [The course's cross-entropy]); `logits-sum` / `logits-mean`: no log-softmax, one "
    "materialised (t, V) gradient.",
    "`--keep-logits`: the logits live until the step ends.",
    "`--optimizer-implementation cs336`: the course's AdamW holds five temporaries of each "
    "parameter (Note [Optimizer-step temporaries]).",
    "`--zero-grad-before-backward`: the previous step's gradients live through the forward "
    "and are freed before the backward.",
)


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
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("ids", nargs="*")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES:
        if args.ids and case.id not in args.ids:
            continue
        row = run_case(case, args.corpus)
        rows.append(row)
        print_case(row)
    text = render(rows)
    print()
    print(text)
    if args.write_results:
        write_section(text)
    ok = all(meets(r) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
