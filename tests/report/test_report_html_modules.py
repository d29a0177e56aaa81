"""The HTML report (self-contained, offline) and the per-module tables."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from trainmem.breakdown import MemoryEstimate
from trainmem.estimate import estimate
from trainmem.report.html import comparison_labels, render_html, write_html
from trainmem.report.modules import activation_rows, module_group, module_tables, peak_rows
from trainmem.specs.training import TrainingConfig

TINY = TrainingConfig(micro_batch_size=2, seq_len=64)


@pytest.fixture(scope="module")
def tiny() -> MemoryEstimate:
    return estimate("tiny-gpt2-test", TINY, gpu="T4")


def test_activation_rows_sum_to_the_forward_footprint(tiny: MemoryEstimate) -> None:
    rows = activation_rows(tiny, top=100)
    assert {r["module"] for r in rows} == {"embedding", "layers.0", "layers.1", "head"}
    # both layers save the same terms
    by = {r["module"]: r["activation_bytes"] for r in rows}
    assert by["layers.0"] == by["layers.1"] > 0
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-3)
    json.dumps(rows)


def test_peak_rows_sum_to_the_plotted_peak(tiny: MemoryEstimate) -> None:
    from trainmem.report.plots import timeline_series

    rows = peak_rows(tiny, top=1000)
    assert (
        sum(r["bytes"] for r in rows) == timeline_series(tiny.timeline, reserved=False).peak_bytes
    )
    assert rows == sorted(rows, key=lambda r: -r["bytes"])
    short = peak_rows(tiny, top=2)
    assert len(short) == 3 and short[-1]["module"].startswith("(other ")
    assert sum(r["bytes"] for r in short) == sum(r["bytes"] for r in rows)


def test_module_group_and_tables(tiny: MemoryEstimate) -> None:
    assert module_group("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert module_group("transformer.h.3.attn", None) == "transformer.h.3.attn"
    assert module_group("") == "(model)"
    acts, peak = module_tables(tiny)
    assert acts.row_count == 4 and peak.row_count >= 5


def test_no_timeline_gives_empty_rows(tiny: MemoryEstimate) -> None:
    est = estimate("tiny-gpt2-test", TINY)
    est.timeline = None
    assert activation_rows(est) == [] and peak_rows(est) == []
    assert "no per-module tables" in render_html(est, plots=False)


def test_html_is_self_contained(tiny: MemoryEstimate, tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    other = estimate(
        "tiny-gpt2-test",
        TrainingConfig(micro_batch_size=2, seq_len=64, activation_checkpointing="full"),
        gpu="T4",
    )
    write_html(tiny, path, [other])
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    # no external assets: no src/href pointing anywhere but data: URIs
    assert not re.search(r'(src|href)="(?!data:)', text)
    assert "<script" not in text and "http://" not in text and "https://" not in text
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 2  # timeline + comparison bars
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    # the breakdown table, the per-module tables, the configuration, the comparison labels
    assert "<h2>Breakdown at the peak</h2>" in text and "<td>optimizer states</td>" in text
    assert f"{tiny.breakdown.allocated_bytes:,}" in text
    assert "Live at the peak, by module and category" in text and "<td>layers.0</td>" in text
    assert "<td>activation_checkpointing</td><td>none</td>" in text
    assert "<td>micro_batch_size</td><td>2</td>" in text
    assert "activation_checkpointing=full" in text
    assert "fits" in text and "T4" in text


def test_html_escapes_and_labels(tiny: MemoryEstimate) -> None:
    tiny2 = estimate("tiny-gpt2-test", TINY)
    tiny2.notes.append("<b>not markup</b>")
    text = render_html(tiny2, plots=False)
    assert "&lt;b&gt;not markup&lt;/b&gt;" in text and "<img" not in text
    assert comparison_labels([tiny, tiny]) == ["#1", "#2"]
    assert comparison_labels([tiny, tiny2]) == ["gpu=T4", "gpu=None"]
