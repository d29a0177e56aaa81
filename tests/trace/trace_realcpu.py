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
    apply_activation_checkpointing,
    default_forward_loss,
)
from trainmem.trace.fsdp import fake_process_group, shard_model, uses_fsdp
from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch
from trainmem.trace.optimizers import build_optimizer
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
    FSDP2, rank 0 of a fake process group (collectives write nothing, buffers are real)."""
    if not uses_fsdp(training):
        return _real_cpu_peak(preset, training, None)
    with fake_process_group(training.data_parallel_size) as mesh:
        return _real_cpu_peak(preset, training, mesh)


def _real_cpu_peak(preset: str, training: TrainingConfig, mesh) -> int:
    torch.manual_seed(0)
    model = build_hf_training_model(load_hf_config(preset), training, device="cpu")
    apply_activation_checkpointing(model, training.activation_checkpointing)
    if mesh is not None:
        shard_model(model, mesh, training, None)
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
    with _emulation(training, emulate_cuda=False):
        run_step(model, batches, opt, **kwargs)  # warm-up: creates the optimizer states
        before = [*model.parameters(), *model.buffers()]
        before += [p.grad for p in model.parameters() if p.grad is not None]  # set_to_none=False
        before += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        before += [t for b in batches for t in b.values()]
        pre_bytes = _storage_bytes(before)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run_step(model, batches, opt, **kwargs)
    allocs = [
        n
        for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if n.tag == _EventType.Allocation
    ]
    step_peak = max((n.extra_fields.total_allocated for n in allocs), default=0)
    return pre_bytes + max(step_peak, 0)
