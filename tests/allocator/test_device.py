"""CUDA context, allocator capacity and cuBLAS workspace injection (spec section 5.3)."""

from __future__ import annotations

import pytest

from trainmem.allocator.device import (
    CUBLAS_WORKSPACE_MODULE,
    allocator_capacity_bytes,
    cublas_workspace_bytes_from_config,
    cuda_context_bytes,
    inject_cublas_workspaces,
)
from trainmem.allocator.replay import replay_timeline
from trainmem.breakdown import MemoryCategory
from trainmem.errors import SpecError
from trainmem.specs.hardware import GPUS
from trainmem.timeline import AllocEvent, Timeline

MiB = 1_048_576
A = MemoryCategory.ACTIVATION


def test_context_figures_come_from_the_hardware_module() -> None:
    assert cuda_context_bytes(GPUS["A100-80GB"]) == 500 * MiB
    assert cuda_context_bytes(lazy_module_loading=False) == 1343 * MiB


def test_capacity_subtracts_context_and_other_memory() -> None:
    gpu = GPUS["A100-40GB"]
    assert allocator_capacity_bytes(gpu) == gpu.memory_bytes - 500 * MiB
    assert allocator_capacity_bytes(gpu, context_bytes=0, other_bytes=MiB) == gpu.memory_bytes - MiB
    with pytest.raises(SpecError):
        allocator_capacity_bytes(gpu, context_bytes=gpu.memory_bytes)


@pytest.mark.parametrize(
    ("config", "expected"),
    [(":4096:2:16:8", 8_519_680), (":4096:8", 33_554_432), (":0:0", 0)],
)
def test_cublas_workspace_config(config: str, expected: int) -> None:
    assert cublas_workspace_bytes_from_config(config) == expected


@pytest.mark.parametrize("config", ["4096:8", ":4096", ":a:b", ""])
def test_cublas_workspace_config_rejects(config: str) -> None:
    with pytest.raises(SpecError):
        cublas_workspace_bytes_from_config(config)


def timeline() -> Timeline:
    return Timeline(
        events=[
            AllocEvent("alloc", 1, 4 * MiB, A, "forward"),
            AllocEvent("alloc", 2, 4 * MiB, A, "forward"),
            AllocEvent("free", 2, 4 * MiB, A, "backward"),
            AllocEvent("free", 1, 4 * MiB, A, "backward"),
        ]
    )


def test_one_workspace_before_the_first_forward_and_backward_event() -> None:
    out = inject_cublas_workspaces(timeline(), 8_519_680)
    assert [(e.action, e.block_id, e.phase) for e in out.events] == [
        ("alloc", 3, "forward"),
        ("alloc", 1, "forward"),
        ("alloc", 2, "forward"),
        ("alloc", 4, "backward"),
        ("free", 2, "backward"),
        ("free", 1, "backward"),
    ]
    assert out.events[0].module == CUBLAS_WORKSPACE_MODULE
    assert len(timeline().events) == 4  # input untouched
    assert inject_cublas_workspaces(timeline(), 0).events == timeline().events


def test_workspaces_in_the_replay() -> None:
    # 8,519,680 B rounds to 8,519,680 (a multiple of 512); it is a 1-10 MiB request, so the first
    # one opens a 20 MiB segment and splits it (20 MiB - 8.125 MiB > 1 MiB left). The two 4 MiB
    # activations fit in the 11.875 MiB remainder; the second workspace (backward) needs 8.125 MiB
    # but only 3.875 MiB is left, so it opens a second 20 MiB segment.
    r = replay_timeline(inject_cublas_workspaces(timeline(), 8_519_680), capacity_bytes=None)
    assert r.max_memory_reserved == 40 * MiB
    assert r.max_memory_allocated == 2 * 8_519_680 + 8 * MiB
    assert r.memory_stats["allocated_bytes.all.current"] == 2 * 8_519_680
