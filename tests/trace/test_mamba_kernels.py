"""Note [Traced Mamba kernels] (trainmem/trace/mamba_kernels.py): during the trace transformers'
Mamba mixers take their CUDA-kernel path, and the stand-ins keep what mamba_ssm's kernels keep.

The expected bytes are derived by hand from mamba_ssm's ``MambaInnerFn.forward`` and
``selective_scan.cpp`` (state-spaces/mamba e9594ce1), for a Mamba mixer of hidden size e = 8,
intermediate size d = 16, state size n = 4, time-step rank r = 2, conv width 4, on a batch of
b = 2 sequences of l = 3 tokens (c = ceil(3 / 2048) = 1 scan chunk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kernel_saved_bytes import saved_activation_bytes  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402

from trainmem.trace import mamba_kernels  # noqa: E402
from trainmem.trace.mamba_kernels import mamba_kernels as patched  # noqa: E402

E, D_INNER, N, R, B, L = 8, 16, 4, 2, 2, 3


def _mixer() -> Any:
    config = transformers.MambaConfig(
        hidden_size=E,
        intermediate_size=D_INNER,
        state_size=N,
        time_step_rank=R,
        conv_kernel=4,
        num_hidden_layers=1,
        vocab_size=16,
        use_bias=False,
        use_conv_bias=True,
    )
    return modeling_mamba.MambaMixer(config, layer_idx=0).train()


def test_fp32_mixer_saves_what_mamba_inner_fn_saves() -> None:
    mixer = _mixer()
    hidden = torch.randn(B, L, E, requires_grad=True)
    with patched():
        out = mixer(hidden)
    assert type(out.grad_fn).__name__ == "MambaInnerBackward"
    # MambaInnerFn (checkpoint_lvl 1) keeps, besides the parameters, in fp32 (4 bytes):
    xz = B * 2 * D_INNER * L * 4  # in_proj's output made contiguous ([b, l, 2d] transposed)
    x_dbl = B * L * (R + 2 * N) * 4  # x_proj's output [b*l, r + 2n]
    a = D_INNER * N * 4  # A = -exp(A_log) [d, n]
    b_c = 2 * B * N * L * 4  # B and C as contiguous [b, 1, n, l] copies
    states = B * D_INNER * 1 * 2 * N * 4  # scan states x [b, d, c, 2n], fp32
    scan_out = B * D_INNER * L * 4  # the ungated scan output [b, d, l]
    saved = saved_activation_bytes(out.grad_fn, mixer)
    assert saved == xz + x_dbl + a + b_c + states + scan_out == 2864
    out.sum().backward()  # the backward's gradients have the parameters' shapes
    assert all(p.grad is not None and p.grad.shape == p.shape for p in mixer.parameters())
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape


def test_autocast_mixer_keeps_the_kernels_16_bit_weight_copies() -> None:
    mixer = _mixer()
    hidden = torch.randn(B, L, E, requires_grad=True)
    with patched(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixer(hidden)
    # the activations above in bf16 (2 bytes), the fp32 A and scan states unchanged, plus the
    # copies MambaInnerFn casts itself: x_proj [r + 2n, d], dt_proj [d, r], out_proj [e, d]
    activations = (B * 2 * D_INNER * L + B * L * (R + 2 * N) + 2 * B * N * L + B * D_INNER * L) * 2
    fp32 = (D_INNER * N + B * D_INNER * 2 * N) * 4
    copies = ((R + 2 * N) * D_INNER + D_INNER * R + E * D_INNER) * 2
    assert saved_activation_bytes(out.grad_fn, mixer) == activations + fp32 + copies == 2712


def test_scan_states_one_chunk_per_2048_positions() -> None:
    # selective_scan.cpp: n_chunks = (seqlen + 2048 - 1) / 2048; x [b, d, n_chunks, 2n] fp32
    b, d, n, seq = 1, 2, 3, 2049
    u = torch.randn(b, d, seq, dtype=torch.bfloat16, requires_grad=True)
    delta = torch.randn(b, d, seq, dtype=torch.bfloat16, requires_grad=True)
    bc = torch.randn(b, n, seq, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(d, n, requires_grad=True)
    out = mamba_kernels.selective_scan_fn(u, delta, a, bc, bc, None, None)
    shapes = {(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors if t is not None}
    assert ((b, d, 2, 2 * n), torch.float32) in shapes


def test_patch_is_undone() -> None:
    original = modeling_mamba.mamba_inner_fn
    with patched():
        assert modeling_mamba.mamba_inner_fn is mamba_kernels.mamba_inner_fn
    assert modeling_mamba.mamba_inner_fn is original


TINY_CONFIGS = {
    # (config, the modeling module's kernel name the stand-in replaces, its reference scan)
    "mamba": (
        {"hidden_size": 64, "intermediate_size": 128, "state_size": 16},
        "mamba_inner_fn",
        "mamba_selective_scan",
    ),
    "jamba": (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "mamba_d_state": 8,
        },
        "mamba_selective_scan",
        None,
    ),
    "mamba2": (
        {"hidden_size": 64, "num_heads": 4, "head_dim": 32, "expand": 2, "state_size": 16},
        "mamba2_split_conv1d_scan_combined",
        "mamba2_chunk_scan",
    ),
}


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_traced_model_runs_the_kernel_path(
    model_type: str, tmp_path: Path, monkeypatch: Any
) -> None:
    import importlib

    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    fields, kernel, reference = TINY_CONFIGS[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    calls: list[str] = []
    stand_in = mamba_kernels._STAND_INS[kernel]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kernel)
        return stand_in(*args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the trace ran transformers' PyTorch scan")

    monkeypatch.setitem(mamba_kernels._STAND_INS, kernel, counted)
    if reference is not None:
        monkeypatch.setattr(module, reference, refused)
    config = {"model_type": model_type, "num_hidden_layers": 2, "vocab_size": 256, **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    training = TrainingConfig(micro_batch_size=1, seq_len=64)
    estimate(str(path), training, engine="generic", simulate_allocator=False)
    assert calls  # the mixers ran through the stand-in


def _mamba2_mixer() -> Any:
    from transformers.models.mamba2 import modeling_mamba2

    # h = 2 heads of p = 4 (d = 8), one group of state n = 4: conv channels d + 2n = 16,
    # in_proj width 2d + 2n + h = 26 (z, xBC, dt; no extra MLP channels)
    config = transformers.Mamba2Config(
        hidden_size=8,
        expand=1,
        num_heads=2,
        head_dim=4,
        n_groups=1,
        state_size=4,
        conv_kernel=4,
        chunk_size=256,
        num_hidden_layers=1,
        vocab_size=16,
        use_bias=False,
        use_conv_bias=True,
    )
    return modeling_mamba2.Mamba2Mixer(config, layer_idx=0).train()


def test_mamba2_mixer_saves_what_the_split_conv1d_scan_kernel_saves() -> None:
    mixer = _mamba2_mixer()
    hidden = torch.randn(B, L, 8, requires_grad=True)
    with patched():
        out = mixer(hidden)
    assert type(out.grad_fn).__name__ == "SplitConv1dScanBackward"
    # MambaSplitConv1dScanCombinedFn with the gated RMSNorm and out_proj fused keeps, in fp32:
    zxbcdt = B * L * 26 * 4  # in_proj's output itself
    out_x = B * L * 2 * 4 * 4  # the scan's output [b, l, h, p], before the gated norm
    a = 2 * 4  # A = -exp(A_log) [h]
    rstd = 1 * B * L * 4  # the norm's 1/rms per group and row, fp32
    assert saved_activation_bytes(out.grad_fn, mixer) == zxbcdt + out_x + a + rstd == 848
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in mixer.parameters())
