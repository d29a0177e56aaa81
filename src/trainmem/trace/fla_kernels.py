"""Stand-ins for the flash-linear-attention kernels, so the traced step takes transformers' kernel
path for gated delta-net and Kimi delta-attention layers and for short convolutions.

Legend: b = micro_batch_size, l = seq_len, H = query / key heads, HV = value heads, K / V = key /
value head dims, BT = 64 the chunk size, NT = ceil(l / BT) the chunks.

Note [Traced linear-attention kernels]
    transformers 5.24 binds ``chunk_gated_delta_rule`` / ``chunk_kda`` to flash-linear-attention
    (``fla``) and ``causal_conv1d_fn`` to causal-conv1d when they import (a user's GPU run),
    else to its PyTorch reference (``integrations/hub_kernels.py``
    ``use_kernel_func_from_hub_with_fallback``), which the trace would run: a Python loop over
    the NT chunks whose per-chunk products autograd keeps (plus fp32 copies of q, k, v), bytes
    no GPU run holds. As Note [Traced Mamba kernels] does for Mamba, the modeling modules'
    names are pointed at :class:`torch.autograd.Function` stand-ins that allocate, save and free
    what the kernels do, ``torch.empty`` / ``torch.zeros`` in place of each Triton launch.
    Sources: fla-org/flash-linear-attention v0.5.2 (9c8e42e762fce087c27b673af4922795d9edb85e);
    the short convolution is Note [Traced Mamba kernels]'s ``causal_conv1d_fn`` (its fused
    activation allocates nothing more).

    - ``chunk_gated_delta_rule`` (fla/ops/gated_delta_rule/chunk.py
      ``ChunkGatedDeltaRuleFunction``; Qwen3-Next, Qwen3.5, OLMo-hybrid...): ``input_guard``
      makes every input contiguous (q, k, v are strided views of the conv output: copies, held
      to the forward's end); with ``use_qk_l2norm_in_kernel`` (transformers passes True)
      ``l2norm_fwd`` (fla/modules/l2norm.py) gives q, k = empty_like and rstd [b*l*H] fp32
      each; ``chunk_local_cumsum`` g -> fp32 [b, l, HV]; ``chunk_gated_delta_rule_fwd_intra``
      A = zeros [b, l, HV, BT] in k's dtype, w [b, l, HV, K] and u = empty_like(v) (wy_fast.py
      ``recompute_w_u_fwd``); ``chunk_gated_delta_rule_fwd_h`` (common/chunk_delta_h.py) the
      chunk states h [b, NT, HV, K, V] in k's dtype and v_new = empty_like(u); ``chunk_fwd_o``
      o = empty_like(v). w, u, h, v_new are dropped; it saves q, q_rstd, k, k_rstd, v, the
      fp32 cumulative g, beta and A. The backward recomputes w, u, h, v_new, then allocates dv
      (``chunk_bwd_dv_local``), dh [b, NT, HV, K, V] and a new dv (``_bwd_dhu``), dq, dk
      [b, l, HV, K], dw, dg [NK, b, l, HV] fp32 (common/chunk_o.py ``chunk_bwd_dqkwg``; NK =
      ceil(K / BK), BK = min(max(K, 16), 64): the tile of A100 / Ada shared memory, 128 on
      Hopper), then dk2, dv, dg2, db (``prepare_wy_repr_bwd``), the reverse cumsum of dg and
      l2norm_bwd's dq, dk = empty_like.
    - ``chunk_kda`` (fla/ops/kda/chunk.py ``ChunkKDAFunction``, ``disable_recompute=False``;
      Kimi-Linear, per-channel decay g [b, l, HV, K]): the same guard and l2norm; g's cumsum
      fp32 [b, l, HV, K]; ``chunk_kda_fwd_intra`` (kda/chunk_intra.py) Aqk = empty and Akk =
      zeros [b, l, HV, BT] in k's dtype, Akkd [b, l, HV, 16] fp32 (dropped), w, kg [b, l, HV,
      K] and u (kda/wy_fast.py ``recompute_w_u_fwd``, no qg); h and v_new as above; o =
      zeros_like(v_new) (gla/chunk.py ``chunk_gla_fwd_o_gk``). It saves q, q_rstd, k, k_rstd,
      v, g's cumsum, g as passed, beta, Aqk and Akk. The backward (kda/chunk_bwd.py
      ``chunk_kda_bwd``) recomputes w, u, qg, kg, h, v_new, then dAqk [b, l, HV, BT] fp32 and
      dv, dh and a new dv, the fused WY pass's fp32 dq, dk [b, l, HV, K], dg, db, dAkk and a
      new dv, ``chunk_kda_bwd_intra``'s fp32 dq2, dk2, dg2 and db2 [NK, b, l, HV] (BK =
      min(32, K)), the reverse cumsum of dg, l2norm_bwd's dq, dk, and the casts of dg and db
      back to g's and beta's dtypes.

    Known limitations: the varlen (``cu_seqlens``) and context-parallel paths, initial states
    and the single-token recurrent kernels (decoding) are not modelled; transformers' gated
    RMSNorm stays its PyTorch module, as it does on a GPU without ``kernels``. Under
    ``--compile`` the trace's AOTAutograd traces through the stand-ins, where fla's
    ``@torch.compiler.disable`` breaks the graph (Note [Tracing torch.compile]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainmem.trace.mamba_kernels import causal_conv1d_fn, point_module_names

__all__ = ["LINEAR_ATTENTION_MODULES", "linear_attention_kernels"]

CHUNK = 64
"""fla's default ``chunk_size`` (gated_delta_rule/chunk.py, kda/chunk.py)."""

DQKWG_TILE = 64
"""``chunk_bwd_dqkwg``'s ``CONST_TILING`` on A100 / Ada shared memory (common/chunk_o.py; 128 on
Hopper, 32 below Ada)."""

KDA_INTRA_TILE = 32
"""``chunk_kda_bwd_intra``'s ``BK = min(32, next_power_of_2(K))`` (kda/chunk_intra.py)."""

LINEAR_ATTENTION_MODULES = (
    "lfm2", "lfm2_moe", "lfm3", "inkling", "inkling2", "inkling2_loop",
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "olmo_hybrid", "lara_mini",
    "kimi_linear", "bailing_hybrid", "glm5_next",
)  # fmt: skip
"""transformers model types whose modeling module calls ``causal_conv1d_fn`` and, from qwen3_next
on, ``chunk_gated_delta_rule`` (as ``torch_chunk_gated_delta_rule``) or ``chunk_kda`` (as
``chunk_kimi_delta_attention``) by name."""


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _l2norm_fwd(x: Any) -> tuple[Any, Any]:
    """fla ``l2norm_fwd``: y = empty_like(x), rstd [rows] fp32."""
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), torch.empty(rows, dtype=torch.float32, device=x.device)


def _l2norm_bwd(y: Any) -> Any:
    """fla ``l2norm_bwd``: dx = empty_like(y)."""
    return torch.empty_like(y)


def _heads_sum(t: Any, heads: int) -> Any:
    """GVA: a [b, l, HV, K] gradient summed back to the H query / key heads."""
    b, l_, hv, k = t.shape
    return t if hv == heads else t.view(b, l_, heads, hv // heads, k).sum(3)


def _dims(k: Any, v: Any) -> tuple[int, int, int, int, int, int]:
    """b, l, H, K, HV, V from k [b, l, H, K] and v [b, l, HV, V]."""
    b, l_, heads, kd = k.shape
    return b, l_, heads, kd, v.shape[2], v.shape[3]


def _forward_inputs(
    q: Any, k: Any, v: Any, g: Any, beta: Any, use_qk_l2norm: bool
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """What both chunk functions do first: ``input_guard``'s contiguous copies (returned, as
    the guard holds them to the forward's end), the optional ``l2norm_fwd`` of q and k, and
    ``chunk_local_cumsum``'s fp32 gate. Returns (the guarded inputs, (q, q_rstd, k, k_rstd, v,
    g as passed, its cumsum, beta))."""
    guarded = tuple(t.contiguous() for t in (q, k, v, g, beta))
    q, k, v, g, beta = guarded
    q_rstd = k_rstd = None
    if use_qk_l2norm:
        q, q_rstd = _l2norm_fwd(q)
        k, k_rstd = _l2norm_fwd(k)
    return guarded, (q, q_rstd, k, k_rstd, v, g, torch.empty_like(g, dtype=torch.float32), beta)


class ChunkGatedDeltaRule(torch.autograd.Function):
    """fla ``ChunkGatedDeltaRuleFunction`` (Note [Traced linear-attention kernels])."""

    @staticmethod
    def forward(
        ctx: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, output_final_state: bool,
        use_qk_l2norm: bool,
    ) -> Any:  # fmt: skip
        guarded, (q, q_rstd, k, k_rstd, v, _, g, beta) = _forward_inputs(
            q, k, v, g, beta, use_qk_l2norm
        )
        b, l_, _, kd, hv, vd = _dims(k, v)
        nt = -(-l_ // CHUNK)
        A = torch.zeros(b, l_, hv, CHUNK, dtype=k.dtype, device=k.device)
        w = k.new_empty(b, l_, hv, kd)
        u = torch.empty_like(v)
        h = k.new_empty(b, nt, hv, kd, vd)
        v_new = torch.empty_like(u)
        final_state = None
        if output_final_state:
            final_state = k.new_zeros(b, hv, kd, vd, dtype=torch.float32)
        o = torch.empty_like(v_new)
        del w, u, h, v_new, guarded
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A)
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx: Any, do: Any, *_: Any) -> Any:
        q, q_rstd, k, k_rstd, v, g, beta, A = ctx.saved_tensors
        do = do.contiguous()
        b, l_, heads, kd, hv, vd = _dims(k, v)
        nt = -(-l_ // CHUNK)
        w, u = k.new_empty(b, l_, hv, kd), torch.empty_like(v)  # recompute_w_u_fwd
        h, v_new = k.new_empty(b, nt, hv, kd, vd), torch.empty_like(u)  # _fwd_h
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh = q.new_empty(b, nt, hv, kd, vd)  # chunk_gated_delta_rule_bwd_dhu
        dv = torch.empty_like(dv)
        nk = -(-kd // min(max(_next_pow2(kd), 16), DQKWG_TILE))
        dq, dk = q.new_empty(b, l_, hv, kd), k.new_empty(b, l_, hv, kd)  # chunk_bwd_dqkwg
        dg = torch.empty(nk, *g.shape, dtype=torch.float32, device=g.device)
        dw = torch.empty_like(w)
        dq, dk = _heads_sum(dq, heads), _heads_sum(dk, heads)
        dg = dg.sum(0)
        dk2, dv_wy = k.new_empty(b, l_, hv, kd), torch.empty_like(v)  # prepare_wy_repr_bwd
        dg2, db = torch.empty_like(g), torch.empty_like(beta)
        dk2 = _heads_sum(dk2, heads)
        dv = dv_wy
        del dv_wy
        dk.add_(dk2)
        dg.add_(dg2)
        dg = torch.empty_like(dg, dtype=torch.float32)  # chunk_local_cumsum(reverse=True)
        del w, u, h, v_new, dh, dw, dk2, dg2
        if ctx.use_qk_l2norm:
            dq, dk = _l2norm_bwd(q), _l2norm_bwd(k)
        return dq.to(q), dk.to(k), dv.to(v), dg, db.to(beta), None, None


class ChunkKDA(torch.autograd.Function):
    """fla ``ChunkKDAFunction`` with ``disable_recompute=False`` (Note [Traced linear-attention
    kernels])."""

    @staticmethod
    def forward(
        ctx: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, output_final_state: bool,
        use_qk_l2norm: bool,
    ) -> Any:  # fmt: skip
        guarded, (q, q_rstd, k, k_rstd, v, g_input, g, beta) = _forward_inputs(
            q, k, v, g, beta, use_qk_l2norm
        )
        b, l_, _, kd, hv, vd = _dims(k, v)
        nt = -(-l_ // CHUNK)
        # chunk_kda_fwd_intra
        Aqk = torch.empty(b, l_, hv, CHUNK, dtype=k.dtype, device=k.device)
        Akk = torch.zeros(b, l_, hv, CHUNK, dtype=k.dtype, device=k.device)
        Akkd = torch.empty(b, l_, hv, 16, dtype=torch.float32, device=k.device)
        w, u, kg = k.new_empty(b, l_, hv, kd), torch.empty_like(v), k.new_empty(b, l_, hv, kd)
        del Akkd
        h = k.new_empty(b, nt, hv, kd, vd)  # chunk_gated_delta_rule_fwd_h
        v_new = torch.empty_like(u)
        final_state = None
        if output_final_state:
            final_state = k.new_zeros(b, hv, kd, vd, dtype=torch.float32)
        o = torch.zeros_like(v_new)  # chunk_gla_fwd_o_gk
        del w, u, kg, v_new, h, guarded
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, g_input, beta, Aqk, Akk)
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx: Any, do: Any, *_: Any) -> Any:
        q, q_rstd, k, k_rstd, v, g, g_input, beta, Aqk, Akk = ctx.saved_tensors
        do = do.contiguous()
        b, l_, heads, kd, hv, vd = _dims(k, v)
        nt = -(-l_ // CHUNK)
        f32 = {"dtype": torch.float32, "device": k.device}
        # recompute_w_u_fwd with q: w, u, qg, kg
        w, u = k.new_empty(b, l_, hv, kd), torch.empty_like(v)
        qg, kg = k.new_empty(b, l_, hv, kd), k.new_empty(b, l_, hv, kd)
        h, v_new = k.new_empty(b, nt, hv, kd, vd), torch.empty_like(u)  # _fwd_h
        dAqk, dv = torch.empty(b, l_, hv, CHUNK, **f32), torch.empty_like(do)  # chunk_kda_bwd_dAv
        dh = qg.new_empty(b, nt, hv, kd, vd)  # chunk_gated_delta_rule_bwd_dhu
        dv = torch.empty_like(dv)
        # chunk_kda_bwd_wy_dqkg_fused
        dq, dk = torch.empty(b, l_, hv, kd, **f32), torch.empty(b, l_, hv, kd, **f32)
        dv_wy = torch.empty_like(v)
        dg, db = torch.empty_like(g, dtype=torch.float32), torch.empty_like(beta, **f32)
        dAkk = torch.empty_like(Akk, dtype=torch.float32)
        dv = dv_wy
        del dv_wy
        # chunk_kda_bwd_intra
        nk = -(-kd // min(KDA_INTRA_TILE, _next_pow2(kd)))
        dq2, dk2 = torch.empty_like(dq), torch.empty_like(dk)
        db2 = torch.empty(nk, *beta.shape, **f32)
        dg2 = torch.empty_like(dg, dtype=torch.float32)
        db = db2.sum(0).add_(db)
        dq, dk, dg = dq2, dk2, dg2
        del dq2, dk2, dg2, db2
        dq, dk = _heads_sum(dq, heads), _heads_sum(dk, heads)
        dg = torch.empty_like(dg, dtype=torch.float32)  # chunk_local_cumsum(reverse=True)
        del w, u, qg, kg, h, v_new, dAqk, dh, dAkk
        if ctx.use_qk_l2norm:
            dq, dk = _l2norm_bwd(q), _l2norm_bwd(k)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g_input), db.to(beta), None, None


# ---- the names transformers' modeling modules call -------------------------------------------


def chunk_gated_delta_rule(
    q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float | None = None,
    initial_state: Any = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None, **_: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """fla ``chunk_gated_delta_rule``: q, k [b, l, H, K], v [b, l, HV, V], g and beta
    [b, l, HV] -> o [b, l, HV, V] (and the final state [b, HV, K, V] fp32)."""
    _unmodelled(initial_state, cu_seqlens, "chunk_gated_delta_rule")
    out: tuple[Any, Any] = ChunkGatedDeltaRule.apply(
        q, k, v, g, beta, output_final_state, use_qk_l2norm_in_kernel
    )
    return out


def chunk_kda(
    q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float | None = None,
    initial_state: Any = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None, **_: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """fla ``chunk_kda``: q, k [b, l, H, K], v [b, l, HV, V], g [b, l, HV, K], beta [b, l, HV]
    -> o [b, l, HV, V] (and the final state [b, HV, K, V] fp32)."""
    _unmodelled(initial_state, cu_seqlens, "chunk_kda")
    out: tuple[Any, Any] = ChunkKDA.apply(
        q, k, v, g, beta, output_final_state, use_qk_l2norm_in_kernel
    )
    return out


def _unmodelled(initial_state: Any, cu_seqlens: Any, kernel: str) -> None:
    if initial_state is not None or cu_seqlens is not None:
        raise NotImplementedError(
            f"the traced {kernel} takes no initial state and no packed sequences (cu_seqlens)"
        )


_STAND_INS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
    "chunk_kimi_delta_attention": chunk_kda,
}


@contextlib.contextmanager
def linear_attention_kernels() -> Iterator[None]:
    """Point the loaded linear-attention / short-conv modeling modules of transformers at the
    kernel stand-ins (Note [Traced linear-attention kernels]) for the duration of the block.

    Yields:
        None.
    """
    with point_module_names(LINEAR_ATTENTION_MODULES, _STAND_INS):
        yield
