"""The world layout (trainmem.specs.ranks, Note [One rank map]); expected values by hand from
Megatron's rank order (tensor fastest, then context, data, pipeline) and the two layer splits."""

from __future__ import annotations

import pytest

from trainmem.specs.ranks import rank_map, stage_layers
from trainmem.specs.training import TrainingConfig


def _spans(ranges: list[range]) -> list[list[int]]:
    return [[r.start, r.stop - 1] for r in ranges]


def test_pipeline_rank_r_is_a_contiguous_block_of_dp_cp_tp_ranks() -> None:
    # torchtitan's split of 126 layers over 8 stages: 15, 16 x 6, 15 (generate_split_points);
    # dp 2 x cp 2 x tp 4 = 16 ranks per pipeline rank
    t = TrainingConfig(
        framework="fsdp2",
        zero_stage=3,
        pipeline_parallel_size=8,
        data_parallel_size=2,
        context_parallel_size=2,
        tensor_parallel_size=4,
        seq_len=4096,
        gradient_accumulation_steps=8,
    )
    layout = rank_map(t, 126).to_json()
    assert layout["world_size"] == 8 * 2 * 2 * 4 == 128
    assert layout["order"] == "tp-cp-dp-pp"
    stages = layout["stages"]
    assert isinstance(stages, list) and len(stages) == 8
    assert stages[1] == {
        "stage": 1,
        "pipeline_rank": 1,
        "layers": [15, 30],
        "global_ranks": [16, 31],
    }
    assert stages[7]["layers"] == [111, 125] and stages[7]["global_ranks"] == [112, 127]
    ranks = layout["ranks"]
    assert isinstance(ranks, list)
    # first, the first middle rank with 16 layers (more than the first's 15), last
    assert [(r["rank"], r["pipeline_stage"], r["num_layers"]) for r in ranks] == [
        (0, 0, 15),
        (16, 1, 16),
        (112, 7, 15),
    ]
    assert ranks[1]["coordinates"] == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert [(r["has_embedding"], r["has_head"]) for r in ranks] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert {r["ranks_alike"] for r in ranks} == {16}


def test_megatron_interleaved_chunks_divide_each_ranks_share() -> None:
    # 10 layers, p = 2, v = 2, Megatron: each rank holds ceil(10 / 2) = 5 layers in two chunks
    # of 3 and 2; stage k * p + r is chunk k of rank r, so the stages hold 3, 3, 2, 2 layers
    # (ceil(10 / 4) = 3 per stage would give rank 0 six layers and rank 1 four)
    t = TrainingConfig(
        pipeline_parallel_size=2,
        pipeline_schedule="interleaved-1f1b",
        virtual_pipeline_stages=2,
        gradient_accumulation_steps=4,
    )
    assert _spans(stage_layers(10, t)) == [[0, 2], [3, 5], [6, 7], [8, 9]]
    layout = rank_map(t, 10)
    assert layout.layers_per_pipeline_rank() == [5, 5]
    assert [r.to_json()["layers"] for r in layout.ranks] == [[[0, 2], [6, 7]], [[3, 5], [8, 9]]]
    assert [r.stages for r in layout.ranks] == [(0, 2), (1, 3)]
    # torchtitan's split of the same: 10 // 4 = 2 on the first stage, one more on each of the
    # next two middle stages, the last the rest: 2, 3, 3, 2
    titan = TrainingConfig(
        framework="fsdp2",
        pipeline_parallel_size=2,
        pipeline_schedule="interleaved-1f1b",
        virtual_pipeline_stages=2,
        gradient_accumulation_steps=4,
    )
    assert _spans(stage_layers(10, titan)) == [[0, 1], [2, 4], [5, 7], [8, 9]]


def test_tied_embeddings_put_the_embedding_on_the_last_rank_too() -> None:
    t = TrainingConfig(pipeline_parallel_size=4, gradient_accumulation_steps=4)
    untied = rank_map(t, 8).ranks
    tied = rank_map(t, 8, tied_embeddings=True).ranks
    # 8 layers, 2 per stage: the middle ranks hold no more than the first, so only two
    assert [r.pipeline_rank for r in tied] == [0, 3]
    assert [r.has_embedding for r in untied] == [True, False]
    assert [r.has_embedding for r in tied] == [True, True]


def test_without_the_layer_count_the_layers_are_null() -> None:
    t = TrainingConfig(data_parallel_size=4, tensor_parallel_size=2)
    layout = rank_map(t, None).to_json()
    assert layout["world_size"] == 8
    assert layout["stages"] == [
        {"stage": 0, "pipeline_rank": 0, "layers": None, "global_ranks": [0, 7]}
    ]
    (rank,) = layout["ranks"]  # type: ignore[misc]
    assert rank["layers"] == [None] and rank["num_layers"] is None and rank["ranks_alike"] == 8
    with pytest.raises(ValueError, match="layer count"):
        rank_map(TrainingConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2), None)
