"""One rank map whichever engine ran (Note [One rank map] in trainmem/specs/ranks.py): the
analytic engine and the traced pipeline give the JSON ``rank_map`` and the layout part of every
``per_rank`` row alike, and both are the layout derived here by hand."""

from __future__ import annotations

from conftest import InvokeJson

# tiny-llama-test: 2 layers, untied embeddings; 2 pipeline stages x 2 data-parallel ranks
ARGS = (
    "estimate",
    "tiny-llama-test",
    "-b",
    "2",
    "-s",
    "32",
    "--precision",
    "32-true",
    "--framework",
    "fsdp2",
    "--zero-stage",
    "3",
    "--data-parallel-size",
    "2",
    "--pipeline-parallel-size",
    "2",
    "--gradient-accumulation-steps",
    "4",
    "--no-dropout",
)

# ranks numbered tensor fastest, then context, data, pipeline (Megatron's RankGenerator): the
# two data-parallel ranks of pipeline rank r are 2r and 2r + 1; one layer per stage; the first
# stage holds the embedding, the last the head; each rank is alike with its 2 data-parallel
# peers
EXPECTED_RANKS = [
    {
        "rank": 0,
        "coordinates": {"pp": 0, "dp": 0, "cp": 0, "tp": 0},
        "pipeline_stage": 0,
        "stages": [0],
        "layers": [[0, 0]],
        "num_layers": 1,
        "has_embedding": True,
        "has_head": False,
        "ranks_alike": 2,
    },
    {
        "rank": 2,
        "coordinates": {"pp": 1, "dp": 0, "cp": 0, "tp": 0},
        "pipeline_stage": 1,
        "stages": [1],
        "layers": [[1, 1]],
        "num_layers": 1,
        "has_embedding": False,
        "has_head": True,
        "ranks_alike": 2,
    },
]
EXPECTED = {
    "world_size": 4,
    "data_parallel_size": 2,
    "tensor_parallel_size": 1,
    "context_parallel_size": 1,
    "pipeline_parallel_size": 2,
    "expert_parallel_size": 1,
    "order": "tp-cp-dp-pp",
    "stages": [
        {"stage": 0, "pipeline_rank": 0, "layers": [0, 0], "global_ranks": [0, 1]},
        {"stage": 1, "pipeline_rank": 1, "layers": [1, 1], "global_ranks": [2, 3]},
    ],
    "ranks": EXPECTED_RANKS,
}


def test_analytic_and_trace_give_one_rank_map(invoke_json: InvokeJson) -> None:
    analytic = invoke_json(*ARGS, "--engine", "analytic")
    traced = invoke_json(*ARGS, "--engine", "trace")
    assert (analytic["engine"], traced["engine"]) == ("analytic", "trace")
    for answer in (analytic, traced):
        assert answer["rank_map"] == answer["details"]["rank_map"]
    assert analytic["rank_map"] == EXPECTED
    assert traced["rank_map"] == EXPECTED
    # every per-rank row starts with its rank's layout, the same keys and values in both
    for rows in (analytic["per_rank"], traced["per_rank"]):
        assert [{k: row[k] for k in EXPECTED_RANKS[0]} for row in rows] == EXPECTED_RANKS
    # the engine's own extras beside it: the analytic engine's micro-batches in flight (1F1B,
    # 4 micro-batches, 2 stages: min(4, 2 - stage)); the trace's mesh (a dp_shard dimension
    # under FSDP2, pipeline outermost)
    assert [r["micro_batches_in_flight"] for r in analytic["per_rank"]] == [2, 1]
    assert traced["details"]["traced_mesh"] == {"pp": 2, "dp_shard": 2}
