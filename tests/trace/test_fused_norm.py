"""Megatron's fused RMSNorm in the trace and in the formulas (Note [Megatron's fused RMSNorm],
trainmem/trace/fused_norm.py; issue 26).

Expected numbers by hand from what the fused kernels save (Apex normalization/
fused_layer_norm.py ``FusedRMSNormAffineMixedDtypesFunction``: ``ctx.save_for_backward(input_,
weight_, invvar)``; TransformerEngine's ``RMSNorm``: the input, the weight, the fp32 ``rsigma``):
the input in its own dtype (r h per token), the weight, one fp32 value per row. The values are
checked against transformers' own ``LlamaRMSNorm`` run on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.norms import block_norm_bytes
from trainmem.estimate import estimate
from trainmem.schedule import Op
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from trainmem.trace.fused_norm import fuse_rms_norms  # noqa: E402

AGREEMENT = MODELS_DIR / "agreement" / "llama_h2048.json"


def _pair(h: int, dtype: Any) -> tuple[LlamaRMSNorm, LlamaRMSNorm]:
    torch.manual_seed(0)
    plain, fused = LlamaRMSNorm(h, eps=1e-6), LlamaRMSNorm(h, eps=1e-6)
    with torch.no_grad():
        plain.weight.normal_()
        fused.weight.copy_(plain.weight)
    plain.to(dtype)
    fused.to(dtype)
    assert fuse_rms_norms(fused) == 1
    return plain, fused


def test_fused_norm_computes_transformers_rmsnorm_and_its_gradients() -> None:
    plain, fused = _pair(16, torch.float32)
    x = torch.randn(2, 3, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = plain(x), fused(x2)
    assert torch.allclose(y, y2, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert x.grad is not None and x2.grad is not None
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)
    assert plain.weight.grad is not None and fused.weight.grad is not None
    assert torch.allclose(plain.weight.grad, fused.weight.grad, atol=1e-5)


def test_fused_norm_saves_its_input_weight_and_fp32_rstd_only() -> None:
    """bf16, 2 x 3 tokens, h = 16: the input 6 x 16 x 2 = 192 B, the weight 16 x 2 = 32 B, the
    rstd 6 x 4 = 24 B. transformers' norm (the contrast) saves its fp32 upcast 6 x 16 x 4 = 384 B
    instead of the input, the rstd, the normalised bf16 tensor (192 B) and the weight."""
    plain, fused = _pair(16, torch.bfloat16)

    def saved_bytes(norm: LlamaRMSNorm) -> dict[int, int]:
        seen: dict[int, int] = {}

        def pack(t: Any) -> Any:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        return seen

    assert sorted(saved_bytes(fused).values()) == [24, 32, 192]
    assert sorted(saved_bytes(plain).values()) == [24, 32, 192, 384]


def test_formulas_save_the_fused_norms_input_and_rstd_for_megatron() -> None:
    """The agreement Llama, h = 2048, bf16 weights without autocast (r = 2): r h + 4 = 4100 B
    per token under Megatron, 4 h + r h + 4 = 12,292 B for transformers' norm (pytorch-amp
    bf16-true)."""
    model = load_model_spec(str(AGREEMENT))
    assert model.hidden_size == 2048
    megatron = TrainingConfig(micro_batch_size=2, seq_len=256, framework="megatron")
    plain = TrainingConfig(micro_batch_size=2, seq_len=256, precision="bf16-true")
    assert block_norm_bytes(model, megatron) == (2 * 2048 + 4, 0)
    assert block_norm_bytes(model, plain) == (4 * 2048 + 2 * 2048 + 4, 0)


def _ops(items: tuple[Any, ...] | list[Any]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(list(item.body))
    return out


def test_megatron_trace_allocates_the_fused_kernels_outputs_only() -> None:
    """The final norm of the agreement Llama on a traced Megatron step, 2 x 256 = 512 tokens,
    h = 2048, bf16: the forward makes the output (512 x 2048 x 2 = 2,097,152 B) and the fp32
    rstd (512 x 4 = 2,048 B), the backward the input gradient (2,097,152 B) and the weight's
    new 16-bit gradient (2048 x 2 = 4,096 B); transformers' norm makes fp32 tokens x h
    tensors (4,194,304 B) in both."""
    training = TrainingConfig(micro_batch_size=2, seq_len=256, framework="megatron")
    est = estimate(str(AGREEMENT), training, engine="generic", simulate_allocator=False)
    allocs = [
        (op.phase, op.size_bytes)
        for op in _ops(est.schedules[0].step)
        if op.action == "alloc" and op.module == "model.norm"
    ]
    assert allocs == [
        ("forward", 2_097_152),
        ("forward", 2_048),
        ("backward", 2_097_152),
        ("backward", 4_096),
    ]
