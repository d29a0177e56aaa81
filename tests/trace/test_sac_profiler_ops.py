"""Selective checkpointing's replay with ``record_function`` markers that differ between the
forward and the recompute (Note [Profiler ops under selective checkpointing] in
trainmem/trace/sac.py): FSDP1's hooks open a different number of them in the two passes."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.utils.checkpoint as checkpoint  # noqa: E402

from trainmem.trace.sac import ignore_profiler_ops, selective_policy  # noqa: E402

PROFILER = {
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _step() -> None:
    """One forward and backward of a region whose recompute opens one marker more, as
    FSDP1's ``rate_limiter`` does when its free-event queue fills in one pass only."""
    passes = []

    def region(x: Any) -> Any:
        with torch.profiler.record_function("both passes"):
            y = torch.mm(x, x)
        if passes:  # the recompute
            with torch.profiler.record_function("recompute only"):
                pass
        passes.append(1)
        return (y.sin() @ x).sum()

    x = torch.randn(4, 4, requires_grad=True)
    out = checkpoint.checkpoint(
        region,
        x,
        use_reentrant=False,
        context_fn=lambda: checkpoint.create_selective_checkpoint_contexts(selective_policy()),
    )
    out.backward()
    assert len(passes) == 2 and x.grad is not None


def test_extra_markers_in_the_recompute_break_the_replay_unless_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpoint, "SAC_IGNORED_OPS", set(checkpoint.SAC_IGNORED_OPS) - PROFILER)
    with pytest.raises(RuntimeError, match="invocation index 1 encountered during backward"):
        _step()
    ignore_profiler_ops()
    assert checkpoint.SAC_IGNORED_OPS >= PROFILER
    _step()
