"""``fit`` and ``plan`` for a model only the generic path runs (diffusers, Whisper, wav2vec2,
vision-language and the other transformers families the formulas do not model).

Every candidate is a whole traced estimate (:func:`trainmem.estimate.estimate`: the model's own
forward and backward on fake tensors, the allocator replayed), about a second for a small model
and tens of seconds for a 12B transformer, so the searches here spend as few of them as they
can, where :mod:`trainmem.planner.fixes` and :mod:`trainmem.planner.search` screen hundreds of
closed-form candidates first:

- ``fit`` walks :data:`~trainmem.planner.fixes.CHANGES` cheapest first (Note [Cost ranks]) and
  stops at ``limit`` fixes. A change's most drastic proposal (the most GPUs, micro-batch 1) is
  traced first; when even that does not fit the change is dropped, else its proposals are
  bisected for the cheapest that fits (each row's proposals save more memory the further down
  its list they are). Pairs of changes are tried only when no change fits alone, each pair
  with both rows at their most drastic.
- ``plan`` finds the largest micro-batch size with
  :func:`~trainmem.planner.search.largest_true` on the traced verdict.

All sizes are bytes (``int``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations
from typing import cast

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.planner.fixes import CHANGES, Change, Fix
from trainmem.planner.search import MAX_MICRO_BATCH_SIZE, LimitedBy, PlanResult, largest_true
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig, derived

Probe = Callable[[TrainingConfig], MemoryEstimate]
"""A traced estimate of one configuration on the planned GPU (raises what
:func:`trainmem.estimate.estimate` raises: SpecError, UnsupportedError)."""

PAIRED_CHANGES = 4
"""When no change fits alone, pairs are formed from this many changes, those whose most drastic
proposal saved the most memory (6 pairs: each pair is one or two traced steps)."""


def traced_probe(
    model: str, gpu: GPUSpec, on_probe: Callable[[TrainingConfig], None] | None = None
) -> Probe:
    """:data:`Probe` of ``model`` on ``gpu`` through the generic path (``engine="auto"``, which
    is the generic path for a model the formulas do not know); ``on_probe`` is told of each
    configuration before it is traced (the CLI prints progress)."""

    def probe(training: TrainingConfig) -> MemoryEstimate:
        if on_probe is not None:
            on_probe(training)
        return estimate(model, training, gpu=gpu)

    return probe


def traced_only(model: str | ModelSpec) -> bool:
    """Whether ``model`` is a family the formulas do not model, so that ``fit``, ``plan``
    and ``sweep`` trace each candidate on the generic path."""
    from trainmem.estimate import resolve_model

    try:
        resolve_model(model)
    except UnsupportedError:
        return True
    return False


def traced_run(model: str | ModelSpec, training: TrainingConfig) -> bool:
    """Whether ``trainmem fit`` traces each candidate for this run: a family the formulas do
    not model (:func:`traced_only`), or a setting they refuse (prefix tuning, LoHa), which
    ``--engine auto`` sends to the generic path (Note [Which path runs] in
    ``trainmem/estimate.py``). The formulas' fix search would trace each of its hundreds of
    screened candidates there and stop at the first one the generic path refuses.

    Raises:
        SpecError: the run refused by the formulas' checks (as ``trainmem estimate``).
    """
    if traced_only(model):
        return True
    try:
        estimate(model, training, engine="analytic", simulate_allocator=False)
    except UnsupportedError:
        return True
    return False


def traced_fit(
    model: str,
    training: TrainingConfig,
    gpu: GPUSpec,
    *,
    limit: int = 3,
    on_probe: Callable[[TrainingConfig], None] | None = None,
) -> tuple[MemoryEstimate, list[Fix]]:
    """``trainmem fit`` on the generic path: the run traced, then, if it does not fit,
    :func:`traced_fixes` (``[]`` when it fits).

    Raises:
        SpecError / UnsupportedError: the run itself refused (as ``trainmem estimate``).
    """
    probe = traced_probe(model, gpu, on_probe)
    base = probe(training)
    if base.fits:
        return base, []
    return base, traced_fixes(base, training, gpu, probe, limit=limit)


def _try(probe: Probe, training: TrainingConfig) -> MemoryEstimate | None:
    """``probe(training)``, or None when the generic path refuses the configuration (a change
    this model cannot take, e.g. LoRA targets it does not have)."""
    try:
        return probe(training)
    except (SpecError, UnsupportedError):
        return None


def _fits(est: MemoryEstimate | None) -> bool:
    return est is not None and est.fits is True


def _proposals(
    rows: Sequence[Change], training: TrainingConfig, gpu: GPUSpec
) -> list[TrainingConfig]:
    """The rows' proposals applied in order, each later row on the earlier row's most drastic
    proposal (the propose functions read the training and the GPU, never the model)."""
    out = [training]
    for row in rows:
        try:
            nxt = row.propose(cast(ModelSpec, None), out[-1], gpu)
        except SpecError:  # a change this configuration refuses (LoRA beside prefix tuning)
            return []
        if not nxt:
            return []
        out = nxt if row is rows[-1] else [nxt[-1]]
    return out


def _cheapest_fitting(
    proposals: list[TrainingConfig], probe: Probe, drastic: MemoryEstimate
) -> tuple[TrainingConfig, MemoryEstimate]:
    """The first proposal that fits, by bisection, given that the last one fits (``drastic``)."""
    lo, hi = 0, len(proposals) - 1  # proposals[hi] fits
    best = (proposals[hi], drastic)
    while lo < hi:
        mid = (lo + hi) // 2
        est = _try(probe, proposals[mid])
        if _fits(est):
            assert est is not None
            best, hi = (proposals[mid], est), mid
        else:
            lo = mid + 1
    return best


def traced_fixes(
    base: MemoryEstimate,
    training: TrainingConfig,
    gpu: GPUSpec,
    probe: Probe,
    *,
    limit: int = 3,
    changes: tuple[Change, ...] = CHANGES,
) -> list[Fix]:
    """Changes after which a traced run that does not fit ``gpu`` fits, cheapest first.

    Args:
        base: the run's own traced estimate (it does not fit).
        training: the run as planned.
        gpu: the GPU planned for.
        probe: traced estimates (:func:`traced_probe`).
        limit: stop after this many fixes (each costs one or more traced steps).
        changes: the table of candidate changes (default :data:`CHANGES`).

    Returns:
        Fixes sorted by cost rank then memory saved; [] when nothing in the table, nor a pair of
        its rows, makes the run fit.

    Raises:
        SpecError: ``limit`` below 1.
    """
    if limit < 1:  # as :func:`trainmem.planner.fixes.fixes`
        raise SpecError("limit", f"must be a positive number of fixes, got {limit}")
    if base.breakdown.cuda_context >= gpu.memory_bytes:
        return []  # no change in the table shrinks the CUDA context (:func:`beyond_any_fix`)
    base_bytes = base.breakdown.allocated_bytes
    found: list[Fix] = []
    saved: dict[str, int] = {}
    for row in sorted(changes, key=lambda c: c.cost_rank):
        if len(found) >= limit:
            break
        proposals = _proposals((row,), training, gpu)
        if not proposals:
            continue
        drastic = _try(probe, proposals[-1])
        if drastic is None:
            continue
        saved[row.name] = base_bytes - drastic.breakdown.allocated_bytes
        if not _fits(drastic):
            continue
        proposed, est = _cheapest_fitting(proposals, probe, drastic)
        fix_saved = base_bytes - est.breakdown.allocated_bytes
        found.append(Fix((row,), proposed, est, fix_saved, row.cost_rank, training))
    if not found:
        helpful = sorted(
            (c for c in changes if saved.get(c.name, 0) > 0), key=lambda c: -saved[c.name]
        )[:PAIRED_CHANGES]
        pairs = sorted(
            ((a, b) for a, b in combinations(helpful, 2) if a.group != b.group),
            key=lambda rows: sum(c.cost_rank for c in rows),
        )
        for rows in pairs:
            if len(found) >= limit:
                break
            proposals = _proposals(rows, training, gpu)
            paired = _try(probe, proposals[-1]) if proposals else None
            if paired is not None and _fits(paired):
                rank = sum(c.cost_rank for c in rows)
                fix_saved = base_bytes - paired.breakdown.allocated_bytes
                found.append(Fix(rows, proposals[-1], paired, fix_saved, rank, training))
    found.sort(key=lambda f: (f.cost_rank, -f.saved_bytes))
    return found


def beyond_any_fix(base: MemoryEstimate, gpu: GPUSpec) -> str | None:
    """Why no change can make the run fit ``gpu`` without tracing one, or None: the CUDA
    context and the NCCL communicators (``breakdown.cuda_context``, outside the allocator) are
    alone at least the card's usable memory."""
    context = base.breakdown.cuda_context
    if context < gpu.memory_bytes:
        return None
    return (
        f"the CUDA context alone ({context / 2**30:.2f} GiB) fills the "
        f"{gpu.memory_bytes / 2**30:.2f} GiB usable on {gpu.name}"
    )


def traced_max_micro_batch_size(
    training: TrainingConfig, gpu: GPUSpec, probe: Probe, *, hi: int = MAX_MICRO_BATCH_SIZE
) -> PlanResult:
    """The largest micro-batch size whose traced step fits ``gpu``: exponential growth from 1,
    then bisection (:func:`~trainmem.planner.search.largest_true`), one traced step a probe.

    Raises:
        SpecError, UnsupportedError: the generic path refuses the configuration.
    """
    seen: dict[int, MemoryEstimate] = {}

    def at(n: int) -> MemoryEstimate:
        if n not in seen:
            seen[n] = probe(derived(training, micro_batch_size=n))
        return seen[n]

    value = largest_true(lambda n: _fits(at(n)), 1, hi)
    dimension = "micro_batch_size"
    if value is None:
        first = at(1)
        return PlanResult(
            dimension,
            None,
            None,
            None,
            first,
            gpu,
            "nothing_fits",
            f"even micro_batch_size=1 needs {first.breakdown.device_total_bytes / 2**30:.2f} GiB"
            f" on {gpu.name}; `trainmem fit` lists the changes that make it fit",
        )
    chosen = derived(training, micro_batch_size=value)
    limited: LimitedBy = "search_limit" if value >= hi else "memory"
    nxt = seen.get(value + 1) if limited == "memory" else None
    if limited == "memory" and nxt is None:
        nxt = at(value + 1)
    reason = (
        f"micro_batch_size={value + 1} does not fit (traced)"
        if limited == "memory"
        else f"the search stops at micro_batch_size={hi}"
    )
    return PlanResult(dimension, value, chosen, seen[value], nxt, gpu, limited, reason)
