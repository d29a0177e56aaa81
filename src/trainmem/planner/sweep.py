"""Estimates over a grid of training settings, with fit / no fit per row.

A sweep is the cartesian product of ``over`` (field -> values) applied to a base
:class:`~trainmem.specs.training.TrainingConfig` with :func:`~trainmem.specs.training.derived`
(``dataclasses.replace`` checking only the changed concerns). By default each
row is the closed form alone (``simulate_allocator=False``, fragmentation 0). A grid with many
(micro-batch size, sequence length) pairs per other setting estimates its rows ``lean``
(:func:`~trainmem.estimate.estimate`): the step schedules filled from templates of their
structure (Note [Schedule templates] in :mod:`trainmem.analytic.template`), the same answers
at about 0.15 ms a row, so a 10,000-row sweep takes about 1.5-2 CPU seconds on a busy 2-core
Xeon (``benchmarks/planner_speed.py``; the budget is 2 s).

All sizes are bytes (``int``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any, cast, overload

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import assumed_of, estimate, resolve_gpu, resolve_model, vision_sequence
from trainmem.specs.grid import SWEEPABLE as SWEEPABLE  # re-exported for the callers
from trainmem.specs.grid import field_name as field_name
from trainmem.specs.grid import parse_over as parse_over
from trainmem.specs.grid import parse_value as parse_value
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig, derived

SHAPE_FIELDS = ("micro_batch_size", "seq_len")
"""Swept fields that change no assumption unless the lengths are drawn from a dataset's
statistics (:func:`trainmem.specs.assumptions.assumptions` reads the framework, loop,
precision, LoRA, quantization, versions and parallel sizes; the shape only for
``sample_lengths``' drawn lengths): a sweep works out what each point assumed once per value of
its other swept fields (of all of them with ``sample_lengths``)."""

TEMPLATED_FROM = 16
"""(micro-batch size, sequence length) pairs per other setting from which a sweep fills its
schedules from templates (Note [Schedule templates]: a recording costs about as much as ten
built schedules, and serves every pair that takes its path through the builder)."""


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One grid point.

    Attributes:
        settings: the swept fields and their values at this point.
        allocated_bytes: predicted ``max_memory_allocated``.
        reserved_bytes: predicted ``max_memory_reserved`` (equal to allocated without the
            simulator; None when the simulated allocator runs out of memory).
        device_total_bytes: reserved plus the CUDA context (what nvidia-smi shows; None on
            an out-of-memory).
        peak_phase: ``forward``, ``backward`` or ``optimizer``.
        fits: whether the step runs on the GPU (None without a GPU).
        verdict: ``fits`` / ``tight`` / ``does not fit`` (:attr:`MemoryEstimate.verdict`),
            None without a GPU.
        margin_bytes: usable capacity minus the device total (None without a GPU, or when the
            simulated allocator runs out of memory: no device total).
        allocator_simulated: whether the row's step was replayed through the allocator
            simulator (``--simulate-allocator``, or a traced step); False: the closed form,
            reserved = allocated, so a run that fragmentation pushes out of memory may read
            ``tight`` here and ``does not fit`` in ``trainmem estimate``.
        assumed: what the point assumed (framework, loop, library versions:
            :func:`~trainmem.estimate.assumed_of`, estimate's ``details.assumed``); not in
            :meth:`to_dict` (the CSV's flat rows): :meth:`Sweep.to_dict` carries it.
    """

    settings: dict[str, Any]
    allocated_bytes: int
    reserved_bytes: int | None
    device_total_bytes: int | None
    peak_phase: str
    fits: bool | None
    verdict: str | None
    margin_bytes: int | None
    allocator_simulated: bool = False
    assumed: Mapping[str, str] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-able dict: the settings, then the figures (bytes)."""
        return {
            **self.settings,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "peak_phase": self.peak_phase,
            "fits": self.fits,
            "verdict": self.verdict,
            "margin_bytes": self.margin_bytes,
            "allocator_simulated": self.allocator_simulated,
        }


@dataclass(frozen=True, slots=True)
class Sweep(Sequence[SweepRow]):
    """A sweep's rows with what they were computed for: a sequence of :class:`SweepRow` (the
    grid points in order), plus the model, GPU, grid, the settings held fixed and what was
    assumed, as ``estimate`` / ``plan`` / ``fit`` report them.

    Attributes:
        model_name: the model as the estimates name it (preset name or config path).
        engine: the first point's engine (``analytic``, or the generic path's ``trace``).
        gpu: the GPU of the verdicts, or None.
        over: the grid: field -> values, fields spelled as :class:`TrainingConfig`'s.
        config: every resolved setting of the first point (the swept fields vary by row).
        assumed: what the first point assumed (framework, loop, versions); a row whose
            assumptions differ (a swept framework, loop or version) carries its own.
        rows: one per grid point, in ``itertools.product`` order.
    """

    model_name: str
    engine: str
    gpu: GPUSpec | None
    over: dict[str, list[Any]]
    config: dict[str, Any]
    assumed: Mapping[str, str]
    rows: tuple[SweepRow, ...]

    @overload
    def __getitem__(self, index: int) -> SweepRow: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[SweepRow]: ...
    def __getitem__(self, index: int | slice) -> SweepRow | Sequence[SweepRow]:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[SweepRow]:
        return iter(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """``{"model", "engine", "gpu", "over", "config", "assumed", "rows"}``: ``gpu`` is
        ``{"name", "capacity_bytes"}`` or None; each row :meth:`SweepRow.to_dict`, plus
        ``"assumed"`` where it differs from the top-level one."""
        gpu = self.gpu
        return {
            "model": self.model_name,
            "engine": self.engine,
            "gpu": None if gpu is None else {"name": gpu.name, "capacity_bytes": gpu.memory_bytes},
            "over": self.over,
            "config": self.config,
            "assumed": dict(self.assumed),
            "rows": [
                r.to_dict() | ({} if r.assumed == self.assumed else {"assumed": dict(r.assumed)})
                for r in self.rows
            ],
        }


def sweep(
    model: str | ModelSpec,
    base_training: TrainingConfig,
    gpu: str | GPUSpec | None,
    over: Mapping[str, Sequence[Any]],
    *,
    simulate_allocator: bool = False,
    cuda_context_bytes: int | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> Sweep:
    """Estimate every point of the grid ``over`` around ``base_training``.

    Args:
        model: preset name, HF ``config.json`` path, or a ModelSpec.
        base_training: the settings that are not swept.
        gpu: catalog name or GPUSpec for the verdicts, or None for no verdict.
        over: field (``micro_batch_size`` or ``micro-batch-size``) -> values; rows come in
            ``itertools.product`` order of the fields as given.
        simulate_allocator: replay every row through the allocator simulator (tens of ms a
            row) for reserved memory and fragmentation; default off (closed form).
        cuda_context_bytes: memory outside the allocator, bytes; default per GPU catalog.
        on_point: told each point's settings before it is estimated (the CLI's progress).

    A family the formulas do not model is estimated on the generic path, each point a traced
    step with the allocator replayed (``simulate_allocator`` has no effect there).

    Returns:
        One row per grid point (a sequence), with the model, GPU, grid, the first point's
        settings and what each point assumed.

    Raises:
        SpecError: unknown model, GPU or field, or a value a field does not accept (the message
            names the field).
    """
    try:
        spec: ModelSpec | None = resolve_model(model)
    except UnsupportedError:  # a family only the generic path runs: each point traced
        spec = None
    gpu_spec = resolve_gpu(gpu)
    names = [field_name(k) for k in over]
    if len(set(names)) != len(names):
        raise SpecError("over", "a field is given twice")
    if spec is not None and spec.architecture == "vision-encoder" and "seq_len" in names:
        raise SpecError(
            "seq_len",
            f"{spec.name} is a vision encoder: its sequence is its image's patches (Note "
            "[Vision encoders at another resolution]); sweep the image size instead, e.g. "
            "--over resolution=224,384",
        )
    grids = [list(v) for v in over.values()]
    for name, values in zip(names, grids, strict=True):
        if not values:
            raise SpecError(name, "no values to sweep")
    # many points of one structure (Note [Schedule templates]): fill their schedules from a
    # template rather than build each (the same answers)
    shapes = 1
    for name, values in zip(names, grids, strict=True):
        if name in ("micro_batch_size", "seq_len"):
            shapes *= len(values)
    lean = shapes >= TEMPLATED_FROM
    rows: list[SweepRow] = []
    first: MemoryEstimate | None = None  # the sweep's config and assumptions
    assumed: dict[object, Mapping[str, str]] = {}  # by the point's other swept values
    others = [i for i, n in enumerate(names) if n not in SHAPE_FIELDS]
    training, previous = base_training, None
    for point in product(*grids):
        settings = dict(zip(names, point, strict=True))
        # from the previous point, whose other fields are these (product order: mostly the
        # last field changes); the same configuration as derived from the base
        changed = (
            settings
            if previous is None
            else {n: v for n, v, p in zip(names, point, previous, strict=True) if v is not p}
        )
        training, previous = derived(training, **changed), point
        if spec is not None:  # a vision encoder's sequence follows a swept resolution
            training = vision_sequence(spec, training, given=False)
        if on_point is not None:
            on_point(settings)
        est = (
            estimate(
                spec,
                training,
                gpu=gpu_spec,
                cuda_context_bytes=cuda_context_bytes,
                simulate_allocator=simulate_allocator,
                lean=lean,
            )
            if spec is not None
            else estimate(
                cast(str, model), training, gpu=gpu_spec, cuda_context_bytes=cuda_context_bytes
            )
        )
        b = est.breakdown
        first = est if first is None else first
        key: object = point if training.sample_lengths else tuple(point[i] for i in others)
        try:
            said = assumed.get(key)
        except TypeError:  # a value that does not hash (a list given through the library)
            key = repr(key)
            said = assumed.get(key)
        if said is None:
            said = assumed[key] = assumed_of(est)
        rows.append(
            SweepRow(
                settings=settings,
                allocated_bytes=b.allocated_bytes,
                reserved_bytes=None if est.oom_message else b.reserved_bytes,
                device_total_bytes=None if est.oom_message else b.device_total_bytes,
                peak_phase=est.peak_phase,
                fits=est.fits,
                verdict=est.verdict,
                margin_bytes=est.margin_bytes,
                allocator_simulated=simulate_allocator or spec is None,
                assumed=said,
            )
        )
    assert first is not None  # every field has a value (checked above): one point at least
    return Sweep(
        model_name=first.model_name,
        engine=first.engine,
        gpu=gpu_spec,
        over=dict(zip(names, grids, strict=True)),
        config=dict(first.config),
        assumed=rows[0].assumed,
        rows=tuple(rows),
    )
