"""Note [Reentrant checkpoint's recomputed output] (analytic/transforms/reentrant.py): torch's
reentrant checkpoint holds the recomputed layer's output through the layer's backward; the
bytes derived by hand, the binding checked on torch's own ``checkpoint`` on the CPU."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from trainmem.analytic.transforms.reentrant import KEY, reentrant_output_bytes
from trainmem.estimate import estimate, resolve_model
from trainmem.schedule import Item, Repeat, _format_index
from trainmem.specs.training import TrainingConfig


def _fsdp_qlora(**kw: object) -> TrainingConfig:
    """GT129: fsdp_qlora train.py, llama-2-70b, 2 x 2048 tokens, bf16, FSDP1 + CPU offload."""
    base: dict[str, object] = {
        "framework": "fsdp-qlora",
        "precision": "bf16-true",
        "micro_batch_size": 2,
        "seq_len": 2048,
        "activation_checkpointing": "full",
        "data_parallel_size": 2,
        "zero_stage": 3,
        "offload": "optimizer+params",
        "lora_rank": 64,
        "quantize_base": "nf4-dq",
        "bitsandbytes_version": "0.43.0",
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_bytes_are_one_residual_tensor_where_the_checkpoint_is_reentrant() -> None:
    big, small = resolve_model("llama-2-70b"), resolve_model("llama-2-7b")
    # b s h bf16: 2 x 2048 x 8192 x 2 B
    assert reentrant_output_bytes(big, _fsdp_qlora()) == 67_108_864
    # train.py without --reentrant_checkpointing; no checkpointing
    assert reentrant_output_bytes(big, _fsdp_qlora(checkpoint_reentrant=False)) == 0
    assert reentrant_output_bytes(big, _fsdp_qlora(activation_checkpointing="none")) == 0
    # transformers' gradient checkpointing: reentrant before 5.0; under bf16-mixed the residual
    # stream (the layer's output) is fp32: 1 x 1024 x 4096 x 4 B
    hf: dict[str, object] = {
        "framework": "hf-trainer",
        "precision": "bf16-mixed",
        "activation_checkpointing": "full",
        "micro_batch_size": 1,
        "seq_len": 1024,
    }
    assert reentrant_output_bytes(small, TrainingConfig(**hf, transformers_version="4.40.0")) == (
        16_777_216
    )
    assert reentrant_output_bytes(small, TrainingConfig(**hf, transformers_version="5.0")) == 0


def _held(items: list[Item], i: int = 0) -> Iterator[tuple[str, str, int]]:
    for item in items:
        if isinstance(item, Repeat):
            for k in range(item.count):
                yield from _held(list(item.body), item.index(k))
        elif item.key == KEY:
            yield item.action, _format_index(item.module, i), item.size_bytes


def test_schedule_holds_the_output_through_each_layers_backward() -> None:
    # llama-2-7b, one sequence of 512 tokens: 512 x 4096 x 2 B = 4,194,304, made and freed once
    # in each of the 32 layers' backward, in reverse order
    training = _fsdp_qlora(micro_batch_size=1, seq_len=512, offload="none")
    est = estimate("llama-2-7b", training, simulate_allocator=False)
    ops = list(_held(list(est.schedules[0].step)))
    u = 4_194_304
    expected = [(a, f"layers.{i}", u) for i in range(31, -1, -1) for a in ("alloc", "free")]
    assert ops == expected


torch = pytest.importorskip("torch")


def _output_alive_in_backward(*, reentrant: bool) -> bool:
    """Whether the recomputed layer's output is alive while the layer's backward runs (a hook
    on a tensor inside the layer, whose gradient is made mid-backward)."""
    from torch.utils.checkpoint import checkpoint

    outputs: list[weakref.ref[Any]] = []
    seen: dict[str, bool] = {}
    w = torch.randn(16, 16)

    def layer(x: Any) -> Any:
        h = torch.relu(x @ w)
        if torch.is_grad_enabled():  # the recompute (reentrant) or the first run (not)
            h.register_hook(lambda g: seen.__setitem__("alive", outputs[-1]() is not None))
        out = x + h @ w  # a new tensor no node saves
        outputs.append(weakref.ref(out))
        return out

    x = torch.randn(4, 16, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=reentrant)
    z = y * 2
    del y
    z.sum().backward()
    return seen["alive"]


def test_torch_reentrant_checkpoint_holds_the_recomputed_output() -> None:
    assert _output_alive_in_backward(reentrant=True)
    assert not _output_alive_in_backward(reentrant=False)
