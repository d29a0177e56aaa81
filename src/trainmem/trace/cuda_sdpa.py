"""Route ``F.scaled_dot_product_attention`` to the kernel a CUDA GPU would pick.

Legend: b = micro_batch_size, a = num_heads, a_kv = num_kv_heads, s = seq_len, d = head_dim.

On fake (or real) CPU tensors PyTorch picks the CPU kernels: ``_scaled_dot_product_flash_attention
_for_cpu`` without dropout, the O(s^2) math path with dropout. A CUDA run instead takes
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``, priority
flash > efficient > math; cuDNN first on sm90+, same saved tensors as flash for our purposes):

- fp16/bf16, d <= 256, no explicit mask: **flash** (``_scaled_dot_product_flash_attention``):
  saves out [b, a, s, d] and logsumexp [b, a, s] fp32, plus the philox seed/offset with dropout.
- fp32, or a float/bool mask: **memory-efficient** (``_scaled_dot_product_efficient_attention``):
  out [b, a, s, d] and logsumexp [b, a, ceil(s/32)*32] fp32 (padded to 32 rows:
  ``aten/src/ATen/native/transformers/cuda/attention.cu``, ``kAlignLSE = 32``).
- GQA (a_kv < a, ``enable_gqa=True``): flash supports it natively; the efficient kernel does not,
  so k and v are expanded with ``repeat_interleave`` first (``sdp_utils.cpp``,
  ``check_grouped_query_attention``; math fallback ``attention.cpp``).

The patch replaces the module attribute ``torch.nn.functional.scaled_dot_product_attention``
(and the copies transformers imported), not a ``TorchFunctionMode``: a mode is popped while its
handler runs, so checkpoint recomputation inside ``backward()`` would bypass it
(shared/notes/tracing-without-a-gpu.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()
F = torch.nn.functional

__all__ = ["choose_kernel", "cuda_sdpa", "make_cuda_flex"]

FLASH_MAX_HEAD_DIM = 256
"""Largest head_dim the flash kernel takes (``sdp_utils.cpp``, ``check_head_dim_size_flash``)."""


def choose_kernel(dtype: Any, head_dim: int, has_mask: bool) -> str:
    """Kernel a CUDA GPU (sm80+) would run for SDPA in training.

    Args:
        dtype: dtype of q/k/v after autocast.
        head_dim: d.
        has_mask: an explicit ``attn_mask`` is passed.

    Returns:
        ``"flash"`` or ``"efficient"``.
    """
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_MAX_HEAD_DIM and not has_mask:
        return "flash"
    return "efficient"


def _autocast_dtype() -> Any | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def make_cuda_sdpa(force: str | None = None) -> Callable[..., Any]:
    """Build a drop-in ``scaled_dot_product_attention`` that calls the CUDA kernels' ATen ops.

    Args:
        force: ``"flash"`` to force the flash kernel (HF ``flash_attention_2``), None to choose.

    Returns:
        A function with the signature of ``F.scaled_dot_product_attention``.
    """

    def sdpa(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        lp = _autocast_dtype()
        if lp is not None and not (force == "flash" and query.dtype != torch.float32):
            # CUDA autocast lists scaled_dot_product_attention as lower_precision_fp
            # (aten/src/ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP). flash-attn is on
            # no autocast list: transformers casts q / k / v to autocast's dtype only when q
            # is fp32 (5.24 integrations/flash_attention.py ``get_target_dtype``,
            # modeling_flash_attention_utils.py ``if target_dtype and q.dtype ==
            # torch.float32``) and otherwise runs the 16-bit dtype they come in (an fp16
            # stream under bf16 autocast: Note [A quantized base's other weights in another
            # 16-bit dtype])
            from trainmem.trace.cuda_autocast import cast_for_autocast

            query, key, value = (cast_for_autocast(t, lp) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = cast_for_autocast(attn_mask, lp)
        with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        ):
            d = query.shape[-1]
            kernel = force or choose_kernel(query.dtype, d, attn_mask is not None)
            if kernel == "flash" and (attn_mask is not None or value.shape[-1] != d):
                # flash needs equal q/k/v head dims (aten/src/ATen/native/transformers/cuda/
                # sdp_utils.cpp, check_head_dim_size_flash): DeepSeek's MLA (v 128, qk 192)
                # takes the memory-efficient kernel
                kernel = "efficient"
            if kernel == "flash":
                out = torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale
                )
                return out[0]
            if enable_gqa and key.shape[-3] != query.shape[-3]:
                rep = query.shape[-3] // key.shape[-3]
                key = key.repeat_interleave(rep, dim=-3)
                value = value.repeat_interleave(rep, dim=-3)
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                # sdpa converts a bool mask to an additive float mask first
                # (attention.cpp, convert_boolean_attn_mask)
                attn_mask = torch.where(
                    attn_mask,
                    torch.zeros((), dtype=query.dtype),
                    torch.full((), -math.inf, dtype=query.dtype),
                )
            if attn_mask is not None:
                attn_mask = attn_mask.expand(
                    query.shape[0], query.shape[1], query.shape[2], key.shape[2]
                )
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )
            return out[0]

    return sdpa


def make_cuda_flex(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """A drop-in ``torch.nn.attention.flex_attention.flex_attention`` that runs ``sdpa`` (the
    CUDA kernels' ops of :func:`make_cuda_sdpa`) without the mask.

    Note [FlexAttention as the flash kernel]
        On a GPU FlexAttention runs as a compiled Triton kernel (``torch/_inductor/kernel/
        flex/flex_attention.py``): its forward saves the output [b, a, s, d] and the logsumexp
        [b, a, s] fp32, its backward computes the gradients of q, k, v block by block from them,
        the same tensors as the flash kernel's; a ``BlockMask`` (its block counts and indices,
        built by the model before the call and held by it) or a ``score_mod`` only decides
        which blocks are computed, never what is saved. On CPU PyTorch has no flex backward
        ("FlexAttention does not support backward on CPU"), and its eager forward materialises
        the [b, a, s, s] scores, which a CUDA run compiles away (diffusers warns when
        Kandinsky 6 SR's flex attention is not compiled). So the trace runs the flash kernel's
        ops in its place; the uncompiled eager fallback is not modelled.
    """

    def flex_attention(
        query: Any,
        key: Any,
        value: Any,
        score_mod: Any = None,
        block_mask: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        kernel_options: Any = None,
        **_: Any,
    ) -> Any:
        out = sdpa(query, key, value, scale=scale, enable_gqa=enable_gqa)
        if return_lse:  # the kernel's logsumexp, [b, a, s] fp32
            return out, query.new_empty(query.shape[:-1], dtype=torch.float32)
        return out

    return flex_attention


@contextlib.contextmanager
def cuda_sdpa(force: str | None = None) -> Iterator[None]:
    """Patch ``F.scaled_dot_product_attention`` (and transformers' reference to it) and
    FlexAttention's ``flex_attention`` (Note [FlexAttention as the flash kernel]) for the
    duration of the block.

    Args:
        force: see :func:`make_cuda_sdpa`.

    Yields:
        None.
    """
    original = F.scaled_dot_product_attention
    patched = make_cuda_sdpa(force)
    # transformers calls torch.nn.functional.scaled_dot_product_attention by attribute lookup
    # (transformers/integrations/sdpa_attention.py), so patching F covers it.
    targets: list[tuple[Any, str, Any]] = [(F, "scaled_dot_product_attention", patched)]
    try:  # diffusers calls flex_attention.flex_attention(...) by attribute lookup too
        import torch.nn.attention.flex_attention as flex
    except ImportError:  # pragma: no cover - torch without FlexAttention
        pass
    else:  # Note [FlexAttention as the flash kernel]
        targets.append((flex, "flex_attention", make_cuda_flex(patched)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
    try:
        for obj, name, value in targets:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        assert F.scaled_dot_product_attention is original
