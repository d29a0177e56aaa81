"""Remote-code families on the traced paths (issue 26): Qwen-1, ChatGLM2/3 and Baichuan-7B
ship their modeling code on the Hub (``trust_remote_code``), so transformers cannot build
their ``model_type``; their layers are transformers' Qwen2 / Llama layers under other names.

Note [Remote-code stand-ins]
    The config is read through its HF table row (:mod:`trainmem.specs.hf_table`, no remote
    code runs) into a :class:`~trainmem.specs.model.ModelSpec`, and the traced model is the
    transformers class with the same tensors: ``Qwen2ForCausalLM`` where the fused QKV
    projection is biased and the output projection and MLP are not (Qwen-1's ``c_attn``,
    ChatGLM's ``query_key_value`` with ``add_qkv_bias``), ``LlamaForCausalLM`` where nothing is
    biased (Baichuan's ``W_pack``). Same widths, heads, key/value groups (ChatGLM's
    ``multi_query_group_num``), head size (``kv_channels``), MLP width (Qwen-1's
    ``intermediate_size // 2``), vocabulary and untied head, so the parameter count is the
    row's (tested). Not reproduced: a fused projection's single output tensor (three tensors
    here, the same bytes), ChatGLM's rotary on half of each head (the cos / sin tables and the
    rotated copies of the other half: a few (tokens x head_dim) tensors per layer), Baichuan2's
    ``NormHead`` (the normalised [V, h] weight made at each forward). The estimate's notes name
    the stand-in. Full fine-tuning matches the table row's analytic estimate (within 0.001 % at
    4 x 2,048 tokens, activations dominating); LoRA is refused, since peft would put the
    adapters on the stand-in's separate q / v linears, not on the fused projection the remote
    code has (its saved tensors differ: +6 % at that size).

Source: Qwen/Qwen-7B modeling_qwen.py, THUDM/chatglm3-6b modeling_chatglm.py,
baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py (as cited by the table rows);
transformers models/qwen2/modeling_qwen2.py, models/llama/modeling_llama.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.hf_table import REMOTE_CODE_TYPES

__all__ = ["REMOTE_CODE_TYPES", "stand_in_config"]


def stand_in_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers config of the class that stands in for a remote-code model (Note
    [Remote-code stand-ins]).

    Args:
        raw: the published ``config.json`` of a ``qwen`` / ``chatglm`` / ``baichuan`` model.

    Returns:
        A ``qwen2`` or ``llama`` config dict with the same tensors.

    Raises:
        SpecError / UnsupportedError: what the table row refuses, or biases no transformers
            class has (an output projection or MLP bias beside a biased QKV), or LayerNorm.
    """
    from trainmem.specs.hf import model_spec_from_hf

    spec = model_spec_from_hf(raw, name=str(raw.get("model_type")))
    if spec.norm_kind != "rmsnorm" or not spec.final_norm:
        raise UnsupportedError(
            f"{spec.model_type} with LayerNorm or without a final norm has no transformers "
            "stand-in to trace; use --engine analytic"
        )
    if spec.attention_out_bias or spec.mlp_bias:
        raise UnsupportedError(
            f"{spec.model_type} with biased output projections or MLP (no_bias / "
            "add_bias_linear) has no transformers stand-in to trace; use --engine analytic"
        )
    model_type = "qwen2" if spec.attention_bias else "llama"
    return {
        "model_type": model_type,
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": False,
    }
