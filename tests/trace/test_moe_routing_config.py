"""A MoE config whose router cannot pick its experts (transformers' default DeepseekV2Config:
``num_experts_per_tok`` null) is refused naming the field, where the traced step failed inside
``torch.topk`` before; the refusal is checked against the real model's forward on the CPU, which
fails on the same config (Note [A router without its top-k] in trainmem/trace/hf_model.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainmem.errors import SpecError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

# AutoConfig.for_model("deepseek_v2") shrunk: the router fields left to the class defaults
# (num_experts_per_tok, n_group, topk_group null; topk_method "greedy")
_TINY_V2: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def _config(tmp_path: Path, **changes: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_TINY_V2, **changes}))
    return str(path)


def _real_forward(**changes: Any) -> None:
    """The run a user's GPU would start: the model from the config, one forward on tokens."""
    config = transformers.AutoConfig.for_model(**{**_TINY_V2, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 512, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def _estimate(path: str) -> int:
    training = TrainingConfig(micro_batch_size=1, seq_len=16, precision="32-true")
    est = estimate(path, training, engine="generic", simulate_allocator=False)
    return est.breakdown.allocated_bytes


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 2, "topk_method": "group_limited_greedy"}, "n_group"),
        ({"num_experts_per_tok": 2, "topk_method": None}, "topk_method"),
    ],
    ids=["default-config", "groups-unset", "no-method"],
)
def test_a_router_without_its_top_k_is_refused_naming_the_field(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises((TypeError, UnboundLocalError)):  # the real run fails on this config
        _real_forward(**changes)
    with pytest.raises(SpecError, match=f"^{field}: "):
        _estimate(_config(tmp_path, **changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"num_experts_per_tok": 2},
        {"num_experts_per_tok": 2, "topk_method": "group_limited_greedy", "n_group": 2,
         "topk_group": 1},
        {"first_k_dense_replace": 2},  # every layer dense: no router reads the null field
    ],
    ids=["greedy", "group-limited", "all-dense"],
)  # fmt: skip
def test_a_config_whose_router_runs_is_traced(tmp_path: Path, changes: dict[str, Any]) -> None:
    _real_forward(**changes)  # the real run goes through
    assert _estimate(_config(tmp_path, **changes)) > 0
