"""The Stanford CS336 course transformer (``model_type: "cs336_basics"``) for the trace engine:
its model, its AdamW and its losses, written op for op as the course code runs them, since
transformers cannot build it.

The model mirrors stanford-cs336 ``cs336_basics/model.py`` (``BasicsTransformerLM``:
``Embedding`` by indexing, pre-norm ``TransformerBlock`` of ``RMSNorm`` with an fp32 upcast,
``CausalMultiHeadSelfAttention`` with bias-free q/k/v/output projections applied by ``einsum``,
``RotaryEmbedding`` from a (2, context_length, d/2) buffer, scores by ``einsum``, a
``torch.where`` causal mask and ``nn_utils.softmax`` written out; ``SwiGLU`` with ``silu(x) = x *
torch.sigmoid(x)``; ``ln_final``; an untied ``lm_head``). The losses mirror ``nn_utils.py``
(``log_softmax`` / ``cross_entropy`` written out) or are ``F.cross_entropy`` and the
``logits.sum()`` / ``.mean()`` stand-ins of the course's benchmarking scripts; the optimizer
mirrors ``optimizer.py`` (``AdamW.step``: a loop over the parameters, new moments and the update
built out of place). Einops' ``rearrange`` is written with ``unflatten`` / ``transpose`` /
``reshape`` (the same views and copies). Checked against real GPU snapshots of the course's
scripts in benchmarks/snapshot_traced_step.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trainmem.errors import SpecError
from trainmem.trace._torch import require_torch

torch = require_torch()
nn = torch.nn
_Module: Any = torch.nn.Module
_Optimizer: Any = torch.optim.Optimizer

__all__ = [
    "BasicsLM",
    "CourseAdamW",
    "build_course_model",
    "course_cross_entropy",
    "course_loss",
]


class Linear(_Module):  # type: ignore[misc]
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))

    def forward(self, x: Any) -> Any:
        return torch.einsum("...i,oi->...o", x, self.weight)


class RMSNorm(_Module):  # type: ignore[misc]
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Any) -> Any:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * rms
        return (self.weight * x).to(in_dtype)


def softmax(x: Any, dim: int) -> Any:
    """nn_utils.py ``softmax``."""
    rescaled = x - torch.max(x, dim=dim, keepdim=True)[0]
    exponentiated = torch.exp(rescaled)
    return exponentiated / torch.sum(exponentiated, dim=dim, keepdim=True)


class Rope(_Module):  # type: ignore[misc]
    def __init__(self, context: int, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        d = torch.arange(0, dim, 2) / dim
        freqs = torch.outer(torch.arange(context).float(), theta**-d)
        self.register_buffer("cache", torch.stack((freqs.cos(), freqs.sin())), persistent=False)

    def forward(self, x: Any) -> Any:
        half = x.shape[-1] // 2
        x = x.unflatten(-1, (half, 2))
        x1, x2 = x[..., 0], x[..., 1]
        cos, sin = self.cache[:, : x.shape[-3], :].unbind(0)
        return torch.cat((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1)


class Attention(_Module):  # type: ignore[misc]
    def __init__(self, d: int, h: int, rope: Rope) -> None:
        super().__init__()
        self.h = h
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (Linear(d, d) for _ in range(4))
        self.rope = rope

    def forward(self, x: Any) -> Any:
        b, s, d = x.shape
        q, k, v = (
            p(x).unflatten(-1, (self.h, -1)).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = self.rope(q), self.rope(k)
        iota = torch.arange(s, device=x.device)
        mask = iota[:, None] >= iota[None, :]
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        scores = torch.where(mask, scores, float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", softmax(scores, -1), v)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, d).contiguous())


class SwiGLU(_Module):  # type: ignore[misc]
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(d, f), Linear(f, d), Linear(d, f)

    def forward(self, x: Any) -> Any:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class Block(_Module):  # type: ignore[misc]
    def __init__(self, d: int, h: int, f: int, rope: Rope) -> None:
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.attn, self.ffn = Attention(d, h, rope), SwiGLU(d, f)

    def forward(self, x: Any) -> Any:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsLM(_Module):  # type: ignore[misc]
    """``BasicsTransformerLM(vocab_size, context_length, d_model, num_layers, num_heads,
    d_ff)``."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int, d_ff: int):
        super().__init__()
        self.token_embeddings = nn.Parameter(torch.empty(vocab, d))
        rope = Rope(context, d // heads)
        self.layers = nn.ModuleList(Block(d, heads, d_ff, rope) for _ in range(layers))
        self.ln_final = RMSNorm(d)
        self.lm_head = Linear(d, vocab)

    def forward(self, ids: Any) -> Any:
        x = self.token_embeddings[ids, :]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


class CourseAdamW(_Optimizer):  # type: ignore[misc]
    """optimizer.py ``AdamW``: per parameter, fresh zeros for the default moments (built even
    when the state has them), new m and v tensors each step, then two in-place updates."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()  # type: ignore[misc,untyped-decorator]
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                t = state.get("t", 1)
                m0 = state.get("m", torch.zeros_like(g))
                v0 = state.get("v", torch.zeros_like(g))
                m = b1 * m0 + ((1 - b1) * g)
                v = b2 * v0 + ((1 - b2) * torch.square(g))
                a = group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
                p -= a * m / (torch.sqrt(v) + group["eps"])
                p -= group["lr"] * group["weight_decay"] * p
                state["m"], state["v"], state["t"] = m, v, t + 1


def course_log_softmax(x: Any, dim: int = -1) -> Any:
    """nn_utils.py ``log_softmax`` (the 2025 copy: ``x = x - x_max`` first), max-shifted, each
    step an x-sized tensor."""
    x = x - torch.max(x, dim=dim, keepdim=True)[0]
    return x - torch.log(torch.sum(torch.exp(x), dim=dim, keepdim=True))


def course_cross_entropy(logits: Any, targets: Any) -> Any:
    """nn_utils.py ``cross_entropy``: minus the log-softmax, gathered at the targets, averaged."""
    negative_log_softmax = -course_log_softmax(logits.flatten(0, -2))
    return torch.mean(torch.gather(negative_log_softmax, -1, targets.reshape(-1, 1)))


def course_loss(kind: str) -> Callable[[Any, Any], Any]:
    """``loss_fn(logits, batch)`` of a ``TrainingConfig.loss`` value (the batch is the token ids,
    which are also the targets)."""
    losses: dict[str, Callable[[Any, Any], Any]] = {
        "cs336-cross-entropy": course_cross_entropy,
        "cross-entropy": lambda out, ids: torch.nn.functional.cross_entropy(
            out.flatten(0, -2), ids.reshape(-1)
        ),
        "transposed-cross-entropy": torchtune_transposed_cross_entropy,
        "logits-sum": lambda out, _ids: out.sum(),
        "logits-mean": lambda out, _ids: out.mean(),
    }
    return losses[kind]


def torchtune_transposed_cross_entropy(logits: Any, ids: Any) -> Any:
    """torchtune's 2024 recipes' loss (Note [torchtune's transposed cross-entropy] in
    ``trainmem.analytic.loss``): the model's fp32 output (modules/transformer.py
    ``self.output(h).float()``), shifted into a contiguous copy, its (b, V, s - 1) transposed
    view into ``cross_entropy`` (recipes/lora_finetune_single_device.py @fef3ed1 ``train()``);
    the token ids are the labels. ``cross_entropy`` is ``nll_loss`` of ``log_softmax(x, 1)``
    (aten/src/ATen/native/LossNLL.cpp), and the CUDA log-softmax reads a contiguous copy of a
    strided input, freed when it returns (aten/src/ATen/native/cuda/SoftMax.cu
    ``host_softmax``: ``input_.contiguous()``), which the meta kernel does not make: the copy
    is made here, where autograd saves nothing of it (``clone``)."""
    logits = logits.float()
    logits = logits[..., :-1, :].contiguous()
    labels = ids[..., 1:].contiguous()
    logits = logits.transpose(1, 2)
    log_probs = torch.log_softmax(logits.contiguous(), 1)
    return torch.nn.functional.nll_loss(log_probs, labels)


def build_course_model(config: Mapping[str, Any]) -> Any:
    """``BasicsLM`` from a ``cs336_basics`` config.json (the constructor's arguments).

    Raises:
        SpecError: a missing or non-integer size (the analytic family table checks the same
            fields with the same names).
    """
    sizes = []
    for key in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SpecError(key, f"must be a positive integer, got {value!r}")
        sizes.append(value)
    return BasicsLM(*sizes)
