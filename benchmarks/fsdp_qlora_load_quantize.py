"""Answer.AI fsdp_qlora's ``load_and_quantize`` replayed on trainmem's allocator before the
row's own timeline: what the quantizing load leaves reserved, and how far it moves the run's
``max_memory_reserved``. A measurement for issue 24 item 6 (the load's cached blocks), not a
rule: the fsdp_qlora rows are predicted without it (analytic/load.py models the FSDP1 init
only, Note [FSDP1 sync_module_states init]).

What the load does (train.py 50efa1e, the commit the benchmarks' rows cite; bitsandbytes
0.43.0, the README's floor):

* every rank quantizes every weight on its own GPU (``load_and_quantize``: ``type(param)(
  value.to(device=device, dtype=dtype).data, **param.__dict__).cuda(device)``), then moves
  only the packed data to the CPU (rank 0, ``low_memory``) or the meta device (the others):
  ``type(param)(value.data.to("cpu"), **value.__dict__)``; the ``quant_state`` stays;
* the checkpoint tensor is converted on the CPU and copied (ATen Copy.cu ``copy_kernel_cuda``
  converts host-side for a blocking host-to-device copy): 2 n bytes of bf16 on the GPU;
* ``Params4bit._quantize`` -> ``functional.quantize_4bit(w, blocksize=64,
  compress_statistics=True, quant_type='nf4', quant_storage=bf16)`` allocates, in order: the
  fp32 absmax (4 n / 64 B, ``torch.zeros``), the packed output (``(n + 1) // 4`` bf16
  elements), the 16-entry NF4 code (``get_4bit_type``: built on the CPU, 64 B on the GPU),
  ``offset = absmax.mean()`` (4 B), the first call's 256-entry dynamic map (1 KiB,
  ``name2qmap['dynamic']``, kept for the process), then ``quantize_blockwise(absmax,
  blocksize=256)``: the fp32 absmax of the absmax (4 n / 64 / 256 B) and the uint8 absmax
  (n / 64 B, ``zeros_like``); ``del absmax`` frees the fp32 absmax; the bf16 weight is freed
  when ``_quantize`` returns (``self.data = w_4bit``), the packed output once it is copied
  off the GPU. Kept: the uint8 absmax, its fp32 absmax, the code, the offset;
* the names come in safetensors' order (``load_file`` walks ``safe_open(...).keys()``, which
  sorts them: safetensors v0.4.2 bindings/python/src/lib.rs ``keys``), so within a layer
  mlp.down / gate / up, self_attn.k / o / q / v; norms, embedding and head go straight to the
  CPU or meta device; the order of the layers does not change the pattern, a shard boundary
  inside a layer shifts it (``--shift``);
* ``parallel(load_and_quantize_parallel, ..., n_workers=n_workers, threadpool=True)``
  (fastcore): ``n_loading_workers`` = min(cpu_count / GPUs, int(8 x total_memory / 40e9 x
  70e9 / params)), 5 for a 70B model on a 24 GiB card, the CPU count unknown; all threads
  allocate on the default stream. Serial (one worker) is replayed as the source orders it;
  several workers are interleaved op by op, at random (``--seeds``) and round-robin, as
  the bounds;
* ``torch.cuda.empty_cache()`` after every shard is loaded: only segments holding a kept
  statistics block stay reserved. PEFT and the FSDP1 init come next (the row's timeline).

The row's timeline allocates each quantized weight's statistics as one block in its load
phase (Note [bitsandbytes statistics under sharding]); here that allocation takes the
emulated uint8 absmax (and, without parameter offload, allocates only the codes' shard), so
the statistics are not counted twice.

Usage::

    PYTHONPATH=src python benchmarks/fsdp_qlora_load_quantize.py GT129 --seeds 10

Output (session 24, helper gt129; lines shortened)::

    GT129 llama-2-70b: measured 16.02 GB, predicted 13.709 GB (-14.4%) without the quantizing load
      workers 1 (serial): the load leaves 0.127 .. 0.127 GB reserved beyond its kept blocks;
        the run moves +0.071 .. +0.071 GB (-14.0 .. -14.0%); statistics adopted [560] of 560
      workers 2 (...): 0.111 .. 0.220 GB; +0.021 .. +0.090 GB (-14.3 .. -13.9%)
      workers 3 (...): 0.099 .. 0.221 GB; +0.048 .. +0.132 GB (-14.1 .. -13.6%)
      workers 4 (...): 0.110 .. 0.812 GB; -0.239 .. +0.122 GB (-15.9 .. -13.7%)
      workers 5 (...): 0.218 .. 1.092 GB; -0.182 .. +0.136 GB (-15.6 .. -13.6%)

``--shift 1`` .. ``6`` (a shard boundary inside a layer), serial: +0.071 .. +0.130 GB. The
other double-quantized fsdp_qlora rows, serial: GT115 -9.3 -> -9.9 %, GT127 -1.7 -> -2.3 %,
GT128 -6.4 -> -6.7 %, the rest within 0.2 point (the 7B rows' statistics are all under 1 MiB,
small-pool blocks); five workers: GT128 down to -8.3 %.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainmem.allocator.replay as replay_module  # noqa: E402
from trainmem.allocator.caching import CachingAllocatorSim  # noqa: E402
from trainmem.analytic.params import linear_shapes  # noqa: E402
from trainmem.specs.hf import load_model_spec  # noqa: E402
from trainmem.specs.quantization import bnb_4bit_statistics_bytes  # noqa: E402

#: safetensors' sorted names of a Llama layer's linears (``model.layers.{i}.`` + these)
HF_NAMES = {
    "down": "mlp.down_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "k": "self_attn.k_proj",
    "o": "self_attn.o_proj",
    "q": "self_attn.q_proj",
    "v": "self_attn.v_proj",
}
QUANT_STORAGE_BYTES = 2  # train.py: Linear4bit(..., quant_storage=torch_dtype), bf16

Op = tuple[str, str, int]  # ("a" | "f", key, bytes)


def layer_weights(model_name: str) -> list[tuple[str, int]]:
    """Every quantized linear (key, numel) in safetensors' sorted order, layer by layer."""
    spec = load_model_spec(model_name)
    shapes = linear_shapes(spec)
    layer = sorted((HF_NAMES[k], fi * fo) for k, (fi, fo, _count) in shapes.items())
    order = sorted(range(spec.num_layers), key=lambda i: f"model.layers.{i}.")
    return [(f"{i}.{name}", n) for i in order for name, n in layer]


def quantize_ops(key: str, n: int, first: bool) -> list[Op]:
    """bitsandbytes 0.43.0 ``Params4bit._quantize`` of one bf16 weight, then train.py's move
    of its data off the GPU (the module docstring)."""
    blocks = -(-n // 64)
    ops: list[Op] = [
        ("a", f"{key}/bf16", 2 * n),
        ("a", f"{key}/absmax", 4 * blocks),
        ("a", f"{key}/packed", (n + 1) // (2 * QUANT_STORAGE_BYTES) * QUANT_STORAGE_BYTES),
        ("a", f"{key}/code", 64),
        ("a", f"{key}/offset", 4),
    ]
    if first:
        ops.append(("a", "dynamic-map", 1024))
    ops += [
        ("a", f"{key}/absmax2", 4 * -(-blocks // 256)),
        ("a", f"{key}/qabsmax", blocks),
        ("f", f"{key}/absmax", 0),
        ("f", f"{key}/bf16", 0),
        ("f", f"{key}/packed", 0),
    ]
    return ops


def interleave(streams: list[list[Op]], workers: int, seed: int | None) -> Iterator[Op]:
    """The ops of ``workers`` threads each taking the next weight when done; ``seed`` None is
    round-robin, else a seeded random pick of the thread that runs next."""
    rng = random.Random(seed)
    pending = list(reversed(streams))
    active: list[Iterator[Op]] = []
    turn = 0
    while pending or active:
        while len(active) < workers and pending:
            active.append(iter(pending.pop()))
        j = turn % len(active) if seed is None else rng.randrange(len(active))
        op = next(active[j], None)
        if op is None:
            active.pop(j)
            continue
        turn += 1
        yield op


@dataclass
class Load:
    """The load replayed on ``sim``: its peak, what ``empty_cache`` left, the kept blocks."""

    peak_reserved_bytes: int
    reserved_bytes: int
    kept_bytes: int
    kept: dict[str, int]  # key -> handle
    matched: Any = None  # the simulator, whose ``matched`` counts the adopted statistics


def run_load(
    sim: CachingAllocatorSim, weights: list[tuple[str, int]], workers: int, seed: int | None
) -> Load:
    streams = [quantize_ops(key, n, j == 0) for j, (key, n) in enumerate(weights)]
    live: dict[str, int] = {}
    for action, key, size in interleave(streams, workers, seed):
        if action == "a":
            live[key] = sim.malloc(size)
        else:
            sim.free(live.pop(key))
    peak = sim.max_memory_reserved
    sim.empty_cache()
    return Load(peak, sim.memory_reserved, sim.memory_allocated, live)


@contextmanager
def loaded_first(
    weights: list[tuple[str, int]], quantize: str, workers: int, seed: int | None, ranks: int
) -> Iterator[list[Load]]:
    """Every replay inside starts from the emulated load; the timeline's statistics block of
    each quantized weight takes that weight's emulated uint8 absmax (the rest of its
    allocation, the codes' shard without offload, is allocated as usual)."""
    loads: list[Load] = []
    stats = {n: bnb_4bit_statistics_bytes(n, quantize) for _key, n in weights}
    # beside the statistics without parameter offload: the codes' FULL_SHARD shard, or all
    # of them (NO_SHARD, fsdp_qlora's ddp: one block with the statistics)
    codes = [-(-n // 2) for _key, n in weights]
    codes_shards = frozenset([*(-(-c // ranks) for c in codes), *codes])

    class Sim(CachingAllocatorSim):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.load = run_load(self, weights, workers, seed)
            loads.append(self.load)
            self.queue: dict[int, list[int]] = {}
            for key, n in reversed(weights):
                self.queue.setdefault(stats[n], []).append(self.load.kept[f"{key}/qabsmax"])
            self.matched = 0
            self.load.matched = self

        def malloc(self, size_bytes: int, stream: int = 0, **kw: Any) -> int:
            if kw.get("category") == "parameters":
                for s, handles in self.queue.items():
                    if handles and (size_bytes == s or size_bytes - s in codes_shards):
                        self.matched += 1
                        handle = handles.pop()
                        rest = size_bytes - s
                        return super().malloc(rest, stream, **kw) if rest else handle
            return super().malloc(size_bytes, stream, **kw)

    # the replay builds its simulator by this module-level name (allocator/replay.py _replay)
    setattr(replay_module, "CachingAllocatorSim", Sim)  # noqa: B010
    try:
        yield loads
    finally:
        setattr(replay_module, "CachingAllocatorSim", CachingAllocatorSim)  # noqa: B010


def percent(predicted: float, measured: float) -> float:
    """The signed error of ``predicted`` against ``measured``, in percent."""
    return 100 * (predicted / measured - 1)


def main() -> None:
    from validate import _invoke_estimate, cli_args, load_dev2

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--shift", type=int, default=0, help="ops' start inside a layer")
    opts = parser.parse_args()
    rows = {r.id: r for r in load_dev2()}
    for rid in opts.rows:
        row = rows[rid]
        args = cli_args(row)
        quantize = args[len(args) - 1 - args[::-1].index("--quantize-base") + 1]
        weights = layer_weights(args[0])
        weights = weights[opts.shift :] + weights[: opts.shift]
        base, _ = _invoke_estimate(args)
        assert base is not None
        before = base["peak"]["reserved_bytes"]
        err = 100 * (before / row.measured - 1)
        print(
            f"{rid} {args[0]}: measured {row.measured / 1e9:.2f} GB, predicted "
            f"{before / 1e9:.3f} GB ({err:+.1f}%) without the quantizing load"
        )
        for workers in opts.workers:
            seeds: list[int | None] = [None] if workers == 1 else [None, *range(opts.seeds)]
            ranks = int(args[args.index("--data-parallel-size") + 1])
            left: list[float] = []
            moved: list[float] = []
            adopted: set[int] = set()
            for seed in seeds:
                with loaded_first(weights, quantize, workers, seed, ranks) as loads:
                    ans, error = _invoke_estimate(args)
                if ans is None:
                    print(f"  workers {workers} seed {seed}: {error}")
                    continue
                load = loads[0]
                left.append((load.reserved_bytes - load.kept_bytes) / 1e9)
                moved.append((ans["peak"]["reserved_bytes"] - before) / 1e9)
                adopted.add(load.matched.matched)

            low, high = (percent(before + 1e9 * x, row.measured) for x in (min(moved), max(moved)))
            how = "serial" if workers == 1 else f"round-robin and {opts.seeds} random interleavings"
            print(
                f"  workers {workers} ({how}): the load leaves {min(left):.3f} .. {max(left):.3f}"
                f" GB reserved beyond its kept blocks; the run moves {min(moved):+.3f} .. "
                f"{max(moved):+.3f} GB ({low:+.1f} .. {high:+.1f}"
                f"%); statistics adopted {sorted(adopted)} of {len(weights)}"
            )


if __name__ == "__main__":
    main()
