"""benchmarks/deepspeed_zero3_init_replay.py: DeepSpeed ZeRO-3's init allocations in
stage3.py v0.12.3's order, sizes derived by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from deepspeed_zero3_init_replay import init_ops  # noqa: E402


def test_init_ops_follow_stage3_order_per_sub_group() -> None:
    # partitions 6e8, 6e8, 3e8: _create_fp16_sub_groups closes a group at >= 1e9, so the
    # sub-groups are [1.2e9] and [3e8]; bf16 weights and gradients, a 4096-element bucket
    ops = init_ops([6 * 10**8, 6 * 10**8, 3 * 10**8], 4096)
    g0, g1, total = 12 * 10**8, 3 * 10**8, 15 * 10**8
    assert ops == [
        ("a", "flat16", 2 * total),  # defragment: one flat 16-bit block
        ("a", "clone", 2 * g0),  # _create_fp32_partitions: .clone() then .float()
        ("a", "fp32/0", 4 * g0),
        ("f", "clone", 0),
        ("a", "clone", 2 * g1),
        ("a", "fp32/1", 4 * g1),
        ("f", "clone", 0),
        ("a", "gradient_buffer", 4 * g0),  # initialize_optimizer_states: largest sub-group
        ("a", "exp_avg/0", 4 * g0),
        ("a", "exp_avg_sq/0", 4 * g0),
        ("a", "exp_avg/1", 4 * g1),
        ("a", "exp_avg_sq/1", 4 * g1),
        ("f", "gradient_buffer", 0),
        ("a", "ipg_bucket", 2 * 4096),
        ("a", "grad_partitions", 2 * total),
    ]
