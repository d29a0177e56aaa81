"""``--framework trl`` and ``--trl-version`` (issue 24 item 1) give the same estimate from the
CLI, the web page and the library, and say the same release in ``details["assumed"]``.

The numbers differ between releases by TRL's own code (tests/analytic/test_trl_releases.py
derives them): from 0.26 no k-bit upcast and bf16 adapters; 0.9.3 .. 0.25 the upcast with the
embeddings and head back in bf16.
"""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import InvokeJson
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.web.compute import numbers, resolve_request, run
from trainmem.web.form import cli_command, default_values

QLORA = {
    "model": "llama-3.2-1b",
    "engine": "analytic",
    "framework": "trl",
    "quantize_base": "nf4",
    "lora_rank": 16,
    "seq_len": 256,
    "micro_batch_size": 2,
}


@pytest.mark.parametrize("trl_version", [None, "0.13.0", "1.16.0"])
def test_trl_on_the_page_as_on_the_cli_and_the_library(
    invoke_json: InvokeJson, trl_version: str | None
) -> None:
    values = {**default_values(), **QLORA, "trl_version": trl_version}
    words = shlex.split(cli_command(values))
    assert ("--trl-version" in words) is (trl_version is not None)
    cli = invoke_json(*words[1:])
    est = run(resolve_request(values))
    assert json.loads(json.dumps(est.to_dict()["config"], default=str)) == cli["config"]
    assert numbers(est).breakdown_bytes == cli["breakdown_bytes"]
    assert est.details["assumed"]["trl"] == cli["details"]["assumed"]["trl"]
    if trl_version is not None:  # an explicit release is said as given
        assert cli["details"]["assumed"]["trl"] == trl_version
    training = TrainingConfig(
        framework="trl",
        quantize_base="nf4",
        lora_rank=16,
        seq_len=256,
        micro_batch_size=2,
        trl_version=trl_version,
    )
    library = estimate("llama-3.2-1b", training, engine="analytic", gpu=values["gpu"])
    assert library.breakdown == est.breakdown


def test_releases_differ_as_trl_does(invoke_json: InvokeJson) -> None:
    # llama-3.2-1b (h 2,048; 8 kv heads of 64; 16 layers), peft's default targets q, v at r 16:
    # 16 x (16 (2,048 + 2,048) + 16 (2,048 + 512)) = 1,703,936 adapter elements; AdamW's two
    # states fp32 under 0.13 (8 B each: 13,631,488 B), bf16 from 0.26 (4 B: 6,815,744 B)
    def states(release: str) -> int:
        values = {**default_values(), **QLORA, "trl_version": release}
        cli = invoke_json(*shlex.split(cli_command(values))[1:])
        return int(cli["breakdown_bytes"]["optimizer_states"])

    assert states("0.13.0") == 8 * 1_703_936 == 13_631_488
    assert states("1.16.0") == 4 * 1_703_936 == 6_815_744


def test_a_bad_release_on_the_page_names_the_field() -> None:
    with pytest.raises(Exception, match="trl_version: .*allowed: a TRL release"):
        resolve_request({**default_values(), **QLORA, "trl_version": "newest"})
