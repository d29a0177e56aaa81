"""A model whose own code fails on the traced batch (a diffusers forward that unpacks another
latent layout, a value check) gives one line naming the cause, never a traceback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import TraceError  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.trace.engine import run_trace  # noqa: E402


class _Unpacks(torch.nn.Module):
    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error("not enough values to unpack (expected 6, got 5)")


@pytest.mark.parametrize("error", [ValueError, IndexError, KeyError, AttributeError, NameError])
def test_model_code_errors_become_one_trace_error(error: type[Exception]) -> None:
    holder: dict[str, _Unpacks] = {}

    def build() -> _Unpacks:
        holder["m"] = _Unpacks(error)
        return holder["m"]

    with pytest.raises(TraceError, match=f"the traced step failed: {error.__name__}"):
        run_trace(
            build,
            lambda: torch.randn(2, 4),
            TrainingConfig(precision="32-true"),
            loss_fn=lambda out, batch: out.sum(),
        )
