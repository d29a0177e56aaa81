"""Record every tensor-storage allocation and free of a training step, with its module and phase.

A :class:`StorageRecorder` is a ``TorchDispatchMode`` placed *inside* ``FakeTensorMode`` (or used
on real tensors): every ATen op passes through :meth:`StorageRecorder.__torch_dispatch__` below
autograd, so autograd's own buffers (gradients, ``AccumulateGrad`` clones, checkpoint
recomputation) are seen too. A storage counts once, however many views share it, at its
requested size ``UntypedStorage.nbytes()`` (the CUDA caching allocator rounds it up to 512 B
later; see ``trainmem.allocator``). A free is the ``weakref`` callback of the storage's Python
object: storages keep their Python object alive as long as the C++ ``StorageImpl`` lives
(PyObject preservation, ``torch/csrc/Storage.cpp``), so the callback fires exactly when the
storage is released.

The module that allocated a block comes from :class:`~trainmem.trace.module_paths.
ModulePathTracker` (forward hooks; autograd-node ownership in backward).

Mirrors: ``torch/distributed/_tools/mem_tracker.py`` (MemTracker), which does the same with more
bookkeeping per op and is 6-30x slower (shared/notes/tracing-without-a-gpu.md, sec. 2).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.trace._torch import require_torch
from trainmem.trace.module_paths import ModulePathTracker

torch = require_torch()

from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten  # noqa: E402

__all__ = [
    "RESIZE_OP",
    "Block",
    "RawEvent",
    "StorageRecorder",
    "plain_tensors",
    "stream_tags",
    "untracked",
]

_ALIASING_COLLECTIVE_OPS = frozenset(
    {"_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"}
)
"""Ops whose real output is their input (``torch/csrc/distributed/c10d/Functional.cpp``
``wait_tensor``; ``torch/distributed/_functional_collectives.py`` ``_wrap_tensor_autograd``
wraps it in an ``AsyncCollectiveTensor``)."""

RESIZE_OP = "UntypedStorage.resize_"
"""``Block.op`` of a storage re-allocated in place (FSDP2's ``alloc_storage``)."""


_UNTRACKED = [0]


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Ops run inside allocate nothing a GPU would allocate; the recorder skips them (the
    pointwise intermediates inductor fuses away, ``trainmem.trace.compile``)."""
    _UNTRACKED[0] += 1
    try:
        yield
    finally:
        _UNTRACKED[0] -= 1


_STREAM_TAGS: list[StreamTags] = []


class StreamTags:
    """What a framework's streams tell the recorder (Note [FSDP1 streams on the trace] in
    trainmem/trace/fsdp.py): the CUDA stream id of an allocation made now, and whether a free
    made now is held back (its block not yet reusable) until the owner releases it."""

    def stream(self) -> int:
        """The stream id of an allocation made now (0: the default stream)."""
        return 0

    def hold(self, recorder: StorageRecorder, block: Block) -> bool:
        """True to keep ``block``'s free from the event list now; the owner later calls
        :meth:`StorageRecorder.release` with it."""
        return False


@contextlib.contextmanager
def stream_tags(tags: StreamTags) -> Iterator[None]:
    """Tag the recorder's allocations and frees with ``tags`` while inside."""
    _STREAM_TAGS.append(tags)
    try:
        yield
    finally:
        _STREAM_TAGS.remove(tags)


def plain_tensors(tensor: Any) -> list[Any]:
    """The plain tensors holding ``tensor``'s data: itself, or the inner tensors of a wrapper
    subclass (a ``DTensor`` parameter of FSDP2 holds only its local shard,
    ``DTensor.__tensor_flatten__`` -> ``_local_tensor``).

    Args:
        tensor: any tensor.

    Returns:
        Plain tensors whose storages are the memory.
    """
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, n) for n in names)  # DTensor also lists its device_mesh
    return [t for x in inner if isinstance(x, torch.Tensor) for t in plain_tensors(x)]


@dataclass(slots=True)
class Block:
    """One storage's life.

    Attributes:
        block_id: sequential id, in allocation order.
        size_bytes: requested bytes (``UntypedStorage.nbytes()``).
        phase: phase at allocation (``init`` for storages that existed before recording).
        module: dotted module path that allocated it (``""`` outside any module).
        category: final category (see ``trainmem.trace.attribution``); None until decided.
        forward_region: index of the forward region (main forward or a checkpoint recomputation)
            the block was allocated in, or -1.
        freed: the free has been recorded.
        op: ATen op that allocated it (``aten.mm.default``), ``""`` for registered storages.
        stream: CUDA stream id it was allocated on (:class:`StreamTags`; 0 = default).
    """

    block_id: int
    size_bytes: int
    phase: str
    module: str
    category: MemoryCategory | None = None
    forward_region: int = -1
    freed: bool = False
    op: str = ""
    stream: int = 0


@dataclass(slots=True)
class RawEvent:
    """An alloc or free before categories are final: ``(action, block, phase)``; ``phase`` is
    the phase running when the event happened (a free's phase can differ from its alloc's)."""

    action: str
    block: Block
    phase: str


@dataclass
class StorageRecorder(TorchDispatchMode):  # type: ignore[misc]
    """Dispatch mode recording storage allocations/frees in order.

    Use as ``recorder.set_root(model)`` then ``with fake_mode, recorder, recorder.modules:``.
    Set :attr:`phase` from the step driver. Call :meth:`register` for storages that exist
    before recording (parameters...).

    Attributes:
        phase: current phase name (``forward``, ``backward``, ``optimizer``, ``zero_grad``).
        events: ordered raw events.
        blocks: every block ever seen, by id.
        live_bytes: requested bytes currently live.
    """

    phase: str = "init"
    events: list[RawEvent] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    live_bytes: int = 0
    forward_region: int = -1
    _live: dict[int, tuple[Block, weakref.ref[Any]]] = field(default_factory=dict)
    modules: Any = None
    on_alloc: Callable[[Block], None] | None = None
    _orig_resize: Any = None
    _orig_propagate: Any = None
    _paused: int = 0

    def __post_init__(self) -> None:
        super().__init__()

    # -- public -------------------------------------------------------------------------

    def set_root(self, root: Any) -> None:
        """Track module paths of ``root`` (``self.modules`` becomes its tracker)."""
        self.modules = ModulePathTracker(root)

    def current_module(self) -> str:
        """Innermost module whose forward or backward is running, as a dotted path."""
        return self.modules.current() if self.modules is not None else ""

    def register(self, tensor: Any, category: MemoryCategory, module: str = "") -> Block | None:
        """Record ``tensor``'s storage as live (``phase`` ``init`` before the step) and set its
        category; re-labels the block if the storage is already known.

        Args:
            tensor: any tensor (views register their base storage).
            category: what it holds.
            module: owner path for the per-module tables.

        Returns:
            The block, or None for an undefined tensor.
        """
        if tensor is None:
            return None
        inner = plain_tensors(tensor)
        if len(inner) != 1 or inner[0] is not tensor:
            blocks = [self.register(t, category, module) for t in inner]
            return blocks[0] if blocks else None
        st = tensor.untyped_storage()
        known = self._live.get(id(st))
        if known is not None:
            known[0].category = category
            return known[0]
        block = self._new_block(st, op="", module=module)
        block.category = category
        return block

    def block_of(self, tensor: Any) -> Block | None:
        """The live block behind ``tensor``, or None."""
        tensor = plain_tensors(tensor)[0]
        known = self._live.get(id(tensor.untyped_storage()))
        return None if known is None else known[0]

    def __enter__(self) -> StorageRecorder:
        # FSDP2 frees and re-allocates its unsharded parameters by resizing their storage in
        # place (``_fsdp_param.py``: ``free_storage`` / ``alloc_storage``), a Python storage
        # method that no dispatch mode sees; wrap it while recording.
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig

        def resize_(st: Any, size: int) -> Any:
            out = orig(st, size)
            self._on_resize(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._patch_sharding_propagation()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_propagate is not None:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate  # type: ignore[method-assign]
            self._orig_propagate = None
        return super().__exit__(*exc)

    def _patch_sharding_propagation(self) -> None:
        """DTensor infers output shapes by running the op on global-shape fake tensors
        (``ShardingPropagator._propagate_tensor_meta_non_cached``, inside the ambient fake
        mode); those tensors are never allocated on a GPU, so the recorder pauses there."""
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:  # pragma: no cover - torch without distributed
            return
        orig = ShardingPropagator._propagate_tensor_meta_non_cached
        self._orig_propagate = orig

        def propagate(prop: Any, *args: Any, **kwargs: Any) -> Any:
            self._paused += 1
            try:
                return orig(prop, *args, **kwargs)
            finally:
                self._paused -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign,assignment]

    def _on_resize(self, st: Any) -> None:
        known = self._live.get(id(st))
        if known is not None and known[0].size_bytes == st.nbytes():
            return
        if known is not None:
            del self._live[id(st)]
            self._free(known[0])
        if st.nbytes() > 0:
            self._new_block(st, op=RESIZE_OP)

    # -- internals ----------------------------------------------------------------------

    def release(self, block: Block) -> None:
        """Record ``block``'s free now: one a :class:`StreamTags` held back."""
        block.freed = True
        self.live_bytes -= block.size_bytes
        self.events.append(RawEvent("free", block, self.phase))

    def _free(self, block: Block) -> None:
        block.freed = True  # (its storage is gone: a held block is freed, not yet reusable)
        if _STREAM_TAGS and _STREAM_TAGS[-1].hold(self, block):
            return
        self.release(block)

    def _new_block(self, st: Any, *, op: str, module: str | None = None) -> Block:
        block = Block(
            block_id=len(self.blocks),
            size_bytes=int(st.nbytes()),
            phase=self.phase,
            module=self.current_module() if module is None else module,
            forward_region=self.forward_region,
            op=op,
            stream=_STREAM_TAGS[-1].stream() if _STREAM_TAGS else 0,
        )
        self.blocks.append(block)
        key = id(st)

        def on_free(_: Any, block: Block = block, key: int = key) -> None:
            entry = self._live.get(key)
            if entry is not None and entry[0] is block:
                del self._live[key]
            self._free(block)

        self._live[key] = (block, weakref.ref(st, on_free))
        self.live_bytes += block.size_bytes
        self.events.append(RawEvent("alloc", block, self.phase))
        if self.on_alloc is not None:
            self.on_alloc(block)
        return block

    def _track(self, out: Any, op: str) -> None:
        flat, _ = tree_flatten(out)
        for t in (p for x in flat if isinstance(x, torch.Tensor) for p in plain_tensors(x)):
            st = t.untyped_storage()
            known = self._live.get(id(st))
            if known is None:
                self._new_block(st, op=op)
            elif known[0].size_bytes != st.nbytes():  # resize_ / out= variant grew it in place
                del self._live[id(st)]
                self._free(known[0])
                self._new_block(st, op=op)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._paused or _UNTRACKED[0]:
            return func(*args, **(kwargs or {}))
        if any(is_traceable_wrapper_subclass(t) for t in tree_flatten((args, kwargs))[0]):
            # A DTensor op: let the subclass run it; its local ops (including the temporaries
            # of redistributions and of loss_parallel's decompositions) come back through this
            # mode, so they are recorded one by one.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in _ALIASING_COLLECTIVE_OPS:
            # The real kernels return their argument; the fake kernels return a new tensor
            # (``empty_like``), which would count every collective's output twice.
            return torch.ops.aten.alias.default(args[0])
        self._track(out, name)
        return out
