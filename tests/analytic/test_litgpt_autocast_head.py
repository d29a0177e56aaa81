"""lit-gpt's chunked LM head under autocast (bf16-mixed) with a frozen head: each chunk's
``lm_head(x_i)`` casts the fp32 head weight to bf16 again, since autocast caches only casts of
leaves that require grad (aten/src/ATen/autocast_mode.cpp ``cached_cast``), and each chunk's
matmul saves its cast for the input gradient (lit_gpt/lora.py @8641822 ``GPT.forward``:
``[self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]``).

Expected by hand for StableLM-Alpha-3B (V = 50,688, h = 4,096), 1,034 tokens in 9 chunks
(ceil(1034 / 9) = 115 rows each, so 9 pieces): 9 x 2 B x V h = 3,737,124,864 B; unchunked, or
with the head trained (cast once, cached), one cast: 415,236,096 B.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

ONE_CAST = 2 * 50_688 * 4_096  # 415,236,096 B


def _head_copies(**kw: object) -> int:
    base: dict[str, object] = {
        "micro_batch_size": 1,
        "seq_len": 1034,
        "precision": "bf16-mixed",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "framework": "litgpt",
        "chunked_cross_entropy": 9,
    }
    training = TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]
    est = estimate("stablelm-base-alpha-3b", training, engine="analytic", simulate_allocator=False)
    terms: dict[str, int] = est.details["activation_terms_outside_layers_bytes"]
    return terms["autocast_weight_copies"]


@pytest.mark.parametrize(
    ("changes", "casts"),
    [
        pytest.param({}, 9, id="frozen-chunked"),
        pytest.param({"chunked_cross_entropy": 0}, 1, id="unchunked"),
        pytest.param({"lora_rank": 0}, 1, id="trained-head"),
        pytest.param({"framework": "hf-trainer", "lora_dropout": 0.0}, 1, id="hf"),
    ],
)
def test_each_head_chunk_saves_its_own_cast(changes: dict[str, object], casts: int) -> None:
    assert _head_copies(**changes) == casts * ONE_CAST
