"""Training options applied to a traced step as the analytic engine's rules
(trainmem.traced_options; issue 26: every option on every model path).

Expected numbers: the analytic engine (its cited formulas and its own schedule, an independent
derivation of the same run) for the agreement within 1%; sizes of the 2-layer Qwen2 formula
config derived by hand (elements in tests/trace/test_traced_transforms.py: 139,840 trainable).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate, trace_unsupported_settings
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
PIXART = str(MODELS_DIR / "diffusers" / "tiny-pixart.json")
TRAINABLE = 139_840


def _training(**changes: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=64, **changes)


def _generic(model: str, **changes: Any) -> StepSchedule:
    est = estimate(model, _training(**changes), engine="generic", simulate_allocator=False)
    return est.schedules[0]


def _peaks(**changes: Any) -> tuple[int, int]:
    out = []
    for engine in ("generic", "analytic"):
        est = estimate(QWEN2, _training(**changes), engine=engine, simulate_allocator=False)
        out.append(est.breakdown.allocated_bytes)
    return out[0], out[1]


def _ops(items: tuple[Item, ...]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


def _buckets(schedule: StepSchedule) -> list[int]:
    return [op.size_bytes for op in _ops(schedule.setup + schedule.step) if op.key == "ddp/buckets"]


# -- plain DDP ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        pytest.param({"gradient_accumulation_steps": 2}, marks=pytest.mark.slow),
        {"framework": "hf-trainer"},
    ],
    ids=["plain", "accumulation", "hf-trainer"],
)
def test_ddp_on_a_traced_model_matches_the_analytic_engine(changes: dict[str, Any]) -> None:
    generic, analytic = _peaks(data_parallel_size=4, **changes)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    # the buckets (4 B x 139,840 = 2.7% of this peak) are more than the tolerance
    alone, _ = _peaks(**changes)
    assert generic - alone > 0.01 * generic


def test_ddp_buckets_of_a_traced_qwen2_by_hand() -> None:
    # pytorch-amp keeps fp32 weights under autocast: every trainable gradient is fp32, and
    # DDP's reducer keeps one flat copy of them, 4 B x 139,840, from wrap time (reducer.cpp)
    schedule = _generic(QWEN2, data_parallel_size=4)
    assert _buckets(schedule) == [4 * TRAINABLE]
    assert schedule.live_before_step()[MemoryCategory.GRADIENT] == 4 * TRAINABLE
    # a bf16 run's buckets are bf16
    assert _buckets(_generic(QWEN2, data_parallel_size=4, precision="bf16-true")) == [2 * TRAINABLE]


def test_ddp_on_a_diffusers_model_adds_its_gradients_once() -> None:
    # no ModelSpec: the buckets are the traced gradients' bytes
    single = _generic(PIXART)
    ddp = _generic(PIXART, data_parallel_size=4)
    grads = single.category_peak(MemoryCategory.GRADIENT)
    assert grads > 0
    assert _buckets(ddp) == [grads]
    assert ddp.peak().peak_bytes == single.peak().peak_bytes + grads


def test_ddp_with_tensor_parallelism_stays_refused() -> None:
    refused = trace_unsupported_settings(
        _training(data_parallel_size=2, tensor_parallel_size=2), "generic"
    )
    assert "data_parallel_size=2" in refused
