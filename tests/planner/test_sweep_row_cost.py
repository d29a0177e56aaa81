"""A sweep row costs one estimate (issue 29, item 10: 100,000 rows took 104 s, 10.5 s at
v0.1). The row's verdict (``trainmem.uncertainty.verdict_of``) rebuilt and re-validated a
TrainingConfig from the estimate's resolved config for every row that fits; the model config is
read once for the whole sweep."""

from __future__ import annotations

from typing import Any

import pytest

import trainmem.specs.hf as hf
from trainmem import TrainingConfig
from trainmem.planner.sweep import sweep

ROWS = 40


def test_a_row_builds_one_training_config_and_reads_no_model_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[int] = []
    reads: list[str] = []
    post_init = TrainingConfig.__post_init__
    load = hf.load_hf_config

    def counting_post_init(self: TrainingConfig) -> None:
        built.append(1)
        post_init(self)

    def counting_load(name: str) -> Any:
        reads.append(name)
        return load(name)

    monkeypatch.setattr(TrainingConfig, "__post_init__", counting_post_init)
    monkeypatch.setattr(hf, "load_hf_config", counting_load)
    base = TrainingConfig(micro_batch_size=1)
    built.clear()
    rows = sweep("tiny-llama-test", base, "A100-80GB", {"seq_len": list(range(16, 16 + ROWS))})
    assert [r.verdict for r in rows] == ["fits"] * ROWS  # every row takes the band
    assert len(built) <= ROWS + 2  # the row's own config (was two per row)
    assert len(reads) <= 1
