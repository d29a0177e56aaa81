"""The two ways the planner evaluates one configuration, and the fit predicate they share.

* :func:`fast_estimate`: the analytic closed form alone (``simulate_allocator=False``, about
  0.3 ms on a 2-core Xeon, ``benchmarks/analytic_speed.py``). Fragmentation is 0, so its device
  total is a lower bound of the simulated one. Used inside searches, fix generation and sweeps.
* :func:`simulated_estimate`: the closed form plus a replay of the step through the CUDA
  caching-allocator simulator (tens of ms): reserved memory, fragmentation and an OOM verdict.
  Used for the final answer at a search boundary and for every fix that is reported.

All sizes are bytes (``int``).

Note [Fast bound, simulated answer]
    The simulated breakdown adds ``fragmentation >= 0`` to the same closed-form categories, so
    ``device_total(simulated) >= device_total(fast)`` for every configuration. Whatever does not
    fit by the fast estimate does not fit by the simulated one either; the planner therefore
    searches with the fast estimate and only re-checks the candidate answer (and, if needed,
    smaller values) with the simulator.
"""

from __future__ import annotations

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError
from trainmem.estimate import estimate, resolve_gpu, resolve_model
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def require_gpu(gpu: str | GPUSpec | None) -> GPUSpec:
    """The catalog GPU for a name or spec; the planner always needs one.

    Raises:
        SpecError: no GPU given, or an unknown name (the message lists the catalog).
    """
    spec = resolve_gpu(gpu)
    if spec is None:
        raise SpecError("gpu", "required for planning: name a GPU (see `trainmem gpus`)")
    return spec


def resolve(model: str | ModelSpec, gpu: str | GPUSpec | None) -> tuple[ModelSpec, GPUSpec]:
    """(model spec, GPU spec) from names or specs.

    Raises:
        SpecError: unknown model or GPU, or no GPU.
    """
    return resolve_model(model), require_gpu(gpu)


def fast_estimate(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    *,
    cuda_context_bytes: int | None = None,
) -> MemoryEstimate:
    """Closed-form estimate without the allocator replay (fragmentation 0), about 0.3 ms.

    Returns:
        The estimate; bytes throughout.
    """
    return estimate(
        model, training, gpu=gpu, cuda_context_bytes=cuda_context_bytes, simulate_allocator=False
    )


def simulated_estimate(
    model: ModelSpec,
    training: TrainingConfig,
    gpu: GPUSpec,
    *,
    cuda_context_bytes: int | None = None,
) -> MemoryEstimate:
    """Closed form plus the caching-allocator replay (fragmentation, OOM verdict), tens of ms.

    Returns:
        The estimate; bytes throughout.
    """
    return estimate(
        model, training, gpu=gpu, cuda_context_bytes=cuda_context_bytes, simulate_allocator=True
    )


def fits(est: MemoryEstimate) -> bool:
    """The estimate's own verdict (:attr:`MemoryEstimate.fits`): no out-of-memory in the
    simulated allocator when it ran, else the device total within the usable capacity."""
    return bool(est.fits)


def margin_bytes(est: MemoryEstimate) -> int:
    """Usable capacity minus the predicted device total, bytes (negative: does not fit).

    Raises:
        SpecError: the estimate has no GPU.
    """
    if est.gpu_capacity_bytes is None:
        raise SpecError("gpu", "the estimate has no GPU to compute a margin against")
    return est.gpu_capacity_bytes - est.breakdown.device_total_bytes
