"""Test model: the small pre-norm decoder of Stanford CS336 (``BasicsTransformerLM``), its
course AdamW and its cross-entropy, written from the course's description for
``benchmarks/snapshot_traced_step.py`` (the real snapshots ../shared/validation/snapshots S001-S049
profile it).

The model: token embedding by indexing, ``L`` pre-norm blocks (RMSNorm with an fp32 upcast;
causal multi-head attention, RoPE on Q and K, scores by einsum, a ``torch.where`` causal mask and
a max-shifted softmax written out; SwiGLU with ``silu(x) = x * sigmoid(x)``), a final RMSNorm and
an untied LM head. Linears are bias-free weights applied with ``einsum``. The optimizer is the
course's for-loop AdamW (new ``m``/``v`` tensors each step, default zeros built eagerly); the loss
is an explicit log-softmax, negated, gathered and averaged. Requires torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * rms
        return (self.weight * x).to(in_dtype)


def softmax(x, dim):
    x = x - x.max(dim=dim, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


class Rope(nn.Module):
    def __init__(self, context, dim, theta=10000.0):
        super().__init__()
        d = torch.arange(0, dim, 2) / dim
        freqs = torch.outer(torch.arange(context).float(), theta**-d)
        self.register_buffer("cache", torch.stack((freqs.cos(), freqs.sin())), persistent=False)

    def forward(self, x):
        half = x.shape[-1] // 2
        x = x.unflatten(-1, (half, 2))
        x1, x2 = x[..., 0], x[..., 1]
        cos, sin = self.cache[:, : x.shape[-3], :].unbind(0)
        return torch.cat((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1)


class Attention(nn.Module):
    def __init__(self, d, h, rope):
        super().__init__()
        self.h = h
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (Linear(d, d) for _ in range(4))
        self.rope = rope

    def forward(self, x):
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


class SwiGLU(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(d, f), Linear(f, d), Linear(d, f)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, h, f, rope):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.attn, self.ffn = Attention(d, h, rope), SwiGLU(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsLM(nn.Module):
    def __init__(self, vocab, context, d, layers, heads, d_ff):
        super().__init__()
        self.token_embeddings = nn.Parameter(torch.empty(vocab, d))
        rope = Rope(context, d // heads)
        self.layers = nn.ModuleList(Block(d, heads, d_ff, rope) for _ in range(layers))
        self.ln_final = RMSNorm(d)
        self.lm_head = Linear(d, vocab)

    def forward(self, ids):
        x = self.token_embeddings[ids, :]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


class CourseAdamW(torch.optim.Optimizer):
    """The course's for-loop AdamW: per parameter, fresh zeros for the default moments (built
    even when the state has them), new m and v tensors each step, then two in-place updates."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
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


def course_log_softmax(x, dim=-1):
    """Max-shifted log-softmax written out (each step materialises an x-sized tensor)."""
    x = x - x.max(dim=dim, keepdim=True).values
    return x - torch.log(torch.exp(x).sum(dim=dim, keepdim=True))


def course_cross_entropy(logits, targets):
    """The course's cross-entropy: minus the log-softmax, gathered at the targets, averaged."""
    log_probs = -course_log_softmax(logits.flatten(0, -2))
    return log_probs.gather(-1, targets.reshape(-1, 1)).mean()
