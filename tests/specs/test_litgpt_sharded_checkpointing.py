"""litgpt checkpoints every ``Block`` whenever its fine-tuning scripts shard, so an estimate
with ``--framework litgpt`` on more than one rank and no checkpointing given is one with
``full`` checkpointing (issue 26; ``FrameworkConventions.sharded_activation_checkpointing``).

Source: litgpt 0.5.13 litgpt/finetune/full.py ``setup``: ``if devices * num_nodes > 1:
strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
...)``; finetune/lora.py ``ModelParallelStrategy(parallelize_fn=parallelize_fn, ...)`` with
``parallelize_fn(model, device_mesh, activation_checkpointing=True)`` wrapping every block in
``checkpoint_wrapper``; lit-gpt @8641822 finetune/lora.py the FSDP1 form. No option turns it
off. litgpt/pretrain.py shards with ``FSDPStrategy(auto_wrap_policy={Block},
sharding_strategy="HYBRID_SHARD")`` and no checkpointing, so an explicit ``none`` is a real run.
"""

from __future__ import annotations

import pytest

from trainmem.specs.training import TrainingConfig, derived

_SHARDED = {"framework": "litgpt", "data_parallel_size": 2, "zero_stage": 3}


def test_litgpt_on_several_ranks_checkpoints_every_block_unless_told() -> None:
    assert TrainingConfig(**_SHARDED).activation_checkpointing == "full"  # type: ignore[arg-type]
    lora = TrainingConfig(**_SHARDED, lora_rank=8, lora_targets=("q", "v"))  # type: ignore[arg-type]
    assert lora.activation_checkpointing == "full"


@pytest.mark.parametrize("given", ["none", "selective"])
def test_an_explicit_checkpointing_wins(given: str) -> None:
    # pretrain.py's FSDP runs without checkpointing: the user's value is a real litgpt run
    made = TrainingConfig(**_SHARDED, activation_checkpointing=given)  # type: ignore[arg-type]
    assert made.activation_checkpointing == given


def test_one_gpu_and_other_frameworks_keep_no_checkpointing() -> None:
    # finetune/*.py use strategy="auto" on one device (no wrapper, no checkpointing)
    assert TrainingConfig(framework="litgpt").activation_checkpointing == "none"
    fsdp2 = TrainingConfig(framework="fsdp2", data_parallel_size=2, zero_stage=3)
    assert fsdp2.activation_checkpointing == "none"


def test_derived_resolves_a_reset_checkpointing_for_the_new_size() -> None:
    base = TrainingConfig(framework="litgpt")
    wider = derived(base, data_parallel_size=4, zero_stage=3, activation_checkpointing=None)
    assert wider.activation_checkpointing == "full"


def test_assumptions_say_which_litgpt_sharding_is_modelled() -> None:
    from trainmem.specs.assumptions import assumptions

    said = assumptions({"framework": "litgpt", "data_parallel_size": 2})["litgpt_sharding"]
    assert "FSDP1" in said and "0.5.11" in said and "FSDP2" in said
    assert "litgpt_sharding" not in assumptions({"framework": "litgpt", "data_parallel_size": 1})
