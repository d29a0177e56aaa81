"""bitsandbytes' 4-bit inputs under torch's non-reentrant checkpoint (issue 24): kept by
``MatMul4Bit``'s ``ctx`` from each layer's forward to the end of the backward (Note
[bitsandbytes' inputs under non-reentrant checkpointing], trainmem/analytic/held_outputs.py).

First the mechanism on the real torch: an ``autograd.Function`` that keeps its input as a
``ctx`` attribute when it needs a gradient, as bitsandbytes 0.41.3's ``MatMul4Bit.forward``
does (``ctx.tensors = (A, B)``), under ``torch.utils.checkpoint.checkpoint`` reentrant and
not. Then the rule, with bytes derived by hand for ms-swift's Qwen-7B nf4 cell."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest

from conftest import MODELS_DIR, keyed_schedule_ops
from trainmem.analytic.held_outputs import checkpoint_held_input_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN1 = load_model_spec(str(MODELS_DIR / "remote_code" / "qwen-7b.json"))


def _alive_after_forward(reentrant: bool, layers: int = 3) -> tuple[int, int]:
    """(inputs kept by ``ctx`` after the checkpointed forward, all inputs it kept) on the CPU."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    kept: list[weakref.ref[Any]] = []

    class KeepsInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: Any, w: Any) -> Any:  # type: ignore[override]
            ctx.tensors = (a, w) if any(ctx.needs_input_grad[:2]) else (None, None)
            if ctx.tensors[0] is not None:
                kept.append(weakref.ref(a))
            return a @ w.t()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            _, w = ctx.tensors
            return grad @ w, None

    weight = torch.randn(16, 16)  # frozen, as the packed 4-bit weight
    adapter = torch.nn.Linear(16, 16)  # trainable, so the stream needs a gradient

    def layer(x: Any) -> Any:
        return KeepsInput.apply(x.to(torch.float64), weight.double()).float() + adapter(x)

    x = torch.randn(4, 16, requires_grad=True)
    h = x
    for _ in range(layers):
        h = checkpoint(layer, h, use_reentrant=reentrant)
    alive = sum(ref() is not None for ref in kept)
    h.sum().backward()
    return alive, len(kept)


def test_non_reentrant_checkpoint_keeps_every_layers_ctx_input() -> None:
    # the forward's three inputs stay; the recompute's (three more) are dropped with it
    alive, made = _alive_after_forward(reentrant=False)
    assert alive == 3
    assert made == 6


def test_reentrant_checkpoint_keeps_none() -> None:
    # the forward runs under no_grad: the input needs no gradient, nothing kept
    alive, made = _alive_after_forward(reentrant=True)
    assert alive == 0
    assert made == 3  # the recompute's, freed with CheckpointFunction.backward's graph


def _swift(**kw: object) -> TrainingConfig:
    """ms-swift's Qwen-7B nf4 cell (benchmarks/published_probe_swift.py) at 2,048 tokens."""
    base: dict[str, object] = dict(
        framework="hf-trainer",
        transformers_version="4.36.2",
        torch_version="2.1.1",
        micro_batch_size=1,
        seq_len=2048,
        optimizer="adamw",
        lora_rank=8,
        lora_dropout=0.05,
        lora_targets=("q", "k", "v"),
        activation_checkpointing="full",
        attention="flash",
        quantize_base="nf4-dq",
        precision="bf16-mixed",
        load_dtype="float16",
        bitsandbytes_version="0.41.3",
        prepare_kbit_training=False,
        checkpoint_reentrant=False,
    )
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_qwen1_layer_keeps_four_bf16_hidden_copies_and_the_mlp_product() -> None:
    # fp16 stream under bf16 autocast: c_attn, c_proj, w1 and w2 each cast their own fp16 input
    # to bf16 (Linear4bit.forward), the MLP's c_proj its 11,008-wide product:
    # 2 B x 2,048 x (4 x 4,096 + 11,008) = 112,197,632 B a layer
    assert checkpoint_held_input_bytes(QWEN1, _swift()) == 112_197_632
    # a bf16 stream (loaded in bf16): no casts, w1 and w2 share the normed input:
    # 2 B x 2,048 x (3 x 4,096 + 11,008)
    bf16 = _swift(load_dtype="bfloat16")
    assert checkpoint_held_input_bytes(QWEN1, bf16) == 95_420_416


def test_nothing_kept_where_the_rule_does_not_apply() -> None:
    assert checkpoint_held_input_bytes(QWEN1, _swift(checkpoint_reentrant=True)) == 0
    # transformers 4.x's own default is reentrant
    assert checkpoint_held_input_bytes(QWEN1, _swift(checkpoint_reentrant=None)) == 0
    # MatMul4Bit keeps (None, B) from 0.43.2; GPTQ saves through the hooks
    assert checkpoint_held_input_bytes(QWEN1, _swift(bitsandbytes_version="0.43.2")) == 0
    gptq = _swift(quantize_base="gptq-int4", precision="16-mixed", load_dtype=None)
    assert checkpoint_held_input_bytes(QWEN1, gptq) == 0
    assert checkpoint_held_input_bytes(QWEN1, _swift(activation_checkpointing="none")) == 0


def test_schedule_keeps_every_layers_inputs_to_the_end_of_the_backward() -> None:
    training = _swift(seq_len=256)
    est = estimate(QWEN1, training, simulate_allocator=False)
    ops = list(keyed_schedule_ops(list(est.schedules[0].step), "bnb_ctx_inputs/"))
    # 2 B x 256 x (4 x 4,096 + 11,008) = 14,024,704 B a layer, 32 layers
    u = 14_024_704
    allocs = [(key, size) for action, key, size in ops if action == "alloc"]
    assert allocs == [(f"bnb_ctx_inputs/{i}", u) for i in range(32)]
    frees = [(key, size) for action, key, size in ops if action == "free"]
    assert sorted(frees) == sorted(allocs)
    # the peak, at the forward's end, rises by all 32 layers' against reentrant checkpointing
    reentrant = estimate(QWEN1, dataclasses.replace(training, checkpoint_reentrant=True))
    rise = est.breakdown.allocated_bytes - reentrant.breakdown.allocated_bytes
    assert rise == 32 * u


def test_int8_keeps_each_input_once_as_given() -> None:
    """``MatMul8bitLt`` keeps ``ctx.tensors = (CAt, subA, A)`` (bitsandbytes 0.40.0 .. 0.49.2
    autograd/_functions.py), A the input as ``Linear8bitLt.forward`` passes it: no bf16 copies
    of the fp16 stream (Note [bitsandbytes' int8 inputs under non-reentrant checkpointing])."""
    int8 = _swift(quantize_base="int8", bitsandbytes_version="0.45.0")
    # c_attn's normed input, c_proj's, w1 / w2's one normed input, the MLP's c_proj's, fp16:
    # 2 B x 2,048 x (3 x 4,096 + 11,008)
    assert checkpoint_held_input_bytes(QWEN1, int8) == 95_420_416
    # before 0.45.0 each linear's int8 copy CAt besides: 1 B x 2,048 x (4 x 4,096 + 11,008)
    old = _swift(quantize_base="int8", bitsandbytes_version="0.44.1")
    assert checkpoint_held_input_bytes(QWEN1, old) == 95_420_416 + 56_098_816
    # peft's fp32 upcast: the two normed inputs fp32, c_proj's and the MLP's c_proj's bf16:
    # 2,048 x (4 x 2 x 4,096 + 2 x 4,096 + 2 x 11,008)
    upcast = _swift(
        quantize_base="int8",
        bitsandbytes_version="0.45.0",
        prepare_kbit_training=True,
        load_dtype=None,
    )
    assert checkpoint_held_input_bytes(QWEN1, upcast) == 128_974_848
    # reentrant: the first forward under no_grad, the recompute's graph dropped: nothing
    assert (
        checkpoint_held_input_bytes(QWEN1, _swift(quantize_base="int8", checkpoint_reentrant=True))
        == 0
    )
