"""An op that fails on fake tensors is reported once, by trainmem (issue 29, item 8): torch's
fake-tensor mode logged its own 35-50 line traceback of the same failure (a GPT-J config whose
``rotary_dim`` does not fit the heads) before the one ``error: the traced step failed`` line."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainmem.trace._torch import require_torch  # noqa: E402

with FakeTensorMode():  # the first fake op initialises dispatch: at collection, not in the test
    torch.empty(1, 2) * torch.empty(3, 1)


def test_a_failing_fake_op_writes_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    require_torch()  # what every trace path calls first
    capfd.readouterr()
    with FakeTensorMode(), pytest.raises(RuntimeError, match="broadcast|size"):
        torch.empty(1, 128, 1, 8) * torch.empty(1, 128, 4, 7)
    assert capfd.readouterr().err == ""
    assert not logging.getLogger("torch._subclasses.fake_tensor").isEnabledFor(logging.CRITICAL)
