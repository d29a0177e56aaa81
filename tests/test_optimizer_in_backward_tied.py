"""Note [Optimizer in backward on a traced step] (trainmem/traced_options.py), a tied weight:
its post-accumulate-grad hook (where torchtune steps and frees it) fires once, after the
lookup's backward, not at the head's. Checked on a real CPU execution of torch's autograd, then
on the traced-step rewrite with hand-made sizes."""

from __future__ import annotations

import pytest

from trainmem.analytic.transforms.base import alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import StepSchedule
from trainmem.specs.training import TrainingConfig
from trainmem.traced_options import apply_offload


def test_tied_weight_hook_fires_once_after_the_lookup() -> None:
    torch = pytest.importorskip("torch")
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied, as transformers' tie_weights does
    events: list[str] = []
    embedding.weight.register_post_accumulate_grad_hook(lambda p: events.append("hook"))
    x = embedding(torch.tensor([[1, 2, 3]]))
    x.register_hook(lambda g: events.append("lookup's backward next"))
    logits = head(torch.relu(x))
    logits.register_hook(lambda g: events.append("head's backward next"))
    logits.sum().backward()
    assert events == ["head's backward next", "lookup's backward next", "hook"]


def test_rewrite_steps_a_tied_gradient_after_the_lookup() -> None:
    training = TrainingConfig(micro_batch_size=1, seq_len=8, optimizer_in_backward=True)
    n = 1000  # elements of the tied weight; fp32 (the default weight dtype): 4,000 B
    param = alloc(4 * n, Cat.PARAMETER, "init", "p", "embed.weight", "")
    norm = alloc(16, Cat.PARAMETER, "init", "w", "norm.weight", "")
    head_grad = alloc(4 * n, Cat.GRADIENT, "backward", "g", "lm_head", "")  # owns no parameter
    norm_grad = alloc(16, Cat.GRADIENT, "backward", "gn", "norm", "")
    lookup = alloc(4 * n, Cat.TEMPORARY, "backward", "d", "embed", "")
    step = (
        head_grad,
        norm_grad,
        lookup,
        free(lookup, "backward"),
        free(norm_grad, "optimizer"),
        free(head_grad, "optimizer"),
    )
    out = apply_offload(StepSchedule(setup=(param, norm), step=step), None, training)
    keys = [(op.action, op.key) for op in out.step]
    # the untied norm's gradient is stepped and freed at once; the tied one after the lookup
    assert keys.index(("free", "gn")) < keys.index(("alloc", "d"))
    assert keys.index(("free", "g")) > keys.index(("free", "d"))
