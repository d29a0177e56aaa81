"""DeepSpeed ZeRO-1/2 on the traced paths beyond a formula family's full fine-tune (issue 26):
LoRA (peft's adapters traced in the model's 16-bit dtype, as DeepSpeed casts the whole wrapped
module: trainmem.trace.lora ``cast_adapters``) and models without a ModelSpec (Note [DeepSpeed
without a ModelSpec]), DeepSpeed's transforms applied to the traced step
(trainmem.traced_transforms).

Expected numbers: the adapter sizes by hand below; the analytic engine (its own formulas and
schedule) for the agreement within 1%.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("peft")

QWEN2 = MODELS_DIR / "formula" / "qwen2.json"


@pytest.fixture(scope="module")
def wide_qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 2-layer Qwen2 formula config at hidden 256 (4 heads of 64, 2 KV heads), so that the
    adapters' states are not lost beside the cuBLAS workspaces."""
    raw = json.loads(QWEN2.read_text())
    raw.update(hidden_size=256, intermediate_size=512)
    path = tmp_path_factory.mktemp("qwen2-wide") / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _lora(**changes: Any) -> TrainingConfig:
    settings: dict[str, Any] = {
        "micro_batch_size": 2,
        "seq_len": 64,
        "lora_rank": 16,
        "framework": "deepspeed",
        "zero_stage": 2,
        "data_parallel_size": 4,
        "reduce_bucket_size": "auto",  # h^2 elements, not DeepSpeed's 1 GB default
    }
    return TrainingConfig(**{**settings, **changes})


def test_lora_adapters_under_zero2_by_hand(wide_qwen2: str) -> None:
    # rank 16 on q (256 -> 256) and v (256 -> 128): 16 x (256 + 256) + 16 x (256 + 128) =
    # 14,336 elements per layer, 28,672 in the 2 layers; DeepSpeed casts them to bf16 (2 B),
    # keeps an fp32 master copy and two fp32 moments partitioned over 4 ranks (12 B / 4) and,
    # under ZeRO-2, this rank's bf16 gradient partition (2 B / 4)
    est = estimate(wide_qwen2, _lora(), engine="generic", simulate_allocator=False)
    assert est.num_trainable_parameters == 28_672
    states = est.schedules[0].model_states()
    assert states["optimizer_states"] == 12 * 28_672 // 4
    assert states["gradients"] == 2 * 28_672 // 4
    plain = estimate(wide_qwen2, _lora(framework="pytorch-amp", zero_stage=0, data_parallel_size=1,
                                      precision="bf16-true"), engine="generic",
                     simulate_allocator=False)  # fmt: skip
    # the same bf16 base as DeepSpeed's, adapters fp32 (peft's upcast): 2 B more per element
    assert plain.schedules[0].model_states()["parameters"] == states["parameters"] + 2 * 28_672


@pytest.mark.parametrize(
    "changes",
    [{}, {"zero_stage": 1}, {"data_parallel_size": 8, "lora_targets": ("q", "k", "v", "o")}],
)
def test_lora_under_deepspeed_matches_the_analytic_engine(
    wide_qwen2: str, changes: dict[str, Any]
) -> None:
    training = _lora(**changes)
    generic = estimate(wide_qwen2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(wide_qwen2, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_deepspeed_without_a_model_spec_reads_the_traced_step(wide_qwen2: str) -> None:
    """Note [DeepSpeed without a ModelSpec]: the trainable elements from the traced gradients
    give the schedule the analytic layout gives, to the byte."""
    from trainmem.specs.hf import load_model_spec
    from trainmem.trace.generic import estimate_generic
    from trainmem.traced_transforms import apply_deepspeed

    for changes in ({}, {"zero_stage": 1, "gradient_accumulation_steps": 2, "lora_rank": 0}):
        training = _lora(reduce_bucket_size=4096, **changes)
        traced = estimate_generic(wide_qwen2, training).schedules[0]
        with_spec = apply_deepspeed(traced, load_model_spec(wide_qwen2), training)
        without = apply_deepspeed(traced, None, training)
        assert without.peak().peak_bytes == with_spec.peak().peak_bytes
        assert without.model_states() == with_spec.model_states()


def test_deepspeed_on_a_diffusers_model() -> None:
    pytest.importorskip("diffusers")
    pixart = str(MODELS_DIR / "diffusers" / "tiny-pixart.json")
    training = TrainingConfig(micro_batch_size=2, framework="deepspeed", zero_stage=2,
                              data_parallel_size=4, reduce_bucket_size=4096)  # fmt: skip
    est = estimate(pixart, training, engine="generic", simulate_allocator=False)
    n = est.num_trainable_parameters
    states = est.schedules[0].model_states()
    # bf16 weights; fp32 master + two fp32 moments and bf16 gradients partitioned over 4
    assert states["optimizer_states"] == 12 * n // 4
    assert states["gradients"] == 2 * n // 4
    assert any("DeepSpeed ZeRO-2" in note for note in est.notes)
    # "auto" buckets are h^2, and a diffusers model has no ModelSpec to give h
    with pytest.raises(UnsupportedError, match="reduce-bucket-size=N"):
        estimate(pixart, replace(training, reduce_bucket_size="auto"), engine="generic")
