"""DeepSpeed ZeRO-3's gathered parameters as a transform (Note [DeepSpeed ZeRO-3 parameter
gathers]): the input embeddings' at the start of the forward, the layers' prefetch pool up to
``stage3_max_live_parameters`` through the forward and the backward, the output layer's weight
fetched while the last layers run and released after the head's backward, the layers kept
across the turnaround, and under parameter offload each root gather's host-to-device copy,
all on the all-gather stream with ``overlap_comm`` (their own pool of cached blocks).

Source: DeepSpeed runtime/zero/partitioned_param_coordinator.py, partition_parameters.py,
v0.8.0 (cited per rule in :mod:`trainmem.analytic.zero3_gathers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
)
from trainmem.analytic.zero3_gathers import Zero3Gathers, zero3_gathers
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.timeline import Phase


def deepspeed_zero3_gathers(ctx: RankContext) -> Zero3Gathers:
    """The rank's :class:`~trainmem.analytic.zero3_gathers.Zero3Gathers` (computed once per
    context)."""
    cached = ctx.memo.get("zero3_gathers")
    if isinstance(cached, Zero3Gathers):
        return cached
    out = zero3_gathers(
        ctx.layer_states,
        ctx.num_layers,
        ctx.emb_states,
        ctx.head_states,
        tied=ctx.model is not None and ctx.model.tie_word_embeddings and ctx.rank.has_head,
        training=ctx.training,
    )
    ctx.memo["zero3_gathers"] = out
    return out


def applies_to(ctx: RankContext) -> bool:
    """DeepSpeed ZeRO-3 (``zero_ipg_buckets`` at stage 3), unless it gathers nothing: one rank
    from 0.9.0 with the parameters on the GPU (``TrainingConfig.zero3_one_rank_views``)."""
    t = ctx.training
    views = t.zero3_one_rank_views and t.offload != "optimizer+params"
    return t.conventions.zero_ipg_buckets and ctx.zero_stage == 3 and not views


class DeepSpeedZero3Gathers(Transform):
    """DeepSpeed ZeRO-3's gathered parameters of one rank (sizes:
    :func:`deepspeed_zero3_gathers`).

    Inserts: ``micro_batch.begin`` the embeddings' (and their offload copy), freed at
    ``stack.pre_forward`` or kept to the head's / the embedding's backward;
    ``stack.pre_forward`` the layers' pool until ``stack.post_forward``, where the head's
    weight is fetched before the pool is freed and the turnaround's layers are kept until
    ``stack.pre_backward``; ``stack.pre_backward`` the pool again until
    ``stack.post_backward``; ``embedding.pre_backward`` the embeddings again for a trainable
    embedding's backward.
    """

    name = "deepspeed_gathers"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.g = deepspeed_zero3_gathers(ctx)

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return applies_to(ctx)

    def _gather(self, size: int, phase: Phase, key: str, module: str, label: str) -> list[Op]:
        """A gather of ``size`` bytes: the gathered buffer, then the offloaded partition's
        copy beside it (allocated and freed)."""
        op = alloc(size, Cat.TEMPORARY, phase, key, module, label, self.g.stream)
        copy = alloc(
            self.g.copy(size),
            Cat.TEMPORARY,
            phase,
            f"{key}/h2d",
            module,
            "the offloaded partition copied to the GPU for the gather",
            self.g.stream,
        )
        return [op, copy, free(copy, phase)] if copy.size_bytes else [op]

    def _embedding(self, phase: Phase) -> list[Op]:
        return self._gather(
            self.g.embedding,
            phase,
            "gather/embedding",
            "embedding",
            "the embeddings' gathered weights",
        )

    def _pool(self, phase: Phase) -> Op:
        label = "the layers' gathered weights (prefetched up to stage3_max_live_parameters)"
        return alloc(
            self.g.pool, Cat.TEMPORARY, phase, "gather/pool", "layers", label, self.g.stream
        )

    def _turnaround(self) -> Op:
        label = "the layers' gathered weights kept from their forward to their backward"
        size, stream = self.g.turnaround, self.g.stream
        return alloc(size, Cat.TEMPORARY, "forward", "gather/kept", "layers", label, stream)

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        if not self.g.embedding:
            return ()
        first, *copy = self._embedding("forward")
        if self.g.embedding_release == "stack.pre_forward":
            return [first, *copy]  # freed explicitly before the pool fills
        return [Lifetime(first, self.g.embedding_release), *copy]

    def stack_pre_forward(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.g.embedding and self.g.embedding_release == "stack.pre_forward":
            out.append(free(self._embedding("forward")[0], "forward"))
        out.append(self._pool("forward"))
        return out

    def stack_post_forward(self, where: Where) -> Sequence[Emitted]:
        out: list[Emitted] = []
        if self.g.head:
            head, *copy = self._gather(
                self.g.head, "forward", "gather/head", "head", "the output layer's gathered weight"
            )
            out += [Lifetime(head, "head.post_backward"), *copy]
        out += [free(self._pool("forward"), "forward"), self._turnaround()]
        return out

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return [
            free(self._turnaround(), "backward"),
            Lifetime(self._pool("backward"), "stack.post_backward"),
        ]

    def embedding_pre_backward(self, where: Where) -> Sequence[Emitted]:
        if not self.g.embedding_backward:
            return ()
        first, *copy = self._embedding("backward")
        return [Lifetime(first, "embedding.post_backward"), *copy]
