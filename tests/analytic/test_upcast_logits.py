"""Note [The upcast 16-bit logits] (analytic/loss.py ``upcast_logits_bytes``): transformers'
Llama before 4.46 rebinds ``logits = logits.float()``, so the LM head's 16-bit output is freed at
the upcast; under a loop that holds the fp32 logits the schedule frees it there."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

from trainmem.analytic.loss import upcast_logits_bytes
from trainmem.estimate import estimate, resolve_model
from trainmem.schedule import Item, Repeat
from trainmem.specs.training import TrainingConfig


def _qlora(**kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "fsdp-qlora",
        "precision": "bf16-true",
        "micro_batch_size": 2,
        "seq_len": 512,
        "activation_checkpointing": "full",
        "data_parallel_size": 2,
        "zero_stage": 3,
        "lora_rank": 64,
        "transformers_version": "4.40.0",
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_bytes_are_the_lm_head_output_where_the_model_upcasts() -> None:
    model = resolve_model("llama-2-7b")
    # 2 x 512 tokens x 32000 x 2 B
    assert upcast_logits_bytes(model, _qlora()) == 65_536_000
    # transformers 4.46 returns the lm_head output itself; the Trainer's loop holds nothing
    assert upcast_logits_bytes(model, _qlora(transformers_version="4.46.0")) == 0
    assert upcast_logits_bytes(model, _qlora(loop="drop")) == 0


def _flat(items: list[Item]) -> list[tuple[str, str, int]]:
    out: list[tuple[str, str, int]] = []
    for item in items:
        if isinstance(item, Repeat):
            out += _flat(list(item.body))  # the layers: no logits there
        else:
            out.append((item.action, item.key, item.size_bytes))
    return out


def test_schedule_frees_the_16_bit_logits_at_the_upcast() -> None:
    est = estimate("llama-2-7b", _qlora(), simulate_allocator=False)
    steps = _flat(list(est.schedules[0].step))
    ops = [op for op in steps if op[1].startswith("logits") and op[2] > 0]  # 0 B: no event
    # the 16-bit output (65,536,000 B), the fp32 logits the loop keeps (131,072,000 B) made from
    # it, the 16-bit one freed, then the loss's shifted fp32 copy (2 x 511 x 32000 x 4 B)
    assert ops[:4] == [
        ("alloc", "logits16/upcast", 65_536_000),
        ("alloc", "logits_kept", 131_072_000),
        ("free", "logits16/upcast", 65_536_000),
        ("alloc", "logits/shifted", 130_816_000),
    ]


torch = pytest.importorskip("torch")


def test_torch_frees_the_output_at_the_rebinding() -> None:
    head = torch.nn.Linear(8, 32, bias=False).to(torch.bfloat16)
    head.weight.requires_grad_(False)  # LoRA: the head is frozen
    hidden = torch.randn(2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    refs: list[weakref.ref[Any]] = []
    logits = head(hidden)
    refs.append(weakref.ref(logits))
    logits = logits.float()
    assert refs[0]() is None  # no node saved the 16-bit output
    logits[..., :-1, :].contiguous().logsumexp(-1).sum().backward()
