"""A model whose own code fails on the traced batch (a diffusers forward that unpacks another
latent layout, a value check) gives one line naming the cause, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Invoke

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


_UPERNET = {
    "model_type": "upernet",
    "hidden_size": 32,
    "auxiliary_in_channels": 32,
    "auxiliary_channels": 16,
    "num_labels": 3,
    "backbone_config": {
        "model_type": "convnext",
        "hidden_sizes": [8, 16, 32, 64],
        "depths": [1, 1, 1, 1],
        "image_size": 64,
        "out_features": ["stage1", "stage2", "stage3", "stage4"],
    },
}


def test_batchnorm_with_one_value_per_channel_names_the_micro_batch(
    invoke: Invoke, tmp_path: Path
) -> None:
    """UperNet's pyramid pooling pools to 1 x 1 and batch-normalises it
    (modeling_upernet.py ``UperNetPyramidPoolingBlock``): at one image PyTorch refuses that in
    training on any device, as the real model's CPU forward here shows, and runs at two. The
    estimate refuses with the field and what works (the same refusal as timm's LeViT head,
    tests/trace/test_timm.py), not "the traced step failed"."""
    import json

    transformers = pytest.importorskip("transformers")
    from trainmem.trace._torch import import_torchvision

    import_torchvision(torch)  # (UperNet's module imports torchvision)
    config = transformers.AutoConfig.for_model(**_UPERNET)
    real = transformers.AutoModelForSemanticSegmentation.from_config(config).train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        real(pixel_values=torch.randn(1, 3, 64, 64))
    real(pixel_values=torch.randn(2, 3, 64, 64))  # two images run
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_UPERNET))
    result = invoke("estimate", str(path), "-e", "generic", "-b", "1", exit_code=2)
    assert "error: micro_batch_size: 1: UperNetForSemanticSegmentation batch-normalises" in (
        result.output
    )
    assert "allowed: --micro-batch-size 2 or more" in result.output
    invoke("estimate", str(path), "-e", "generic", "-b", "2")


class _Routes(torch.nn.Module):
    """An MoE-style per-expert loop: the experts its activations pick (``nonzero`` of a count,
    transformers' per-expert loop in modeling_step3p7.py / modeling_switch_transformers.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(4, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in torch.bincount(picked, minlength=2).nonzero():
            out = out + self.experts[int(e)](x)
        return out


def test_a_read_of_activation_values_is_refused_saying_so() -> None:
    """The fake tensors have no values: a forward that loops over the experts its router
    picked cannot be traced, and the refusal says so and names the op, not "the traced step
    failed" (the loop runs on real CPU tensors)."""
    _Routes()(torch.randn(2, 4)).sum().backward()  # the model runs for real
    with pytest.raises(TraceError) as info:
        run_trace(
            _Routes,
            lambda: torch.randn(2, 4),
            TrainingConfig(precision="32-true"),
            loss_fn=lambda out, batch: out.sum(),
        )
    message = str(info.value)
    assert message.startswith("_Routes's forward reads the values of its activations (aten.")
    assert "fake tensors do not have" in message
    assert "traced step failed" not in message
