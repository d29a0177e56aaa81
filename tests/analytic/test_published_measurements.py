"""Against published GPU measurements (shared/validation/dev_measurements.csv, lit-gpt rows):
max_memory_allocated of lit-gpt finetune/lora.py, bf16-true, LoRA r=8 on q and v, dropout 0.05,
LM head and loss in chunks of 128 tokens. Tolerance 5%: the rows are single measurements."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig


@pytest.mark.parametrize(
    ("row", "preset", "b", "s", "measured_gb"),
    [
        ("GT076", "phi-1.5", 1, 1044, 4.82),
        ("GT079", "phi-1.5", 4, 1044, 10.68),
        ("GT083", "stablelm-base-alpha-3b", 4, 1034, 16.92),
        ("GT084", "llama-2-7b", 1, 1304, 21.30),
        ("GT087", "llama-2-7b", 2, 1304, 29.07),
    ],
)
def test_litgpt_lora_rows(row: str, preset: str, b: int, s: int, measured_gb: float) -> None:
    training = TrainingConfig(
        micro_batch_size=b,
        seq_len=s,
        precision="bf16-true",
        lora_rank=8,
        lora_targets=("q", "v"),
        lora_dropout=0.05,
        framework="litgpt",
        chunked_cross_entropy=-(-s // 128),
    )
    predicted = estimate(preset, training).breakdown.allocated_bytes / 1e9
    assert abs(predicted - measured_gb) / measured_gb < 0.05, (row, predicted)
