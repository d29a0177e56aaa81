"""Timeline: the allocation stream of one training step, passed from an engine to the allocator
simulator and the plots. Pure data, no torch.

Each :class:`AllocEvent` is one ``malloc`` or ``free`` of a tensor storage as the CUDA caching
allocator would see it (``size_bytes`` is the requested size, before the allocator's 512-byte
rounding). ``block_id`` pairs a free with its alloc.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from trainmem.breakdown import MemoryCategory

Action = Literal["alloc", "free"]
Phase = Literal["load", "init", "forward", "backward", "optimizer", "zero_grad"]
PHASES: tuple[str, ...] = ("load", "init", "forward", "backward", "optimizer", "zero_grad")

ALL_GATHER_STREAM = 1
REDUCE_SCATTER_STREAM = 2
"""Streams of FSDP's collectives (``FrameworkConventions.fsdp_collective_streams``: FSDP2's
all-gather / reduce-scatter streams, FSDP1's unshard / post-backward streams)."""
PRE_UNSHARD_STREAM = 3
"""FSDP1's pre-unshard stream (torch distributed/fsdp/_runtime_utils.py ``_unshard``: ``with
state._device_handle.stream(pre_unshard_stream): handle.pre_unshard()``), where a CPU-offloaded
shard is copied to the GPU (Note [FSDP1 offloaded shard copy])."""


def module_group(path: str, depth: int | None = 3) -> str:
    """Shorten a dotted module path to its first ``depth`` components (``transformer.h.3``);
    None keeps the full path. Code outside any module is ``(model)``."""
    if not path:
        return "(model)"
    parts = path.split(".")
    return ".".join(parts if depth is None else parts[:depth])


@dataclass(frozen=True, slots=True)
class AllocEvent:
    """One allocation or free.

    Attributes:
        action: ``"alloc"`` or ``"free"``.
        block_id: identifies the storage; a free carries the id of its alloc.
        size_bytes: requested bytes (same on the free as on its alloc).
        category: what the storage holds.
        phase: step phase the event happened in.
        module: dotted module path that was running (``"transformer.h.3.attn"``), ``""`` if none.
        stream: CUDA stream id (0 = default stream).
    """

    action: Action
    block_id: int
    size_bytes: int
    category: MemoryCategory
    phase: Phase
    module: str = ""
    stream: int = 0


class EventRecord(NamedTuple):
    """An :class:`AllocEvent` as a named tuple, for a replay that keeps no timeline (the
    planner's probes): the same fields, built in a seventh of the time (0.1 us instead of 0.7;
    a probe replays thousands of events).

    Attributes:
        action / block_id / size_bytes / category / phase / module / stream: as
            :class:`AllocEvent`'s.
    """

    action: Action
    block_id: int
    size_bytes: int
    category: MemoryCategory
    phase: Phase
    module: str = ""
    stream: int = 0


EventFields = tuple[Action, int, int, MemoryCategory, Phase, str, int]
"""An event's fields as a plain tuple, in :class:`EventRecord`'s order: what a schedule hands
the driver's replay (:meth:`~trainmem.schedule.StepSchedule.replay_events`). A plain tuple is
built by one bytecode from the values on the stack, about a quarter of the time of an
``EventRecord`` (a subclass instance, made by a call); a replay reads an event's fields by
unpacking it, never by name (Note [Plain event tuples] in ``trainmem.schedule``)."""


@dataclass(slots=True)
class Timeline:
    """Ordered allocation events of one steady-state step, plus the blocks live before it.

    Attributes:
        events: ordered events.
        name: free text (model + config) for reports.
        steady_state_start: index of the first event of the steady-state step; events before
            it set up the state the step starts from (weights, optimizer states, a warm-up step).
            Plots show ``events[steady_state_start:]`` with the live bytes carried in.
    """

    events: list[AllocEvent] = field(default_factory=list)
    name: str = ""
    steady_state_start: int = 0

    def __iter__(self) -> Iterator[AllocEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def live_bytes(self) -> list[int]:
        """Live requested bytes after each event (no rounding)."""
        out: list[int] = []
        live = 0
        for ev in self.events:
            live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """(peak live requested bytes, index of the event that set it); (0, -1) if empty."""
        best, at = 0, -1
        for i, live in enumerate(self.live_bytes()):
            if live > best:
                best, at = live, i
        return best, at
