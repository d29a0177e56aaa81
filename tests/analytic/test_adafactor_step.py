"""transformers' Adafactor step temporaries (issue 26): a Python loop over the parameters in
fp32, the last parameter's ``update`` still bound while the next one's step builds its own,
and under FSDP1 (``use_orig_params=False``) the parameters are the units' flat shards.

Source: transformers/optimization.py ``Adafactor.step`` (4.4x to 5.24; read at 5.24.0):
``grad = grad.float()`` and ``p_data_fp32 = p.float()`` for 16-bit tensors (kept through the
parameter's iteration), ``update = (grad**2) + eps`` (``grad**2`` and the sum alive together,
the previous parameter's ``update`` freed only by this assignment),
``update = exp_avg_sq.rsqrt().mul_(grad)`` (a new tensor beside the old), ``p_data_fp32.add_(
-update)`` (``-update`` beside ``update``); torch 2.13 distributed/fsdp/_flat_param.py (one
``FlatParameter`` per unit). Bytes by hand for a 2-layer Llama, h 1024, i 2816, 8 heads (no
GQA), vocabulary 4096, untied head (tests/models/agreement/llama_h1024.json):
a layer: 4 x 1024^2 + 3 x 1024 x 2816 + 2 x 1024 = 12,847,104 elements; the root unit
(embedding, final norm, head): 2 x 4096 x 1024 + 1024 = 8,389,632; the largest tensor (the
embedding or the head) 4,194,304.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

LLAMA = str(MODELS_DIR / "agreement" / "llama_h1024.json")
LAYER = 4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024
TENSOR = 4096 * 1024
assert LAYER == 12_847_104

FSDP1 = {"framework": "accelerate-fsdp", "zero_stage": 3}
FSDP1_4 = {**FSDP1, "data_parallel_size": 4}


def _step_temporaries(engine: str, **settings: Any) -> int:
    """Adafactor's own temporaries: the optimizer phase's highest live temporary bytes less
    those live when it starts (the cuBLAS workspaces)."""
    training = TrainingConfig(  # type: ignore[arg-type]
        micro_batch_size=2, seq_len=256, optimizer="adafactor", **settings
    )
    schedule = estimate(LLAMA, training, engine=engine, simulate_allocator=False).schedules[0]
    live, peak, base = 0, 0, None
    for ev in schedule.events():
        if ev.phase == "optimizer" and base is None:
            base = live
        if ev.category is MemoryCategory.TEMPORARY:
            live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
            if ev.phase == "optimizer":
                peak = max(peak, live)
    assert base is not None
    return peak - base


def _adafactor_step(**settings: Any) -> int:
    return _step_temporaries("analytic", **settings)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        # NO_SHARD (FSDP1 on one rank): the second layer's flat parameter, 16-bit gradient and
        # weight upcast: 4 B x (2 + 2) x LAYER, beside the first layer's fp32 update 4 B x LAYER
        ({**FSDP1, "precision": "bf16-true"}, 4 * 4 * LAYER + 4 * LAYER),
        # fp32 flat parameters: no upcast, 4 B x 2 x LAYER + 4 B x LAYER
        ({**FSDP1, "precision": "32-true"}, 4 * 2 * LAYER + 4 * LAYER),
        # FULL_SHARD over 4 ranks: each unit's shard, LAYER / 4 (4 divides it: no padding)
        ({**FSDP1_4, "precision": "bf16-true"}, 4 * 5 * LAYER // 4),
        # the HF Trainer's per-tensor loop: the head (the embedding's size) after the final
        # norm, whose 1,024-element update it has beside it
        ({"framework": "hf-trainer", "precision": "bf16-true"}, 4 * 4 * TENSOR + 4 * 1024),
    ],
    ids=["no-shard-bf16", "no-shard-fp32", "full-shard-4", "hf-trainer"],
)
def test_adafactor_step_temporaries_by_hand(settings: dict[str, Any], expected: int) -> None:
    assert _adafactor_step(**settings) == expected


@pytest.mark.slow  # about 4 s; the hand-derived cases above are its fast representative
def test_the_trace_of_transformers_adafactor_has_the_same_step() -> None:
    # transformers' Adafactor runs as it is on the generic path (FSDP1 NO_SHARD traced for real)
    settings = {**FSDP1, "precision": "bf16-true"}
    assert _step_temporaries("generic", **settings) == _step_temporaries("analytic", **settings)


def test_a_per_parameter_loop_under_fsdp2_steps_local_shards() -> None:
    # torch/optim/adamw.py ``_single_tensor_adamw`` on FSDP2's DTensor parameters runs on each
    # local shard: ``denom = (exp_avg_sq.sqrt() / ...).add_(eps)``, two fp32 tensors of the
    # largest shard, the embedding's (or head's) 4,194,304 / 4 elements: 2 x 4 B x 1,048,576.
    # The formulas took the whole tensor (33,554,432 B); the trace: 8,650,820 B
    settings = {"framework": "fsdp2", "zero_stage": 3, "data_parallel_size": 4}
    training = TrainingConfig(  # type: ignore[arg-type]
        micro_batch_size=2,
        seq_len=256,
        optimizer="adamw",
        optimizer_implementation="for-loop",
        precision="bf16-mixed",
        **settings,
    )
    schedule = estimate(LLAMA, training, simulate_allocator=False).schedules[0]
    step = [
        ev.size_bytes
        for ev in schedule.events()
        if ev.phase == "optimizer" and ev.category is MemoryCategory.TEMPORARY
    ]
    assert max(step) == 2 * 4 * TENSOR // 4
