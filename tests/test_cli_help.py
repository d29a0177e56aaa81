"""``estimate --help`` is a few panels by concern (the web page's groups), and no help text is
cut or swallowed at 80 columns (issue 27)."""

from __future__ import annotations

import pytest

from conftest import Invoke
from trainmem.specs.groups import FIELD_GROUPS


def _help(invoke: Invoke, columns: int) -> str:
    return invoke("estimate", "--help", env={"COLUMNS": str(columns)}).output


@pytest.fixture(scope="module")
def help_text(invoke: Invoke) -> str:
    return _help(invoke, 80)


def test_options_are_grouped_by_concern(help_text: str) -> None:
    for panel in (*FIELD_GROUPS, "Model, GPU and output", "Reports", "Config files and --set"):
        assert f"─ {panel} ─" in help_text, panel


def test_nothing_is_cut_at_100_columns(invoke: Invoke) -> None:
    assert "…" not in _help(invoke, 100)


def test_no_value_is_cut_or_swallowed_at_80_columns(help_text: str) -> None:
    # (typer's option-name column still shortens the longest flag names at 80 columns)
    # "[default: ...]" inside a help text is rich markup unless escaped; it must show
    flat = " ".join(help_text.replace("│", " ").split())
    assert "Tokens per sequence. [default: model context, max 4096]" in flat
    for value in ("fp8-mixed", "paged-adamw-8bit", "hybrid-shard", "no-shard", "gptq-int4"):
        assert value in flat, value
