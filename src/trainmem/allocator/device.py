"""Memory next to the caching allocator: the CUDA context and the cuBLAS workspaces.

Two kinds of memory sit beside what a trace of tensor storages contains (spec section 5.3):

- The **CUDA context** (driver state, lazily loaded kernels, library handles) is *outside* the
  caching allocator: it is never in ``memory_reserved()`` but it is in ``nvidia-smi`` and it
  shrinks what ``cudaMalloc`` can get. :func:`allocator_capacity_bytes` subtracts it from the
  GPU's ``total_memory`` to give the ``capacity_bytes`` of a replay.
- The **cuBLAS workspace** goes *through* the caching allocator, one persistent allocation per
  (cuBLAS handle, stream), made at the first matmul of each thread. A FakeTensor trace does not
  see it, so :func:`inject_cublas_workspaces` adds it to a timeline.

The figures live in :mod:`trainmem.specs.hardware` (``DEFAULT_CUDA_CONTEXT_BYTES``,
``LEGACY_CUDA_CONTEXT_BYTES``, ``GPUSpec.cublas_workspace_bytes``); this module only applies them.

Note [cuBLAS workspaces in a training step]
    ``at::cuda::getCurrentCUDABlasHandle`` allocates the workspace through the caching allocator
    the first time a handle is used on a stream and keeps it until
    ``torch._C._cuda_clearCublasWorkspaces()``. The forward runs on the Python thread, the
    backward on the autograd engine's device thread, which has its own handle: a training step
    holds two workspaces (spec section 5.3). Each is allocated just before the output of the first
    matmul of its thread, i.e. at the start of the forward and of the backward for a transformer
    whose first op with an output is a matmul/embedding lookup. Without op names in the timeline,
    the workspace is placed before the first event of each phase.

Source: aten/src/ATen/cuda/CublasHandlePool.cpp (``getChosenWorkspaceSize``,
``getCUDABlasLtWorkspace``/``getCurrentCUDABlasHandle``); ../shared/specs/cuda-caching-allocator.md
section 5.3.

Known limitations:
    - no per-GPU-family context figure has been measured yet: every current GPU gets
      ``DEFAULT_CUDA_CONTEXT_BYTES``, pre-lazy-loading stacks ``LEGACY_CUDA_CONTEXT_BYTES``;
    - cuBLASLt and cuDNN workspaces are not injected (per-call or algorithm-dependent sizes);
    - NCCL buffers are not modelled (pass them as ``other_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.breakdown import MemoryCategory
from trainmem.errors import SpecError
from trainmem.specs.hardware import (
    DEFAULT_CUDA_CONTEXT_BYTES,
    LEGACY_CUDA_CONTEXT_BYTES,
    GPUSpec,
)
from trainmem.timeline import AllocEvent, Phase, Timeline

#: ``module`` of injected workspace events, so reports can name them.
CUBLAS_WORKSPACE_MODULE = "<cublas workspace>"

#: cuBLAS workspace size per handle when ``CUBLAS_WORKSPACE_CONFIG`` is unset on a pre-Hopper GPU:
#: ``:4096:2:16:8`` = 2 x 4096 KiB + 8 x 16 KiB (CublasHandlePool.cpp, PyTorch >= 2.0).
DEFAULT_CUBLAS_WORKSPACE_CONFIG = ":4096:2:16:8"


def cuda_context_bytes(gpu: GPUSpec | None = None, *, lazy_module_loading: bool = True) -> int:
    """Memory a PyTorch process holds outside the caching allocator after a training step.

    Args:
        gpu: the GPU; currently every GPU family gets the same figure (see Known limitations).
        lazy_module_loading: ``CUDA_MODULE_LOADING=LAZY``, PyTorch's default since 1.13 with
            CUDA >= 11.7; False selects the eager-loading measurement of the torch 1.10 era.

    Returns:
        Bytes: ``DEFAULT_CUDA_CONTEXT_BYTES`` (500 MiB) with lazy loading, else
        ``LEGACY_CUDA_CONTEXT_BYTES`` (1343 MiB). See Note [CUDA context] in
        :mod:`trainmem.specs.hardware` for the measurements.
    """
    del gpu  # NB: no per-family measurement yet; kept so callers need not change later
    return DEFAULT_CUDA_CONTEXT_BYTES if lazy_module_loading else LEGACY_CUDA_CONTEXT_BYTES


def allocator_capacity_bytes(
    gpu: GPUSpec, *, context_bytes: int | None = None, other_bytes: int = 0
) -> int:
    """Bytes the caching allocator can obtain from ``cudaMalloc`` on ``gpu``.

    Args:
        gpu: the GPU; its ``memory_bytes`` is ``total_memory``.
        context_bytes: CUDA context; None uses :func:`cuda_context_bytes`.
        other_bytes: any other memory outside PyTorch (NCCL buffers, other processes).

    Returns:
        ``gpu.memory_bytes - context_bytes - other_bytes`` (bytes), the ``capacity_bytes`` of
        :func:`trainmem.allocator.replay.replay_timeline` (spec section 3.1).

    Raises:
        SpecError: a negative size, or nothing left for the allocator.
    """
    context = cuda_context_bytes(gpu) if context_bytes is None else context_bytes
    if context < 0 or other_bytes < 0:
        raise SpecError("cuda_context_bytes", "must be >= 0")
    capacity = gpu.memory_bytes - context - other_bytes
    if capacity <= 0:
        raise SpecError(
            "cuda_context_bytes",
            f"context {context} B + other {other_bytes} B leave nothing of {gpu.name}'s "
            f"{gpu.memory_bytes} B",
        )
    return capacity


def cublas_workspace_bytes_from_config(cublas_workspace_config: str) -> int:
    """Workspace bytes per handle for a ``CUBLAS_WORKSPACE_CONFIG`` value.

    Args:
        cublas_workspace_config: ``":SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]"``, e.g. ``":4096:8"``;
            ``":0:0"`` disables the workspace.

    Returns:
        ``sum(SIZE_KiB * 1024 * COUNT)`` in bytes; 8,519,680 for ``":4096:2:16:8"``.

    Raises:
        SpecError: not of that form.

    Source: CublasHandlePool.cpp ``parseChosenWorkspaceSize``; spec section 5.3.
    """
    parts = cublas_workspace_config.split(":")
    fields = parts[1:]
    if parts[0] != "" or not fields or len(fields) % 2:
        raise SpecError(
            "CUBLAS_WORKSPACE_CONFIG",
            f"expected ':SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]', got {cublas_workspace_config!r}",
        )
    try:
        numbers = [int(x) for x in fields]
    except ValueError:
        raise SpecError(
            "CUBLAS_WORKSPACE_CONFIG",
            f"sizes and counts must be integers: {cublas_workspace_config!r}",
        ) from None
    return sum(numbers[i] * 1024 * numbers[i + 1] for i in range(0, len(numbers), 2))


def inject_cublas_workspaces(
    timeline: Timeline,
    workspace_bytes: int,
    *,
    phases: Sequence[Phase] = ("forward", "backward"),
    stream: int = 0,
) -> Timeline:
    """A copy of ``timeline`` with one persistent cuBLAS workspace allocation per thread.

    See Note [cuBLAS workspaces in a training step]: one allocation of ``workspace_bytes`` is
    inserted before the first event of each phase in ``phases`` (a phase with no events gets
    none), and never freed.

    Args:
        timeline: the trace or analytic timeline.
        workspace_bytes: per handle, usually ``GPUSpec.cublas_workspace_bytes`` or
            :func:`cublas_workspace_bytes_from_config`; 0 returns an unchanged copy.
        phases: phases whose first event gets a workspace before it.
        stream: stream of the workspaces.

    Returns:
        A new timeline; the inserted events have ``category=TEMPORARY``,
        ``module=CUBLAS_WORKSPACE_MODULE`` and ``block_id`` values above every existing id.

    Raises:
        SpecError: a negative ``workspace_bytes``.
    """
    if workspace_bytes < 0:
        raise SpecError("cublas_workspace_bytes", f"must be >= 0, got {workspace_bytes}")
    events = timeline.events
    if workspace_bytes == 0:
        return Timeline(events=list(events), name=timeline.name)
    next_id = max((e.block_id for e in events), default=0) + 1
    first_index: dict[int, Phase] = {}
    for phase in phases:
        index = next((i for i, e in enumerate(events) if e.phase == phase), None)
        if index is not None and index not in first_index:
            first_index[index] = phase
    out: list[AllocEvent] = []
    for i, ev in enumerate(events):
        if i in first_index:
            out.append(
                AllocEvent(
                    "alloc",
                    next_id,
                    workspace_bytes,
                    MemoryCategory.TEMPORARY,
                    first_index[i],
                    CUBLAS_WORKSPACE_MODULE,
                    stream,
                )
            )
            next_id += 1
        out.append(ev)
    return Timeline(events=out, name=timeline.name)
