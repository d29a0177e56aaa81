"""The page's ``--fsdp`` dropdown (issue 26): the page and ``trainmem estimate --fsdp`` resolve
the same run through the same function (:func:`trainmem.specs.training.apply_fsdp`), a run that
does not fit renders its verdict and the fixes, and a bad strategy is one line naming ``fsdp``
and the strategies.

Each page state is compared with the CLI run of the command the page itself prints (its CLI
box), so the page, its command and the CLI cannot drift apart."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import pytest

from conftest import InvokeJson
from trainmem.web import handlers as h
from trainmem.web.compute import resolve_request, run
from trainmem.web.form import NO_FSDP, cli_command, default_values, from_query, to_query

#: page changes, then fields the strategy must set, from torch's FSDP documentation
#: (torch/distributed/fsdp/api.py ShardingStrategy: SHARD_GRAD_OP keeps the parameters
#: unsharded between forward and backward; HYBRID_SHARD shards within a node) and the
#: LLaMA-Factory v0.9.5 recipe the Trainer runs under accelerate's FSDP plugin
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "shard-grad-op": (
        {"model": "gpt2", "fsdp": "shard-grad-op", "data_parallel_size": 4, "seq_len": 512}
        | {"framework": "accelerate-fsdp"},
        {"zero_stage": 3, "reshard_after_forward": False, "framework": "accelerate-fsdp"},
    ),
    "hybrid-shard over two nodes": (
        {"model": "gpt2", "fsdp": "hybrid-shard", "data_parallel_size": 16, "seq_len": 512}
        | {"framework": "fsdp2"},
        {"zero_stage": 3, "shard_group_size": 8, "reshard_after_forward": True},
    ),
    "llama-factory under FSDP": (
        {"model": "tiny-llama-test", "fsdp": "full-shard", "data_parallel_size": 2}
        | {"framework": "llama-factory", "lora_rank": 4, "seq_len": 64},
        {"zero_stage": 3, "framework": "accelerate-fsdp"},
    ),
}


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _update(**changes: Any) -> dict[str, str]:
    out = h.update([], None, *h.widget_values({**default_values(), **changes}))
    return dict(zip(h.ESTIMATE_OUTPUTS, out, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_the_page_runs_what_its_cli_command_runs(invoke_json: InvokeJson, case: str) -> None:
    changes, implied = CASES[case]
    values = {**default_values(), "gpu": "H100-80GB", **changes}
    command = cli_command(values)
    assert f"--fsdp {changes['fsdp']}" in command
    cli = invoke_json(*shlex.split(command)[1:])
    page = run(resolve_request(values)).to_dict()
    assert {k: cli["config"][k] for k in implied} == implied
    assert _json(page["config"]) == cli["config"]
    assert page["peak"] == cli["peak"] and page["verdict"] == cli["verdict"] == "fits"
    out = _update(gpu="H100-80GB", **changes)
    assert out["message"] == "" and 'data-verdict="fits"' in out["result"]


def test_the_strategy_changes_the_estimate() -> None:
    # FULL_SHARD over 4 ranks keeps a quarter of the model states of an unsharded run
    base = {**default_values(), "model": "gpt2", "seq_len": 512, "data_parallel_size": 4}
    base["framework"] = "accelerate-fsdp"
    none = run(resolve_request(base)).to_dict()["model_states_bytes"]
    full = run(resolve_request({**base, "fsdp": "full-shard"})).to_dict()["model_states_bytes"]
    assert full["optimizer_states"] * 4 == pytest.approx(none["optimizer_states"], rel=0.01)


def test_a_run_that_does_not_fit_renders_the_verdict_and_the_fixes() -> None:
    # 8.03e9 parameters, FULL_SHARD over 2 ranks: 16 B / 2 = 8 B per parameter of model
    # states alone (Rajbhandari et al. 2020 sec. 3.1), 64 GB > a T4's 15 GiB
    changes: dict[str, Any] = {"model": "llama-3.1-8b", "gpu": "t4", "fsdp": "full-shard"}
    changes |= {"data_parallel_size": 2, "framework": "accelerate-fsdp", "seq_len": 512}
    out = _update(**changes)
    assert out["message"] == ""
    assert 'data-verdict="does not fit"' in out["result"]
    values = {**default_values(), **changes}
    fixes, plan = h.fit_and_plan(h.FIT_TAB, None, *h.widget_values(values))
    assert "tm-error" not in fixes + plan and "unexpected" not in fixes + plan
    assert '<table class="tm" id="fixes">' in fixes


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"fsdp": "zero-3"}, "full-shard, shard-grad-op, hybrid-shard, no-shard"),
        ({"fsdp": "full-shard", "zero_stage": 1}, "give one of --fsdp or --zero-stage"),
    ],
)
def test_a_bad_strategy_is_one_line_naming_the_field(
    changes: dict[str, Any], expected: str
) -> None:
    out = _update(model="gpt2", data_parallel_size=2, **changes)
    message = re.sub("<[^>]+>", " ", out["message"])
    assert "fsdp" in message and expected in message
    assert "unexpected error" not in message and "No estimate" in out["result"]


def test_a_link_keeps_the_strategy_and_reports_a_bad_one() -> None:
    values = {**default_values(), "fsdp": "hybrid-shard", "data_parallel_size": 16}
    query = to_query(values)
    assert "fsdp=hybrid-shard" in query
    back, _, problems = from_query(query)
    assert back == values and problems == []
    back, _, problems = from_query("fsdp=bogus")
    assert back["fsdp"] is None and len(problems) == 1 and "fsdp" in problems[0]


def test_no_strategy_is_the_dropdowns_none() -> None:
    widgets = h.widget_values(default_values())
    assert widgets[h.INPUT_NAMES.index("fsdp")] == NO_FSDP
    assert h.collect(widgets) == default_values()
