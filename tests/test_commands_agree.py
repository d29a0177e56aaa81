"""The commands agree with each other (issue 27): every fix `fit` prints is a command that
`estimate` answers "fits" for; `plan`'s largest micro-batch fits and one more does not; a
`sweep` row has the verdict `estimate` gives for the same point."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import Invoke, InvokeJson


def test_every_fix_command_fits_when_estimated(invoke: Invoke, invoke_json: InvokeJson) -> None:
    r = invoke(
        "fit", "llama-3.1-8b", "--gpu", "RTX-4090", "-b", "2", "-s", "2048", env={"COLUMNS": "400"}
    )
    commands = [
        line.split(". ", 1)[1]
        for line in r.output.splitlines()
        if line[:1].isdigit() and ". trainmem estimate" in line
    ]
    assert commands
    for command in commands:
        words = shlex.split(command)
        assert words[:2] == ["trainmem", "estimate"]
        assert invoke_json("estimate", *words[2:])["fits"] is True, command


def test_plan_agrees_with_estimate(invoke: Invoke, invoke_json: InvokeJson) -> None:
    args = ["llama-3.2-1b", "--gpu", "RTX-4090", "-s", "512", "-c", "full"]
    r = invoke("plan", *args, "--json")
    best = {x["dimension"]: x for x in json.loads(r.stdout)["results"]}["micro_batch_size"]["value"]
    assert invoke_json("estimate", *args, "-b", str(best))["fits"] is True
    assert invoke_json("estimate", *args, "-b", str(best + 1))["fits"] is False


@pytest.mark.parametrize("b", [1, 4])
def test_sweep_verdict_is_estimates(invoke: Invoke, invoke_json: InvokeJson, b: int) -> None:
    args = ["llama-3.2-1b", "--gpu", "RTX-4090", "-s", "2048"]
    r = invoke(
        "sweep",
        *args,
        "--over",
        f"micro-batch-size={b}",
        "--simulate-allocator",
        "--format",
        "json",
    )
    row = json.loads(r.stdout)["rows"][0]
    assert row["verdict"] == invoke_json("estimate", *args, "-b", str(b))["verdict"]


def test_compare_and_formulas_agree_with_estimate(invoke: Invoke, invoke_json: InvokeJson) -> None:
    args = ["llama-3.2-1b", "-s", "512", "--gpu", "RTX-4090"]
    r = invoke(
        "compare", *args, "--set", "micro-batch-size=1", "--set", "micro-batch-size=8", "--json"
    )
    for config, b in zip(json.loads(r.stdout)["configurations"], (1, 8), strict=True):
        alone = invoke_json("estimate", *args, "-b", str(b))
        assert config["verdict"] == alone["verdict"]
        assert config["peak"]["allocated_bytes"] == alone["peak"]["allocated_bytes"]
    f = invoke("formulas", "llama-3.2-1b", "-s", "512", "--json")
    ours = [row for row in json.loads(f.stdout) if row["formula"].startswith("trainmem")]
    assert (
        ours[0]["total_bytes"]
        == invoke_json("estimate", "llama-3.2-1b", "-s", "512")["peak"]["allocated_bytes"]
    )
