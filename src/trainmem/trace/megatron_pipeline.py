"""Megatron's pipeline stage buffers on the traced torch pipelining schedule: each sent output's
data freed, every received tensor allocated per message (Note [Megatron's pipeline stage
buffers] in :mod:`trainmem.analytic.pipeline`).

Note [Megatron's stage buffers in the trace]
    The trace runs ``torch.distributed.pipelining`` (Note [Tracing pipeline parallelism] in
    :mod:`trainmem.trace.pipeline`); for a framework with
    ``FrameworkConventions.pipeline_sent_outputs_freed`` (Megatron) each ``PipelineStage`` is
    changed in place to keep what megatron-core's schedules keep:

    * ``get_fwd_send_ops``: once the sends of a micro-batch's output are made (the fake
      process group completes them at once), the output kept in ``fwd_cache`` and the sent
      tensor get megatron-core's ``deallocate_output_tensor``: ``.data`` replaced by a
      1-element tensor, the grad_fn kept. The stage's backward then runs megatron-core's
      ``custom_backward`` (the C++ engine's ``run_backward`` on the 1-element output with the
      received gradient, ``accumulate_grad=True``), and returns the inputs' gradients as
      torch's ``stage_backward`` does (``val.grad``, then ``val.grad = None``).
    * ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``: a new buffer per message, as
      p2p_communication.py ``_communicate``'s ``torch.empty`` (shape, stride and dtype of the
      buffer torch's ``_prepare_forward_infra`` / ``_prepare_backward_infra`` made at the
      first step); ``_retrieve_recv_activations`` / ``_retrieve_recv_grads`` drop the stage's
      reference once the micro-batch has taken it, so the input lives as long as
      ``fwd_cache`` holds it for the backward and the gradient through its backward.

    * The last stage's loss: torch's schedule keeps each micro-batch's loss in
      ``_internal_losses`` to the step's end, and with it the loss's autograd graph, whose
      ``AccumulateGrad`` node holds the stage's received input (a leaf): every micro-batch's
      input stays alive through the step. megatron-core drops its reference once the backward
      ran (``output_tensors.pop(0)`` into ``backward_step``; ``forward_data_store`` gets
      ``loss_func``'s reported values, detached in pretrain_gpt.py), so the kept loss is
      detached after the micro-batch's backward (:func:`drop_loss_graphs`).

    A stage output that is a view (``DTensor.to_local`` under sequence parallelism) has its
    base's data freed too: megatron-core asserts ``out._base is None`` (its stages hand on
    the residual stream itself, not a view of it).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any
from unittest import mock

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["drop_loss_graphs", "free_sent_outputs"]


def deallocate_output(out: Any) -> None:
    """megatron-core ``deallocate_output_tensor``: a tensor's data replaced by one element of
    its dtype, its grad_fn kept; a view's base freed too (Note [Megatron's stage buffers in
    the trace])."""
    if not isinstance(out, torch.Tensor) or out.numel() <= 1:
        return
    base = out._base
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
    if base is not None:
        deallocate_output(base)


def megatron_stage_backward(
    stage_output: Any, output_grads: Any, input_values: list[Any]
) -> tuple[Any, ...]:
    """megatron-core ``custom_backward`` on a stage's freed outputs, then the inputs' gradients
    as torch's ``stage_backward`` returns them (torch/distributed/pipelining/_backward.py)."""
    from torch.autograd.variable import Variable

    pairs = [
        (o, g)
        for o, g in zip(stage_output, output_grads, strict=True)
        if isinstance(o, torch.Tensor) and (o.requires_grad or o.grad_fn is not None)
    ]
    Variable._execution_engine.run_backward(
        tensors=tuple(o for o, _ in pairs),
        grad_tensors=tuple(g for _, g in pairs),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
    del pairs
    grads: list[Any] = []
    for val in input_values:
        if isinstance(val, torch.Tensor):
            grads.append(val.grad)
            val.grad = None
        else:
            grads.append(None)
    return tuple(grads)


def _megatron_backward() -> Any:
    """torch's ``stage_backward`` replaced by :func:`megatron_stage_backward` while one stage's
    backward runs (a context manager)."""
    stage_module = importlib.import_module("torch.distributed.pipelining.stage")
    return mock.patch.object(stage_module, "stage_backward", megatron_stage_backward)


def _per_message(stage: Any, infos_of: Callable[[int], Any], name: str, take: str) -> None:
    """``stage.<name>(i)`` receives into new buffers, ``stage.<take>(i)`` drops them after."""
    shapes: dict[int, tuple[Any, Any, Any, Any]] = {}
    get_ops, retrieve = getattr(stage, name), getattr(stage, take)

    def recv_infos(i: int) -> list[Any]:
        return [x for x in infos_of(i) if not x.is_root_arg and x.tensor_meta is not None]

    @functools.wraps(get_ops)
    def ops(i: int) -> Any:
        for info in recv_infos(i):
            if id(info) not in shapes:  # the buffer torch made at the first step
                b = info.buffer
                shapes[id(info)] = (b.size(), b.stride(), b.dtype, b.device)
            size, stride, dtype, device = shapes[id(info)]
            info.buffer = torch.empty_strided(size, stride, dtype=dtype, device=device)
        return get_ops(i)

    @functools.wraps(retrieve)
    def taken(i: int) -> Any:
        out = retrieve(i)
        for info in recv_infos(i):
            info.buffer = None
        return out

    setattr(stage, name, ops)
    setattr(stage, take, taken)


def free_sent_outputs(stage: Any) -> None:
    """Megatron's sends and receives on one ``PipelineStage``, in place (Note [Megatron's
    stage buffers in the trace])."""
    send = stage.get_fwd_send_ops

    @functools.wraps(send)
    def send_ops(i: int) -> Any:
        ops = send(i)
        for op in ops:
            deallocate_output(op.tensor)
        for out in stage.fwd_cache[i][0]:
            deallocate_output(out)
        return ops

    backward = stage.backward_maybe_with_nosync

    @functools.wraps(backward)
    def backward_freed(*args: Any, **kwargs: Any) -> Any:
        with _megatron_backward():
            return backward(*args, **kwargs)

    if not stage.is_last:
        stage.get_fwd_send_ops = send_ops
        stage.backward_maybe_with_nosync = backward_freed
    if not stage.is_first:
        _per_message(
            stage,
            lambda i: stage.args_recv_info[i],
            "get_fwd_recv_ops",
            "_retrieve_recv_activations",
        )
    if not stage.is_last:
        _per_message(
            stage, lambda i: stage.grad_recv_info[i], "get_bwd_recv_ops", "_retrieve_recv_grads"
        )


def drop_loss_graphs(schedule: Any, stages: list[Any]) -> None:
    """The schedule keeps each last-stage loss detached once its backward ran (Note
    [Megatron's stage buffers in the trace]), in place."""
    for stage in stages:
        if not stage.is_last:
            continue
        backward = stage.backward_one_chunk

        @functools.wraps(backward)
        def backward_then_detach(i: int, *args: Any, _run: Any = backward, **kwargs: Any) -> Any:
            out = _run(i, *args, **kwargs)
            losses = schedule._internal_losses
            if 0 <= i < len(losses) and isinstance(losses[i], torch.Tensor):
                losses[i] = losses[i].detach()
            return out

        stage.backward_one_chunk = backward_then_detach
