"""llm-analysis ``LLMAnalysis.training``: "(weight+op_state+grad+act)_memory_per_gpu".

The ModelConfig is filled from the row's local config.json (llm-analysis's own JSON format has
these fields), not from the Hub. Decoder-only language models with full fine-tuning and Adam
only: it has no PEFT ("in future support"), no encoder/classifier heads, no 8-bit or factored
optimizers, and no 32-bit training (it asserts 4/8/16-bit weights and activations). Mixed
precision is its default w16a16e16 with an fp32 master copy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import Answer, common_limits, serve  # noqa: E402

_RECOMPUTE = {"none": 0, "selective": 1, "full": 4}


def _first(config: dict[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def answer(req: dict[str, Any]) -> Answer:
    from llm_analysis.analysis import (
        ActivationRecomputation,
        DSZeRO,
        LLMAnalysis,
        get_gpu_config_by_name,
    )
    from llm_analysis.config import DtypeConfig, ModelConfig, ParallelismConfig

    training, config = req["training"], req["config"]
    why = common_limits(training, tool="llm-analysis")
    if why:
        return {"cannot_express": why}
    arch = (config.get("architectures") or [""])[0]
    if not arch.endswith("ForCausalLM") and not arch.endswith("LMHeadModel"):
        return {"cannot_express": f"{arch}: llm-analysis models decoder-only language models"}
    precision = training.get("precision", "bf16-mixed")
    if precision == "32-true":
        return {
            "cannot_express": "32-bit training: LLMAnalysis asserts weight_bits and "
            "activation_bits in (4, 8, 16)"
        }
    if precision in ("16-mixed", "bf16-mixed"):
        dtype, master = DtypeConfig(), 4
    else:
        return {"cannot_express": f"{precision}: no pure 16-bit Adam without master weights"}
    h = _first(config, "hidden_size", "n_embd", "d_model")
    model = ModelConfig(
        name=arch,
        num_layers=_first(config, "num_hidden_layers", "n_layer"),
        n_head=_first(config, "num_attention_heads", "n_head"),
        hidden_dim=h,
        vocab_size=config["vocab_size"],
        max_seq_len=_first(config, "max_position_embeddings", "n_positions"),
        num_key_value_heads=config.get("num_key_value_heads"),
        ffn_embed_dim=_first(config, "intermediate_size", "n_inner") or 4 * h,
        model_type=config.get("model_type"),
    )
    n = training.get("data_parallel_size", 1)
    gpu = "a100-sxm-40gb"  # only used for its capacity check and latency, not for memory
    analysis = LLMAnalysis(
        model,
        get_gpu_config_by_name(gpu),
        dtype_config=dtype,
        parallelism_config=ParallelismConfig(dp_size=n),
    )
    summary = analysis.training(
        batch_size_per_gpu=training.get("micro_batch_size", 1),
        gradient_accumulation_steps=training.get("gradient_accumulation_steps", 1),
        seq_len=training["seq_len"],
        activation_recomputation=ActivationRecomputation(
            _RECOMPUTE[training.get("activation_checkpointing", "none")]
        ),
        ds_zero=DSZeRO(training.get("zero_stage", 0) if n > 1 else 0),
        master_weights_dtype_bytes=master,
        flash_attn=training.get("attention", "sdpa") != "eager",
        softmax_dropout=training.get("attention", "sdpa") == "eager"
        and bool(training.get("dropout", True)),
        mlp_gated_linear_units=config.get("hidden_act") in ("silu", "swiglu"),
    )
    return {"predicted_bytes": int(summary["(weight+op_state+grad+act)_memory_per_gpu"])}


if __name__ == "__main__":
    serve("llm-analysis", "llm-analysis", answer)
