"""Context parallelism under the plain loop / FSDP2 needs ZeRO-3 (issue 26; Note [Context
parallelism needs FSDP over its ranks], trainmem/specs/training.py): torchtitan applies FSDP
over its dp_shard x cp mesh whenever CP is on and accelerate 1.14 refuses CP without FSDP2, so
the pair is refused by the shared settings check, the same for the CLI, the page and both
engines, naming the field, the sources and what runs."""

from __future__ import annotations

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.training import TrainingConfig


def test_cli_names_the_field_the_sources_and_what_runs(invoke: Invoke) -> None:
    result = invoke("estimate", "llama-3.2-1b", "--context-parallel-size", "2", exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err
    assert err.startswith(
        "error: zero_stage: 0 with --context-parallel-size 2 and --framework pytorch-amp:"
    )
    for part in (
        "torchtitan parallel_dims.py",
        "accelerate 1.14 state.py",
        "allowed: --zero-stage 3 (or --fsdp full-shard), or --context-parallel-size 1",
    ):
        assert part in err, err


@pytest.mark.parametrize(
    ("framework", "stage"), [("pytorch-amp", 1), ("pytorch-amp", 2), ("fsdp2", 0)]
)
def test_every_stage_below_3_is_refused(framework: str, stage: int) -> None:
    with pytest.raises(SpecError) as info:
        TrainingConfig(
            framework=framework, zero_stage=stage, data_parallel_size=2, context_parallel_size=2
        )
    assert info.value.field == "zero_stage"
    assert f"{stage} with --context-parallel-size 2 and --framework {framework}" in str(info.value)


def test_what_runs_is_accepted() -> None:
    # ZeRO-3 (FSDP2 over the data x context ranks, or over the context ranks alone)
    cp = TrainingConfig(context_parallel_size=2, zero_stage=3)
    assert cp.sharding_degree == 2
    # Megatron's context parallelism keeps whole states over its CP ranks (its own rule)
    TrainingConfig(framework="megatron", context_parallel_size=2)


def test_cli_fsdp_full_shard_runs_with_context_parallelism(invoke: Invoke) -> None:
    invoke(
        "estimate", "llama-3.2-1b", "--context-parallel-size", "2", "--fsdp", "full-shard",
        "--engine", "analytic",
    )  # fmt: skip
