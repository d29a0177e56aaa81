"""Run a warm-up step, then record the steady-state step: the orchestration of the trace engine.

Note [Steady state]
    The first step of Adam has no moments during forward and backward, so its peak is two
    parameter copies too low (shared/notes/tracing-without-a-gpu.md, sec. 4). We run one full
    step unrecorded, then record the second: optimizer states, parameters, buffers and the
    micro-batches are registered as live ``init`` blocks, and every alloc/free of the step
    follows.

Note [Categories]
    Registered storages keep their category (parameters, buffers, optimizer states, inputs). A
    storage a step allocates is:
    - a gradient once ``AccumulateGrad`` stores it in ``param.grad`` (post-accumulate-grad hook),
      or once it is ``param.grad`` when the optimizer step begins (FSDP1's sharded gradients);
    - an optimizer state if it is in ``optimizer.state`` after the step (first-step creation);
    - in a forward region (the forward pass, or a checkpoint recomputation in backward, seen by
      the global module forward hooks): an activation if it is still live when the region ends
      (saved for backward, kept by checkpointing or by the loss), otherwise a temporary; a
      recomputation's blocks are judged at the next allocation after it ends (Note [A
      recompute's unwound tensors]);
    - an FSDP2 unsharded parameter (storage re-allocated by ``resize_``): a temporary;
    - anything else (backward transients, optimizer temporaries): a temporary.

Note [A recompute's unwound tensors]
    torch's non-reentrant checkpoint stops a recomputation early: once the last tensor the
    layer saves is packed again, ``_recomputation_hook``'s pack hook raises
    ``_StopRecomputationError``, which the unpack hook that started the recomputation catches
    (torch 2.13 utils/checkpoint.py ``_checkpoint_hook``: ``except _StopRecomputationError:
    pass``). The recomputed forward's frames unwind on the way: the module post-hooks
    (``always_call=True``) bring the module depth back to 0 and end the region while the
    exception's traceback still holds those frames' locals (the MLP's input, ``act(gate) * up``
    going into a frozen down projection, DoRA's ``lora_weight``, its base output before DoRA
    saves it), and they are freed when the exception is caught, before the backward node that
    asked for the recompute makes anything. They were saved by nothing, so they are
    temporaries, as the formulas count them (Note [The recompute's tensors held at an
    autocast down projection] in analytic/forward_transients.py); judged at the region's end
    they were activations. So a recomputation's blocks are judged at the next allocation after
    the region ends: freed by then, temporaries. On the 1024-wide agreement Llama (2 x 256
    tokens, LoRA or DoRA r 16 on q / v, full or op-level selective checkpointing) the
    generic path had 2,883,584 B (c t i, down's input) more activations and as much less
    temporaries than the formulas at the step's peak, the total equal; now each category within
    2.1 KB. A region the forward ends (``forward_end``) is judged at its end, as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.trace._torch import require_torch
from trainmem.trace.module_paths import clean_module_path
from trainmem.trace.recorder import RESIZE_OP, Block, StorageRecorder, plain_tensors
from trainmem.trace.step import run_step

torch = require_torch()

__all__ = ["Capture", "capture_step"]


@dataclass
class Capture:
    """What one recorded steady-state step produced.

    Attributes:
        recorder: holds the blocks and ordered events (init blocks first).
        num_parameters: unique parameter elements.
        num_trainable_parameters: elements of parameters with ``requires_grad``.
        trace_seconds: wall time of the recorded step.
        warmup_seconds: wall time of the unrecorded warm-up step.
        host_state_bytes: optimizer-state bytes that live in host memory on CUDA (Adam's
            ``step`` scalars for the for-loop/foreach implementations), left out.
        root: the module the step called (FSDP1's root wrapper under ``accelerate-fsdp``).
    """

    recorder: StorageRecorder
    num_parameters: int
    num_trainable_parameters: int
    trace_seconds: float
    warmup_seconds: float
    host_state_bytes: int = 0
    root: Any = None


def _unique_params(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _gradients_at_step(
    optimizer: Any, params: Sequence[Any], on_grad: Callable[[Any], None]
) -> list[Any]:
    """A step pre-hook calling ``on_grad`` for every parameter with a ``.grad`` (its handle in
    a list; none for an optimizer without hooks): FSDP1 gives a flat parameter its sharded
    gradient after ``AccumulateGrad`` (the reduce-scatter output, set as ``.grad`` by
    ``_post_backward_hook`` / ``_finalize_params``), a gradient whatever made it (Note
    [Tracing FSDP1] in trainmem/trace/fsdp.py)."""
    if not hasattr(optimizer, "register_step_pre_hook"):
        return []

    def before_step(*_: Any) -> None:
        for p in params:
            if p.grad is not None:
                on_grad(p)

    return [optimizer.register_step_pre_hook(before_step)]


def _host_resident(name: str, value: Any, fused: bool) -> bool:
    """Adam/AdamW/SGD keep ``state["step"]`` as a CPU scalar unless fused or capturable
    (``torch/optim/adam.py``, ``_init_group``)."""
    return name == "step" and not fused and value.numel() == 1


def _register_all(rec: StorageRecorder, tensors: Iterable[tuple[Any, MemoryCategory, str]]) -> None:
    for tensor, category, module in tensors:
        rec.register(tensor, category, module=module)


def capture_step(
    model: Any,
    batches: Sequence[Any],
    optimizer: Any,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    accumulation_divisor: int = 1,
    fake_mode: Any = None,
    host_optimizer_step: bool = True,
    fused: bool = False,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    set_to_none: bool = True,
    forward_loss: Any = None,
    step: Callable[[Callable[[str], None] | None], None] | None = None,
    runtime_state: Callable[[], Iterable[tuple[Any, MemoryCategory, str]]] | None = None,
    keep_output: bool = False,
    hold_output: bool = False,
    zero_grad_before_backward: bool = False,
) -> Capture:
    """Warm up, then record one optimizer step over ``batches``.

    Args:
        model: ``nn.Module`` whose tensors are fake (or real, for the CPU proof).
        batches: the micro-batches of the recorded step (reused for the warm-up).
        optimizer: ``torch.optim.Optimizer`` over the model's trainable parameters.
        loss_fn: see :func:`trainmem.trace.step.compute_loss`.
        autocast: factory of the autocast context, or None.
        accumulation_divisor: loss divisor (gradient accumulation steps).
        fake_mode: the ``FakeTensorMode`` to run in, or None for real tensors.
        host_optimizer_step: treat Adam's scalar ``step`` states as host memory (CUDA); False
            counts them (a real CPU run).
        fused: the optimizer is fused (its ``step`` lives on the device).
        context: extra context (SDPA routing, autocast policy, mask patches) around both steps.
        set_to_none: ``zero_grad(set_to_none=...)``; False keeps the warm-up's gradients, which
            are registered as live gradients before the recorded step.
        forward_loss, keep_output, zero_grad_before_backward, hold_output: see
            :func:`trainmem.trace.step.run_step`.
        step: ``step(on_phase)`` runs one whole optimizer step instead of
            :func:`~trainmem.trace.step.run_step` (a pipeline schedule,
            ``trainmem.trace.pipeline``); the other step arguments are then unused.
        runtime_state: ``(tensor, category, module)`` of what a training runtime keeps from one
            step to the next besides the model and optimizer (pipelining's receive buffers and
            output chunks), registered as live after the warm-up.

    Returns:
        The :class:`Capture`.
    """
    ctx = context or contextlib.nullcontext
    outer = fake_mode if fake_mode is not None else contextlib.nullcontext()

    def one_step(on_phase: Callable[[str], None] | None) -> None:
        if step is not None:
            step(on_phase)
            return
        run_step(
            model,
            batches,
            optimizer,
            loss_fn=loss_fn,
            autocast=autocast,
            accumulation_divisor=accumulation_divisor,
            on_phase=on_phase,
            set_to_none=set_to_none,
            forward_loss=forward_loss,
            keep_output=keep_output,
            hold_output=hold_output,
            zero_grad_before_backward=zero_grad_before_backward,
        )

    with outer, ctx():
        t0 = time.perf_counter()
        one_step(None)
        warmup = time.perf_counter() - t0

        rec = StorageRecorder()
        rec.set_root(model)
        names = {
            id(p): clean_module_path(n) for n, p in model.named_parameters(remove_duplicate=True)
        }
        params = _unique_params(model)
        for p in params:
            rec.register(p, MemoryCategory.PARAMETER, module=names.get(id(p), ""))
        for n, b in model.named_buffers():
            rec.register(b, MemoryCategory.BUFFER, module=clean_module_path(n))
        for p in params:
            if p.grad is not None:  # zero_grad(set_to_none=False): kept, zeroed
                rec.register(p.grad, MemoryCategory.GRADIENT, module=names.get(id(p), ""))
        host_bytes = 0
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    if host_optimizer_step and _host_resident(key, value, fused):
                        host_bytes += sum(
                            t.untyped_storage().nbytes() for t in plain_tensors(value)
                        )
                        continue
                    rec.register(value, MemoryCategory.OPTIMIZER_STATE, module=names.get(id(p), ""))
        for batch in batches:
            flat, _ = torch.utils._pytree.tree_flatten(batch)
            for t in flat:
                if isinstance(t, torch.Tensor):
                    rec.register(t, MemoryCategory.INPUT)
        if runtime_state is not None:
            _register_all(rec, runtime_state())  # (a loop here would keep its last tensor)

        region_blocks: list[Block] = []
        unwound: list[Block] = []  # a recompute's blocks, settled at the next allocation
        state = {"in_region": False, "phase": "init"}

        def settle(blocks: list[Block]) -> None:
            for b in blocks:
                if b.category is None:
                    # FSDP2's unsharded parameters (re-allocated by storage resize) are gathered
                    # copies, not saved activations, even when kept through the forward (root).
                    transient = b.freed or b.op == RESIZE_OP
                    b.category = (
                        MemoryCategory.TEMPORARY if transient else MemoryCategory.ACTIVATION
                    )
            blocks.clear()

        def close_region(recompute: bool = False) -> None:
            if recompute:  # Note [A recompute's unwound tensors]
                unwound.extend(region_blocks)
                region_blocks.clear()
            else:
                settle(region_blocks)
            state["in_region"] = False

        def on_alloc(block: Block) -> None:
            if unwound:
                settle(unwound)
            if state["in_region"]:
                region_blocks.append(block)

        def on_depth(depth: int) -> None:
            if state["phase"] != "backward":
                return
            if depth > 0 and not state["in_region"]:
                state["in_region"] = True  # checkpoint recomputation starts
                rec.forward_region += 1
            elif depth == 0 and state["in_region"]:
                close_region(recompute=True)

        def on_phase(phase: str) -> None:
            if phase == "forward":
                rec.forward_region += 1
                state["in_region"] = True
            elif phase == "forward_end":
                close_region()
                return
            elif phase in ("backward_end", "end"):
                if state["in_region"]:
                    close_region()
                settle(unwound)
                return
            state["phase"] = phase
            rec.phase = phase

        def on_grad(p: Any) -> None:
            if p.grad is not None:
                rec.register(p.grad, MemoryCategory.GRADIENT, module=names.get(id(p), ""))

        rec.on_alloc = on_alloc
        rec.modules.depth_callback = on_depth
        handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
        handles += _gradients_at_step(optimizer, params, on_grad)
        t0 = time.perf_counter()
        try:
            with rec, rec.modules:
                one_step(on_phase)
                # First-step optimizer states (e.g. a trace without warm-up) become states.
                for state_dict in optimizer.state.values():
                    for key, value in state_dict.items():
                        if isinstance(value, torch.Tensor) and not (
                            host_optimizer_step and _host_resident(key, value, fused)
                        ):
                            block = rec.block_of(value)
                            if block is not None and block.phase != "init":
                                block.category = MemoryCategory.OPTIMIZER_STATE
        finally:
            for h in handles:
                h.remove()
        elapsed = time.perf_counter() - t0
        for b in rec.blocks:
            if b.category is None:
                b.category = MemoryCategory.TEMPORARY
    n_all = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    return Capture(
        recorder=rec,
        num_parameters=n_all,
        num_trainable_parameters=n_train,
        trace_seconds=elapsed,
        warmup_seconds=warmup,
        host_state_bytes=host_bytes,
        root=model,
    )
