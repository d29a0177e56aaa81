"""The LLaMA-Factory / axolotl presets through the library API and through ``trainmem
estimate``: a combination a path does not model is refused with the same text either way
(the CLI adds only ``error:``), so a library user reads what a CLI user reads."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Invoke
from trainmem import TrainingConfig, estimate
from trainmem.errors import TrainmemError

#: (TrainingConfig fields, the same as CLI options); tiny-llama-test at 1 x 64 tokens
CASES: list[tuple[dict[str, Any], list[str]]] = [
    # the HF Trainer stacks are traced on one GPU and under DDP only
    ({"framework": "llama-factory", "tensor_parallel_size": 2}, ["--tensor-parallel-size", "2"]),
    ({"framework": "axolotl", "pipeline_parallel_size": 2}, ["--pipeline-parallel-size", "2"]),
    ({"framework": "axolotl", "context_parallel_size": 2}, ["--context-parallel-size", "2"]),
    # a quantized base without adapters trains nothing
    ({"framework": "llama-factory", "quantize_base": "nf4"}, ["--quantize-base", "nf4"]),
]


@pytest.mark.parametrize("engine", ["analytic", "generic"])
@pytest.mark.parametrize(("fields", "options"), CASES)
def test_the_library_refuses_with_the_clis_text(
    invoke: Invoke, engine: str, fields: dict[str, Any], options: list[str]
) -> None:
    if engine == "generic":
        pytest.importorskip("transformers")
    args = ["tiny-llama-test", "-s", "64", "-e", engine, "--framework", fields["framework"]]
    result = invoke("estimate", *args, *options, exit_code=None)
    try:
        estimate("tiny-llama-test", TrainingConfig(seq_len=64, **fields), engine=engine)
    except TrainmemError as exc:
        assert result.exit_code != 0
        assert result.stderr.strip().splitlines()[-1] == f"error: {exc}"
    else:
        assert result.exit_code == 0, result.stderr
