"""max_micro_batch_size / max_seq_len: the answer fits and one more does not, edges, and the
monotonicity the search relies on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate, resolve_model
from trainmem.estimate import estimate as estimate_analytic
from trainmem.planner.evaluate import fits
from trainmem.planner.search import largest_true, max_micro_batch_size, max_seq_len
from trainmem.specs.hardware import get_gpu
from trainmem.specs.training import TrainingConfig


def simulated_fits(model: str, training: TrainingConfig, gpu: str) -> bool:
    est = estimate_analytic(resolve_model(model), training, gpu=get_gpu(gpu))
    return fits(est)


@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 8, 9, 100, 1023, 1024])
def test_largest_true_finds_the_threshold(threshold: int) -> None:
    calls: list[int] = []

    def pred(n: int) -> bool:
        calls.append(n)
        return n <= threshold

    assert largest_true(pred, 1, 1 << 20) == threshold
    assert len(calls) <= 2 * (threshold.bit_length() + 1) + 1  # O(log n)


def test_largest_true_edges() -> None:
    assert largest_true(lambda n: False, 1, 100) is None
    assert largest_true(lambda n: True, 1, 100) == 100
    assert largest_true(lambda n: True, 1, 1) == 1
    assert largest_true(lambda n: n <= 5, 1, 3) == 3


CASES = [
    ("gpt2", "T4", TrainingConfig(seq_len=1024)),
    ("gpt2", "T4", TrainingConfig(seq_len=1024, precision="32-true", attention="eager")),
    ("llama-3.2-1b", "A100-40GB", TrainingConfig(seq_len=2048)),
    ("llama-3.2-1b", "A100-80GB", TrainingConfig(seq_len=4096, activation_checkpointing="full")),
]


@pytest.mark.parametrize(("model", "gpu", "training"), CASES)
def test_planned_micro_batch_fits_and_one_more_does_not(
    model: str, gpu: str, training: TrainingConfig
) -> None:
    r = max_micro_batch_size(model, training, gpu)
    assert r.value is not None and r.limited_by == "memory"
    at = replace(training, micro_batch_size=r.value)
    assert estimate(model, at, gpu=gpu).fits
    assert simulated_fits(model, at, gpu)
    assert not simulated_fits(model, replace(training, micro_batch_size=r.value + 1), gpu)
    assert r.margin_bytes is not None and 0 <= r.margin_bytes < get_gpu(gpu).memory_bytes
    assert r.estimate is not None and r.estimate.config["micro_batch_size"] == r.value
    assert f"micro_batch_size={r.value} fits" in r.reason


@pytest.mark.parametrize(("model", "gpu", "training"), CASES[2:])
@pytest.mark.parametrize("multiple_of", [1, 128])
def test_planned_seq_len_fits_and_one_more_does_not(
    model: str, gpu: str, training: TrainingConfig, multiple_of: int
) -> None:
    r = max_seq_len(model, training, gpu, multiple_of=multiple_of)
    assert r.value is not None and r.value % multiple_of == 0
    assert simulated_fits(model, replace(training, seq_len=r.value), gpu)
    if r.limited_by == "memory":
        assert not simulated_fits(model, replace(training, seq_len=r.value + multiple_of), gpu)
    else:
        assert r.limited_by == "context_length"


def test_seq_len_stops_at_the_context_length() -> None:
    r = max_seq_len("gpt2", TrainingConfig(), "A100-80GB")
    assert (r.value, r.limited_by, r.next_estimate) == (1024, "context_length", None)
    assert "max_position_embeddings=1024" in r.reason


def test_micro_batch_search_limit() -> None:
    r = max_micro_batch_size("gpt2", TrainingConfig(seq_len=64), "A100-80GB", max_value=4)
    assert (r.value, r.limited_by) == (4, "search_limit")


@pytest.mark.parametrize("search", [max_micro_batch_size, max_seq_len])
def test_weights_alone_exceed_the_gpu(search) -> None:  # noqa: ANN001
    r = search("llama-3.1-405b", TrainingConfig(seq_len=2048), "T4")
    assert r.value is None and r.estimate is None and r.training is None
    assert r.limited_by == "nothing_fits" and r.margin_bytes is None
    assert "weights alone" in r.reason and "T4" in r.reason
    assert r.next_estimate is not None and not r.next_estimate.fits
    assert r.to_dict()["value"] is None


def test_optimizer_states_exceed_the_gpu() -> None:
    r = max_micro_batch_size("llama-3.1-8b", TrainingConfig(seq_len=2048), "A100-40GB")
    assert r.value is None
    assert "weights + optimizer states alone" in r.reason and "trainmem fit" in r.reason


def test_peak_exceeds_the_gpu_at_the_smallest_value() -> None:
    # model states fit (about 14 GiB for 1.2 B parameters at 16 bytes / 2 ...) but the step does not
    r = max_micro_batch_size("llama-3.2-1b", TrainingConfig(seq_len=4096), "RTX-4090")
    assert r.value is None
    assert r.reason.startswith("even micro_batch_size=1 needs")


def test_plan_result_to_dict_is_json_able() -> None:
    import json

    r = max_micro_batch_size("gpt2", TrainingConfig(seq_len=1024), "T4")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["value"] == r.value and d["limited_by"] == "memory"
    assert d["next"]["micro_batch_size"] == r.value + 1
    assert d["peak"]["device_total_bytes"] + d["margin_bytes"] == d["gpu"]["capacity_bytes"]


@pytest.mark.parametrize(
    ("model", "training"),
    [
        ("gpt2", TrainingConfig(attention="eager")),
        ("gpt2", TrainingConfig(precision="32-true", optimizer_implementation="for-loop")),
        ("llama-3.2-1b", TrainingConfig(activation_checkpointing="selective")),
        (
            "llama-3.2-1b",
            TrainingConfig(activation_checkpointing="full", gradient_accumulation_steps=4),
        ),
        ("llama-3.2-1b", TrainingConfig(optimizer="adamw-8bit", precision="bf16-true")),
    ],
)
def test_estimate_is_monotone_in_micro_batch_and_seq_len(
    model: str, training: TrainingConfig
) -> None:
    """The property the searches rely on, on the closed form they search."""
    spec, gpu = resolve_model(model), get_gpu("H100-80GB")

    def total(b: int, s: int) -> int:
        t = replace(training, micro_batch_size=b, seq_len=s)
        est = estimate_analytic(spec, t, gpu=gpu, simulate_allocator=False)
        return est.breakdown.device_total_bytes

    batches = [1, 2, 3, 4, 7, 8, 16, 33]
    lengths = [1, 16, 127, 128, 512, 1000, 1024]
    grid = {(b, s): total(b, s) for b in batches for s in lengths}
    for s in lengths:
        col = [grid[b, s] for b in batches]
        assert col == sorted(col), (s, col)
    for b in batches:
        row = [grid[b, s] for s in lengths]
        assert row == sorted(row), (b, row)


def test_planned_seq_len_defaults_to_tensor_core_padding() -> None:
    # transformers' data collators pad to a multiple of 8 for Tensor Cores (pad_to_multiple_of);
    # the default answer is such a length, it fits, and the next multiple of 8 does not
    model, gpu, training = CASES[2]
    r = max_seq_len(model, training, gpu)
    assert r.value is not None and r.limited_by == "memory" and r.value % 8 == 0
    assert simulated_fits(model, replace(training, seq_len=r.value), gpu)
    assert not simulated_fits(model, replace(training, seq_len=r.value + 8), gpu)
    exact = max_seq_len(model, training, gpu, multiple_of=1)
    assert exact.value is not None and r.value <= exact.value


def test_seq_len_below_a_context_length_off_the_granularity(tmp_path) -> None:  # noqa: ANN001
    # gpt2 with a 1,020-token position table: multiples of 8 stop at 1,016 (127 * 8), which is
    # the last multiple of 8 below the context length, not the context length itself
    import json

    from trainmem.specs.hf import load_hf_config

    cfg = {**load_hf_config("gpt2"), "n_positions": 1020}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = str(tmp_path / "config.json")
    r = max_seq_len(path, TrainingConfig(), "A100-80GB")
    assert (r.value, r.limited_by, r.step) == (1016, "context_length", 8)
    assert "last multiple of 8 tokens below the model's context length" in r.reason
    assert "max_position_embeddings=1020" in r.reason
    assert r.to_dict()["step"] == 8
    exact = max_seq_len(path, TrainingConfig(), "A100-80GB", multiple_of=1)
    assert (exact.value, exact.step) == (1020, 1)
    assert "it is the model's context length (max_position_embeddings=1020)" in exact.reason
    assert max_micro_batch_size(path, TrainingConfig(seq_len=64), "T4").to_dict()["step"] == 1
