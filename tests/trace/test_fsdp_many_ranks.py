"""FSDP2 over many ranks: the trace builds only the chunks FSDP reads, with the same views
torch's own ``_chunk_with_empty`` makes (torch/distributed/fsdp/_fully_shard/_fsdp_common.py),
so ``--data-parallel-size 100000`` traces in seconds instead of hanging (issue 17's fuzz list)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from trainmem.trace.fsdp import _LazyChunks


@pytest.mark.parametrize(
    ("rows", "cols", "n"), [(7, 3, 2), (64, 4, 8), (5, 2, 8), (1, 1, 3), (0, 4, 4), (100, 1, 7)]
)
def test_lazy_chunks_are_torchs_chunks(rows: int, cols: int, n: int) -> None:
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    expected = _chunk_with_empty(t, n, dim=0)
    lazy = _LazyChunks(t, n, 0)
    assert len(lazy) == len(expected) == n
    for i in (*range(n), -1):
        got, want = lazy[i], expected[i]
        assert got.shape == want.shape and got.dtype == want.dtype
        if want.numel():
            assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
    assert [c.shape for c in lazy[1:3]] == [c.shape for c in expected[1:3]]
    with pytest.raises(IndexError):
        lazy[n]


def test_fsdp_over_100000_ranks_traces(tmp_path: object) -> None:
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    t = TrainingConfig(micro_batch_size=1, seq_len=64, zero_stage=3, data_parallel_size=100_000)
    est = estimate("tiny-llama-test", t, engine="trace", simulate_allocator=False)
    # every parameter padded to one row per rank: the all-gathered layer is 100,000 rows wide
    # (FSDP2 pads dim 0 to a multiple of the world size), far more than the model itself
    assert est.breakdown.allocated_bytes > 100_000 * 4
