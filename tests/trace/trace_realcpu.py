"""Ground truth for tests/trace: run a training step for real on CPU and measure its peak live
tensor bytes with torch.profiler's allocator events -- no code shared with the recorder.

Peak = bytes of the storages that exist before the step (parameters, buffers, optimizer states,
micro-batches; deduplicated by data pointer) + the maximum of ``total_allocated`` over the
profiler's Allocation events during the step. On CPU ``total_allocated`` counts only what was
allocated while profiling (``c10/core/CPUAllocator.cpp``, ``ProfiledCPUMemoryReporter``).
"""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import (
    _autocast_factory,
    _emulation,
    _maybe_float8,
    apply_activation_checkpointing,
    default_forward_loss,
)
from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch
from trainmem.trace.optimizers import build_optimizer
from trainmem.trace.parallel import loss_context, parallelize, trace_mesh, uses_mesh
from trainmem.trace.recorder import plain_tensors
from trainmem.trace.step import run_step


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in (p for x in tensors for p in plain_tensors(x)):  # DTensor: its local shard
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def real_cpu_peak(preset: str, training: TrainingConfig) -> int:
    """Peak live tensor bytes of the second (steady-state) step, measured by the profiler; with
    FSDP2 / TP, rank 0 of a fake process group (collectives write nothing, buffers are real);
    tests/trace/trace_realcpu_dist.py runs the ranks for real over gloo."""
    if not uses_mesh(training):
        return real_cpu_rank_peak(preset, training, None)
    with trace_mesh(training) as mesh:
        return real_cpu_rank_peak(preset, training, mesh)


def real_cpu_rank_peak(preset: str, training: TrainingConfig, mesh, repeats: int = 1) -> int:
    """The peak of this process's rank of ``mesh`` (None: a single process); the smallest over
    ``repeats`` profiled steps, counting a block whose free the profiler missed until its
    address is reused (:func:`real_cpu_rank_bounds`)."""
    return real_cpu_rank_bounds(preset, training, mesh, repeats)[1]


def real_cpu_rank_bounds(
    preset: str, training: TrainingConfig, mesh, repeats: int = 1
) -> tuple[int, int]:
    """Bounds on the peak of this process's rank of ``mesh`` (None: a single process), from
    ``repeats`` profiled steps: ``(p, p)`` from the smallest peak of the steps whose every free
    was recorded; if none was, the smallest lower and upper bounds of :func:`_main_thread_peaks`
    (tests/trace/test_real_cpu_parallel.py says when a free goes unrecorded)."""
    torch.manual_seed(0)
    model = build_hf_training_model(load_hf_config(preset), training, device="cpu")
    _maybe_float8(model, training)
    apply_activation_checkpointing(model, training.activation_checkpointing)
    if mesh is not None:
        parallelize(model, mesh, training, None)
    k = min(training.gradient_accumulation_steps, 2)
    batches = [make_hf_batch(model, training.micro_batch_size, training.seq_len) for _ in range(k)]
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    opt = build_optimizer(params, training)
    kwargs = dict(
        autocast=_autocast_factory(training),
        accumulation_divisor=training.gradient_accumulation_steps,
        set_to_none=training.zero_grad_set_to_none,
        forward_loss=default_forward_loss(training),
    )
    with _emulation(training, emulate_cuda=False), loss_context(training):
        run_step(model, batches, opt, **kwargs)  # warm-up: creates the optimizer states
        before = [*model.parameters(), *model.buffers()]
        before += [p.grad for p in model.parameters() if p.grad is not None]  # set_to_none=False
        before += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        before += [t for b in batches for t in b.values()]
        pre_bytes = _storage_bytes(before)
        bounds = []
        for _ in range(repeats):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                run_step(model, batches, opt, **kwargs)
            lower, upper = _main_thread_peaks(prof)
            bounds.append((pre_bytes + lower, pre_bytes + upper))
    exact = [upper for lower, upper in bounds if lower == upper]
    if exact:
        return min(exact), min(exact)
    return min(b[0] for b in bounds), min(b[1] for b in bounds)


def _main_thread_peak(prof) -> int:
    """Peak of the bytes allocated during profiling, leaving out blocks another thread
    allocated (gloo's worker threads allocate and free their own staging buffers inside a
    collective, concurrently with the step; NCCL has none). With one thread this is the
    maximum of the allocator's ``total_allocated``."""
    return _main_thread_peaks(prof)[1]


def _main_thread_peaks(prof) -> tuple[int, int]:
    """Lower and upper bounds on the peak of the bytes the main thread allocated during
    profiling (:func:`_main_thread_peak`), equal when every free of those blocks was recorded.

    A block freed on a thread the profiler does not record (gloo's worker dropping a collective's
    work, the last reference to its output: tests/trace/test_real_cpu_parallel.py) has no free
    event. It was freed at the latest when its address is allocated again (the allocator does
    not hand out a live block), or else at some time before the step's end: the upper bound
    counts it live until then, the lower bound not at all. A free of a block allocated before
    profiling lowers both."""
    allocs = [
        n
        for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if n.tag == _EventType.Allocation
    ]
    allocs.sort(key=lambda n: n.start_time_ns)
    if not allocs:
        return 0, 0
    tids: dict[int, int] = {}
    for n in allocs:
        tids[n.start_tid] = tids.get(n.start_tid, 0) + 1
    main = max(tids, key=lambda t: tids[t])
    unrecorded: set[int] = set()  # indices of the main thread's blocks with no free event
    open_block: dict[int, int] = {}  # ptr -> index of the allocation not yet freed
    for i, n in enumerate(allocs):
        size, ptr = n.extra_fields.alloc_size, n.extra_fields.ptr
        if size > 0:
            if ptr in open_block:  # allocated again: the earlier block's free went unrecorded
                unrecorded.add(open_block[ptr])
            open_block[ptr] = i
        else:
            open_block.pop(ptr, None)
    unrecorded |= {i for i in open_block.values() if allocs[i].start_tid == main}
    live: dict[int, tuple[int, bool]] = {}  # ptr -> (bytes, free recorded) of main's blocks
    upper = lower = peak_upper = peak_lower = 0
    for i, n in enumerate(allocs):
        size, ptr = n.extra_fields.alloc_size, n.extra_fields.ptr
        if size > 0 and ptr in live:  # the unrecorded free, at the latest
            upper -= live.pop(ptr)[0]
        if size > 0 and n.start_tid == main:
            recorded = i not in unrecorded
            live[ptr] = (size, recorded)
            upper += size
            lower += size if recorded else 0
        elif size < 0 and ptr in live:
            freed, recorded = live.pop(ptr)
            upper -= freed
            lower -= freed if recorded else 0
        elif size < 0 and n.start_tid == main:  # a block allocated before profiling
            upper += size
            lower += size
        peak_upper, peak_lower = max(peak_upper, upper), max(peak_lower, lower)
    return peak_lower, peak_upper
