"""sweep(): grid order, parsing of --over, CSV / JSON that parse back to the same numbers."""

from __future__ import annotations

import csv
import io
import json

import pytest

from trainmem.errors import SpecError
from trainmem.planner.sweep import parse_over, sweep
from trainmem.report.render import sweep_csv, sweep_json, sweep_table
from trainmem.specs.hardware import get_gpu
from trainmem.specs.training import TrainingConfig

OVER = {"micro_batch_size": [1, 8, 16], "seq-len": [512, 1024]}


def test_rows_are_the_product_in_order() -> None:
    rows = sweep("gpt2", TrainingConfig(), "T4", OVER)
    assert [(r.settings["micro_batch_size"], r.settings["seq_len"]) for r in rows] == [
        (1, 512),
        (1, 1024),
        (8, 512),
        (8, 1024),
        (16, 512),
        (16, 1024),
    ]
    cap = get_gpu("T4").memory_bytes
    for r in rows:
        assert r.allocated_bytes == r.reserved_bytes  # closed form: no fragmentation
        assert r.margin_bytes == cap - r.device_total_bytes
        assert r.fits is (r.margin_bytes >= 0)
    assert rows[0].fits and not rows[-1].fits


def test_simulated_sweep_adds_fragmentation() -> None:
    rows = sweep("gpt2", TrainingConfig(), "T4", {"micro_batch_size": [4]}, simulate_allocator=True)
    assert rows[0].reserved_bytes >= rows[0].allocated_bytes


def test_sweep_without_gpu_has_no_verdict() -> None:
    rows = sweep("gpt2", TrainingConfig(), None, {"precision": ["32-true", "bf16-mixed"]})
    assert [r.fits for r in rows] == [None, None]
    assert rows[0].allocated_bytes > rows[1].allocated_bytes


def test_csv_and_json_parse_back() -> None:
    rows = sweep("gpt2", TrainingConfig(), "T4", OVER)
    parsed = list(csv.DictReader(io.StringIO(sweep_csv(rows))))
    assert len(parsed) == len(rows)
    assert list(parsed[0]) == [
        "micro_batch_size",
        "seq_len",
        "allocated_bytes",
        "reserved_bytes",
        "device_total_bytes",
        "peak_phase",
        "fits",
        "verdict",
        "margin_bytes",
        "allocator_simulated",
    ]
    for p, r in zip(parsed, rows, strict=True):
        assert int(p["device_total_bytes"]) == r.device_total_bytes
        assert int(p["micro_batch_size"]) == r.settings["micro_batch_size"]
        assert p["fits"] == ("true" if r.fits else "false")
        assert p["verdict"] in ("fits", "tight", "does not fit")
        assert (p["verdict"] == "does not fit") == (not r.fits)
    data = json.loads(sweep_json(rows))["rows"]
    assert data == [r.to_dict() for r in rows]
    assert isinstance(data[0]["fits"], bool) and isinstance(data[0]["margin_bytes"], int)


def test_an_oom_row_has_no_margin_and_says_does_not_fit() -> None:
    # gpt2 (124M) full fine-tune, fp32, eager attention, 32 x 1024 tokens on a T4 (16 GB): the
    # attention probabilities saved for backward alone are 32 x 12 heads x 1024^2 x 4 B =
    # 1.6 GB per layer, x 12 layers = 19.3 GB (Korthikanti et al. 2022, eq. 1, 5as^2b term).
    assert 32 * 12 * 1024**2 * 4 * 12 > 16 * 10**9
    training = TrainingConfig(attention="eager", precision="32-true")
    over = {"micro_batch_size": [1, 32]}
    rows = sweep("gpt2", training, "T4", over, simulate_allocator=True)
    fits, oom = rows
    assert fits.verdict in ("fits", "tight") and fits.margin_bytes is not None
    assert oom.fits is False and oom.verdict == "does not fit"
    assert oom.margin_bytes is None and oom.device_total_bytes is None
    assert sweep_table("t", rows).row_count == 2


def test_table_has_one_row_per_point() -> None:
    rows = sweep("gpt2", TrainingConfig(), "T4", OVER)
    assert sweep_table("t", rows).row_count == len(rows)


def test_parse_over_types_and_spellings() -> None:
    items = ["micro-batch-size=1,2, 4", "precision=bf16-mixed,32-true", "dropout=no"]
    assert parse_over(items) == {
        "micro_batch_size": [1, 2, 4],
        "precision": ["bf16-mixed", "32-true"],
        "dropout": [False],
    }


@pytest.mark.parametrize(
    ("items", "field", "words"),
    [
        (["batch=1,2"], "over", ["unknown field 'batch'", "micro-batch-size", "seq-len"]),
        (["seq-len"], "over", ["FIELD=V1,V2"]),
        (["seq-len=512,abc"], "seq_len", ["integer", "'abc'"]),
        (["dropout=maybe"], "dropout", ["true or false"]),
        (["seq-len="], "seq_len", ["no values"]),
        (["seq-len=1", "seq_len=2"], "over", ["twice"]),
    ],
)
def test_parse_over_errors_name_the_field(items: list[str], field: str, words: list[str]) -> None:
    with pytest.raises(SpecError) as info:
        parse_over(items)
    assert info.value.field == field
    for w in words:
        assert w in str(info.value)


def test_a_value_the_field_rejects_names_the_field() -> None:
    with pytest.raises(SpecError, match="precision: unknown value 'fp8'"):
        sweep("gpt2", TrainingConfig(), "T4", {"precision": ["fp8"]})
    with pytest.raises(SpecError, match="over: unknown field"):
        sweep("gpt2", TrainingConfig(), "T4", {"batch": [1]})
