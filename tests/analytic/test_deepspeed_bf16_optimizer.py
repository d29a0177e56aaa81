"""DeepSpeed's BF16_Optimizer keeps two gradients (Note [BF16_Optimizer's two gradients]):
bytes derived by hand from deepspeed/runtime/bf16_optimizer.py and engine.py (v0.16.4 to
v0.19.5) for GPT-2 small, checked against the analytic schedule."""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.specs.frameworks import (
    deepspeed_bf16_grads_released,
    deepspeed_bf16_immediate_grad_update,
)
from trainmem.specs.training import TrainingConfig

# GPT-2 small: 124,439,808 trainable elements; the largest tensor is the (tied) token
# embedding, 50,257 x 768 = 38,597,376 elements
PSI = 124_439_808
WTE = 50_257 * 768
STEPS = 2  # the schedule expands the warm-up step and the step after it


def _events(**kw: object) -> list[tuple[str, int, str, str, str]]:
    t = TrainingConfig(
        framework="deepspeed",
        micro_batch_size=2,
        seq_len=64,
        data_parallel_size=2,
        **kw,  # type: ignore[arg-type]
    )
    assert t.deepspeed_optimizer == "bf16"
    est = estimate("gpt2", t, engine="analytic", simulate_allocator=False)
    return [
        (e.action, e.size_bytes, str(e.category), str(e.phase), e.module)
        for e in est.schedules[0].expand()
    ]


def _grad_bytes(events: list[tuple[str, int, str, str, str]], action: str, phase: str) -> int:
    return sum(
        size
        for a, size, cat, ph, module in events
        if a == action and cat.endswith("GRADIENT") and ph == phase and module != "(model)"
    )


def test_release_and_immediate_update_follow_the_release() -> None:
    # 0.16.4: clear_lp_grads() (set_to_none) at the start of BF16_Optimizer.backward, no
    # zero_grad; 0.16.5 (b418cf6c1): zeroed in place there, zero_grad(set_to_none=True) after
    # the step under ZeRO only (engine.py _take_model_step)
    assert deepspeed_bf16_grads_released(0, (0, 16, 4)) == "backward"
    assert deepspeed_bf16_grads_released(1, (0, 16, 4)) == "backward"
    assert deepspeed_bf16_grads_released(0, (0, 16, 5)) == "never"
    assert deepspeed_bf16_grads_released(1, (0, 19, 5)) == "step"
    # constants.py default False, True from 0.16.5; precision_config.py False from 0.17.1
    assert [
        deepspeed_bf16_immediate_grad_update(v)
        for v in ((0, 14, 4), (0, 16, 4), (0, 16, 5), (0, 17, 0), (0, 17, 1), (0, 19, 5))
    ] == [False, False, True, True, False, False]


def test_fp32_buffer_from_init_beside_the_bf16_grads() -> None:
    events = _events(deepspeed_version="0.16.4")
    # _setup_for_real_optimizer: zeros_like(bf16_groups_flat, dtype=fp32), the flat group
    # padded to a multiple of 2 x 2 (124,439,808 already is), not partitioned, never freed
    buffer = [e for e in events if e[2].endswith("GRADIENT") and e[4] == "(model)"]
    assert buffer == [("alloc", 4 * PSI, "MemoryCategory.GRADIENT", "forward", "(model)")]
    # the bf16 .grad of the previous step live through the forward and are freed by
    # clear_lp_grads() before loss.backward() (phase zero_grad), then made again: 2 B each
    assert _grad_bytes(events, "free", "zero_grad") == STEPS * 2 * PSI
    assert _grad_bytes(events, "alloc", "backward") == STEPS * 2 * PSI
    # update_hp_grads after the backward: lp.grad.to(fp32) of one tensor at a time, the
    # largest the token embedding's: 4 x 38,597,376
    copies = [e for e in events if e[3] == "backward" and e[4] == "(model)" and e[0] == "alloc"]
    assert [e[1] for e in copies] == STEPS * [4 * WTE]


def test_zero1_frees_the_bf16_grads_after_the_step() -> None:
    # ZeRO-1 with fp32 accumulation runs BF16_Optimizer; from 0.16.5 its zero_grad frees the
    # bf16 .grad after optimizer.step(), none is alive in the next forward
    events = _events(zero_stage=1, grad_accum_dtype="float32")
    assert _grad_bytes(events, "alloc", "backward") == STEPS * 2 * PSI
    assert _grad_bytes(events, "free", "zero_grad") == STEPS * 2 * PSI
    phases = [ph for a, _, _, ph, _ in events if a == "free" and ph == "zero_grad"]
    last_optimizer = max(i for i, e in enumerate(events) if e[3] == "optimizer")
    first_free = min(i for i, e in enumerate(events) if e[0] == "free" and e[3] == "zero_grad")
    assert phases and first_free > last_optimizer


def test_without_zero_from_0_16_5_the_bf16_grads_are_never_freed() -> None:
    # clear_lp_grads(set_to_none=False) zeroes them in place; _take_model_step's `pass`
    events = _events(deepspeed_version="0.17.5")
    assert _grad_bytes(events, "free", "zero_grad") == 0
    assert _grad_bytes(events, "alloc", "backward") == 0
    kept = sum(e[1] for e in events if e[0] == "alloc" and e[2].endswith("GRADIENT"))
    assert kept == 4 * PSI + 2 * PSI
