"""Ground truth for a parallel step: every rank a real process, real tensors, real collectives
over gloo (``torch.multiprocessing``, CPU). Each rank measures its own peak live tensor bytes
with torch.profiler exactly as tests/trace/trace_realcpu.py does; nothing is shared with the
recorder. Several configurations run in one spawn (the process start and imports dominate)."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from trainmem.specs.training import TrainingConfig
from trainmem.trace.parallel import device_mesh, mesh_dims, mesh_size

REPEATS = 2
"""Profiled steps per rank; the smallest peak is kept. gloo completes a collective on its own
worker thread, which releases the work (and the buffers it references) when it is done, which
can be after the main thread has allocated again: a late free can only raise a step's peak.
(Not seen once gloo's own staging buffers are left out, tests/trace/trace_realcpu.py
``_main_thread_peak``; kept as a guard.)"""


def _rank_main(rank: int, world: int, init_file: str, cases: list, out) -> None:
    from trace_realcpu import real_cpu_rank_peak

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for i, (preset, cfg) in enumerate(cases):
            training = TrainingConfig(**cfg)
            mesh = device_mesh(mesh_dims(training))
            peak = real_cpu_rank_peak(preset, training, mesh, repeats=REPEATS)
            out.put((i, rank, peak))
    finally:
        dist.destroy_process_group()


def real_cpu_rank_peaks(cases: list[tuple[str, TrainingConfig]]) -> list[dict[int, int]]:
    """Per case, ``{rank: peak live tensor bytes}`` of the steady-state step, every rank a gloo
    process. All cases must have the same world size."""
    worlds = {mesh_size(t) for _, t in cases}
    if len(worlds) != 1:
        raise ValueError(f"cases of different world sizes: {sorted(worlds)}")
    world = worlds.pop()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, path) if p)
    plain = [(p, {f: getattr(t, f) for f in t.__dataclass_fields__}) for p, t in cases]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _rank_main,
                args=(world, os.path.join(tmp, "store"), plain, out),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
    finally:
        os.environ["PYTHONPATH"] = path
    peaks: list[dict[int, int]] = [{} for _ in cases]
    for _ in range(world * len(cases)):
        i, rank, peak = out.get()
        peaks[i][rank] = peak
    return peaks
