"""``derived`` (the planner's fast ``dataclasses.replace``) answers and refuses as ``replace``
does; ``cached_on`` caches give the uncached answer on configurations that differ in every
field they do not list (issue 28)."""

from __future__ import annotations

import dataclasses
from itertools import product
from typing import Any

import pytest

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.loss import model_loss_in_logits_dtype
from trainmem.errors import SpecError
from trainmem.memo import cached_on
from trainmem.specs.hf import load_model_spec
from trainmem.specs.ranks import model_rank_map
from trainmem.specs.training import TrainingConfig, derived

BASES = [
    TrainingConfig(),
    TrainingConfig(
        precision="16-mixed", framework="deepspeed", zero_stage=2, data_parallel_size=4
    ),  # fmt: skip
    TrainingConfig(
        pipeline_parallel_size=4,
        pipeline_schedule="interleaved-1f1b",
        virtual_pipeline_stages=2,
        gradient_accumulation_steps=8,
    ),  # fmt: skip
]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize(
    "changes",
    [
        {"micro_batch_size": 7, "seq_len": 3000},
        {"precision": "bf16"},  # an alias, made the full name by PrecisionConfig's check
        {"activation_checkpointing": "full", "optimizer": "sgd"},
        {"lora_rank": 8, "quantize_base": "nf4"},
        {"tensor_parallel_size": 2, "sequence_parallel": True},
    ],
)
def test_derived_equals_replace(base: TrainingConfig, changes: dict[str, Any]) -> None:
    expected = dataclasses.replace(base, **changes)
    got = derived(base, **changes)
    assert got == expected and hash(got) == hash(expected)
    assert [getattr(got, f.name) for f in dataclasses.fields(got)] == [
        getattr(expected, f.name) for f in dataclasses.fields(expected)
    ]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"precision": "fp4"}, "precision"),
        ({"lora_dropout": float("nan")}, "lora_dropout"),
        (
            {"optimizer_in_backward": True, "gradient_accumulation_steps": 4},
            "optimizer_in_backward",
        ),  # fmt: skip
        ({"context_parallel_size": 3, "seq_len": 1000}, "context_parallel_size"),
        ({"gradient_accumulation_steps": 4}, "optimizer_in_backward"),  # the base's other field
    ],
)
def test_derived_refuses_what_replace_refuses(changes: dict[str, Any], field: str) -> None:
    base = TrainingConfig(optimizer_in_backward=True) if field == "optimizer_in_backward" and (
        "optimizer_in_backward" not in changes) else TrainingConfig()  # fmt: skip
    with pytest.raises(SpecError) as expected:
        dataclasses.replace(base, **changes)
    with pytest.raises(SpecError) as got:
        derived(base, **changes)
    assert got.value.field == expected.value.field == field
    assert str(got.value) == str(expected.value)


def test_derived_refuses_an_unknown_field_as_replace_does() -> None:
    with pytest.raises(TypeError):
        derived(TrainingConfig(), batch=2)


def _variants() -> list[TrainingConfig]:
    """Configurations that differ in the fields the caches read and in others."""
    out = []
    for precision, framework, quantize, (dp, tp, cp, pp, schedule), b in product(
        ("bf16-mixed", "16-true", "32-true", "fp8-mixed"),
        ("pytorch-amp", "lit-gpt", "megatron", "torchtitan"),
        ("none", "nf4"),
        ((1, 1, 1, 1, "1f1b"), (8, 2, 1, 4, "interleaved-1f1b"), (2, 1, 2, 2, "gpipe")),
        (1, 3),
    ):
        try:
            out.append(
                TrainingConfig(
                    precision=precision,  # type: ignore[arg-type]
                    framework=framework,
                    quantize_base=quantize,
                    lora_rank=8 if quantize != "none" else 0,
                    data_parallel_size=dp,
                    tensor_parallel_size=tp,
                    context_parallel_size=cp,
                    # the plain loop's CP runs with FSDP2 over its ranks only
                    zero_stage=3 if cp > 1 and framework == "pytorch-amp" else 0,
                    pipeline_parallel_size=pp,
                    pipeline_schedule=schedule,
                    virtual_pipeline_stages=2,
                    gradient_accumulation_steps=pp,
                    micro_batch_size=b,
                    seq_len=1024 * b,
                )
            )
        except SpecError:
            continue
    return out


def test_cached_terms_equal_their_uncached_answer() -> None:
    model = load_model_spec("llama-3.1-8b")
    variants = _variants()
    assert len(variants) > 60
    compute_and_residual_bytes.cache_clear()  # type: ignore[attr-defined]
    model_rank_map.cache_clear()  # type: ignore[attr-defined]
    model_loss_in_logits_dtype.cache_clear()  # type: ignore[attr-defined]
    gpt2 = load_model_spec("gpt2")  # its loss takes 16-bit logits before transformers 4.49
    for t in variants:
        for version in (None, "4.44.0"):
            v = dataclasses.replace(t, transformers_version=version, loss=None)
            for m in (model, gpt2):
                fresh = model_loss_in_logits_dtype.__wrapped__(m, v)  # type: ignore[attr-defined]
                assert model_loss_in_logits_dtype(m, v) == fresh
    for t in variants:
        assert compute_and_residual_bytes(t) == compute_and_residual_bytes.__wrapped__(t)  # type: ignore[attr-defined]
        assert model_rank_map(model, t) == model_rank_map.__wrapped__(model, t)  # type: ignore[attr-defined]


def test_cached_on_keys_on_the_listed_fields_and_keeps_the_newest() -> None:
    calls: list[int] = []

    @cached_on("micro_batch_size", maxsize=2)
    def twice(t: TrainingConfig) -> int:
        calls.append(t.micro_batch_size)
        return 2 * t.micro_batch_size

    one, also_one, two, three = (TrainingConfig(micro_batch_size=b, seq_len=s)
                                 for b, s in ((1, 100), (1, 200), (2, 100), (3, 100)))  # fmt: skip
    assert [twice(one), twice(also_one), twice(two), twice(three), twice(one)] == [2, 2, 4, 6, 2]
    assert calls == [1, 2, 3, 1]  # seq_len is not read; b=1 was dropped when b=3 came
