"""Note [FSDP1 flat blocks of a layer unit] (trainmem/analytic/transforms/base.py): under FSDP1
with ``use_orig_params=False`` a layer unit's sharded parameters, its sharded gradient and each
Adam state are one tensor each, this rank's chunk of the flat parameter padded to a multiple of
the world size (torch distributed/fsdp/_flat_param.py ``FlatParamHandle.shard``,
``_get_unpadded_shard``; torch/optim/adamw.py ``_init_group``: ``exp_avg`` / ``exp_avg_sq`` per
parameter the optimizer sees)."""

from __future__ import annotations

from typing import Any

from trainmem.analytic.transforms.base import _flat_bytes
from trainmem.estimate import estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.training import TrainingConfig

# Llama-2-7B, bf16: q, k, v, o 4096 x 4096; gate, up, down 4096 x 11008; two norms of 4096
LAYER = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)


def _layer_blocks(framework: str) -> dict[str, list[int]]:
    """Sizes of one layer's parameter, gradient and optimizer-state allocations (first layer
    body met per kind) in the measured step of a 4-rank bf16-true full fine-tune."""
    training = TrainingConfig(
        framework=framework,
        zero_stage=3,
        data_parallel_size=4,
        precision="bf16-true",
        seq_len=512,
        micro_batch_size=1,
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    out: dict[str, list[int]] = {"param": [], "grad": [], "state": []}
    seen: set[str] = set()

    def walk(items: Any) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body)
            elif isinstance(x, Op) and x.action == "alloc" and x.module == "layers.{i}":
                kind = x.key.split("/")[0]
                if kind in out and x.key not in seen:
                    seen.add(x.key)
                    out[kind].append(x.size_bytes)

    walk(sched.setup)
    walk(sched.step)
    return out


def test_accelerate_fsdp1_keeps_one_block_per_unit_and_state() -> None:
    blocks = _layer_blocks("accelerate-fsdp")
    # 6,738,415,616 B per layer unsharded; a quarter each, bf16 states (bf16-true: zeros_like)
    assert blocks["param"] == [LAYER // 4]
    assert blocks["grad"] == [LAYER // 4]
    assert blocks["state"] == [LAYER // 4, LAYER // 4]  # exp_avg, exp_avg_sq


def test_fsdp2_keeps_one_block_per_tensor() -> None:
    blocks = _layer_blocks("fsdp2")  # each parameter a DTensor shard of its own
    assert len(blocks["param"]) == len(blocks["grad"]) == len(blocks["state"]) == 9
    assert sum(blocks["state"]) == 2 * LAYER // 4


def test_flat_shard_pads_the_sum_not_each_tensor() -> None:
    # 5 + 6 elements of 2 B over 4 ranks: per tensor ceil(5/4) + ceil(6/4) = 4 elements (8 B);
    # one flat parameter of 11 padded to 12, a shard of 3 elements (6 B)
    assert _flat_bytes([4, 4], [5, 6], 4) == 6
    # an unsharded field (2 B per element, not per shard element) stays the sum
    assert _flat_bytes([10, 12], [5, 6], 4) == 22
