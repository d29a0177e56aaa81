"""``trainmem fit`` and ``plan`` on a model only the generic path runs (a tiny Whisper): each
answer is checked against ``trainmem estimate`` of the configuration it names, run on its own,
and the paths a user can take (fits, does not fit, --gpus) each end in a clear answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Invoke, InvokeJson

pytest.importorskip("torch")
pytest.importorskip("transformers")

WHISPER = Path(__file__).parents[1] / "models" / "whisper.json"
"""d_model 64, 2 + 2 layers: 21 MB allocated at micro-batch 1, 81 MB at 64 (64 tokens)."""

SMALL = "0.53GiB"
"""A capacity the tiny model overflows at micro-batch 16 (about 0.5 GB of it is the CUDA
context), so that each search stays a few traced steps."""


def _fits(invoke_json: InvokeJson, *flags: str) -> bool:
    d = invoke_json("estimate", WHISPER, "--gpu", SMALL, "-s", "64", *flags)
    assert d["engine"] == "generic"
    return bool(d["fits"])


def _flags(settings: dict[str, dict[str, object]]) -> list[str]:
    out: list[str] = []
    for key, change in settings.items():
        out += [f"--{key.replace('_', '-')}", str(change["to"])]
    return out


def test_fit_traces_changes_that_each_fit_on_their_own(invoke_json: InvokeJson) -> None:
    base = ["-b", "32"]
    assert not _fits(invoke_json, *base)
    d = invoke_json("fit", WHISPER, "--gpu", SMALL, "-s", "64", "--limit", "1", *base)
    assert d["fits"] is False and d["fixes"], d
    for fix in d["fixes"]:
        flags = _flags(fix["settings"])
        settings = dict(zip(flags[::2], flags[1::2], strict=True))
        run = [*base, *flags] if "--micro-batch-size" not in settings else flags
        assert _fits(invoke_json, *run), fix["change"]
    # the cheapest micro-batch that fits: the next larger divisor of 32 does not
    accumulate = [f for f in d["fixes"] if "micro_batch_size" in f["settings"]]
    assert accumulate, [f["change"] for f in d["fixes"]]
    chosen = int(accumulate[0]["settings"]["micro_batch_size"]["to"])
    assert not _fits(invoke_json, "-b", str(chosen * 2))


def test_fit_of_a_traced_run_that_fits_changes_nothing(invoke: Invoke) -> None:
    r = invoke("fit", WHISPER, "--gpu", SMALL, "-s", "64", "-b", "1")
    assert "fits with" in r.stdout and "does not fit" not in r.stdout


def test_plan_traces_the_largest_micro_batch(invoke_json: InvokeJson) -> None:
    d = invoke_json("plan", WHISPER, "--gpu", SMALL, "-s", "64")
    (row,) = d["results"]
    value = row["value"]
    assert row["dimension"] == "micro_batch_size" and row["limited_by"] == "memory"
    assert _fits(invoke_json, "-b", str(value))
    assert not _fits(invoke_json, "-b", str(value + 1))


def test_plan_gpus_is_refused_with_what_works(invoke: Invoke) -> None:
    r = invoke("plan", WHISPER, "--gpus", exit_code=None)
    assert r.exit_code != 0
    assert "--gpu NAME" in r.output and "Traceback" not in r.output


def test_sweep_traces_each_point_as_estimate_does(invoke_json: InvokeJson, invoke: Invoke) -> None:
    r = invoke(
        "sweep", WHISPER, "--over", "micro-batch-size=1,32", "-s", "64", "--gpu", SMALL,
        "--format", "json",
    )  # fmt: skip
    import json

    rows = json.loads(r.stdout)["rows"]
    assert [row["micro_batch_size"] for row in rows] == [1, 32]
    for row in rows:
        d = invoke_json(
            "estimate", WHISPER, "--gpu", SMALL, "-s", "64", "-b", str(row["micro_batch_size"])
        )
        assert row["verdict"] == d["verdict"]
        assert row["allocated_bytes"] == d["peak"]["allocated_bytes"]
    assert [row["fits"] for row in rows] == [True, False]


PREFIX = ["tiny-llama-test", "-s", "512", "--num-virtual-tokens", "8"]
"""A formula family under prefix tuning: in the formulas since session 29 (Note [Prompt learning
in the formulas]); their search must skip the candidates they refuse beside it (session 28,
traced: the search stopped at the first one the generic path refuses, selective
checkpointing, with that refusal as the command's error; session 29 on the formulas alike
until ``_apply`` left them out)."""


def test_fit_skips_the_changes_prefix_tuning_refuses(invoke_json: InvokeJson) -> None:
    d = invoke_json("fit", *PREFIX, "-b", "16", "--gpu", "0.6GB", "--limit", "1")
    assert d["fits"] is False and d["fixes"], d
    for fix in d["fixes"]:
        # LoRA beside prefix tuning is refused (peft trains one adapter type), and so is
        # activation checkpointing (transformers drops the prefix's cache)
        assert "lora_rank" not in fix["settings"], fix
        assert "activation_checkpointing" not in fix["settings"], fix
        flags = _flags(fix["settings"])
        run = ["-b", "16", *flags] if "--micro-batch-size" not in flags else flags
        est = invoke_json("estimate", *PREFIX, "--gpu", "0.6GB", *run)
        assert est["engine"] == "analytic" and est["fits"] is True, fix["change"]


def test_which_fit_runs_traced() -> None:
    from trainmem.planner.fixes import CHANGES
    from trainmem.planner.traced import _proposals, traced_run
    from trainmem.specs.hardware import resolve_gpu
    from trainmem.specs.training import TrainingConfig

    # prefix tuning is in the formulas since session 29 (their search skips the candidates
    # they refuse beside it: checkpointing)
    assert not traced_run("llama-3.1-8b", TrainingConfig(num_virtual_tokens=8))
    assert traced_run("llama-3.1-8b", TrainingConfig(lora_rank=8, lora_variant="loha"))
    assert not traced_run("llama-3.1-8b", TrainingConfig(lora_rank=8))
    assert traced_run(str(WHISPER), TrainingConfig())
    # a change the run refuses proposes nothing (it raised out of the search before)
    lora = [c for c in CHANGES if c.group == "adapters"]
    prefix = TrainingConfig(num_virtual_tokens=8)
    assert lora and all(_proposals((c,), prefix, resolve_gpu("T4")) == [] for c in lora)
