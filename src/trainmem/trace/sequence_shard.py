"""Megatron's sequence-parallel column-parallel linears in the trace: they save the sequence
shard of their input, not the all-gathered sequence (Note [Megatron's column-parallel linears
save the shard]).

Note [Megatron's column-parallel linears save the shard]
    Under sequence parallelism the input of a column-parallel linear (q/k/v, gate/up, the output
    layer) is sharded over the sequence and all-gathered before the GEMM. DTensor's plan
    (torchtitan's ``PrepareModuleInput(Shard(1) -> Replicate)`` / ``ColwiseParallel(
    input_layouts=Shard(1))``) hands the gathered tensor to the linears, whose matmuls save it
    whole for the weight gradient. megatron-core saves the shard and gathers it again in
    backward:

    * ``ColumnParallelLinear`` (megatron-core core_v0.9.0 megatron/core/tensor_parallel/
      layers.py ``LinearWithGradAccumulationAndAsyncCommunication``): ``forward`` runs
      ``ctx.save_for_backward(input, weight)`` on the sequence shard, gathers it with
      ``_all_gather_base`` into ``get_global_memory_buffer().get_tensor(..., "mpu")`` for the
      GEMM; ``backward`` gathers ``input`` into that buffer again for the weight gradient
      (``grad_output.t().matmul(total_input)``) and reduce-scatters the input gradient;
    * TransformerEngine's ``LayerNormLinear`` / ``Linear`` (the TE spec's
      ``TELayerNormColumnParallelLinear``; TE v1.11 transformer_engine/pytorch/module/
      layernorm_linear.py ``_LayerNormLinear``): ``forward`` gathers ``ln_out`` into a new
      tensor (``gather_along_first_dim``) for the GEMM and saves ``ln_out``, the shard;
      ``backward`` gathers it again into a new tensor before the input-gradient GEMM and
      frees it after the weight-gradient GEMM (``clear_tensor_data(ln_out_total)``).

    The trace runs DTensor's forward (its gather) and swaps what the linears save: inside the
    module that gathers (the attention, the MLP, the output layer) a ``saved_tensors_hooks``
    pair packs a saved tensor that is a view of the gathered input as the shard (kept alive
    instead) and unpacks it by gathering the shard into one new full tensor, alive while that
    linear's backward node runs, as TE's ``ln_out_total`` (the trace's q, k and v are three
    linears where Megatron fuses one: three gathers one after another, one alive at a time).
    Per layer and rank the saved bytes of the two gathered inputs fall from 2 x b s h c to
    2 x b s h c / t (the analytic engine's rule: ``parallel_divisor`` in
    trainmem/analytic/activation_parallelism.py). # NB the formulas do not place the backward's
    gathers (their layer backward is not linear by linear for the attention): on the
    agreement Llama at tp 2, 2 x 1,024 tokens, the trace's gathers at gate / up and q / k / v
    reach 1,139.9 MB, below its backward peak at the down projection (1,154.6 MB) and its step
    peak at the loss (1,160.9 MB); at a tensor-parallel size where b s h c outgrows the
    MLP's 2 b s i c / t they may set a layer's backward peak. # NB under activation checkpointing (a
    ``saved_tensors_hooks`` already active) the hooks are not installed: the recompute saves
    the gathered input as DTensor does (not reconciled).

Source: megatron-core core_v0.9.0 megatron/core/tensor_parallel/layers.py; TransformerEngine
v1.11 transformer_engine/pytorch/module/layernorm_linear.py.
"""

from __future__ import annotations

from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["save_sequence_shard"]

_SHARD = "trainmem.sequence_shard"


def _local(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return x._local_tensor if isinstance(x, DTensor) else x


def _storage(x: Any) -> int:
    return int(_local(x).untyped_storage()._cdata)


def _gather(shard: Any, mesh: Any, full_shape: tuple[int, ...]) -> Any:
    """The sequence-sharded ``shard`` ([b, s / t, ...] on this rank) gathered over ``mesh``
    into one new [b, s, ...] tensor (Megatron's one gather buffer; no chunk-and-cat copy)."""
    import torch.distributed as dist

    full = shard.new_empty(full_shape)
    pieces = list(full.chunk(mesh.size(), dim=1))
    dist.all_gather(pieces, shard.contiguous(), group=mesh.get_group())
    return full


def save_sequence_shard(module: Any, mesh: Any, kwarg: str | None = None) -> None:
    """Make the linears under ``module`` save the sequence shard of its input (the ``kwarg``
    keyword argument, else the first positional one) where they would save the gathered input
    (Note [Megatron's column-parallel linears save the shard]). Call after the module's
    DTensor plan is applied (its input-preparing hooks run before the one added here)."""
    from torch.distributed.tensor import DTensor

    if module is None:
        return
    state: dict[str, Any] = {}

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return kwargs.get(kwarg) if kwarg is not None else (args[0] if args else None)

    def before(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state["shard"] = argument(args, kwargs)

    def after(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shard, full = state.pop("shard", None), argument(args, kwargs)
        if not (isinstance(shard, DTensor) and isinstance(full, torch.Tensor)):
            return
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            return  # a checkpoint's hooks are active (# NB in the Note)
        gathered, local = _storage(full), shard._local_tensor
        shape = tuple(shard.shape)

        def pack(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or _storage(t) != gathered:
                return t
            view = _local(t)
            meta = (view.shape, view.stride(), view.storage_offset())
            spec = (
                (t.device_mesh, t.placements, t.shape, t.stride())
                if isinstance(t, DTensor)
                else None
            )
            return (_SHARD, local, meta, spec)

        def unpack(packed: Any) -> Any:
            if not (isinstance(packed, tuple) and packed and packed[0] == _SHARD):
                return packed
            _, shard_local, (size, stride, offset), spec = packed
            view = _gather(shard_local, mesh, shape).as_strided(size, stride, offset)
            if spec is None:
                return view
            dmesh, placements, gshape, gstride = spec
            return DTensor.from_local(
                view, dmesh, placements, run_check=False, shape=gshape, stride=gstride
            )

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        state["hooks"] = hooks

    def done(_mod: Any, _args: Any, _kwargs: Any, _out: Any) -> None:
        hooks = state.pop("hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(before, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(after, with_kwargs=True)
    module.register_forward_hook(done, with_kwargs=True, always_call=True)
