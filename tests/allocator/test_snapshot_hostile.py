"""Hostile memory snapshots from the fuzz campaign (issue 29, item 4): a huge integer, a value
nested 200,000 deep, an unknown action with a None size. Each is one line from
``compare-snapshot`` and ``replay-snapshot``, read by the same restricted unpickler."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke
from trainmem.allocator.snapshot import loads_snapshot
from trainmem.errors import SnapshotError

_PLACEHOLDER = b"X" + (11).to_bytes(4, "little") + b"PLACEHOLDER"  # BINUNICODE "PLACEHOLDER"


def _with_deep_list(snapshot: dict[str, Any], depth: int = 200_000) -> bytes:
    """``snapshot`` pickled with its "PLACEHOLDER" string replaced by a list nested ``depth``
    deep: ``depth`` EMPTY_LIST opcodes, then ``depth - 1`` APPENDs (pickle itself would
    overflow the C stack writing one)."""
    data = pickle.dumps(snapshot, protocol=2)
    assert data.count(_PLACEHOLDER) == 1
    return data.replace(_PLACEHOLDER, b"]" * depth + b"a" * (depth - 1))


def _segment(**fields: Any) -> dict[str, Any]:
    return {"address": 0, "total_size": 2 * 2**20, "blocks": [], **fields}


CASES = {
    "huge int": pickle.dumps({"segments": [_segment(total_size=10**5000)]}),
    "deep list": _with_deep_list({"segments": [_segment(total_size="PLACEHOLDER")]}),
    "deep list in a trace": _with_deep_list(
        {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": "PLACEHOLDER"}]]}
    ),
    "unknown action, None size": pickle.dumps(
        {"segments": [_segment()], "device_traces": [[{"action": "weird", "size": None}]]}
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_snapshot_is_a_snapshot_error(case: str) -> None:
    with pytest.raises(SnapshotError) as info:
        loads_snapshot(CASES[case])
    text = str(info.value)
    assert "\n" not in text and len(text) < 300, text


@pytest.mark.parametrize("command", ["replay-snapshot", "compare-snapshot"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_snapshot_is_one_line_from_the_cli(
    invoke: Invoke, case: str, command: str, tmp_path: Path
) -> None:
    path = tmp_path / "hostile.pickle"
    path.write_bytes(CASES[case])
    args = [command, str(path)] + (["tiny-gpt2-test"] if command == "compare-snapshot" else [])
    result = invoke(*args, exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("error: snapshot field "), err
