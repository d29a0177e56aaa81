"""``zero_grad()``'s default follows ``--torch-version`` (Note [zero_grad's default by release]
in trainmem/specs/frameworks.py): torch 2.0 made ``set_to_none=True`` the default of
``Optimizer.zero_grad`` and ``Module.zero_grad`` (pytorch PR #92731); before, the gradients
stayed allocated, zeroed, through the next forward. DeepSpeed's ZeRO optimizers and Megatron's
gradient buffer have their own. An explicit value always wins.

Bytes by hand: GPT-2 small has 124,439,808 parameters (wte 50,257 x 768 = 38,597,376, wpe
1,024 x 768 = 786,432, 12 blocks of 7,087,872 = 85,054,464, ln_f 1,536; the head is tied);
fp32 weights give fp32 gradients, 4 B each, 497,759,232 B, all alive at the peak (the start
of the backward, where freed gradients have not been made yet) when they are kept.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import InvokeJson
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

GPT2_PARAMETERS = 38_597_376 + 786_432 + 12 * 7_087_872 + 1_536


@pytest.mark.parametrize(
    ("framework", "torch_version", "frees"),
    [
        ("pytorch-amp", None, True),  # a current release
        ("pytorch-amp", "2.0", True),
        ("pytorch-amp", "1.13.1", False),
        ("pytorch-amp", "1.8.1", False),
        ("hf-trainer", "1.10", False),  # Trainer's model.zero_grad(), torch's default
        ("hf-trainer", "2.1", True),
        ("deepspeed", "1.13", True),  # its ZeRO optimizer's own zero_grad
        ("megatron", "1.13", True),  # its gradient buffer, zeroed in place
    ],
)
def test_the_default_follows_the_release(
    framework: str, torch_version: str | None, frees: bool
) -> None:
    t = TrainingConfig(framework=framework, torch_version=torch_version)
    assert t.zero_grad_set_to_none is frees


@pytest.mark.parametrize(("torch_version", "given"), [("1.13", True), ("2.0", False)])
def test_an_explicit_value_wins(torch_version: str, given: bool) -> None:
    t = TrainingConfig(torch_version=torch_version, zero_grad_set_to_none=given)
    assert t.zero_grad_set_to_none is given


def test_mmsegmentation_cells_need_no_flag() -> None:
    # benchmarks/published_probe_vision.py's settings on torch 1.8.1 (mmcv 1.x's
    # optimizer.zero_grad()): the same configuration with and without --zero-grad-keep
    cell: dict[str, Any] = {
        "optimizer": "adamw",
        "data_parallel_size": 8,
        "attention": "eager",
        "torch_version": "1.8.1",
        "precision": "16-mixed",
        "micro_batch_size": 2,
    }
    assert TrainingConfig(**cell) == TrainingConfig(**cell, zero_grad_set_to_none=False)


def _peak(**fields: Any) -> int:
    training = TrainingConfig(micro_batch_size=2, seq_len=512, precision="32-true", **fields)
    return estimate("gpt2", training, engine="analytic").breakdown.allocated_bytes


def test_kept_gradients_on_torch_1_13() -> None:
    kept = _peak(torch_version="1.13")
    freed = _peak(torch_version="1.13", zero_grad_set_to_none=True)
    assert kept - freed == 4 * GPT2_PARAMETERS == 497_759_232


def test_the_command_line_follows_the_release(invoke_json: InvokeJson) -> None:
    args = ("estimate", "gpt2", "-b", "1", "-s", "128", "--torch-version", "1.13")
    assert invoke_json(*args)["config"]["zero_grad_set_to_none"] is False
    given = invoke_json(*args, "--zero-grad-set-to-none")["config"]["zero_grad_set_to_none"]
    assert given is True
    newer = invoke_json("estimate", "gpt2", "-b", "1", "-s", "128", "--torch-version", "2.0")
    assert newer["config"]["zero_grad_set_to_none"] is True


# accelerate's AcceleratedOptimizer.zero_grad(set_to_none=None) passes set_to_none=False
# before 0.28.0 (src/accelerate/optimizer.py v0.27.0 ``if set_to_none is None: set_to_none =
# False``; v0.28.0 ``True``), whatever torch's default; the HF Trainer calls model.zero_grad().
@pytest.mark.parametrize(
    ("framework", "accelerate_version", "frees"),
    [
        ("accelerate-fsdp", "0.27.2", False),
        ("accelerate-fsdp", "0.28.0", True),
        ("accelerate-fsdp", None, True),  # a current release
        ("hf-trainer", "0.27.2", True),  # torch's Module.zero_grad on torch 2.x
        ("pytorch-amp", "0.27.2", True),  # not accelerate's optimizer
    ],
)
def test_accelerates_optimizer_follows_its_release(
    framework: str, accelerate_version: str | None, frees: bool
) -> None:
    sharded = {"zero_stage": 3, "data_parallel_size": 2} if framework == "accelerate-fsdp" else {}
    t = TrainingConfig(
        framework=framework, torch_version="2.1", accelerate_version=accelerate_version, **sharded
    )
    assert t.zero_grad_set_to_none is frees
    # a given value wins
    given = TrainingConfig(
        framework=framework,
        accelerate_version=accelerate_version,
        zero_grad_set_to_none=not frees,
        **sharded,
    )
    assert given.zero_grad_set_to_none is (not frees)


def test_accelerate_0_27_keeps_the_gradient_shards() -> None:
    """GPT-2 small in fp32 under accelerate's FSDP over 2 ranks: each rank's flat gradient
    shard, 4 B x 124,439,808 / 2 = 248,879,616 B, stays allocated through the next forward."""

    def peak(**fields: Any) -> int:
        training = TrainingConfig(
            micro_batch_size=2,
            seq_len=512,
            precision="32-true",
            framework="accelerate-fsdp",
            zero_stage=3,
            data_parallel_size=2,
            **fields,
        )
        return estimate("gpt2", training, engine="analytic").breakdown.allocated_bytes

    kept = peak(accelerate_version="0.27.0")
    assert kept - peak(accelerate_version="0.28.0") == 4 * GPT2_PARAMETERS // 2 == 248_879_616


def test_the_trainers_fsdp_keeps_its_own_zero_grad(invoke_json: InvokeJson) -> None:
    args = ("estimate", "gpt2", "-b", "1", "-s", "128", "--fsdp", "full-shard")
    args += ("--data-parallel-size", "2", "--accelerate-version", "0.27.0")
    own = invoke_json(*args, "--framework", "accelerate-fsdp")["config"]
    assert own["zero_grad_set_to_none"] is False
    trainer = invoke_json(*args, "--framework", "hf-trainer")["config"]
    assert trainer["framework"] == "accelerate-fsdp"
    assert trainer["zero_grad_set_to_none"] is True
