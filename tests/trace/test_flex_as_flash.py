"""FlexAttention on fake tensors runs as the flash kernel a CUDA GPU's compiled flex kernel
matches in saved tensors (trainmem/trace/cuda_sdpa.py, Note [FlexAttention as the flash
kernel]): PyTorch has no CPU backward for it."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trainmem.trace.cuda_sdpa import cuda_sdpa  # noqa: E402


class _Ops(TorchDispatchMode):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[str, list[Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs.setdefault(str(func), []).append(out)
        return out


def test_flex_attention_trains_as_the_flash_kernel_and_is_restored() -> None:
    original = flex.flex_attention
    b, a, s, d = 2, 4, 128, 32
    with FakeTensorMode():
        q, k, v = (torch.randn(b, a, s, d, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        with cuda_sdpa(), _Ops() as ops:
            out = flex.flex_attention(q, k, v)  # diffusers' attribute lookup
            out.float().sum().backward()
    assert flex.flex_attention is original
    assert tuple(out.shape) == (b, a, s, d)
    (fwd,) = ops.outputs["aten._scaled_dot_product_flash_attention.default"]
    logsumexp = fwd[1]  # saved for the backward: [b, a, s] fp32, as the flex kernel's
    assert (tuple(logsumexp.shape), logsumexp.dtype) == ((b, a, s), torch.float32)
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops.outputs
    assert q.grad is not None and tuple(q.grad.shape) == (b, a, s, d)
