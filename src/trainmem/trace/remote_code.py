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
    row's (tested). The fused projections are fused in the stand-in too
    (:func:`fuse_projections`, Note [Fused stand-in projections]), so LoRA's adapters sit on the
    one linear the remote code has. Not reproduced: ChatGLM's k and v expanded to every head,
    its rotary on half of each head (the cos / sin tables and the rotated copies of the other
    half: a few (tokens x head_dim) tensors per layer), Baichuan2's ``NormHead`` (the
    normalised [V, h] weight made at each forward).
    The estimate's notes name the stand-in. Full fine-tuning matches the table row's analytic
    estimate (within 0.001 % at 4 x 2,048 tokens, activations dominating).

Note [Fused stand-in projections]
    The remote code computes q, k and v with one linear and splits its output (Qwen-1
    ``QWenAttention.forward``: ``mixed_x_layer = self.c_attn(hidden_states)``; ``query, key,
    value = mixed_x_layer.split(self.split_size, dim=2)``; ChatGLM ``query_key_value`` then
    ``mixed_x_layer.split([...], dim=-1)``; Baichuan ``W_pack`` then ``unflatten``). The
    Qwen-1 and Baichuan stand-ins get the same: each attention's ``q_proj`` / ``k_proj`` /
    ``v_proj`` become views of one ``qkv_proj`` linear's output: the fused linear runs when q
    is asked for (transformers' Qwen2 / Llama call q, k, v in that order, checkpoint
    recomputation too) and k and v take their views of its output, as the remote code's split
    does. What that changes against three linears: one output tensor and one input saved
    (under autocast one 16-bit copy of the input, not three, as the formulas count a fused
    q/k/v: ``analytic/attention.py``); v, which attention saves, a view that keeps the whole
    (a + 2k) * d output alive (q and k are rotated copies), +2 h per token a layer without GQA,
    which the formulas count as ``attention/qkv_view_kept`` (``ModelSpec.
    fused_qkv_output_kept``; measured: the fused trace was +2 c h t L above the formulas'
    separate-tensor count on Qwen-7B, 4 x 2,048 tokens, bf16, full and LoRA alike); the
    split's backward concatenating the three gradients; and peft's LoRA on the fused linear
    (one A reading the input, one B of the fused width, as peft targets the remote code's
    ``c_attn`` / ``W_pack``), where on separate linears each targeted one would have its own
    adapter. ChatGLM fuses gate / up too (``dense_h_to_4h``, chunked into ``silu(x1) * x2``):
    its stand-in's ``gate_proj`` / ``up_proj`` become views of one ``gate_up_proj`` (the
    chunk's views keep the fused output, as the two separate outputs were kept: the same bytes),
    so peft adapts the one linear the remote code has. ChatGLM's multi-query v is a copy, not a
    view (``value_layer.unsqueeze(-2).expand(...).contiguous()``), so its fused output is not
    kept by v (``fused_qkv_output_kept`` False): the stand-in's v part is copied
    (``contiguous``) at the key/value width; the expansion to every head (a copy of k and v
    per query head, saved by SDPA) is not reproduced, as the formulas do not count it either.

Source: Qwen/Qwen-7B modeling_qwen.py, THUDM/chatglm3-6b modeling_chatglm.py,
baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py (as cited by the table rows);
transformers models/qwen2/modeling_qwen2.py, models/llama/modeling_llama.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.hf_table import REMOTE_CODE_TYPES
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["REMOTE_CODE_TYPES", "fuse_projections", "remote_code_loss", "stand_in_config"]


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


class _Part(torch.nn.Module):  # type: ignore[misc,name-defined]
    """One of the views of a fused linear's output (Note [Fused stand-in projections]): part
    ``index`` of ``widths`` along the last dimension. Part 0 runs the owner's fused linear
    (looked up at each call, so peft's wrapper of it runs) and keeps the others' views until
    they are taken. The owner is held outside the module tree (no second path to the linear)."""

    def __init__(
        self,
        owner: Any,
        fused: str,
        index: int,
        widths: list[int],
        shared: dict[str, Any],
        copy: bool = False,
    ) -> None:
        super().__init__()
        self._owner = [owner]
        self.fused, self.index, self.widths, self._shared = fused, index, widths, shared
        self.copy = copy

    def forward(self, x: Any) -> Any:
        if self.index == 0:  # (a tensor-parallel shard of the fused linear: its share of each)
            out = getattr(self._owner[0], self.fused)(x)
            n, total = out.shape[-1], sum(self.widths)
            self._shared["parts"] = out.split([w * n // total for w in self.widths], -1)
        parts = self._shared["parts"]
        if self.index == len(self.widths) - 1:
            del self._shared["parts"]  # the views the remote code's split gives, no longer held
        part = parts[self.index]
        return part.contiguous() if self.copy else part

    def extra_repr(self) -> str:
        copied = ", copied" if self.copy else ""
        return f"{self.fused}[{self.index}] of widths {self.widths}{copied}"


def _fuse(module: Any, names: tuple[str, ...], fused: str, *, copy_last: bool = False) -> None:
    """Replace ``module``'s linears ``names`` by views of one linear ``fused`` of their
    concatenated width, registered first (where the remote code defines it, so the LoRA target
    inference of ``trainmem.trace.lora`` reads it as the fused q / k / v or gate / up); with
    ``copy_last`` the last part is a copy of its view (ChatGLM's multi-query v)."""
    parts = [getattr(module, n) for n in names]
    widths = [p.out_features for p in parts]
    w = parts[0].weight
    linear = torch.nn.Linear(
        parts[0].in_features,
        sum(widths),
        bias=parts[0].bias is not None,
        device=w.device,
        dtype=w.dtype,
    )
    shared: dict[str, Any] = {}
    rest = {k: v for k, v in module._modules.items() if k not in names}
    module._modules.clear()
    module._modules[fused] = linear
    for k, n in enumerate(names):
        copy = copy_last and k == len(names) - 1
        module._modules[n] = _Part(module, fused, k, widths, shared, copy)
    module._modules.update(rest)


def fuse_projections(model: Any, raw: Mapping[str, Any]) -> None:
    """Fuse a remote-code stand-in's projections as the remote code fuses them, in place (Note
    [Fused stand-in projections]): q / k / v where the table row says so
    (``ModelSpec.fused_qkv``: Qwen-1, Baichuan, ChatGLM), v copied where the remote code copies
    it (ChatGLM, not ``ModelSpec.fused_qkv_output_kept``), gate / up where they are one linear
    (``ModelSpec.fused_gate_up``: ChatGLM's ``dense_h_to_4h``).

    Args:
        model: the stand-in built from :func:`stand_in_config` (transformers' Qwen2 / Llama).
        raw: the published ``config.json`` (its table row says what is fused).
    """
    from trainmem.specs.hf import model_spec_from_hf

    spec = model_spec_from_hf(raw, name=str(raw.get("model_type")))
    for module in list(model.modules()):
        if spec.fused_qkv and all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj")):
            names = ("q_proj", "k_proj", "v_proj")
            _fuse(module, names, "qkv_proj", copy_last=not spec.fused_qkv_output_kept)
        if spec.fused_gate_up and all(hasattr(module, n) for n in ("gate_proj", "up_proj")):
            _fuse(module, ("gate_proj", "up_proj"), "gate_up_proj")


def remote_code_loss(output: Any, batch: Any) -> Any:
    """The causal-LM loss of a remote-code family that computes it on its 16-bit logits
    (:data:`~trainmem.specs.model.REMOTE_CODE_LOSS_IN_LOGITS_DTYPE`), on the stand-in's logits:
    the stand-in runs without labels (transformers' own loss shifts the labels from 4.49), and
    this takes a shifted contiguous copy of the logits as they are and their cross-entropy
    against the shifted ids. Source: Qwen/Qwen-7B modeling_qwen.py ``QWenLMHeadModel.forward``
    (``shift_logits = lm_logits[..., :-1, :].contiguous()``, ``shift_labels = labels[..., 1:]
    .contiguous()``, ``CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))``).

    Args:
        output: the stand-in's output (``logits`` in the model's dtype).
        batch: its batch; the token ids stand for the labels (the same values in a causal LM
            batch, ``make_hf_batch``).

    Returns:
        The scalar loss.
    """
    return _shifted_cross_entropy(output.logits, batch)


def remote_code_upcast_loss(output: Any, batch: Any) -> Any:
    """The causal-LM loss of a remote-code family that upcasts its logits first
    (:data:`~trainmem.specs.model.REMOTE_CODE_UPCAST_SHIFTED_LOSS`): the stand-in's logits
    (no labels given) to fp32, then :func:`remote_code_loss`'s shifted copy and cross-entropy.
    Source: THUDM/chatglm3-6b modeling_chatglm.py ``ChatGLMForConditionalGeneration.forward``
    (``lm_logits = lm_logits.to(torch.float32)``, ``shift_logits = lm_logits[..., :-1, :]
    .contiguous()``, ``CrossEntropyLoss(ignore_index=-100)``)."""
    return _shifted_cross_entropy(output.logits.to(torch.float32), batch)


def _shifted_cross_entropy(logits: Any, batch: Any) -> Any:
    """Cross-entropy of a shifted contiguous copy of ``logits`` against the shifted ids."""
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = batch["input_ids"][..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(
        shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1)
    )
