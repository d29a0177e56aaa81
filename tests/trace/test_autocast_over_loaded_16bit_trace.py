"""The trace engine under ``load_dtype`` (issue 24): it loads the tiny model in bf16
(``TrainingConfig.weight_dtype``, trainmem/trace/hf_model.py) and runs the step under
torch.autocast, peft keeping its adapters fp32 (``autocast_adapter_dtype=True``). Expected
bytes by hand (tests/analytic/test_autocast_over_loaded_16bit.py): the parameters and AdamW's
states of tiny-llama-test's 158,016 values halve against fp32 weights (316,032 B and 632,064 B
less); under LoRA r 8 on q, v the 3,584 adapter values stay 4 B, so only the base halves.
Where the layers' saved tensors come out, the analytic engine's formulas are held to the
traced step."""

from __future__ import annotations

import pytest

from trainmem import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")


def _both(lora_rank: int, load_dtype: str | None):  # type: ignore[no-untyped-def]
    t = TrainingConfig(
        framework="hf-trainer",
        precision="bf16-mixed",
        micro_batch_size=2,
        seq_len=128,
        lora_rank=lora_rank,
        load_dtype=load_dtype,
    )
    run = {"simulate_allocator": False}
    return (
        estimate("tiny-llama-test", t, engine="trace", **run),  # type: ignore[arg-type]
        estimate("tiny-llama-test", t, engine="analytic", **run),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_traced_states_halve(lora_rank: int) -> None:
    base = 158_016  # tiny-llama-test's parameters
    loaded, _ = _both(lora_rank, "bfloat16")
    fp32, _ = _both(lora_rank, None)
    assert fp32.breakdown.parameters - loaded.breakdown.parameters == 2 * base
    trained = base if lora_rank == 0 else 0  # adapters' states stay fp32
    assert fp32.breakdown.optimizer_states - loaded.breakdown.optimizer_states == 4 * trained


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_engines_agree(lora_rank: int) -> None:
    traced, analytic = _both(lora_rank, "bfloat16")
    t, a = traced.breakdown, analytic.breakdown
    # the trace's few bytes of its own (AdamW's step scalars, RoPE's buffer) and autocast's
    # fp32 casts of the norm weights: under 2 KiB on a 0.2 MB model
    assert abs(t.activations - a.activations) <= 2048
    assert abs(t.allocated_bytes - a.allocated_bytes) <= 2048
