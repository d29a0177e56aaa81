"""trainmem.uncertainty: the band from the benchmark's error spread."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.uncertainty import MIN_ROWS, configuration_kinds, load_table, uncertainty_band

GiB = 2**30


def _stats(lo: float, hi: float, n: int = 5) -> dict[str, float]:
    return {"n": n, "min": lo, "p10": lo, "median": 0.0, "p90": hi, "max": hi}


TABLE = {
    "engines": {
        "analytic": {
            "all": _stats(-0.2, 0.5, n=30),
            "method=full": _stats(-0.1, 0.1),
            "method=lora": _stats(0.0, 0.4),
            "sharded=no": _stats(-0.05, 0.2),
            "offload=none": _stats(-0.05, 0.05),
            "attention=sdpa": _stats(-0.02, 0.1),
            "attention=eager": _stats(-0.2, 0.15),
            "checkpointing=none": _stats(-0.05, 0.1),
            "precision=bf16-mixed": _stats(-0.05, 0.1),
            "optimizer=adam": _stats(-0.1, 0.1),
            "sharded=yes": _stats(-0.1, 0.1, n=MIN_ROWS - 1),
        }
    }
}


def test_kinds() -> None:
    assert configuration_kinds(TrainingConfig()) == [
        "method=full",
        "sharded=no",
        "offload=none",
        "attention=sdpa",
        "checkpointing=none",
        "precision=bf16-mixed",
        "optimizer=adam",
    ]
    kinds = configuration_kinds(
        TrainingConfig(
            lora_rank=8,
            quantize_base="nf4",
            optimizer="paged-adamw-8bit",
            data_parallel_size=2,
            zero_stage=3,
        )
    )
    assert "method=qlora" in kinds and "sharded=yes" in kinds and "optimizer=8-bit" in kinds
    assert "sharded=no" in configuration_kinds(TrainingConfig(data_parallel_size=2))


def test_band_is_the_union_of_the_kinds_spreads() -> None:
    band = uncertainty_band(TrainingConfig(), 100 * GiB, table=TABLE)
    # e_min = -0.1 (method=full / optimizer=adam), e_max = 0.2 (sharded=no)
    assert band["expected"] == 100 * GiB
    assert band["low"] == int(100 * GiB / 1.2)
    assert band["high"] == int(100 * GiB / 0.9)
    assert band["engine"] == "analytic" and band["metric"] == "allocated"
    assert band["least_sure_of"][0].startswith("sharded=no")


def test_band_always_brackets_expected() -> None:
    one_sided = {"engines": {"analytic": {"all": _stats(0.1, 0.3, n=30)}}}
    band = uncertainty_band(TrainingConfig(), 1000, table=one_sided)
    assert band["low"] <= band["expected"] == 1000 <= band["high"]
    for training in (
        TrainingConfig(),
        TrainingConfig(lora_rank=8),
        TrainingConfig(attention="eager"),
    ):
        band = uncertainty_band(training, 7 * GiB, table=TABLE)
        assert band["low"] <= band["expected"] <= band["high"]


def test_unmeasured_kind_falls_back_to_all_rows_and_is_named_first() -> None:
    sharded = TrainingConfig(data_parallel_size=2, zero_stage=3)  # sharded=yes has n < MIN_ROWS
    band = uncertainty_band(sharded, 10 * GiB, table=TABLE)
    assert band["least_sure_of"][0].startswith("sharded=yes")
    assert band["high"] == int(10 * GiB / 0.8)  # the overall spread's -20%
    flash = uncertainty_band(TrainingConfig(attention="flash"), 10 * GiB, table=TABLE)
    assert any(s.startswith("attention=flash: 0 dev rows") for s in flash["least_sure_of"])


def test_training_config_needs_expected_and_metric_is_checked() -> None:
    with pytest.raises(TypeError):
        uncertainty_band(TrainingConfig(), table=TABLE)
    with pytest.raises(ValueError, match="metric"):
        uncertainty_band(TrainingConfig(), 1, metric="peak", table=TABLE)


def test_band_from_an_estimate_uses_its_config_engine_and_metric() -> None:
    est = estimate("gpt2", TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=8))
    band = uncertainty_band(est, table=TABLE)
    assert band["expected"] == est.breakdown.allocated_bytes
    assert "method=lora" in band["kinds"]
    reserved = uncertainty_band(est, metric="reserved", table=TABLE)
    assert reserved["expected"] == est.breakdown.reserved_bytes
    # An engine missing from the table falls back to the analytic spread.
    assert uncertainty_band(est, engine="trace", table=TABLE)["low"] == band["low"]


def test_shipped_table_is_readable_and_covers_the_analytic_engine() -> None:
    table = load_table()
    analytic = table["engines"]["analytic"]
    assert analytic["all"]["n"] >= 10
    assert analytic["all"]["min"] <= analytic["all"]["median"] <= analytic["all"]["max"]
    band = uncertainty_band(TrainingConfig(), 50 * GiB)
    assert band["low"] <= band["expected"] <= band["high"]
