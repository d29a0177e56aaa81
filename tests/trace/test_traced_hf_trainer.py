"""The HF Trainer on the traced paths (issue 26): on one GPU it is a plain loop whose default
optimizer is ``adamw_torch_fused`` from torch 2.8 (transformers training_args.py
``OptimizerNames``; ``default_optim``), so its traced step is the plain loop's with fused AdamW,
and it agrees with the analytic engine's hf-trainer row."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")


def _peak(engine: str, **settings: object) -> int:
    training = TrainingConfig(micro_batch_size=4, seq_len=256, **settings)  # type: ignore[arg-type]
    est = estimate(QWEN2, training, engine=engine, simulate_allocator=False)
    return est.breakdown.allocated_bytes


def test_trainer_step_is_the_plain_loop_with_fused_adamw() -> None:
    trainer = _peak("generic", framework="hf-trainer", torch_version="2.8")
    plain_fused = _peak("generic", optimizer_implementation="fused")
    plain_foreach = _peak("generic", optimizer_implementation="foreach")
    assert trainer == plain_fused
    assert plain_fused != plain_foreach  # the test can tell the implementations apart


@pytest.mark.parametrize(
    "settings",
    [{}, {"gradient_accumulation_steps": 4, "activation_checkpointing": "full"}],
    ids=["plain", "accumulation-full-ac"],
)
def test_trainer_on_the_generic_path_agrees_with_the_formulas(settings: dict) -> None:
    generic = _peak("generic", framework="hf-trainer", **settings)
    analytic = _peak("analytic", framework="hf-trainer", **settings)
    assert abs(generic / analytic - 1) < 0.01


def test_trainer_with_adafactor_or_parallelism_stays_refused() -> None:
    for settings in ({"optimizer": "adafactor"}, {"tensor_parallel_size": 2}):
        with pytest.raises(UnsupportedError, match="framework=hf-trainer"):
            _peak("generic", framework="hf-trainer", **settings)
