"""Results shared by every engine: memory categories, the peak breakdown, the estimate.

Categories align with PyTorch's ``torch.distributed._tools.mem_tracker._MemRefType`` (PARAM, BUFFER,
GRAD, ACT, TEMP, OPT) plus what only a device sees (fragmentation, CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

SCHEMA_VERSION = 4
"""Version of the JSON produced by :meth:`MemoryEstimate.to_dict`; bump on any key change."""


class MemoryCategory(str, Enum):
    """What a block of GPU memory holds."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer_states"
    ACTIVATION = "activations"
    TEMPORARY = "temporary"
    INPUT = "inputs"
    FRAGMENTATION = "fragmentation"
    CUDA_CONTEXT = "cuda_context"


#: Keys of ``breakdown_bytes`` in the JSON, in display order. Buffers and inputs are folded into
#: parameters and activations respectively for the top-level breakdown (they stay separate in the
#: trace engine's detailed table).
BREAKDOWN_KEYS: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "temporary",
    "fragmentation",
    "cuda_context",
)


_FOLD: dict[MemoryCategory, str] = {
    MemoryCategory.PARAMETER: "parameters",
    MemoryCategory.BUFFER: "parameters",
    MemoryCategory.GRADIENT: "gradients",
    MemoryCategory.OPTIMIZER_STATE: "optimizer_states",
    MemoryCategory.ACTIVATION: "activations",
    MemoryCategory.INPUT: "activations",
    MemoryCategory.TEMPORARY: "temporary",
}


def fold_category(category: MemoryCategory) -> str:
    """The :data:`BREAKDOWN_KEYS` entry a timeline category is counted under (buffers as
    parameters, inputs as activations, anything else as temporary)."""
    return _FOLD.get(category, "temporary")


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per category at the moment of the peak of one training step (one GPU).

    ``parameters + gradients + optimizer_states + activations + temporary`` is the predicted
    ``torch.cuda.max_memory_allocated``; ``+ fragmentation`` is ``max_memory_reserved``;
    ``+ cuda_context`` is what nvidia-smi shows.
    """

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    temporary: int
    fragmentation: int = 0
    cuda_context: int = 0

    @property
    def allocated_bytes(self) -> int:
        """Sum of tensor categories: predicted ``max_memory_allocated``."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.temporary
        )

    @property
    def reserved_bytes(self) -> int:
        """Allocated plus fragmentation: predicted ``max_memory_reserved``."""
        return self.allocated_bytes + self.fragmentation

    @property
    def device_total_bytes(self) -> int:
        """Reserved plus CUDA context: what nvidia-smi shows."""
        return self.reserved_bytes + self.cuda_context

    def as_dict(self) -> dict[str, int]:
        """Category -> bytes, keys :data:`BREAKDOWN_KEYS`."""
        return {k: int(getattr(self, k)) for k in BREAKDOWN_KEYS}


@dataclass(slots=True)
class MemoryEstimate:
    """The answer of any engine for one model + training config (+ optional GPU).

    Attributes:
        model_name: preset name or config path.
        engine: ``"analytic"`` or ``"trace"``.
        num_parameters: all parameters (trainable and frozen).
        num_trainable_parameters: parameters that get gradients and optimizer states.
        breakdown: bytes per category at the peak.
        peak_phase: ``forward``, ``backward`` or ``optimizer``: where the peak falls.
        peak_reason: one sentence on why the peak falls there.
        config: every resolved training setting (JSON-able).
        gpu_name / gpu_capacity_bytes: the GPU the verdict is for, or None.
        details: engine-specific extras (per-component bytes, per-module tables...).
        timeline: the replayed allocation stream of the reported rank (the expansion of its
            step schedule).
        notes: sentences for the user.
        schedules: the step schedule of every rank whose memory differs (both engines).
        rank_labels: what identifies each of those ranks (pipeline stage, layers...).
        oom_message: PyTorch's out-of-memory message when the simulated caching allocator
            (free cache and retry included) cannot serve the step on the GPU; None otherwise.
        replayed: whether the allocator simulator ran (else reserved = allocated).
        verdict: ``"fits"``, ``"tight"`` (fits, but the uncertainty band's high end of the
            device total crosses the capacity) or ``"does not fit"``; None without a GPU. Set
            by the driver (``trainmem.uncertainty.verdict_of``).
    """

    model_name: str
    engine: str
    num_parameters: int
    num_trainable_parameters: int
    breakdown: MemoryBreakdown
    peak_phase: str
    peak_reason: str
    config: dict[str, Any]
    gpu_name: str | None = None
    gpu_capacity_bytes: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    recorded_timeline: Any = None
    notes: list[str] = field(default_factory=list)
    schedules: list[Any] = field(default_factory=list)
    rank_labels: list[dict[str, Any]] = field(default_factory=list)
    oom_message: str | None = None
    replayed: bool = False
    reported_rank: int = 0
    verdict: str | None = None

    @property
    def model_states_bytes(self) -> dict[str, int]:
        """Persistent bytes of the reported rank (``StepSchedule.model_states``): parameters and
        optimizer states held when the step starts, the most gradient bytes held during it."""
        if not self.schedules:
            return {}
        states: dict[str, int] = self.schedules[self.reported_rank].model_states()
        return states

    @property
    def timeline(self) -> Any:
        """The replayed events of the reported rank: the trace engine's recording, or the
        expansion of the analytic schedule (built on first use; None without the replay)."""
        if self.recorded_timeline is None and self.replayed and self.schedules:
            self.recorded_timeline = self.schedules[self.reported_rank].expand()
        return self.recorded_timeline

    @timeline.setter
    def timeline(self, value: Any) -> None:
        self.recorded_timeline = value
        self.replayed = self.replayed and value is not None

    @property
    def fits(self) -> bool | None:
        """Whether the run (loading the model, then the step) fits on the GPU: no out-of-memory
        in the simulated caching allocator (which frees its cache and retries before it fails)
        with the CUDA context outside it; without the simulation, the device total within the
        GPU's usable capacity and the load phase's peak (``details["load_phase"]``) + the CUDA
        context too. None without a GPU."""
        if self.gpu_capacity_bytes is None:
            return None
        if self.oom_message is not None:
            return False
        load = self.details.get("load_phase") or {}
        loading = int(load.get("peak_allocated_bytes", 0)) + self.breakdown.cuda_context
        if load and loading > self.gpu_capacity_bytes:
            return False
        return self.breakdown.device_total_bytes <= self.gpu_capacity_bytes

    @property
    def margin_bytes(self) -> int | None:
        """Usable capacity minus the device total, bytes (negative: short by that much); None
        without a GPU, and None when the simulated allocator runs out of memory (a step that
        cannot run has no device total)."""
        if self.gpu_capacity_bytes is None or self.oom_message is not None:
            return None
        return self.gpu_capacity_bytes - self.breakdown.device_total_bytes

    def peak_dict(self) -> dict[str, Any]:
        """The peak as every JSON report gives it (``estimate``, ``plan``, ``fit``), bytes: no
        reserved or device total when the simulated allocator runs out of memory (``oom``, its
        message), as the tables print ``OOM``."""
        b = self.breakdown
        return {
            "allocated_bytes": b.allocated_bytes,
            "reserved_bytes": None if self.oom_message else b.reserved_bytes,
            "device_total_bytes": None if self.oom_message else b.device_total_bytes,
            "phase": self.peak_phase,
            "reason": self.peak_reason,
            "oom": self.oom_message,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (schema :data:`SCHEMA_VERSION`); all sizes integers in bytes."""
        b = self.breakdown
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model_name,
            "engine": self.engine,
            "num_parameters": self.num_parameters,
            "num_trainable_parameters": self.num_trainable_parameters,
            "breakdown_bytes": b.as_dict(),
            "model_states_bytes": dict(self.model_states_bytes),
            "peak": self.peak_dict(),
            "fits": self.fits,
            "verdict": self.verdict,
            "margin_bytes": self.margin_bytes,
            "gpu": {"name": self.gpu_name, "capacity_bytes": self.gpu_capacity_bytes},
            "config": dict(self.config),
            "per_rank": self.details.get("per_rank", []),
            "rank_map": self.details.get("rank_map"),
            "details": self.details,
            "notes": list(self.notes),
        }
