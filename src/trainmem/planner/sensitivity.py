"""Whether the answer depends on the framework the user did not name: the same run under the
other common frameworks' conventions, closed form (no allocator replay).

A plain PyTorch FSDP run without ``MixedPrecision`` gathers fp32 weights where accelerate's
FSDP gathers bf16, DeepSpeed keeps 2 + 2 + 12 bytes per parameter where PyTorch AMP keeps
4 + 4 + 8: the same flags can differ by half. When another framework moves the peak by more
than :data:`THRESHOLD`, the estimate says so in one line.
"""

from __future__ import annotations

from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig, derived
from trainmem.units import gib_text

SINGLE_GPU_FRAMEWORKS: tuple[str, ...] = ("pytorch-amp", "hf-trainer", "torchtune", "litgpt")
"""The frameworks a run on one GPU (or unsharded data parallelism) is compared under."""
SHARDED_FRAMEWORKS: tuple[str, ...] = ("accelerate-fsdp", "deepspeed", "fsdp2")
"""Added for a sharded run (ZeRO / FSDP over several GPUs), where their conventions differ
most. Megatron and fsdp_qlora bring their own model code or quantized layers: not the same
run."""


def common_frameworks(training: TrainingConfig) -> tuple[str, ...]:
    """The frameworks that would run these settings as the same run."""
    sharded = training.data_parallel_size > 1 and training.zero_stage > 0
    return SINGLE_GPU_FRAMEWORKS + (SHARDED_FRAMEWORKS if sharded else ())


THRESHOLD = 0.10
"""Relative change of peak allocated bytes above which the framework is said to matter."""


def framework_sensitivity(
    model: ModelSpec, training: TrainingConfig, gpu: GPUSpec | None
) -> list[dict[str, Any]]:
    """The same settings under each other common framework whose peak allocated bytes differ
    by more than :data:`THRESHOLD` from ``training.framework``'s.

    Returns:
        ``[{"framework", "allocated_bytes", "change"}]`` (``change`` relative, signed), largest
        change first; frameworks that refuse the settings are left out.
    """

    def allocated(t: TrainingConfig) -> int:
        est = estimate(model, t, gpu=gpu, engine="analytic", simulate_allocator=False)
        return est.breakdown.allocated_bytes

    base = allocated(training)
    rows: list[dict[str, Any]] = []
    for framework in common_frameworks(training):
        if framework == training.framework:
            continue
        try:
            other = allocated(derived(training, framework=framework))
        except (SpecError, UnsupportedError):
            continue
        change = (other - base) / base
        if abs(change) > THRESHOLD:
            rows.append({"framework": framework, "allocated_bytes": other, "change": change})
    rows.sort(key=lambda r: -abs(float(r["change"])))
    return rows


def framework_note(model: ModelSpec, training: TrainingConfig, gpu: GPUSpec | None) -> str:
    """One line when the framework matters (:func:`framework_sensitivity`), else ""."""
    rows = framework_sensitivity(model, training, gpu)
    if not rows:
        return ""
    shown = ", ".join(
        f"--framework {r['framework']} {gib_text(r['allocated_bytes'])} GiB "
        f"({100 * r['change']:+.0f}%)"
        for r in rows[:3]
    )
    return (
        f"the framework matters here: this is --framework {training.framework}'s peak "
        f"allocated; under {shown}. Pass the --framework you train with"
    )
