"""The trace engine on a deep model traces a few layers and composes the rest (issue 14: a 70B
rank in seconds); the composition must give what tracing every layer gives.

Expected numbers: the whole model traced op by op (``trainmem.trace.engine.estimate_trace``, the
engine's own whole-model path), an independent execution of the same step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import COMPOSE_ABOVE_LAYERS, estimate, finish
from trainmem.schedule import StepSchedule
from trainmem.specs.hf import PRESETS_DIR
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import estimate_trace


@pytest.fixture(scope="module")
def deep_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((PRESETS_DIR / "tiny-llama-test.json").read_text())
    config["num_hidden_layers"] = COMPOSE_ABOVE_LAYERS + 4
    path = tmp_path_factory.mktemp("deep") / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "training",
    [
        pytest.param(TrainingConfig(micro_batch_size=2, seq_len=64, dropout=False), id="single"),
        pytest.param(
            TrainingConfig(
                micro_batch_size=2, seq_len=64, dropout=False, activation_checkpointing="full",
                framework="fsdp2", data_parallel_size=2, zero_stage=3,
            ),
            id="fsdp2-full-ac",
            marks=pytest.mark.slow,  # ~9 s; "single" keeps the composition in the fast set
        ),
    ],
)  # fmt: skip
def test_composed_trace_equals_the_whole_trace(deep_config: Path, training: TrainingConfig) -> None:
    composed = estimate(str(deep_config), training, engine="trace", simulate_allocator=False)
    assert composed.engine == "trace"
    assert "identical layers a few are traced" in composed.notes[0]
    whole = estimate_trace(str(deep_config), training)
    whole.schedules = [StepSchedule.from_timeline(whole.timeline).with_lazy_optimizer_states()]
    whole = finish(whole, gpu=None, alloc_conf="", simulate_allocator=False)
    assert composed.num_parameters == whole.num_parameters
    assert composed.breakdown.allocated_bytes == whole.breakdown.allocated_bytes
    assert composed.peak_phase == whole.peak_phase


def test_shallow_models_are_traced_whole() -> None:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, dropout=False)
    est = estimate("tiny-llama-test", training, engine="trace", simulate_allocator=False)
    assert "identical layers" not in est.notes[0]
