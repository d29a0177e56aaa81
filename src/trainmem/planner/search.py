"""The largest micro-batch size and the longest sequence length that fit one GPU.

Both searches run on a predicate that is monotone in the searched value (the analytic peak is
non-decreasing in ``micro_batch_size`` and in ``seq_len``; ``tests/planner`` checks this over a
grid): exponential growth from the smallest value until the first value that does not fit, then
bisection between the last fit and the first non-fit. That is ``O(log n)`` fast estimates.
The answer is then re-checked with the allocator simulator (See Note [Fast bound, simulated
answer] in ``evaluate.py``) and moved down by a second bisection if fragmentation pushes it over.

All sizes are bytes (``int``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import assumed_of
from trainmem.planner.evaluate import (
    fast_estimate,
    fits,
    margin_bytes,
    resolve,
    simulated_estimate,
)
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig, derived
from trainmem.units import format_bytes

MAX_MICRO_BATCH_SIZE = 1 << 20
"""Upper end of the micro-batch search: a tiny model on a large GPU stops here instead of
searching forever (reported as ``limited_by="search_limit"``)."""

SEQ_LEN_MULTIPLE_OF = 8
"""Default granularity of a planned ``seq_len``, tokens: the batches people train on are padded
to a multiple of 8 so that 16-bit matmuls run on Tensor Cores (transformers 5.24
data/data_collator.py ``pad_to_multiple_of``: "especially useful to enable the use of Tensor
Cores on NVIDIA hardware with compute capability >= 7.0 (Volta)"; NVIDIA's Matrix
Multiplication Background guide, "Tensor Core Requirements": dimensions multiples of 8 for
FP16 / BF16). ``multiple_of=1`` gives the exact longest length; it costs about twice the
allocator replays, since near the limit fragmentation makes fitting non-monotone (Note
[Aimed probes at the boundary])."""

LimitedBy = Literal["memory", "context_length", "search_limit", "nothing_fits"]


@dataclass(frozen=True, slots=True)
class PlanResult:
    """The answer of one search.

    Attributes:
        dimension: the searched field, ``"micro_batch_size"`` or ``"seq_len"``.
        value: the largest value that fits, or None when even the smallest does not.
        training: the configuration at ``value`` (None when nothing fits).
        estimate: the simulated estimate at ``value`` (None when nothing fits).
        next_estimate: the fast estimate at the first value that does not fit (``value + step``,
            or the smallest value when nothing fits); None when the search hit a limit instead.
        gpu: the GPU planned for.
        limited_by: ``memory`` (the next value does not fit), ``context_length`` (seq_len
            reached the model's ``max_position_embeddings``), ``search_limit``, or
            ``nothing_fits``.
        reason: one sentence for a person: why the answer is what it is.
        step: the granularity of the search: only multiples of ``step`` were tried (1 for the
            micro-batch size; for ``seq_len`` the ``multiple_of``, 8 tokens by default, times
            the context-parallel size when that does not divide it).
    """

    dimension: str
    value: int | None
    training: TrainingConfig | None
    estimate: MemoryEstimate | None
    next_estimate: MemoryEstimate | None
    gpu: GPUSpec
    limited_by: LimitedBy
    reason: str
    step: int = 1

    @property
    def margin_bytes(self) -> int | None:
        """Usable capacity minus the simulated device total at ``value``, bytes; None when
        nothing fits."""
        return None if self.estimate is None else margin_bytes(self.estimate)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; sizes in bytes."""
        est = self.estimate
        nxt = self.next_estimate
        said = est or nxt  # what was assumed: at the answer, else at the first value tried
        return {
            "dimension": self.dimension,
            "value": self.value,
            "limited_by": self.limited_by,
            "reason": self.reason,
            "step": self.step,
            "verdict": "does not fit" if est is None else est.verdict,
            "margin_bytes": self.margin_bytes,
            "gpu": {"name": self.gpu.name, "capacity_bytes": self.gpu.memory_bytes},
            "peak": None if est is None else est.peak_dict(),
            "next": None
            if nxt is None
            else {**nxt.peak_dict(), self.dimension: nxt.config.get(self.dimension)},
            "config": None if est is None else dict(est.config),
            # framework, loop and versions, as estimate's details.assumed
            "assumed": None if said is None else assumed_of(said),
        }


def largest_true(
    pred: Callable[[int], bool],
    lo: int,
    hi: int,
    aim: Callable[[int, int], int] | None = None,
) -> int | None:
    """Largest ``n`` in ``[lo, hi]`` with ``pred(n)``, for ``pred`` true up to some point and
    false after it; None when ``pred(lo)`` is false.

    Exponential search from ``lo`` (``lo, 2lo, 4lo, ...``), then, between the last true and
    the first false, bisection: ``O(log(answer))`` calls; or, with ``aim``, the probes it
    names (Note [Interpolated probes]).

    Args:
        pred: the predicate, monotone as above.
        lo: the smallest value.
        hi: the largest value.
        aim: ``aim(good, bad)``, a probe strictly between a true ``good`` and a false
            ``bad`` (clamped into that range); None bisects.

    Note [Interpolated probes]
        For a monotone predicate every sequence of probes that keeps a true value below a
        false one ends at the same pair (the last true value, the first false), so ``aim``
        changes how many calls the search makes, never its answer. The planner aims by linear
        interpolation of the closed-form device total, which is non-decreasing and close to
        linear in the micro-batch size and the sequence length (:func:`toward`): one or two
        probes where bisection took 13 over a bracket of 8,192 tokens. An aimed probe that
        does not halve the bracket twice running is followed by a midpoint, so the calls stay
        within three times bisection's. tests/planner/test_interpolated_search.py compares
        the aimed searches with bisection and with a scan of every value up to twice the
        answer, and whole plans with the replays they ran, over 14 configurations.
    """
    if lo > hi or not pred(lo):
        return None
    good, n = lo, lo
    while True:
        n = min(2 * n, hi)
        if n == good:
            return good  # reached hi, everything fits
        if not pred(n):
            bad = n
            break
        good = n
    slow = 0  # aimed probes in a row that did not halve the bracket
    while bad - good > 1:  # invariant: pred(good), not pred(bad)
        width = bad - good
        if aim is None or slow >= 2:
            n, slow = (good + bad) // 2, 0
        else:
            n = min(max(aim(good, bad), good + 1), bad - 1)
            slow += 1
        if pred(n):
            good = n
        else:
            bad = n
        if 2 * (bad - good) <= width:
            slow = 0
    return good


def toward(total: Callable[[int], int], limit: float) -> Callable[[int, int], int]:
    """An ``aim`` for :func:`largest_true`: the value where the line through
    ``(good, total(good))`` and ``(bad, total(bad))`` reaches ``limit`` (Note [Interpolated
    probes]); the midpoint when ``total`` does not rise between them.

    Args:
        total: a non-decreasing closed-form total at a value, bytes (memoised by the caller:
            both ends were evaluated by the predicate already).
        limit: the total the predicate allows, bytes.
    """

    def aim(good: int, bad: int) -> int:
        low, high = total(good), total(bad)
        if high <= low:
            return (good + bad) // 2
        return good + int((limit - low) / (high - low) * (bad - good))

    return aim


def largest_simulated_fit(
    sim: Callable[[int], MemoryEstimate],
    fast_total: Callable[[int], int],
    capacity_bytes: int,
    hi: int,
) -> int | None:
    """Largest ``u`` in ``[1, hi - 1]`` whose simulated estimate fits, given that ``hi``'s does
    not and that fitting is monotone in ``u``; None when ``sim(1)`` does not fit either.

    Bisection with aimed probes (Note [Aimed probes at the boundary]): about half the
    simulator calls of an exponential search and bisection from 1.

    Args:
        sim: the simulated estimate at ``u`` (memoised by the caller).
        fast_total: the closed-form device total at ``u``, bytes (fragmentation 0).
        capacity_bytes: the GPU's usable bytes.
        hi: a value whose simulated estimate does not fit.

    Returns:
        The largest fitting value, or None.

    Note [Aimed probes at the boundary]
        The simulated device total is the closed form's plus fragmentation (Note [Fast bound,
        simulated answer]), and fragmentation changes slowly with the searched value. So after
        a probe that fits, the next probe is the largest value whose closed-form total plus
        that probe's fragmentation, scaled by the ratio of the two closed-form totals, is
        within the capacity (closed-form estimates cost about a millisecond, a replay tens);
        after a probe that does not fit, or before any fits, the next is the midpoint. The
        bracket (last fit, first non-fit) shrinks at every probe and ends as a value that fits
        next to one that does not. Fragmentation moves in whole segments, so fitting is not
        strictly monotone near the boundary, and where it is not, a different sequence of
        probes can end at another such pair (llama-3.2-1b on an RTX-4090 at micro-batch 1:
        seq_len 225 where the search from 1 found 233). Replays per seq_len search on
        llama-3.2-3b / A100-80GB (token granularity): 14, where the search from 1 took 28.
        Tried and dropped (issue 28): after an aimed probe that fails, probing just below it
        (a sixteenth of the bracket) instead of the midpoint, or aiming with a 1-2% margin,
        ran as many or more replays over 56 searches (7 model / GPU pairs, 2 precisions, with
        and without checkpointing, both dimensions: 277 replays as is) and moved 3 or 4 of
        the answers to another fitting pair, so the probe sequence is kept.
    """
    lo, ratio = 0, 0.0  # lo: the largest value known to fit (0: none)
    aimed = False
    while hi - lo > 1:
        probe = (lo + hi) // 2
        if lo and not aimed:

            def within(u: int, r: float = ratio) -> bool:
                return fast_total(u) * (1.0 + r) <= capacity_bytes

            aim = toward(fast_total, capacity_bytes / (1.0 + ratio))
            guess = largest_true(within, lo + 1, hi - 1, aim)
            probe = lo + 1 if guess is None else guess
        aimed = bool(lo) and not aimed
        est = sim(probe)
        if fits(est):
            lo, aimed = probe, False
            allocated = est.breakdown.device_total_bytes - est.breakdown.fragmentation
            ratio = est.breakdown.fragmentation / max(allocated, 1)
        else:
            hi = probe
    return lo or None


def _search(
    dimension: str,
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    *,
    step: int,
    max_value: int,
    cap_reason: LimitedBy,
    cuda_context_bytes: int | None,
) -> PlanResult:
    def config(units: int) -> TrainingConfig:
        changes: dict[str, Any] = {dimension: units * step}
        return derived(training, **changes)

    fast_cache: dict[int, MemoryEstimate] = {}  # the aimed probes ask some values again

    def fast(units: int) -> MemoryEstimate:
        if units not in fast_cache:
            fast_cache[units] = fast_estimate(
                model, config(units), gpu, cuda_context_bytes=cuda_context_bytes
            )
        return fast_cache[units]

    def fast_fits(units: int) -> bool:
        return fits(fast(units))

    cache: dict[int, MemoryEstimate] = {}

    def sim(units: int) -> MemoryEstimate:
        if units not in cache:
            cache[units] = simulated_estimate(
                model, config(units), gpu, cuda_context_bytes=cuda_context_bytes
            )
        return cache[units]

    max_units = max_value // step
    if max_units < 1:
        raise SpecError(dimension, f"step {step} is larger than the limit {max_value}")

    def fast_total(u: int) -> int:
        return fast(u).breakdown.device_total_bytes

    # Note [Interpolated probes]: the same answer as bisection, in fewer closed forms
    best = largest_true(fast_fits, 1, max_units, toward(fast_total, gpu.memory_bytes))
    if best is None:
        first = fast(1)
        return PlanResult(
            dimension,
            None,
            None,
            None,
            first,
            gpu,
            "nothing_fits",
            why_nothing_fits(dimension, first, gpu),
            step,
        )
    if not fits(sim(best)):
        # Fragmentation pushed the closed-form answer over: search below it on the simulator,
        # its probes aimed by the fragmentation measured (Note [Aimed probes at the boundary]).
        sim_best = largest_simulated_fit(lambda u: sim(u), fast_total, gpu.memory_bytes, best)
        if sim_best is None:
            first = sim(1)
            return PlanResult(
                dimension,
                None,
                None,
                None,
                first,
                gpu,
                "nothing_fits",
                why_nothing_fits(dimension, first, gpu),
                step,
            )
        best = sim_best
    est = sim(best)
    value = best * step
    if best == max_units:
        limit = cap_reason
        nxt = None
        reason = f"{dimension}={value} fits with {format_bytes(margin_bytes(est))} to spare; " + (
            _context_length(value, step, max_value)
            if limit == "context_length"
            else f"the search stops at {max_value}"
        )
    else:
        limit = "memory"
        nxt = fast(best + 1)
        if fits(nxt):  # the simulator moved the answer down: show what it says one step up
            nxt = sim(best + 1)
        reason = (
            f"{dimension}={value} fits with {format_bytes(margin_bytes(est))} to spare; "
            + _why_next_does_not_fit(f"{dimension}={value + step}", nxt, gpu)
        )
    return PlanResult(dimension, value, config(best), est, nxt, gpu, limit, reason, step)


def _context_length(value: int, step: int, max_value: int) -> str:
    """Why ``value`` is the answer when the next multiple of ``step`` passes the model's
    context length ``max_value``: it is that length, or the last multiple of ``step`` below it."""
    cap = f"the model's context length (max_position_embeddings={max_value})"
    if value == max_value:
        return f"it is {cap}"
    return f"it is the last multiple of {step} tokens below {cap}"


def _why_next_does_not_fit(what: str, nxt: MemoryEstimate, gpu: GPUSpec) -> str:
    """Why the first value past the answer does not fit: what it needs, or, when its allocated
    peak would fit and the simulated allocator still runs out of memory, that fragmentation
    does (its device total is then not a number: the estimate's table prints OOM)."""
    b, usable = nxt.breakdown, format_bytes(gpu.memory_bytes)
    if nxt.oom_message and b.allocated_bytes + b.cuda_context <= gpu.memory_bytes:
        return (
            f"{what} runs out of memory in the {nxt.peak_phase}: "
            f"{format_bytes(b.allocated_bytes)} allocated plus the CUDA context "
            f"({format_bytes(b.cuda_context)}) would fit the {usable} usable, but the "
            "simulated caching allocator finds no free block large enough (fragmentation)"
        )
    return (
        f"{what} needs {format_bytes(b.device_total_bytes)} in the {nxt.peak_phase}"
        f"{_fragmentation(nxt)} (usable {usable})"
    )


def _fragmentation(est: MemoryEstimate) -> str:
    frag = est.breakdown.fragmentation
    out = f", {format_bytes(frag)} of it fragmentation" if frag else ""
    if est.oom_message:
        out += ", and the simulated caching allocator runs out of memory"
    return out


def why_nothing_fits(dimension: str, first: MemoryEstimate, gpu: GPUSpec) -> str:
    """One sentence on why the smallest configuration does not fit: the weights alone, the
    weights + optimizer states, or the peak of the step at the smallest value.

    Args:
        dimension: the searched field.
        first: the estimate at the smallest value of the search.
        gpu: the GPU.

    Returns:
        The sentence (sizes in GiB).
    """
    b = first.breakdown
    usable = gpu.memory_bytes
    ctx = b.cuda_context
    value = first.config.get(dimension)
    fix_hint = "; see `trainmem fit` for changes that make it fit"
    if b.parameters + ctx > usable:
        return (
            f"the weights alone ({format_bytes(b.parameters)}) plus the CUDA context "
            f"({format_bytes(ctx)}) exceed the {format_bytes(usable)} usable on {gpu.name}, "
            f"before any gradient, optimizer state or activation"
        )
    if b.parameters + b.optimizer_states + ctx > usable:
        return (
            f"weights + optimizer states alone ({format_bytes(b.parameters)} + "
            f"{format_bytes(b.optimizer_states)}) plus the CUDA context exceed the "
            f"{format_bytes(usable)} usable on {gpu.name}{fix_hint}"
        )
    over = (
        f"> {format_bytes(usable)} usable on {gpu.name}"
        if b.device_total_bytes > usable
        else f"and the simulated caching allocator runs out of memory within the "
        f"{format_bytes(usable)} usable on {gpu.name} (fragmentation)"
    )
    return (
        f"even {dimension}={value} needs {format_bytes(b.device_total_bytes)} at the peak "
        f"({first.peak_phase}: {first.peak_reason}; weights {format_bytes(b.parameters)}, "
        f"gradients {format_bytes(b.gradients)}, optimizer states "
        f"{format_bytes(b.optimizer_states)}, activations {format_bytes(b.activations)}) "
        f"{over}{fix_hint}"
    )


def max_micro_batch_size(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu: str | GPUSpec,
    *,
    cuda_context_bytes: int | None = None,
    max_value: int = MAX_MICRO_BATCH_SIZE,
) -> PlanResult:
    """The largest ``micro_batch_size`` that fits ``gpu``, every other setting fixed.

    Args:
        model: preset name, HF ``config.json`` path, or a ModelSpec.
        training: the fixed settings (its ``micro_batch_size`` is ignored).
        gpu: catalog name or GPUSpec.
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.
        max_value: search limit.

    Returns:
        The answer with the simulated estimate at it, its margin in bytes and a reason; when even
        ``micro_batch_size=1`` does not fit, ``value`` is None and ``reason`` says why (e.g. the
        weights alone exceed the GPU).

    Raises:
        SpecError: unknown model or GPU.

    Source: exponential + binary search on a monotone predicate; the predicate is
    :func:`trainmem.estimate.estimate` (Note [One description of the step]).
    """
    spec, gpu_spec = resolve(model, gpu)
    return _search(
        "micro_batch_size",
        spec,
        training,
        gpu_spec,
        step=1,
        max_value=max_value,
        cap_reason="search_limit",
        cuda_context_bytes=cuda_context_bytes,
    )


def max_seq_len(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu: str | GPUSpec,
    *,
    cuda_context_bytes: int | None = None,
    multiple_of: int = SEQ_LEN_MULTIPLE_OF,
) -> PlanResult:
    """The longest ``seq_len`` (a multiple of ``multiple_of``, at most the model's
    ``max_position_embeddings``) that fits ``gpu``, every other setting fixed.

    Args:
        model: preset name, HF ``config.json`` path, or a ModelSpec.
        training: the fixed settings (its ``seq_len`` is ignored).
        gpu: catalog name or GPUSpec.
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.
        multiple_of: granularity of the answer in tokens; default :data:`SEQ_LEN_MULTIPLE_OF`
            (8), 1 for the exact longest length.

    Returns:
        As :func:`max_micro_batch_size`; ``limited_by="context_length"`` when the model's own
        context length fits.

    Raises:
        SpecError: unknown model or GPU, ``multiple_of`` < 1 or above the context length.
        UnsupportedError: a vision encoder, whose sequence is fixed by the image size.
    """
    spec, gpu_spec = resolve(model, gpu)
    if spec.architecture == "vision-encoder":
        raise UnsupportedError(
            f"{spec.name} is a vision encoder: its sequence length is fixed by the image size "
            "(patches + 1); plan the micro-batch size instead"
        )
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise SpecError("seq_len_multiple_of", f"must be a positive integer, got {multiple_of!r}")
    # every context-parallel rank holds seq_len / context_parallel_size tokens
    step = math.lcm(multiple_of, training.context_parallel_size)
    context = spec.max_position_embeddings
    if step > context:
        cp = training.context_parallel_size
        raise SpecError(
            "seq_len_multiple_of",
            f"{multiple_of}"
            + (
                f" (with context_parallel_size={cp}: steps of {step})"
                if step != multiple_of
                else ""
            )
            + f" is longer than {spec.name}'s context length (max_position_embeddings={context})"
            f"; allowed: 1-{context}",
        )
    return _search(
        "seq_len",
        spec,
        training,
        gpu_spec,
        step=step,
        max_value=context,
        cap_reason="context_length",
        cuda_context_bytes=cuda_context_bytes,
    )


DATA_PARALLEL_SIZES: tuple[int, ...] = tuple(2**k for k in range(11))
"""GPU counts the sharded search tries, fewest first: 1, 2, 4, ..., 1024."""

DEFAULT_SHARDED_STAGE = 3
"""The sharding assumed when the user chose none: ZeRO-3 / FSDP full-shard (parameters,
gradients and optimizer states over the data-parallel GPUs; Rajbhandari et al. 2020, sec. 5.3)."""


@dataclass(frozen=True, slots=True)
class ShardResult:
    """The fewest GPUs of one kind that hold a sharded run.

    Attributes:
        data_parallel_size: the fewest GPUs that fit, or None when none of the sizes tried do.
        training: the configuration at that size (None when none fits).
        estimate: the simulated estimate there; when none fits, the fast estimate at the
            largest size tried.
        gpu: the GPU.
    """

    data_parallel_size: int | None
    training: TrainingConfig | None
    estimate: MemoryEstimate
    gpu: GPUSpec

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; sizes in bytes."""
        est = self.estimate
        return {
            "data_parallel_size": self.data_parallel_size,
            "zero_stage": est.config.get("zero_stage"),
            "verdict": est.verdict,
            "margin_bytes": margin_bytes(est),
            "peak": est.peak_dict(),
            "at_data_parallel_size": est.config.get("data_parallel_size"),
        }


def fewest_gpus(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    *,
    sizes: tuple[int, ...] = DATA_PARALLEL_SIZES,
    cuda_context_bytes: int | None = None,
) -> ShardResult:
    """The smallest ``data_parallel_size`` in ``sizes`` at which the sharded run fits ``gpu``.

    Every size is tried with the fast estimate, fewest first; the first that fits is confirmed
    with the allocator replay, and if fragmentation pushes it over the scan goes on. A size that
    does not fit by the fast estimate does not fit by the simulated one either (Note [Fast
    bound, simulated answer]), so the answer is the fewest by the simulator too.

    Args:
        model: the model.
        training: the settings, ZeRO stage / FSDP included (its ``data_parallel_size`` is
            ignored).
        gpu: the GPU.
        sizes: GPU counts to try, ascending.
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.

    Returns:
        The answer with its simulated estimate.

    Raises:
        SpecError: ``sizes`` is empty, or the settings are refused at every size.
    """
    if not sizes:
        raise SpecError("sizes", "no data_parallel_size to try")
    last: MemoryEstimate | None = None
    error: SpecError | None = None
    for n in sizes:
        try:
            t = derived(training, data_parallel_size=n)
            fast = fast_estimate(model, t, gpu, cuda_context_bytes=cuda_context_bytes)
        except SpecError as exc:  # e.g. a shard group larger than the size tried
            error = exc
            continue
        last = fast
        if not fits(fast):
            continue
        sim = simulated_estimate(model, t, gpu, cuda_context_bytes=cuda_context_bytes)
        if fits(sim):
            return ShardResult(n, t, sim, gpu)
        last = sim
    if last is None:
        assert error is not None
        raise error
    return ShardResult(None, None, last, gpu)


@dataclass(frozen=True, slots=True)
class GpuPlanRow:
    """One catalog GPU in :func:`plan_gpus`.

    Attributes:
        gpu: the GPU.
        micro_batch: the largest micro-batch size at the given settings (None: refused).
        sharded: the fewest GPUs of this kind for the sharded run (None: no sharded search).
        error: why the GPU cannot run the settings at all (e.g. no bf16), else None.
    """

    gpu: GPUSpec
    micro_batch: PlanResult | None
    sharded: ShardResult | None = None
    error: str | None = None

    @property
    def verdict(self) -> str | None:
        """The verdict of the estimate at the largest micro-batch size (at micro-batch 1 when
        none fits): :attr:`MemoryEstimate.verdict`."""
        mb = self.micro_batch
        if mb is None:
            return None
        est = mb.estimate if mb.estimate is not None else mb.next_estimate
        return None if est is None else est.verdict

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; sizes in bytes."""
        mb = self.micro_batch
        return {
            "gpu": {"name": self.gpu.name, "capacity_bytes": self.gpu.memory_bytes},
            "error": self.error,
            "micro_batch_size": None if mb is None else mb.value,
            "verdict": self.verdict,
            "device_total_bytes": None
            if mb is None or mb.estimate is None
            else mb.estimate.breakdown.device_total_bytes,
            "fewest_gpus": None if self.sharded is None else self.sharded.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """:func:`plan_gpus`'s answer.

    Attributes:
        model_name: the model.
        training: the settings as given.
        rows: one per GPU, in catalog order.
        sharded: whether the fewest-GPU search ran.
        zero_stage: the ZeRO stage of the sharded search (the user's, or
            :data:`DEFAULT_SHARDED_STAGE`).
        model_states_bytes: parameters + gradients + optimizer states of the whole model on one
            GPU (the given settings at ``data_parallel_size=1``).
        assumption: the sentence stating the sharding assumed, or None when the user chose it.
    """

    model_name: str
    training: TrainingConfig
    rows: list[GpuPlanRow]
    sharded: bool
    zero_stage: int
    model_states_bytes: int
    assumption: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; sizes in bytes."""
        return {
            "model": self.model_name,
            "sharded": self.sharded,
            "zero_stage": self.zero_stage if self.sharded else None,
            "data_parallel_sizes": list(DATA_PARALLEL_SIZES) if self.sharded else None,
            "model_states_bytes": self.model_states_bytes,
            "assumption": self.assumption,
            "gpus": [r.to_dict() for r in self.rows],
        }


def plan_gpus(
    model: str | ModelSpec,
    training: TrainingConfig,
    *,
    gpus: list[GPUSpec] | None = None,
    shard: bool | None = None,
    cuda_context_bytes: int | None = None,
) -> GpuPlan:
    """Every catalog GPU with the largest micro-batch size that fits at the given settings and,
    for a sharded run, the fewest GPUs of that kind that fit.

    The sharded search (:func:`fewest_gpus` over :data:`DATA_PARALLEL_SIZES`) runs when the
    user chose a ZeRO stage / FSDP (``training.zero_stage > 0``) or when the model states alone
    (parameters + gradients + optimizer states, unsharded) exceed some GPU's usable memory; it
    keeps the user's stage, else assumes ZeRO-3 / FSDP full-shard and says so.

    Args:
        model: preset name, HF ``config.json`` path, or a ModelSpec.
        training: the settings.
        gpus: the GPUs to list; None for the whole catalog
            (:data:`~trainmem.specs.hardware.GPUS`).
        shard: force (True) or skip (False) the sharded search; None decides as above.
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.

    Returns:
        One row per GPU; sizes in bytes.

    Raises:
        SpecError: unknown model, or settings refused whatever the GPU.
    """
    from trainmem.estimate import resolve_model
    from trainmem.specs.hardware import GPUS

    spec = resolve_model(model)
    catalog = list(GPUS.values()) if gpus is None else list(gpus)
    if not catalog:
        raise SpecError("gpus", "no GPU to plan for")
    one = derived(training, data_parallel_size=1, shard_group_size=None)
    states = sum(
        _first_estimate(spec, one, catalog, cuda_context_bytes).model_states_bytes.values()
    )
    chosen = training.zero_stage > 0
    if shard is None:
        shard = chosen or any(states > g.memory_bytes for g in catalog)
    stage = training.zero_stage if chosen else DEFAULT_SHARDED_STAGE
    assumption = None
    if shard and not chosen:
        assumption = (
            f"sharded as ZeRO-3 / FSDP full-shard (zero_stage={stage}), the default: the model "
            f"states alone ({format_bytes(states)}: weights, gradients, optimizer states) exceed "
            "one GPU; pass --zero-stage or --fsdp to choose"
        )
    sharded_training = derived(training, zero_stage=stage)
    rows = []
    for gpu in catalog:
        try:
            mb = max_micro_batch_size(spec, training, gpu, cuda_context_bytes=cuda_context_bytes)
        except SpecError as exc:  # the GPU cannot run the settings (e.g. no bf16)
            rows.append(GpuPlanRow(gpu, None, error=str(exc)))
            continue
        sharded = None
        if shard:
            sharded = fewest_gpus(
                spec, sharded_training, gpu, cuda_context_bytes=cuda_context_bytes
            )
        rows.append(GpuPlanRow(gpu, mb, sharded))
    if all(r.error is not None for r in rows):  # refused whatever the GPU: say why once
        raise SpecError("gpus", f"no GPU runs these settings: {rows[0].error}")
    return GpuPlan(spec.name, training, rows, shard, stage, states, assumption)


def _first_estimate(
    model: ModelSpec,
    training: TrainingConfig,
    gpus: list[GPUSpec],
    cuda_context_bytes: int | None,
) -> MemoryEstimate:
    """The fast estimate on the first GPU that accepts the settings (the model states do not
    depend on the GPU)."""
    error: SpecError | None = None
    for gpu in gpus:
        try:
            return fast_estimate(model, training, gpu, cuda_context_bytes=cuda_context_bytes)
        except SpecError as exc:
            error = exc
    assert error is not None
    raise error
