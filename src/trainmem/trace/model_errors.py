"""The model's own errors on the traced step that a GPU run meets too, as refusals naming the
setting and what would work (every other error of the model's code is one ``the traced step
failed`` line: :func:`trainmem.trace.engine.run_trace`)."""

from __future__ import annotations

from typing import Any

from trainmem.errors import SpecError

__all__ = ["refusal_of"]

_ONE_VALUE = "Expected more than 1 value per channel when training"


def refusal_of(exc: BaseException, model: Any, micro_batch_size: int) -> SpecError | None:
    """The refusal a model's error stands for, or None.

    A micro-batch that leaves a BatchNorm one value per channel (batch-normalised pooled
    features: MobileNetV4's and LeViT's timm heads, UperNet's 1 x 1 pyramid-pooling branch,
    transformers modeling_upernet.py ``UperNetPyramidPoolingBlock``): PyTorch refuses it in
    training on any device (torch/nn/functional.py ``_verify_batch_size``: "Expected more than 1
    value per channel when training"), so the real run fails as the trace does.

    Args:
        exc: the error the model's code raised.
        model: the traced model (a peft wrapper names its base model).
        micro_batch_size: the run's micro-batch.

    Returns:
        The :class:`SpecError` naming ``micro_batch_size``, or None for any other error.
    """
    if not isinstance(exc, ValueError) or _ONE_VALUE not in str(exc):
        return None
    name = type(getattr(model, "get_base_model", lambda: model)()).__name__
    got = str(exc).rsplit("got ", 1)[-1]
    return SpecError(
        "micro_batch_size",
        f"{micro_batch_size}: {name} batch-normalises a tensor with one value per channel at "
        f"this micro-batch ({got}), which PyTorch refuses in training on any device "
        "(torch.nn.functional.batch_norm); allowed: --micro-batch-size 2 or more",
    )
