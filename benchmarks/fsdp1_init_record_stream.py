"""FSDP1's ``sync_module_states`` init of torchtune's April 2024 distributed recipes, replayed per
rank through trainmem's caching-allocator simulator, with the broadcast buckets held by NCCL's
``record_stream``, over the range of host timings the code allows. A finding for GT029 / GT032
(``benchmarks/dev2_causes.py``), not a rule of the estimate: where in the range a run lands is
the ratio of two hosts' speeds, which no source gives.

What runs (torch 2.2.2, the README's "latest stable" at torchtune fef3ed1, 2024-04-16):

* recipes/lora_finetune_distributed.py and full_finetune_distributed.py @fef3ed1
  ``_setup_model``: rank 0 builds the model on the CPU (cast to bf16), the other ranks on the
  meta device; ``FSDP(..., sync_module_states=True, param_init_fn=lambda m:
  m.to_empty(device="cuda", recurse=False) if not rank 0)``, each LoRA leaf (lora
  ``lora_fsdp_wrap_policy``) and each ``TransformerDecoderLayer`` a unit, the root last; then
  ``torch.distributed.barrier()``; ``train()`` starts with ``cleanup_before_training``
  (``empty_cache``, ``reset_peak_memory_stats``). The LoRA recipe sets
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` only from bec7babe (2024-04-23, PR #843: "non-zero ranks
  have 78G memory during model init ... reduced the memory from 78G to 23G"); the full recipe
  not at all through 0217d44c.
* per unit (torch distributed/fsdp/_init_utils.py ``_init_param_handle_from_module``): its
  tensors on the GPU (rank 0: ``_move_module_to_device``, a blocking copy from pageable host
  memory, ``memcpy_and_sync``, so rank 0's host waits for its stream at every unit; other
  ranks: ``to_empty``, no copy, no wait), ``_sync_module_params_and_buffers`` (buffers first,
  then the parameters) -> ``dist._broadcast_coalesced`` in 250 MiB buckets, two in flight
  (c10d comm.cpp ``broadcast_coalesced``): each bucket ``flatten_dense_tensors``, a new
  ``cat`` or, for a bucket of one tensor, a view of the tensor itself; ProcessGroupNCCL records
  it on its stream (``recordStream`` unless TORCH_NCCL_AVOID_RECORD_STREAMS), so its block is
  reusable only once the caching allocator sees that stream's event complete; then the flat
  parameter (``torch.cat``), this rank's shard (``_get_shard``: ``clone``), the flat storage
  freed, the moved tensors freed on return.

When a recorded block is reusable: the caching allocator's ``process_events``, at the start of
every ``malloc``, queries the event recorded on the NCCL stream at the block's free and returns
the block once the GPU has passed it (c10/cuda/CUDACachingAllocator.cpp; ../shared/specs
cuda-caching-allocator.md 2.8); no host synchronisation is involved. On rank 0 that is by its
next unit (its blocking copy waits for its stream). On another rank the host never waits in the
init: ``_broadcast_coalesced``'s ``BroadcastWork::finish`` calls ``work->wait()``, which in
ProcessGroupNCCL makes the current stream wait for the NCCL stream (``synchronizeStreams``) and
blocks the host only under TORCH_NCCL_BLOCKING_WAIT=1; nothing else in the init
synchronises before the recipe's barrier. But its broadcast of a unit completes only once rank
0 has issued the same broadcast, after rank 0's host has copied that unit from host memory. So
a rank's pile-up is what its host has enqueued less what rank 0's host has issued: the code
puts this rank's host ahead (per unit it allocates with ``to_empty`` where rank 0 copies), and
how far ahead is the ratio of the two hosts' speeds (the copy's bandwidth against Python's
per-unit work), which no source gives. ``RankInit``'s ``pace`` spans it: p = 1 is rank 0
keeping pace, p = 0 rank 0 issuing nothing before this rank's host is done (the upper bound),
the GPU keeping up the lower. The device's capacity is trainmem's (the GPU less the CUDA
context). Output (Llama-2-7B; GB):

* GT029, LoRA r = 8 on q, v, 2 x RTX 4090 (measured 20.95): rank 0 8.53 .. 8.73, rank 1 8.53
  (GPU keeps up), at rank 0's pace 1 / 0.5 / 0.25 / 0.1 / 0: 8.73 / 15.25 / 18.50 / 20.39 /
  21.62;
* GT032, full, 4 x RTX 4090 (measured 22.9): rank 0 5.20 .. 5.24, rank 1 5.20, 5.24 / 11.75 /
  15.01 / 16.90 / 18.12;
* GT043 (Llama-2-70B, full, 8 x A100 80GB, the May table, measured 70.4): rank 0 21.97 ..
  22.62, rank 1 21.97, 22.62 / 83.88 / 84.46 / 84.46 / 83.61 (the allocator's capacity is
  84.46: from pace 0.5 the out-of-memory path's synchronisation caps it).

None of these is in the figure the recipe logs: ``train()`` calls ``cleanup_before_training``
(torchtune/utils/memory.py @fef3ed1: ``empty_cache``, ``reset_peak_memory_stats``) on every
rank before the first step, and only rank 0 logs (``memory_stats_log`` every 100 steps).

Run: ``python benchmarks/fsdp1_init_record_stream.py`` (a second; no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.allocator.caching import CachingAllocatorSim
from trainmem.allocator.device import allocator_capacity_bytes
from trainmem.analytic.load import FSDP1_BROADCASTS_IN_FLIGHT, broadcast_buckets
from trainmem.errors import OutOfMemoryError
from trainmem.specs.hardware import get_gpu

BF16 = 2
BUFFERS = ("theta", "cache")
"""RotaryPositionalEmbeddings' buffers (torchtune modules/position_embeddings.py @fef3ed1), one
pair per layer, bf16 after the recipe's ``model.to(torch.bfloat16)``."""


@dataclass
class RankInit:
    """One rank's FSDP1 init on a simulated allocator of ``capacity`` bytes (None: unlimited).

    ``pace`` says when a block NCCL recorded becomes reusable (CUDACachingAllocator.cpp
    ``process_events``, at every ``malloc``: once the event recorded on the NCCL stream at its
    free has completed on the GPU; no host synchronisation is needed). None: at once (the GPU
    kept up). A number p: on rank 0, at its next unit (its blocking copy waits for its stream);
    on another rank, once rank 0 has broadcast the unit, which is when rank 0's host has issued
    it, and rank 0's host is taken to have issued the first p x (the bytes this host has
    enqueued so far) of the init: p = 0, rank 0 issues nothing before this host is done (the
    upper bound); p = 1, rank 0 keeps pace. The allocator's out-of-memory path completes every
    recorded block (``release_cached_blocks`` synchronises the device)."""

    rank: int
    world: int
    pace: float | None
    capacity: int | None = None
    sim: CachingAllocatorSim = field(init=False)
    recorded: list[tuple[int, int]] = field(default_factory=list)
    """(the end of its unit in bytes enqueued, handle) of each recorded block not yet reusable."""
    enqueued: int = 0

    def __post_init__(self) -> None:
        self.sim = CachingAllocatorSim(self.capacity)

    def malloc(self, size: int) -> int:
        """``malloc``; when the device is full the allocator synchronises (its
        ``release_cached_blocks`` completes every recorded block first) and retries."""
        try:
            return self.sim.malloc(size)
        except OutOfMemoryError:
            self.complete(None)
            return self.sim.malloc(size)

    def complete(self, upto: float | None) -> None:
        """The recorded blocks of the units ending at ``upto`` bytes or before (None: all)
        become reusable."""
        done = [h for end, h in self.recorded if upto is None or end <= upto]
        self.recorded = [(e, h) for e, h in self.recorded if upto is not None and e > upto]
        for handle in done:
            self.sim.free(handle)

    def release(self, handle: int) -> None:
        """Free a block NCCL recorded (at once when the GPU keeps up)."""
        if self.pace is None:
            self.sim.free(handle)
        else:
            self.recorded.append((self.enqueued, handle))

    def unit(self, sizes: dict[str, int], made: list[str], synced: list[str]) -> None:
        """One unit: ``made`` the order its tensors reach the GPU, ``synced`` the broadcast
        order (buffers, then parameters); every name but the buffers is a flat-parameter
        member, in ``synced`` order."""
        if self.pace is not None:  # rank 0: the unit's first copy (memcpy_and_sync) waits
            self.complete(None if self.rank == 0 else self.pace * self.enqueued)
        self.enqueued += sum(sizes[n] for n in synced)
        handles = {name: self.malloc(sizes[name]) for name in made}
        buckets = broadcast_buckets([sizes[n] for n in synced])
        in_flight: list[int | None] = []
        for bucket in buckets:
            if len(in_flight) >= FSDP1_BROADCASTS_IN_FLIGHT:
                self._finish(in_flight.pop(0))
            if len(bucket) == 1:  # a view of the tensor: the tensor's own block is recorded
                in_flight.append(None)
                continue
            in_flight.append(self.malloc(sum(sizes[synced[k]] for k in bucket)))
        for flat_bucket in in_flight:
            self._finish(flat_bucket)
        members = [n for n in synced if n not in BUFFERS]
        full = sum(sizes[n] for n in members)
        flat = self.malloc(full)
        self.malloc(-(-full // self.world))  # this rank's shard, kept
        self.sim.free(flat)
        single = {synced[b[0]] for b in buckets if len(b) == 1}
        for name in members:
            if name in single:
                self.release(handles[name])
            else:
                self.sim.free(handles[name])

    def _finish(self, flat_bucket: int | None) -> None:
        if flat_bucket is not None:
            self.release(flat_bucket)


@dataclass(frozen=True)
class Llama:
    """torchtune's llama2 builders: width, MLP width, key/value width, vocabulary, layers."""

    h: int
    i: int
    kv: int
    vocab: int
    layers: int


def init_peak(
    model: Llama, rank: int, world: int, lora: bool, pace: float | None, capacity: int | None
) -> int:
    """Peak reserved bytes of one rank's init, bf16, LoRA r = 8 on q and v when ``lora``
    (lora_llama2_7b's default targets); ``pace`` as :class:`RankInit`'s."""
    m, r = model, 8
    run = RankInit(rank, world, pace, capacity)
    sizes = {"sa_norm": m.h, "mlp_norm": m.h, "theta": 64, "cache": 4096 * 64 * 2}
    sizes |= {"q": m.h * m.h, "o": m.h * m.h, "k": m.h * m.kv, "v": m.h * m.kv}
    sizes |= {n: m.h * m.i for n in ("w1", "w2", "w3")}
    sizes = {n: BF16 * s for n, s in sizes.items()}
    params = ["sa_norm", "q", "k", "v", "o", "mlp_norm", "w1", "w2", "w3"]
    if rank == 0:  # _move_module_to_device: the unit's parameters (BFS), then its buffers
        made = ["sa_norm", "mlp_norm", "q", "k", "v", "o", "w1", "w2", "w3", *BUFFERS]
    else:  # _get_modules_to_materialize (BFS), to_empty(recurse=False) each
        made = ["sa_norm", "mlp_norm", "q", "k", "v", "o", *BUFFERS, "w1", "w2", "w3"]
    for _ in range(m.layers):
        for _ in range(2 if lora else 0):  # q's then v's lora_a, lora_b units
            for leaf in (BF16 * m.h * r, BF16 * r * m.kv):
                run.unit({"w": leaf}, ["w"], ["w"])
        run.unit(sizes, made, [*BUFFERS, *params])
    root = {"tok_embeddings": BF16 * m.vocab * m.h, "norm": BF16 * m.h}
    root["output"] = BF16 * m.vocab * m.h
    run.unit(root, list(root), list(root))
    return run.sim.max_memory_reserved


LLAMA2_7B = Llama(4096, 11008, 4096, 32000, 32)
LLAMA2_70B = Llama(8192, 28672, 1024, 32000, 80)
ROWS = (
    ("GT029", "Llama-2-7B LoRA, 2 x RTX 4090", LLAMA2_7B, 2, True, "RTX 4090", 20.95e9),
    ("GT032", "Llama-2-7B full, 4 x RTX 4090", LLAMA2_7B, 4, False, "RTX 4090", 22.9e9),
    ("GT043", "Llama-2-70B full, 8 x A100 80GB", LLAMA2_70B, 8, False, "A100 80GB", 70.4e9),
)


PACES = (1.0, 0.5, 0.25, 0.1, 0.0)
"""Rank 0's pace against another rank's host (:class:`RankInit`): shown, not chosen."""


def main() -> None:
    for row, what, model, world, lora, gpu, measured in ROWS:
        capacity = allocator_capacity_bytes(get_gpu(gpu))
        print(f"{row} {what}, measured {measured / 1e9:.2f} GB:")
        none, most = (init_peak(model, 0, world, lora, p, capacity) / 1e9 for p in (None, 0.0))
        print(
            f"  rank 0 init peak reserved, GPU keeps up .. waits for the next unit: "
            f"{none:.2f} .. {most:.2f} GB"
        )
        paced = [init_peak(model, 1, world, lora, p, capacity) / 1e9 for p in (None, *PACES)]
        print(
            f"  rank 1 init peak reserved, GPU keeps up: {paced[0]:.2f} GB; rank 0's pace "
            + ", ".join(f"{p:g}: {v:.2f}" for p, v in zip(PACES, paced[1:], strict=True))
            + " GB"
        )


if __name__ == "__main__":
    main()
