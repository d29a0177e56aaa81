"""Remote-code families on the generic path (issue 26, Note [Remote-code stand-ins]): Qwen-1,
ChatGLM3 and Baichuan2-7B traced as the transformers class with the same tensors.

Expected values: the parameter count is the table row's (itself checked against the published
totals in tests/specs), and the peak is the analytic engine's for the same row: the two engines
model the same step independently (formulas vs a trace of transformers' code).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

REMOTE = MODELS_DIR / "remote_code"


@pytest.mark.parametrize("name", ["qwen-7b", "chatglm3-6b", "baichuan2-7b"])
def test_stand_in_matches_the_table_row(name: str) -> None:
    path = str(REMOTE / f"{name}.json")
    # activations dominate: 4 x 2,048 tokens without checkpointing, SGD (no optimizer states)
    training = TrainingConfig(
        micro_batch_size=4, seq_len=2048, precision="bf16-true", optimizer="sgd"
    )
    generic = estimate(path, training, engine="generic", simulate_allocator=False)
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert generic.num_parameters == analytic.num_parameters
    assert analytic.breakdown.activations > analytic.breakdown.parameters
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01
    assert any("remote-code" in note for note in generic.notes)


@pytest.mark.parametrize("name", ["qwen-7b", "baichuan2-7b"])
def test_lora_on_the_fused_stand_in_matches_the_table_row(name: str) -> None:
    # Note [Fused stand-in projections]: peft's adapters on the one fused q/k/v linear the
    # remote code has (c_attn / W_pack), under autocast (one 16-bit copy of its input)
    path = str(REMOTE / f"{name}.json")
    training = TrainingConfig(
        micro_batch_size=4, seq_len=2048, precision="bf16-mixed", lora_rank=16
    )
    generic = estimate(path, training, engine="generic", simulate_allocator=False)
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert generic.num_trainable_parameters == analytic.num_trainable_parameters
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_the_fused_output_kept_by_v_by_hand() -> None:
    # Qwen-7B: h = a * d = 32 x 128 = 4096, no GQA; v a view of c_attn's 3h output keeps the
    # q and k widths alive beside it: 2 bytes x 2h per token, 4 x 2,048 tokens
    from dataclasses import replace

    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.estimate import resolve_model

    spec = resolve_model(str(REMOTE / "qwen-7b.json"))
    assert spec.fused_qkv_output_kept
    training = TrainingConfig(micro_batch_size=4, seq_len=2048, precision="bf16-true")
    kept = sum(layer_activation_terms(spec, training).values())
    separate = replace(spec, fused_qkv_output_kept=False)
    assert kept - sum(layer_activation_terms(separate, training).values()) == 2 * 2 * 4096 * 8192


def _tiny_chatglm(tmp_path: Path) -> str:
    """ChatGLM3's config shrunk: h = 64, 4 heads of kv_channels 16, 2 multi-query groups,
    ffn 128, 2 layers, vocabulary 512."""
    config = json.loads((REMOTE / "chatglm3-6b.json").read_text())
    config.update(hidden_size=64, num_attention_heads=4, kv_channels=16, num_layers=2)
    config.update(multi_query_group_num=2, ffn_hidden_size=128, padded_vocab_size=512)
    path = tmp_path / "tiny-chatglm.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_lora_on_chatglm_adapts_its_fused_linears(tmp_path: Path) -> None:
    # peft on the remote code's fused query_key_value and dense_h_to_4h, r = 4, every linear:
    # query_key_value A 4 x 64, B (4 + 2 x 2) x 16 x 4 = 768; dense 4 x 64 + 64 x 4 = 512;
    # dense_h_to_4h 4 x 64 + 2 x 128 x 4 = 1,280; dense_4h_to_h 4 x 128 + 64 x 4 = 768;
    # 3,328 a layer, 6,656 for 2 (separate q / k / v and gate / up linears: 8,192)
    path = _tiny_chatglm(tmp_path)
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=64,
        lora_rank=4,
        lora_targets=("q", "k", "v", "o", "gate", "up", "down"),
    )
    generic = estimate(path, training, engine="generic", simulate_allocator=False)
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert generic.num_trainable_parameters == analytic.num_trainable_parameters == 6_656
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_chatglm_own_loss_on_the_stand_in_matches_the_table_row(tmp_path: Path) -> None:
    # a vocabulary of 32,768 over 2 x 256 tokens, so the loss's tensors lead: ChatGLM's own
    # loss (fp32 upcast, then a shifted contiguous copy, modeling_chatglm.py) in the trace
    # (remote_code_upcast_loss on the stand-in) and the formulas (shifted_logits_bytes in any
    # release); transformers' ForCausalLMLoss of the installed release would shift the labels
    config = json.loads(Path(_tiny_chatglm(tmp_path)).read_text())
    config["padded_vocab_size"] = 32_768
    path = tmp_path / "tiny-chatglm-vocab.json"
    path.write_text(json.dumps(config))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, precision="bf16-true")
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    analytic = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.005


@pytest.mark.slow
def test_lora_on_chatglm3_matches_the_table_row() -> None:
    # the fast representative is the tiny ChatGLM above; here activations dominate
    path = str(REMOTE / "chatglm3-6b.json")
    training = TrainingConfig(micro_batch_size=4, seq_len=2048, lora_rank=16,
                              lora_targets=("q", "k", "v", "o", "gate", "up", "down"))  # fmt: skip
    generic = estimate(path, training, engine="generic", simulate_allocator=False)
    analytic = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert generic.num_trainable_parameters == analytic.num_trainable_parameters
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01
