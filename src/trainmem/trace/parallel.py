"""The device mesh of a traced rank and the parallelisms applied over it, in torchtitan's order.

Note [Tracing one rank of a mesh]
    The world is ``pipeline_parallel_size x data_parallel_size x context_parallel_size x
    tensor_parallel_size`` ranks laid out as torchtitan's ``ParallelDims`` builds its mesh
    (``torchtitan/distributed/parallel_dims.py``: dimensions ``pp, dp_replicate, dp_shard, cp,
    tp``, the last varying fastest; ``dp_replicate`` under HSDP, ``shard_group_size`` smaller
    than ``data_parallel_size``); size-1 dimensions are left out (pipeline parallelism:
    ``trainmem.trace.pipeline``). One rank of it is run in this process under torch's
    ``"fake"`` process group
    (``torch.testing._internal.distributed.fake_pg.FakeStore``): collectives allocate their
    output buffers and return at once, so every storage the rank allocates is recorded and no
    other rank exists. The model is parallelized in torchtitan's order (``parallelize_llama``):
    tensor / sequence parallelism on the ``tp`` sub-mesh (:mod:`trainmem.trace.tensor_parallel`),
    activation checkpointing (applied by the engine before this module runs; the order does not
    change what is allocated, the checkpoint wraps the layer's call), then FSDP2 on the
    ``dp_shard`` sub-mesh (:mod:`trainmem.trace.fsdp`; 2-D FSDP x TP when both are on).

    Which rank: every rank of a TP / FSDP mesh holds the same shapes except where a dimension
    does not divide: ``DTensor`` shards follow ``torch.chunk`` (rank 0 holds the largest
    piece) and FSDP2 pads every shard to ``ceil(dim0 / N)`` rows, so rank 0 is the most loaded
    and is the one traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.ranks import fsdp1_framework, fsdp1_no_shard
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.fsdp import fsdp1_fake_pointers, shard_model, uses_fsdp, wrap_fsdp1

torch = require_torch()

__all__ = [
    "add_position_ids",
    "context_parallel",
    "loss_context",
    "mesh_coordinates",
    "mesh_dims",
    "mesh_size",
    "parallelize",
    "trace_mesh",
    "uses_mesh",
]


def mesh_dims(training: TrainingConfig) -> dict[str, int]:
    """Mesh dimension name -> size, outermost first; see Note [Tracing one rank of a mesh].

    Args:
        training: ``pipeline_parallel_size``, ``data_parallel_size`` (a ``dp_shard``
            dimension under FSDP2; ``dp_replicate x dp_shard`` when ``shard_group_size`` is
            smaller, HSDP), ``context_parallel_size`` and ``tensor_parallel_size``.

    Returns:
        The dimensions of size > 1 (empty: a single rank), and ``dp`` of FSDP1's ``NO_SHARD``
        (:func:`~trainmem.specs.ranks.fsdp1_no_shard`; one rank included: FSDP1 needs a process
        group).
    """
    dims = {}
    if training.pipeline_parallel_size > 1:  # outermost (torchtitan's ParallelDims)
        dims["pp"] = training.pipeline_parallel_size
    if uses_fsdp(training):
        dp, group = training.data_parallel_size, training.shard_group_size
        # the ranks FSDP2 shards over: dp_shard x cp (torchtitan's "dp_shard_cp"), of which a
        # shard group spans shard_group_size (TrainingConfig.sharding_degree)
        cp = training.context_parallel_size if shards_over_cp(training) else 1
        if group is not None and group < dp * cp:  # HSDP: replicas of a shard group
            dims["dp_replicate"] = dp * cp // group
            if group // cp > 1:
                dims["dp_shard"] = group // cp
        else:
            dims["dp_shard"] = dp
    elif fsdp1_no_shard(training):  # FSDP1 NO_SHARD: a process group even of one rank
        dims["dp"] = training.data_parallel_size
    if training.context_parallel_size > 1:
        dims["cp"] = training.context_parallel_size
    if training.tensor_parallel_size > 1:
        dims["tp"] = training.tensor_parallel_size
    return dims


def shards_over_cp(training: TrainingConfig) -> bool:
    """FSDP2 shards over the context-parallel ranks too (torchtitan's ``dp_shard_cp``;
    ``FrameworkConventions.fsdp_shards_over_context_parallel``), not FSDP1."""
    return (
        training.context_parallel_size > 1
        and training.conventions.fsdp_shards_over_context_parallel
    )


def uses_mesh(training: TrainingConfig) -> bool:
    """True when the step runs over a device mesh (FSDP2, tensor, context or pipeline
    parallelism)."""
    return bool(mesh_dims(training))


def mesh_coordinates(training: TrainingConfig, rank: int = 0) -> dict[str, int]:
    """Global rank ``rank``'s index along every dimension of the traced mesh.

    Args:
        training: the parallel sizes (:func:`mesh_dims`).
        rank: a global rank of the mesh.

    Returns:
        Dimension name -> index, outermost first (``{}``: a single rank).
    """
    dims = mesh_dims(training)
    coords, rest = {}, rank
    for name in reversed(dims):
        coords[name] = rest % dims[name]
        rest //= dims[name]
    return {k: coords[k] for k in dims}


def mesh_size(training: TrainingConfig) -> int:
    """Ranks of the traced mesh: the product of :func:`mesh_dims` (1 without a mesh; a data-
    parallel dimension without sharding is no mesh dimension, so not counted)."""
    world = 1
    for n in mesh_dims(training).values():
        world *= n
    return world


@contextlib.contextmanager
def trace_mesh(training: TrainingConfig, rank: int = 0) -> Iterator[Any]:
    """A ``"fake"`` default process group over the whole mesh, as ``rank``, and its CPU mesh.

    Args:
        training: the parallel sizes (:func:`mesh_dims`).
        rank: the global rank this process plays.

    Yields:
        The ``DeviceMesh`` (dimension names of :func:`mesh_dims`).

    Raises:
        UnsupportedError: a process group is already initialised in this process.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = mesh_dims(training)
    world = mesh_size(training)
    if dist.is_initialized():
        raise UnsupportedError(
            "a torch.distributed process group is already initialised in this process; trace "
            "a parallel step in a fresh process"
        )
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_real_mesh_tensors())
            stack.enter_context(_eager_collectives())
            if fsdp1_framework(training):  # Note [Tracing FSDP1]
                stack.enter_context(fsdp1_fake_pointers())
            yield device_mesh(dims)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _eager_collectives() -> Iterator[None]:
    """Make DTensor and the functional collectives take their eager paths on fake tensors.

    ``torch.distributed._functional_collectives._are_we_tracing`` answers True whenever a
    ``FakeTensorMode`` is active, and DTensor then takes its compile-time paths: outputs of
    collectives waited at once instead of ``AsyncCollectiveTensor``, padding / narrowing
    copies kept, sharding propagation not cached (and run on global-shape fake tensors inside
    the step). A real eager step takes the other branch, so the fake-mode test is dropped
    (tracing by ``make_fx`` / dynamo still answers True).
    """
    import sys

    import torch.distributed._functional_collectives as funcol

    orig = funcol._are_we_tracing  # type: ignore[attr-defined]

    def are_we_tracing() -> bool:
        from torch.compiler import is_dynamo_compiling
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if is_dynamo_compiling():
            return True
        if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher):
            return True
        return get_proxy_mode() is not None

    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torch.distributed") and getattr(m, "_are_we_tracing", None) is orig
    ]
    for m in patched:
        m._are_we_tracing = are_we_tracing  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in patched:
            m._are_we_tracing = orig  # type: ignore[attr-defined]


@contextlib.contextmanager
def _real_mesh_tensors() -> Iterator[None]:
    """Compute ``DeviceMesh.mesh`` (the rank layout, an int tensor) outside the fake mode.

    FSDP2 on a TP-sharded parameter concatenates the dp and tp meshes
    (``_fsdp_param.py``, ``_init_sharding_spec_tp`` -> ``DeviceMesh._concatenate``), whose rank
    tensor and coordinates are built from a real tensor; inside ``FakeTensorMode`` those ops are
    refused.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    prop = DeviceMesh.__dict__["mesh"]
    init = DeviceMesh.__init__

    def mesh(self: Any) -> Any:
        with unset_fake_temporarily():
            return prop.fget(self)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.mesh = property(mesh)  # type: ignore[method-assign,assignment]
    DeviceMesh.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.mesh = prop  # type: ignore[method-assign]
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


def device_mesh(dims: dict[str, int]) -> Any:
    """``init_device_mesh("cpu", sizes, mesh_dim_names=names)`` over the default group.

    Args:
        dims: :func:`mesh_dims`.

    Returns:
        The ``DeviceMesh``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


def parallelize(model: Any, mesh: Any, training: TrainingConfig, fake_mode: Any) -> Any:
    """Apply TP / SP, then FSDP2 (over dp_shard x cp), in place, or FSDP1 around it
    (``accelerate-fsdp``, Note [Tracing FSDP1] in trainmem/trace/fsdp.py); see Note [Tracing
    one rank of a mesh]. Context parallelism itself is entered around the step
    (:func:`context_parallel`).

    Args:
        model: the model (fake or real tensors), activation checkpointing already applied.
        mesh: the mesh of :func:`trace_mesh` (or a real one of the same dimensions).
        training: the parallel settings.
        fake_mode: the ``FakeTensorMode`` of the tensors, or None for real tensors.

    Returns:
        The module the step calls: ``model``, or FSDP1's root wrapper of it.

    Raises:
        UnsupportedError: a model / setting the parallelisms cannot be applied to.
    """
    from trainmem.trace.tensor_parallel import apply_tensor_parallel
    from trainmem.trace.timm_parallel import apply_timm_tensor_parallel, is_timm_model

    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            if is_timm_model(model):  # Note [timm's transformer blocks]
                apply_timm_tensor_parallel(
                    model, mesh["tp"], sequence_parallel=training.sequence_parallel
                )
            elif type(model).__module__.startswith("diffusers."):
                from trainmem.trace.diffusers_parallel import apply_diffusers_tensor_parallel

                # Note [Tracing tensor parallelism of diffusers blocks]
                apply_diffusers_tensor_parallel(
                    model, mesh["tp"], sequence_parallel=training.sequence_parallel
                )
            else:
                apply_tensor_parallel(
                    model,
                    mesh["tp"],
                    sequence_parallel=training.sequence_parallel,
                    float8=training.is_fp8,
                    saves_gathered_input=training.sequence_parallel_saves_gathered_input,
                )
    if "cp" in names and is_timm_model(model):  # Note [Context parallelism of a ViT's tokens]
        from trainmem.trace.timm_parallel import apply_timm_context_parallel

        apply_timm_context_parallel(model, mesh["cp"] if len(names) > 1 else mesh)
    if "dp" in names:  # FSDP1 NO_SHARD (trainmem.specs.ranks.fsdp1_no_shard)
        dp_mesh = mesh if len(names) == 1 else mesh["dp"]
        return wrap_fsdp1(model, dp_mesh, training, fake_mode)
    fsdp_dims = tuple(d for d in ("dp_shard", "cp") if d in names)
    if fsdp_dims:
        # torchtitan shards over dp_shard x cp flattened ("dp_shard_cp"), FSDP even without
        # dp_shard when CP is on (its gradients must be reduced over the cp ranks)
        if len(names) == 1:
            fsdp_mesh = mesh
        elif len(fsdp_dims) == 1:
            fsdp_mesh = mesh[fsdp_dims[0]]
        else:
            fsdp_mesh = mesh[fsdp_dims]._flatten("dp_shard_cp")
        if "dp_replicate" in names:
            # HSDP: a 2-D mesh (replicate, shard), as torchtitan's parallelize_llama passes
            # ("dp_replicate", "dp_shard_cp"): shards within a group, the reduce-scattered
            # gradient all-reduced across the replicas (_fsdp_collectives.foreach_reduce)
            shard = fsdp_dims[0] if len(fsdp_dims) == 1 else "dp_shard_cp"
            fsdp_mesh = mesh[("dp_replicate", shard)]
        # under PP torchtitan keeps the layers gathered from forward to backward
        # (apply_fsdp: reshard_after_forward = not pp_enabled); otherwise the user's setting
        reshard = training.pipeline_parallel_size == 1 and training.reshard_after_forward
        if fsdp1_framework(training):  # FSDP1 (Note [Tracing FSDP1])
            if "cp" in names and "dp_shard" in names:  # FSDP1 shards over its data ranks only
                fsdp_mesh = mesh["dp_shard"]
            return wrap_fsdp1(model, fsdp_mesh, training, fake_mode, reshard_after_forward=reshard)
        shard_model(model, fsdp_mesh, training, fake_mode, reshard_after_forward=reshard)
    return model


def add_position_ids(batch: Any, training: TrainingConfig) -> None:
    """Give a transformers batch explicit ``position_ids`` [b, s] under context parallelism:
    the model would otherwise number the positions of the local sequence shard from 0.

    Args:
        batch: a micro-batch dict with ``input_ids`` (anything else is left alone).
        training: ``context_parallel_size``.
    """
    if training.context_parallel_size == 1 or not isinstance(batch, dict):
        return
    ids = batch.get("input_ids")
    if ids is None or "position_ids" in batch:
        return
    b, s = ids.shape
    batch["position_ids"] = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()


def context_parallel(
    mesh: Any, batches: list[Any], training: TrainingConfig, model: Any = None
) -> contextlib.AbstractContextManager[Any]:
    """torch's context parallelism around the steps, or a no-op.

    ``torch.distributed.tensor.experimental.context_parallel`` over the ``cp`` sub-mesh
    (torchtitan's ``create_context_parallel_ctx``): the micro-batches' ``input_ids``,
    ``labels`` and ``position_ids`` are sharded in place along the sequence (head-tail load
    balanced) and SDPA becomes ring attention (its handler runs the CUDA flash / efficient
    kernels on the local blocks and keeps the running output / logsumexp). Enter it inside
    the SDPA routing of ``trainmem.trace.cuda_sdpa`` so that the ring calls the routed kernel.

    Args:
        mesh: the traced mesh (None: no mesh).
        batches: the micro-batches (dicts), sharded in place.
        training: ``context_parallel_size``.
        model: the model; a diffusers denoiser's latents are sharded instead (Note [Context
            parallelism of a denoiser] in trainmem/trace/diffusers_parallel.py).

    Returns:
        A context manager for both steps.
    """
    if mesh is None or training.context_parallel_size == 1:
        return contextlib.nullcontext()
    if any(c.__module__.startswith("diffusers.") for c in type(model).__mro__):
        # (FSDP2's class of the model subclasses the diffusers one)
        from trainmem.trace.diffusers_parallel import denoiser_context_parallel

        return denoiser_context_parallel(model, mesh, batches, training)
    from torch.distributed.tensor.experimental import context_parallel as cp_context

    keys = ("input_ids", "labels", "position_ids")
    buffers = [b[k] for b in batches if isinstance(b, dict) for k in keys if k in b]
    cp_mesh = mesh["cp"] if len(mesh.mesh_dim_names) > 1 else mesh
    if not buffers:  # an image model: its tokens are sharded inside it (trace.timm_parallel)
        return _ring_attention(cp_mesh)
    return cp_context(
        cp_mesh,
        buffers=buffers,
        buffer_seq_dims=[1] * len(buffers),
        no_restore_buffers=set(buffers),
    )


@contextlib.contextmanager
def _ring_attention(cp_mesh: Any) -> Iterator[None]:
    """SDPA as ring attention over ``cp_mesh``, without load balancing and without a buffer to
    shard: ``context_parallel``'s dispatcher alone (torch 2.13 distributed/tensor/experimental/
    _context_parallel/_attention.py ``context_parallel``: its monkey-patch mode,
    ``_enable_context_parallel_dispatcher_impl(seq_dim=2, ...)``), for a model that shards its
    own tokens (Note [Context parallelism of a ViT's tokens] in trainmem/trace/timm_parallel.py;
    its non-causal attention refuses load balancing)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH  # as context_parallel sets it
    balance = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = False
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        yield
    finally:
        cp._disable_context_parallel_dispatcher_impl()
        cp._cp_options.enable_load_balance = balance


def loss_context(training: TrainingConfig) -> contextlib.AbstractContextManager[Any]:
    """``loss_parallel()`` under tensor parallelism (the logits stay vocabulary-sharded and the
    cross-entropy reduces across ranks; torchtitan's ``train_context``), else a no-op.

    Args:
        training: ``tensor_parallel_size``.

    Returns:
        A context manager for the forward and the backward.
    """
    if training.tensor_parallel_size == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
