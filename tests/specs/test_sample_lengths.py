"""Earlier steps' lengths from a dataset's statistics (``sample_lengths``, Note [Lengths from a
dataset's statistics]). Expected lengths are hand calculations from the log-normal with the
given mean m and standard deviation d: sigma^2 = ln(1 + d^2/m^2), mu = ln m - sigma^2 / 2,
quantile exp(mu + sigma z(u)) with z the standard normal quantile (tables: z(0.25) = -0.6745,
z(0.5) = 0, z(0.75) = 0.6745, z(0.8660) = 1.1078)."""

from __future__ import annotations

import dataclasses

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.sample_lengths import DATASETS, SAMPLED_STEPS, sampled_seq_lens
from trainmem.specs.training import TrainingConfig

# m = 100, d = 50: sigma^2 = ln 1.25 = 0.22314, sigma = 0.47238, mu = 4.60517 - 0.11157 = 4.49360


def test_one_sample_a_batch_takes_the_quantiles_at_the_step_midpoints() -> None:
    # two steps: p = 0.25, 0.75; exp(4.49360 -/+ 0.47238 * 0.6745) = exp(4.17497) = 65.04,
    # exp(4.81222) = 123.00
    assert sampled_seq_lens("100:50", 512, 1, steps=2, order="ascending") == (65, 123)


def test_a_batch_is_padded_to_the_longest_of_its_samples() -> None:
    # b = 2: the largest of two draws is at p^(1/2): p = 0.25 -> 0.5, the median exp(mu) =
    # m / sqrt(1.25) = 89.44; p = 0.75 -> 0.8660, exp(4.49360 + 0.47238 * 1.1078) = 150.94
    assert sampled_seq_lens("100:50", 512, 2, steps=2, order="ascending") == (89, 151)


def test_truncated_samples_stop_at_seq_len() -> None:
    # the 0.75 quantile (123) is cut to --seq-len 100; the 0.25 one (65) is not
    assert sampled_seq_lens("100:50", 100, 1, steps=2, order="ascending") == (65, 100)


def test_deleted_samples_leave_the_distribution_below_seq_len() -> None:
    # "delete": the samples kept are those under 100 tokens, F(100) = Phi((ln 100 - mu) / sigma)
    # = Phi(0.23619) = 0.59336; quantiles at 0.25 F = 0.14834 (z = -1.0436) and 0.75 F = 0.44502
    # (z = -0.13826): exp(4.49360 - 0.49297) = 54.63, exp(4.49360 - 0.06531) = 83.79
    assert sampled_seq_lens("100:50", 100, 1, "delete", steps=2, order="ascending") == (55, 84)


def test_the_published_shortest_and_longest_bound_the_lengths() -> None:
    # shortest 80: the 0.25 quantile (65) is raised to it; longest 110: the 0.75 one (123) cut
    assert sampled_seq_lens("100:50:80:110", 512, 1, steps=2, order="ascending") == (80, 110)


def test_no_spread_gives_the_mean_at_every_step() -> None:
    assert sampled_seq_lens("300:0", 512, 4) == (300,) * SAMPLED_STEPS


def test_the_orders_are_one_set_of_lengths() -> None:
    up = sampled_seq_lens("alpaca-cleaned", 512, 2, order="ascending")
    assert list(up) == sorted(up) and len(set(up)) > SAMPLED_STEPS // 2
    assert sampled_seq_lens("alpaca-cleaned", 512, 2, order="descending") == up[::-1]
    shuffled = sampled_seq_lens("alpaca-cleaned", 512, 2)
    assert sorted(shuffled) == list(up) and shuffled not in (up, up[::-1])
    assert sampled_seq_lens("alpaca-cleaned", 512, 2, seed=1) != shuffled


def test_every_shipped_dataset_has_its_source() -> None:
    for name, stats in DATASETS.items():
        assert stats.source and stats.shortest <= stats.mean <= (stats.longest or stats.mean), name


@pytest.mark.parametrize("text", ["alpaca", "abc", "100", "100:50:1:2:3", "-5:3", "100:-1", ""])
def test_other_text_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(SpecError, match="sample_lengths"):
        TrainingConfig(sample_lengths=text)


def test_a_long_samples_value_outside_the_two_is_refused() -> None:
    with pytest.raises(SpecError, match="long_samples.*truncate, delete"):
        TrainingConfig(long_samples="cut")  # type: ignore[arg-type]


def test_explicit_earlier_lengths_win() -> None:
    given = TrainingConfig(earlier_seq_lens="64,32", sample_lengths="alpaca-cleaned")
    assert given.earlier_seq_len_list == (64, 32)
    drawn = TrainingConfig(seq_len=512, micro_batch_size=2, sample_lengths="alpaca-cleaned")
    assert drawn.earlier_seq_len_list == sampled_seq_lens("alpaca-cleaned", 512, 2)


GPT2 = TrainingConfig(micro_batch_size=4, seq_len=512, precision="32-true")


def test_the_estimate_replays_the_drawn_lengths_as_listed_ones() -> None:
    drawn = dataclasses.replace(GPT2, sample_lengths="100:80")
    listed = dataclasses.replace(
        GPT2, earlier_seq_lens=",".join(map(str, sampled_seq_lens("100:80", 512, 4)))
    )
    fixed, a, b = (estimate("gpt2", t, gpu="A100-80GB") for t in (GPT2, drawn, listed))
    assert a.breakdown.reserved_bytes == b.breakdown.reserved_bytes
    # the drawn steps leave blocks cached beside the measured step's: more reserved, the same
    # allocated peak (every drawn length is at most --seq-len)
    assert a.breakdown.reserved_bytes > fixed.breakdown.reserved_bytes
    assert a.breakdown.allocated_bytes == fixed.breakdown.allocated_bytes
    assumed = a.details["assumed"]["lengths"]
    assert "100:80" in assumed and ",".join(map(str, sampled_seq_lens("100:80", 512, 4))) in assumed


def test_a_closed_form_answer_builds_no_earlier_step() -> None:
    drawn = dataclasses.replace(GPT2, sample_lengths="100:80")
    a, b = (estimate("gpt2", t, gpu="A100-80GB", simulate_allocator=False) for t in (GPT2, drawn))
    assert a.schedules[0].setup == b.schedules[0].setup
    assert a.breakdown.allocated_bytes == b.breakdown.allocated_bytes
