"""Adafactor over DTensor-sharded matrices (Note [Adafactor on DTensor-sharded matrices],
specs/training.py; issue 26: FSDP2 + Adafactor failed on the generic path with a trace error
while the formulas answered). torch 2.13's Adafactor raises there, so both engines refuse it
and name what runs; FSDP1, DDP and DeepSpeed keep it."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig, check_training_for_model

MODEL = str(MODELS_DIR / "formula" / "qwen2.json")
FSDP2: dict[str, Any] = {"data_parallel_size": 4, "zero_stage": 3, "framework": "fsdp2"}


@pytest.mark.parametrize(
    "settings",
    [
        FSDP2,
        {"data_parallel_size": 4, "zero_stage": 3},  # pytorch-amp's FSDP2
        {**FSDP2, "shard_group_size": 2},  # HSDP: still Shard(0) DTensors
        {"tensor_parallel_size": 2},  # ColwiseParallel's Shard(0) weights
    ],
)
def test_refused_with_what_runs(settings: dict[str, Any]) -> None:
    training = TrainingConfig(optimizer="adafactor", **settings)
    with pytest.raises(SpecError) as err:
        check_training_for_model(resolve_model(MODEL), training)
    assert "in-place operations that require placement changes" in str(err.value)
    assert "accelerate-fsdp" in str(err.value)  # what runs instead


@pytest.mark.parametrize("engine", ["analytic", "generic"])
def test_both_engines_refuse(engine: str) -> None:
    training = TrainingConfig(micro_batch_size=1, seq_len=32, optimizer="adafactor", **FSDP2)
    with pytest.raises(SpecError, match="adafactor under FSDP2"):
        estimate(MODEL, training, engine=engine, simulate_allocator=False)


@pytest.mark.parametrize(
    "settings",
    [
        {"data_parallel_size": 4, "zero_stage": 3, "framework": "accelerate-fsdp"},
        {"data_parallel_size": 4},  # DDP
        {"data_parallel_size": 4, "zero_stage": 2, "framework": "deepspeed"},
        {**FSDP2, "optimizer": "adamw"},
    ],
)
def test_allowed_elsewhere(settings: dict[str, Any]) -> None:
    training = TrainingConfig(**({"optimizer": "adafactor"} | settings))
    check_training_for_model(resolve_model(MODEL), training)


def test_an_older_torch_is_left_to_the_formulas() -> None:
    # not checked before 2.13: the formulas answer, the generic path (the installed torch)
    # refuses by name instead of failing inside the trace
    training = TrainingConfig(
        micro_batch_size=1, seq_len=32, optimizer="adafactor", torch_version="2.8", **FSDP2
    )
    assert estimate(MODEL, training, engine="analytic", simulate_allocator=False)
    with pytest.raises(UnsupportedError, match="optimizer=adafactor on DTensor-sharded"):
        estimate(MODEL, training, engine="generic", simulate_allocator=False)
