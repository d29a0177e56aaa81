"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under torch's fake process group: one rank.

Note [Tracing FSDP2]
    ``zero_stage=3`` with ``data_parallel_size=N`` is traced as torchtitan applies FSDP2: each
    transformer layer (``trainmem.trace.lora.layer_stack``) is ``fully_shard``-ed, then the root
    module, over a 1-D CPU device mesh of N ranks of the ``"fake"`` backend
    (``torch.testing._internal.distributed.fake_pg.FakeStore``; collectives return at once and
    write nothing, so only their buffers are allocated). Rank 0's allocations are recorded:
    sharded parameters, gradients and optimizer states are its ``DTensor`` local shards (dim-0
    chunks padded to ``ceil(dim0 / N)`` rows), and the unsharded parameters, all-gather and
    reduce-scatter buffers of the layer being run appear as temporaries. Activation
    checkpointing is applied before sharding, as torchtitan does. ``framework="fsdp2"`` with
    ``*-mixed`` precision uses ``MixedPrecisionPolicy(param_dtype=<16-bit>,
    reduce_dtype=float32)`` and no autocast, as does ``fp8-mixed`` (torchtitan); any other
    framework keeps fp32 gathered weights and runs under autocast.

    Not modelled: the separate all-gather / reduce-scatter CUDA streams (the caching allocator
    keeps per-stream pools and frees them only after the consumer stream's event), so blocks
    freed across streams are freed here at once; a CUDA device mesh (impossible on the CPU
    build, shared/notes/tracing-without-a-gpu.md).

Note [Tracing FSDP1]
    ``framework="accelerate-fsdp"`` (accelerate's, and the HF Trainer's ``--fsdp``, FSDP
    version 1) runs torch's ``FullyShardedDataParallel`` itself on the fake tensors, under the
    same fake process group: it runs there (flat parameters built by ``torch.cat``, their
    unsharded storage allocated and freed by ``UntypedStorage.resize_``, which the recorder
    sees), so it is traced for real, not as a transform. Wrapped as accelerate wraps a
    transformers model (accelerate utils/dataclasses.py ``FullyShardedDataParallelPlugin``,
    torch 2.13 distributed/fsdp/fully_sharded_data_parallel.py): ``TRANSFORMER_BASED_WRAP``
    on the decoder layer class (``transformer_cls_names_to_wrap`` = ``_no_split_modules``),
    the root unit holding the rest (embeddings, final norm, head), and under LoRA each adapter
    its own unit (peft's ``fsdp_auto_wrap_policy``); ``FULL_SHARD`` at ZeRO-3
    (``SHARD_GRAD_OP`` with ``reshard_after_forward=False``; ``HYBRID_SHARD`` on a smaller
    ``shard_group_size``); ``use_orig_params=False``
    (accelerate's default: the optimizer steps the flat parameters); under ``*-mixed``
    ``MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=<16-bit>)`` (``set_mixed_precision``)
    and the forward under autocast on top (:func:`accelerate_native_amp`: accelerate's
    ``native_amp``; ``FrameworkConventions.autocast`` stays False for accelerate-fsdp: the
    parameters are 16-bit, the residual stream too, but CUDA's fp32 ops, LayerNorm, ``pow``,
    softmax, run in fp32 and their 16-bit consumers cast again); FSDP1's own
    defaults for prefetching (``BACKWARD_PRE``) and ``limit_all_gathers``. The module paths
    drop FSDP1's ``_fsdp_wrapped_module`` segments (:func:`~trainmem.trace.module_paths.
    clean_module_path`), so the traced stream names the layers as the unwrapped model does.
    Its allocations carry the CUDA streams FSDP1 enters and its rate limiter's pending frees
    (Note [FSDP1 streams on the trace]).

    ``framework="fsdp-qlora"`` (Answer.AI fsdp_qlora train.py 50efa1e) wraps the same units
    (``get_wrapping_policy``: LoRA leaves with a trainable ``weight``, then the decoder layer
    class) with ``use_orig_params=False``, ``limit_all_gathers=True``, FSDP1's default
    ``BACKWARD_PRE``, ``FULL_SHARD`` by default (``--sharding_strategy``: ``shard_grad_op``,
    ``ddp`` = ``NO_SHARD``, the hybrids), and its ``mp_policy``: None for ``bf16`` / ``fp32``
    (``--precision bf16-true`` / ``32-true``: the model loaded in that dtype), and
    ``MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=float32)`` on fp32 weights under
    ``torch.cuda.amp.autocast`` for ``bf16_autocast`` / ``fp16_autocast`` (``*-mixed``), which
    casts nothing (FSDP1 casts only a ``param_dtype`` other than the parameter's), so the
    trace passes none. Its 4-bit weights are bitsandbytes ``Linear4bit(quant_storage=
    torch_dtype)``: packed codes stored in the model's dtype, which FSDP1 flattens with the
    rest (Note [Traced quantized base] in trainmem/trace/quantized.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.quantization import BNB_4BIT, float_quant_storage
from trainmem.specs.ranks import fsdp1_no_shard
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import ALL_GATHER_STREAM, PRE_UNSHARD_STREAM, REDUCE_SCATTER_STREAM
from trainmem.trace._torch import require_torch
from trainmem.trace.recorder import Block, StorageRecorder, StreamTags, stream_tags

torch = require_torch()

__all__ = [
    "fake_process_group",
    "fsdp1_fake_pointers",
    "fsdp1_streams",
    "shard_model",
    "uses_fsdp",
    "wrap_fsdp1",
]


def uses_fsdp(training: TrainingConfig) -> bool:
    """True when ``training`` is traced with FSDP2 (parameters sharded over ranks).

    Args:
        training: ``zero_stage`` and ``data_parallel_size``.

    Returns:
        ``zero_stage == 3`` and more than one rank.
    """
    return training.zero_stage == 3 and training.data_parallel_size > 1


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A ``"fake"`` default process group of ``world_size`` ranks (rank 0) and its CPU mesh.

    Args:
        world_size: N.

    Yields:
        The 1-D ``DeviceMesh``.

    Raises:
        UnsupportedError: a process group is already initialised in this process.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UnsupportedError(
            "a torch.distributed process group is already initialised in this process; trace "
            "FSDP in a fresh process"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def accelerate_native_amp(training: TrainingConfig) -> bool:
    """accelerate runs the model's forward under ``torch.autocast`` for ``*-mixed`` (accelerator.py
    ``prepare_model``: ``native_amp`` wraps ``model.forward`` in
    ``get_mixed_precision_context_manager`` before the FSDP1 wrap), on top of FSDP1's
    ``MixedPrecision`` casting the units' parameters (Note [Tracing FSDP1]).

    Args:
        training: framework and precision.

    Returns:
        ``framework == "accelerate-fsdp"`` under a ``*-mixed`` precision (not float8).
    """
    return training.framework == "accelerate-fsdp" and training.is_mixed and not training.is_fp8


def shard_model(
    model: Any,
    mesh: Any,
    training: TrainingConfig,
    fake_mode: Any,
    *,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` every layer, then the root, in place; see Note [Tracing FSDP2].

    Args:
        model: the ``nn.Module`` (fake or real tensors).
        mesh: the device mesh of :func:`fake_process_group`.
        training: precision and framework (mixed-precision policy).
        fake_mode: the ``FakeTensorMode`` the tensors live in, or None for real tensors.
        reshard_after_forward: the layers' ``fully_shard(reshard_after_forward=...)`` (False:
            gathered from their forward to their backward, torchtitan under PP).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainmem.trace.lora import wrapped_blocks

    kwargs: dict[str, Any] = {"mesh": mesh}
    if (training.framework == "fsdp2" and training.is_mixed) or training.is_fp8:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, training.compute_dtype), reduce_dtype=torch.float32
        )
    layers = wrapped_blocks(model, "fsdp")
    with (
        fake_mode if fake_mode is not None else contextlib.nullcontext(),
        _lazy_rank_chunks(),
    ):
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)


def wrap_fsdp1(
    model: Any,
    mesh: Any,
    training: TrainingConfig,
    fake_mode: Any,
    *,
    reshard_after_forward: bool = True,
) -> Any:
    """Wrap ``model`` in FSDP1 as accelerate does; see Note [Tracing FSDP1].

    Args:
        model: the ``nn.Module`` (fake or real tensors), activation checkpointing applied.
        mesh: the device mesh of the data-parallel ranks: 1-D (``FULL_SHARD`` /
            ``SHARD_GRAD_OP``; ``NO_SHARD`` when :func:`~trainmem.specs.ranks.fsdp1_no_shard`)
            or 2-D replicate x shard (HSDP: ``HYBRID_SHARD``).
        training: the precision (mixed-precision policy).
        fake_mode: the ``FakeTensorMode`` the tensors live in, or None for real tensors.
        reshard_after_forward: ``FULL_SHARD``; False: ``SHARD_GRAD_OP``.

    Returns:
        The root ``FullyShardedDataParallel`` module, which the step must call.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    policy = _fsdp1_wrap_policy(model)
    mixed = None
    policy_dtype = fsdp1_policy_dtype(training)
    if policy_dtype is not None:  # Note [Tracing FSDP1]
        dtype = getattr(torch, policy_dtype)
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    hybrid = mesh.ndim == 2  # HSDP: (replicate, shard), FSDP1's device_mesh argument
    strategy = {
        (False, True): ShardingStrategy.FULL_SHARD,
        (False, False): ShardingStrategy.SHARD_GRAD_OP,
        (True, True): ShardingStrategy.HYBRID_SHARD,
        (True, False): ShardingStrategy._HYBRID_SHARD_ZERO2,
    }[hybrid, reshard_after_forward]
    if fsdp1_no_shard(training):  # replicated flat parameters, all-reduced gradients
        strategy = ShardingStrategy.NO_SHARD
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        root = FullyShardedDataParallel(
            model,
            device_mesh=mesh,
            auto_wrap_policy=policy,
            mixed_precision=mixed,
            sharding_strategy=strategy,
            device_id=torch.device("cpu"),
            use_orig_params=False,
        )
        if mixed is not None:
            _steady_state_views(root)
    return root


def fsdp1_policy_dtype(training: TrainingConfig) -> str | None:
    """The dtype of accelerate's FSDP1 ``MixedPrecision`` policy, or None for none (Note
    [Tracing FSDP1]): the 16-bit compute dtype under ``*-mixed`` (accelerate's
    ``set_mixed_precision``); for a bitsandbytes 4-bit base whose codes are stored in a 16-bit
    float (:func:`~trainmem.specs.quantization.float_quant_storage`) that dtype whatever the
    precision, as transformers' Trainer sets it (trainer.py ``_fsdp_qlora_plugin_updates``:
    ``fsdp_plugin.set_mixed_precision(bnb_4bit_quant_storage, override=True)`` when the
    storage is a floating dtype), so the fp32 LoRA units are gathered in it (the formulas'
    ``analytic.lora.adapter_matmul_bytes``). Not for fms-acceleration's GPTQ patch (the
    Trainer's override reads a bitsandbytes config: ``quantization_method ==
    BITS_AND_BYTES``), whose ``*-true`` run has no policy. None under fsdp-qlora (its policy
    casts nothing)."""
    if training.framework == "fsdp-qlora":
        return None
    if training.is_mixed:
        return training.compute_dtype
    storage = float_quant_storage(training) if training.quantize_base in BNB_4BIT else None
    return storage if storage is not None and storage != "float32" else None


def _steady_state_views(root: Any) -> None:
    """Leave every FSDP1 unit's parameter views as they are between steps: views of its
    16-bit unsharded flat parameter (storage freed), not of the fp32 one it was built from.

    Note [FSDP1 views between steps]
        With ``use_orig_params=False`` a unit's module attributes (``lora_A.weight``) are
        plain views: of the fp32 flat parameter when the unit is built (torch 2.13
        distributed/fsdp/_flat_param.py ``FlatParamHandle.__init__``:
        ``_use_unsharded_views``; ``shard`` swaps the flat parameter's data and leaves them),
        and after its first forward of the ``param_dtype`` unsharded one (``unshard`` ->
        ``_use_unsharded_flat_param``; ``reshard`` frees that storage and keeps the views).
        peft reads a child unit's dtype from outside it, before the unit's pre-forward
        unshards it (tuners/lora/layer.py ``Linear.forward``:
        ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``), so the first step's forward
        sees fp32 (an fp32 copy of the 16-bit input) and every later pass, the first step's
        checkpoint recompute included, bf16 (no copy). Under activation checkpointing the
        trace's warm-up then fails non-reentrant checkpointing's metadata check (the
        forward saved fp32, the recompute bf16, when the trace ran no autocast; a real first
        step runs under accelerate's ``native_amp`` autocast, accelerator.py
        ``prepare_model``, whose matmul casts save bf16 in both passes, as the trace's does
        now, :func:`accelerate_native_amp`, but the warm-up's fp32 input copies would still
        differ from the recorded step's). The
        recorded step is the steady state, in which the views are bf16 in both passes;
        each unit is unsharded and resharded once here as in a forward, so the warm-up
        runs as every later step does: FSDP1's own
        ``_lazy_init``, then in the ``FORWARD`` handle state (the only one in which
        ``_use_unsharded_flat_param`` re-points the views) ``FlatParamHandle.pre_unshard`` /
        ``unshard`` / ``post_unshard`` / ``reshard`` / ``post_reshard``, as ``_pre_forward``
        and ``_post_forward`` run them (``_unshard`` / ``_reshard`` in _runtime_utils.py;
        NO_SHARD's flat parameter is kept, its 16-bit copy freed by ``post_reshard``). The
        recorded step is unchanged by it (same bytes with and without, no checkpointing).
    """
    import importlib

    from torch.distributed.fsdp import FullyShardedDataParallel

    runtime: Any = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    states: Any = importlib.import_module("torch.distributed.fsdp._flat_param").HandleTrainingState
    runtime._lazy_init(root, root)
    for unit in FullyShardedDataParallel.fsdp_modules(root):
        handle = unit._handle
        if handle is None or not handle._uses_param_mixed_precision:
            continue
        handle._training_state = states.FORWARD  # views are re-pointed in the forward only
        handle.pre_unshard()
        handle.unshard()
        handle.post_unshard()
        handle.reshard(handle.uses_sharded_strategy)  # NO_SHARD keeps its flat parameter
        handle.post_reshard()
        handle._training_state = states.IDLE


@contextlib.contextmanager
def fsdp1_fake_pointers() -> Iterator[None]:
    """FSDP1's storage checks answered on fake tensors: it compares data pointers to tell a
    flat parameter's sharded storage from its unsharded one (torch 2.13 distributed/fsdp/
    _flat_param.py ``_same_storage``; _runtime_utils.py ``_catch_all_reshard``:
    ``flat_param.data_ptr() == flat_param._local_shard.data_ptr()``), and a fake tensor's
    pointer is 0 for every storage, so every check would say "same" (a frozen unit would then
    never be resharded). While tracing, a fake tensor's pointer is its storage's identity plus
    its offset, and ``_same_storage`` compares storages by identity: the answers a real
    allocation gives."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensor

    flat: Any = importlib.import_module("torch.distributed.fsdp._flat_param")
    original = flat._same_storage

    def storage_id(t: Any) -> int:
        from torch.distributed.tensor import DTensor

        t = t._local_tensor if isinstance(t, DTensor) else t
        return int(t.untyped_storage()._cdata)

    def data_ptr(t: Any) -> int:
        return storage_id(t) + t.storage_offset() * t.element_size()

    own = FakeTensor.__dict__.get("data_ptr")  # (none: TensorBase's)
    FakeTensor.data_ptr = data_ptr  # type: ignore[method-assign,assignment]
    flat._same_storage = lambda a, b: storage_id(a) == storage_id(b)
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.data_ptr
        else:
            FakeTensor.data_ptr = own  # type: ignore[method-assign]
        flat._same_storage = original


class _FSDP1Streams(StreamTags):
    """Note [FSDP1 streams on the trace]: the stream FSDP1 entered, and its rate limiter's
    pending frees, for the recorder."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.collecting = False  # inside a limited reshard that frees its flat parameter
        self.collected: list[tuple[StorageRecorder, Block]] = []
        self.held: dict[int, list[tuple[StorageRecorder, Block]]] = {}  # event id -> frees

    def stream(self) -> int:
        current = torch.cpu.current_stream()
        root = self.root
        for attr, sid in (
            ("_unshard_stream", ALL_GATHER_STREAM),
            ("_post_backward_stream", REDUCE_SCATTER_STREAM),
            ("_pre_unshard_stream", PRE_UNSHARD_STREAM),
        ):
            if getattr(root, attr, None) is current:
                return sid
        return 0

    def hold(self, recorder: StorageRecorder, block: Block) -> bool:
        if self.collecting and block.stream == ALL_GATHER_STREAM:
            self.collected.append((recorder, block))
            return True
        return False

    def enqueued(self, event: Any) -> None:
        """The limiter's free event of the reshard whose frees were collected."""
        if self.collected:
            self.held[id(event)] = self.collected
            self.collected = []

    def synchronized(self, event: Any) -> None:
        """The limiter waits on ``event``: the frees before it are done."""
        for recorder, block in self.held.pop(id(event), ()):
            recorder.release(block)

    def release_all(self) -> None:
        """A pass is over: every held free is done (Note [FSDP1 streams on the trace])."""
        for frees in self.held.values():
            for recorder, block in frees:
                recorder.release(block)
        self.held.clear()


@contextlib.contextmanager
def fsdp1_streams(root: Any) -> Iterator[None]:
    """Tag the recorded step's allocations with FSDP1's streams and hold its rate-limited frees;
    nothing unless ``root`` is an FSDP1 root module.

    Note [FSDP1 streams on the trace]
        torch's FSDP1 runs on the CPU with ``torch.cpu``'s stand-in streams (torch/cpu/
        __init__.py ``Stream``, ``stream()``, ``current_stream()``): ``_init_streams`` (torch
        2.13 distributed/fsdp/_runtime_utils.py) makes the root's ``_unshard_stream``,
        ``_post_backward_stream`` and ``_pre_unshard_stream``, and the real hooks enter them as
        on CUDA: ``_unshard`` allocates the padded unsharded flat parameter under
        ``stream(unshard_stream)`` and a mixed-precision unit's 16-bit shard under
        ``stream(pre_unshard_stream)`` (``FlatParamHandle.pre_unshard`` ->
        ``_use_low_precision_shard``), ``_post_backward_hook`` the reduce-scatter output (the
        sharded gradient, cast to the parameter's dtype) under
        ``stream(state._post_backward_stream)``. The recorder tags each allocation with the
        stream current when it is made (the ids of trainmem.timeline: 1 unshard, 2
        post-backward, 3 pre-unshard, 0 otherwise), so the replay keeps their blocks in
        per-stream pools as the caching allocator does, the pools the formulas model (Note
        [FSDP1 unshard stream pool], trainmem/analytic/transforms/sharding.py).

        The rate limiter (``limit_all_gathers``): ``_reshard`` frees a unit's unsharded flat
        parameter, ``record_stream``-ed on the compute stream, and enqueues a free event
        (_limiter_utils.py ``_FreeEventQueue``, two in flight); ``_unshard`` dequeues the
        oldest and synchronises on it before its all-gather. As the formulas assume (the GPU
        runs behind the CPU), such a block is not reusable until the limiter has synchronised
        on its event: the recorder holds its free back until ``_unshard`` dequeues that event,
        or the layer stack's pass ends (the last layer's forward returns, the backward's
        final callback ``_post_backward_final_callback`` is over), where the formulas'
        pending blocks end too (the prefetched layer's at ``stack.post_forward``, Note [FSDP1
        unshard stream pool]'s third block at ``stack.post_backward``). A held block counts
        as allocated until then, as the formulas' pending block does: both engines'
        allocated bytes include the pending frees that torch's ``max_memory_allocated``
        leaves out (a caching-allocator block freed with stream uses stops counting at
        once); they set the pool's size, the reserved bytes.

        Not tagged: HSDP's all-reduce stream (``_all_reduce_stream``), which the formulas do
        not model either.
    """
    import importlib

    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(root, FullyShardedDataParallel):
        yield
        return
    runtime: Any = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    limiter: Any = importlib.import_module("torch.distributed.fsdp._limiter_utils")
    tags = _FSDP1Streams(root)
    queue = limiter._FreeEventQueue
    reshard, final = runtime._reshard, runtime._post_backward_final_callback
    enqueue, dequeue = queue.enqueue, queue._dequeue

    def limited_reshard(state: Any, handle: Any, free_unsharded_flat_param: bool) -> None:
        tags.collecting = bool(state.limit_all_gathers and free_unsharded_flat_param)
        try:
            reshard(state, handle, free_unsharded_flat_param)
        finally:
            tags.collecting = False
            tags.collected = []  # (enqueued, or nothing freed)

    def queued(self: Any, event: Any) -> None:
        tags.enqueued(event)
        enqueue(self, event)

    def dequeued(self: Any) -> Any:
        event = dequeue(self)
        if event is not None:
            tags.synchronized(event)
        return event

    def final_callback(state: Any, module: Any) -> None:
        final(state, module)
        tags.release_all()

    runtime._reshard, runtime._post_backward_final_callback = limited_reshard, final_callback
    queue.enqueue, queue._dequeue = queued, dequeued
    from trainmem.trace.lora import layer_stack

    def stack_end(*_: Any) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recomputation in the backward
            tags.release_all()

    _, layers = layer_stack(root)
    forward_end = layers[-1].register_forward_hook(stack_end)
    try:
        with stream_tags(tags):
            yield
    finally:
        forward_end.remove()
        runtime._reshard, runtime._post_backward_final_callback = reshard, final
        queue.enqueue, queue._dequeue = enqueue, dequeue


def _fsdp1_wrap_policy(model: Any) -> Any:
    """accelerate's ``TRANSFORMER_BASED_WRAP`` on the layer classes (of every stack:
    :func:`~trainmem.trace.lora.wrapped_blocks`); with frozen parameters
    (LoRA) also every leaf module with a trainable ``weight`` as its own unit, as peft's
    ``fsdp_auto_wrap_policy`` (peft utils/other.py) does, which ``use_orig_params=False``
    needs (a flat parameter is all trainable or all frozen)."""
    import functools

    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    from trainmem.trace.lora import wrapped_blocks

    layers = wrapped_blocks(model, "fsdp")  # every stack's layers, as for FSDP2
    layer = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={type(m) for m in layers}
    )
    if all(p.requires_grad for p in model.parameters()):
        return layer

    def trainable_leaf(module: Any) -> bool:
        weight = getattr(module, "weight", None)
        return not list(module.children()) and weight is not None and weight.requires_grad

    leaf = functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf)
    return functools.partial(_or_policy, policies=[leaf, layer])


class _LazyChunks(Sequence[Any]):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` entries, as
    ``_chunk_with_empty`` returns (torch/distributed/fsdp/_fully_shard/_fsdp_common.py), but
    each chunk made only when indexed: ``FSDPParam`` reads chunk 0 (the padded size) and its
    own rank's chunk. Same views, same sizes (``torch.chunk`` splits into ``ceil(d / n)``-row
    pieces); building all ``n`` fake views eagerly cost about 0.3 ms per rank per parameter,
    minutes for thousands of ranks."""

    def __init__(self, tensor: Any, num_chunks: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.step = -(-size // num_chunks) if size else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.n))]
        if index < 0:
            index += self.n
        if not 0 <= index < self.n:
            raise IndexError(index)
        size = self.tensor.size(self.dim)
        start = index * self.step
        if size == 0:  # torch.chunk gives n empty views of the tensor's shape
            return self.tensor.narrow(self.dim, 0, 0)
        if start >= size:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, size - start))


@contextlib.contextmanager
def _lazy_rank_chunks() -> Iterator[None]:
    """Patch FSDP2's ``_chunk_with_empty`` with :class:`_LazyChunks` while sharding."""
    import importlib

    module: Any = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param")
    original = module._chunk_with_empty
    module._chunk_with_empty = _LazyChunks
    try:
        yield
    finally:
        module._chunk_with_empty = original
