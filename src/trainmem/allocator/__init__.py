"""CUDA caching allocator simulator, pure Python (no torch).

Replays a :class:`~trainmem.timeline.Timeline` the way PyTorch's ``backend:native`` CUDA caching
allocator (c10/cuda/CUDACachingAllocator.cpp) would serve it, and reports what ``torch.cuda``
would: ``max_memory_allocated``, ``max_memory_reserved``, ``memory_stats()``, out-of-memory errors
and memory snapshots. Spec: ../shared/specs/cuda-caching-allocator.md.

Modules: ``constants`` (kMinBlockSize...), ``config`` (PYTORCH_CUDA_ALLOC_CONF), ``stats``
(memory_stats keys), ``caching`` (CachingAllocatorSim), ``replay`` (replay_timeline), ``device``
(CUDA context, cuBLAS workspaces), ``snapshot`` (memory snapshot export/import).
"""

from trainmem.allocator.caching import CachingAllocatorSim, OutOfMemoryError, format_size
from trainmem.allocator.config import AllocatorConfig
from trainmem.allocator.device import (
    allocator_capacity_bytes,
    cublas_workspace_bytes_from_config,
    cuda_context_bytes,
    inject_cublas_workspaces,
)
from trainmem.allocator.replay import ReplayResult, replay_timeline
from trainmem.allocator.snapshot import (
    SnapshotError,
    read_snapshot,
    snapshot_stats,
    timeline_from_snapshot,
    write_snapshot,
)
from trainmem.allocator.stream_compare import compare_snapshot
from trainmem.errors import TimelineError

__all__ = [
    "AllocatorConfig",
    "CachingAllocatorSim",
    "OutOfMemoryError",
    "ReplayResult",
    "SnapshotError",
    "TimelineError",
    "allocator_capacity_bytes",
    "compare_snapshot",
    "cublas_workspace_bytes_from_config",
    "cuda_context_bytes",
    "format_size",
    "inject_cublas_workspaces",
    "read_snapshot",
    "replay_timeline",
    "snapshot_stats",
    "timeline_from_snapshot",
    "write_snapshot",
]
