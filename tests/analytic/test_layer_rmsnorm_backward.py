"""Each layer's RMSNorm backward holds five fp32 (tokens x h) transients beside its saved
fp32 input (Note [Final RMSNorm's backward], the layers' norms: analytic/schedule.py
``_Layers._norm_backward``, analytic/head.py ``layer_norm_backward_bytes``).

transformers' ``LlamaRMSNorm.forward`` is written out (``x.to(float32)``, ``pow(2)``,
``mean(-1)``, ``rsqrt``, ``x * rstd``, ``.to(dtype)``, ``weight *``); its backward runs those
ops' derivatives.yaml formulas over (tokens x h) in fp32. On the agreement model (2-layer
2048-wide Llama, 2 x 256 = 512 tokens) each transient is 4 B x 512 x 2048 = 4,194,304 B.
"""

from __future__ import annotations

from conftest import MODELS_DIR, layer_bodies
from trainmem.estimate import estimate
from trainmem.schedule import Op
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H = 2 * 256, 2048


def _layer_body(model: str, seq_len: int = 256, **changes: object) -> list[Op]:
    training = TrainingConfig(micro_batch_size=2, seq_len=seq_len, **changes)  # type: ignore[arg-type]
    est = estimate(model, training, engine="analytic", simulate_allocator=False)
    return layer_bodies(est.schedules[0].step)[0]


def test_each_layer_norm_backward_holds_five_fp32_tensors_before_its_saved_input_is_freed() -> None:
    ops = _layer_body(AGREEMENT, precision="bf16-true", optimizer="sgd")
    keys = [(op.action, op.key) for op in ops]
    for term in ("mlp/norm", "attention/norm"):
        tmp = [op for op in ops if op.key.startswith(f"{term}_tmp/")]
        assert [op.size_bytes for op in tmp if op.action == "alloc"] == [4 * T * H] * 5
        # all five alive at once: the five allocations come before any of their frees
        allocs = [keys.index(("alloc", op.key)) for op in tmp if op.action == "alloc"]
        frees = [keys.index(("free", op.key)) for op in tmp if op.action == "alloc"]
        assert max(allocs) < min(frees)
    # the input norm's backward runs after q's, k's and v's gradients are made (the layer's
    # last backward): every gradient op of the layer precedes its transients
    first_tmp = keys.index(("alloc", "attention/norm_tmp/0"))
    grads = [k for k, op in enumerate(ops) if op.category.value == "gradients"]
    assert max(grads) < first_tmp


def test_layer_norm_transients_peak_the_step_as_on_the_trace() -> None:
    # SGD keeps every gradient; layer 0's input norm runs last: all the layers' gradients
    # (bf16: 2 B x the layers' parameters) beside its five transients. The trace (generic
    # path) peaks there at 455,393,800 B; the formulas without the layers' norms peaked at
    # the embedding's gradient, 445,038,592 B (-2.3 %); within 1 % now.
    training = TrainingConfig(micro_batch_size=2, seq_len=256, precision="bf16-true",
                              optimizer="sgd")  # fmt: skip
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    peak = est.schedules[0].peak()
    assert peak.label == "an RMSNorm's fp32 backward transients"
    # five 4,194,304 B transients + the 2 x 8,519,680 B cuBLAS workspaces + the residual
    # stream's 2 MiB bf16 gradient (2 B x T x H) = 40,108,032 B of temporaries at the peak
    assert peak.by_category[next(c for c in peak.by_category if c.value == "temporary")] == (
        5 * 4 * T * H + 2 * 8_519_680 + 2 * T * H
    )
    assert abs(est.breakdown.allocated_bytes / 455_393_800 - 1) < 0.01


def test_layernorm_models_have_no_such_transients() -> None:
    # LayerNorm's backward is one kernel (GPT-2): nothing added
    ops = _layer_body("tiny-gpt2-test", seq_len=64)
    assert not [op for op in ops if op.key.endswith(tuple(f"norm_tmp/{k}" for k in range(5)))]
