"""TrainingConfig refuses bad types, ranges and combinations with a SpecError naming the field;
check_training_for_model refuses settings the model cannot take (issue 17's fuzzing findings)."""

from __future__ import annotations

import dataclasses

import pytest

from trainmem.errors import SpecError
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import (
    TrainingConfig,
    check_training_for_model,
    pipeline_sizes,
    zero_stage_from,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lora_dropout": "0.1"}, "lora_dropout"),  # was a TypeError from the comparison
        ({"lora_dropout": float("nan")}, "lora_dropout"),
        ({"dropout": "no"}, "dropout"),  # was accepted, and kept dropout on
        ({"compile": 1}, "compile"),
        ({"zero_stage": 2.0}, "zero_stage"),  # 2.0 == 2 let a float through
        ({"zero_stage": True}, "zero_stage"),
        ({"micro_batch_size": 2.0}, "micro_batch_size"),
        ({"micro_batch_size": 2**31}, "micro_batch_size"),
        ({"lora_rank": 10**12}, "lora_rank"),  # was a MemoryError in the trace engine
        ({"lora_rank": 10**400}, "lora_rank"),  # was an OverflowError
        ({"seq_len": None}, "seq_len"),
        ({"precision": None}, "precision"),
        ({"precision": ["bf16-mixed"]}, "precision"),
        ({"lora_targets": "qv"}, "lora_targets"),  # a string would be read letter by letter
        ({"lora_rank": 8, "lora_targets": ()}, "lora_targets"),
        (
            {"optimizer_in_backward": True, "gradient_accumulation_steps": 4},
            "optimizer_in_backward",
        ),
        (  # was an internal ScheduleError from the formulas' step schedule
            {
                "optimizer_in_backward": True,
                "pipeline_parallel_size": 2,
                "pipeline_schedule": "gpipe",
            },
            "optimizer_in_backward",
        ),
        ({"seq_len": 1024, "context_parallel_size": 4096}, "context_parallel_size"),
        ({"seq_len": 1000, "context_parallel_size": 3}, "context_parallel_size"),
    ],
)
def test_bad_settings_name_their_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as info:
        TrainingConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_good_combinations_still_pass() -> None:
    TrainingConfig(optimizer_in_backward=True, gradient_accumulation_steps=1)
    TrainingConfig(seq_len=4096, context_parallel_size=8)
    TrainingConfig(lora_rank=8, lora_dropout=0)  # an int probability is fine
    TrainingConfig(micro_batch_size=2**31 - 1)


def test_fsdp_and_a_different_zero_stage_conflict() -> None:
    assert zero_stage_from(0, "full-shard") == 3
    assert zero_stage_from(3, "full-shard") == 3
    # SHARD_GRAD_OP, commonly called ZeRO-2, is modelled as stage 3 without resharding
    assert zero_stage_from(2, "shard-grad-op") == 3
    with pytest.raises(SpecError, match="fsdp: full-shard shards like ZeRO stage 3 but"):
        zero_stage_from(1, "full-shard")


def test_pipeline_sizes_leave_every_stage_a_layer() -> None:
    # L = 32, ceil split: p = 9 gives 4 layers per stage and 32 - 8 * 4 = 0 for the last;
    # p = 12 gives 3 and 32 - 11 * 3 = -1 (the -1 layers the fuzzer saw); p = 16 gives 2, 2.
    assert pipeline_sizes(32) == [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32]
    assert pipeline_sizes(1) == [1]


@pytest.mark.parametrize("p", [9, 12, 31])
def test_pipeline_size_leaving_a_stage_empty_is_refused(p: int) -> None:
    model = load_model_spec("llama-3.1-8b")
    with pytest.raises(SpecError, match=r"allowed: 1-8, 11, 16, 32") as info:
        check_training_for_model(model, TrainingConfig(pipeline_parallel_size=p))
    assert info.value.field == "pipeline_parallel_size"


def test_interleaved_chunks_need_a_layer_each() -> None:
    model = load_model_spec("tiny-llama-test")  # 2 layers
    assert model.num_layers == 2
    t = TrainingConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved-1f1b")
    with pytest.raises(SpecError, match="2 stages x 2 chunks need at least 4 layers"):
        check_training_for_model(model, t)  # the default of 2 chunks per rank
    check_training_for_model(model, dataclasses.replace(t, virtual_pipeline_stages=1))


def test_learned_positions_bound_the_sequence() -> None:
    gpt2 = load_model_spec("gpt2")  # n_positions 1024
    check_training_for_model(gpt2, TrainingConfig(seq_len=1024))
    with pytest.raises(SpecError, match="seq_len: 4096 is longer than gpt2's 1024"):
        check_training_for_model(gpt2, TrainingConfig(seq_len=4096))
    # rotary models may run past their context (long-context fine-tuning)
    llama = load_model_spec("llama-2-7b")  # 4096 positions
    check_training_for_model(llama, TrainingConfig(seq_len=8192))


def test_lora_targets_must_exist_in_the_model() -> None:
    vit = load_model_spec("vit-large-patch16-224")
    with pytest.raises(SpecError, match="has no 'lm_head' linear"):
        check_training_for_model(vit, TrainingConfig(lora_rank=8, lora_targets=("lm_head",)))
    gpt2 = load_model_spec("gpt2")  # GELU MLP: no gate projection
    with pytest.raises(SpecError, match="has no 'gate' linear"):
        check_training_for_model(gpt2, TrainingConfig(lora_rank=8, lora_targets=("q", "gate")))
    check_training_for_model(gpt2, TrainingConfig(lora_rank=8, lora_targets=("q", "lm_head")))


def test_replace_revalidates() -> None:
    with pytest.raises(SpecError, match="micro_batch_size"):
        dataclasses.replace(TrainingConfig(), micro_batch_size=0)
