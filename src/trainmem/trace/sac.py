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

__all__ = ["save_ops", "selective_policy"]


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
