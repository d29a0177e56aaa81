"""Every mechanism's step schedule as recorded (issue 25, "record first"): a refactor of the
analytic step must reproduce each expanded allocation stream byte for byte; a deliberate change
of the memory model re-records them (``python benchmarks/golden_schedules.py --write``) in its
own commit that says why."""

from __future__ import annotations

import json

import pytest

from benchmarks import golden_schedules as golden

STORED = json.loads(golden.GOLDEN.read_text(encoding="utf-8"))


def test_the_grid_is_recorded() -> None:
    assert sorted(STORED) == sorted(golden.GRID)


@pytest.mark.parametrize("name", sorted(golden.GRID))
def test_schedule_is_as_recorded(name: str) -> None:
    assert golden.record(name) == STORED[name], (
        f"{name}: the step schedule changed; if deliberate, re-record with "
        "`python benchmarks/golden_schedules.py --write` in a commit that says why"
    )


def test_a_changed_schedule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # the hash covers every event's size: one byte more anywhere changes it
    from trainmem.timeline import AllocEvent

    entry = golden.record("gpt2 bf16-mixed")
    original = golden._events_hash

    def shifted(timeline: object) -> str:
        events = list(timeline)  # type: ignore[call-overload]
        first = events[0]
        events[0] = AllocEvent(
            first.action, first.block_id, first.size_bytes + 1, first.category, first.phase
        )
        return original(events)

    monkeypatch.setattr(golden, "_events_hash", shifted)
    assert golden.record("gpt2 bf16-mixed")["ranks"] != entry["ranks"]
