"""A transformers 5 MoE block under LoRA (``_frozen_grouped_experts`` in
trainmem/analytic/lora.py): frozen weights' matmuls keep no input. Bytes by hand from
:func:`trainmem.analytic.mlp.moe_terms`'s per-token sizes, b 2 x s 32 = 64 tokens, bf16
autocast over fp32 weights (c = 2, w = 4)."""

from __future__ import annotations

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

T = 64


def _terms(name: str, **lora: object) -> dict[str, int]:
    model = load_model_spec(str(MODELS_DIR / name))
    block = model.layer_kinds()[-1][1]  # the MoE block
    settings: dict[str, object] = {"micro_batch_size": 2, "seq_len": 32, **lora}
    return layer_activation_terms(block, TrainingConfig(**settings))  # type: ignore[arg-type]


def test_frozen_router_and_routed_experts_keep_no_input() -> None:
    # Mixtral (h 64, 4 experts, top 2): the softmax router keeps its fp32 probabilities (4 E)
    # and top-k values and indices (12 k), not its autocast input copy (c h: the frozen
    # weight's matmul keeps the weight only); the grouped matmul over frozen experts keeps no
    # gathered tokens (w h k), only the gather's and the sort's int64 indices (16 k)
    full = _terms("formula/mixtral.json")
    lora = _terms("formula/mixtral.json", lora_rank=8, lora_targets=("q", "v"))
    assert full["mlp/router"] == (2 * 64 + 4 * 4 + 12 * 2) * T == 10_752
    assert lora["mlp/router"] == (4 * 4 + 12 * 2) * T == 2_560
    assert full["mlp/expert_inputs"] == (4 * 64 * 2 + 16 * 2) * T == 34_816
    assert lora["mlp/expert_inputs"] == 16 * 2 * T == 2_048


def test_frozen_shared_expert_down_projection_keeps_no_input() -> None:
    # DeepSeek-V3 (tests/models/deepseek_v3.json: one shared expert of 32): gate's output,
    # the activation's and up's (3 c s_i); the product only when down trains
    lora = _terms("deepseek_v3.json", lora_rank=8, lora_targets=("q", "v"))
    assert lora["mlp/shared_expert"] == 3 * 2 * 32 * T == 12_288
    down = _terms("deepseek_v3.json", lora_rank=8, lora_targets=("q", "v", "down"))
    assert down["mlp/shared_expert"] == 4 * 2 * 32 * T == 16_384
