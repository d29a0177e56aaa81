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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["fake_process_group", "shard_model", "uses_fsdp"]


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
