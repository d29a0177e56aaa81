"""The model's own errors on the traced step that a GPU run meets too, as refusals naming the
setting and what would work, and the reads of activation values the trace cannot run, as
refusals saying so (every other error of the model's code is one ``the traced step
failed`` line: :func:`trainmem.trace.engine.run_trace`)."""

from __future__ import annotations

from typing import Any

from trainmem.errors import SpecError, TraceError, TrainmemError

__all__ = ["refusal_of"]

_ONE_VALUE = "Expected more than 1 value per channel when training"

_VALUE_READS = frozenset({"DataDependentOutputException", "DynamicOutputShapeException"})
"""torch/_subclasses/fake_tensor.py's exceptions for an op that needs a fake tensor's values
(named, not imported: this module imports no torch)."""


def refusal_of(exc: BaseException, model: Any, micro_batch_size: int) -> TrainmemError | None:
    """The refusal a model's error stands for, or None.

    A forward that reads the values of its activations (an MoE's per-expert loop over the
    experts its router picked, ``(counts > 0).nonzero()``; a ``.item()`` or ``.tolist()`` of a
    routing count; a check on values): the fake tensors the trace runs on have shapes but no
    values (torch/_subclasses/fake_tensor.py raises ``DynamicOutputShapeException`` for an op
    whose output shape depends on values, ``DataDependentOutputException`` for a value read on
    the host), so no setting makes the trace run: a :class:`TraceError` naming the op and
    saying so (a vision-language model's step with an image then runs on text only, as on any
    trace failure: ``trace/generic.py`` ``_trace_config``). The GPU run does not meet it; the
    values a synthetic batch knows (its ids, masks and grids, Note [Known values of a
    synthetic batch]) never raise it.

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
        The :class:`SpecError` naming ``micro_batch_size``, the :class:`TraceError` of a value
        read, or None for any other error.
    """
    name = type(getattr(model, "get_base_model", lambda: model)()).__name__
    if type(exc).__name__ in _VALUE_READS:
        return TraceError(
            f"{name}'s forward reads the values of its activations ({exc}: an MoE's per-expert "
            "loop over the experts its router picked, a value read on the host or a check on "
            "values), which the traced step's fake tensors do not have; trainmem cannot trace "
            "this model (no setting changes that); use --engine analytic"
        )
    if not isinstance(exc, ValueError) or _ONE_VALUE not in str(exc):
        return None
    got = str(exc).rsplit("got ", 1)[-1]
    return SpecError(
        "micro_batch_size",
        f"{micro_batch_size}: {name} batch-normalises a tensor with one value per channel at "
        f"this micro-batch ({got}), which PyTorch refuses in training on any device "
        "(torch.nn.functional.batch_norm); allowed: --micro-batch-size 2 or more",
    )
