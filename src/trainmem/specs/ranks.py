"""How the world of ranks is laid out, one answer for every engine (``details.rank_map``).

Note [One rank map]
    The world is ``pipeline x data x context x tensor`` ranks (expert parallelism is not
    modelled: every rank holds all the experts of its layers). Ranks are numbered with the
    tensor-parallel index varying fastest, then context, data and pipeline: Megatron's default
    order (megatron/core/parallel_state.py ``RankGenerator``, ``order="tp-cp-ep-dp-pp"``) and
    torchtitan's mesh (torchtitan/distributed/parallel_dims.py ``ParallelDims``: ``pp,
    dp_replicate, dp_shard, cp, tp``, the last fastest) number them alike, so pipeline rank
    ``r`` is the global ranks ``r * n`` to ``(r + 1) * n - 1`` with ``n = dp * cp * tp``.

    The layers of each pipeline stage are :func:`stage_layers` (Megatron's or torchtitan's
    split; the model chunks of interleaved 1F1B are stages, stage ``s`` on pipeline rank
    ``s % p``). The ranks whose memory differs are the first and the last
    pipeline rank, and the first middle rank holding the most layers when it holds more than the
    first; of each, the data / context / tensor-parallel index 0 is reported (the most loaded
    where a shard does not divide: ``torch.chunk`` gives rank 0 the largest piece). Both engines
    evaluate exactly these ranks: the analytic engine one schedule each
    (:func:`trainmem.analytic.engine.pipeline_ranks`), the trace engine one trace each
    (:func:`trainmem.trace.pipeline.pipeline_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.memo import cached_on
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig, pipeline_stage_ids, pipeline_stage_layers

__all__ = [
    "RANK_ORDER",
    "RankMap",
    "RankPlace",
    "StagePlace",
    "fsdp1_framework",
    "fsdp1_no_shard",
    "model_rank_map",
    "rank_map",
    "stage_layers",
]

RANK_ORDER = "tp-cp-dp-pp"
"""The rank order, fastest-varying dimension first (Note [One rank map])."""


@dataclass(frozen=True)
class StagePlace:
    """One pipeline stage (a model chunk under interleaved 1F1B).

    Attributes:
        stage: stage index, 0 = first.
        pipeline_rank: the pipeline rank running it (``stage % p``).
        layers: its transformer layers (block indices), or None when the engine does not know
            the model's layer count (a module traced as a whole).
        global_ranks: the first and the last global rank of its pipeline rank.
    """

    stage: int
    pipeline_rank: int
    layers: range | None
    global_ranks: tuple[int, int]

    def to_json(self) -> dict[str, object]:
        """``{"stage", "pipeline_rank", "layers": [first, last] | null, "global_ranks":
        [first, last]}``."""
        return {
            "stage": self.stage,
            "pipeline_rank": self.pipeline_rank,
            "layers": _span(self.layers),
            "global_ranks": list(self.global_ranks),
        }


@dataclass(frozen=True)
class RankPlace:
    """One rank whose memory differs from the others' (Note [One rank map]).

    Attributes:
        rank: global rank.
        pipeline_rank: its pipeline rank (the ``pp`` coordinate).
        data / context / tensor: its other coordinates (0: the most loaded of its peers).
        stages: the stages it runs, ascending.
        layers: the layers of each of those stages (None entries: layer count unknown).
        has_embedding: holds the input embeddings (the first stage; the last one too when the
            embeddings are tied, as Megatron keeps a copy for the output layer).
        has_head: holds the final norm, the output layer and the loss (the last stage).
        ranks_alike: the ranks of its pipeline rank, ``dp * cp * tp`` (its peers hold the same
            tensors, up to shards that do not divide).
    """

    rank: int
    pipeline_rank: int
    data: int
    context: int
    tensor: int
    stages: tuple[int, ...]
    layers: tuple[range | None, ...]
    has_embedding: bool
    has_head: bool
    ranks_alike: int

    @property
    def num_layers(self) -> int | None:
        """Transformer layers held, or None when unknown."""
        if any(r is None for r in self.layers):
            return None
        return sum(len(r) for r in self.layers if r is not None)

    @property
    def coordinates(self) -> dict[str, int]:
        """``{"pp", "dp", "cp", "tp"}`` indices, outermost first."""
        return {"pp": self.pipeline_rank, "dp": self.data, "cp": self.context, "tp": self.tensor}

    def to_json(self) -> dict[str, object]:
        """``{"rank", "coordinates", "pipeline_stage", "stages", "layers": [[first, last] per
        stage], "num_layers", "has_embedding", "has_head", "ranks_alike"}``."""
        return {
            "rank": self.rank,
            "coordinates": self.coordinates,
            "pipeline_stage": self.pipeline_rank,
            "stages": list(self.stages),
            "layers": [_span(r) for r in self.layers],
            "num_layers": self.num_layers,
            "has_embedding": self.has_embedding,
            "has_head": self.has_head,
            "ranks_alike": self.ranks_alike,
        }


@dataclass(frozen=True)
class RankMap:
    """The world layout of one training run (Note [One rank map]).

    Attributes:
        data_parallel_size / tensor_parallel_size / context_parallel_size /
            pipeline_parallel_size: the sizes of the four dimensions.
        expert_parallel_size: 1 (no engine shards the experts of a MoE layer over ranks).
        stages: every pipeline stage, first to last.
        ranks: the ranks whose memory differs, ascending (one without pipelining).
    """

    data_parallel_size: int
    tensor_parallel_size: int
    context_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    stages: tuple[StagePlace, ...]
    ranks: tuple[RankPlace, ...]

    @property
    def world_size(self) -> int:
        """All ranks: ``pp * dp * cp * tp``."""
        return (
            self.pipeline_parallel_size
            * self.data_parallel_size
            * self.context_parallel_size
            * self.tensor_parallel_size
        )

    def layers_per_pipeline_rank(self) -> list[int | None]:
        """Transformer layers held by each pipeline rank, first to last (None: unknown)."""
        out: list[int | None] = [0] * self.pipeline_parallel_size
        for s in self.stages:
            held, r = out[s.pipeline_rank], s.layers
            out[s.pipeline_rank] = None if held is None or r is None else held + len(r)
        return out

    def to_json(self) -> dict[str, object]:
        """The JSON ``rank_map``: ``{"world_size", "data_parallel_size", "tensor_parallel_size",
        "context_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "order",
        "stages": [StagePlace.to_json()], "ranks": [RankPlace.to_json()]}``, the same keys
        whichever engine ran."""
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "order": RANK_ORDER,
            "stages": [s.to_json() for s in self.stages],
            "ranks": [r.to_json() for r in self.ranks],
        }


def _span(layers: range | None) -> list[int] | None:
    """``range(4, 8)`` -> ``[4, 7]`` (first and last layer); None stays None."""
    return None if layers is None else [layers.start, layers.stop - 1]


def stage_layers(num_layers: int, training: TrainingConfig) -> list[range]:
    """The layers of every pipeline stage, first to last: ``pipeline_stage_layers``, except
    for Megatron's interleaved schedule, whose model chunks divide each rank's share.

    Megatron gives pipeline rank ``r`` its ``ceil(L / p)`` layers (the last rank the rest) and
    splits them into ``v`` model chunks; chunk ``k`` of rank ``r`` is stage ``k * p + r``, so
    the chunks of all ranks tile the layers in stage order (megatron/core/transformer/
    transformer_block.py ``get_num_layers_to_build``, ``_get_layer_offset``: offset ``k * L /
    v + r * L / (p v)`` when ``p v`` divides ``L``). Where the share does not divide, the first
    chunks of a rank take one more layer. (``ceil(L / (p v))`` layers per chunk, the plain
    split over ``p v`` stages, can leave the last chunks fewer than no layers: 10 layers over
    4 x 2 chunks.)

    Args:
        num_layers: transformer blocks L.
        training: ``pipeline_parallel_size``, ``pipeline_schedule``,
            ``virtual_pipeline_stages`` and the framework's conventions.

    Returns:
        One ``range`` of layer indices per stage (``p * v`` under interleaving).
    """
    split = pipeline_stage_layers(num_layers, training)
    p = training.pipeline_parallel_size
    if training.conventions.torchtitan_pipeline_split or len(split) == p:
        return split
    v = len(split) // p
    per = -(-num_layers // p)
    shares = [per] * (p - 1) + [num_layers - per * (p - 1)]
    sizes = [shares[s % p] // v + (s // p < shares[s % p] % v) for s in range(p * v)]
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def rank_map(
    training: TrainingConfig, num_layers: int | None, *, tied_embeddings: bool = False
) -> RankMap:
    """The world layout and the ranks whose memory differs (Note [One rank map]).

    Args:
        training: ``data_parallel_size``, ``tensor_parallel_size``, ``context_parallel_size``,
            ``pipeline_parallel_size``, ``pipeline_schedule``, ``virtual_pipeline_stages`` and
            the framework's pipeline split.
        num_layers: transformer blocks of the model (encoder + decoder blocks of an
            encoder-decoder: ``ModelSpec.num_blocks``); None when unknown, allowed only without
            pipelining (the layers are then reported as null).
        tied_embeddings: the output layer shares the input embeddings
            (``tie_word_embeddings``).

    Returns:
        The :class:`RankMap`.

    Raises:
        ValueError: ``num_layers`` None with ``pipeline_parallel_size > 1``.

    Source: megatron/core/parallel_state.py ``RankGenerator`` (order);
    :func:`~trainmem.specs.training.pipeline_stage_layers` (split).
    """
    p = training.pipeline_parallel_size
    dp, cp, tp = (
        training.data_parallel_size,
        training.context_parallel_size,
        training.tensor_parallel_size,
    )
    per_pp = dp * cp * tp
    if num_layers is None:
        if p > 1:
            raise ValueError("a pipelined rank map needs the model's layer count")
        split: list[range | None] = [None]
    else:
        split = list(stage_layers(num_layers, training))
    stages = tuple(
        StagePlace(s, s % p, r, ((s % p) * per_pp, (s % p + 1) * per_pp - 1))
        for s, r in enumerate(split)
    )

    def place(r: int) -> RankPlace:
        ids = tuple(pipeline_stage_ids(r, training))
        last = len(split) - 1 in ids
        return RankPlace(
            rank=r * per_pp,
            pipeline_rank=r,
            data=0,
            context=0,
            tensor=0,
            stages=ids,
            layers=tuple(split[s] for s in ids),
            has_embedding=0 in ids or (last and tied_embeddings),
            has_head=last,
            ranks_alike=per_pp,
        )

    ranks = [place(0)] if p == 1 else [place(0), place(p - 1)]
    middle = [place(r) for r in range(1, p - 1)]
    if middle:
        most = max(middle, key=lambda x: (x.num_layers or 0, -x.pipeline_rank))
        if (most.num_layers or 0) > (ranks[0].num_layers or 0):
            ranks.insert(1, most)
    return RankMap(dp, tp, cp, p, 1, stages, tuple(ranks))


@cached_on(  # what rank_map reads (the framework for its pipeline split)
    "data_parallel_size",
    "tensor_parallel_size",
    "context_parallel_size",
    "pipeline_parallel_size",
    "pipeline_schedule",
    "virtual_pipeline_stages",
    "framework",
)
def model_rank_map(model: ModelSpec, training: TrainingConfig) -> RankMap:
    """:func:`rank_map` of ``model``'s blocks (encoder + decoder blocks of an encoder-decoder,
    ``ModelSpec.num_blocks``) and tied embeddings (cached per model and parallel layout: the
    engine asks twice a configuration)."""
    return rank_map(training, model.num_blocks, tied_embeddings=model.tie_word_embeddings)


def fsdp1_framework(training: TrainingConfig) -> bool:
    """True when ``training``'s framework shards with FSDP1 (``FullyShardedDataParallel``)
    wrapped as accelerate (``accelerate-fsdp``) or Answer.AI fsdp_qlora's train.py
    (``fsdp-qlora``, 50efa1e: LoRA leaves and decoder layers as units, ``use_orig_params=
    False``, ``limit_all_gathers=True``) wrap it, which the traced paths run for real (Note
    [Tracing FSDP1] in trainmem/trace/fsdp.py)."""
    return training.framework in ("accelerate-fsdp", "fsdp-qlora")


def flat_optimizer_tensors(training: TrainingConfig) -> bool:
    """True when the optimizer steps flat 1-D tensors, not the model's weights (Note [Optimizer
    states of flat tensors] in ``analytic/model_states.py``): FSDP1 with ``use_orig_params=
    False`` (:func:`fsdp1_framework`: each unit's ``FlatParameter`` shard) and every DeepSpeed
    optimizer wrapper (``zero``, ``bf16``, ``fp16``: one flat fp32 partition per parameter
    group; DeepSpeed v0.16.4 runtime/zero/stage_1_and_2.py ``param_group['params'] =
    [self.single_partition_of_fp32_groups[i]]``, runtime/zero/stage3.py
    ``_set_fp32_optimizer_param_groups`` (``fp32_partitioned_groups_flat``),
    runtime/bf16_optimizer.py ``fp32_groups_flat_partition``, runtime/fp16/fused_optimizer.py
    ``fp32_groups_flat``)."""
    return fsdp1_framework(training) or training.deepspeed_optimizer not in (None, "none")


def fsdp1_no_shard(training: TrainingConfig) -> bool:
    """True when ``training`` is FSDP1's ``NO_SHARD`` (Note [Tracing FSDP1] in
    trainmem/trace/fsdp.py, Note [FSDP1 NO_SHARD's 16-bit copy] in
    trainmem/analytic/transforms/sharding.py): an FSDP1 framework (:func:`fsdp1_framework`) at
    ZeRO stage 0 (accelerate's ``--fsdp no-shard``, fsdp_qlora's ``--sharding_strategy ddp``),
    or on one rank, where torch's FSDP1 itself switches any strategy to ``NO_SHARD`` (torch
    2.13 distributed/fsdp/_init_utils.py ``_init_core_state``: "FSDP is switching to use
    `NO_SHARD` ... since the world size is 1").

    Args:
        training: ``framework``, ``zero_stage`` and ``data_parallel_size``.

    Returns:
        Whether the run is FSDP1 without sharding.
    """
    return fsdp1_framework(training) and (
        training.zero_stage == 0 or training.data_parallel_size == 1
    )
