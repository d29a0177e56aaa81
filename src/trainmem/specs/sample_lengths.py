"""The earlier steps' lengths from a dataset's length distribution (``sample_lengths``).

Note [Lengths from a dataset's statistics]
    Most training runs over instruction data pad each micro-batch to its own longest sample
    (torchtune ``padded_collate``, the HF ``DataCollatorForSeq2Seq`` / ``DataCollatorWith
    Padding``, ms-swift ``data_collate_fn``, litgpt ``get_sft_collate_fn``), so the caching
    allocator meets a new shape at every step (Note [Steps of varying length]). A user rarely
    knows the lengths of the steps; a dataset's published token statistics (mean, standard
    deviation, shortest and longest sample) stand in for them here:

    1. a sample's length is log-normal with the published mean m and standard deviation d
       (moments matched: sigma^2 = ln(1 + d^2 / m^2), mu = ln m - sigma^2 / 2), held within
       the published shortest and longest samples; the shape is this module's assumption (no
       source gives more than the moments), right-skewed as token counts are;
    2. a micro-batch of b samples is padded to its longest, the largest of b draws, whose
       quantile at p is the sample's at p^(1/b) (independent draws);
    3. a sample above ``seq_len`` is cut to it (``long_samples="truncate"``: torchtune's
       ``max_seq_len``, litgpt's ``max_seq_length``, HF tokenizers' ``truncation=True``) or
       dropped from the data (``"delete"``: ms-swift's ``--truncation_strategy delete``, the
       default in 2.x): the sample's distribution then stops at ``seq_len`` (quantile at
       u F(seq_len));
    4. :data:`SAMPLED_STEPS` steps, at the micro-batch quantiles p = (i + 1/2) / N, run in
       :data:`ORDER`'s order before the measured step (at ``seq_len``, the longest micro-batch
       the run can meet).

    Which order (benchmarks/sample_lengths_order.py, session 26): the replayed reserved bytes
    depend on it. Ascending lengths grow the cache most (every step meets blocks too small for
    it: torchtune's alpaca rows +8 .. +28 %, ms-swift's LoRA cells up to +175 %, far over the
    measurements); descending least (each step fits the blocks of the one before: mostly the
    fixed-length figure). A shuffled data loader (torchtune, the HF Trainer, ms-swift all
    shuffle) gives neither, so the quantiles are shuffled, by ``random.Random(0)``: over five
    seeds the seed-0 figure lies within 4.2 points of their median on every row studied (it was
    not chosen for that: 0 is the first seed). The shuffles' spread is the figure's uncertainty
    from the order alone: a median of 8 points (0-9) on torchtune's alpaca rows at 512 (GT033:
    -6.3 .. +2.5 %), 5-45 points on ms-swift's first 11 LoRA cells. It is a property of a run,
    not of the short sample: i.i.d. draws over 256 steps settle within 32-64 steps (the cache
    then holds blocks for every later size) at seed-dependent figures (GT033: -3.5 / -5.9 / -6.7
    %; GT029: -26.7 / -28.3 / -31.4 %). 16 and 63 steps land within the shuffles' range;
    :data:`SAMPLED_STEPS` is 32, where those long runs have settled. Explicit
    ``earlier_seq_lens`` win over ``sample_lengths``.

Source: the statistics of :data:`DATASETS`, each with its citation.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Literal

from trainmem.errors import SpecError

LongSamples = Literal["truncate", "delete"]
LONG_SAMPLES: tuple[LongSamples, ...] = ("truncate", "delete")
"""What the data pipeline does with a sample above ``seq_len`` (Note [Lengths from a dataset's
statistics], step 3)."""

SAMPLED_STEPS = 32
"""Earlier steps drawn from a dataset's statistics (each is one more schedule built and
replayed: an estimate takes about 17 ms more per step on a 7B model; benchmarks/
sample_lengths_order.py compares 16, 32 and 63)."""

Order = Literal["shuffled", "ascending", "descending"]
ORDERS: tuple[Order, ...] = ("shuffled", "ascending", "descending")
ORDER: Order = "shuffled"
"""The order the sampled steps run in: the quantiles shuffled by ``random.Random(ORDER_SEED)``
(a shuffled data loader; Note [Lengths from a dataset's statistics])."""
ORDER_SEED = 0


@dataclass(frozen=True, slots=True)
class LengthStatistics:
    """A dataset's tokens per sample as published: mean, standard deviation, shortest and
    longest (None: not stated), and where the figures come from."""

    mean: float
    sd: float
    shortest: int = 1
    longest: int | None = None
    source: str = "given"


_SWIFT = "ms-swift v3.0 dataset table, Qwen2 tokenizer and chat template"
_SWIFT_BENCHMARK = "ms-swift Benchmark.md @4312aeb2, Qwen-1 tokenizer"

DATASETS: dict[str, LengthStatistics] = {
    "alpaca-cleaned": LengthStatistics(170.1, 122.9, 29, 1028, _SWIFT),
    "alpaca-gpt4": LengthStatistics(167.6, 123.9, 29, 607, _SWIFT),
    "codealpaca-20k": LengthStatistics(99.3, 57.6, 30, 857, _SWIFT),
    "dolly-15k": LengthStatistics(199.0, 268.8, 26, 5987, _SWIFT),
    "no-robots": LengthStatistics(300.0, 246.2, 40, 6739, _SWIFT),
    "slimorca": LengthStatistics(405.5, 442.1, 47, 8312, _SWIFT),
    "sharegpt": LengthStatistics(820.5, 366.1, 25, 2221, _SWIFT),
    "ultrachat-200k": LengthStatistics(1188.0, 571.1, 170, 4068, _SWIFT),
    "cls-fudan-news-zh": LengthStatistics(3234.4, 2547.5, 91, 19548, _SWIFT_BENCHMARK),
}
"""Shipped token statistics by name (``--sample-lengths NAME``), each figure as its source
prints it (mean, standard deviation, shortest, longest):

- ``cls-fudan-news-zh``: modelscope/ms-swift docs/source/LLM/Benchmark.md @4312aeb28776
  (2024-01-04), the dataset of its Qwen-1 benchmark, tokens of the Qwen-1 tokenizer;
- the others: ms-swift docs/source_en/Instruction/Supported-models-datasets.md @b40f31df7c09
  (v3.0, 2024-12-05; unchanged in the current Supported-models-and-datasets.md), column
  "Statistic (token)", computed by scripts/utils/run_dataset_info.py at that commit: the first
  5,000 samples of the Hugging Face dataset (alpaca-cleaned: yahma/alpaca-cleaned;
  alpaca-gpt4: vicgalle/alpaca-gpt4; codealpaca-20k: HuggingFaceH4/CodeAlpaca_20K; dolly-15k:
  databricks/databricks-dolly-15k; no-robots: HuggingFaceH4/no_robots; slimorca:
  Open-Orca/SlimOrca; sharegpt: swift/sharegpt's common-zh, unknow-zh and common-en subsets;
  ultrachat-200k: HuggingFaceH4/ultrachat_200k train_sft) encoded with the Qwen2-7B-Instruct
  tokenizer and swift's ``qwen`` chat template (its system prompt included), mean +- standard
  deviation, min, max of ``len(input_ids)``.

The tokenizer and template are the source's: another model's counts differ (a Llama-2
tokenizer splits English text into more tokens than Qwen's; another prompt template adds or
removes a few dozen tokens); ``MEAN:SD`` gives one's own."""


def parse_sample_lengths(text: str) -> LengthStatistics:
    """``sample_lengths``: a name of :data:`DATASETS`, or ``MEAN:SD`` with optional
    ``:SHORTEST`` and ``:LONGEST`` (tokens per sample).

    Raises:
        SpecError: another value (the field named, the allowed forms listed).
    """
    stats = DATASETS.get(text.strip().lower())
    if stats is not None:
        return stats
    parts = text.split(":")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    ok = 2 <= len(numbers) <= 4 and all(math.isfinite(x) for x in numbers)
    if ok:
        mean, sd = numbers[0], numbers[1]
        shortest = numbers[2] if len(numbers) > 2 else 1.0
        longest = numbers[3] if len(numbers) > 3 else None
        ok = mean >= 1 and sd >= 0 and 1 <= shortest <= mean
        ok = ok and (longest is None or longest >= mean) and shortest == int(shortest)
        ok = ok and (longest is None or longest == int(longest))
        if ok:
            return LengthStatistics(
                mean, sd, int(shortest), None if longest is None else int(longest)
            )
    raise SpecError(
        "sample_lengths",
        f"must be a dataset name ({', '.join(DATASETS)}) or MEAN:SD[:SHORTEST[:LONGEST]] in "
        f"tokens per sample (mean >= 1, sd >= 0, shortest <= mean <= longest), got {text!r}",
    )


def sampled_seq_lens(
    text: str,
    seq_len: int,
    micro_batch_size: int,
    long_samples: LongSamples = "truncate",
    *,
    steps: int = SAMPLED_STEPS,
    order: Order = ORDER,
    seed: int = ORDER_SEED,
) -> tuple[int, ...]:
    """The earlier steps' lengths for ``sample_lengths=text`` (Note [Lengths from a dataset's
    statistics]): ``steps`` micro-batch lengths, each the longest of ``micro_batch_size``
    samples, at most ``seq_len``, in ``order``.

    Raises:
        SpecError: ``text`` is not a dataset's name nor ``MEAN:SD...``.
    """
    return _sampled(text, seq_len, micro_batch_size, long_samples, steps, order, seed)


@lru_cache(maxsize=4096)
def _sampled(
    text: str,
    seq_len: int,
    micro_batch_size: int,
    long_samples: LongSamples,
    steps: int,
    order: Order,
    seed: int,
) -> tuple[int, ...]:
    stats = parse_sample_lengths(text)
    top = seq_len if stats.longest is None else min(seq_len, stats.longest)
    if stats.sd == 0:
        quantile = [stats.mean] * steps
    else:
        sigma = math.sqrt(math.log1p((stats.sd / stats.mean) ** 2))
        dist = NormalDist(math.log(stats.mean) - sigma * sigma / 2, sigma)
        # "delete": the samples above seq_len are not in the data (the distribution stops there)
        kept = dist.cdf(math.log(seq_len)) if long_samples == "delete" else 1.0
        quantile = []
        for i in range(steps):
            u = ((i + 0.5) / steps) ** (1 / micro_batch_size) * kept  # the batch's longest
            quantile.append(math.exp(dist.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))))
    lengths = [max(1, min(top, max(stats.shortest, round(x)))) for x in quantile]
    if order == "descending":
        lengths.reverse()
    elif order == "shuffled":
        random.Random(seed).shuffle(lengths)
    return tuple(lengths)


def describe_lengths(
    text: str, lengths: tuple[int, ...], long_samples: LongSamples, seq_len: int, b: int
) -> str:
    """The ``assumed: lengths`` text for sampled lengths: the statistics, their source, and the
    lengths replayed (at ``seq_len`` and micro-batch ``b``)."""
    stats = parse_sample_lengths(text)
    bounds = f", {stats.shortest}..{stats.longest}" if stats.longest else ""
    return (
        f"micro-batches padded to their longest sample, {len(lengths)} earlier steps drawn from "
        f"{text} ({stats.mean:g} +- {stats.sd:g} tokens{bounds}; {stats.source}) as log-normal, "
        f"each the longest of {b}, samples above --seq-len {long_samples}d, {ORDER} (Note "
        f"[Lengths from a dataset's statistics]); at seq_len {seq_len}: "
        + ",".join(str(n) for n in lengths)
    )
