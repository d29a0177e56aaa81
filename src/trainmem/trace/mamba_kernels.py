"""Stand-ins for the Mamba CUDA kernels, so the traced step takes transformers' kernel path.

Legend: b = micro_batch_size, l = seq_len, d = the mixer's intermediate size (d_inner),
n = ssm_state_size (d_state), r = time_step_rank, w = conv_kernel, e = hidden_size,
c = ceil(l / 2048), the selective scan's chunks.

Note [Traced Mamba kernels]
    transformers 5.24 resolves each Mamba op once, at import, to the CUDA package when it
    imports (``integrations/hub_kernels.py`` ``use_kernel_func_from_hub_with_fallback``:
    "1. Hf kernels 2. Original package 3. Torch only path"), else to its own PyTorch reference.
    A user's GPU run has ``mamba_ssm`` and ``causal_conv1d``; the trace does not, so without
    this module it runs the reference: a Python loop over l whose per-step products autograd
    keeps, minutes of tracing and bytes no GPU run holds. During the trace the modeling
    modules' names are pointed at :class:`torch.autograd.Function` stand-ins that allocate,
    save and free what the kernels do, with ``torch.empty`` / ``torch.zeros`` in place of each
    CUDA launch and the kernels' own PyTorch glue (reshapes, ``.contiguous()`` copies, the
    projections inside ``mamba_inner_fn``) run as written. Sources: state-spaces/mamba at
    e9594ce1c732d97440f0332fdc43170a2294dbfa, Dao-AILab/causal-conv1d at
    0d2252d161f25f7907bbd05985c08ab98d255874.

    - ``selective_scan_fn`` (mamba_ssm/ops/selective_scan_interface.py ``SelectiveScanFn``;
      csrc/selective_scan/selective_scan.cpp ``selective_scan_fwd`` / ``_bwd``): u, delta, B, C
      and z are made contiguous in the last dimension first; the forward allocates
      out = empty_like(delta), the chunk states x [b, d, c, 2n] in A's dtype (fp32) and
      out_z = empty_like(z); it saves u, delta, A, B, C, D, z, delta_bias, x and out (the
      ungated output) and returns out_z. The backward allocates du, ddelta (empty_like),
      dA, dD, ddelta_bias (zeros_like), dB / dC as fp32 zeros cast back to B / C's dtype, and
      dz = empty_like(z).
    - ``causal_conv1d_fn`` (causal_conv1d/causal_conv1d_interface.py ``CausalConv1dFn``,
      causal_conv1d/cpp_functions.py): the forward allocates out = empty_like(x) and saves x,
      weight, bias; the backward allocates dx = empty_like(x) and dweight / dbias as fp32
      zeros cast to the weight's dtype (the deterministic-mode workspaces are not modelled).
    - ``mamba_inner_fn`` (``MambaInnerFn``, checkpoint_lvl 1, what transformers' Mamba and
      FalconMamba call in training): under autocast it casts x_proj, dt_proj and out_proj
      weights (and out_proj's bias) to the autocast dtype itself; it runs the conv (out
      [b, d, l]), x_dbl = x_proj(conv_out) [b*l, r + 2n], delta = dt_proj [b, d, l] (a view of
      [d, b*l]), B and C as contiguous [b, 1, n, l] copies, optional RMS norms on B, C, delta
      (``_layer_norm_fwd``: y = empty_like), then the scan; conv_out and delta are dropped
      (recomputed in the backward) and it saves xz, the weights (the 16-bit copies under
      autocast), x_dbl, A, B, C, D, delta_bias, x [b, d, c, 2n] fp32 and out [b, d, l]. The
      output is out_proj(out_z). Its backward recomputes conv_out and delta, allocates dxz
      = empty_like(xz) (the scan writes dz and the conv's dx into its halves), dx_dbl
      = empty_like(x_dbl) and the weight gradients.

    Known limitations: the Mamba2 kernels (``mamba_chunk_scan_combined``,
    ``mamba_split_conv1d_scan_combined``, Triton) are not stood in yet, so Mamba2, Bamba,
    Zamba2, GraniteMoeHybrid, FalconH1 and NemotronH still trace transformers' chunked PyTorch
    reference; dtype checks of the kernels are not repeated.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MAMBA1_MODULES", "mamba_kernels"]

SCAN_CHUNK = 2048
"""Sequence positions per chunk of the selective scan's saved states
(csrc/selective_scan/selective_scan.cpp: ``n_chunks = (seqlen + 2048 - 1) / 2048``)."""

MAMBA1_MODULES = ("mamba", "falcon_mamba", "jamba", "zamba")
"""transformers model types whose modeling module calls the Mamba-1 kernels by name."""


def _last_dim_contiguous(t: Any) -> Any:
    # the kernels' wrappers copy an operand whose last dimension is strided
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _autocast_dtype() -> Any | None:
    # the trace runs CUDA's autocast policy on the CPU key (trainmem.trace.cuda_autocast)
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


# ---- the CUDA launches: what each allocates ---------------------------------------------------


def _scan_fwd(u: Any, delta: Any, A: Any, z: Any) -> tuple[Any, Any, Any]:
    """``selective_scan_cuda.fwd``: out, x [b, d, c, 2n] in A's dtype, out_z (or None)."""
    b, d, l_ = u.shape
    n = A.shape[1]
    out = torch.empty_like(delta)
    x = torch.empty(b, d, -(-l_ // SCAN_CHUNK), 2 * n, dtype=A.dtype, device=u.device)
    out_z = torch.empty_like(z) if z is not None else None
    return out, x, out_z


def _scan_bwd(
    u: Any, delta: Any, A: Any, B: Any, C: Any, D: Any, z: Any, delta_bias: Any, dout: Any,
    out: Any, dz: Any, recompute_out_z: bool,
) -> tuple[Any, ...]:  # fmt: skip
    """``selective_scan_cuda.bwd``: du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, out_z (dout
    [b, d, l] is read only)."""
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dA = torch.zeros_like(A)
    # variable B / C: accumulated in fp32, returned in their own dtype
    dB = torch.zeros_like(B, dtype=torch.float32).to(B.dtype)
    dC = torch.zeros_like(C, dtype=torch.float32).to(C.dtype)
    dD = torch.zeros_like(D) if D is not None else None
    ddelta_bias = torch.zeros_like(delta_bias) if delta_bias is not None else None
    if z is not None and dz is None:
        dz = torch.empty_like(z)
    out_z = torch.empty_like(out) if z is not None and recompute_out_z else None
    return du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, out_z


def _conv_fwd(x: Any) -> Any:
    """``causal_conv1d_fwd_function``: out = empty_like(x)."""
    return torch.empty_like(x)


def _conv_bwd(x: Any, weight: Any, bias: Any, dx: Any = None) -> tuple[Any, Any, Any]:
    """``causal_conv1d_bwd_function``: dx, and dweight / dbias accumulated in fp32."""
    if dx is None:
        dx = torch.empty_like(x)
    dweight = torch.zeros_like(weight, dtype=torch.float32).type_as(weight)
    dbias = torch.zeros_like(bias, dtype=torch.float32).type_as(bias) if bias is not None else None
    return dx, dweight, dbias


def _rms_norm(x: Any) -> Any:
    """mamba_ssm ``rms_norm_forward`` -> ``_layer_norm_fwd``: y = empty_like(x) (its fp32
    rstd [rows] is dropped on return)."""
    x = _last_dim_contiguous(x)
    y = torch.empty_like(x)
    del x
    return y


def _rms_rows(t: Any, rows_last: bool, L: int) -> Any:
    """RMS-norm B or C [b, 1, n, l] (rows_last) or delta [b, d, l] over its last-but-one
    dimension, through the (b l) x features layout the kernel normalizes in."""
    if rows_last:
        b, _, n, _ = t.shape
        flat = t.permute(0, 3, 1, 2).reshape(b * L, n).contiguous()
        return _rms_norm(flat).reshape(b, L, 1, n).permute(0, 2, 3, 1).contiguous()
    b, d, _ = t.shape
    flat = t.transpose(1, 2).reshape(b * L, d).contiguous()
    return _rms_norm(flat).reshape(b, L, d).transpose(1, 2).contiguous()


# ---- the autograd functions --------------------------------------------------------------------


class SelectiveScan(torch.autograd.Function):
    """mamba_ssm ``SelectiveScanFn`` (Note [Traced Mamba kernels])."""

    @staticmethod
    def forward(
        ctx: Any, u: Any, delta: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
        delta_bias: Any = None, delta_softplus: bool = False, return_last_state: bool = False,
    ) -> Any:  # fmt: skip
        u, delta, B, C, z = (_last_dim_contiguous(t) for t in (u, delta, B, C, z))
        D = D.contiguous() if D is not None else None
        squeeze_b, squeeze_c = B.dim() == 3, C.dim() == 3
        if squeeze_b:
            B = B.unsqueeze(1)
        if squeeze_c:
            C = C.unsqueeze(1)
        out, x, out_z = _scan_fwd(u, delta, A, z)
        ctx.squeeze = (squeeze_b, squeeze_c)
        ctx.has_z = z is not None
        last_state = x[:, :, -1, 1::2]  # [b, d, n]
        if z is None:
            ctx.save_for_backward(u, delta, A, B, C, D, delta_bias, x)
            result = out
        else:
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out)
            result = out_z
        return (result, last_state) if return_last_state else result

    @staticmethod
    def backward(ctx: Any, dout: Any, *_: Any) -> Any:
        if ctx.has_z:
            u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
        else:
            u, delta, A, B, C, D, delta_bias, x = ctx.saved_tensors
            z = out = None
        dout = _last_dim_contiguous(dout)
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, _ = _scan_bwd(
            u, delta, A, B, C, D, z, delta_bias, dout, out, None, False
        )
        if ctx.squeeze[0]:
            dB = dB.squeeze(1)
        if ctx.squeeze[1]:
            dC = dC.squeeze(1)
        return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, None, None


class CausalConv1d(torch.autograd.Function):
    """causal_conv1d ``CausalConv1dFn`` without initial / final states (Note [Traced Mamba
    kernels])."""

    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, bias: Any = None) -> Any:
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = _conv_fwd(x)
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Any) -> Any:
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = _conv_bwd(x, weight, bias)
        return dx, dweight, dbias if bias is not None else None


class MambaInner(torch.autograd.Function):
    """mamba_ssm ``MambaInnerFn`` with checkpoint_lvl 1 and input-dependent B and C (Note
    [Traced Mamba kernels])."""

    @staticmethod
    def forward(
        ctx: Any, xz: Any, conv1d_weight: Any, conv1d_bias: Any, x_proj_weight: Any,
        delta_proj_weight: Any, out_proj_weight: Any, out_proj_bias: Any, A: Any, D: Any,
        delta_bias: Any, delta_softplus: bool, rms_weights: tuple[Any, Any, Any],
    ) -> Any:  # fmt: skip
        L = xz.shape[-1]
        r = delta_proj_weight.shape[1]
        n = A.shape[-1]
        lp = _autocast_dtype()
        ctx.autocast = lp
        if lp is not None:  # torch.amp.custom_fwd keeps autocast on; the casts are the kernel's
            x_proj_weight = x_proj_weight.to(lp)
            delta_proj_weight = delta_proj_weight.to(lp)
            out_proj_weight = out_proj_weight.to(lp)
            out_proj_bias = out_proj_bias.to(lp) if out_proj_bias is not None else None
        xz = _last_dim_contiguous(xz)
        conv1d_weight = conv1d_weight.squeeze(1)  # [d, w]
        x, z = xz.chunk(2, dim=1)
        conv1d_bias = conv1d_bias.contiguous() if conv1d_bias is not None else None
        conv_out = _conv_fwd(x)
        x_dbl = torch.nn.functional.linear(
            conv_out.transpose(1, 2).reshape(-1, x.shape[1]), x_proj_weight
        )
        delta = (delta_proj_weight @ x_dbl[:, :r].t()).view(-1, xz.shape[0], L).transpose(0, 1)
        B = x_dbl[:, r : r + n].reshape(-1, L, 1, n).permute(0, 2, 3, 1).contiguous()
        C = x_dbl[:, -n:].reshape(-1, L, 1, n).permute(0, 2, 3, 1).contiguous()
        D = D.contiguous() if D is not None else None
        b_rms, c_rms, dt_rms = rms_weights
        if b_rms is not None:
            B = _rms_rows(B, True, L)
        if c_rms is not None:
            C = _rms_rows(C, True, L)
        if dt_rms is not None:
            delta = _rms_rows(delta, False, L)
        out, scan_states, out_z = _scan_fwd(conv_out, delta, A, z)
        ctx.rms = tuple(w is not None for w in rms_weights)
        ctx.has_out_bias = out_proj_bias is not None
        ctx.has_conv_bias = conv1d_bias is not None
        del conv_out, delta  # checkpoint_lvl 1: recomputed in the backward
        ctx.save_for_backward(
            xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
            out_proj_weight, A, B, C, D, delta_bias, scan_states, out,
        )  # fmt: skip
        return torch.nn.functional.linear(out_z.transpose(1, 2), out_proj_weight, out_proj_bias)

    @staticmethod
    def backward(ctx: Any, dout: Any) -> Any:
        enabled = ctx.autocast is not None
        dtype = ctx.autocast if enabled else torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):  # torch.amp.custom_bwd
            return MambaInner._backward(ctx, dout)

    @staticmethod
    def _backward(ctx: Any, dout: Any) -> Any:
        (xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
         out_proj_weight, A, B, C, D, delta_bias, scan_states, out) = ctx.saved_tensors  # fmt: skip
        L = xz.shape[-1]
        r = delta_proj_weight.shape[1]
        n = A.shape[-1]
        b = xz.shape[0]
        x, z = xz.chunk(2, dim=1)
        dout = _last_dim_contiguous(dout)
        # checkpoint_lvl 1: the conv and delta (and their norms) again
        conv_out = _conv_fwd(x)
        delta = (delta_proj_weight @ x_dbl[:, :r].t()).view(-1, b, L).transpose(0, 1)
        if ctx.rms[2]:
            delta = _rms_rows(delta, False, L)
        if ctx.rms[0]:
            B = _rms_rows(B, True, L)
        if ctx.rms[1]:
            C = _rms_rows(C, True, L)
        dxz = torch.empty_like(xz)
        dx, dz = dxz.chunk(2, dim=1)
        dout = dout.reshape(-1, dout.shape[-1]).t()  # [e, b*l]
        dout_y = (out_proj_weight.t() @ dout).view(-1, b, L).transpose(0, 1)
        dconv_out, ddelta, dA, dB, dC, dD, ddelta_bias, dz, out_z = _scan_bwd(
            conv_out, delta, A, B, C, D, z, delta_bias, dout_y, out, dz, True
        )
        dout_proj_weight = torch.einsum(
            "eB,dB->ed", dout, out_z.transpose(0, 1).reshape(out_z.shape[1], -1)
        )
        dout_proj_bias = dout.sum(dim=1) if ctx.has_out_bias else None
        dx_dbl = torch.empty_like(x_dbl)
        dx_dbl[:, r : r + n] = dB.permute(0, 3, 1, 2).reshape(-1, n).contiguous()
        dx_dbl[:, -n:] = dC.permute(0, 3, 1, 2).reshape(-1, n).contiguous()
        del dB, dC
        ddelta = ddelta.transpose(0, 1).reshape(ddelta.shape[1], -1)  # [d, b*l]
        ddelta_proj_weight = torch.einsum("dB,Br->dr", ddelta, x_dbl[:, :r])
        dx_dbl[:, :r] = torch.einsum("dB,dr->Br", ddelta, delta_proj_weight)
        dconv_out = dconv_out.transpose(0, 1).reshape(dconv_out.shape[1], -1)  # [d, b*l]
        conv_rows = conv_out.transpose(1, 2).reshape(-1, conv_out.shape[1])
        dx_proj_weight = torch.einsum("Br,Bd->rd", dx_dbl, conv_rows)
        del conv_rows
        dconv_out = torch.addmm(dconv_out, x_proj_weight.t(), dx_dbl.t(), out=dconv_out)
        dconv_out = dconv_out.view(-1, b, L).transpose(0, 1)
        _, dconv_weight, dconv_bias = _conv_bwd(x, conv1d_weight, conv1d_bias, dx)
        return (
            dxz, dconv_weight.unsqueeze(1), dconv_bias if ctx.has_conv_bias else None,
            dx_proj_weight, ddelta_proj_weight, dout_proj_weight, dout_proj_bias,
            dA, dD, ddelta_bias if delta_bias is not None else None, None, None,
        )  # fmt: skip


# ---- the names transformers' modeling modules call -------------------------------------------


def selective_scan_fn(
    u: Any, delta: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
    delta_bias: Any = None, delta_softplus: bool = False, return_last_state: bool = False,
    **_: Any,
) -> Any:  # fmt: skip
    """mamba_ssm ``selective_scan_fn``; transformers' extra keywords (``use_mambapy``...) are
    dropped as its wrapper drops them for the kernel."""
    return SelectiveScan.apply(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state
    )


def causal_conv1d_fn(
    x: Any, weight: Any, bias: Any = None, seq_idx: Any = None, activation: str | None = None,
    **_: Any,
) -> Any:  # fmt: skip
    """causal_conv1d ``causal_conv1d_fn`` [b, d, l] -> [b, d, l], weight [d, w]."""
    return CausalConv1d.apply(x, weight, bias)


def mamba_inner_fn(
    xz: Any, conv1d_weight: Any, conv1d_bias: Any, x_proj_weight: Any, delta_proj_weight: Any,
    out_proj_weight: Any, out_proj_bias: Any, A: Any, B: Any = None, C: Any = None, D: Any = None,
    delta_bias: Any = None, delta_softplus: bool = True, b_rms_weight: Any = None,
    c_rms_weight: Any = None, dt_rms_weight: Any = None, **_: Any,
) -> Any:  # fmt: skip
    """mamba_ssm ``mamba_inner_fn`` with input-dependent B and C (B = C = None), the only way
    transformers calls it."""
    assert B is None and C is None, "transformers passes input-dependent B and C"
    return MambaInner.apply(
        xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
        out_proj_bias, A, D, delta_bias, delta_softplus,
        (b_rms_weight, c_rms_weight, dt_rms_weight),
    )  # fmt: skip


_STAND_INS = {
    "mamba_inner_fn": mamba_inner_fn,
    "mamba_selective_scan": selective_scan_fn,
    "causal_conv1d_fn": causal_conv1d_fn,
}


@contextlib.contextmanager
def mamba_kernels() -> Iterator[None]:
    """Point the loaded Mamba-1 modeling modules of transformers at the kernel stand-ins
    (Note [Traced Mamba kernels]) for the duration of the block.

    Yields:
        None.
    """
    saved: list[tuple[Any, str, Any]] = []
    for model_type in MAMBA1_MODULES:
        name = f"transformers.models.{model_type}.modeling_{model_type}"
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, stand_in in _STAND_INS.items():
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, stand_in)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
