"""Selective checkpointing and tensor / sequence parallelism of timm's ViT blocks (Note [timm's
transformer blocks], trainmem/trace/timm_parallel.py; issue 26).

The expected bytes are derived by hand from timm 1.0.31's ``test_vit`` (timm/models/
vision_transformer.py: patch 16, ``embed_dim`` d = 64, depth 6, 2 heads, ``mlp_ratio`` 3, so the
MLP is 192 wide, with biases everywhere; 1,000 classes) at its 160 x 160 input: N = (160 / 16)**2
+ 1 class token = 101 tokens, b = 2, fp32 weights and activations (``32-true``), dropout off.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("timm") is None:
    pytest.skip("timm is the optional extra trainmem[vision]", allow_module_level=True)

from trainmem.breakdown import MemoryCategory  # noqa: E402
from trainmem.errors import NotApplicableError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

B, N, D, HEADS, HIDDEN, DEPTH, CLASSES = 2, 101, 64, 2, 192, 6, 1000
F32 = 4


def _training(**kwargs: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=B, precision="32-true", dropout=False, **kwargs)


def _activations(**kwargs: Any) -> dict[str, int]:
    """Live activation bytes at the end of the forward, per allocating module."""
    import torch

    from trainmem.trace import timm_model as tm
    from trainmem.trace.engine import run_trace

    training = _training(**kwargs)
    with torch.device("meta"):
        model = tm.build_timm_model({"architecture": "test_vit"}, training)
    _, report = run_trace(
        lambda: model,
        lambda: tm.make_timm_batch(model, training),
        training,
        forward_loss=tm.timm_forward_loss,
    )
    return report.activation_bytes_by_module


def _attention_bytes(heads: int) -> int:
    """SDPA's saved output [b, heads, N, head_dim] and the memory-efficient kernel's logsumexp
    [b, heads, ceil(N / 32) * 32] (fp32 inputs take that kernel; aten's ``kAlignLSE``), plus
    its philox seed and offset (two int64)."""
    head_dim = D // HEADS
    lse = B * heads * (-(-N // 32) * 32) * F32
    return B * heads * N * head_dim * F32 + lse + 2 * 8


def test_selective_checkpointing_keeps_the_policys_outputs_of_each_block() -> None:
    """torchtitan's policy (trainmem/trace/sac.py) saves every ``addmm`` output (timm's linears
    all have biases, so no ``mm`` is left to alternate) and the attention's; full checkpointing
    keeps only each block's input. Per block beyond full: qkv 3d, proj d, fc1 192, fc2 d wide,
    and the attention."""
    full = sum(_activations(activation_checkpointing="full").values())
    selective = sum(_activations(activation_checkpointing="selective").values())
    linears = B * N * (3 * D + D + HIDDEN + D) * F32
    assert selective - full == DEPTH * (linears + _attention_bytes(HEADS))


def test_tensor_parallel_shards_qkv_proj_fc1_fc2() -> None:
    """Megatron's layout on timm's names: qkv and fc1 split by rows (weight and bias), proj and
    fc2 by columns (their biases whole); everything else whole. At t = 2 each block holds half of
    qkv (3 d d + 3 d), fc1 (d 192 + 192), proj (d d) and fc2 (192 d)."""
    est = estimate("timm:test_vit", _training(tensor_parallel_size=2), engine="generic")
    whole = est.num_parameters
    assert whole == 371_240  # timm's own count (tests/trace/test_timm.py checks it against timm)
    sharded = (3 * D * D + 3 * D) + (D * HIDDEN + HIDDEN) + D * D + HIDDEN * D
    assert est.breakdown.parameters == (whole - DEPTH * sharded // 2) * F32
    qkv_weight = [
        op.size_bytes
        for op in est.schedules[0].setup
        if op.module == "blocks.0.attn.qkv.weight"
        and op.action == "alloc"
        and op.category == MemoryCategory.PARAMETER
    ]
    assert qkv_weight == [3 * D * D // 2 * F32]


def test_tensor_parallel_heads_and_mlp_activations_per_rank() -> None:
    """Each rank's qkv output is 3 d / t wide, its attention has HEADS / t heads of the full
    head_dim, its fc1 output (and GELU's) 192 / t; the norms' inputs stay whole."""
    acts = _activations(tensor_parallel_size=2)
    assert acts["blocks.1.attn.qkv"] == B * N * 3 * D // 2 * F32
    assert acts["blocks.1.attn"] == _attention_bytes(HEADS // 2)
    assert acts["blocks.1.mlp.fc1"] == acts["blocks.1.mlp.act"] == B * N * HIDDEN // 2 * F32
    assert acts["blocks.1.norm1"] == B * N * D * F32 + 2 * B * N * F32  # output, mean, rstd


def test_sequence_parallel_shards_the_residual_stream_by_tokens() -> None:
    """With sequence parallelism rank 0 holds ceil(101 / 2) = 51 tokens of the residual stream
    (torch.chunk's split): the block's two residual sums and the norms' statistics are that
    wide, while the attention and the MLP save their all-gathered 101-token input."""
    acts = _activations(tensor_parallel_size=2, sequence_parallel=True)
    local = -(-N // 2)
    assert acts["blocks.1"] == 2 * B * local * D * F32
    assert acts["blocks.1.norm1"] == acts["blocks.1.norm2"] == 2 * B * local * F32
    assert acts["blocks.1.mlp"] == B * N * D * F32  # fc1's gathered input
    assert acts["blocks.1.attn"] == B * N * D * F32 + _attention_bytes(HEADS // 2)


def test_lora_under_tensor_parallelism_shards_lora_b_beside_qkv() -> None:
    """LoRA's default q, v targets adapt the fused qkv (peft's match); beside the column-parallel
    base ``lora_A`` [r, d] is replicated and ``lora_B`` [3 d, r] split by rows (Note [LoRA under
    tensor parallelism]): AdamW's two fp32 states per trainable element on the rank."""
    r = 16
    est = estimate(
        "timm:test_vit", _training(lora_rank=r, tensor_parallel_size=2), engine="generic"
    )
    assert est.breakdown.optimizer_states == 2 * F32 * DEPTH * (r * D + 3 * D * r // 2)


@pytest.mark.parametrize("name", ["timm:test_resnet", "timm:test_convnext"])
@pytest.mark.parametrize(
    "settings",
    [{"activation_checkpointing": "selective"}, {"tensor_parallel_size": 2}],
    ids=["selective", "tp2"],
)
def test_a_cnn_refuses_as_not_applicable_and_says_what_runs(
    name: str, settings: dict[str, Any]
) -> None:
    with pytest.raises(NotApplicableError, match="no attention blocks") as err:
        estimate(name, TrainingConfig(micro_batch_size=2, **settings), engine="generic")
    assert "full checkpointing" in str(err.value)


def test_context_parallelism_shards_the_patch_tokens_inside_the_blocks() -> None:
    """At 176 x 176 the ViT has 11 * 11 + 1 = 122 tokens; over 2 context ranks each block runs
    on 61 (its qkv output 3 d wide, the ring attention's local output and logsumexp, the residual
    sums), while the final norm after the blocks' all-gather holds all 122 (Note [Context
    parallelism of a ViT's tokens]). FSDP2 shards over the context ranks (torchtitan)."""
    tokens, local = 11 * 11 + 1, 61
    acts = _activations(zero_stage=3, context_parallel_size=2, resolution=176)
    assert acts["blocks.1.attn.qkv"] == B * local * 3 * D * F32
    head_dim = D // HEADS
    lse = B * HEADS * (-(-local // 32) * 32) * F32
    assert acts["blocks.1.attn"] == B * HEADS * local * head_dim * F32 + lse + 2 * 8
    assert acts["blocks.1"] == 2 * B * local * D * F32
    assert acts["norm"] == B * tokens * D * F32 + 2 * B * tokens * F32


def test_context_parallelism_pads_tokens_the_ranks_do_not_divide() -> None:
    """test_vit's own 160 x 160 input gives 101 tokens; torch's ring attention all-gathers equal
    chunks, so they are padded with one zero token to 102, 51 per rank (Note [Context
    parallelism of a ViT's tokens]): each block's qkv output, ring attention output and
    logsumexp (51 rounded up to 64) and residual sums are 51 tokens wide; the blocks' gathered
    output keeps the pad (102 tokens, the final norm saves a narrowed view of it), while the
    final norm's own output and statistics are the 101 real tokens."""
    padded, local = N + 1, (N + 1) // 2
    acts = _activations(zero_stage=3, context_parallel_size=2)
    assert acts["blocks.1.attn.qkv"] == B * local * 3 * D * F32
    head_dim = D // HEADS
    lse = B * HEADS * (-(-local // 32) * 32) * F32
    assert acts["blocks.1.attn"] == B * HEADS * local * head_dim * F32 + lse + 2 * 8
    assert acts["blocks.1"] == 2 * B * local * D * F32
    assert acts["blocks"] == B * padded * D * F32
    assert acts["norm"] == B * N * D * F32 + 2 * B * N * F32


def test_the_padding_is_in_the_estimates_notes() -> None:
    """Over 4 context ranks 101 tokens pad to 104, 26 per rank; a divisible count (122 at 176 x
    176 over 2) is split without padding, and the notes say which."""
    padded = estimate(
        "timm:test_vit", _training(zero_stage=3, context_parallel_size=4), engine="generic"
    )
    assert any("tokens padded 101 -> 104" in n and "26 per rank" in n for n in padded.notes)
    even = estimate(
        "timm:test_vit",
        _training(zero_stage=3, context_parallel_size=2, resolution=176),
        engine="generic",
    )
    assert any("122 tokens split 61 per rank" in n for n in even.notes)
    assert not any("padded" in n for n in even.notes)


def test_resolution_reaches_a_timm_vit_through_estimate() -> None:
    """``--resolution`` sets a timm ViT's input and position table (``img_size``): 176 x 176 is
    11 * 11 patches of 16 pixels, the position table (121 + 1 class token) x d."""
    est = estimate("timm:test_vit", _training(resolution=176), engine="generic")
    base = estimate("timm:test_vit", _training(), engine="generic")
    assert est.num_parameters - base.num_parameters == (122 - 101) * D
