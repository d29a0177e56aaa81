"""``trainmem compare`` and ``emit_reports`` (registered on a fresh app here; the lead wires
``register(app)`` into cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from conftest import Invoke
from trainmem.cli.compare import register
from trainmem.cli.options import parse_set
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.report.compare import emit_reports
from trainmem.specs.training import TrainingConfig

app = typer.Typer()


@app.callback()
def _root() -> None:
    """Test app."""


register(app)


def test_parse_set() -> None:
    assert parse_set("activation-checkpointing=full micro-batch-size=4") == {
        "activation_checkpointing": "full",
        "micro_batch_size": 4,
    }
    assert parse_set("lora-rank=8;lora-targets=q,v,engine=analytic") == {
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "engine": "analytic",
    }
    assert parse_set("dropout=false gpu=T4") == {"dropout": False, "gpu": "T4"}
    for bad, match in (
        ("", "empty"),
        ("nope", "KEY=VALUE"),
        ("bogus=1", "unknown key"),
        ("micro-batch-size=x", "integer"),
    ):
        with pytest.raises(SpecError, match=match):
            parse_set(bad)


def test_compare_table_json_and_plot(invoke: Invoke, tmp_path: Path) -> None:
    plot = tmp_path / "cmp.png"
    args = [
        "compare",
        "tiny-gpt2-test",
        "-b",
        "2",
        "-s",
        "64",
        "--gpu",
        "T4",
        "--set",
        "activation-checkpointing=none",
        "--set",
        "activation-checkpointing=full",
        "--plot",
        str(plot),
    ]
    r = invoke(*args)
    assert (
        "activation-checkpointing=none" in r.stdout and "activation-checkpointing=full" in r.stdout
    )
    assert f"note: comparison plot written to {plot}" in r.stdout and plot.stat().st_size > 0
    r = invoke(*args, "--json")
    rows = json.loads(r.stdout)["configurations"]
    assert [row["config"]["activation_checkpointing"] for row in rows] == ["none", "full"]
    assert rows[1]["settings"] == {"activation_checkpointing": "full"}
    expected = estimate(
        "tiny-gpt2-test",
        TrainingConfig(micro_batch_size=2, seq_len=64, activation_checkpointing="full"),
        gpu="T4",
    )
    assert rows[1]["breakdown_bytes"] == expected.breakdown.as_dict()


def test_compare_errors_are_one_line(invoke: Invoke) -> None:
    r = invoke("compare", "gpt2", "--set", "bogus=1", exit_code=2)
    assert r.stderr.startswith("error: set: unknown key 'bogus'")
    r = invoke("compare", "gpt2", "--set", "precision=64-true", exit_code=2)
    assert "precision" in r.stderr


def test_emit_reports(tmp_path: Path) -> None:
    est = estimate("tiny-gpt2-test", TrainingConfig(micro_batch_size=2, seq_len=64))
    plot, html = tmp_path / "t.svg", tmp_path / "r.html"
    notes = emit_reports(est, plot=str(plot), html=str(html))
    assert notes == [f"timeline plot written to {plot}", f"HTML report written to {html}"]
    assert "live memory (GiB = 2^30 bytes)" in plot.read_text()
    assert "<h2>Configuration</h2>" in html.read_text()
    assert emit_reports(est, plot=None, html=None) == []
    with pytest.raises(SpecError, match="png or .svg"):
        emit_reports(est, plot=str(tmp_path / "t.gif"), html=None)


def test_compare_keeps_every_number_whole_at_80_columns() -> None:
    # (issue 27: one row per configuration cut every number to "7..." in a narrow terminal)
    from rich.console import Console

    from trainmem.estimate import estimate
    from trainmem.report.compare import compare_table
    from trainmem.specs.training import TrainingConfig

    runs = [
        estimate("llama-3.2-1b", TrainingConfig(seq_len=512, micro_batch_size=b), gpu="RTX-4090")
        for b in (1, 8)
    ]
    labels = ["micro-batch-size=1", "micro-batch-size=8 activation-checkpointing=full"]
    console = Console(width=80, record=True)
    console.print(compare_table(runs, labels))
    text = console.export_text()
    assert "…" not in text
    for e in runs:
        assert f"{e.breakdown.allocated_bytes / 2**30:,.2f}" in text
