"""Note [Traced linear-attention kernels] (trainmem/trace/fla_kernels.py): during the trace
transformers' gated delta-net, Kimi delta-attention and short-conv layers take their kernel path,
and the stand-ins keep what flash-linear-attention's kernels keep.

The expected bytes are derived by hand from fla v0.5.2 (9c8e42e7)
``ChunkGatedDeltaRuleFunction.forward`` / ``ChunkKDAFunction.forward`` and the allocations of the
functions they call, for b = 2 sequences of l = 3 tokens (one chunk of BT = 64), H = 2 query /
key heads of K = 4, V = 4, in fp32 (4 bytes)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kernel_saved_bytes import saved_activation_bytes  # noqa: E402

from trainmem.trace import fla_kernels  # noqa: E402
from trainmem.trace.fla_kernels import linear_attention_kernels as patched  # noqa: E402

B, L, H, K = 2, 3, 2, 4


def _node(out: Any, name: str) -> Any:
    """The autograd node called ``name`` in the graph of ``out``."""
    stack, seen = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == name:
            return fn
        stack.extend(f for f, _ in fn.next_functions)
    raise AssertionError(f"no {name} in the graph: the kernel path did not run")


def _gated_delta_net() -> Any:
    from transformers.models.qwen3_next import modeling_qwen3_next

    config = transformers.Qwen3NextConfig(
        hidden_size=8,
        linear_num_key_heads=H,
        linear_num_value_heads=2 * H,  # grouped values: HV = 4
        linear_key_head_dim=K,
        linear_value_head_dim=K,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        vocab_size=16,
    )
    return modeling_qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0).train()


def test_gated_delta_net_saves_what_chunk_gated_delta_rule_saves() -> None:
    layer = _gated_delta_net()
    hidden = torch.randn(B, L, 8, requires_grad=True)
    with patched():
        out = layer(hidden)
    node = _node(out, "ChunkGatedDeltaRuleBackward")
    hv = 2 * H
    # ChunkGatedDeltaRuleFunction keeps (fp32 here):
    q = k = B * L * H * K * 4  # l2norm_fwd's outputs (empty_like q / k)
    rstd = 2 * B * L * H * 4  # q_rstd and k_rstd, one fp32 per row [b*l*H]
    v = B * L * hv * K * 4  # input_guard's contiguous copy of the value view
    g = B * L * hv * 4  # chunk_local_cumsum's fp32 output [b, l, HV]
    beta = B * L * hv * 4  # sigmoid(b), as passed
    a = B * L * hv * 64 * 4  # the WY matrix A = zeros [b, l, HV, BT] in k's dtype
    assert saved_activation_bytes(node, layer) == q + k + rstd + v + g + beta + a == 7200
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape


def test_gated_delta_net_under_autocast_keeps_the_gate_in_fp32() -> None:
    layer = _gated_delta_net()
    hidden = torch.randn(B, L, 8, requires_grad=True)
    with patched(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(hidden)
    node = _node(out, "ChunkGatedDeltaRuleBackward")
    hv = 2 * H
    # in_proj's outputs are bf16 (2 bytes): q, k, v, beta and A (k's dtype); the rstds and the
    # gate's cumsum stay fp32 (chunk_local_cumsum's output_dtype=torch.float)
    bf16 = (2 * B * L * H * K + B * L * hv * K + B * L * hv + B * L * hv * 64) * 2
    fp32 = (2 * B * L * H + B * L * hv) * 4
    assert saved_activation_bytes(node, layer) == bf16 + fp32 == 3696


def test_kimi_delta_attention_saves_what_chunk_kda_saves() -> None:
    from transformers.models.kimi_linear import modeling_kimi_linear

    config = transformers.KimiLinearConfig(
        hidden_size=8,
        linear_attn_config={
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": H,
            "head_dim": K,
            "short_conv_kernel_size": 4,
        },
        num_hidden_layers=2,
        vocab_size=16,
    )
    layer = modeling_kimi_linear.KimiLinearDeltaAttention(config, layer_idx=0).train()
    assert (layer.num_heads, layer.head_dim) == (H, K)
    hidden = torch.randn(B, L, 8, requires_grad=True)
    with patched():
        out = layer(hidden)
    node = _node(out, "ChunkKDABackward")
    # ChunkKDAFunction (disable_recompute=False) keeps (fp32 here, HV = H):
    q = k = v = B * L * H * K * 4  # l2norm outputs; v: the guard's copy of the split view
    rstd = 2 * B * L * H * 4  # q_rstd, k_rstd
    g = 2 * B * L * H * K * 4  # the per-channel gate as passed and its fp32 chunk cumsum
    beta = B * L * H * 4
    a = 2 * B * L * H * 64 * 4  # Aqk (empty) and Akk (zeros), [b, l, HV, BT] in k's dtype
    assert saved_activation_bytes(node, layer) == q + k + v + rstd + g + beta + a == 7248
    out.sum().backward()
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape


def test_gated_delta_rule_backward_sums_grouped_heads() -> None:
    # GVA: q, k have H heads, v HV = 2H; the kernel's [b, l, HV, K] dq / dk are summed to H
    q = torch.randn(B, L, H, K, requires_grad=True)
    k = torch.randn(B, L, H, K, requires_grad=True)
    v = torch.randn(B, L, 2 * H, K, requires_grad=True)
    g = torch.randn(B, L, 2 * H, requires_grad=True)
    beta = torch.rand(B, L, 2 * H, requires_grad=True)
    o, final = fla_kernels.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert o.shape == v.shape and final.shape == (B, 2 * H, K, K) and final.dtype == torch.float32
    o.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, g, beta))


def test_patch_is_undone() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next

    original = modeling_qwen3_next.torch_chunk_gated_delta_rule
    with patched():
        stand_in = modeling_qwen3_next.torch_chunk_gated_delta_rule
        assert stand_in is fla_kernels.chunk_gated_delta_rule
    assert modeling_qwen3_next.torch_chunk_gated_delta_rule is original


TINY_CONFIGS = {
    # (config, the modeling module's kernel name the stand-in replaces)
    "qwen3_next": (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
        "torch_chunk_gated_delta_rule",
    ),
    "kimi_linear": (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "linear_attn_config": {
                "kda_layers": [1],
                "full_attn_layers": [2],
                "num_heads": 2,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        },
        "chunk_kimi_delta_attention",
    ),
    "lfm2": (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_types": ["conv", "full_attention"],
        },
        "causal_conv1d_fn",
    ),
}


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_traced_model_runs_the_kernel_path(
    model_type: str, tmp_path: Path, monkeypatch: Any
) -> None:
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    fields, kernel = TINY_CONFIGS[model_type]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    calls: list[str] = []
    stand_in = fla_kernels._STAND_INS[kernel]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kernel)
        return stand_in(*args, **kwargs)

    monkeypatch.setitem(fla_kernels._STAND_INS, kernel, counted)
    config = {"model_type": model_type, "num_hidden_layers": 2, "vocab_size": 256, **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    training = TrainingConfig(micro_batch_size=1, seq_len=64)
    estimate(str(path), training, engine="generic", simulate_allocator=False)
    assert calls  # the layers ran through the stand-in, not transformers' reference
