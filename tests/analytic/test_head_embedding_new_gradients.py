"""Note [New gradients of the head and the embedding] (trainmem/analytic/schedule.py): under
gradient accumulation every later micro-batch makes the output layer's and the token
embedding's new gradients (torch accumulate_grad.h: added into the kept ``.grad`` in place,
then dropped); a tied weight's waits in autograd's input buffer from the head's backward to
the embedding's, beside the lookup's gradient and, when the head's gradient is not a fresh
tensor, their out-of-place sum (input_buffer.cpp ``accumulate``).

Expected numbers by hand from the agreement Llama's config (tests/models/agreement/
llama_h2048.json: vocabulary V = 4096, hidden h = 2048): the head's / embedding's gradient is
V x h x 4 bytes beside fp32 master weights (bf16-mixed), V x h x 2 in bf16-true; the count of
new gradients is the number of later micro-batches. The in-place / out-of-place sum was
checked on torch 2.13's CPU with the profiler's memory (the Note).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import MODELS_DIR, live_at
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

AGREEMENT = MODELS_DIR / "agreement" / "llama_h2048.json"
CFG = json.loads(AGREEMENT.read_text())
V, H = CFG["vocab_size"], CFG["hidden_size"]


def _flat(items: tuple[Item, ...] | list[Item]) -> list[Op]:
    """The step's ops in order, each repeated body as many times as it runs."""
    out: list[Op] = []
    for item in items:
        if isinstance(item, Repeat):
            out += _flat(list(item.body)) * item.count
        else:
            out.append(item)
    return out


def _step(model: Path | str, **settings: Any) -> list[Op]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **settings)
    est = estimate(str(model), training, engine="analytic", simulate_allocator=False)
    return _flat(est.schedules[0].step)


def _tied(tmp_path: Path) -> Path:
    path = tmp_path / "llama_tied.json"
    path.write_text(json.dumps({**CFG, "tie_word_embeddings": True}))
    return path


def test_later_micro_batches_make_untied_head_and_embedding_gradients() -> None:
    """Accumulation over 4: three later micro-batches, each making the head's and the
    embedding's fp32 new gradient (V x h x 4), freed right after it is added."""
    ops = _step(AGREEMENT, gradient_accumulation_steps=4)
    for group in ("head", "embedding"):
        at = [
            n
            for n, op in enumerate(ops)
            if op.action == "alloc"
            and op.key.startswith(f"new_grad/{group}/")
            and op.size_bytes == 4 * V * H
        ]
        assert len(at) == 3
        assert all(ops[n + 1].action == "free" and ops[n + 1].key == ops[n].key for n in at)


def test_no_new_head_gradient_without_accumulation() -> None:
    ops = _step(AGREEMENT)
    assert not [op for op in ops if op.key.startswith("new_grad/")]


def _tied_key(ops: list[Op], prefix: str, size: int) -> str:
    """The key of the head group's gradient of the tied weight (its V x h bytes)."""
    (key,) = {op.key for op in ops if op.key.startswith(prefix) and op.size_bytes == size}
    return key


def test_tied_new_gradient_waits_for_the_lookup_and_their_out_of_place_sum(tmp_path: Path) -> None:
    """bf16-true, accumulation over 2: at the second micro-batch's sum of the tied weight's
    two gradients, the kept gradient, the head's new one, the lookup's and the sum are all
    alive, V x h x 2 bytes each; the new one is freed before the next step."""
    ops = _step(_tied(tmp_path), gradient_accumulation_steps=2, precision="bf16-true")
    kept, new = _tied_key(ops, "grad/head/", 2 * V * H), _tied_key(ops, "new_grad/head/", 2 * V * H)
    live = live_at(ops, "grad/embedding/tied_sum", 1)
    assert live[kept] == live[new] == 2 * V * H
    assert live["grad/embedding/vocab"] == live["grad/embedding/tied_sum"] == 2 * V * H
    assert new not in live_at(ops, "grad/embedding/tied_sum", 0)
    freed = [n for n, op in enumerate(ops) if op.action == "free" and op.key == new]
    summed = [n for n, op in enumerate(ops) if op.key == "grad/embedding/tied_sum"]
    assert len(freed) == 1 and summed[2] < freed[0] < summed[3]  # freed after the sum's alloc


def test_tied_lookup_added_in_place_under_autocast(tmp_path: Path) -> None:
    """bf16-mixed: the head's new gradient is the fresh fp32 cast of its bf16 one, so the
    lookup's fp32 gradient (V x h x 4) is added into it in place: no sum."""
    ops = _step(_tied(tmp_path), gradient_accumulation_steps=2)
    assert not [op for op in ops if op.key == "grad/embedding/tied_sum" and op.size_bytes]
    new = _tied_key(ops, "new_grad/head/", 4 * V * H)
    live = live_at(ops, "grad/embedding/vocab", 1)
    assert live[new] == live["grad/embedding/vocab"] == 4 * V * H


def test_classification_head_leaves_the_embeddings_new_gradient_to_the_lookup(
    tmp_path: Path,
) -> None:
    """BertForSequenceClassification under ``tie_word_embeddings`` (BERT's default): no head
    reads the word embedding, so a later micro-batch's new gradient of it (V x h x 4, fp32
    under autocast) is made at the embedding's backward, after the whole-vocabulary op, not
    at the head's; no lookup transient beside it."""
    cfg = json.loads((MODELS_DIR / "formula" / "bert.json").read_text())
    path = tmp_path / "bert_cls.json"
    path.write_text(
        json.dumps({**cfg, "architectures": ["BertForSequenceClassification"], "num_labels": 2})
    )
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    ops = _step(path, gradient_accumulation_steps=2)
    new = _tied_key(ops, "new_grad/head/", 4 * v * h)
    lookup = [n for n, op in enumerate(ops) if op.key == "grad/embedding/vocab"]
    made = [n for n, op in enumerate(ops) if op.key == new]
    assert all(op.size_bytes == 0 for op in ops if op.key == "grad/embedding/vocab")
    assert len(made) == 2 and lookup[2] < made[0] < made[1] < lookup[3]


def test_tied_lookup_added_in_place_into_a_chunked_heads_sum(tmp_path: Path) -> None:
    """bf16-true with the loss in 8 chunks: the head's gradient in the input buffer is already
    the out-of-place sum of its chunks' (Note [Chunked head's first weight-gradient sum]), a
    fresh tensor, so the lookup's bf16 gradient (V x h x 2) is added into it in place."""
    ops = _step(
        _tied(tmp_path), precision="bf16-true", framework="torchtune", chunked_cross_entropy=8
    )
    assert not [op for op in ops if op.key == "grad/embedding/tied_sum" and op.size_bytes]
    assert {op.size_bytes for op in ops if op.key == "grad/embedding/vocab"} == {2 * V * H}


_DS_ZERO = {"data_parallel_size": 4, "framework": "deepspeed", "gradient_accumulation_steps": 2}


def test_tied_gradient_waits_whole_under_deepspeed_zero2(tmp_path: Path) -> None:
    """Note [A tied gradient under DeepSpeed ZeRO-2/3]: ZeRO-2 over 4 ranks (bf16 weights,
    gradients and lookup), accumulation 2: at the second micro-batch's out-of-place sum the
    head's new gradient waits whole, V x h x 2 bytes (not the partition, V x h x 2 / 4),
    beside the lookup's gradient and the sum, V x h x 2 each."""
    ops = _step(_tied(tmp_path), zero_stage=2, **_DS_ZERO)
    new = _tied_key(ops, "new_grad/head/", 2 * V * H)
    live = live_at(ops, "grad/embedding/tied_sum", 1)
    assert live[new] == live["grad/embedding/vocab"] == live["grad/embedding/tied_sum"] == 2 * V * H


def test_tied_lookup_and_sum_under_deepspeed_zero3(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-3's hooks run after AccumulateGrad too (``register_post_accumulate_grad
    _hook``): the lookup's gradient and the out-of-place sum (V x h x 2 each) are made beside
    the head's whole new gradient, as under ZeRO-2 (FSDP's transforms size their own)."""
    ops = _step(_tied(tmp_path), zero_stage=3, **_DS_ZERO)
    new = _tied_key(ops, "new_grad/head/", 2 * V * H)
    live = live_at(ops, "grad/embedding/tied_sum", 1)
    assert live[new] == live["grad/embedding/vocab"] == live["grad/embedding/tied_sum"] == 2 * V * H
