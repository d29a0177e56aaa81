"""Optimizer in backward, one gradient at a time (analytic/transforms/optimizer.py
``Optimizer.gradients``): torchtune's ``register_optim_in_bwd_hooks`` steps each parameter and
sets its gradient to None in the hook torch runs once that gradient is accumulated
(``register_post_accumulate_grad_hook``), so no two gradients are ever alive together.

Hand derivation on tests/models/formula/qwen2.json (h = 64, i = 128, vocab 512, untied; fp32
weights and gradients under bf16 autocast): the largest gradients are the embedding's and the
LM head's, 512 x 64 x 4 = 131,072 B; a layer's largest is gate / up / down, 64 x 128 x 4 =
32,768 B, and a whole layer's 4 x (64*64*2 + 64*32*2 + 64*128*3 + 64 + 32*2 + 2*64) = 148,480 B
(q, k, v biases included; the norms 2 x 64 x 4). With the embedding tied to the head, the
head's backward makes the weight's gradient but autograd adds the lookup's into it before the
AccumulateGrad node (and so the hook) runs, at the embedding's backward: that 131,072 B lives
through every layer's backward, beside each layer gradient in turn (largest 32,768 B).
Each parameter's own step (foreach AdamW on one tensor) makes one fp32 copy of it (a
temporary, not a gradient). Checked against the generic path: a 4-layer Qwen2 of width 256 at
b2 s64 -1.9 % -> +0.4 % (tied -0.8 %); torchtune's optimizer_in_bwd dev rows GT015-GT017
unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

QWEN2 = str(Path(__file__).resolve().parents[1] / "models" / "formula" / "qwen2.json")


def _gradient_peak(model: str = QWEN2, **changes: object) -> int:
    settings: dict[str, object] = {"micro_batch_size": 2, "seq_len": 64, **changes}
    training = TrainingConfig(**settings)  # type: ignore[arg-type]
    est = estimate(model, training, engine="analytic", simulate_allocator=False)
    return est.schedules[0].category_peak(MemoryCategory.GRADIENT)


def test_one_gradient_alive_at_a_time() -> None:
    assert _gradient_peak(optimizer_in_backward=True) == 512 * 64 * 4


def test_without_it_every_gradient_is_alive() -> None:
    embedding_and_head = 2 * 512 * 64 * 4
    layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 64 + 32 * 2 + 2 * 64)
    assert _gradient_peak() == embedding_and_head + 2 * layer + 64 * 4  # + the final norm


def test_a_tied_weight_is_stepped_at_the_lookups_backward(tmp_path: Path) -> None:
    tied = tmp_path / "qwen2-tied.json"
    tied.write_text(
        json.dumps({**json.loads(Path(QWEN2).read_text()), "tie_word_embeddings": True})
    )
    assert _gradient_peak(str(tied), optimizer_in_backward=True) == 512 * 64 * 4 + 64 * 128 * 4
