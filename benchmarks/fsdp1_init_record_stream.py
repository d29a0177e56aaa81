"""FSDP1's ``sync_module_states`` init of torchtune's April 2024 distributed recipes, replayed per
rank through trainmem's caching-allocator simulator, with the broadcast buckets held by NCCL's
``record_stream``: the two bounds the code allows. A finding for GT029 / GT032
(``benchmarks/dev2_causes.py``), not a rule of the estimate: where between the bounds a run lands
is host timing.

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

The bounds: a recorded block is reusable at the next allocation (the GPU kept up: ``lag
none``), or only at the next host synchronisation (``lag most``): on rank 0 the next unit's
first copy; on the other ranks nothing in FSDP1's init waits for the GPU until the recipe's
barrier or the allocator's out-of-memory path (their broadcasts wait for rank 0's, which copies
every weight from the host first). The device's capacity is trainmem's (the GPU less the CUDA
context). Output (Llama-2-7B; GB):

* GT029, LoRA r = 8 on q, v, 2 x RTX 4090 (measured 20.95): rank 0 8.53 .. 8.73, rank 1
  8.53 .. 21.62;
* GT032, full, 4 x RTX 4090 (measured 22.9): rank 0 5.20 .. 5.24, rank 1 5.20 .. 18.12;
* GT043 (Llama-2-70B, full, 8 x A100 80GB, the May table, measured 70.4): rank 0 21.97 ..
  22.62, rank 1 21.97 .. 83.61 (the card's capacity).

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
    ``most_lag``: recorded blocks wait for the next host synchronisation (rank 0: its next
    unit; other ranks: the allocator's out-of-memory path, which synchronises, or the end)."""

    rank: int
    world: int
    most_lag: bool
    capacity: int | None = None
    sim: CachingAllocatorSim = field(init=False)
    recorded: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sim = CachingAllocatorSim(self.capacity)

    def malloc(self, size: int) -> int:
        """``malloc``; when the device is full the allocator synchronises (its
        ``release_cached_blocks`` completes every recorded block first) and retries."""
        try:
            return self.sim.malloc(size)
        except OutOfMemoryError:
            self.sync()
            return self.sim.malloc(size)

    def sync(self) -> None:
        """The host waits for the GPU: every recorded block becomes reusable."""
        for handle in self.recorded:
            self.sim.free(handle)
        self.recorded = []

    def release(self, handle: int) -> None:
        """Free a block NCCL recorded (at once when the GPU keeps up)."""
        if self.most_lag:
            self.recorded.append(handle)
        else:
            self.sim.free(handle)

    def unit(self, sizes: dict[str, int], made: list[str], synced: list[str]) -> None:
        """One unit: ``made`` the order its tensors reach the GPU, ``synced`` the broadcast
        order (buffers, then parameters); every name but the buffers is a flat-parameter
        member, in ``synced`` order."""
        if self.rank == 0:
            self.sync()  # the unit's first host-to-device copy (memcpy_and_sync)
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
    model: Llama, rank: int, world: int, lora: bool, most_lag: bool, capacity: int | None
) -> int:
    """Peak reserved bytes of one rank's init, bf16, LoRA r = 8 on q and v when ``lora``
    (lora_llama2_7b's default targets)."""
    m, r = model, 8
    run = RankInit(rank, world, most_lag, capacity)
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


def main() -> None:
    for row, what, model, world, lora, gpu, measured in ROWS:
        capacity = allocator_capacity_bytes(get_gpu(gpu))
        print(f"{row} {what}, measured {measured / 1e9:.2f} GB:")
        for rank in (0, 1):
            none, most = (
                init_peak(model, rank, world, lora, lag, capacity) / 1e9 for lag in (False, True)
            )
            print(
                f"  rank {rank} init peak reserved, lag none .. most: {none:.2f} .. {most:.2f} GB"
            )


if __name__ == "__main__":
    main()
