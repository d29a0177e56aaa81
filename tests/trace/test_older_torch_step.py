"""The traced paths follow ``--torch-version`` where the formulas do (issue 24: versions as
inputs): torch 2.0's foreach AdamW step, ``zero_grad()``'s default before 2.0 and a
cross-entropy's log-softmax input before 1.11, each against the analytic engine and by hand.

Bytes by hand, the 2-layer Qwen2 formula config (hidden 64, vocabulary 512; 139,840 trainable
elements, tests/trace/test_traced_transforms.py), b x s = 2 x 64, pytorch-amp's fp32 weights:
- torch 2.0.1 adamw.py ``_multi_tensor_adamw``: ``exp_avg_sq_sqrt = torch._foreach_sqrt(...)``
  and ``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, both fp32 lists of the group at
  ``_foreach_addcdiv_``: 2 x 4 B x 139,840 = 1,118,720 B (2.1 adds eps in place: one list);
- ``zero_grad()`` on torch 1.13 keeps every fp32 gradient: 4 B x 139,840 = 559,360 B before the
  step begins;
- torch 1.10's ``log_softmax`` keeps its input (the fp32 upcast logits) beside its output:
  4 B x 512 x 128 tokens = 262,144 B.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.loss import loss_saved_terms
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
TRAINABLE = 139_840
FOREACH_LABEL = "the foreach adamw step's temporaries"


def _training(**changes: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=64, **changes)


def _both(training: TrainingConfig) -> tuple[Any, Any]:
    """(the generic path's estimate, the analytic engine's)."""
    return tuple(
        estimate(QWEN2, training, engine=engine, simulate_allocator=False)
        for engine in ("generic", "analytic")
    )


def _allocated(items: tuple[Item, ...], label: str) -> int:
    """Bytes allocated under ``label`` in ``items`` (a repeated body once per repeat)."""
    total = 0
    for item in items:
        if isinstance(item, Repeat):
            total += item.count * _allocated(item.body, label)
        elif isinstance(item, Op) and item.action == "alloc" and item.label == label:
            total += item.size_bytes
    return total


def _step_temporaries(schedule: StepSchedule) -> int:
    return _allocated(schedule.step, FOREACH_LABEL)


def test_torch_2_0_foreach_adamw_on_the_generic_path() -> None:
    training = _training(torch_version="2.0")
    assert training.step_implementation == "foreach"
    generic, analytic = _both(training)
    assert _step_temporaries(generic.schedules[0]) == 2 * 4 * TRAINABLE == 1_118_720
    assert _step_temporaries(analytic.schedules[0]) == 2 * 4 * TRAINABLE
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01, ratio
    assert any("torch_version=2.0: its foreach step" in n for n in generic.notes)


def test_zero_grad_keeps_the_gradients_before_torch_2_0() -> None:
    kept = _both(_training(torch_version="1.13"))
    freed = _both(_training(torch_version="1.13", zero_grad_set_to_none=True))
    for engine, (k, f) in zip(("generic", "analytic"), zip(kept, freed, strict=True), strict=True):
        grown = k.breakdown.allocated_bytes - f.breakdown.allocated_bytes
        assert grown == 4 * TRAINABLE == 559_360, engine  # the peak is in the backward
    ratio = kept[0].breakdown.allocated_bytes / kept[1].breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01, ratio


def test_the_log_softmax_input_before_torch_1_11() -> None:
    model = load_model_spec(QWEN2)
    old = loss_saved_terms(model, _training(torch_version="1.10"), t=128)
    assert old["log_softmax_input"] == 4 * 512 * 128 == 262_144
    newer = loss_saved_terms(model, _training(torch_version="1.11"), t=128)
    assert "log_softmax_input" not in newer
    # the engines agree there (before, the formulas lacked those 262,144 B: -1.2 %)
    generic, analytic = _both(_training(torch_version="1.10", attention="eager"))
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.001, ratio
