"""Changes that make a run fit, ranked by what they cost.

Every candidate change is one row of :data:`CHANGES`: a name, a group (two changes of the same
group are alternatives and are never combined), a function that proposes configurations
(cheapest first), a cost rank and a cost sentence with its source. Adding a kind of change
(sharding over N GPUs, LoRA, ...) is adding a row. :func:`fixes` tries every row on its own;
when no single change fits it tries every pair of rows from different groups.

All sizes are bytes (``int``).

Note [Cost ranks]
    ``cost_rank`` orders fixes; where the cost is compute it is the estimated extra step time as
    a fraction (full recompute: one extra forward = 1/3 of the forward + backward FLOPs, since
    the backward costs about twice the forward, so +33%; Chen et al. 2016, arXiv:1604.06174,
    sec. 4; Korthikanti et al. 2022, arXiv:2205.05198, sec. 5). Selective recompute recomputes
    only the attention core; Korthikanti et al. 2022 (abstract, sec. 5, Table 4) measure its
    overhead at under a tenth of full recompute's, so we rank it at 0.03. Costs that are not
    compute (numerics, a dependency, a different optimizer) get fixed ranks chosen to sit where a
    practitioner would try them; they are ordering keys, not predictions. A combination costs the
    sum of its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from itertools import combinations, islice
from typing import Any, TypeVar

from trainmem.analytic.prompt_encoder import check_prompt_learning
from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.planner.costs import CostFigures, cost_figures
from trainmem.planner.evaluate import (
    fast_estimate,
    fits,
    margin_bytes,
    resolve,
    simulated_estimate,
)
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig, check_training_for_model, derived

_T = TypeVar("_T")

Propose = Callable[[ModelSpec, TrainingConfig, GPUSpec], list[TrainingConfig]]
"""Configurations one change proposes for a run, cheapest first; [] when it does not apply."""

_TRAINING_FIELDS = frozenset(f.name for f in fields(TrainingConfig))


@dataclass(frozen=True, slots=True)
class Change:
    """One row of :data:`CHANGES`.

    Attributes:
        name: short label, e.g. ``"full activation checkpointing"``.
        group: changes of one group are alternatives (never combined), e.g. ``"precision"``.
        propose: the configurations this change proposes, cheapest first.
        cost_rank: ordering key, see Note [Cost ranks].
        cost: what the change costs, for a person.
        source: where the cost (and the memory effect) comes from.
    """

    name: str
    group: str
    propose: Propose
    cost_rank: float
    cost: str
    source: str


@dataclass(frozen=True, slots=True)
class Fix:
    """A change (or two) after which the run fits.

    Attributes:
        changes: the :data:`CHANGES` rows applied, in order.
        training: the configuration after the change.
        estimate: the simulated estimate of that configuration (it fits).
        saved_bytes: reduction of the closed-form peak (``max_memory_allocated``), bytes.
        cost_rank: sum of the rows' cost ranks (Note [Cost ranks]).
    """

    changes: tuple[Change, ...]
    training: TrainingConfig
    estimate: MemoryEstimate
    saved_bytes: int
    cost_rank: float
    base: TrainingConfig
    model: ModelSpec | None = None

    @property
    def figures(self) -> CostFigures | None:
        """Recomputed FLOPs, compute ratio, communication and PCIe bytes of the change
        (:func:`~trainmem.planner.costs.cost_figures`); None without the model."""
        return None if self.model is None else cost_figures(self.model, self.base, self.training)

    @property
    def name(self) -> str:
        """The rows' names joined with ``" + "``."""
        return " + ".join(c.name for c in self.changes)

    @property
    def settings(self) -> dict[str, tuple[Any, Any]]:
        """Changed fields: name -> (old value, new value)."""
        return changed_settings(self.base, self.training)

    @property
    def margin_bytes(self) -> int:
        """Usable capacity minus the simulated device total after the change, bytes."""
        return margin_bytes(self.estimate)

    @property
    def cost(self) -> str:
        """The rows' cost sentences joined with ``"; "``."""
        return "; ".join(c.cost for c in self.changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; sizes in bytes."""
        b = self.estimate.breakdown
        return {
            "change": self.name,
            "settings": {k: {"from": v[0], "to": v[1]} for k, v in self.settings.items()},
            "saved_bytes": self.saved_bytes,
            "allocated_bytes": b.allocated_bytes,
            "reserved_bytes": b.reserved_bytes,
            "device_total_bytes": b.device_total_bytes,
            "margin_bytes": self.margin_bytes,
            "cost_rank": self.cost_rank,
            "cost": self.cost,
            "cost_figures": None if self.figures is None else asdict(self.figures),
            "sources": [c.source for c in self.changes],
        }


def changed_settings(base: TrainingConfig, new: TrainingConfig) -> dict[str, tuple[Any, Any]]:
    """TrainingConfig fields that differ: name -> (old, new)."""
    out = {}
    for name in sorted(_TRAINING_FIELDS):
        old, value = getattr(base, name), getattr(new, name)
        if old != value:
            out[name] = (old, value)
    return out


# --- proposers: one per row, each returns [] when the change does not apply -------------------


def _supports_bf16(gpu: GPUSpec) -> bool:
    # bf16 tensor cores from Ampere (compute capability 8.0); every ROCm target in the catalog
    # (CDNA2/3) has bf16.
    if gpu.vendor != "nvidia":
        return True
    return int(gpu.compute_capability.split(".")[0]) >= 8


def _fused_optimizer(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    # torch.optim's fused kernel, where it makes fewer step temporaries (Adam / AdamW)
    row = OPTIMIZER_TABLE[t.optimizer]
    fused = row.step_temporaries("fused")
    if row.torch_fused and row.step_temporaries(t.step_implementation) != fused:
        return [derived(t, optimizer_implementation="fused")]
    return []


def _precision(t: TrainingConfig, precision: str) -> list[TrainingConfig]:
    """``t`` in ``precision``, if its framework trains in it (torchtune: bf16-true / 32-true,
    ``FrameworkConventions.precisions``)."""
    allowed = t.conventions.precisions
    if allowed is not None and precision not in allowed:
        return []
    if precision.endswith("-true") and t.load_dtype not in (None, "float32"):
        # a *-true model is in its precision's dtype: no load_dtype beside it
        return [derived(t, precision=precision, load_dtype=None)]
    return [derived(t, precision=precision)]


def _mixed_precision(_m: ModelSpec, t: TrainingConfig, g: GPUSpec) -> list[TrainingConfig]:
    if t.precision != "32-true":
        return []
    return _precision(t, "bf16-mixed" if _supports_bf16(g) else "16-mixed")


def _true_16bit(_m: ModelSpec, t: TrainingConfig, g: GPUSpec) -> list[TrainingConfig]:
    if t.precision.endswith("-true") and t.precision != "32-true":
        return []
    return _precision(t, "bf16-true" if _supports_bf16(g) else "16-true")


def _selective(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    if t.activation_checkpointing != "none":
        return []
    return [derived(t, activation_checkpointing="selective")]


def _full(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    if t.activation_checkpointing == "full":
        return []
    return [derived(t, activation_checkpointing="full")]


def _accumulate(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    # Keep the global batch exactly: b' divides b and the accumulation grows by b / b'.
    b, gas = t.micro_batch_size, t.gradient_accumulation_steps
    if t.optimizer_in_backward:  # no gradient is kept to accumulate into (TrainingConfig)
        return []
    return [
        derived(t, micro_batch_size=d, gradient_accumulation_steps=gas * (b // d))
        for d in range(b - 1, 0, -1)
        if b % d == 0
    ]


def _eight_bit_optimizer(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    eight_bit = OPTIMIZER_TABLE[t.optimizer].eight_bit
    if eight_bit is None:
        return []
    return [derived(t, optimizer=eight_bit)]


def _adafactor(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    row = OPTIMIZER_TABLE[t.optimizer]
    if row.factored or not row.states:  # already factored, or nothing to factor (plain SGD)
        return []
    # torch.optim.Adafactor's foreach step builds a var_estimate for every parameter at once
    # (one copy of the parameters); its per-parameter loop holds one at a time
    return [derived(t, optimizer="adafactor", optimizer_implementation="for-loop")]


def _has(*names: str) -> bool:
    return all(n in _TRAINING_FIELDS for n in names)


#: Data-parallel sizes tried by the sharding rows, smallest first (the fewest GPUs that fit).
DATA_PARALLEL_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512)

#: LoRA rank proposed by the LoRA rows (peft's examples and the QLoRA paper use 8 to 64).
LORA_RANK = 16


def _zero(stage: int) -> Propose:
    def propose(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
        if not _has("zero_stage", "data_parallel_size") or getattr(t, "zero_stage", 0) >= stage:
            return []
        # global batch kept: each of n ranks runs the same micro-batch; callers who want the
        # same global batch divide the accumulation steps by n themselves.
        current = getattr(t, "data_parallel_size", 1)
        sizes = [n for n in DATA_PARALLEL_SIZES if n >= max(current, 2)]
        return [derived(t, zero_stage=stage, data_parallel_size=n) for n in sizes]

    return propose


def _offload(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
    if not _has("offload") or getattr(t, "offload", "none") != "none":
        return []
    return [derived(t, offload="optimizer")]


def _lora(quantize: str) -> Propose:
    def propose(_m: ModelSpec, t: TrainingConfig, _g: GPUSpec) -> list[TrainingConfig]:
        if not _has("lora_rank", "quantize_base") or getattr(t, "lora_rank", 0) > 0:
            return []
        return [derived(t, lora_rank=LORA_RANK, quantize_base=quantize)]

    return propose


CHANGES: tuple[Change, ...] = (
    Change(
        "fused optimizer",
        "optimizer_implementation",
        _fused_optimizer,
        0.0,
        "none: one fused kernel, usually faster than foreach (torch.optim fused=True, CUDA)",
        "Note [Optimizer-step temporaries] (foreach materialises one copy of the parameters)",
    ),
    Change(
        "16-bit mixed precision",
        "precision",
        _mixed_precision,
        0.01,
        "none to negative on tensor cores; fp16 (pre-Ampere) needs loss scaling",
        "Micikevicius et al. 2018, arXiv:1710.03740 (mixed precision training)",
    ),
    Change(
        "selective activation checkpointing",
        "activation_checkpointing",
        _selective,
        0.03,
        "a few % more compute: the attention core is recomputed in the backward",
        "Korthikanti et al. 2022, arXiv:2205.05198, sec. 5 (Note [Cost ranks])",
    ),
    Change(
        "smaller micro-batch + gradient accumulation",
        "micro_batch",
        _accumulate,
        0.05,
        "same global batch and same update; smaller kernels use the GPU less well (not modelled)",
        "gradients persist across micro-batches (Note [Where the peak falls])",
    ),
    Change(
        "8-bit optimizer",
        "optimizer",
        _eight_bit_optimizer,
        0.1,
        "bitsandbytes dependency; block-wise 8-bit Adam matches 32-bit Adam in the paper's "
        "benchmarks; paged-adamw-8bit has the same GPU footprint here and also pages states "
        "to the CPU under memory spikes",
        "Dettmers et al. 2021, arXiv:2110.02861; paged optimizers: Dettmers et al. 2023, "
        "arXiv:2305.14314, sec. 3",
    ),
    Change(
        "full activation checkpointing",
        "activation_checkpointing",
        _full,
        0.33,
        "about 33% more compute: one extra forward, which is 1/3 of forward + backward FLOPs",
        "Chen et al. 2016, arXiv:1604.06174, sec. 4; Korthikanti et al. 2022, "
        "arXiv:2205.05198, sec. 5",
    ),
    Change(
        "pure 16-bit weights and optimizer states",
        "precision",
        _true_16bit,
        0.5,
        "numerics: updates smaller than 16-bit resolution are lost unless stochastic rounding "
        "or Kahan summation is used",
        "Zamirai et al. 2020, arXiv:2010.06192 (revisiting bf16 training)",
    ),
    Change(
        "Adafactor optimizer",
        "optimizer",
        _adafactor,
        1.0,
        "different optimizer (factored second moment, no momentum): may need retuning",
        "Shazeer & Stern 2018, arXiv:1804.04235, sec. 3",
    ),
    # Rows below need TrainingConfig's sharding / LoRA fields; they propose nothing without them.
    Change(
        "ZeRO-1 over N GPUs",
        "sharding",
        _zero(1),
        1.5,
        "N GPUs; optimizer states sharded, same communication volume as plain data parallelism",
        "Rajbhandari et al. 2020, arXiv:1910.02054, sec. 5.1 and 7.2.1",
    ),
    Change(
        "ZeRO-2 / FSDP shard-grad-op over N GPUs",
        "sharding",
        _zero(2),
        1.6,
        "N GPUs; gradients reduce-scattered instead of all-reduced (same volume)",
        "Rajbhandari et al. 2020, arXiv:1910.02054, sec. 5.2 and 7.2.1",
    ),
    Change(
        "ZeRO-3 / FSDP full-shard over N GPUs",
        "sharding",
        _zero(3),
        2.0,
        "N GPUs; parameters all-gathered in forward and backward: 1.5x the communication of "
        "data parallelism",
        "Rajbhandari et al. 2020, arXiv:1910.02054, sec. 5.3 and 7.2.2",
    ),
    Change(
        "CPU offload of the optimizer",
        "offload",
        _offload,
        3.0,
        "optimizer step on the CPU and PCIe transfers each step: often much slower",
        "Ren et al. 2021, arXiv:2101.06840 (ZeRO-Offload)",
    ),
    Change(
        f"LoRA (rank {LORA_RANK})",
        "adapters",
        _lora("none"),
        4.0,
        "fine-tuning only: a low-rank update instead of full training",
        "Hu et al. 2021, arXiv:2106.09685",
    ),
    Change(
        f"QLoRA (4-bit NF4 base, rank {LORA_RANK})",
        "adapters",
        _lora("nf4"),
        4.5,
        "fine-tuning only, 4-bit frozen base: dequantization per matmul and quantization error",
        "Dettmers et al. 2023, arXiv:2305.14314",
    ),
)
"""Every change the planner knows, cheapest first (See Note [Cost ranks])."""


def _apply(
    model: ModelSpec, training: TrainingConfig, gpu: GPUSpec, rows: tuple[Change, ...]
) -> Iterator[TrainingConfig]:
    """Every configuration the rows propose applied in order (first row's proposals outer),
    those the model refuses left out (a pair that no release runs together: Adafactor and
    FSDP2, Note [Adafactor on DTensor-sharded matrices]), and those the formulas refuse under
    prompt learning (prefix tuning with checkpointing: the step fails; Note [Prompt learning in
    the formulas] in trainmem/analytic/prompt_encoder.py)."""
    if not rows:
        try:
            check_training_for_model(model, training)
            check_prompt_learning(model, training)
        except (SpecError, UnsupportedError):
            return
        yield training
        return
    first, rest = rows[0], rows[1:]
    try:
        proposals = first.propose(model, training, gpu)
    except SpecError:  # a change this configuration cannot take (load_dtype under ZeRO-3)
        return
    for proposed in proposals:
        yield from _apply(model, proposed, gpu, rest)


def fixes(
    model: str | ModelSpec,
    training: TrainingConfig,
    gpu: str | GPUSpec,
    *,
    changes: tuple[Change, ...] = CHANGES,
    limit: int = 10,
    cuda_context_bytes: int | None = None,
    simulated: MemoryEstimate | None = None,
) -> list[Fix]:
    """Ranked changes after which a run that does not fit ``gpu`` fits.

    Each row of ``changes`` is tried on its own; for each the cheapest configuration it proposes
    that fits is kept (e.g. the largest micro-batch that divides the current one). When no single
    row makes the run fit, every pair of rows from different groups is tried. Candidates are
    screened with the closed form and confirmed with the allocator simulator (See Note [Fast
    bound, simulated answer] in ``evaluate.py``).

    Args:
        model: preset name, HF ``config.json`` path, or a ModelSpec.
        training: the run as planned.
        gpu: catalog name or GPUSpec.
        changes: the table of candidate changes (default :data:`CHANGES`).
        limit: at most this many fixes are returned.
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.
        simulated: the run's simulated estimate when the caller has it (``trainmem fit``
            shows it), so that its allocator replay is not run twice.

    Returns:
        Fixes sorted by cost rank, then by memory saved (largest first); [] when the run already
        fits or nothing in the table (nor two of its rows) makes it fit.

    Raises:
        SpecError: unknown model or GPU, or ``limit`` below 1.

    Known limitations: saved bytes compare closed-form peaks (fragmentation excluded); the cost
    of a smaller micro-batch is not modelled (rank only).
    """
    if limit < 1:
        raise SpecError("limit", f"must be a positive number of fixes, got {limit}")
    spec, gpu_spec = resolve(model, gpu)
    ctx = cuda_context_bytes
    if simulated is None:
        simulated = simulated_estimate(spec, training, gpu_spec, cuda_context_bytes=ctx)
    if fits(simulated):
        return []
    base_allocated = fast_estimate(spec, training, gpu_spec, cuda_context_bytes=ctx).breakdown
    singles = _screen_fast(spec, training, gpu_spec, [(c,) for c in changes], ctx)
    fitting_alone = {rows[0].name for _, rows, _ in singles}
    # A pair is worth showing only when neither of its rows fits alone (else the single is
    # cheaper and does the job); this covers "no single change fits" and cheap pairs that beat
    # an expensive single (e.g. bf16-true + 8-bit optimizer before sharding over N GPUs).
    pairs: list[tuple[Change, ...]] = [
        (a, b)
        for a, b in combinations(changes, 2)
        if a.group != b.group and a.name not in fitting_alone and b.name not in fitting_alone
    ]
    # Cheapest first; a pair is screened only when the confirmation reaches it, so the search
    # stops at ``limit`` fixes instead of screening every pair (the order is the one a full
    # screen then a stable sort by cost would give: singles before pairs of the same cost).
    ordered = sorted(
        [*singles, *((sum(c.cost_rank for c in rows), rows, None) for rows in pairs)],
        key=lambda entry: entry[0],
    )

    def in_cost_order() -> Iterator[_Screened]:
        for rank, rows, fitting in ordered:
            if fitting is None:
                found = _screen_fast(spec, training, gpu_spec, [rows], ctx)
                if not found:
                    continue
                fitting = found[0][2]
            yield rank, rows, fitting

    base_bytes = base_allocated.allocated_bytes
    return _confirm(spec, training, gpu_spec, in_cost_order(), base_bytes, limit, ctx)


_Screened = tuple[float, tuple[Change, ...], Iterator[tuple[TrainingConfig, MemoryEstimate]]]


def _screen_fast(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    candidates: list[tuple[Change, ...]],
    ctx: int | None,
) -> list[_Screened]:
    """Candidates with at least one proposal that fits by the closed form: (cost rank, rows,
    iterator over the fitting proposals starting at the cheapest)."""
    out: list[_Screened] = []
    for rows in candidates:
        fitting = _fast_fitting(model, training, gpu, rows, ctx)
        first = next(fitting, None)
        if first is not None:
            out.append((sum(c.cost_rank for c in rows), rows, _chain(first, fitting)))
    return out


def _confirm(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    screened: Iterable[_Screened],
    base_allocated_bytes: int,
    limit: int,
    ctx: int | None,
) -> list[Fix]:
    """The simulator in the order given (cheapest first) until ``limit`` fixes are confirmed;
    ties by bytes saved."""
    out: list[Fix] = []
    for rank, rows, fitting in screened:
        if len(out) >= limit:
            break
        # The first closed-form fit may not survive fragmentation; try the next few proposals.
        for proposed, fast in islice(fitting, SIMULATED_RETRIES):
            est = simulated_estimate(model, proposed, gpu, cuda_context_bytes=ctx)
            if fits(est):
                saved = base_allocated_bytes - fast.breakdown.allocated_bytes
                out.append(Fix(rows, proposed, est, saved, rank, training, model))
                break
    out.sort(key=lambda f: (f.cost_rank, -f.saved_bytes))
    return out


SIMULATED_RETRIES = 4
"""Proposals of one candidate checked with the simulator before it is given up."""


def _fast_fitting(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    rows: tuple[Change, ...],
    ctx: int | None,
) -> Iterator[tuple[TrainingConfig, MemoryEstimate]]:
    """The rows' proposals that fit by the closed form, cheapest first (lazily); a sharded
    proposal is not estimated when the same proposal over the most GPUs does not fit (Note
    [More GPUs never need more memory])."""
    proposals = list(_apply(model, training, gpu, rows))
    widest = _widest_of_family(proposals) if PRUNE_SHARDED else {}
    known: dict[int, MemoryEstimate] = {}

    def at(k: int) -> MemoryEstimate:
        est = known.get(k)
        if est is None:
            est = known[k] = fast_estimate(model, proposals[k], gpu, cuda_context_bytes=ctx)
        return est

    for k, proposed in enumerate(proposals):
        top = widest.get(k, k)
        if top != k and not fits(at(top)):
            continue
        est = at(k)
        if fits(est):
            yield proposed, est


PRUNE_SHARDED = True
"""Skip the sharded proposals that cannot fit (Note [More GPUs never need more memory]);
False estimates every proposal (the tests compare both ways)."""

MONOTONE_FROM = 4
"""The smallest data-parallel size from which the closed form's device total never grows with
more GPUs (Note [More GPUs never need more memory])."""


def _widest_of_family(proposals: list[TrainingConfig]) -> dict[int, int]:
    """Index of each sharded proposal -> index of the proposal of its family with the most
    GPUs, for the proposals of Note [More GPUs never need more memory] (ZeRO / FSDP, at least
    :data:`MONOTONE_FROM` ranks, no hybrid shard group); a family is the proposals equal in
    every field but ``data_parallel_size``.

    Note [More GPUs never need more memory]
        The sharding rows propose ``data_parallel_size`` 2, 4, ..., 512 and the search keeps
        the fewest GPUs that fit, so a sharding row (or a pair with one) that fits nowhere
        used to cost nine closed-form estimates (``trainmem fit llama-3.1-8b --gpu RTX-4090
        -b 2 -s 2048``: 297 of its 350). With ZeRO / FSDP the per-rank model states are
        ``ceil(bytes / N)`` or DeepSpeed's ``2 ceil(P / 2N)`` elements, non-increasing in N;
        every other term of the device total is either independent of N or, for N > 1, a
        constant (the sharded-weights flag of autocast, one NCCL communicator). Two
        exceptions: the NCCL communicator of two ranks is smaller than that of more
        (``analytic/buffers.py``, 544 vs 688 MiB on A100), so N = 2 is always estimated on
        its own; and a hybrid shard group (``shard_group_size``) adds a replication
        communicator once N exceeds it, so those are never skipped. From
        :data:`MONOTONE_FROM` ranks on, then, a proposal does not fit when its family's
        widest one does not, and is skipped unestimated: the same fixes, in the same order
        (``tests/planner/test_planner_fixes.py`` compares with every proposal estimated).
    """
    families: dict[tuple[Any, ...], int] = {}
    member: dict[int, tuple[Any, ...]] = {}
    for k, t in enumerate(proposals):
        if (
            t.zero_stage < 1
            or t.data_parallel_size < MONOTONE_FROM
            or t.shard_group_size is not None
        ):
            continue
        key = tuple(getattr(t, name) for name in _FAMILY_FIELDS)
        member[k] = key
        top = families.get(key)
        if top is None or proposals[top].data_parallel_size < t.data_parallel_size:
            families[key] = k
    return {k: families[key] for k, key in member.items()}


_FAMILY_FIELDS = tuple(sorted(_TRAINING_FIELDS - {"data_parallel_size"}))


def _chain(first: _T, rest: Iterator[_T]) -> Iterator[_T]:
    yield first
    yield from rest
