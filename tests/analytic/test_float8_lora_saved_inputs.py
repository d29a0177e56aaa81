"""Note [Frozen float8 linears save their input] (analytic/float8.py), by hand on the 2-layer
Qwen2 formula config (tests/models/formula/qwen2.json: h = 64, i = 128, all sizes multiples of
16, so torchtitan's filter converts every layer linear) at 2 x 64 tokens, t = 128, LoRA on q
and v. torchao 0.18's ``matmul_with_hp_or_float8_args.forward`` calls
``ctx.save_for_backward(input_hp, weight_hp_t)`` whatever ``needs_input_grad`` says, so the
frozen gate / up keep the MLP norm's output (c h t) and the frozen down keeps act(gate) * up
(c i t), where a frozen ``F.linear`` keeps neither; the Function releases them when its
backward returns, after the weight gradient it computes anyway."""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
T, H, FFN = 128, 64, 128
C = 2  # bf16: FSDP2's MixedPrecisionPolicy(param_dtype=bf16), no autocast
FSDP2: dict[str, Any] = {"data_parallel_size": 4, "zero_stage": 3, "framework": "fsdp2"}


def _estimate(**changes: Any) -> Any:
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, lora_rank=8, lora_targets=("q", "v"), **changes
    )
    return estimate(QWEN2, training, engine="analytic", simulate_allocator=False)


def test_frozen_float8_linears_keep_their_inputs() -> None:
    terms = _estimate(precision="fp8-mixed", **FSDP2).details["activation_terms_per_layer_bytes"]
    assert terms["mlp/down_input"] == C * FFN * T  # 32,768 B
    assert terms["mlp/input"] == C * H * T  # 16,384 B
    bf16 = _estimate(precision="bf16-true", **FSDP2).details["activation_terms_per_layer_bytes"]
    assert (bf16["mlp/down_input"], bf16["mlp/input"]) == (0, 0)


def test_compiled_float8_lora_keeps_the_frozen_rule() -> None:
    terms = _estimate(precision="fp8-mixed", compile=True, **FSDP2).details[
        "activation_terms_per_layer_bytes"
    ]
    assert terms["mlp/down_input"] == 0  # the partition recasts (Note [Compiled float8 linears])


def _flat(items: tuple[Item, ...] | list[Item]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += _flat(list(item.body)) if isinstance(item, Repeat) else [item]
    return out


def test_down_input_freed_after_the_frozen_weight_gradient() -> None:
    est = _estimate(precision="fp8-mixed", **FSDP2)
    ops = [op for op in _flat(list(est.schedules[0].step)) if op.phase == "backward"]
    weight = next(k for k, op in enumerate(ops) if op.key == "mlp_tmp/weight")
    assert ops[weight].size_bytes == C * FFN * H  # the frozen down weight's gradient, c i h
    # the saved down input (c i t) is freed only after that gradient was made
    frees = [
        k
        for k, op in enumerate(ops)
        if op.action == "free" and op.size_bytes == C * FFN * T and op.key.startswith("act/")
    ]
    assert frees and frees[0] > weight
