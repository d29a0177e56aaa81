"""The load phase of the analytic schedule: building and loading the model on the GPU where
that has transients of its own (Note [The load phase] in :mod:`trainmem.schedule`).

Three rules today: torchtune's single-device QLoRA on torchao 0.1 (Note [torchao 0.1 NF4 at
load]), the single-device recipes of torchtune before 0.3 on a 16-bit base (Note [torchtune's
cloned layer at load]) and Answer.AI fsdp_qlora's FSDP1 initialisation (Note [FSDP1
sync_module_states init]); every other run loads its weights without modelled transients (no
load phase).

Note [torchtune's cloned layer at load]
    torchtune's single-device recipes build the model on the GPU (recipes/
    lora_finetune_single_device.py and full_finetune_single_device.py @fef3ed1 ``_setup_model``:
    ``with utils.set_default_dtype(self._dtype), self._device: model =
    config.instantiate(cfg_model)``), and through torchtune 0.2.1 every builder makes one
    decoder layer first, then the embedding and the output projection, and hands the layer to
    ``TransformerDecoder``, whose ``__init__`` deep-copies it ``num_layers`` times
    (models/llama2/_component_builders.py ``lora_llama2`` / ``llama2``; modules/transformer.py
    ``_get_clones``: ``copy.deepcopy(module)``); the built layer is freed when the builder
    returns. Then ``load_state_dict`` copies the checkpoint, which is on the CPU, into the
    weights (an fp16 file is converted on the CPU: ATen Copy.cu ``copy_kernel_cuda`` converts
    host-side when the destination is CUDA), with no GPU transient. So the load peaks at the
    model's weights plus one layer's, and that layer's freed blocks stay in the cache, as the
    recipe calls no ``empty_cache`` before training. Llama-2-7B with LoRA on q, v (r = 8):
    13,485,219,840 + 405,028,864 bytes; the QLoRA tutorial logs this config's init peak at
    13.96 GB allocated (docs/source/tutorials/qlora_finetune.rst @fef3ed1), the remaining
    0.07 GB being each layer's own RoPE cache (4096 x 64 x 2 fp32, copied with the layer),
    which the model's buffers do not count. Under QLoRA (Note [torchao 0.1 NF4 at load]) the
    built layer is quantized and copied the same way; that rule quantizes every layer at build
    instead, the same peak (one weight's transients at a time) with another layout.

Note [torchao 0.1 NF4 at load]
    torchtune's ``lora_finetune_single_device`` recipe (fef3ed1, Apr 2024) builds the model on
    the GPU in bf16 (``_setup_model``: ``with utils.set_default_dtype(self._dtype),
    self._device: model = config.instantiate(cfg_model)``); each quantized ``LoRALinear``
    creates an ``nn.Linear`` there and quantizes its weight at once
    (modules/peft/lora.py ``_create_weight_and_bias``: ``to_nf4(linear.weight)``; the bf16
    weight is freed when the function returns). Then ``model.load_state_dict`` copies the
    checkpoint (on the CPU) into every weight: an NF4 weight's ``copy_`` is torchtune's
    (utils/_register_nf4_dispatch_ops.py ``inplace_copy``: ``to_nf4(src.to(dest.device))``,
    then the new pieces replace the old), so every base linear is quantized twice.

    torchao 0.1's ``NF4Tensor.from_tensor`` (dtypes/nf4tensor.py; torchtune pinned
    ``torchao==0.1`` from f97bcdaa, 2024-04-09, to c1c9f308, 2024-06-26) on a bf16 weight of
    ``n`` elements, blocks of 64 (``nb = n / 64`` scalers) in 256-scaler blocks (``nsb = nb /
    256``), allocates in this order (bytes; 2 per bf16, 8 per int64):

    * ``double_quantize_scalers``: ``abs`` 2n, ``max(dim=1)`` values 2nb and indices 8nb (the
      abs and indices freed); ``scalers_1 - mean`` 2nb (the values freed); its ``abs`` 2nb,
      ``max`` 2nsb + 8nsb; ``2 * scaler_absmax`` and ``256 / (...)`` over the expanded
      (nsb, 256) view, 2nb each; ``* factor``, ``round``, ``clamp`` 2nb each, one at a time;
      ``.to(int8)`` nb;
    * ``convert_to_norm_float_weight``: ``abs`` 2n and ``max`` 2nb + 8nb again; ``blocks /
      scales`` 2n; ``quantize_tensor_nearest``: ``(value - nf4)`` over (n, 16) 32n, ``.abs()``
      32n (the difference freed), ``min(dim=-1)`` values 2n and indices 8n (the values and the
      absolute difference freed); ``indices[::2] << 4`` 4n, ``| indices[1::2]`` 4n, then
      ``.to(torch.uint8)`` n / 2, the packed weight.

    The peak of one weight is the live weights + 2n (the bf16 weight) + 2n (scaled) + 64n: for
    Llama-2-7B's 4096 x 11008 MLP weights 3.07 GB above the weights, and the freed (n, 16)
    blocks stay in the caching allocator. The kept pieces are allocated where torchao makes
    them: the factor's (nb) bf16 base (kept whole by its view before torchao 0.3,
    ``tensor_states.torchao_factor_view_bytes``) and the int8 scalers in the double
    quantization, the rest of the weight's ``param_bytes`` (packed data, mean, the 16-entry
    table) where the packed data is made.
    From torchao 0.2 the nearest-value search runs over ``CHUNK_SIZE = 1024**2`` elements at a
    time (Note: Quantize in Chunks), whose transients are not modelled.

    Not modelled: ``from_pretrained`` paths.

Note [FSDP1 sync_module_states init]
    Answer.AI fsdp_qlora train.py (e4968fd, Mar 2024; ``--framework fsdp-qlora``) loads the
    model with ``low_memory=True`` by default: rank 0 on the CPU, the other ranks on the meta
    device, then wraps it in FSDP1 with ``sync_module_states=True`` and, off rank 0,
    ``param_init_fn=lambda m: m.to_empty(device="cuda", recurse=False)``. FSDP1 initialises
    its units bottom-up in wrapping order (each LoRA leaf, then its decoder layer; the root,
    embedding and head, last; torch distributed/fsdp/_init_utils.py
    ``_init_param_handle_from_module``), and for each unit on every rank:

    * ``_move_module_to_device`` (or ``to_empty`` off rank 0): every tensor of the unit on
      the GPU at its full size, one allocation each;
    * ``_sync_module_params_and_buffers``: ``dist._broadcast_coalesced`` with
      ``PARAM_BROADCAST_BUCKET_SIZE`` = 250 MiB: the tensors, in order, fill a bucket until it
      reaches the size (c10d/reducer.cpp ``compute_bucket_assignment_by_size``), each bucket
      flattened into a new tensor, at most two in flight (comm.cpp ``broadcast_coalesced``,
      ``max_in_flight = 2``), freed once copied back;
    * ``FlatParamHandle`` (fsdp/_flat_param.py): ``torch.cat`` of the unit's tensors (the
      flat parameter, full size), then ``shard()``: this rank's chunk cloned (``_get_shard``),
      the flat storage resized to 0; the
      moved tensors are freed when ``_init_param_handle_from_module`` returns.

    A unit's buffers are moved with it and broadcast first (``_sync_module_params_and_buffers``
    lists ``module.buffers()`` before the parameters), never flattened, sharded or offloaded:
    they stay on the GPU (older transformers' per-layer rotary tables,
    :func:`trainmem.analytic.buffers.layer_rope_cache_bytes`).

    With ``sharding_strategy=NO_SHARD`` (fsdp_qlora's ``ddp``: data parallelism without ZeRO
    here) the flat parameter is the unit's weight and nothing is cloned (``shard()`` keeps it
    when ``uses_sharded_strategy`` is False).
    A sharded unit of U bytes thus peaks at U (moved) + U (flat) + U / ranks (its shard) above the
    shards made before; for Llama-2-7B in bf16 the root (embedding + head, 524 MB) sets the
    load's peak, and the flat parameters and buckets (0.3-0.4 GB each) stay cached. The
    shards are the setup's per-tensor shards (one flat shard per unit in FSDP1; the step
    models them per tensor too). Not modelled: the QLoRA path's ``load_and_quantize`` before
    FSDP (each weight quantized on the GPU by ``n_loading_workers`` threads at once, a count
    that depends on the machine's CPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.buffers import ROPE_BUFFERS_KEY
from trainmem.analytic.tensor_states import TensorState, is_quantized_base
from trainmem.analytic.transforms.base import RankContext, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.frameworks import (
    TORCHAO_NF4_CHUNKED_SINCE,
    TORCHTUNE_LAYERS_BUILT_EACH_SINCE,
)
from trainmem.specs.training import TrainingConfig

NF4_TORCHAO_BLOCK = 64
"""torchao ``to_nf4(tensor, block_size=64, scaler_block_size=256)``: elements per scaler."""
NF4_TORCHAO_SCALER_BLOCK = 256
"""Scalers per double-quantization block (``scaler_block_size``)."""
NF4_LEVELS = 16
"""Entries of the NF4 table ``(value - nf4)`` is broadcast against."""

LOAD_RULE = "torchtune QLoRA on torchao 0.1: bf16 linears built and NF4-quantized on the GPU"
"""The torchao 0.1 rule, as :func:`load_rule` names it."""

FSDP1_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""torch distributed/fsdp/_init_utils.py ``PARAM_BROADCAST_BUCKET_SIZE = int(250 * 1024 *
1024)``: ``sync_module_states`` broadcasts a unit's tensors coalesced in buckets of this size."""
FSDP1_BROADCASTS_IN_FLIGHT = 2
"""torch/csrc/distributed/c10d/comm.cpp ``broadcast_coalesced``: ``max_in_flight = 2`` flat
buckets at once."""

FSDP1_RULE = "FSDP1 sync_module_states: each unit moved to the GPU, broadcast, flattened, sharded"

CLONE_RULE = "torchtune < 0.3: one decoder layer built on the GPU, deep-copied per layer, freed"
"""The cloned-layer rule, as :func:`load_rule` names it (Note [torchtune's cloned layer at
load])."""


def load_rule(training: TrainingConfig) -> str | None:
    """The load rule that applies to ``training``, or None: :data:`FSDP1_RULE` for fsdp_qlora
    over more than one rank, sharded or not (Note [FSDP1 sync_module_states init]);
    :data:`LOAD_RULE` for torchtune's single-device recipe (no data, tensor or pipeline
    parallelism) with an NF4 base on torchao before 0.2 (Note [torchao 0.1 NF4 at load]);
    :data:`CLONE_RULE` for it on an unquantized base before torchtune 0.3 (Note [torchtune's
    cloned layer at load]).
    ``load_phase=False`` (an explicit setting) turns every rule off."""
    if training.load_phase is False:
        return None
    if (
        training.framework == "fsdp-qlora"
        and training.data_parallel_size > 1
        and training.zero_stage in (0, 3)
        and training.pipeline_parallel_size == 1
        and training.tensor_parallel_size == 1
    ):
        return FSDP1_RULE
    single = (
        training.data_parallel_size
        * training.tensor_parallel_size
        * training.pipeline_parallel_size
        * training.context_parallel_size
    ) == 1
    if training.framework != "torchtune" or not single:
        return None
    if training.quantize_base == "none":
        before = training.torchtune_release < TORCHTUNE_LAYERS_BUILT_EACH_SINCE
        return CLONE_RULE if before else None
    if training.quantize_base not in ("nf4", "nf4-dq"):
        return None
    return LOAD_RULE if training.torchao_release < TORCHAO_NF4_CHUNKED_SINCE else None


def to_nf4_ops(numel: int, kept: Op, key: str, module: str) -> list[Op]:
    """The allocations and frees of torchao 0.1 ``NF4Tensor.from_tensor`` on a bf16 weight of
    ``numel`` elements, in order (Note [torchao 0.1 NF4 at load]). The weight's kept pieces
    are allocated where torchao makes them: the quantization factor's (n / 64) bf16 base
    (``f"{kept.key}/factor"``) and the int8 scalers (``f"{kept.key}/scalers"``) in the double
    quantization, then ``kept``, less those 3n / 64 bytes, where ``.to(torch.uint8)`` makes the
    packed data. ``key`` prefixes the transients' keys.

    Source: torchao v0.1 dtypes/nf4tensor.py ``from_tensor``, ``double_quantize_scalers``,
    ``get_block_absmax``, ``convert_to_norm_float_weight``, ``quantize_tensor_nearest``.
    """
    n = numel
    nb = n // NF4_TORCHAO_BLOCK
    nsb = nb // NF4_TORCHAO_SCALER_BLOCK
    out: list[Op] = []

    def new(size: int, name: str, label: str = "") -> Op:
        op = alloc(size, Cat.TEMPORARY, "load", f"{key}/{name}", module, label)
        out.append(op)
        return op

    def drop(*ops: Op) -> None:
        out.extend(free(op, "load") for op in ops)

    # double_quantize_scalers(inpt.flatten(), 64, 256)
    a1 = new(2 * n, "abs1")
    v1, i1 = new(2 * nb, "max1"), new(8 * nb, "argmax1")
    drop(a1, i1)
    s1 = new(2 * nb, "scalers1")
    drop(v1)
    a2 = new(2 * nb, "abs2")
    v2, i2 = new(2 * nsb, "max2"), new(8 * nsb, "argmax2")
    drop(a2, i2)
    m2 = new(2 * nb, "twice")
    qf = alloc(2 * nb, Cat.PARAMETER, "load", f"{kept.key}/factor", module)  # kept
    out.append(qf)
    drop(m2)
    q1 = new(2 * nb, "mul")
    q2 = new(2 * nb, "round")
    drop(q1)
    q3 = new(2 * nb, "clamp")
    drop(q2)
    qs = alloc(nb, Cat.PARAMETER, "load", f"{kept.key}/scalers", module)  # kept
    out.append(qs)
    drop(q3, v2, s1)
    # convert_to_norm_float_weight(inpt, n_blocks, 64, nf4)
    a3 = new(2 * n, "abs3")
    v3, i3 = new(2 * nb, "max3"), new(8 * nb, "argmax3")
    drop(a3, i3)
    scaled = new(2 * n, "scaled")
    diff = new(2 * NF4_LEVELS * n, "diff", "torchao 0.1 NF4: (value - nf4) over (numel, 16)")
    absd = new(2 * NF4_LEVELS * n, "absdiff", "torchao 0.1 NF4: |value - nf4| over (numel, 16)")
    drop(diff)
    mv, mi = new(2 * n, "min"), new(8 * n, "argmin")
    drop(mv, absd)
    shifted = new(4 * n, "shift")
    packed = new(4 * n, "or")
    drop(shifted)
    out.append(kept._replace(size_bytes=kept.size_bytes - qf.size_bytes - qs.size_bytes))
    drop(packed, mi, scaled, v3)
    return out


def _kept_pieces(op: Op, numel: int) -> list[Op]:
    """The frees of a weight :func:`to_nf4_ops` made under ``op.key``: its pieces and the
    rest."""
    nb = numel // NF4_TORCHAO_BLOCK
    factor = op._replace(key=f"{op.key}/factor", size_bytes=2 * nb)
    scalers = op._replace(key=f"{op.key}/scalers", size_bytes=nb)
    rest = op._replace(size_bytes=op.size_bytes - 3 * nb)
    return [free(x, "load") for x in (factor, scalers, rest)]


def _quantized_weight(state: TensorState, op: Op, init_key: str | None) -> list[Op]:
    """One quantized linear's build (``init_key``: the weight is kept under it until the
    checkpoint's copy replaces it) or reload (``init_key`` None: the new weight under the
    setup's key, then the built one freed)."""
    n = state.local_numel or state.numel
    module = op.module
    if init_key is not None:  # nn.Linear(...) on the GPU, then to_nf4(linear.weight)
        src = alloc(2 * n, Cat.TEMPORARY, "load", f"{op.key}/bf16", module, "a bf16 linear")
        kept = op._replace(phase="load", key=init_key)
        return [src, *to_nf4_ops(n, kept, f"{op.key}/init", module), free(src, "load")]
    src = alloc(2 * n, Cat.TEMPORARY, "load", f"{op.key}/ckpt", module, "a checkpoint weight")
    built = op._replace(key=f"{op.key}@init")
    kept = op._replace(phase="load")
    return [
        src,
        *to_nf4_ops(n, kept, f"{op.key}/load", module),
        free(src, "load"),
        *_kept_pieces(built, n),
    ]


def broadcast_buckets(sizes: Sequence[int]) -> list[list[int]]:
    """The buckets ``sync_module_states`` broadcasts a unit's tensors in (Note [FSDP1
    sync_module_states init]): c10d reducer.cpp ``compute_bucket_assignment_by_size`` with the
    one limit :data:`FSDP1_BROADCAST_BUCKET_BYTES` that comm.cpp ``broadcast_coalesced`` gives
    it (torch 2.2.2): the tensors, in order, fill a bucket until it holds at least the limit,
    and the last bucket holds the rest.

    Args:
        sizes: each tensor's bytes, in broadcast order (buffers, then parameters), all of one
            dtype and device: ``compute_bucket_assignment_by_size`` keys its buckets by
            (dtype, device), which this does not model.

    Returns:
        The buckets in broadcast order, each the indices into ``sizes`` of its tensors; empty
        for no tensors.
    """
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for k, size in enumerate(sizes):
        current.append(k)
        total += size
        if total >= FSDP1_BROADCAST_BUCKET_BYTES:
            out.append(current)
            current, total = [], 0
    return out + ([current] if current else [])


def _fsdp1_unit(
    moved: Sequence[Op],
    sharded: Sequence[Op],
    full: Sequence[int],
    key: str,
    module: str,
    buffers: Sequence[Op] = (),
) -> list[Op]:
    """One FSDP1 unit's init on a rank (Note [FSDP1 sync_module_states init]): ``moved`` its
    tensors as ``_move_module_to_device`` puts them on the GPU (full size), then its
    ``buffers`` (the setup's own, kept), the broadcast buckets (the buffers first, as
    ``_sync_module_params_and_buffers`` lists them), the flat parameter (``full`` summed),
    then ``sharded`` (the setup's shards), the flat parameter freed and the moved tensors with
    it. A bucket of one tensor is broadcast in place, with no block of its own: aten
    native/TensorShape.cpp ``flatten_dense_tensors`` (torch/csrc/utils/tensor_flatten.h
    forwards to it) returns ``tensors[0].contiguous().view({-1})`` for one tensor
    (``at::cat`` only for more), and ``BroadcastWork::finish`` copies the unflattened views
    back onto it (torch/csrc/distributed/c10d/comm.cpp, torch 2.2.2); its work still takes one
    of the two in-flight slots."""
    out: list[Op] = [*moved, *buffers]
    in_flight: list[Op | None] = []
    sizes = [op.size_bytes for op in (*buffers, *moved)]
    for members in broadcast_buckets(sizes):
        if len(in_flight) >= FSDP1_BROADCASTS_IN_FLIGHT:
            done = in_flight.pop(0)
            out += [free(done, "load")] if done is not None else []
        bucket = None
        if len(members) > 1:
            size, label = sum(sizes[j] for j in members), "a broadcast bucket"
            name = f"{key}/bucket{members[-1]}"
            bucket = alloc(size, Cat.TEMPORARY, "load", name, module, label)
            out.append(bucket)
        in_flight.append(bucket)
    out += [free(op, "load") for op in in_flight if op is not None]
    if sum(op.size_bytes for op in sharded) >= sum(full):  # NO_SHARD: the flat parameter is kept
        out += sharded
    else:
        flat = alloc(
            sum(full), Cat.TEMPORARY, "load", f"{key}/flat", module, "an unsharded flat parameter"
        )
        out += [flat, *sharded, free(flat, "load")]
    out += [free(op, "load") for op in moved]
    return out


def _fsdp1_items(ctx: RankContext, parameters: Sequence[Item]) -> tuple[Item, ...]:
    """Every FSDP1 unit's init in wrapping order: per layer its LoRA units then the layer, then
    the root (embedding, head, buffers)."""
    layer_items: list[Op] = []
    root_moved: list[Op] = []
    root_sharded: list[Op] = []
    root_full: list[int] = []
    ends = ctx.emb_states + ctx.head_states
    repeat: Repeat | None = None
    rope: Repeat | None = None
    k = 0
    for item in _flat(parameters):
        if isinstance(item, Repeat) and _is_rope_buffers(item):
            rope = item
            continue
        if isinstance(item, Repeat):
            repeat = item
            continue
        if item.key == "buffers":
            root_moved.append(item._replace(phase="load"))
            continue
        state = ends[k]
        k += 1
        root_moved.append(_moved(item, state))
        root_sharded.append(item._replace(phase="load"))
        root_full.append(state.full_param_bytes)
    assert repeat is not None
    base_moved: list[Op] = []
    base_sharded: list[Op] = []
    base_full: list[int] = []
    for n, op in enumerate(repeat.body):
        assert isinstance(op, Op)
        state = ctx.layer_states[n]
        if state.trainable:  # a LoRA leaf: its own unit, wrapped first
            layer_items += _fsdp1_unit(
                [_moved(op, state)],
                [op._replace(phase="load")],
                [state.full_param_bytes],
                f"{op.key}/unit",
                op.module,
            )
        else:
            base_moved.append(_moved(op, state))
            base_sharded.append(op._replace(phase="load"))
            base_full.append(state.full_param_bytes)
    buffers = [_in_op(op) for op in rope.body] if rope is not None else []
    layer_items += _fsdp1_unit(
        base_moved, base_sharded, base_full, "unit/{i}", "layers.{i}", buffers
    )
    root = _fsdp1_unit(root_moved, root_sharded, root_full, "unit/root", "(model)")
    return (Repeat(tuple(layer_items), repeat.count), *root)


def _moved(op: Op, state: TensorState) -> Op:
    """A tensor moved to the GPU at its full (unsharded) size."""
    label = "a weight moved to the GPU by FSDP"
    return alloc(state.full_param_bytes, Cat.TEMPORARY, "load", f"{op.key}/moved", op.module, label)


def load_items(ctx: RankContext, parameters: Sequence[Item]) -> tuple[Item, ...]:
    """The load phase of one rank (Note [The load phase]): ``parameters`` (the setup's weight
    allocations, :meth:`trainmem.analytic.schedule._Builder.parameters`) as the load makes
    them, or ``()`` when no load rule applies (:func:`load_rule`).

    Returns:
        Items in phase ``"load"``: every weight built (a quantized one through
        :func:`to_nf4_ops`), then every quantized weight loaded again from the checkpoint.
    """
    rule = load_rule(ctx.training)
    if rule is None:
        return ()
    if rule == FSDP1_RULE:
        return _fsdp1_items(ctx, parameters)
    if rule == CLONE_RULE:
        return _cloned_items(parameters)
    build: list[Item] = []
    reload: list[Item] = []
    for item in _flat(parameters):
        if isinstance(item, Op) or _is_rope_buffers(item):
            build.append(_in_load(item))
            continue
        assert isinstance(item, Repeat)
        body: list[Op] = []
        again: list[Op] = []
        for n, op in enumerate(item.body):
            assert isinstance(op, Op)
            state = ctx.layer_states[n]
            if is_quantized_base(state, ctx.training):
                body += _quantized_weight(state, op, f"{op.key}@init")
                again += _quantized_weight(state, op, None)
            else:
                body.append(op._replace(phase="load"))
        build.append(Repeat(tuple(body), item.count))
        if again:
            reload.append(Repeat(tuple(again), item.count))
    return (*build, *reload)


def _cloned_items(parameters: Sequence[Item]) -> tuple[Item, ...]:
    """The build of torchtune < 0.3 (Note [torchtune's cloned layer at load]): one layer's
    weights (the layer repeat's body, keys ``...@built``), the embedding, head and buffers,
    the ``num_layers`` copies (the setup's layer weights), then the built layer freed."""
    ends: list[Item] = []
    layers: Repeat | None = None
    for item in _flat(parameters):
        if isinstance(item, Repeat) and _is_layer_body(item) and not _is_rope_buffers(item):
            layers = item
        else:
            ends.append(_in_load(item))
    if layers is None:  # no layers on this rank: nothing is cloned
        return tuple(ends)
    label = "the builder's decoder layer, deep-copied per layer"
    built = [
        alloc(
            op.size_bytes,
            Cat.TEMPORARY,
            "load",
            op.key.replace("{i}", "built") + "@built",
            op.module.replace("{i}", "built"),
            label,
        )
        for op in layers.body
        if isinstance(op, Op)
    ]
    copies = Repeat(tuple(_in_load(op) for op in layers.body), layers.count)
    return (*built, *ends, copies, *(free(op, "load") for op in built))


def _in_load(item: Item) -> Item:
    """A setup item made in the load phase."""
    if isinstance(item, Op):
        return item._replace(phase="load")
    if isinstance(item, Repeat):
        return Repeat(tuple(_in_load(x) for x in item.body), item.count)
    return item


def _flat(items: Sequence[Item]) -> list[Item]:
    """The setup's weight items with single-iteration repeats opened: the embedding, head and
    buffer allocations as ops, the layers' repeat kept."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, Repeat) and item.count == 1 and not _is_layer_body(item):
            out += _flat(item.body)
        else:
            out.append(item)
    return out


def _is_rope_buffers(item: Item) -> bool:
    """The layers' rotary buffers (``trainmem.analytic.buffers.layer_rope_cache_bytes``)."""
    return isinstance(item, Repeat) and any(
        isinstance(op, Op) and op.key == ROPE_BUFFERS_KEY for op in item.body
    )


def _in_op(item: Item) -> Op:
    """An op of the setup made in the load phase."""
    assert isinstance(item, Op)
    return item._replace(phase="load")


def _is_layer_body(item: Repeat) -> bool:
    return all(isinstance(op, Op) and "{i}" in op.key for op in item.body)
