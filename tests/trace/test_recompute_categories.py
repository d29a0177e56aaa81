"""The category of what a non-reentrant recompute holds when it stops early (Note [A
recompute's unwound tensors], trainmem/trace/capture.py): the 1024-wide agreement Llama
(tests/models/agreement/llama_h1024.json: h 1024, i 2816) at 2 x 256 = 512 tokens, bf16
autocast over fp32 weights, peft LoRA r 16 on q / v, full checkpointing.

By hand (torch 2.13 utils/checkpoint.py ``_checkpoint_hook``, derivatives.yaml ``mm``,
transformers 5.24 modeling_llama.py ``LlamaMLP.forward``): layer 1's recompute stops once its
last saved tensor is packed again, autocast's bf16 copy of the frozen down weight that down's
``mm`` saves for its input's gradient ([2816, 1024] x 2 B = 5,767,168 B), before that matmul
runs. ``act_fn(gate) * up`` (c t i = 2 x 512 x 2816 = 2,883,584 B), down's input, is saved by
nothing (down's weight needs no gradient): the unwinding frees it, a temporary. The weight
copy is an activation, freed by down's backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")
pytest.importorskip("peft")

T, H, INNER, C = 512, 1024, 2816, 2


def _ops(items: tuple[Item, ...] | list[Item]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)  # type: ignore[union-attr]
    return out


def test_recompute_unwound_tensors_are_temporaries(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text((MODELS_DIR / "agreement" / "llama_h1024.json").read_text())
    training = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16,
                              lora_targets=("q", "v"), activation_checkpointing="full")  # fmt: skip
    est = estimate(str(path), training, engine="generic", simulate_allocator=False)
    schedule = est.schedules[0]
    assert not any(isinstance(item, Repeat) for item in schedule.step)  # two layers as traced
    recompute = [
        op
        for op in _ops(schedule.step)
        if op.action == "alloc" and op.phase == "backward" and ".layers.1.mlp" in op.module
    ]
    product = [op for op in recompute if op.module.endswith("layers.1.mlp")]
    assert [(op.size_bytes, op.category) for op in product] == [
        (C * T * INNER, MemoryCategory.TEMPORARY)  # 2,883,584 B, activations before
    ]
    copies = [
        op.category
        for op in recompute
        if op.module.endswith("mlp.down_proj") and op.size_bytes == C * INNER * H
    ]
    assert copies == [MemoryCategory.ACTIVATION]
    # the formulas count the same tensors in the same categories at the step's peak
    formulas = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    for field in ("activations", "temporary"):
        gap = getattr(est.breakdown, field) - getattr(formulas.breakdown, field)
        assert abs(gap) <= 4096, (field, gap)
