"""torchtitan's op-level selective activation checkpointing policy, shared by the eager
checkpoint wrapper (:func:`trainmem.trace.engine.apply_activation_checkpointing`) and the
compiled layers (:mod:`trainmem.trace.compile`), which tag their joint graph with it as dynamo
does.

Source: torchtitan/parallelisms/parallelize_llama.py ``_apply_ac_to_transformer_block``
(``_save_list``, ``_custom_policy``): the outputs of the ops of the list are saved, except every
second ``aten.mm``; everything else is recomputed (``torch.utils.checkpoint``
``CheckpointPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["ignore_profiler_ops", "save_ops", "selective_policy"]


def save_ops() -> frozenset[Any]:
    """Ops whose outputs the policy saves: the matmuls and the attention kernels (CPU, flash,
    memory-efficient)."""
    aten = torch.ops.aten
    return frozenset(
        {
            aten.mm.default,
            aten.addmm.default,
            aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
        }
    )


def selective_policy() -> Callable[..., Any]:
    """A fresh policy (one ``aten.mm`` counter per pass, forward and recompute apart), with the
    signature ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` expects."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = save_ops()
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *_a: Any, **_k: Any) -> Any:
        if op == aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def ignore_profiler_ops() -> None:
    """Keep ``torch.profiler.record_function``'s ops out of selective checkpointing's replay.

    Note [Profiler ops under selective checkpointing]
        SAC (torch 2.13 utils/checkpoint.py ``_CachingTorchDispatchMode`` /
        ``_CachedTorchDispatchMode``) numbers each op's invocations in the forward and looks
        the recompute's up by the same numbers; only ``SAC_IGNORED_OPS`` are left out.
        ``record_function`` dispatches ``profiler._record_function_enter_new`` / ``_exit``
        whether or not a profiler runs, and FSDP1's hooks open one per phase: under
        accelerate's FSDP1 the checkpointed decoder layer is an FSDP unit and each LoRA
        adapter a unit inside it (Note [Tracing FSDP1] in trainmem/trace/fsdp.py), so the
        recompute runs a different number of them (the layer unit's ``_pre_forward`` returns
        early in ``BACKWARD_PRE``; ``_unshard``'s ``FullyShardedDataParallel.rate_limiter``
        opens only when ``limit_all_gathers``' free-event queue is full, which differs between
        the passes) and the replay fails ("invocation index N encountered during backward but
        not found in storage"). They return no tensor, so nothing of theirs is saved or
        recomputed: they join ``SAC_IGNORED_OPS`` (in place, idempotent), as NVIDIA-NeMo
        Automodel does for torch 2.13 FSDP2 units inside a SAC region (PR #3133).
    """
    import torch.utils.checkpoint as checkpoint

    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )
