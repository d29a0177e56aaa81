"""Pipeline parallelism of a diffusers denoiser (Note [Tracing pipeline parallelism of a
denoiser], trainmem/trace/diffusers_pipeline.py): torch's pipeline frontend cuts the stages at
the blocks, each traced rank holds what its stage holds. Expected bytes by hand from the config
(tests/models/diffusers/tiny-pixart.json; the parameter count per module is derived in
tests/trace/test_diffusers_options.py's docstring).

Tiny PixArt in fp32, pipeline 2 over its 2 blocks: stage 0 holds the patch embedding (544), the
adaLN-single timestep embedder and table (15,616), the caption projection (2,624) and block 0
(16,992); stage 1 block 1 (16,992), the final ``scale_shift_table`` (64) and ``proj_out``
(1,056). The patch embedding's ``pos_embed`` buffer (16 x 32 fp32) is on stage 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainmem.breakdown import MemoryCategory
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("diffusers")

MODELS = Path(__file__).resolve().parents[1] / "models" / "diffusers"
PIXART = str(MODELS / "tiny-pixart.json")
SD3 = str(Path(__file__).parent / "diffusers_configs" / "tiny-sd3.json")
BLOCK = 16_992
STAGE0 = 544 + 15_616 + 2_624 + BLOCK
STAGE1 = BLOCK + 64 + 1_056


def _pipeline(path: str, **settings: Any) -> Any:
    training = TrainingConfig(micro_batch_size=2, precision="32-true", pipeline_parallel_size=2,
                              gradient_accumulation_steps=4, **settings)  # fmt: skip
    return estimate(path, training, engine="generic", simulate_allocator=False)


def _at_peak(est: Any, rank: int, category: MemoryCategory) -> int:
    return int(est.schedules[rank].peak().by_category.get(category, 0))


def test_each_stage_holds_its_blocks_and_what_runs_beside_them() -> None:
    est = _pipeline(PIXART)
    assert est.num_parameters == STAGE0 + STAGE1 == 53_888
    assert [r["pipeline_stage"] for r in est.details["per_rank"]] == [0, 1]
    for rank, n in enumerate((STAGE0, STAGE1)):
        assert _at_peak(est, rank, MemoryCategory.PARAMETER) == n * 4
        assert _at_peak(est, rank, MemoryCategory.OPTIMIZER_STATE) == 2 * n * 4  # AdamW
    assert _at_peak(est, 0, MemoryCategory.BUFFER) == 16 * 32 * 4
    assert _at_peak(est, 1, MemoryCategory.BUFFER) == 0
    # the step's inputs, 4 micro-batches of 2: latents [8, 4, 8, 8], captions [8, 77, 48],
    # timesteps [8], fp32
    inputs = (8 * 4 * 8 * 8 + 8 * 77 * 48 + 8) * 4
    assert _at_peak(est, 0, MemoryCategory.INPUT) == inputs


def test_lora_adapters_stay_with_their_block() -> None:
    # rank-16 LoRA on q, v: to_q and to_v of both attentions of a block, 4 x (16 x 32 + 32 x 16)
    est = _pipeline(PIXART, lora_rank=16)
    per_block = 4 * (16 * 32 + 32 * 16)
    assert est.num_trainable_parameters == 2 * per_block
    for rank in (0, 1):
        assert _at_peak(est, rank, MemoryCategory.OPTIMIZER_STATE) == 2 * per_block * 4


def test_a_joint_attention_denoiser_splits_too() -> None:
    # tiny SD3 (MMDiT): stage 1 holds block 1 (context_pre_only: its attention's image q / k / v
    # / out, text q / k / v, no text out or feed-forward) and the output layers, width 32:
    # attention 7 x 1,056, ff 4,224 + 4,128, norm1 32 -> 6 x 32 (6,336), norm1_context
    # 32 -> 2 x 32 (2,112); norm_out 32 -> 64 (2,112), proj_out 32 -> 2 x 2 x 16 (2,112)
    est = _pipeline(SD3)
    stage1 = 7 * 1_056 + 4_224 + 4_128 + 6_336 + 2_112 + 2_112 + 2_112
    assert _at_peak(est, 1, MemoryCategory.PARAMETER) == stage1 * 4


def test_what_is_not_traced_beside_it_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match="without activation_checkpointing=full"):
        _pipeline(PIXART, activation_checkpointing="full")
    with pytest.raises(UnsupportedError, match="whole-model trace does not split"):
        estimate(PIXART, TrainingConfig(pipeline_parallel_size=2, gradient_accumulation_steps=4),
                 engine="trace")  # fmt: skip


def test_inputs_without_a_batch_dimension_are_replicated_to_every_micro_batch() -> None:
    # tiny FLUX at its default 128 px: 64 x 64 packed latents = 4,096 image tokens of 64
    # channels, 512 text tokens of 48, pooled 24, fp32. The whole step (4 micro-batches of 2)
    # holds the batched inputs of 8 samples and the position ids once: img_ids [4096, 3],
    # txt_ids [512, 3], which the schedule replicates to every micro-batch (chunked by 4, the
    # rotary table would cover 1,024 + 128 of the 4,096 + 512 tokens and the forward fail)
    flux = str(Path(__file__).parent / "diffusers_configs" / "tiny-flux.json")
    est = _pipeline(flux)
    batched = 8 * (4_096 * 64 + 512 * 48 + 24 + 1 + 1)  # + timestep, guidance
    assert _at_peak(est, 0, MemoryCategory.INPUT) == (batched + 4_096 * 3 + 512 * 3) * 4
