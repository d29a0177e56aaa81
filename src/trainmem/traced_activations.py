"""Activation offloading applied to a traced step as the analytic engine's rule (issue 26).

Note [Activation offloading on a traced step]
    torchtune's ``OffloadActivations`` (torchtune/training/_activation_offloading.py) is a
    ``saved_tensors_hooks`` pair that copies each saved tensor to pinned CPU memory on side
    CUDA streams and brings it back before its backward; its streams and events do not exist
    on a CPU build, so it does not run in the trace. The analytic engine's rule
    (:class:`~trainmem.analytic.transforms.checkpointing.ActivationOffloading`): once a layer's
    forward has run, the previous layer's saved activations have left for the CPU (the last
    layer's stay); when a layer's backward begins, the previous layer's (the next one the
    backward needs) are prefetched, so the current and the prefetched layer's are on the GPU.
    On the traced step (traced without offloading) the same rule moves events:

    * a layer's saved activations are the ``ACTIVATION`` blocks allocated in its forward (what
      the recorder saw saved for the backward; under full checkpointing the layer output the
      next layer's checkpoint keeps);
    * they are freed after layer ``j + 1``'s last forward allocation and allocated again
      before its first backward allocation; their own frees in the backward stay;
    * a layer repeated by the generic path's composition (a ``Repeat`` body, Note [Composing the
      full depth]) frees and prefetches the ``{i_prev}`` copy of its own saved blocks, which are
      the previous layer's when the layers are alike (checked: a mismatch raises).

    Each micro-batch (a forward after a backward starts one) is rewritten on its own; a block
    list other than the model's layers (``model.layers``, ``transformer_blocks`` ...) is a stack
    of its own. Nothing else moves (the copies to and from the CPU are on side streams, their
    pinned host buffers outside the GPU).

Source: torchtune/training/_activation_offloading.py ``OffloadActivations``;
trainmem/analytic/transforms/checkpointing.py ``ActivationOffloading``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError, UnsupportedError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.traced_transforms import layer_of

__all__ = ["apply_activation_offloading"]

_INDEX = re.compile(r"^(.*)\.(\d+|\{i\})$")

LABEL = "saved activations prefetched from the CPU"

Layer = tuple[str, int]
"""A block list's path and a layer's index in it."""


def apply_activation_offloading(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced step without offloading as activation offloading has it (Note [Activation
    offloading on a traced step]).

    Args:
        schedule: a traced step of the same run with ``activation_offloading=False``.
        model: unused (the sizes are the traced blocks').
        training: the run.

    Returns:
        The schedule with each layer's saved activations off the GPU from the next layer's
        forward to its backward.

    Raises:
        UnsupportedError: the rewritten step does not pair its frees and allocations (layers
            repeated by the composition that are not alike).
    """
    out = StepSchedule(
        setup=tuple(_rewrite_steps(schedule.setup)),
        step=tuple(_rewrite_steps(schedule.step)),
        name=schedule.name,
    )
    try:
        list(out.events())
    except ScheduleError as exc:
        raise UnsupportedError(
            "activation offloading on this traced step: its repeated layers do not save the "
            f"same blocks as the layer before them ({exc}); use --engine analytic"
        ) from exc
    return out


def _phases(item: Item) -> set[str]:
    if isinstance(item, Op):
        return {item.phase}
    return set().union(*(_phases(x) for x in item.body))


def _rewrite_steps(items: Sequence[Item]) -> list[Item]:
    """Each micro-batch (a forward after a backward starts one) rewritten on its own."""
    out: list[Item] = []
    segment: list[Item] = []
    seen_backward = False
    for item in items:
        phases = _phases(item)
        if seen_backward and "forward" in phases and "backward" not in phases:
            out += _Segment.of(segment).rewrite()
            segment, seen_backward = [], False
        segment.append(item)
        seen_backward = seen_backward or "backward" in phases
    return out + _Segment.of(segment).rewrite()


def _layer(module: str) -> tuple[str, str] | None:
    """(block list, index or ``{i}``) of a module path inside a block list."""
    block = layer_of(module)
    m = _INDEX.match(block) if block else None
    return (m.group(1), m.group(2)) if m else None


def _fill(op: Op, i: int | str) -> Op:
    """``op`` of a repeated layer as layer ``i`` (an index, or ``{i_prev}``)."""
    text = "{" + i + "}" if isinstance(i, str) else str(i)
    return op._replace(key=op.key.replace("{i}", text), module=op.module.replace("{i}", text))


@dataclass(slots=True)
class _Segment:
    """One micro-batch: every layer's saved blocks and where its forward ends and its backward
    begins (indices into ``items``; a repeated layer's are in its ``Repeat`` body)."""

    items: list[Item]
    saved: dict[Layer, list[Op]] = field(default_factory=dict)
    forward_end: dict[Layer, int] = field(default_factory=dict)
    backward_begin: dict[Layer, int] = field(default_factory=dict)
    repeats: dict[int, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, items: list[Item]) -> _Segment:
        seg = cls(items)
        for k, item in enumerate(items):
            if isinstance(item, Repeat):
                seg._repeat(k, item)
            elif item.action == "alloc":
                seg._op(k, item)
        return seg

    def _op(self, k: int, op: Op) -> None:
        where = _layer(op.module)
        if where is None or op.phase not in ("forward", "backward") or where[1] == "{i}":
            return
        layer = (where[0], int(where[1]))
        if op.phase == "forward":
            self.forward_end[layer] = k
            if op.category is Cat.ACTIVATION:
                self.saved.setdefault(layer, []).append(op)
        else:
            self.backward_begin.setdefault(layer, k)

    def _repeat(self, k: int, item: Repeat) -> None:
        """A repeated layer: its saved blocks per index, its body marked for the rewrite."""
        allocs = [x for x in item.body if isinstance(x, Op) and x.action == "alloc"]
        where = {_layer(x.module) for x in allocs} - {None}
        phases = {x.phase for x in allocs}
        if len(where) != 1 or len(phases) != 1 or not phases <= {"forward", "backward"}:
            return
        stack, index = next(iter(where))  # type: ignore[misc]
        if index != "{i}":
            return
        self.repeats[k] = (stack, phases.pop())
        if "backward" in self.repeats[k]:
            return
        saved = [x for x in allocs if x.category is Cat.ACTIVATION]
        for n in range(item.count):
            self.saved[(stack, item.index(n))] = [_fill(x, item.index(n)) for x in saved]

    def rewrite(self) -> list[Item]:
        """The micro-batch with the saved blocks moved (Note [Activation offloading on a traced
        step])."""
        after: dict[int, list[Item]] = {}
        before: dict[int, list[Item]] = {}
        for (stack, j), k in self.forward_end.items():
            after.setdefault(k, []).extend(
                op._replace(action="free") for op in self.saved.get((stack, j - 1), [])
            )
        for (stack, j), k in self.backward_begin.items():
            before.setdefault(k, []).extend(
                op._replace(phase="backward", label=LABEL)
                for op in self.saved.get((stack, j - 1), [])
            )
        out: list[Item] = []
        for k, item in enumerate(self.items):
            out += before.get(k, [])
            out.append(self._repeated(k, item) if isinstance(item, Repeat) else item)
            out += after.get(k, [])
        return out

    def _repeated(self, k: int, item: Repeat) -> Repeat:
        """A repeated layer's body with the previous layer's saved blocks freed at its end
        (forward) or prefetched at its start (backward)."""
        if k not in self.repeats:
            return item
        stack, phase = self.repeats[k]
        saved = [
            x
            for x in item.body
            if isinstance(x, Op) and x.action == "alloc" and x.category is Cat.ACTIVATION
        ]
        if phase == "forward":
            saved = [_fill(x, "i_prev") for x in saved]
            body = (*item.body, *(x._replace(action="free") for x in saved))
        else:  # the previous layer's forward blocks, as the forward body saved them
            fwd = self._forward_template(stack)
            body = (*(_fill(x, "i_prev")._replace(phase="backward", label=LABEL) for x in fwd),
                    *item.body)  # fmt: skip
        return Repeat(body, item.count, item.reverse, item.start, item.independent)

    def _forward_template(self, stack: str) -> list[Op]:
        """The saved blocks of the forward's repeated body of ``stack`` (with ``{i}``)."""
        for k, (s, phase) in self.repeats.items():
            body = self.items[k]
            if s == stack and phase == "forward" and isinstance(body, Repeat):
                return [
                    x
                    for x in body.body
                    if isinstance(x, Op) and x.action == "alloc" and x.category is Cat.ACTIVATION
                ]
        return []
