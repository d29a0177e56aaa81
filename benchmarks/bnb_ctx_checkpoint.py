"""bitsandbytes' 4-bit inputs under torch's checkpoint, on the CPU (helper bnbrest, issue 24):
what ``MatMul4Bit``'s ``ctx.tensors`` keeps after a checkpointed forward, reentrant and not,
against Note [bitsandbytes' inputs under non-reentrant checkpointing]
(trainmem/analytic/held_outputs.py, :func:`~trainmem.analytic.held_outputs.
checkpoint_held_input_bytes`).

Runs bitsandbytes' own ``nn.Linear4bit.forward``, ``matmul_4bit`` and ``MatMul4Bit`` (install
the release to check in a throwaway venv, e.g. ``pip install --no-deps
bitsandbytes==0.41.3.post2 scipy numpy`` beside a CPU torch); only the CUDA dequantization is
replaced, by an fp16 tensor of the weight's shape (what ``dequantize_4bit`` returns for a
weight quantized from fp16 before 0.43.0). The layer is Qwen-1's block as ms-swift trains it:
an fp16 stream (RMSNorm returning its input's dtype), the fused ``c_attn``, ``c_proj``, ``w1``,
``w2`` and the MLP's ``c_proj`` as 4-bit linears of compute dtype bf16, a trainable adapter on
``c_attn``, the embedding output made to require grad (``enable_input_require_grads``),
each layer under ``torch.utils.checkpoint.checkpoint``. Attention is left out (it saves
through the hooks, and ``c_proj`` reads a tensor of the same shape).

After the forward it walks the graph from the output and sums the inputs that
``MatMul4BitBackward`` nodes keep. Expected: 2 B x t x (4 h + i) per layer non-reentrant
(ms-swift patches torch's checkpoint to ``use_reentrant=False``), nothing reentrant.

Result (2026-11-29, torch 2.13.0+cpu, bitsandbytes 0.41.3.post2, h 64, i 176, 3 layers of
2 x 32 tokens): non-reentrant 165,888 B kept (= 3 layers x 2 B x 64 tokens x (4 x 64 + 176)),
reentrant 0.

``--int8``: the same block with bitsandbytes' ``Linear8bitLt`` (``has_fp16_weights=False``,
threshold 6.0) against Note [bitsandbytes' int8 inputs under non-reentrant checkpointing].
Needs a bitsandbytes whose int8 runs on the CPU (0.49.2: its default ops; the modules in eval
mode, as ``bnb.matmul`` sends a training CPU input to ``MatMul8bitFp`` instead, a frozen int8
weight being the same otherwise). Sums the distinct storages of the ``MatMul8bitLtBackward``
nodes' ``ctx.tensors``. Expected: each input kept once, as given (fp16, no cast): 2 B x t x
(3 h + i) per layer non-reentrant (c_attn's normed input, c_proj's, w1 / w2's one normed input,
the MLP's c_proj's), no ``CAt`` (from 0.45.0), nothing reentrant.

Result (2026-11-29, torch 2.13.0+cpu, bitsandbytes 0.49.2, the same shapes): non-reentrant
141,312 B kept (= 3 x 2 B x 64 x (3 x 64 + 176)), reentrant 0.

    python benchmarks/bnb_ctx_checkpoint.py [--int8]
"""

from __future__ import annotations

import sys
import types
from typing import Any

H, INTER, LAYERS, B, S = 64, 176, 3, 2, 32


def _build(torch: Any, bnb: Any, int8: bool = False) -> Any:
    functional = bnb.functional

    def dequantize_4bit(packed: Any, quant_state: Any = None, *args: Any, **kw: Any) -> Any:
        out = torch.randn(quant_state.shape, dtype=torch.float16) * 0.02
        # the packed weight comes transposed, (1, n / 2): dequantize_4bit then returns out.t()
        return out.t() if packed.shape[0] == 1 else out

    functional.dequantize_4bit = dequantize_4bit  # the CUDA kernel's stand-in

    def linear4bit(fan_in: int, fan_out: int, bias: bool = False) -> Any:
        if int8:
            return linear8bit(fan_in, fan_out, bias)
        module = bnb.nn.Linear4bit(
            fan_in, fan_out, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4"
        )
        packed = torch.zeros(fan_in * fan_out // 2, 1, dtype=torch.uint8)
        module.weight = bnb.nn.Params4bit(packed, requires_grad=False)
        module.weight.quant_state = types.SimpleNamespace(shape=torch.Size([fan_out, fan_in]))
        if bias:
            module.bias = torch.nn.Parameter(torch.zeros(fan_out, dtype=torch.float16), False)
        return module

    def linear8bit(fan_in: int, fan_out: int, bias: bool) -> Any:
        module = bnb.nn.Linear8bitLt(
            fan_in, fan_out, bias=bias, has_fp16_weights=False, threshold=6.0
        )
        weight = torch.randn(fan_out, fan_in, dtype=torch.float16) * 0.02
        module.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        if bias:
            module.bias = torch.nn.Parameter(torch.zeros(fan_out, dtype=torch.float16), False)
        return module.to("cpu").eval()  # Int8Params quantizes on the move

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = linear4bit(H, 3 * H, bias=True)
            self.lora = torch.nn.Linear(H, 3 * H, bias=False).half()
            self.c_proj = linear4bit(H, H)
            self.w1, self.w2 = linear4bit(H, INTER), linear4bit(H, INTER)
            self.mlp_c_proj = linear4bit(INTER, H)

        @staticmethod
        def norm(x: Any) -> Any:  # Qwen-1's RMSNorm: fp32 math, the input's dtype out
            y = x.float()
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)

        def forward(self, x: Any) -> Any:
            normed = self.norm(x)
            qkv = self.c_attn(normed) + self.lora(normed)
            context = qkv[..., :H] * qkv[..., H : 2 * H]  # stands for attention: (b, s, h)
            x = x + self.c_proj(context)
            normed = self.norm(x)
            return x + self.mlp_c_proj(self.w1(normed) * torch.nn.functional.silu(self.w2(normed)))

    return torch.nn.ModuleList(Block() for _ in range(LAYERS))


def kept_bytes(torch: Any, blocks: Any, reentrant: bool) -> int:
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(B, S, H, dtype=torch.float16).requires_grad_(True)  # the embedding hook
    h = x
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=reentrant)
    seen, stack, total = set(), [h.grad_fn], 0
    storages: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name in ("MatMul4BitBackward", "MatMul8bitLtBackward"):
            # (A, B): A, B being the packed weight; (CAt, subA, A); storages counted once
            for a in node.tensors[:1] if name == "MatMul4BitBackward" else node.tensors:
                if a is None or a.untyped_storage().data_ptr() in storages:
                    continue
                storages.add(a.untyped_storage().data_ptr())
                total += a.untyped_storage().nbytes() if a.numel() else 0
        stack.extend(fn for fn, _ in node.next_functions)
    h.float().sum().backward()
    return total


def main() -> None:
    from importlib.metadata import version

    import bitsandbytes as bnb
    import torch

    torch.manual_seed(0)
    int8 = "--int8" in sys.argv
    blocks = _build(torch, bnb, int8)
    expected = LAYERS * 2 * B * S * ((3 if int8 else 4) * H + INTER)
    print(f"torch {torch.__version__}, bitsandbytes {version('bitsandbytes')}")
    print(f"non-reentrant: {kept_bytes(torch, blocks, False):,} B kept (expected {expected:,})")
    print(f"reentrant: {kept_bytes(torch, blocks, True):,} B kept (expected 0)")


if __name__ == "__main__":
    main()
