"""The rules of thumb people quote, each exactly as published, for ``trainmem formulas``.

Each function returns a dict of named byte counts and a ``total_bytes``; none of them is used by
trainmem's own estimate. Legend: N = parameters, b = micro-batch, s = seq_len, h = hidden,
L = layers, a = heads, V = vocab.
"""

from __future__ import annotations

from trainmem.analytic.activations import korthikanti_layer_bytes
from trainmem.analytic.model_states import zero_paper_model_state_bytes
from trainmem.analytic.params import num_parameters
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


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


def rules_of_thumb(model: ModelSpec, training: TrainingConfig) -> list[tuple[str, int | None, str]]:
    """Each rule above applied to one configuration, as (name, total bytes, what it counts).

    ``bytes_per_value`` for the "model memory" rule and the GPT-2 calculator is 4 for
    ``32-true`` and 2 otherwise (the rules know one dtype only); the ZeRO and Korthikanti rules
    are fixed to mixed-precision Adam by their papers. Korthikanti's formula applies with
    ``full`` checkpointing as its full-recompute variant. None where a rule cannot express the
    model (the GPT-2 calculator has no GQA, gated MLP or encoders).
    """
    n = num_parameters(model)
    b, s = training.micro_batch_size, training.seq_len
    h, L, a = model.hidden_size, model.num_layers, model.num_heads
    p = 4 if training.precision == "32-true" else 2
    rows: list[tuple[str, int | None, str]] = []
    z = zero_paper(n=n, h=h, b=b, s=s, num_layers=L)
    rows.append(
        (
            "ZeRO paper (Rajbhandari et al. 2020)",
            z["total_bytes"],
            "16 B/param model states + 12*h*b*s*L 16-bit activations",
        )
    )
    m = model_memory_rule(n=n, b=b, s=s, bytes_per_value=p)
    rows.append(
        (
            f"'model memory' rule (P={p})",
            m["total_bytes"],
            "weights, 2x Adam states, grads, optimizer intermediates, A*B*L*P activations",
        )
    )
    gpt2_like = (
        model.architecture == "decoder"
        and model.mlp_kind == "gelu"
        and (model.num_kv_heads == model.num_heads)
    )
    g = (
        gpt2_calculator(
            vocab=model.vocab_size, e=h, num_layers=L, num_heads=a, b=b, t=s, bytes_per_value=p
        )
        if gpt2_like
        else None
    )
    rows.append(
        (
            f"GPT-2 calculator (P={p})",
            g["total_bytes"] if g else None,
            "4x model params + 2x activation values"
            if g
            else "not expressible: needs a GPT-2-like decoder (no GQA, 4h GELU MLP)",
        )
    )
    k = korthikanti(
        n=n,
        h=h,
        a=a,
        b=b,
        s=s,
        num_layers=L,
        full_recompute=training.activation_checkpointing == "full",
    )
    rows.append(
        (
            "Korthikanti et al. 2022 + 16 B/param",
            k["total_bytes"],
            "sbh(34 + 5as/h) per layer (2sbh with full recompute), no logits/loss",
        )
    )
    return rows
