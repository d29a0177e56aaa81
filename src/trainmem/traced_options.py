"""Training options the trace cannot run for real, applied to a traced step as the analytic
engine's rules (issue 26: "every training option on every model path").

Each option here is one :class:`TracedOption`: the settings the trace runs in its place
(:meth:`TracedOption.traced_as`, e.g. one rank without data parallelism) and the rewrite of the
traced :class:`~trainmem.schedule.StepSchedule` into the one the option has, with the same rule
the analytic engine's transform for it uses (:mod:`trainmem.analytic.transforms`). What the
trace runs as it is (FSDP2, DTensor, pipelining, peft, compile) stays in :mod:`trainmem.trace`;
DeepSpeed ZeRO-1/2 and the quantized optimizers are :mod:`trainmem.traced_transforms`.

Note [DDP on a traced step]
    torch's ``DistributedDataParallel`` does not wrap a model of fake tensors usefully: its
    ``Reducer`` (C++, torch/csrc/distributed/c10d/reducer.cpp) builds the flat bucket tensors
    outside the Python dispatcher the recorder sees, and its collectives need a process group
    the fake one answers without data. What a DDP rank holds beyond the plain loop is the
    reducer's flat buckets (Note [DDP gradient buckets] in trainmem/analytic/transforms/ddp.py):
    every trainable parameter's gradient bytes in the parameter's dtype, allocated at wrap time
    and never freed. So the plain loop of one rank is traced (``data_parallel_size=1``) and the
    buckets are allocated after the state the step starts from, sized as the most gradient
    bytes the traced step holds (every ``.grad`` before ``zero_grad``: each trainable
    parameter's gradient in its own dtype, fp32 LoRA adapters included), which is what
    :class:`~trainmem.analytic.transforms.ddp.DdpReducer` sums from the analytic layout. It
    needs no ModelSpec, so it applies to every traced model (diffusers, timm, remote code).

Source: torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp (cited per
rule in the Notes); the analytic transforms named per option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from trainmem.analytic.transforms.ddp import bucket_op
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

__all__ = [
    "OPTIONS",
    "TracedOption",
    "active_options",
    "apply_ddp",
    "traced_ddp",
    "traced_settings",
]


@dataclass(frozen=True, slots=True)
class TracedOption:
    """One option applied to a traced step.

    Attributes:
        name: what the estimate's note calls it.
        applies: the option is asked for and this rule models it.
        traced_as: the settings the trace runs instead (the option taken out).
        apply: the traced step (of ``traced_as``'s settings) as the run asked for has it;
            given the model's shape when it has a ModelSpec (None otherwise).
        note: one line for the estimate's notes.
    """

    name: str
    applies: Callable[[TrainingConfig], bool]
    traced_as: Callable[[TrainingConfig], TrainingConfig]
    apply: Callable[[StepSchedule, ModelSpec | None, TrainingConfig], StepSchedule]
    note: Callable[[TrainingConfig], str]


# -- plain DDP ---------------------------------------------------------------------------------


def traced_ddp(training: TrainingConfig) -> bool:
    """Plain data parallelism the traced paths model (Note [DDP on a traced step]): ZeRO stage 0
    over more than one rank under a framework that wraps with torch DDP
    (``FrameworkConventions.ddp_reducer_buckets``), without tensor, context or pipeline
    parallelism (as :class:`~trainmem.analytic.transforms.ddp.DdpReducer`)."""
    t = training
    return (
        t.conventions.ddp_reducer_buckets
        and t.data_parallel_size > 1
        and t.zero_stage == 0
        and t.tensor_parallel_size == 1
        and t.context_parallel_size == 1
        and t.pipeline_parallel_size == 1
    )


def apply_ddp(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced single-rank step with DDP's flat gradient buckets (Note [DDP on a traced
    step]): one allocation of the step's most gradient bytes, after the state the step starts
    from (weights, buffers), kept for the run.

    Args:
        schedule: a traced step of one rank without data parallelism.
        model: unused (the sizes are the traced gradients').
        training: the DDP run.

    Returns:
        The schedule with the buckets in its setup (or its leading state, for a flat one).
    """
    bucket = bucket_op(schedule.category_peak(Cat.GRADIENT))
    if schedule.setup:
        setup = _after_state(schedule.setup, bucket)
        return StepSchedule(setup=setup, step=schedule.step, name=schedule.name)
    return StepSchedule(setup=(), step=_after_state(schedule.step, bucket), name=schedule.name)


def _after_state(items: tuple[Item, ...], op: Op) -> tuple[Item, ...]:
    """``items`` with ``op`` after their leading run of ``init`` ops (the state)."""
    n = 0
    while n < len(items) and isinstance(items[n], Op) and items[n].phase == "init":  # type: ignore[union-attr]
        n += 1
    return (*items[:n], op, *items[n:])


DDP = TracedOption(
    name="ddp",
    applies=traced_ddp,
    traced_as=lambda t: replace(t, data_parallel_size=1),
    apply=apply_ddp,
    note=lambda t: (
        f"DDP over {t.data_parallel_size} ranks: one rank's plain loop was traced and torch "
        "DDP's flat gradient buckets added (every trainable gradient's bytes, kept from wrap "
        "time; Note [DDP on a traced step] in trainmem/traced_options.py)"
    ),
)

OPTIONS: tuple[TracedOption, ...] = (DDP,)
"""Every option, in the order their rewrites apply (each to the previous one's schedule)."""


def active_options(training: TrainingConfig) -> list[TracedOption]:
    """The options of ``training`` this module models, each checked on the settings the
    earlier ones leave (so their stand-ins compose)."""
    out: list[TracedOption] = []
    for option in OPTIONS:
        if option.applies(training):
            out.append(option)
            training = option.traced_as(training)
    return out


def traced_settings(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs for ``training``: each active option taken out."""
    for option in active_options(training):
        training = option.traced_as(training)
    return training
