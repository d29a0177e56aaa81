"""Fixtures shared by the analytic tests that run torch's own code on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def fake_group() -> Iterator[None]:
    """Rank 0 of a 2-rank ``"fake"`` process group (torch's testing store): collectives return
    at once, so FSDP runs its real hooks and allocations on the CPU."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
