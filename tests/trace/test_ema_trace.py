"""``--ema`` traced for real (issue 26): the EMA copy is registered as a parameter before the
step and ``EMAModel.step``'s update runs after the optimizer, so the traced and composed
(generic) steps agree with the analytic engine's hand-derived bytes."""

from __future__ import annotations

import dataclasses

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")

N = 124_439_808  # GPT-2 small
WTE = 50_257 * 768
BASE = TrainingConfig(seq_len=128, precision="bf16-true", optimizer_implementation="foreach")


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_traced_ema_copy_is_a_parameter(engine: str) -> None:
    plain = estimate("gpt2", BASE, engine=engine).breakdown
    ema = estimate("gpt2", dataclasses.replace(BASE, ema=True), engine=engine).breakdown
    assert ema.parameters - plain.parameters == 2 * N
    analytic = estimate("gpt2", dataclasses.replace(BASE, ema=True), engine="analytic").breakdown
    assert ema.parameters == analytic.parameters
    assert abs(ema.allocated_bytes - analytic.allocated_bytes) <= 4096


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_offloaded_ema_is_moved_to_the_gpu_for_its_step(engine: str) -> None:
    cpu = dataclasses.replace(BASE, ema=True, ema_device="cpu", optimizer_implementation="fused")
    traced = estimate("gpt2", cpu, engine=engine)
    analytic = estimate("gpt2", cpu, engine="analytic")
    assert traced.breakdown.parameters == 2 * N  # the weights only
    assert traced.peak_phase == "optimizer"
    # 2 B x N moved + (s_param - param) and its product for wte + two cuBLAS workspaces
    assert traced.breakdown.temporary == 2 * N + 2 * 2 * WTE + 2 * 8_519_680
    assert abs(traced.breakdown.allocated_bytes - analytic.breakdown.allocated_bytes) <= 4096
