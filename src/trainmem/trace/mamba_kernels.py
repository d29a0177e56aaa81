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
    - ``mamba_split_conv1d_scan_combined`` (mamba_ssm/ops/triton/ssd_combined.py
      ``MambaSplitConv1dScanCombinedFn``, what transformers' Mamba2 mixers call in training
      without a cache; h = heads, p = head
      dim, g = groups, cs = chunk_size, nc = ceil(l / cs)): the conv over the xBC channels
      (a copy first unless its row stride is a multiple of 8, ``ensure_stride``), the chunked
      scan (``_mamba_chunk_scan_combined_fwd``: dt_out and dA_cumsum [b, h, nc, cs] fp32, the
      chunk states [b, nc, h, p, n] fp32 then passed in C's dtype, final states [b, h, p, n]
      fp32, CB [b, nc, g, cs, cs] fp32, out [b, l, h, p]), the gated RMSNorm
      (layernorm_gated.py ``_layer_norm_fwd``: y = empty_like, rstd [g * b * l] fp32) and
      out_proj (its weight cast by the kernel under autocast); it saves zxbcdt (in_proj's
      output itself), the scan output [b, l, h, p] before the norm, A, D, dt_bias, the norm's
      weight and rstd, and out_proj's weight (the 16-bit copy under autocast). Its backward
      recomputes the conv and the output, allocates dzxbcdt = empty_like(zxbcdt), dxBC, the
      norm's dx, the scan's recomputed chunk sums, CB, states and their gradients.
    - ``mamba_chunk_scan_combined`` (``MambaChunkScanCombinedFn``, what the hybrids call when
      the model made a cache, as Zamba2, FalconH1 and NemotronH do with ``use_cache``): the
      chunked scan above; it saves out (out_x with z), x, dt, dA_cumsum, A, B, C, D, z,
      dt_bias as passed.

    Known limitations: buffers whose size depends on the GPU or on Triton's autotuning are not
    modelled (the layer-norm backward's per-SM dw rows, the scan backward's split dB / dC / dD
    partial sums, the deterministic-mode conv workspaces), nor a ``d_nonssm`` SwiGLU's own
    backward buffers; the kernels' dtype checks are not repeated. Under ``--compile`` the
    trace's AOTAutograd traces through the stand-ins and its partitioner chooses what they
    keep, where dynamo would break the graph at the CUDA extension and run the kernel's
    autograd function eagerly (Note [Tracing torch.compile]): not modelled yet.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["MAMBA_MODULES", "causal_conv1d_fn", "mamba_kernels", "point_module_names"]

SCAN_CHUNK = 2048
"""Sequence positions per chunk of the selective scan's saved states
(csrc/selective_scan/selective_scan.cpp: ``n_chunks = (seqlen + 2048 - 1) / 2048``)."""

MAMBA_MODULES = (
    "mamba", "falcon_mamba", "jamba", "zamba",
    "mamba2", "bamba", "zamba2", "granitemoehybrid", "falcon_h1", "nemotron_h",
)  # fmt: skip
"""transformers model types whose modeling module calls the Mamba kernels by name (the first
four Mamba-1's, the others Mamba-2's)."""


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


def _ensure_stride(t: Any) -> Any:
    """ssd_combined.py ``ensure_stride``: a copy unless stride(1) is a multiple of 8."""
    return t if t.stride(1) % 8 == 0 else t.contiguous()


def _ssd_fwd(x: Any, dt: Any, B: Any, C: Any, chunk_size: int, z: Any) -> tuple[Any, ...]:
    """``_mamba_chunk_scan_combined_fwd``: out, out_x (with z), dt_out, dA_cumsum, states,
    final_states; its B / C copies and the chunk products CB are dropped on return."""
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    B, C = _last_dim_contiguous(B), _last_dim_contiguous(C)
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    nc = -(-s // chunk_size)
    f32 = {"dtype": torch.float32, "device": x.device}
    dt_out = torch.empty(b, h, nc, chunk_size, **f32)  # _chunk_cumsum_fwd
    dA_cumsum = torch.empty(b, h, nc, chunk_size, **f32)
    states = torch.empty(b, nc, h, p, n, **f32)  # _chunk_state_fwd, states_in_fp32
    # _state_passing_fwd: the passed states in C's dtype, the final states fp32
    states = torch.empty(b, nc, h, p * n, dtype=C.dtype, device=x.device).view(b, nc, h, p, n)
    final_states = torch.empty(b, h, p * n, **f32).view(b, h, p, n)
    cb = torch.empty(b, nc, g, chunk_size, chunk_size, **f32)  # _bmm_chunk_fwd
    out = torch.empty(b, s, h, p, dtype=x.dtype, device=x.device)  # _chunk_scan_fwd
    out_x = torch.empty(b, s, h, p, dtype=x.dtype, device=x.device) if z is not None else None
    del cb, B, C
    return out, out_x, dt_out, dA_cumsum, states, final_states


def _ssd_bwd(
    x: Any, dt: Any, B: Any, chunk_size: int, dout: Any, dx: Any, A: Any, D: Any, dt_bias: Any
) -> tuple[Any, Any, Any]:
    """The allocations of ``_mamba_chunk_scan_combined_bwd`` fixed by the shapes alone (dx,
    dB, dC and ddt are written into the caller's buffers); returns dA, dD, ddt_bias."""
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dout = _last_dim_contiguous(dout)
    nc = -(-s // chunk_size)
    f32 = {"dtype": torch.float32, "device": x.device}
    dt_in = dt.clone()
    dA_cumsum = torch.empty(b, h, nc, chunk_size, **f32)  # the forward's chunk sums again
    dt_out = torch.empty(b, h, nc, chunk_size, **f32)
    cb = torch.empty(b, nc, g, chunk_size, chunk_size, **f32)
    states = torch.empty(b, nc, h, p, n, **f32)
    states = torch.empty(b, nc, h, p * n, **f32)  # _state_passing_fwd, fp32 out
    dstates = torch.empty(b, nc, h, p, n, **f32)  # _chunk_scan_bwd_dstates
    # _state_passing_bwd: dstates and the states converted to x's dtype
    dstates = torch.empty(b, nc, h, p * n, dtype=x.dtype, device=x.device)
    states = torch.empty(b, nc, h, p * n, dtype=x.dtype, device=x.device)
    ddt = torch.empty(b, h, nc, chunk_size, **f32)  # _chunk_scan_chunk_state_bwd_dx
    dcb = torch.empty(b, nc, g, chunk_size, chunk_size, **f32)  # _chunk_scan_bwd_dcb
    ddA = torch.empty(b, h, nc, chunk_size, **f32)  # _chunk_scan_bwd_ddAcs_stable
    del dcb, ddt, dstates, states, cb, dt_out, dA_cumsum, dt_in, dout, ddA
    dA = torch.empty_like(A, dtype=torch.float32)  # _chunk_cumsum_bwd
    ddt_bias = torch.empty_like(dt_bias, dtype=torch.float32)
    dD = torch.zeros(D.shape, **f32).to(D.dtype)
    return dA, dD, ddt_bias


class ChunkScan(torch.autograd.Function):
    """mamba_ssm ``MambaChunkScanCombinedFn`` (Note [Traced Mamba kernels])."""

    @staticmethod
    def forward(
        ctx: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, z: Any, dt_bias: Any,
        initial_states: Any, chunk_size: int, return_final_states: bool,
    ) -> Any:  # fmt: skip
        out, out_x, _, dA_cumsum, _, final_states = _ssd_fwd(x, dt, B, C, chunk_size, z)
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(
            out if z is None else out_x, x, dt, dA_cumsum, A, B, C, D, z, dt_bias, initial_states
        )
        return (out, final_states) if return_final_states else out

    @staticmethod
    def backward(ctx: Any, dout: Any, *_: Any) -> Any:
        out, x, dt, dA_cumsum, A, B, C, D, z, dt_bias, initial_states = ctx.saved_tensors
        # _mamba_chunk_scan_combined_bwd without given buffers allocates its gradients
        dx, dB, dC, ddt = (torch.empty_like(t) for t in (x, B, C, dt))
        dz = torch.empty_like(z) if z is not None else None
        dinitial = torch.empty_like(initial_states) if initial_states is not None else None
        dA, dD, ddt_bias = _ssd_bwd(x, dt, B, ctx.chunk_size, dout, dx, A, D, dt_bias)
        return (
            dx, ddt, dA, dB, dC, dD if D is not None else None, dz,
            ddt_bias if dt_bias is not None else None, dinitial, None, None,
        )  # fmt: skip


class SplitConv1dScan(torch.autograd.Function):
    """mamba_ssm ``MambaSplitConv1dScanCombinedFn`` (Note [Traced Mamba kernels])."""

    @staticmethod
    def forward(
        ctx: Any, zxbcdt: Any, conv1d_weight: Any, conv1d_bias: Any, dt_bias: Any, A: Any,
        D: Any, rmsnorm_weight: Any, outproj_weight: Any, outproj_bias: Any,
        meta: tuple[int, int, int, bool],
    ) -> Any:  # fmt: skip
        chunk_size, headdim, ngroups, _ = meta
        h = D.shape[0]
        dim = h * headdim
        n = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * n - h) // 2
        bsz, s, _ = zxbcdt.shape
        zx0, z, xbc, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * n, h], -1)
        xbc_conv = _conv_fwd(_ensure_stride(xbc).transpose(1, 2)).transpose(1, 2)
        x, B, C = torch.split(xbc_conv, [dim, ngroups * n, ngroups * n], dim=-1)
        x = x.unflatten(-1, (h, headdim))
        B, C = B.unflatten(-1, (ngroups, n)), C.unflatten(-1, (ngroups, n))
        z4 = z.unflatten(-1, (h, headdim))
        rstd = None
        if rmsnorm_weight is None:
            out, out_x, *_kept = _ssd_fwd(x, dt, B, C, chunk_size, z4)
            out = out.flatten(-2)
            if d_nonssm > 0:  # _swiglu_fwd(zx0): [b, s, d_nonssm]
                out = torch.cat([torch.empty_like(zx0[..., :d_nonssm]), out], dim=-1)
        else:
            out_x, _, *_kept = _ssd_fwd(x, dt, B, C, chunk_size, None)
            x_rms = out_x.reshape(bsz * s, dim)
            rmsnorm_weight = rmsnorm_weight.contiguous()
            # layernorm_gated.py _layer_norm_fwd: y = empty_like(x), rstd [ngroups * rows] fp32
            if d_nonssm == 0:
                out = torch.empty_like(x_rms).view(bsz, s, dim)
            else:
                out = torch.empty(bsz, s, d_nonssm + dim, dtype=x_rms.dtype, device=x_rms.device)
            rstd = torch.empty(ngroups * bsz * s, dtype=torch.float32, device=x_rms.device)
        if outproj_weight is not None:
            lp = _autocast_dtype()
            if lp is not None:  # the kernel casts under autocast itself
                out, outproj_weight = out.to(lp), outproj_weight.to(lp)
                outproj_bias = outproj_bias.to(lp) if outproj_bias is not None else None
            out = torch.nn.functional.linear(out, outproj_weight, outproj_bias)
        ctx.meta = meta
        ctx.has = (conv1d_bias is not None, rmsnorm_weight is not None, outproj_bias is not None)
        ctx.autocast = _autocast_dtype()
        ctx.save_for_backward(
            zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, rmsnorm_weight, rstd,
            outproj_weight, outproj_bias,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx: Any, dout: Any) -> Any:
        enabled = ctx.autocast is not None
        dtype = ctx.autocast if enabled else torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):  # torch.amp.custom_bwd
            return SplitConv1dScan._backward(ctx, dout)

    @staticmethod
    def _backward(ctx: Any, dout: Any) -> Any:
        (zxbcdt, conv1d_weight, conv1d_bias, out, A, D, dt_bias, rmsnorm_weight, rstd,
         outproj_weight, outproj_bias) = ctx.saved_tensors  # fmt: skip
        chunk_size, headdim, ngroups, _ = ctx.meta
        h = D.shape[0]
        dim = h * headdim
        n = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * n - h) // 2
        bsz, s = out.shape[:2]
        out_recompute = None
        if outproj_weight is not None:
            out_recompute = torch.empty(bsz, s, d_nonssm + dim, dtype=out.dtype, device=out.device)
        splits = [2 * d_nonssm, dim, dim + 2 * ngroups * n, h]
        _, z, xbc, dt = torch.split(zxbcdt, splits, dim=-1)
        xbc_conv = _conv_fwd(_ensure_stride(xbc).transpose(1, 2)).transpose(1, 2)
        x, B, _ = torch.split(xbc_conv, [dim, ngroups * n, ngroups * n], dim=-1)
        x, B = x.unflatten(-1, (h, headdim)), B.unflatten(-1, (ngroups, n))
        dzxbcdt = torch.empty_like(zxbcdt)
        _, dz, dxbc_given, _ = torch.split(dzxbcdt, splits, dim=-1)
        dxbc = torch.empty_like(xbc)
        dx = dxbc[..., :dim].unflatten(-1, (h, headdim))
        dout_og = dout
        if outproj_weight is not None:
            dout = torch.nn.functional.linear(dout, outproj_weight.t())
        if d_nonssm > 0:
            dout = dout[..., d_nonssm:]
        drmsnorm_weight = None
        if rmsnorm_weight is not None:
            # layernorm_gated.py _layer_norm_bwd: dx = empty_like(x), dz written in place,
            # dw summed from per-program fp32 rows (their SM-count-sized buffer not modelled)
            dy_rms = dout  # noqa: F841 - held, as the kernel's local, to the end
            dout = torch.empty(bsz * s, dim, dtype=out.dtype, device=out.device)
            drmsnorm_weight = torch.zeros(dim, dtype=torch.float32, device=out.device)
            drmsnorm_weight = drmsnorm_weight.to(rmsnorm_weight.dtype)
            dout = dout.view(bsz, s, h, headdim)
        else:
            dout = dout.unflatten(-1, (h, headdim))
        dA, dD, ddt_bias = _ssd_bwd(x, dt, B, chunk_size, dout, dx, A, D, dt_bias)
        doutproj_weight = doutproj_bias = None
        if outproj_weight is not None:
            doutproj_weight = torch.einsum("bso,bsd->od", dout_og, out_recompute)
            doutproj_bias = dout_og.sum(dim=(0, 1)) if ctx.has[2] else None
        dx_conv = _ensure_stride(dxbc_given).transpose(1, 2)
        dx_conv, dweight, dbias = _conv_bwd(xbc, conv1d_weight, conv1d_bias, dx_conv)
        return (
            dzxbcdt, dweight, dbias, ddt_bias, dA, dD, drmsnorm_weight, doutproj_weight,
            doutproj_bias, None,
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


def mamba_split_conv1d_scan_combined(
    zxbcdt: Any, conv1d_weight: Any, conv1d_bias: Any, dt_bias: Any, A: Any, D: Any,
    chunk_size: int, initial_states: Any = None, seq_idx: Any = None,
    return_final_states: bool = False, rmsnorm_weight: Any = None,
    outproj_weight: Any = None, outproj_bias: Any = None, headdim: int | None = None,
    ngroups: int = 1, norm_before_gate: bool = True, **_: Any,
) -> Any:  # fmt: skip
    """mamba_ssm ``mamba_split_conv1d_scan_combined`` [b, l, in_proj] -> [b, l, e], as
    transformers' Mamba2 mixers call it in training (no initial or final states)."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("the traced Mamba2 kernel takes no initial or final states")
    headdim = headdim if D.dim() == 1 else D.shape[1]
    assert headdim is not None, "mamba_split_conv1d_scan_combined needs headdim for a 1-D D"
    meta = (chunk_size, headdim, ngroups, norm_before_gate)
    return SplitConv1dScan.apply(
        zxbcdt,
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        rmsnorm_weight,
        outproj_weight,
        outproj_bias,
        meta,
    )


def mamba_chunk_scan_combined(
    x: Any, dt: Any, A: Any, B: Any, C: Any, chunk_size: int, D: Any = None, z: Any = None,
    dt_bias: Any = None, initial_states: Any = None, return_final_states: bool = False, **_: Any,
) -> Any:  # fmt: skip
    """mamba_ssm ``mamba_chunk_scan_combined``: x [b, l, h, p], dt [b, l, h], B / C
    [b, l, g, n] -> [b, l, h, p] (and the final states [b, h, p, n] fp32)."""
    return ChunkScan.apply(
        x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size, return_final_states
    )


_STAND_INS: dict[str, Callable[..., Any]] = {
    "mamba_inner_fn": mamba_inner_fn,
    "mamba_selective_scan": selective_scan_fn,
    "causal_conv1d_fn": causal_conv1d_fn,
    "mamba2_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
    "mamba2_chunk_scan": mamba_chunk_scan_combined,
}


@contextlib.contextmanager
def point_module_names(
    model_types: tuple[str, ...], stand_ins: dict[str, Callable[..., Any]]
) -> Iterator[None]:
    """Point the names ``stand_ins`` lists in the loaded modeling modules of ``model_types`` at
    the stand-ins for the duration of the block (transformers' modeling code looks each kernel
    up by its module-level name at call time).

    Yields:
        None.
    """
    saved: list[tuple[Any, str, Any]] = []
    for model_type in model_types:
        name = f"transformers.models.{model_type}.modeling_{model_type}"
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, stand_in in stand_ins.items():
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, stand_in)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


@contextlib.contextmanager
def mamba_kernels() -> Iterator[None]:
    """Point the loaded Mamba modeling modules of transformers at the kernel stand-ins
    (Note [Traced Mamba kernels]) for the duration of the block.

    Yields:
        None.
    """
    with point_module_names(MAMBA_MODULES, _STAND_INS):
        yield
