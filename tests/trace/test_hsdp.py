"""HSDP and ``reshard_after_forward=False`` traced under FSDP2 (issue 14: "FSDP2 on a
multi-dimensional mesh ... HSDP, with reshard_after_forward as the framework sets it").

What an HSDP rank holds, from torch's source (torch 2.13, torch/distributed/fsdp/_fully_shard):
on a 2-D ``(replicate, shard)`` mesh ``fully_shard`` shards each parameter over the shard
dimension only (``_fsdp_param.py``: ``shard_mesh_info``) and all-gathers within it, so a rank of
``data_parallel_size=4, shard_group_size=2`` holds the shards, gathers and reduce-scatter
buffers of a rank of plain FSDP over 2 ranks; the reduce-scattered gradient is all-reduced
across the replicas in place (``_fsdp_collectives.py`` ``foreach_reduce``:
``dist.all_reduce(reduce_output, group=all_reduce_group)``), no buffer more. So its peak equals
FSDP 2's and exceeds FSDP 4's (whose shards are half as large).
"""

from __future__ import annotations

from typing import Any

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig


def _peak(engine: str = "trace", **kw: Any) -> tuple[int, dict[str, Any]]:
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, dropout=False, framework="fsdp2", zero_stage=3, **kw
    )
    est = estimate("tiny-llama-test", training, engine=engine, simulate_allocator=False)
    return est.breakdown.allocated_bytes, est.details.get("traced_mesh") or {}


def test_an_hsdp_rank_holds_what_a_rank_of_its_shard_group_holds() -> None:
    hsdp, mesh = _peak(data_parallel_size=4, shard_group_size=2)
    assert mesh == {"dp_replicate": 2, "dp_shard": 2}
    fsdp2, _ = _peak(data_parallel_size=2)
    fsdp4, _ = _peak(data_parallel_size=4)
    assert hsdp == fsdp2 > fsdp4
    # the analytic engine's rule (sharding_degree = the shard group), to its small-tensor slack
    assert _peak("analytic", data_parallel_size=4, shard_group_size=2)[0] == pytest.approx(
        hsdp, rel=1e-4
    )


def test_reshard_after_forward_false_keeps_the_layers_gathered() -> None:
    """Without resharding, every layer's gathered bf16 weights stay from its forward to its
    backward: the peak rises, in the trace and in the analytic engine alike."""
    kept, _ = _peak(data_parallel_size=2, reshard_after_forward=False)
    resharded, _ = _peak(data_parallel_size=2)
    assert kept > resharded
    analytic = _peak("analytic", data_parallel_size=2, reshard_after_forward=False)[0]
    assert analytic == pytest.approx(kept, rel=1e-4)


def test_hsdp_shapes_the_trace_cannot_build_are_refused() -> None:
    with pytest.raises(UnsupportedError, match="shard_group_size=3 not dividing"):
        _peak(data_parallel_size=4, shard_group_size=3)


def test_hsdp_beside_context_parallelism_shards_over_its_group_of_dp_x_cp_ranks() -> None:
    # torchtitan's mesh (parallel_dims.py): dp_replicate x dp_shard x cp, FSDP2 over the
    # flattened dp_shard x cp ("dp_shard_cp") and HSDP's 2-D (dp_replicate, dp_shard_cp): a
    # shard group of 4 over 4 data x 2 context ranks is 2 replicas of (dp_shard 2 x cp 2);
    # of 2 it is 4 replicas of the 2 context ranks alone. Its rank holds the shards of a
    # 4- (2-) way FSDP rank with CP 2 (data_parallel_size 2 (1) x cp 2), as the formulas'
    # sharding_degree has it
    four, mesh = _peak(data_parallel_size=4, context_parallel_size=2, shard_group_size=4)
    assert mesh == {"dp_replicate": 2, "dp_shard": 2, "cp": 2}
    assert four == _peak(data_parallel_size=2, context_parallel_size=2)[0]
    two, mesh = _peak(data_parallel_size=4, context_parallel_size=2, shard_group_size=2)
    assert mesh == {"dp_replicate": 4, "cp": 2}
    assert two > four
    for group, traced in ((4, four), (2, two)):
        analytic = _peak(
            "analytic", data_parallel_size=4, context_parallel_size=2, shard_group_size=group
        )[0]
        assert analytic == pytest.approx(traced, rel=0.01)
    with pytest.raises(UnsupportedError, match="shard_group_size=3 with context_parallel_size"):
        _peak(data_parallel_size=4, context_parallel_size=2, shard_group_size=3)
