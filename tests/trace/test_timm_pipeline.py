"""Pipeline parallelism of a timm ViT (Note [Pipeline stages of a timm ViT], trainmem/trace/
timm_pipeline.py; Note [Pipeline stages cut by torch's frontend], trace/frontend_pipeline.py):
torch's pipeline frontend cuts timm's ``test_vit`` before the first block of each stage.

Expected bytes by hand from timm 1.0.31's ``test_vit`` (timm/models/vision_transformer.py:
patch 16, d = 64, depth 6, 2 heads of 32, MLP 192 wide, biases everywhere, 1,000 classes) at its
160 x 160 input: N = 10 * 10 + 1 class token = 101 tokens; b = 2 per micro-batch, 4
micro-batches, fp32 (``32-true``), dropout off, pipeline 2 over the 6 blocks (3 per stage).

Parameters. A block: norm1 and norm2 2 x 64 each, qkv 64 x 192 + 192 = 12,480, proj 64 x 64 +
64 = 4,160, fc1 12,480, fc2 192 x 64 + 64 = 12,352: 41,728. Stage 0: the patch embedding 64 x 3
x 16 x 16 + 64 = 49,216, the class token 64, the position table 101 x 64 = 6,464 and blocks
0-2: 180,928. Stage 1: blocks 3-5, the final norm 128 and the head 64 x 1,000 + 1,000 =
65,000: 190,312.

Activations one micro-batch saves on stage 0, per block (fp32): norm1's output (qkv's input)
and its mean / rstd (b N d + 2 b N), qkv's output that SDPA's q / k / v view (3 b N d), the
memory-efficient kernel's output [b, 2, N, 32] (b N d) with its logsumexp [b, 2, ceil(N / 32)
* 32] and two int64 philox values, the two residual sums (2 b N d), norm2 as norm1, fc1's
output and GELU's (2 b N 192): 729,264 bytes; before the blocks the embedded tokens plus the
position table (b N d): 51,712. One micro-batch: 3 x 729,264 + 51,712 = 2,239,504 bytes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("timm") is None:
    pytest.skip("timm is the optional extra trainmem[vision]", allow_module_level=True)

from trainmem.breakdown import MemoryCategory  # noqa: E402
from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

B, N, D, HEADS, HIDDEN = 2, 101, 64, 2, 192
F32 = 4
BLOCK = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * HIDDEN + HIDDEN) + (HIDDEN * D + D)
STAGE0 = (D * 3 * 16 * 16 + D) + D + N * D + 3 * BLOCK
STAGE1 = 3 * BLOCK + 2 * D + (D * 1000 + 1000)


def _block_activation_bytes() -> int:
    bnd = B * N * D * F32
    norm = bnd + 2 * B * N * F32
    attention = B * HEADS * N * (D // HEADS) * F32 + B * HEADS * (-(-N // 32) * 32) * F32 + 2 * 8
    return norm + 3 * bnd + attention + 2 * bnd + norm + 2 * B * N * HIDDEN * F32


MICRO_BATCH_STAGE0 = 3 * _block_activation_bytes() + B * N * D * F32


def _pipeline(name: str = "timm:test_vit", **settings: Any) -> Any:
    training = TrainingConfig(micro_batch_size=B, precision="32-true", dropout=False,
                              pipeline_parallel_size=2, gradient_accumulation_steps=4,
                              **settings)  # fmt: skip
    return estimate(name, training, engine="generic", simulate_allocator=False)


def _at_peak(est: Any, rank: int, category: MemoryCategory) -> int:
    return int(est.schedules[rank].peak().by_category.get(category, 0))


def test_hand_counts() -> None:
    assert (BLOCK, STAGE0, STAGE1) == (41_728, 180_928, 190_312)
    assert MICRO_BATCH_STAGE0 == 2_239_504


def test_each_stage_holds_its_blocks_and_what_runs_beside_them() -> None:
    est = _pipeline()
    assert est.num_parameters == STAGE0 + STAGE1
    assert [r["pipeline_stage"] for r in est.details["per_rank"]] == [0, 1]
    for rank, n in enumerate((STAGE0, STAGE1)):
        assert _at_peak(est, rank, MemoryCategory.PARAMETER) == n * F32
        assert _at_peak(est, rank, MemoryCategory.OPTIMIZER_STATE) == 2 * n * F32  # AdamW
    # the step's images, 4 micro-batches of 2 [8, 3, 160, 160] fp32, and their 8 int64 labels
    assert _at_peak(est, 0, MemoryCategory.INPUT) == 8 * 3 * 160 * 160 * F32 + 8 * 8
    # 1F1B: stage 0 of 2 runs two forwards before its first backward, whose first op (fc2's
    # backward in block 2) is the peak: two micro-batches' activations in flight
    assert _at_peak(est, 0, MemoryCategory.ACTIVATION) == 2 * MICRO_BATCH_STAGE0
    # what was assumed names timm, which built the model, as without pipeline stages; it said
    # "transformers 5.24.0 (installed)" and a language model's "lengths" (session 26)
    assumed = est.details["assumed"]
    assert "timm" in assumed and "transformers" not in assumed and "lengths" not in assumed


def test_gpipe_holds_every_micro_batch_on_the_first_stage() -> None:
    est = _pipeline(pipeline_schedule="gpipe")
    assert _at_peak(est, 0, MemoryCategory.ACTIVATION) == 4 * MICRO_BATCH_STAGE0


def test_lora_adapters_stay_with_their_block() -> None:
    # rank-16 LoRA on timm's default target, each block's qkv: 16 x 64 + 192 x 16 = 4,096
    est = _pipeline(lora_rank=16)
    per_block = 16 * D + 3 * D * 16
    assert est.num_trainable_parameters == 6 * per_block
    for rank, n in enumerate((STAGE0, STAGE1)):
        assert _at_peak(est, rank, MemoryCategory.PARAMETER) == (n + 3 * per_block) * F32
        assert _at_peak(est, rank, MemoryCategory.OPTIMIZER_STATE) == 2 * 3 * per_block * F32


def test_a_cnn_is_refused_naming_what_is_traced_on_it() -> None:
    with pytest.raises(UnsupportedError, match="ResNet has none") as err:
        _pipeline("timm:test_resnet")
    assert "full checkpointing" in str(err.value)


def test_what_is_not_traced_beside_it_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedError, match="a timm model .* without activation_checkpointing"):
        _pipeline(activation_checkpointing="full")


def test_maxvit_stages_are_said_to_be_split_by_block_count_not_size() -> None:
    # issue 26 item 6: MaxViT's attention blocks widen stage by stage; the stages are cut at
    # equal block counts (4 / 4 of test_maxvit's 8), so they hold 220,310 / 872,942
    # parameters: the sizes of the two stage modules torch's frontend cut (session 25's
    # timmpp run), which sum to timm's own count. A ViT's equal blocks need no word.
    import torch

    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.frontend_pipeline import _split_points, stage_balance_note
    from trainmem.trace.timm_model import import_timm
    from trainmem.trace.timm_pipeline import timm_pipeline_inputs

    timm = import_timm()
    training = TrainingConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2)
    inputs = timm_pipeline_inputs()
    notes = {}
    for name in ("test_maxvit", "test_vit"):
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        _, spec = _split_points(model, training, inputs)
        notes[name] = stage_balance_note(model, training, inputs, spec)
        if name == "test_maxvit":
            assert 220_310 + 872_942 == sum(p.numel() for p in model.parameters())
    assert notes["test_vit"] is None
    assert notes["test_maxvit"] is not None
    assert "split by count (4 / 4 per stage" in notes["test_maxvit"]
    assert "the stages hold 220,310 / 872,942 parameters" in notes["test_maxvit"]
