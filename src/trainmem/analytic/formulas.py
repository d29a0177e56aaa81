"""The rules of thumb people quote, each exactly as published, for ``trainmem formulas``.

Each function returns a dict of named byte counts and a ``total_bytes``; none of them is used by
trainmem's own estimate. Legend: N = parameters, b = micro-batch, s = seq_len, h = hidden,
L = layers, a = heads, V = vocab.
"""

from __future__ import annotations

from trainmem.analytic.activations import korthikanti_layer_bytes
from trainmem.analytic.model_states import zero_paper_model_state_bytes


def zero_paper(*, n: int, h: int, b: int, s: int, num_layers: int) -> dict[str, int]:
    """ZeRO paper: model states (2 + 2 + 12) * Psi; activations 12 * h * b * s * L values in 16-bit.

    Source: Rajbhandari et al. 2020, arXiv:1910.02054, sec. 3.1 and 3.2 (GPT-2 1.5B, batch 32,
    seq 1K: 24 GB model states, ~60 GB activations).
    """
    act = 12 * h * b * s * num_layers * 2
    states = zero_paper_model_state_bytes(n)
    return {"model_states_bytes": states, "activations_bytes": act, "total_bytes": states + act}


def model_memory_rule(*, n: int, b: int, s: int, bytes_per_value: int) -> dict[str, int]:
    """The "model memory" rule of thumb: weights N*P, Adam states 2*N*P, gradients N*P,
    optimizer intermediates N*P, activations A*B*L*P with A = 4.6894e-4 * N + 1.8494e6.

    Source: shared/seeds "Understanding Model Memory Calculations" (formulas 1-5).
    """
    p = bytes_per_value
    a_per_token = 4.6894e-4 * n + 1.8494e6
    out = {
        "weights_bytes": n * p,
        "optimizer_states_bytes": 2 * n * p,
        "gradients_bytes": n * p,
        "optimizer_intermediates_bytes": n * p,
        "activations_bytes": round(a_per_token * b * s * p),
    }
    out["total_bytes"] = sum(out.values())
    return out


def gpt2_calculator(
    *, vocab: int, e: int, num_layers: int, num_heads: int, b: int, t: int, bytes_per_value: int
) -> dict[str, int]:
    """The GPT-2 memory calculator: model_params = V*E + L*(4E^2 + 2*E*4E + 4E),
    act_params = B*T*(2V + L*(14E + H*T)), total values = 4*model_params + 2*act_params.

    Source: shared/seeds "Transformer Memory Requirements" (26.6 GB predicted vs 27.5 GB measured,
    GPT-2 small, fp32, batch 8, seq 1024).
    """
    model_params = vocab * e + num_layers * (4 * e**2 + 2 * e * 4 * e + 4 * e)
    act_params = b * t * (2 * vocab + num_layers * (14 * e + num_heads * t))
    total = (4 * model_params + 2 * act_params) * bytes_per_value
    return {
        "model_params": model_params,
        "act_params": act_params,
        "total_bytes": total,
    }


def korthikanti(
    *, n: int, h: int, a: int, b: int, s: int, num_layers: int, full_recompute: bool = False
) -> dict[str, int]:
    """Mixed-precision Adam model states (16 bytes per parameter) plus Korthikanti et al.'s
    per-layer activations, L * sbh(34 + 5as/h), or 2sbhL with full recomputation.

    Source: Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.1 Eq. 1 and sec. 5 (Table 2).
    """
    if full_recompute:
        act = 2 * s * b * h * num_layers
    else:
        act = num_layers * korthikanti_layer_bytes(s=s, b=b, h=h, a=a)
    states = zero_paper_model_state_bytes(n)
    return {"model_states_bytes": states, "activations_bytes": act, "total_bytes": states + act}
