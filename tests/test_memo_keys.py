"""Every cache of :mod:`trainmem.memo` (``cached_on``) against its own uncached function.

``cached_on`` keys a function on the settings it reads; a field missing from the key answers a
configuration from another's entry (``prepare_kbit_training`` was, once). Here each cached
function is first asked about a base configuration, then about every configuration that
differs from it in one setting (each allowed value of a choice, the other value of a flag, a
few counts), and each answer must equal the uncached function's (``__wrapped__``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import other_values
from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.loss import model_loss_in_logits_dtype
from trainmem.errors import SpecError
from trainmem.memo import cached_on, per_configuration
from trainmem.specs.hf import load_model_spec
from trainmem.specs.ranks import model_rank_map
from trainmem.specs.training import TrainingConfig

MODEL = load_model_spec("llama-3.2-1b")
GPT2 = load_model_spec("gpt2")  # its own loss takes 16-bit logits before transformers 4.49

BASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "qlora": {"lora_rank": 8, "quantize_base": "nf4"},
    "parallel": {"data_parallel_size": 8, "zero_stage": 3, "pipeline_parallel_size": 2},
    "interleaved": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "interleaved-1f1b",
        "gradient_accumulation_steps": 4,
    },
    "transformers-4.44": {"transformers_version": "4.44.0"},  # gpt2's 16-bit loss
}

CACHED: dict[str, Callable[[TrainingConfig], object]] = {
    "compute_and_residual_bytes": compute_and_residual_bytes,
    "model_rank_map": lambda t: model_rank_map(MODEL, t),
    "model_loss_in_logits_dtype": lambda t: model_loss_in_logits_dtype(GPT2, t),
}
UNCACHED: dict[str, Callable[[TrainingConfig], object]] = {
    "compute_and_residual_bytes": compute_and_residual_bytes.__wrapped__,  # type: ignore[attr-defined]
    "model_rank_map": lambda t: model_rank_map.__wrapped__(MODEL, t),  # type: ignore[attr-defined]
    "model_loss_in_logits_dtype": lambda t: model_loss_in_logits_dtype.__wrapped__(GPT2, t),  # type: ignore[attr-defined]
}


def _variants(base: dict[str, Any]) -> Iterator[TrainingConfig]:
    for field in dataclasses.fields(TrainingConfig):
        for value in other_values(field):
            try:
                yield TrainingConfig(**{**base, field.name: value})
            except SpecError:
                continue  # a combination TrainingConfig refuses


@pytest.mark.parametrize("name", sorted(CACHED))
@pytest.mark.parametrize("base", sorted(BASES))
def test_a_cached_answer_is_the_uncached_one(name: str, base: str) -> None:
    cached, uncached = CACHED[name], UNCACHED[name]
    cached(TrainingConfig(**BASES[base]))  # the entry a missing key would answer from
    checked = 0
    for training in _variants(BASES[base]):
        try:
            expected = uncached(training)
        except SpecError:
            continue
        assert cached(training) == expected, training
        checked += 1
    assert checked > 50  # the variants did run


def test_every_cached_function_is_checked_here() -> None:
    # a new @cached_on function joins CACHED / UNCACHED above, with the bases it needs
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "trainmem"
    decorated = set()
    for path in src.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"^@cached_on\((?:.|\n)*?\)\n(?:#.*\n)*def (\w+)", text, re.M):
            decorated.add(match.group(1))
    assert decorated == set(CACHED)


def test_the_last_call_shortcut_answers_only_the_same_objects() -> None:
    # cached_on answers the last call's arguments by identity: alternating two configurations
    # (and two models) must give each its own answer, also after the cache is cleared
    calls: list[tuple[object, ...]] = []

    @cached_on("micro_batch_size")
    def doubled(training: TrainingConfig) -> int:
        calls.append((training,))
        return 2 * training.micro_batch_size

    @cached_on("micro_batch_size")
    def per_model(model: object, training: TrainingConfig) -> tuple[str, int]:
        return (str(model), training.micro_batch_size)

    one, three = TrainingConfig(micro_batch_size=1), TrainingConfig(micro_batch_size=3)
    assert [doubled(t) for t in (one, three, one, one, three)] == [2, 6, 2, 2, 6]
    assert len(calls) == 2  # one computation per distinct key
    doubled.cache_clear()  # type: ignore[attr-defined]
    assert doubled(three) == 6 and len(calls) == 3
    a, b = "model-a", "model-b"
    assert [per_model(m, t) for m, t in ((a, one), (b, one), (a, three), (a, one))] == [
        ("model-a", 1),
        ("model-b", 1),
        ("model-a", 3),
        ("model-a", 1),
    ]


def test_per_configuration_keys_on_the_objects() -> None:
    # per_configuration: the same (model, training) objects share one computation; an equal
    # configuration that is another object is computed again, so no field list can be short
    calls: list[int] = []

    @per_configuration
    def tokens(model: object, training: TrainingConfig) -> int:
        calls.append(1)
        return training.micro_batch_size * training.seq_len

    t = TrainingConfig(micro_batch_size=2, seq_len=100)
    assert tokens(MODEL, t) == 200 and tokens(MODEL, t) == 200
    assert len(calls) == 1
    assert tokens(MODEL, TrainingConfig(micro_batch_size=2, seq_len=100)) == 200
    assert len(calls) == 2
    assert tokens(MODEL, TrainingConfig(micro_batch_size=3, seq_len=100)) == 300


def test_by_value_keys_equal_objects_alike_and_others_apart() -> None:
    # by_value: one key per value, found by identity for an object met before; the key hashes
    # by identity, so equal models share a cache entry and unequal ones never do
    import dataclasses

    from trainmem.memo import by_value

    llama = load_model_spec("llama-3.2-1b")
    copy = dataclasses.replace(llama)  # equal, another object
    untied = dataclasses.replace(llama, tie_word_embeddings=not llama.tie_word_embeddings)
    assert copy is not llama and copy == llama and untied != llama
    key = by_value(llama)
    assert by_value(llama) is key and by_value(copy) is key
    assert by_value(untied) != key and {key: 1}.get(by_value(copy)) == 1
    assert key.obj == llama  # the first equal object met is held: none other takes its id
