"""Note [The LM head's matmul backward] (trainmem/analytic/head.py): the loss's fp32 logits
gradient is cast back to the head's dtype and freed before the head's matmul backward, which
makes the 16-bit weight gradient (cast into the fp32 one under autocast while it is alive) and
the input gradient, then releases its saved input and autocast's weight copy.

Expected numbers by hand from the agreement Llama's config (tests/models/agreement/
llama_h2048.json, hidden h = 2048) with a 32,000-token vocabulary V, tied, at b = 2, s = 256
(t = 512 tokens): the 16-bit logits gradient 2 V t, the 16-bit weight gradient 2 V h, its fp32
cast 4 V h, the input gradient 2 h t, the fp32 loss gradient 4 V t, autocast's weight copy
2 V h. The order is the one torch 2.13's autograd runs on the CPU (the generic path traces it);
the agreement is checked in tests/trace/test_generic_formula_cells.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import MODELS_DIR, live_at
from trainmem.estimate import estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.training import TrainingConfig

CFG = {
    **json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text()),
    "vocab_size": 32_000,
    "tie_word_embeddings": True,
}
V, H, T = 32_000, CFG["hidden_size"], 2 * 256


def _ops(tmp_path: Path, **settings: Any) -> list[Op]:
    path = tmp_path / "llama_tied.json"
    path.write_text(json.dumps(CFG))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **settings)
    est = estimate(str(path), training, engine="analytic", simulate_allocator=False)

    def flat(items: Any) -> list[Op]:
        out: list[Op] = []
        for item in items:
            out += flat(item.body) * item.count if isinstance(item, Repeat) else [item]
        return out

    return flat(est.schedules[0].step)


def test_autocast_head_gradient_cast_beside_its_16_bit_form(tmp_path: Path) -> None:
    """bf16 autocast, accumulation 2: the second micro-batch's fp32 new gradient of the tied
    weight (4 V h) is made beside its bf16 form (2 V h) and the input gradient (2 h t); the
    fp32 loss gradient, the bf16 logits gradient and the weight copy are gone by then."""
    ops = _ops(tmp_path, gradient_accumulation_steps=2)
    (new,) = {op.key for op in ops if op.key.startswith("new_grad/") and op.size_bytes == 4 * V * H}
    live = live_at(ops, new)
    assert live[new] == 4 * V * H
    assert live["head_tmp/weight"] == 2 * V * H
    assert live["head_tmp/input"] == 2 * H * T
    assert not {"loss/2", "head_tmp/logits"} & set(live)
    assert 2 * V * H not in [v for k, v in live.items() if k.startswith("act/head/")]


def test_autocast_head_matmul_holds_logits_gradient_and_weight_copy(tmp_path: Path) -> None:
    """At the matmul's weight gradient (2 V h) the bf16 logits gradient (2 V t) and autocast's
    weight copy (2 V h) are alive, the fp32 loss gradient (4 V t) freed."""
    live = live_at(_ops(tmp_path), "head_tmp/weight")
    assert live["head_tmp/logits"] == 2 * V * T
    assert 2 * V * H in [v for k, v in live.items() if k.startswith("act/head/")]
    assert "loss/2" not in live


def test_bf16_true_head_makes_its_gradient_in_the_matmul(tmp_path: Path) -> None:
    """bf16-true: no cast; the head's bf16 gradient (2 V h) is the matmul's output, made while
    the bf16 logits gradient (2 V t) is alive, the fp32 loss gradient already freed."""
    ops = _ops(tmp_path, precision="bf16-true")
    (grad,) = {
        op.key for op in ops if op.key.startswith("grad/head/") and op.size_bytes == 2 * V * H
    }
    live = live_at(ops, grad)
    assert live["head_tmp/logits"] == 2 * V * T
    assert "loss/2" not in live and "head_tmp/weight" not in live
