"""Remote-code families on the generic path (issue 26, Note [Remote-code stand-ins]): Qwen-1,
ChatGLM3 and Baichuan2-7B traced as the transformers class with the same tensors.

Expected values: the parameter count is the table row's (itself checked against the published
totals in tests/specs), and the peak is the analytic engine's for the same row: the two engines
model the same step independently (formulas vs a trace of transformers' code).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

REMOTE = MODELS_DIR / "remote_code"


@pytest.mark.parametrize("name", ["qwen-7b", "chatglm3-6b", "baichuan2-7b"])
def test_stand_in_matches_the_table_row(name: str) -> None:
    path = str(REMOTE / f"{name}.json")
    # activations dominate: 4 x 2,048 tokens without checkpointing, SGD (no optimizer states)
    training = TrainingConfig(
        micro_batch_size=4, seq_len=2048, precision="bf16-true", optimizer="sgd"
    )
    generic = estimate(path, training, engine="generic", simulate_allocator=False)
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert generic.num_parameters == analytic.num_parameters
    assert analytic.breakdown.activations > analytic.breakdown.parameters
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01
    assert any("remote-code" in note for note in generic.notes)


def test_lora_on_a_stand_in_is_refused_with_the_reason() -> None:
    training = TrainingConfig(micro_batch_size=1, seq_len=128, lora_rank=8)
    with pytest.raises(UnsupportedError, match="fuses them"):
        estimate(str(REMOTE / "qwen-7b.json"), training, engine="generic")
