"""``plan --gpus``: the largest micro-batch per catalog GPU and, for a sharded run, the fewest
GPUs of each kind; bounds derived by hand from the ZeRO paper's 16 bytes per parameter."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import Invoke
from trainmem.planner.evaluate import fast_estimate, fits
from trainmem.planner.search import DATA_PARALLEL_SIZES, fewest_gpus, plan_gpus
from trainmem.specs.hardware import GPUS
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

PSI = 6_738_415_616
"""llama-2-7b parameters; every tensor divides by 16, so shards have no rounding."""

# fsdp2: fp32 weights, fp32 gradients, two fp32 AdamW moments = 4 + 4 + 8 = 16 B/param
# (Rajbhandari et al. 2020 sec. 3.1), sharded over N GPUs under ZeRO-3 / FULL_SHARD: 16 PSI / N.
TRAINING = TrainingConfig(
    framework="fsdp2", seq_len=128, activation_checkpointing="full", micro_batch_size=1
)


@pytest.fixture(scope="module")
def plan() -> object:
    gpus = [GPUS["H100-80GB"], GPUS["RTX-4090"], GPUS["V100-16GB"]]
    return plan_gpus(load_model_spec("llama-2-7b"), TRAINING, gpus=gpus)


def test_states_beyond_one_card_assume_zero3(plan: object) -> None:
    assert plan.model_states_bytes == 16 * PSI  # type: ignore[attr-defined]
    assert plan.sharded and plan.zero_stage == 3  # type: ignore[attr-defined]
    assert "ZeRO-3" in plan.assumption  # type: ignore[attr-defined]


def test_fewest_gpus_satisfy_the_hand_bound(plan: object) -> None:
    # The fewest N must satisfy 16 PSI / N + A < C (A >= 0: activations, buffers, context).
    # H100-80GB, C = 84,943,715,697: N = 1 holds 16 PSI = 107,814,649,856 > C, so N >= 2;
    # at N = 2 the states are 8 PSI = 53,907,324,928, leaving C - 8 PSI = 31.0e9 for A.
    # RTX-4090, C = 25,393,994,138: 16 PSI / 4 = 26,953,662,464 > C, so N >= 8 whatever A is;
    # at N = 8 the states are 2 PSI = 13,476,831,232, leaving 11.9e9 for A.
    # V100-16GB, C = 16,932,908,564: 16 PSI / 8 = 13.5e9 < C, so only N >= 8 by hand.
    rows = {r.gpu.name: r for r in plan.rows}  # type: ignore[attr-defined]
    h100, rtx, v100 = rows["H100-80GB"].sharded, rows["RTX-4090"].sharded, rows["V100-16GB"].sharded
    assert 16 * PSI > GPUS["H100-80GB"].memory_bytes and h100.data_parallel_size == 2
    assert 16 * PSI // 4 > GPUS["RTX-4090"].memory_bytes and rtx.data_parallel_size == 8
    assert v100.data_parallel_size is not None and v100.data_parallel_size >= 8
    for r in (h100, rtx, v100):
        n, est, cap = r.data_parallel_size, r.estimate, r.gpu.memory_bytes
        # the estimate's states are the hand formula, exactly
        assert sum(est.model_states_bytes.values()) == 16 * PSI // n
        rest = est.breakdown.device_total_bytes - sum(
            getattr(est.breakdown, k) for k in ("parameters", "optimizer_states")
        )
        assert 16 * PSI // n < cap and rest >= 0
        assert fits(est) and est.config["zero_stage"] == 3  # confirmed by the simulator
        # one power of two fewer does not fit (the fast bound; the simulator only adds)
        half = replace(r.training, data_parallel_size=n // 2)
        assert not fits(fast_estimate(load_model_spec("llama-2-7b"), half, r.gpu))


def test_verdict_column_is_the_estimates_verdict(plan: object) -> None:
    for r in plan.rows:  # type: ignore[attr-defined]
        mb = r.micro_batch
        est = mb.estimate if mb.estimate is not None else mb.next_estimate
        assert r.verdict == est.verdict
        assert r.sharded.estimate.verdict in ("fits", "tight")
    # nothing fits one GPU unsharded: 16 PSI alone exceeds every card here
    assert all(r.micro_batch.value is None for r in plan.rows)  # type: ignore[attr-defined]
    assert all(r.verdict == "does not fit" for r in plan.rows)  # type: ignore[attr-defined]


def test_no_sharding_when_the_states_fit_and_none_was_asked() -> None:
    # gpt2: 124,439,808 x 16 B = 1.99e9 B fit every catalog GPU
    p = plan_gpus("gpt2", TrainingConfig(seq_len=128), gpus=[GPUS["T4"]])
    assert not p.sharded and p.assumption is None and p.rows[0].sharded is None
    assert p.rows[0].micro_batch.value is not None
    # the user's choice of ZeRO stage turns the search on and is kept
    p = plan_gpus("gpt2", TrainingConfig(seq_len=128, zero_stage=2), gpus=[GPUS["T4"]])
    assert p.sharded and p.zero_stage == 2 and p.assumption is None
    assert p.rows[0].sharded.data_parallel_size == 1


def test_fewest_gpus_reports_none_past_the_largest_size() -> None:
    r = fewest_gpus(
        load_model_spec("llama-2-7b"), replace(TRAINING, zero_stage=3), GPUS["T4"], sizes=(1, 2)
    )
    assert r.data_parallel_size is None and r.estimate.verdict == "does not fit"
    assert DATA_PARALLEL_SIZES[0] == 1 and DATA_PARALLEL_SIZES[-1] == 1024


def test_cli_json_lists_the_catalog(invoke: Invoke) -> None:
    r = invoke("plan", "gpt2", "--gpus", "--seq-len", "128", "--json")
    d = json.loads(r.stdout)
    assert d["schema_version"] == 1 and not d["sharded"]
    assert [g["gpu"]["name"] for g in d["gpus"]] == [g.name for g in GPUS.values()]
    assert all(g["verdict"] in ("fits", "tight", "does not fit", None) for g in d["gpus"])
    r = invoke("plan", "gpt2", "--gpus", "--gpu", "T4", exit_code=None)
    assert r.exit_code != 0 and "drop --gpu" in r.output


def test_cli_table_of_a_sharded_run(invoke: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    # the table's sharded column, on three cards of the catalog (each row is the same search:
    # the whole catalog's JSON above; the table of all of them took ~2 s more)
    few = {name: GPUS[name] for name in ("T4", "RTX-4090", "H100-80GB")}
    monkeypatch.setattr("trainmem.specs.hardware.GPUS", few)
    r = invoke("plan", "gpt2", "--gpus", "--seq-len", "128", "--zero-stage", "3")
    assert "fewest GPUs (ZeRO-3)" in r.output and "largest micro-batch" in r.output
    assert all(name in r.output for name in few)
