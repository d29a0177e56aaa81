"""An EMA copy of the trainable weights (issue 26, ``--ema``): hand-derived bytes on GPT-2 small
(124,439,808 parameters, the largest tensor the 50,257 x 768 token embedding), and the one-line
refusals. See Note [EMA weights] in ``analytic/tensor_states.py``."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import Invoke
from trainmem.analytic.temporaries import ema_step_temporary_bytes
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

N = 124_439_808  # GPT-2 small, sum(p.numel())
WTE = 50_257 * 768  # the largest trainable tensor
BASE = TrainingConfig(seq_len=128, precision="32-true", optimizer_implementation="fused")


def _params(training: TrainingConfig) -> int:
    return estimate("gpt2", training, engine="analytic").breakdown.parameters


@pytest.mark.parametrize(("ema_dtype", "per_element"), [(None, 4), ("float32", 4), ("bfloat16", 2)])
def test_ema_adds_a_persistent_copy_of_the_trainable_weights(
    ema_dtype: str | None, per_element: int
) -> None:
    with_ema = dataclasses.replace(BASE, ema=True, ema_dtype=ema_dtype)
    assert _params(with_ema) - _params(BASE) == per_element * N  # 4 B x 124,439,808 in fp32


def test_ema_of_bf16_weights_is_bf16() -> None:
    base = dataclasses.replace(BASE, precision="bf16-true")
    assert _params(dataclasses.replace(base, ema=True)) - _params(base) == 2 * N


def test_ema_on_the_cpu_holds_nothing_and_moves_the_copy_for_its_step() -> None:
    cpu = dataclasses.replace(BASE, ema=True, ema_device="cpu")
    assert _params(cpu) == _params(BASE)
    # EMAModel.step per parameter: (s_param - param) and its product, 2 x 4 B x the largest;
    # --offload_ema: ema_unet.to("cuda") first, 4 B x N
    assert ema_step_temporary_bytes(cpu, N, WTE) == 4 * N + 2 * 4 * WTE
    assert ema_step_temporary_bytes(dataclasses.replace(cpu, ema_device="cuda"), N, WTE) == (
        2 * 4 * WTE
    )
    # bf16 copy of fp32 weights: the difference promotes to fp32
    bf16 = dataclasses.replace(cpu, ema_dtype="bfloat16")
    assert ema_step_temporary_bytes(bf16, N, WTE) == 2 * N + 2 * 4 * WTE


def test_the_step_peak_grows_by_the_moved_copy() -> None:
    # fused AdamW has no temporaries: the step's peak temporary is the EMA update's
    plain = estimate("gpt2", BASE, engine="analytic")
    cpu = estimate("gpt2", dataclasses.replace(BASE, ema=True, ema_device="cpu"), engine="analytic")
    assert cpu.peak_phase == "optimizer"
    assert cpu.breakdown.temporary - 2 * 8_519_680 == 4 * N + 2 * 4 * WTE  # - cuBLAS
    assert cpu.breakdown.allocated_bytes > plain.breakdown.allocated_bytes


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (dict(ema_dtype="bfloat16"), "ema_dtype"),
        (dict(ema_device="cpu"), "ema_device"),
        (dict(ema=True, ema_dtype="float16"), "ema_dtype"),
        (dict(ema=True, ema_device="nvme"), "ema_device"),
        (dict(ema=True, offload="optimizer"), "ema"),
        (dict(ema=True, optimizer_in_backward=True), "ema"),
        (dict(ema=True, tensor_parallel_size=2), "ema"),
        (dict(ema=True, data_parallel_size=8, zero_stage=3), "ema"),
        (dict(ema=1), "ema"),
    ],
)
def test_ema_settings_are_validated(settings: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError, match=f"^{field}"):
        TrainingConfig(**settings)  # type: ignore[arg-type]


def test_a_refusal_is_one_line(invoke: Invoke) -> None:
    args = ["estimate", "gpt2", "-s", "128", "--ema", "--offload", "optimizer", "--zero-stage", "2"]
    r = invoke(*args, exit_code=2)  # a usage error
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ema: "), r.stderr
