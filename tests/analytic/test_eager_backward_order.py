"""Eager attention's backward: the tensors saved by o_proj, the value matmul and dropout are
released before the softmax backward's transients (Note [Eager attention's backward order] in
trainmem/analytic/schedule.py).

Expected value: the trace engine's peak, which runs transformers' own ``eager_attention_forward``
under autograd (fake tensors) and records when autograd releases each saved tensor. Before this
order was modelled the analytic peak was one (b, a, s, s) 16-bit probability tensor over it
(8.4 MB here, +8.4 %).
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig


def test_eager_softmax_backward_peak_matches_the_trace() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    training = TrainingConfig(
        micro_batch_size=1, seq_len=1024, precision="bf16-mixed", attention="eager", dropout=False
    )
    analytic = estimate("tiny-llama-test", training, engine="analytic", simulate_allocator=False)
    traced = estimate("tiny-llama-test", training, engine="trace", simulate_allocator=False)
    # both peak at the last layer's softmax backward
    assert analytic.peak_phase == traced.peak_phase == "backward"
    assert "attention" in analytic.peak_reason and "softmax_backward" in traced.peak_reason
    probs = 2 * 4 * 1024 * 1024  # one (b, a, s, s) bf16 tensor: what the old order over-counted
    a, t = analytic.breakdown.allocated_bytes, traced.breakdown.allocated_bytes
    assert abs(a - t) <= 0.01 * t
    assert abs(a - t) < probs // 10
