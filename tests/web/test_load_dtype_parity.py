"""``--load-dtype`` (issue 24) gives the same estimate from the CLI, the web page and the
library, and the JSON's assumptions line says the model is loaded in 16 bits. The bytes
themselves are derived by hand in tests/analytic/test_autocast_over_loaded_16bit.py."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import InvokeJson
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.web.compute import numbers, resolve_request, run
from trainmem.web.form import cli_command, default_values

SETTINGS = {
    "model": "tiny-llama-test",
    "engine": "analytic",
    "framework": "hf-trainer",
    "precision": "bf16-mixed",
    "seq_len": 128,
    "micro_batch_size": 2,
}


@pytest.mark.parametrize("load_dtype", [None, "bfloat16"])
def test_load_dtype_on_the_page_as_on_the_cli_and_the_library(
    invoke_json: InvokeJson, load_dtype: str | None
) -> None:
    values = {**default_values(), **SETTINGS, "load_dtype": load_dtype}
    words = shlex.split(cli_command(values))
    assert ("--load-dtype" in words) is (load_dtype is not None)
    cli = invoke_json(*words[1:])
    est = run(resolve_request(values))
    assert json.loads(json.dumps(est.to_dict()["config"], default=str)) == cli["config"]
    assert numbers(est).breakdown_bytes == cli["breakdown_bytes"]
    training = TrainingConfig(
        framework="hf-trainer",
        precision="bf16-mixed",
        seq_len=128,
        micro_batch_size=2,
        load_dtype=load_dtype,
    )
    library = estimate("tiny-llama-test", training, engine="analytic", gpu=values["gpu"])
    assert library.breakdown == est.breakdown
    means = cli["details"]["assumed"]["framework_means"]
    assert ("loaded in bfloat16" in means) is (load_dtype is not None)
    # 158,016 parameters: 2 B each loaded in bf16, 4 B else
    assert cli["breakdown_bytes"]["parameters"] == (2 if load_dtype else 4) * 158_016
