"""Cut Cross Entropy on a traced step (Note [Cut Cross Entropy on a traced step],
trainmem/trace/cut_loss.py): the stand-in's saved tensors and gradients, by hand from
axolotl-ai-cloud/ml-cross-entropy 5f0c7a7 cce.py ``LinearCrossEntropyFunction`` /
cce_backward.py ``cce_backward_kernel``, on real CPU tensors; and the two engines on a small
Qwen2 with the plugin (the engines' agreement bar, 2 %)."""

from __future__ import annotations

import pytest
import torch
from test_engines_agree_per_cell import wide_qwen2  # noqa: F401 - the fixture

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.trace.cut_loss import _CutCrossEntropy

pytest.importorskip("transformers")


def _saved_and_grads(c_requires_grad: bool) -> tuple[list[tuple[int, ...]], list[object]]:
    t, h, v = 6, 8, 10
    e = torch.randn(t, h, dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=c_requires_grad)
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = _CutCrossEntropy.apply(e, c)
    loss.backward()
    shapes = [(*x.shape, x.dtype) for x in saved]
    return shapes, [e.grad, c.grad]


def test_saves_the_hidden_states_lse_and_logit_avg_and_no_logits() -> None:
    # save_for_backward(e, c, bias, lse, targets, valids, logit_avg): e [t, h] bf16, c [V, h],
    # lse [t] fp32, logit_avg [V] fp32 (filter_eps "auto", a gradient wanted); nothing [t, V]
    shapes, (de, dc) = _saved_and_grads(c_requires_grad=False)
    assert shapes == [
        (6, 8, torch.bfloat16),
        (10, 8, torch.bfloat16),
        (6, torch.float32),
        (10, torch.float32),
    ]
    # de = zeros_like(e); dc only when c.requires_grad
    assert de is not None and de.shape == (6, 8) and de.dtype == torch.bfloat16
    assert dc is None
    _, (_, dc) = _saved_and_grads(c_requires_grad=True)
    assert dc is not None and dc.shape == (10, 8) and dc.dtype == torch.bfloat16


def test_the_engines_agree_with_the_plugin(wide_qwen2: str) -> None:  # noqa: F811
    training = TrainingConfig(
        framework="axolotl",
        micro_batch_size=2,
        seq_len=256,
        lora_rank=16,
        precision="bf16-true",
        cut_cross_entropy=True,
    )
    g = estimate(wide_qwen2, training, engine="generic", simulate_allocator=False)
    a = estimate(wide_qwen2, training, engine="analytic", simulate_allocator=False)
    assert abs(a.breakdown.allocated_bytes / g.breakdown.allocated_bytes - 1) < 0.02
    # and the plugin moved the trace: less at the peak than the model's own loss
    plain = estimate(
        wide_qwen2,
        TrainingConfig(
            framework="axolotl",
            micro_batch_size=2,
            seq_len=256,
            lora_rank=16,
            precision="bf16-true",
        ),
        engine="generic",
        simulate_allocator=False,
    )
    assert g.breakdown.allocated_bytes < plain.breakdown.allocated_bytes
