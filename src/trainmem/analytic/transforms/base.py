"""The contract between the base step order and a mechanism's transform (issue 25).

A :class:`Transform` is one mechanism (FSDP, DeepSpeed ZeRO, pipelining, ...). Given a
:class:`RankContext` (what is trained, how, and this rank's model states), it says whether it
:meth:`~Transform.applies`, and at each named point of the step
(:mod:`~trainmem.analytic.transforms.points`) returns the ops it inserts there: allocations and
frees (:class:`~trainmem.schedule.Op`), repeated blocks (:class:`~trainmem.schedule.Repeat`), or
a :class:`Lifetime`, an allocation whose free the :class:`Emitter` places at a later point
(lifetimes from uses: no hand-paired free). A transform computes its tensors from the context's
model states and sizes only, never from the builder, so the same transform applies to a step
recorded by the trace engine (its states measured, :meth:`RankContext.build`).

Source: the lifetime rule is tinygrad's memory planner's (tinygrad/engine/memory.py
``_internal_memory_planner``: a buffer is freed after its last use), here stated per tensor as
the point that releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from trainmem.analytic.activations import ActivationProfile
from trainmem.analytic.tensor_states import StateLayout, TensorState
from trainmem.analytic.transforms.points import PHASE, POINTS, Point
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

_new_op = tuple.__new__


def alloc(
    size: int,
    cat: Cat,
    phase: Phase,
    key: str,
    module: str = "",
    label: str = "",
    stream: int = 0,
) -> Op:
    """An allocation of ``max(size, 0)`` bytes on CUDA stream ``stream``."""
    size = int(size)
    # NB: tuple.__new__ skips the named tuple's Python-level __new__ (the builder makes about
    # 140 ops per configuration the planner evaluates)
    return _new_op(Op, ("alloc", size if size > 0 else 0, cat, phase, key, module, label, stream))


def free(op: Op, phase: Phase) -> Op:
    """The free of ``op``'s allocation, in ``phase``."""
    _, size, cat, _, key, module, label, stream = op
    return _new_op(Op, ("free", size, cat, phase, key, module, label, stream))


ALL_GATHER_STREAM = 1
REDUCE_SCATTER_STREAM = 2
"""Streams of FSDP2's collectives (``FrameworkConventions.fsdp_collective_streams``)."""


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """One pipeline stage as a rank sees it.

    Attributes:
        stage: stage index (0 = first).
        num_layers: transformer layers held (all of them without pipelining).
        in_flight: micro-batches whose activations the stage holds at once (Korthikanti et al.
            2022 sec. 4.2.3: the first 1F1B stage holds p; interleaving adds (p - 1) / v; GPipe
            holds all of them).
        has_embedding: holds the input embeddings (first stage; the last stage too for tied
            embeddings, as Megatron keeps a copy for the output layer).
        has_head: holds the final norm, the output layer and the loss (last stage).
    """

    stage: int
    num_layers: int
    in_flight: float
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a transform may read: one rank's model, training setup and model states.

    Attributes:
        model / training: what is trained and how.
        rank: the pipeline stage this rank holds.
        emb_states / head_states / layer_states: this rank's parameter tensors before the
            layers, after them, and of one layer (:class:`~trainmem.analytic.tensor_states.
            TensorState`, bytes on this GPU; from the analytic layout or measured by a trace).
        head_grad_states / emb_grad_states: the tensors whose gradients the head's backward /
            the embedding's backward make (a tied embedding's with the head's).
        num_layers: layers on this rank.
        zero_stage: ZeRO / FSDP stage in effect (0 without sharding).
        grad_stream: CUDA stream the sharded gradients are made on (FSDP2's reduce-scatter
            stream with ``fsdp_collective_streams``; 0 otherwise).
        prof: the activation profile (None for a step whose activations were recorded).
        shared: schedule pieces that depend only on the model states (cached per layout).
    """

    model: ModelSpec
    training: TrainingConfig
    rank: PipelineRank
    emb_states: list[TensorState]
    head_states: list[TensorState]
    layer_states: list[TensorState]
    head_grad_states: list[TensorState]
    emb_grad_states: list[TensorState]
    num_layers: int
    zero_stage: int
    grad_stream: int
    prof: ActivationProfile | None = None
    shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        model: ModelSpec,
        training: TrainingConfig,
        rank: PipelineRank,
        layout: StateLayout,
        prof: ActivationProfile | None = None,
    ) -> RankContext:
        """The context of ``rank`` from the per-tensor layout (the analytic one, or one whose
        sizes a trace measured): a later stage holding a tied embedding keeps only the token
        embedding (Megatron's copy for the output layer)."""
        emb = layout.embedding if rank.has_embedding else []
        if rank.has_embedding and rank.stage > 0:
            emb = [s for s in layout.embedding if s.name == "embedding/tokens"]
        head = layout.head if rank.has_head else []
        tied = model.tie_word_embeddings and rank.has_head
        head_grads = head + [s for s in emb if tied and s.name == "embedding/tokens"]
        stage = training.zero_stage if training.sharding_degree > 1 else 0
        streams = training.conventions.fsdp_collective_streams and stage == 3
        return cls(
            model=model,
            training=training,
            rank=rank,
            emb_states=emb,
            head_states=head,
            layer_states=layout.layer,
            head_grad_states=head_grads,
            emb_grad_states=[s for s in emb if s not in head_grads],
            num_layers=rank.num_layers,
            zero_stage=stage,
            grad_stream=REDUCE_SCATTER_STREAM if streams else 0,
            prof=prof,
        )

    @property
    def profile(self) -> ActivationProfile:
        """The activation profile.

        Raises:
            ScheduleError: the context has none (a recorded step).
        """
        if self.prof is None:
            raise ScheduleError("this transform needs the analytic activation profile")
        return self.prof

    def trainable_elements(self) -> int:
        """Trainable elements on this rank before data-parallel sharding (its tensor-parallel
        slice of the embedding, head and layers)."""
        gb = max(dtype_bytes(self.training.grad_dtype), 1)
        outer = sum(s.full_grad_bytes for s in self.emb_states + self.head_states if s.trainable)
        layer = sum(s.full_grad_bytes for s in self.layer_states if s.trainable)
        return (outer + self.num_layers * layer) // gb


class Where(NamedTuple):
    """Where in the step a point is reached.

    Attributes:
        first_step: the warm-up step (buffers made lazily once are allocated in it).
        new_grads: this micro-batch's backward makes the gradients (the first of the step);
            later ones accumulate into them.
        reduce: the last micro-batch of a ``no_sync`` accumulation (it reduces the gradients).
        zero_grad: ``zero_grad()`` runs between this micro-batch's forward and backward.
        first_layer / last_layer: the layer runs first / last of the stack in this pass
            (execution order: the backward's first layer is the last one).
    """

    first_step: bool = False
    new_grads: bool = True
    reduce: bool = False
    zero_grad: bool = False
    first_layer: bool = False
    last_layer: bool = False


@dataclass(frozen=True, slots=True)
class Lifetime:
    """An allocation that lives until point ``release``: the :class:`Emitter` emits ``op`` where
    the transform returns it and its free (in the release point's phase) when ``release`` is
    reached, the tensors released at one point freed last-allocated first."""

    op: Op
    release: Point


Emitted = Op | Repeat | Lifetime


class Transform:
    """One mechanism as insertions into the base step order.

    Subclasses set :attr:`name`, override :meth:`applies` and the methods of the points they
    insert at (``step_begin`` for ``step.begin`` ...), each returning the ops in insertion
    order. The traits below are the few questions the base order asks of a mechanism.
    """

    name: ClassVar[str] = "transform"
    #: frees the gradients into its own buffer at the step (DeepSpeed ZeRO-1)
    frees_gradients_at_step: bool = False

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        """The mechanism is active on this rank."""
        return False

    def ops(self, point: Point, where: Where) -> Sequence[Emitted]:
        """The ops inserted at ``point``."""
        method: Callable[[Where], Sequence[Emitted]] = getattr(self, _METHOD[point])
        return method(where)

    def setup(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_pre_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_pre_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_post_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def backward_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batch_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def optimizer_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_end(self, where: Where) -> Sequence[Emitted]:
        return ()


_METHOD: dict[Point, str] = {p: p.replace(".", "_") for p in POINTS}


class Emitter:
    """The ops of a list of transforms at each point, with the frees their lifetimes imply.

    Use one emitter per piece built (a micro-batch, a step): every :class:`Lifetime` begun in
    it must reach its release point in it (:meth:`check`)."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = transforms
        self._pending: dict[Point, list[Op]] = {}

    def at(self, point: Point, where: Where) -> list[Item]:
        """The transforms' ops at ``point`` in order, then the frees of the lifetimes that end
        there (last allocated first)."""
        out: list[Item] = []
        for transform in self.transforms:
            for item in transform.ops(point, where):
                if isinstance(item, Lifetime):
                    out.append(item.op)
                    self._pending.setdefault(item.release, []).append(item.op)
                else:
                    out.append(item)
        ending = self._pending.pop(point, None)
        if ending:
            phase = PHASE[point]
            out += [free(op, phase) for op in reversed(ending)]
        return out

    def check(self) -> None:
        """Every lifetime begun has ended.

        Raises:
            ScheduleError: one has not (its release point was never reached).
        """
        if self._pending:
            raise ScheduleError(f"lifetimes never released: {sorted(self._pending)}")


def gradient_ops(
    ctx: RankContext, states: Sequence[TensorState], phase: Phase, key: str, module: str
) -> list[Op]:
    """The gradients of ``states`` as this rank holds them between backward and step (one per
    tensor; key ``grad/<key>/<n>``)."""
    return [
        alloc(s.grad_bytes, Cat.GRADIENT, phase, f"grad/{key}/{n}", module, "gradients",
              ctx.grad_stream)
        for n, s in enumerate(states)
    ]  # fmt: skip


def all_gradients(ctx: RankContext, phase: Phase) -> list[Item]:
    """Every gradient allocated at once (kept by ``zero_grad(set_to_none=False)``)."""
    layer = gradient_ops(ctx, ctx.layer_states, phase, "{i}", "layers.{i}")
    return [
        *gradient_ops(ctx, ctx.head_grad_states, phase, "head", "head"),
        Repeat(tuple(layer), ctx.num_layers),
        *gradient_ops(ctx, ctx.emb_grad_states, phase, "embedding", "embedding"),
    ]


def free_gradients(ctx: RankContext, phase: Phase) -> list[Item]:
    """The frees of :func:`all_gradients`, in the same order."""
    head = gradient_ops(ctx, ctx.head_grad_states, phase, "head", "head")
    layer = gradient_ops(ctx, ctx.layer_states, phase, "{i}", "layers.{i}")
    emb = gradient_ops(ctx, ctx.emb_grad_states, phase, "embedding", "embedding")
    return [
        *(free(op, phase) for op in head),
        Repeat(tuple(free(op, phase) for op in layer), ctx.num_layers),
        *(free(op, phase) for op in emb),
    ]


def splice(
    ops: Sequence[Item],
    positions: Mapping[Point, int],
    transforms: Sequence[Transform],
    where: Where | None = None,
) -> list[Item]:
    """``ops`` (a recorded step, e.g. :meth:`~trainmem.schedule.StepSchedule.from_timeline`'s
    ``step``) with the transforms' ops inserted: the ops of point ``p`` go before
    ``ops[positions[p]]`` (``len(ops)``: at the end), points met in step order
    (:data:`~trainmem.analytic.transforms.points.POINTS`) at one position, points not in
    ``positions`` are skipped. The trace engine's steps are one flat run of ops, so the layer
    points (whose ops a ``Repeat`` body would carry) are for the analytic builder.

    Raises:
        ScheduleError: a position outside ``ops`` or before an earlier point's, or a lifetime
            whose release point is not in ``positions``.
    """
    where = Where() if where is None else where
    em = Emitter(transforms)
    at: dict[int, list[Item]] = {}
    last = 0
    for point in POINTS:
        if point not in positions:
            continue
        index = positions[point]
        if not last <= index <= len(ops):
            raise ScheduleError(
                f"point {point}: position {index} outside {last}..{len(ops)} (points go in "
                "step order)"
            )
        last = index
        at.setdefault(index, []).extend(em.at(point, where))
    em.check()
    out: list[Item] = []
    for index, item in enumerate(ops):
        out += at.get(index, [])
        out.append(item)
    out += at.get(len(ops), [])
    return out
