"""Schedules filled from a template against the builder's own (Note [Schedule templates] in
trainmem/analytic/template.py).

A template is the builder run once with the micro-batch size and the sequence length recorded;
a configuration whose guards hold gets the recorded items with its own sizes. Here every
configuration of a spread (five models, bases with sharding, pipelining, LoRA / QLoRA,
DeepSpeed, offload, each varied in one setting at a time over every value it takes, each at
several micro-batch sizes and sequence lengths) is estimated twice: built (the default) and
``lean`` (filled from templates, as a sweep's rows are). The schedules must be equal item for
item, and the peak, its split, phase, reason, fit and verdict equal too. The expected answer is
the builder's, which the rest of the suite checks against its own derivations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import other_values
from trainmem.analytic import engine
from trainmem.analytic.template import _REC, Filled, Sym, _Recorder, templated_schedules
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig, derived

MODELS = ("gpt2", "llama-3.2-1b", "t5-base", "bert-base-uncased", "deepseek-v3")
BASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "mixed-eager": {"precision": "bf16-mixed", "attention": "eager"},
    "checkpointed": {"activation_checkpointing": "full", "precision": "bf16-mixed"},
    "qlora": {"lora_rank": 8, "quantize_base": "nf4", "precision": "bf16-mixed"},
    "fsdp-pp": {"data_parallel_size": 8, "zero_stage": 3, "pipeline_parallel_size": 2},
    "deepspeed-offload": {
        "framework": "deepspeed",
        "data_parallel_size": 4,
        "zero_stage": 2,
        "offload": "optimizer",
        "precision": "bf16-mixed",
    },
}
SHAPES = ((1, 64), (2, 512), (3, 100), (8, 1000), (5, 2048), (1, 300))
"""(micro-batch size, sequence length) pairs: several paths through the builder's size tests
(divisibility of the terms, which tensor is the largest), longer ones refused per model."""


def _variants(base: dict[str, Any]) -> Iterator[TrainingConfig]:
    yield TrainingConfig(**base)
    for field in dataclasses.fields(TrainingConfig):
        if field.name in ("micro_batch_size", "seq_len"):
            continue
        for value in other_values(field):
            try:
                yield TrainingConfig(**{**base, field.name: value})
            except SpecError:
                continue  # a combination TrainingConfig refuses


def _answer(
    model: object, training: TrainingConfig, lean: bool, *, details: bool = False
) -> tuple[object, ...] | str:
    try:
        est = estimate(
            model,  # type: ignore[arg-type]
            training,
            gpu="H100-80GB",
            engine="analytic",
            simulate_allocator=False,
            lean=lean,
        )
    except (SpecError, UnsupportedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    per_rank = [
        {k: v for k, v in r.items() if k in ("allocated_bytes", "peak_phase")}
        for r in est.details["per_rank"]  # type: ignore[union-attr]
    ]
    return (
        est.schedules,
        est.breakdown,
        est.peak_phase,
        est.peak_reason,
        est.fits,
        est.verdict,
        est.margin_bytes,
        est.reported_rank,
        per_rank,
        est.details.get("load_phase"),
        est.num_parameters,
        est.num_trainable_parameters,
        (est.details, est.notes) if details else None,
    )


def _builder_only(*args: Any, eager: bool, details: bool) -> Filled | None:
    """``templated_schedules`` for the built answer: a sweep's rows filled, one estimate built
    (it would be filled from the template once its structure was met before)."""
    return templated_schedules(*args, eager=True, details=details) if eager else None


def _check(
    model_name: str, trainings: list[TrainingConfig], shapes: tuple[tuple[int, int], ...]
) -> int:
    model = load_model_spec(model_name)
    checked = 0
    for base in trainings:
        for b, s in shapes:
            try:
                training = derived(base, micro_batch_size=b, seq_len=s)
            except SpecError:
                continue
            with pytest.MonkeyPatch.context() as patch:  # the builder, never a template
                patch.setattr(engine, "templated_schedules", _builder_only)
                built = _answer(model, training, lean=False)
            filled = _answer(model, training, lean=True)
            assert filled == built, (model_name, training)
            checked += not isinstance(built, str)
    return checked


@pytest.mark.slow  # about a minute: ~1,500 structures recorded
@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("model_name", MODELS)
def test_filled_schedules_are_the_built_ones(model_name: str, base: str) -> None:
    assert _check(model_name, list(_variants(BASES[base])), SHAPES) > 100


def test_filled_schedules_are_the_built_ones_fast() -> None:
    # the fast representative: a few structures of two models, many shapes each
    shapes = tuple((b, s) for b in (1, 2, 3, 7) for s in (64, 96, 100, 384, 512, 1000))
    trainings = [
        TrainingConfig(),
        TrainingConfig(precision="bf16-mixed", activation_checkpointing="full"),
        TrainingConfig(precision="16-mixed", attention="eager", dropout=False),
        TrainingConfig(data_parallel_size=4, zero_stage=3, lora_rank=8, precision="bf16-true"),
    ]
    assert _check("llama-3.2-1b", trainings, shapes) == 4 * len(shapes)
    assert _check("gpt2", trainings[:2], shapes) == 2 * len(shapes)


def test_a_template_serves_other_shapes_and_refuses_another_path() -> None:
    # one recording serves (b, s) pairs that take its path; a pair whose sizes compare
    # otherwise is recorded anew, and both answers are the builder's. Here llama-3.2-1b's eager
    # (b, a, s, s) bf16 scores, 2 * 32 * b * s^2 bytes, equal its (b, s, h) fp32 activations,
    # 4 * 2048 * b * s, at s = 128: the builder's set of tensor sizes holds one where it holds
    # two at s = 200 or 208
    from trainmem.analytic import template
    from trainmem.analytic.activations import activation_profile
    from trainmem.analytic.engine import pipeline_ranks
    from trainmem.analytic.schedule import rank_schedule
    from trainmem.analytic.tensor_states import state_layout

    model = load_model_spec("llama-3.2-1b")
    base = TrainingConfig(attention="eager", precision="bf16-mixed", gradient_accumulation_steps=3)
    ranks = pipeline_ranks(model, base)
    key = template._key(model, base, 1 << 20)
    template._TEMPLATES.pop(key, None)
    for s, recordings in ((200, 1), (208, 1), (128, 2), (216, 2)):
        training = derived(base, seq_len=s)
        filled = templated_schedules(model, training, ranks, 1 << 20)
        assert len(template._TEMPLATES[key].fills) == recordings
        layout, prof = state_layout(model, training), activation_profile(model, training)
        assert filled is not None
        assert filled.schedules == [
            rank_schedule(
                model, training, r, layout=layout, prof=prof, workspace_per_handle=1 << 20
            )
            for r in ranks
        ]


def test_one_estimate_records_after_a_few_builds() -> None:
    # Note [When a template is recorded]: single estimates of a new structure are built, and
    # record nothing, until RECORD_AFTER_BUILDS of them were; the next records its template and
    # the one after is filled from it; every answer is the builder's (the schedules and the
    # estimate, its details among them: the activation terms and the loss's transients are
    # filled with the schedules; compared with the same configuration estimated by the
    # builder only)
    from trainmem.analytic import template
    from trainmem.specs.hardware import get_gpu

    model = load_model_spec("gpt2")
    base = TrainingConfig(precision="bf16-mixed", gradient_accumulation_steps=5, dropout=False)
    key = template._key(model, base, get_gpu("H100-80GB").cublas_workspace_bytes)
    template._TEMPLATES.pop(key, None)
    template._BUILT.pop(key, None)
    builds = template.RECORD_AFTER_BUILDS
    for k, recordings in enumerate([None] * builds + [1, 1]):
        training = derived(base, seq_len=300 + k)
        answer = _answer(model, training, lean=False, details=True)
        found = template._TEMPLATES.get(key)
        assert (found and len(found.fills)) == recordings, k
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engine, "templated_schedules", _builder_only)
            assert answer == _answer(model, training, lean=False, details=True)


def test_recorded_values_guard_every_decision() -> None:
    # arithmetic is recorded; comparisons, truth tests and conversions are guards on it
    rec = _Recorder()
    _REC.append(rec)
    try:
        b, s = rec.node(3, "b", ()), rec.node(100, "s", ())
        t = b * s
        assert isinstance(t, Sym) and t.v == 300
        assert t * 1 is t and 0 + t is t  # the identities add no expression
        assert (t // 7).v == 42 and (t % 7).v == 6
        assert t > 299 and not t > 300
        assert [0] * (b - 1) == [0, 0]  # an index: pinned to its value
        assert f"{t:,}" == "300"
        assert round(t / 7).v == 43
    finally:
        _REC.pop()
    guards = [code for _, code, _ in rec.guards]
    assert "(x2 > 299)" in guards and "not (x2 > 300)" in guards
    assert any(code.endswith("== 2)") for code in guards)  # the pinned index
    assert any(code.endswith("== 300)") for code in guards)  # the pinned text
    with pytest.raises(Exception, match="after its recording ended"):
        _ = t + 1
    _REC.append(_Recorder())  # another recording: the first one's values are not its own
    try:
        with pytest.raises(Exception, match="after its recording ended"):
            _ = t > 1
    finally:
        _REC.pop()
