"""Benchmark: the analytic engine's step schedule against the real step recorded in GPU memory
snapshots (issue 13).

For the snapshots of ../shared/validation/snapshots whose model and configuration are known
(the CS336 course transformer: the cases of ``snapshot_traced_step.py`` and S025, S026), the
course model is given to the analytic engine as a llama-shaped ``config.json``
(``benchmarks/cs336_configs``: no biases, untied embeddings, SiLU-gated MLP, RMSNorm, RoPE, the
course's widths and 10,000-token vocabulary) with eager attention, no dropout, and the for-loop
AdamW for the course's AdamW (torch's foreach default for torch.optim.AdamW). Its schedule, replayed
through the allocator simulator (``estimate(..., engine="analytic")`` -> ``finish``), is compared
with the real trace: peak allocated (the real one is the 512-byte-rounded requested peak, a lower
bound of ``max_memory_allocated``; the predicted one is the schedule's peak of live requested
bytes, what ``estimate`` reports, not the replay's block sizes, which add the unsplit
remainders of cached blocks), peak reserved and the peak of each phase (the real phases read
off the recorded stacks, ``stream_compare.phase_of``).

The course code is not transformers' Llama. Where it keeps other tensors, the difference is not
put into the analytic engine; it is computed per term from the course code
(:func:`course_terms`), added to the analytic schedule at the point of the step where the course
allocates it (:func:`explained_schedule`) and replayed, so "analytic + explained" shows whether
the terms account for the whole gap. Course code: cs336-basics ``cs336_basics/model.py``
(``RMSNorm``, ``RotaryEmbedding``, ``scaled_dot_product_attention``, ``silu``),
``nn_utils.py`` (``softmax``, ``log_softmax``, ``cross_entropy``) and ``optimizer.py``
(``AdamW``), as copied in the students' repositories (e.g. Wedsonlin/assignment2-systems
``cs336-basics/cs336_basics/model.py``; stanford-cs336/spring2024-assignment2-systems
``cs336-basics/cs336_basics/nn_utils.py``); the scripts per snapshot in index.csv. Run::

    PYTHONPATH=src python benchmarks/snapshot_analytic_step.py [--write-results] [IDS...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from snapshot_replay import DEFAULT_CORPUS, commit  # noqa: E402
from snapshot_traced_step import CASES as TRACED_CASES  # noqa: E402
from snapshot_traced_step import Case  # noqa: E402

from trainmem.allocator.caching import round_size_default  # noqa: E402
from trainmem.allocator.replay import replay_timeline  # noqa: E402
from trainmem.allocator.snapshot import read_snapshot, snapshot_stats  # noqa: E402
from trainmem.allocator.snapshot_replay import busiest_device  # noqa: E402
from trainmem.allocator.stream_compare import phase_summary  # noqa: E402
from trainmem.analytic.activations import (  # noqa: E402
    activation_profile,
    backward_layer_transients,
    compute_and_residual_bytes,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
)
from trainmem.breakdown import MemoryCategory as Cat  # noqa: E402
from trainmem.estimate import estimate, resolve_model  # noqa: E402
from trainmem.schedule import Action, Item, Op, Repeat, StepSchedule  # noqa: E402
from trainmem.specs.model import ModelSpec  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.timeline import Phase  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
CONFIGS = Path(__file__).resolve().parent / "cs336_configs"
BEGIN = (
    "<!-- snapshot-analytic-step:begin (benchmarks/snapshot_analytic_step.py --write-results) -->"
)
END = "<!-- snapshot-analytic-step:end -->"
GiB = 2**30
ALLOCATED_TOLERANCE = 0.02  # issue 13's bar
RESERVED_TOLERANCE = 0.03

ZERO_GRAD_AFTER_FORWARD = frozenset({"S009", "S013", "S014"})
"""Scripts that call ``optimizer.zero_grad()`` between the forward and the backward (index.csv
"recorded": fwd, loss, zero_grad, bwd, step)."""

CASES = [
    *TRACED_CASES,
    # full-confidence course runs the traced benchmark does not cover (scripts read at the
    # commits index.csv names; frames checked: the course's nn_utils loss in S025, torch's
    # F.cross_entropy and foreach AdamW (_multi_tensor_adam) in S026)
    Case("S025", 10000, 2560, 32, 32, 6848, 4, 128, "none", False, "32-true",
         "fp32 fwd + course CE + bwd, no optimizer, d_ff = 8/3 d_model (6848)"),
    Case("S026", 10000, 2560, 32, 32, 10240, 4, 512, "torch-adamw", False, "bf16-mixed",
         "bf16 autocast full step, F.cross_entropy, torch AdamW (foreach)", "torch-ce"),
]  # fmt: skip
"""The traced benchmark's cases and two more; ``Case.optimizer`` ``torch-adamw`` is
torch.optim.AdamW (its foreach default), ``Case.loss`` ``torch-ce`` is F.cross_entropy."""

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


def training_of(case: Case) -> TrainingConfig:
    """The case's step as the analytic engine's settings: the course's hand-written attention is
    eager (materialised scores), no dropout layers, the course AdamW loops over the parameters
    (``for-loop``); S001 has no optimizer (``sgd``: no states, no temporaries)."""
    return TrainingConfig(
        micro_batch_size=case.batch,
        seq_len=case.seq_len,
        precision=case.precision,
        optimizer="sgd" if case.optimizer == "none" else "adamw",
        optimizer_implementation="for-loop" if case.optimizer == "course-adamw" else None,
        attention="eager",
        dropout=False,
        zero_grad_set_to_none=not case.grads_kept,
    )


@dataclass(frozen=True)
class Term:
    """One way the course code differs from what the analytic engine counts.

    Attributes:
        name: short name (also the schedule key prefix).
        bytes: bytes of one occurrence (negative: the analytic engine counts more).
        count: occurrences alive at once at the worst point (layers for per-layer terms).
        phase: where it lives ("forward -> backward" for saved tensors).
        cause: the course code that makes it, and the analytic term it is compared with.
    """

    name: str
    bytes: int
    count: int
    phase: str
    cause: str
    block: int = 0
    """Size of the single tensors the term is made of (0: one block)."""

    @property
    def total(self) -> int:
        return self.bytes * self.count


def course_terms(case: Case, model: ModelSpec, training: TrainingConfig) -> list[Term]:
    """The per-term differences between the course code and the analytic engine's terms, bytes
    computed from the course code (module docstring) and the engine's own term sizes.

    Legend: b batch, s sequence (= the script's ``context_length``), t = b*s, h, a heads, d head
    width, i MLP width, V vocabulary, L layers, c compute bytes (4 fp32, 2 under bf16 autocast),
    n = a*s*s*b attention scores.
    """
    b, s = case.batch, case.seq_len
    t, h, a, i, v, L = b * s, case.d_model, case.heads, case.d_ff, case.vocab, case.layers
    d = h // a
    n = a * s * s * b
    c, _ = compute_and_residual_bytes(training)
    prof = activation_profile(model, training)
    analytic_scores = sum(x for k, x in prof.terms.items() if k.startswith("scores/"))
    _, analytic_attention_tmp, _ = backward_layer_transients(model, training)
    terms = [
        Term(
            "softmax_saved",
            (4 + c) * n - analytic_scores,
            L,
            "forward -> backward",
            "nn_utils.softmax is written out: exp's output (fp32; exp is on autocast's fp32 "
            "list) is saved by exp and by the division, and the quotient (c bytes, its 16-bit "
            "cast under autocast) by the value einsum: (4 + c) n per layer, against the "
            "analytic eager terms scores/* (torch.softmax's one output)",
        ),
        Term(
            "silu_saved",
            c * i * t,
            L,
            "forward -> backward",
            "model.silu is x * sigmoid(x): the product also saves sigmoid's output (c i t); "
            "F.silu saves only its input",
        ),
        Term(
            "softmax_stats",
            8 * a * s * b + 4 * a * s * b + s * s,
            L,
            "forward -> backward",
            "torch.max(dim) saves its int64 indices, the division its fp32 row sums, "
            "torch.where its (s, s) bool causal mask, one per layer",
        ),
        Term(
            "softmax_backward",
            5 * 4 * n - analytic_attention_tmp,
            1,
            "backward (one layer)",
            "the division's backward (derivatives.yaml div.Tensor: grad / other and "
            "-grad * ((self / other) / other)) holds five fp32 score-sized tensors with the "
            "incoming gradient, against torch's _softmax_backward_data (two)",
            block=4 * n,
        ),
        Term(
            "rope_tables",
            4 * s * d - prof.head_terms.get("rotary_cos_sin", 0),
            1,
            "whole run",
            "RotaryEmbedding keeps cos/sin as a buffer (2 x context x d/2 fp32, allocated with "
            "the model) instead of per-step (t, d) tables",
        ),
        Term(
            "logits_kept",
            c * v * t,
            1,
            "forward -> end of step",
            "the script keeps the model output (`output = model(x)`) until the step ends; the "
            "analytic engine frees the logits after the loss (HF Trainer's compute_loss)",
        ),
    ]
    log_softmax = prof.head_terms.get("log_softmax", 0)
    loss_fwd = loss_forward_transient_bytes(model, training)
    loss_bwd = loss_backward_transient_bytes(model, training)
    if case.loss == "torch-ce":
        pass  # F.cross_entropy: the analytic engine's own loss terms (fp32 copy, log-softmax)
    elif case.loss == "ce":
        # nn_utils.log_softmax: x - x_max, exp(x - x_max) (saved), the difference, then the
        # negation in cross_entropy: the logits and three (t, V) tensors at once (fp32);
        # under autocast the logits, x - x_max and the second x - x_max are 16-bit and exp's
        # fp32 input cast, exp's output, the difference and its negation are fp32
        course_peak = 16 * v * t if c == 4 else (2 + 2 + 2 + 4 + 4) * v * t
        terms.append(
            Term(
                "loss_forward",
                course_peak - (loss_fwd + log_softmax),
                1,
                "forward (the loss)",
                "nn_utils.cross_entropy written out holds (t, V) tensors beside the logits "
                f"({course_peak // (v * t)} bytes per logit at once), against the analytic "
                "logits + fp32 copy + log-softmax",
                block=4 * v * t,
            )
        )
    else:
        terms += [
            Term(
                "loss_forward",
                -(loss_fwd + log_softmax),
                1,
                "forward -> backward",
                f"loss = logits.{case.loss}(): no log-softmax and no fp32 logits copy",
            ),
            Term(
                "loss_backward",
                c * v * t - loss_bwd,
                1,
                "backward (the loss)",
                f"the {case.loss}'s gradient is one (t, V) tensor materialised for the LM "
                "head's matmul, against cross-entropy's two fp32 log-softmax gradients",
            ),
        ]
    if case.optimizer == "course-adamw":
        largest = max(v * h, h * i) * 4
        terms.append(
            Term(
                "adamw_step",
                3 * largest,
                1,
                "optimizer (one parameter)",
                "optimizer.AdamW builds new m and v each step and a * m / (sqrt(v) + eps) out "
                "of place: five temporaries of the parameter at once, against torch's "
                "for-loop AdamW's two (sqrt and denom)",
            )
        )
    return terms


# -- the analytic schedule with the course terms added where the course allocates them --------


def _op(action: Action, size: int, phase: Phase, key: str, label: str = "") -> Op:
    return Op(action, max(int(size), 0), Cat.TEMPORARY, phase, key, "course", label)


def _resize(op: Op, size: int) -> Op:
    return Op(op.action, max(int(size), 0), op.category, op.phase, op.key, op.module, op.label)


@dataclass(frozen=True)
class Edits:
    """Sizes the schedule edits need besides the net terms: the analytic per-step rotary
    tables and the course's rotary buffer (``rope_tables`` = their difference), the analytic
    log-softmax a ``sum``/``mean`` loss does not save, and that loss's one (t, V) gradient."""

    rope_analytic: int
    rope_buffer: int
    log_softmax: int
    loss_gradient: int
    previous_gradients: tuple[int, ...] = ()
    """Gradient tensors of the previous step alive until ``zero_grad()`` after the forward
    (:data:`ZERO_GRAD_AFTER_FORWARD`); empty otherwise."""


def edits_of(case: Case, model: ModelSpec, training: TrainingConfig) -> Edits:
    """:class:`Edits` of a case (same sources as :func:`course_terms`)."""
    prof = activation_profile(model, training)
    c, _ = compute_and_residual_bytes(training)
    return Edits(
        rope_analytic=prof.head_terms.get("rotary_cos_sin", 0),
        rope_buffer=4 * case.seq_len * (case.d_model // case.heads),
        log_softmax=prof.head_terms.get("log_softmax", 0),
        loss_gradient=c * case.vocab * case.batch * case.seq_len,
    )


def explained_schedule(sched: StepSchedule, terms: list[Term], edits: Edits) -> StepSchedule:
    """``sched`` (the analytic engine's) with each course term of :func:`course_terms`
    allocated and freed where the course code does; terms the analytic engine over-counts
    shrink the op that counts them (a free repeats its allocation's size, so both are resized).

    * per-layer saved terms: allocated after the layer's saved activations in the forward,
      freed with the MLP's (``silu_saved``) or the attention's saved tensors in its backward;
    * ``softmax_backward``: beside the analytic eager-attention backward transient;
    * ``loss_forward`` (cross-entropy): beside the head activations, freed before the logits;
      for a ``sum``/``mean`` loss the analytic logits copy and log-softmax go, and
      ``loss_backward`` replaces the two log-softmax gradients by one (t, V) tensor;
    * ``logits_kept``: from the analytic logits' free to the end of the step;
    * ``rope_tables``: the course's buffer allocated with the model, the analytic per-step
      cos/sin tables removed from the embedding activations;
    * ``adamw_step``: 3/2 of each for-loop temporary (five parameter-sized tensors for two).
    """
    by = {x.name: x.bytes for x in terms}
    per_layer = [k for k in ("softmax_saved", "silu_saved", "softmax_stats") if k in by]
    sum_loss = "loss_backward" in by
    f: Phase = "forward"
    b: Phase = "backward"

    blocks = {x.name: x.block for x in terms}

    def ops(name: str, action: Action, phase: Phase, key: str) -> list[Op]:
        """The term as the tensors it is made of (``Term.block``), or one op."""
        size, block = by[name], blocks[name]
        if block <= 0 or size <= 0 or size % block:
            return [_op(action, size, phase, key, name)]
        return [_op(action, block, phase, f"{key}/{k}", name) for k in range(size // block)]

    def walk(items: tuple[Item, ...]) -> tuple[Item, ...]:
        last_saved = max(
            (
                n
                for n, x in enumerate(items)
                if isinstance(x, Op)
                and x.action == "alloc"
                and x.phase == "forward"
                and x.key.startswith("act/{i}/")
            ),
            default=-1,
        )
        out: list[Item] = []
        for n, x in enumerate(items):
            if isinstance(x, Repeat):
                out.append(Repeat(walk(x.body), x.count, x.reverse, x.start, x.independent))
                continue
            if x.key == "act/embedding":
                x = _resize(x, x.size_bytes - edits.rope_analytic)
            if sum_loss and x.key == "logits":
                x = _resize(x, 0)
            if sum_loss and x.key == "act/head":
                x = _resize(x, x.size_bytes - edits.log_softmax)
            if sum_loss and x.key in ("loss/1", "loss/2"):
                x = _resize(x, edits.loss_gradient if x.key == "loss/1" else 0)
            if x.key == "bucket/backward" and x.action == "alloc":
                out += [  # optimizer.zero_grad() between the forward and the backward
                    _op("free", size, "zero_grad", f"course/previous_grad/{k}")
                    for k, size in enumerate(edits.previous_gradients)
                ]
            out.append(x)
            if n == last_saved:
                out += [_op("alloc", by[k], f, f"course/{k}/{{i}}", k) for k in per_layer]
            if (
                x.key == "act/head"
                and x.action == "alloc"
                and "loss_forward" in by
                and not sum_loss
            ):
                out += ops("loss_forward", "alloc", f, "course/loss")
                out += ops("loss_forward", "free", f, "course/loss")
            if x.key == "logits" and x.action == "free":
                out.append(_op("alloc", by["logits_kept"], f, "course/logits", "logits_kept"))
            if x.key == "mlp_tmp" and x.action == "free":
                out.append(_op("free", by["silu_saved"], b, "course/silu_saved/{i}"))
            if x.key == "attention_tmp" and x.action == "alloc":
                out += ops("softmax_backward", "alloc", b, "course/sbwd")
            if x.key == "attention_tmp" and x.action == "free":
                out += ops("softmax_backward", "free", b, "course/sbwd")
                out += [
                    _op("free", by[k], b, f"course/{k}/{{i}}")
                    for k in per_layer
                    if k != "silu_saved"
                ]
            if x.key == "opt/tmp" and "adamw_step" in by:
                # three more tensors the size of the parameter (the op holds two)
                out += [
                    _op(x.action, x.size_bytes // 2, "optimizer", f"course/adamw/{k}")
                    for k in range(3)
                ]
        return tuple(out)

    end = _op("free", by["logits_kept"], "optimizer", "course/logits")
    rope = _op("alloc", edits.rope_buffer, "init", "course/rope", "rope_tables")
    previous = tuple(
        _op("alloc", size, "forward", f"course/previous_grad/{k}", "zero_grad_after_forward")
        for k, size in enumerate(edits.previous_gradients)
    )
    setup = walk(sched.setup)
    return StepSchedule(
        setup=(rope, setup[0], *previous, *setup[1:], end),
        step=(*previous, *walk(sched.step), end),
        name=sched.name + " + course terms",
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


def predict(case: Case, path: Path | None = None) -> dict[str, Any]:
    """Analytic and analytic + explained numbers of one case (``path``: its config.json,
    default :func:`config_path`)."""
    path = config_path(case) if path is None else path
    model = resolve_model(str(path))
    training = training_of(case)
    est = estimate(str(path), training, engine="analytic")
    replay = est.details["allocator_replay"]
    sched = est.schedules[0]
    terms = course_terms(case, model, training)
    edits = edits_of(case, model, training)
    base = sched
    if case.id in ZERO_GRAD_AFTER_FORWARD:
        # the analytic schedule whose gradients are built in the backward and freed after the
        # step, plus the previous step's gradients alive until zero_grad() after the forward
        base = estimate(
            str(path), replace(training, zero_grad_set_to_none=True), engine="analytic"
        ).schedules[0]
        grads = gradient_sizes(base)
        edits = replace(edits, previous_gradients=tuple(grads))
        terms.append(
            Term(
                "zero_grad_after_forward",
                -sum(grads),
                1,
                "backward (until rebuilt)",
                "the script calls optimizer.zero_grad() between the forward and the backward: "
                "the previous step's gradients are alive through the forward and rebuilt "
                "layer by layer in the backward (the analytic run, told "
                "zero_grad_set_to_none=False, keeps them through the backward)",
            )
        )
    explained = explained_schedule(base, terms, edits)
    ex_replay = replay_timeline(explained.events(), capacity_bytes=None)
    return {
        "case": case,
        "analytic": {
            "allocated": est.breakdown.allocated_bytes,
            "reserved": replay["max_memory_reserved"],
            "phases": sched.phase_peaks(),
            "peak": est.peak_reason,
        },
        "explained": {
            "allocated": explained.peak().peak_bytes,
            "reserved": ex_replay.max_memory_reserved,
            "phases": explained.phase_peaks(),
        },
        "terms": terms,
    }


def run_case(case: Case, corpus: Path) -> dict[str, Any]:
    """Real, analytic and analytic + explained numbers of one case."""
    return {**predict(case), "real": real_numbers(case.id, corpus)}


def gradient_sizes(sched: StepSchedule) -> list[int]:
    """Sizes of the gradient tensors the steady-state step allocates, layers expanded."""
    return [
        e.size_bytes
        for e in sched.expand().events[sched.expand().steady_state_start :]
        if e.action == "alloc" and e.category == Cat.GRADIENT
    ]


def pct(a: int, b: int) -> str:
    return f"{100 * (a - b) / b:+.2f} %"


def gib(x: int) -> str:
    return f"{x / GiB:.3f}"


def print_case(r: dict[str, Any]) -> None:
    c: Case = r["case"]
    real, an, ex = r["real"], r["analytic"], r["explained"]
    print(f"{c.id}: {c.what} (d={c.d_model} L={c.layers} B={c.batch} T={c.seq_len})")
    for what in ("allocated", "reserved"):
        print(
            f"  {what:9s} real {gib(real[what])} GiB | analytic {gib(an[what])} "
            f"({pct(an[what], real[what])}) | analytic + explained {gib(ex[what])} "
            f"({pct(ex[what], real[what])})"
        )
    for phase, value in real["phases"].items():
        a = an["phases"].get(phase)
        e = ex["phases"].get(phase)
        if a is None or e is None:
            continue
        print(
            f"  {phase:9s} real {gib(value)} | analytic {gib(a)} ({pct(a, value)}) | "
            f"+ explained {gib(e)} ({pct(e, value)})"
        )
    for t in r["terms"]:
        print(f"    {t.name:17s} {t.total / GiB:+8.3f} GiB ({t.count} x {t.bytes:,} B, {t.phase})")


def within(a: int, b: int, tol: float) -> bool:
    return abs(a - b) <= tol * b


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Analytic step against the real step (course transformer snapshots)",
        "",
        f"Generated by `benchmarks/snapshot_analytic_step.py` on {datetime.now(UTC):%Y-%m-%d} "
        f"at commit {commit()}. The course model as a llama-shaped config "
        "(`benchmarks/cs336_configs`, no biases, untied embeddings) with eager attention, no "
        "dropout and the for-loop AdamW for the course's AdamW (torch's foreach default for "
        'S026\'s torch.optim.AdamW); `estimate(..., engine="analytic")` and its replay '
        "through the allocator simulator. Real: the snapshot's rounded requested peak (a lower "
        "bound of `max_memory_allocated`) and its exact peak reserved. *+ explained*: the "
        "analytic schedule with the course code's own terms (below) added where the course "
        "allocates them, replayed the same way. Bar (issue 13): allocated within 2 %, reserved "
        "within 3 %.",
        "",
        "| id | configuration | real alloc GiB | analytic | error | + explained | error "
        "| real reserved GiB | analytic | error | + explained | error | analytic peak in |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c: Case = r["case"]
        real, an, ex = r["real"], r["analytic"], r["explained"]
        lines.append(
            f"| {c.id} | d={c.d_model} L={c.layers} B={c.batch} T={c.seq_len}; {c.what} "
            f"| {gib(real['allocated'])} | {gib(an['allocated'])} "
            f"| {pct(an['allocated'], real['allocated'])} | {gib(ex['allocated'])} "
            f"| {pct(ex['allocated'], real['allocated'])} | {gib(real['reserved'])} "
            f"| {gib(an['reserved'])} | {pct(an['reserved'], real['reserved'])} "
            f"| {gib(ex['reserved'])} | {pct(ex['reserved'], real['reserved'])} "
            f"| {an['peak'].split(':')[0].split(',')[0]} |"
        )
    met_a = sum(within(r["analytic"]["allocated"], r["real"]["allocated"], 0.02) for r in rows)
    met_r = sum(within(r["analytic"]["reserved"], r["real"]["reserved"], 0.03) for r in rows)
    lines += [
        "",
        f"Bar met by the analytic engine alone: allocated on {met_a}/{len(rows)}, reserved on "
        f"{met_r}/{len(rows)} snapshots. The gaps are the course's own code, not general "
        "modelling gaps: per term (GiB at the worst point, from the course code; a negative "
        "term is one the analytic engine counts and the course does not have):",
        "",
        "| id | phase | real GiB | analytic | + explained | " + " | ".join(TERM_NAMES) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(TERM_NAMES),
    ]
    for r in rows:
        c = r["case"]
        totals = {t.name: t.total for t in r["terms"]}
        for n, (phase, value) in enumerate(r["real"]["phases"].items()):
            a = r["analytic"]["phases"].get(phase)
            e = r["explained"]["phases"].get(phase)
            if a is None or e is None:
                continue
            cells = (
                [f"{totals[k] / GiB:+.3f}" if k in totals else "" for k in TERM_NAMES]
                if n == 0
                else [""] * len(TERM_NAMES)
            )
            lines.append(
                f"| {c.id} | {phase} | {gib(value)} | {gib(a)} ({pct(a, value)}) "
                f"| {gib(e)} ({pct(e, value)}) | " + " | ".join(cells) + " |"
            )
    lines += ["", "Terms (bytes from the course code; `Term.cause` in the script):", ""]
    lines += [f"- `{k}`: {v}" for k, v in TERM_TEXT.items()]
    lines += [
        "",
        "- Found here and fixed in the analytic engine (a general gap, not the course's): "
        "eager attention's backward releases the o_proj input, the value matmul's saved "
        "probabilities and v and the dropout mask before the softmax backward's transients "
        "(autograd frees a node's saved tensors once it has run; Note [Eager attention's "
        "backward order] in analytic/schedule.py). It took S003's explained backward from "
        "+0.82 % to the figure above and tiny-llama-test eager bf16-mixed from +10.6 % over "
        "the trace engine to +0.1 % (tests/analytic/test_eager_backward_order.py).",
        "- What is left is the analytic engine's placement inside a layer, not a missing "
        "tensor: it allocates a layer's gradients at once at the start of its backward "
        "(S002 backward +0.7 %).",
        "- The explained terms are added as blocks of their natural tensor sizes, but not in "
        "the course's exact order, so the reserved column of *+ explained* is indicative; the "
        "real runs are also warm (several steps) where the replay starts from an empty cache.",
    ]
    return "\n".join(lines) + "\n"


TERM_NAMES = (
    "softmax_saved",
    "silu_saved",
    "softmax_stats",
    "softmax_backward",
    "rope_tables",
    "logits_kept",
    "loss_forward",
    "loss_backward",
    "adamw_step",
    "zero_grad_after_forward",
)

TERM_TEXT = {
    "softmax_saved": "per layer, `nn_utils.softmax` written out saves exp's fp32 output and "
    "the quotient: (4 + c) a s^2 b against the analytic eager terms (one fp32 softmax output; "
    "+ its 16-bit copy under autocast, so 0 there)",
    "silu_saved": "per layer, `silu(x) = x * sigmoid(x)` saves sigmoid's output too: c i t",
    "softmax_stats": "per layer, max's int64 indices, the fp32 row sums and the (s, s) bool "
    "causal mask",
    "softmax_backward": "one layer at a time, the division's backward holds five fp32 "
    "a s^2 b tensors against `_softmax_backward_data`'s two",
    "rope_tables": "cos/sin as a (2, context, d/2) fp32 buffer of the model instead of "
    "per-step (t, d) tables",
    "logits_kept": "the script keeps `output = model(x)` to the end of the step: c V t",
    "loss_forward": "cross-entropy: `nn_utils.log_softmax` / `cross_entropy` written out "
    "hold 16 (fp32) or 14 (autocast) bytes per logit at once against the analytic 8 / 10; "
    "`logits.sum()` / `.mean()`: no log-softmax and no fp32 copy (negative)",
    "loss_backward": "`sum` / `mean`: one materialised (t, V) gradient instead of "
    "cross-entropy's two fp32 ones",
    "zero_grad_after_forward": "S009, S013, S014 call `optimizer.zero_grad()` between the "
    "forward and the backward: the previous step's gradients are alive through the forward "
    "and rebuilt layer by layer in the backward; no `TrainingConfig` says that, so the "
    "analytic run keeps them (`zero_grad_set_to_none=False`) and the explained one is the "
    "analytic schedule with `zero_grad_set_to_none=True` plus those gradients until the "
    "backward starts",
    "adamw_step": "the course AdamW builds new m and v and `a * m / (sqrt(v) + eps)` out of "
    "place: five temporaries of the largest parameter against torch's for-loop two",
}


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
    ok = all(
        within(r["analytic"]["allocated"], r["real"]["allocated"], ALLOCATED_TOLERANCE)
        and within(r["analytic"]["reserved"], r["real"]["reserved"], RESERVED_TOLERANCE)
        for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
