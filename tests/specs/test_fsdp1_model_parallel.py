"""FSDP1 beside model parallelism that no run of the framework has is refused on every path,
naming the size, the framework and what runs instead (issue 26: the generic path and the
formulas describe the same runs).

Source: accelerate 1.4 .. 1.9 state.py ``AcceleratorState.__init__`` (``if
self.torch_tp_plugin is not None: self.distributed_type = DistributedType.TP`` after the FSDP
branch, so ``prepare_model`` never reaches the FSDP wrap) and 1.10+ parallelism_config.py
``_validate_accelerator`` ("ParallelismConfig is only compatible DistributedType.FSDP (version
2) ...") and 1.10.0 state.py ("Using `cp_size>1` requires FSDP2, but the provided
`fsdp_plugin` is using FSDP1", 6891c570); accelerate inference.py ``prepare_pippy`` ("for
pipeline parallel inference"); Answer.AI fsdp_qlora train.py (e4968fd): ``FSDP(model,
...)`` over the whole world, no tensor, pipeline or context-parallel argument.
"""

from __future__ import annotations

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.training import TrainingConfig

_FSDP = {"data_parallel_size": 2, "zero_stage": 3}


@pytest.mark.parametrize(
    ("framework", "size", "allowed"),
    [
        ("accelerate-fsdp", "tensor_parallel_size", "--framework fsdp2 --zero-stage 3"),
        ("accelerate-fsdp", "pipeline_parallel_size", "--framework megatron"),
        ("accelerate-fsdp", "context_parallel_size", "--framework fsdp2 --zero-stage 3"),
        ("fsdp-qlora", "tensor_parallel_size", "--tensor-parallel-size 1"),
        ("fsdp-qlora", "pipeline_parallel_size", "--pipeline-parallel-size 1"),
        ("fsdp-qlora", "context_parallel_size", "--context-parallel-size 1"),
    ],
)
def test_fsdp1_beside_model_parallelism_no_framework_runs_is_refused(
    framework: str, size: str, allowed: str
) -> None:
    with pytest.raises(SpecError) as info:
        TrainingConfig(framework=framework, **_FSDP, **{size: 2})
    assert info.value.field == size
    assert f"2 with --framework {framework}" in str(info.value)
    assert "allowed: " in str(info.value) and allowed in str(info.value)


def test_accelerate_fsdp1_beside_context_parallelism_names_accelerates_own_error() -> None:
    # accelerate 1.10.0 state.py AcceleratorState.__init__ (6891c570, #3700): with
    # parallelism_config.cp_enabled and fsdp_plugin.fsdp_version == 1 it raises "Using
    # `cp_size>1` requires FSDP2, but the provided `fsdp_plugin` is using FSDP1"; NO_SHARD
    # (--zero-stage 0 under accelerate-fsdp) is the same FSDP1 plugin
    for stage in (3, 0):
        with pytest.raises(SpecError) as info:
            TrainingConfig(
                framework="accelerate-fsdp",
                data_parallel_size=2,
                zero_stage=stage,
                context_parallel_size=2,
            )
        assert info.value.field == "context_parallel_size"
        assert "requires FSDP2" in str(info.value)


def test_what_fsdp1_frameworks_do_run_stays_accepted() -> None:
    # the same model parallelism under FSDP2 is torchtitan's (and accelerate's FSDP2)
    for size in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
        TrainingConfig(framework="fsdp2", **_FSDP, **{size: 2})


@pytest.mark.parametrize("engine", ["analytic", "generic"])
def test_the_cli_refuses_accelerate_fsdp_with_tp_on_every_engine(
    invoke: Invoke, engine: str
) -> None:
    r = invoke(
        "estimate", "gpt2", "-s", "64", "--framework", "accelerate-fsdp", "--zero-stage", "3",
        "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--engine", engine,
        exit_code=2,
    )  # fmt: skip
    assert "tensor_parallel_size: 2 with --framework accelerate-fsdp" in r.output
    assert "Traceback" not in r.output
