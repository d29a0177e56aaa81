"""DeepSpeed ZeRO-3's gathered parameters on one rank: how many the prefetcher keeps alive, which
stay gathered between two uses, and the host-to-device copy of an offloaded partition.

Note [DeepSpeed ZeRO-3 parameter gathers]
    DeepSpeed ZeRO-3 (runtime/zero/partitioned_param_coordinator.py, v0.8.0 to v0.16.4 alike)
    gathers a module's parameters in its pre-forward / pre-backward hook (``fetch_sub_module``)
    and releases them in its post hook (``release_sub_module``), on any number of ranks: the
    coordinator has no one-rank path. Before 0.9.0 the gather had none either, so a single GPU
    held gathered copies too (whole ones, beside the partition when the parameters are not
    offloaded); from 0.9.0 (:data:`~trainmem.specs.frameworks.
    DEEPSPEED_ZERO3_ONE_RANK_VIEWS_SINCE`) a parameter over one rank is its partition
    (``_no_gather_coalesced``: ``param.data = param.ds_tensor.data.to(device).view(
    param.ds_shape)``), so one GPU gathers nothing unless the parameters are offloaded, and then
    the host-to-device copy is the gathered parameter, with no buffer beside it
    (:attr:`TrainingConfig.zero3_one_rank_views`). The rules below then hold for that copy.
    From the second step on (a recorded trace, ``is_complete_trace``) three rules set what is
    alive:

    * Prefetch runs ahead to ``stage3_max_live_parameters``. Every hooked module (norms,
      dropouts, activations and containers too, whether they own parameters or not) prefetches
      up to ``min(max_n_available_params - n_available_params, prefetch_bucket_sz)`` elements of
      the upcoming parameters (whole parameters, the last one may overshoot), and a module
      releases only its own. A transformer layer runs more hooked modules than it has large
      weights, so while the layers run the gathered elements rise to ``max_live`` (default 1e9)
      or to every layer's, whichever is less (a layer larger than ``max_live`` is fetched whole
      all the same). The DeepSpeed docs: "The maximum number of parameters resident per GPU
      before releasing".
    * A parameter is not released if it is used again within ``max_reuse_distance`` elements
      (``__params_to_release``: the modules after the current one are walked, adding their
      parameters' elements, until ``stage3_max_reuse_distance``, default 1e9, is reached; any
      parameter met is kept). The trace is the forward's modules then the backward's (the head
      appears twice), so a tied embedding stays gathered from its lookup to the output layer
      when the layers hold fewer than ``max_reuse_distance`` elements, and a layer whose
      forward and backward uses are closer than that (``2 j P + 2 H`` elements apart, ``j``
      layers after it, ``P`` elements a layer, ``H`` the head's) stays gathered across the
      turnaround.
    * While a gathered parameter is more than ``max_live`` on its own, nothing is prefetched
      (``max_params_to_prefetch <= 0``). The output layer's weight (a tied one too) is
      prefetched as soon as the layers' queue is exhausted, i.e. while the last layers'
      gathered weights are still alive, and the layers are gathered again after its backward
      releases it.

    With ``offload_param`` the partition lives in host memory and a gather over several ranks
    (one rank before 0.9.0) copies it to the GPU first, beside the gathered buffer
    (partition_parameters.py ``all_gather_coalesced``:
    ``param_buffer = torch.empty(...)`` then ``_dist_allgather_fn(param.ds_tensor.to(
    torch.cuda.current_device()), param_buffer, ...)``; several parameters: ``torch.cat([p.
    ds_tensor.to(...) for p in params], out=...)``): a transient of one partition (the whole
    parameter on one rank).

    Every gather runs on the coordinator's all-gather stream (``fetch_sub_module``: ``with
    get_accelerator().stream(self.__allgather_stream)`` around ``__all_gather_params`` and
    the handles' ``wait``), which is its own CUDA stream when ``overlap_comm`` is on
    (parameter_offload.py: ``self.__allgather_stream = ... get_accelerator().Stream() if
    overlap_comm else get_accelerator().default_stream()``, v0.8.0 to v0.19.5 alike;
    ``overlap_comm`` defaults to True at stage 3, runtime/zero/config.py
    ``overlap_comm_valid``). The buffers it allocates there (``torch.empty`` of the gathered
    parameter or of a coalesced flat buffer, ``partition_parameters.py``
    ``all_gather_coalesced``; an offloaded partition's ``.to(device)``) come from that stream's
    pool of the caching allocator, whose cached blocks the default stream never reuses: the
    gathered weights reserve their own segments, beside the segments of everything else
    (:attr:`Zero3Gathers.stream`, :data:`~trainmem.timeline.ALL_GATHER_STREAM`). With
    ``overlap_comm`` false the stream is the default one.

    Not modelled: the first step (a trace being recorded releases every parameter after its
    module, no prefetch); parameters under ``stage3_param_persistence_threshold`` (gathered
    once, never released: small); the transient copies of the layers' own gathers (one weight's
    partition at a time); a coalesced gather's per-parameter copies (``AllGatherCoalescedHandle.
    wait``: ``param.data = torch.cat(partitions)`` beside the flat buffer, which lives until
    every parameter of that gather is waited for: a module's weight with its bias, or a
    prefetch of several small parameters).

Source: DeepSpeed runtime/zero/partitioned_param_coordinator.py (``fetch_sub_module``,
``release_sub_module``, ``__params_to_release``), partition_parameters.py
(``all_gather_coalesced``; ``NoGatherCoalescedHandle`` from 0.9.0), runtime/zero/config.py
(``max_live_parameters``, ``max_reuse_distance``: ``pp_int(1e9)``), v0.8.0; the one-rank path
read at v0.9.0, v0.12.3 and v0.19.5; the all-gather stream (parameter_offload.py,
partitioned_param_coordinator.py ``fetch_sub_module``) at v0.8.0, v0.9.0, v0.13.1, v0.14.2,
v0.16.4 and v0.19.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainmem.analytic.buffers import DEEPSPEED_MAX_LIVE_PARAMETERS
from trainmem.analytic.tensor_states import TensorState
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import ALL_GATHER_STREAM
from trainmem.units import dtype_bytes

Release = Literal["stack.pre_forward", "head.post_backward", "embedding.post_backward"]
"""The analytic point after which the embeddings' gathered weights are released."""

DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's default ``stage3_max_reuse_distance``, elements (runtime/zero/config.py
``max_reuse_distance: int = Field(pp_int(1e9), ge=0, alias="stage3_max_reuse_distance")``)."""


@dataclass(frozen=True, slots=True)
class Zero3Gathers:
    """One rank's DeepSpeed ZeRO-3 gathered parameters, bytes (Note [DeepSpeed ZeRO-3
    parameter gathers]).

    Attributes:
        pool: the layers' gathered weights while the layers run (forward and backward).
        turnaround: the layers' gathered weights kept from their forward to their backward.
        embedding: the input embeddings' gathered weights (the first modules).
        embedding_release: the point after which they are released: ``stack.pre_forward``
            (after the lookup), ``head.post_backward`` (a tied weight kept for the output
            layer) or ``embedding.post_backward`` (kept for the embedding's own backward).
        head: the output layer's gathered weight, fetched as the last layers run (0 when a
            tied weight is kept from the lookup).
        embedding_backward: the embedding is gathered again for its own backward.
        copy_share: N, the host-to-device copy of an offloaded partition being 1/N of the
            gathered bytes (0 without parameter offload).
        stream: the CUDA stream the gathers allocate on: :data:`~trainmem.timeline.
            ALL_GATHER_STREAM` with ``overlap_comm`` (DeepSpeed's default at stage 3), else 0.
    """

    pool: int
    turnaround: int
    embedding: int
    embedding_release: Release
    head: int
    embedding_backward: bool
    copy_share: int
    stream: int = 0

    def copy(self, gathered: int) -> int:
        """Bytes of the offloaded partition's copy for a gather of ``gathered`` bytes."""
        return -(-gathered // self.copy_share) if self.copy_share else 0


def _numel_and_bytes(states: Sequence[TensorState], training: TrainingConfig) -> tuple[int, int]:
    """(elements, bytes) of the states' gathered (unsharded) parameters as DeepSpeed counts
    them (``ds_numel``, the stored tensor's elements: a quantized base's packed storage in the
    model dtype, bitsandbytes ``quant_storage``), the LoRA adapters left out (under the
    persistence threshold)."""
    kept = [s for s in states if not s.name.startswith("lora_")]
    w = dtype_bytes(training.weight_dtype)
    quantized = training.quantize_base != "none"
    numel = sum(
        s.full_param_bytes // w if quantized and not s.trainable and s.name != "vector" else s.numel
        for s in kept
    )
    return numel // training.tensor_parallel_size, sum(s.full_param_bytes for s in kept)


def zero3_gathers(
    layer: Sequence[TensorState],
    num_layers: int,
    embedding: Sequence[TensorState],
    head: Sequence[TensorState],
    *,
    tied: bool,
    training: TrainingConfig,
) -> Zero3Gathers:
    """The rank's gathered-parameter sizes (Note [DeepSpeed ZeRO-3 parameter gathers]).

    Args:
        layer: one layer's parameter states (gathered sizes: ``numel``, ``full_param_bytes``).
        num_layers: layers on the rank.
        embedding / head: the states before / after the layers (a tied head's weight is the
            embedding's, so ``head`` holds only the final norm then).
        tied: the output layer uses the token embedding's weight.
        training: ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
            ``stage3_prefetch_bucket_size`` (0: no prefetch), ``offload``, ``sharding_degree``.

    Returns:
        The sizes in bytes.
    """
    p_numel, p_bytes = _numel_and_bytes(layer, training)
    e_numel, e_bytes = _numel_and_bytes(embedding, training)
    h_numel, h_bytes = _numel_and_bytes(head, training)
    if tied:
        tokens = [s for s in embedding if s.name == "embedding/tokens"]
        t_numel, t_bytes = _numel_and_bytes(tokens, training)
        h_numel, h_bytes = h_numel + t_numel, h_bytes + t_bytes
    per = p_bytes / max(p_numel, 1)
    live = training.stage3_max_live_parameters
    max_live = DEEPSPEED_MAX_LIVE_PARAMETERS if live is None or live == "auto" else live
    distance = training.stage3_max_reuse_distance
    reuse = DEEPSPEED_MAX_REUSE_DISTANCE if distance is None or distance == "auto" else distance
    layers = num_layers * p_numel
    pool = min(layers, max(max_live, p_numel))
    if training.stage3_prefetch_bucket_size == 0:  # no prefetch: the current layer's alone
        pool = p_numel
    # layer j places from the end: its forward and backward uses 2 j P + 2 H elements apart
    kept = sum(1 for j in range(num_layers) if 2 * j * p_numel + 2 * h_numel < reuse)
    trainable = any(s.trainable and not s.name.startswith("lora_") for s in embedding)
    # the next use of the embedding: the output layer (tied), else its own backward
    to_head = tied and bool(embedding) and layers < reuse
    to_backward = trainable and (layers < reuse if to_head else 2 * (layers + h_numel) < reuse)
    release: Release = "stack.pre_forward"
    if to_backward:
        release = "embedding.post_backward"
    elif to_head:
        release = "head.post_backward"
    offload = training.offload == "optimizer+params"
    if training.zero3_one_rank_views and not offload:  # every parameter is its partition
        return Zero3Gathers(0, 0, 0, "stack.pre_forward", 0, False, 0)
    # one rank from 0.9.0: the host-to-device copy is the gathered parameter itself
    copy_share = training.sharding_degree if offload and not training.zero3_one_rank_views else 0
    overlap = training.overlap_comm is None or training.overlap_comm  # None: True at stage 3
    return Zero3Gathers(
        pool=int(per * pool),
        turnaround=int(per * min(kept * p_numel, pool)),
        embedding=e_bytes,
        embedding_release=release,
        head=0 if to_head else h_bytes,
        embedding_backward=trainable and not to_backward,
        copy_share=copy_share,
        stream=ALL_GATHER_STREAM if overlap else 0,
    )
