"""torchao's eager float8 casts of the MLP linears' fp32 weights (Note [Float8 casts of a base
weight], analytic/float8.py; the transform analytic/transforms/float8.py).

Hand derivation from torchao 0.18's code on the agreement model (2-layer 2048-wide Llama, i =
5,632, 2 x 256 = 512 tokens), LoRA r16 with ``fp8-mixed`` (fp32 base weights, not FSDP): a cast of
n values (float8_scaling_utils.py ``hp_tensor_to_float8_dynamic``) holds, at its ``.to(float8)``,
``tensor.to(float32) * scale`` (4 n B; float8_training_tensor.py ``_ToFloat8ConstrFunc.forward``),
its ``clamp`` (4 n B; float8_utils.py ``to_fp8_saturated``) and the float8 result (n B); the two
fp32 copies die as the cast returns. For the down projection n = 5,632 x 2,048 = 11,534,336: two
46,137,344 B copies and an 11,534,336 B float8 weight. ``matmul_with_hp_or_float8_args`` casts the
other operand first (the same three tensors, 4 m + 4 m + m B for m values) and keeps its float8
copy (1 B a value) through the matmul: in the forward down's input, m = 512 x 5,632 = 2,883,584; in
the backward the gradient of down's output, m = 512 x 2,048 = 1,048,576, before
``cast_config_weight_for_grad_input`` casts the weight again. Under FSDP2 the weight arrives
all-gathered in float8 and only the operand is cast. The backward never reads
``ctx.needs_input_grad``: the frozen weight's gradient is computed too, in the output
gradient's dtype, 2 x 11,534,336 = 23,068,672 B, and dropped by autograd.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.float8 import float8_eager_casts, float8_weight_cast_bytes
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
N = 5632 * 2048
FP8_LORA: dict[str, Any] = {"lora_rank": 16, "precision": "fp8-mixed"}


def _training(**settings: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=256, **settings)


def _casts(body: list[Any], label_part: str) -> list[tuple[str, str, int]]:
    return [
        (op.action, op.key, op.size_bytes)
        for op in body
        if op.key.startswith("float8/") and label_part in op.label
    ]


def _cast_ops(operand: int, weight: bool = True) -> list[tuple[str, str, int]]:
    """One cast (fp32 scaled copy, its clamp, the float8 copy; the fp32 copies freed as it
    returns) of the operand, then of the weight; the float8 copies freed after the matmul."""
    out: list[tuple[str, str, int]] = []
    casts = [("operand", operand)] + ([("", N)] if weight else [])
    for name, m in casts:
        keys = [f"{name}_scaled", f"{name}_clamped", name] if name else ["scaled", "clamped",
                                                                          "weight"]  # fmt: skip
        sizes = [4 * m, 4 * m, m]
        out += [("alloc", f"float8/{k}", size) for k, size in zip(keys, sizes, strict=True)]
        out += [("free", f"float8/{k}", size) for k, size in zip(keys[:2], sizes, strict=False)]
    if weight:
        out.append(("free", "float8/weight", N))
    return [*out, ("free", "float8/operand", operand)]


def test_down_projection_casts_in_forward_and_backward() -> None:
    est = estimate(AGREEMENT, _training(**FP8_LORA), engine="analytic", simulate_allocator=False)
    step = est.schedules[0].step
    forward = layer_bodies(step, marker="down_held/0")[-1]
    assert _casts(forward, "down's input and weight") == _cast_ops(512 * 5632)
    backward = layer_bodies(step)[-1]
    ops = _casts(backward, "down's output gradient")
    assert ops == _cast_ops(512 * 2048)
    # down's input gradient is made once the fp32 copies are freed, beside the float8 weight
    keys = [(op.action, op.key) for op in backward]
    made = keys.index(("alloc", "mlp_tmp"))
    assert keys.index(("free", "float8/clamped")) < made < keys.index(("free", "float8/weight"))
    # the frozen weight's gradient, computed in bf16 (c i h) and dropped by autograd
    assert [op.size_bytes for op in backward if op.key == "mlp_tmp/weight"] == [2 * N, 2 * N]
    # the forward's peak is the cast at layer 1's down projection, with every saved block alive
    peak = est.schedules[0].peak()
    label = "torchao's float8 casts of down's input and weight"
    assert (peak.phase, peak.label) == ("forward", label)
    fkeys = [(op.action, op.key, op.label) for op in forward]
    saved = [k for k, (action, key, _) in enumerate(fkeys) if action == "alloc" and "act/" in key]
    down = [k for k, (a, key, label) in enumerate(fkeys)
            if (a, key) == ("alloc", "float8/scaled") and "down's" in label]  # fmt: skip
    assert max(saved) < down[0]


def test_a_checkpointed_layer_casts_again_in_its_recompute() -> None:
    training = _training(**FP8_LORA, activation_checkpointing="full")
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    body = layer_bodies(est.schedules[0].step)[-1]
    assert _casts(body, "the recomputed down's") == _cast_ops(512 * 5632)
    keys = [(op.action, op.key) for op in body]
    held = [k for k, (a, key) in enumerate(keys) if a == "alloc" and key.startswith("up_held/")]
    assert held and max(held) < keys.index(("alloc", "float8/scaled"))


def test_where_the_casts_apply() -> None:
    model = resolve_model(AGREEMENT)
    assert float8_eager_casts(model, _training(**FP8_LORA))
    assert float8_eager_casts(model, _training(precision="fp8-mixed"))  # full fine-tuning too
    assert float8_eager_casts(model, _training(**FP8_LORA, data_parallel_size=4))
    assert float8_weight_cast_bytes(model, _training(**FP8_LORA)) == (4 * N, 4 * N, N)
    assert not float8_eager_casts(model, _training(lora_rank=16))  # bf16-mixed
    # compile's fused casts, a GPTQ base (not converted), torchao's float8 TP styles
    assert not float8_eager_casts(model, _training(**FP8_LORA, compile=True))
    assert not float8_eager_casts(model, _training(**FP8_LORA, quantize_base="gptq-int4"))
    assert not float8_eager_casts(model, _training(**FP8_LORA, tensor_parallel_size=2))
    # FSDP2 all-gathers the weight in float8: the operands are still cast, the weight not
    fsdp2 = _training(**FP8_LORA, data_parallel_size=4, zero_stage=3, framework="fsdp2")
    assert float8_eager_casts(model, fsdp2)
    assert float8_weight_cast_bytes(model, fsdp2) == ()


def test_under_fsdp2_only_the_operands_are_cast() -> None:
    training = _training(**FP8_LORA, data_parallel_size=4, zero_stage=3, framework="fsdp2")
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    step = est.schedules[0].step
    forward = layer_bodies(step, marker="down_held/0")[-1]
    assert _casts(forward, "down's input and weight") == _cast_ops(512 * 5632, weight=False)
    backward = layer_bodies(step)[-1]
    assert _casts(backward, "down's output gradient") == _cast_ops(512 * 2048, weight=False)


def test_the_weight_gradients_operands_are_cast_after_the_input_gradient() -> None:
    # ``matmul_with_hp_or_float8_args.backward``: grad_input first, then the output gradient
    # (m = 512 x 2,048) and down's saved input (m = 512 x 5,632) cast along dim 1, each
    # 4 m + 4 m + m, and ``torch._scaled_mm``'s layout copy of each float8 operand (m) before
    # the frozen weight's gradient (2 x 11,534,336 B) is computed
    est = estimate(AGREEMENT, _training(**FP8_LORA), engine="analytic", simulate_allocator=False)
    body = layer_bodies(est.schedules[0].step)[-1]
    ops = [(op.action, op.key, op.size_bytes) for op in body]
    go, x = 512 * 2048, 512 * 5632
    grad_input = ops.index(("alloc", "mlp_tmp", 2 * x))
    grad_weight = ops.index(("alloc", "mlp_tmp/weight", 2 * N))
    assert ops[grad_input + 1 : grad_weight] == [
        ("alloc", "float8/grad_output_dim1_scaled", 4 * go),
        ("alloc", "float8/grad_output_dim1_clamped", 4 * go),
        ("alloc", "float8/grad_output_dim1", go),
        ("free", "float8/grad_output_dim1_scaled", 4 * go),
        ("free", "float8/grad_output_dim1_clamped", 4 * go),
        ("alloc", "float8/input_dim1_scaled", 4 * x),
        ("alloc", "float8/input_dim1_clamped", 4 * x),
        ("alloc", "float8/input_dim1", x),
        ("free", "float8/input_dim1_scaled", 4 * x),
        ("free", "float8/input_dim1_clamped", 4 * x),
        ("alloc", "float8/grad_output_layout", go),
        ("alloc", "float8/input_layout", x),
    ]
    # the float8 operands die once the weight gradient exists
    assert ops.index(("free", "float8/input_dim1", x)) > grad_weight
