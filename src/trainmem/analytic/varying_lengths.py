"""Steps of varying length before the measured one (``earlier_seq_lens``): the step schedules of
the earlier lengths run first, so the replay's caching allocator reaches the measured step with
the blocks they cached.

Note [Steps of varying length]
    A dataset padded to the longest sample of each batch (torchtune's ``padded_collate``, the
    HF ``DataCollatorWithPadding``) gives every step its own length, so every activation's size
    changes from one step to the next. The caching allocator keeps a freed block for reuse
    (c10/cuda/CUDACachingAllocator.cpp: nothing is returned to CUDA before an allocation
    fails or ``empty_cache``): a later, shorter step's tensors are carved out of the longer
    step's cached blocks (``get_free_block`` best fit, the remainder split off when it is
    over kSmallSize), and a later, longer step's tensors do not fit the shorter step's blocks
    and take new segments beside them. ``max_memory_reserved`` is the peak over the run, so it
    depends on the lengths seen and their order, which a step at one length cannot show. With
    ``earlier_seq_lens`` the schedule's setup runs the weights and the warm-up step at the first
    listed length, one step at each further listed length in order, then one step at
    ``seq_len`` (whose state, the optimizer's and any tensor a step hands to the next, the
    measured step starts from); the measured step is at ``seq_len``, and a listed length
    above it counts as ``seq_len`` (the estimate warns; a planner's search over the length
    stays defined). The driver replays that
    stream once, through one allocator (Note [One description of the step]), so the reserved
    figure holds every listed step's layout; the allocated peak is the measured step's (every
    listed length is at most ``seq_len``). Each listed length is one whole step: its
    micro-batches (``gradient_accumulation_steps``) all at that length. The lengths are the
    user's (from their data loader), or drawn from a dataset's length statistics
    (``sample_lengths``, Note [Lengths from a dataset's statistics] in
    trainmem/specs/sample_lengths.py); without either the tool assumes no distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainmem.analytic.activations import activation_profile
from trainmem.analytic.schedule import PipelineRank, rank_schedule
from trainmem.analytic.tensor_states import StateLayout
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def after_earlier_steps(
    model: ModelSpec,
    training: TrainingConfig,
    rank: PipelineRank,
    measured: StepSchedule,
    *,
    layout: StateLayout,
    workspace_per_handle: int,
) -> StepSchedule:
    """``measured`` (the rank's schedule at ``training.seq_len``) preceded by one step at each of
    ``training.earlier_seq_lens`` (Note [Steps of varying length]); ``measured`` itself when
    none are listed.

    Args:
        model / training: what is trained and how (``earlier_seq_lens`` read here).
        rank: the pipeline stage the rank holds.
        measured: the rank's schedule at ``seq_len``.
        layout: per-tensor model states (the same at every length).
        workspace_per_handle: cuBLAS workspace of one handle, bytes.

    Returns:
        A schedule whose ``load`` and setup hold the earlier steps and one step at ``seq_len``,
        and whose ``step`` is ``measured``'s.

    Source: c10/cuda/CUDACachingAllocator.cpp (cached blocks kept per stream and size class,
    split and reused, released only on a failed allocation or ``empty_cache``).
    """
    lengths = earlier_lengths(training)
    if not lengths:
        return measured
    earlier = []
    for n in lengths:
        t = replace(training, seq_len=n, earlier_seq_lens=None, sample_lengths=None)
        prof = activation_profile(model, t)
        earlier.append(
            rank_schedule(
                model, t, rank, layout=layout, prof=prof, workspace_per_handle=workspace_per_handle
            )
        )
    return after_steps(earlier, measured)


def earlier_lengths(training: TrainingConfig) -> tuple[int, ...]:
    """``training.earlier_seq_lens`` in order (or those drawn from ``sample_lengths``), each at
    most ``seq_len`` (a listed length above
    it counts as ``seq_len``: a planner's search over the length; the estimate warns,
    :func:`trainmem.estimate.setting_warnings`)."""
    return tuple(min(n, training.seq_len) for n in training.earlier_seq_len_list)


def after_steps(
    earlier: Sequence[StepSchedule], measured: StepSchedule, *, measured_state: bool = False
) -> StepSchedule:
    """``measured`` preceded by the steps of ``earlier`` (one schedule per listed length, of
    the same rank and engine; Note [Steps of varying length]): the first one's load, weights
    and warm-up step, each further one's step, then ``measured``'s step twice (the one the
    measured step follows, then the measured one). ``measured`` itself when ``earlier`` is
    empty.

    Args:
        earlier: the schedules at the listed lengths, in order.
        measured: the schedule at ``seq_len``.
        measured_state: take the state the steps start from (the setup's leading ``init``
            ops) from ``measured``, not from the first listed length: a traced step's setup
            allocates the batch it runs on there (its inputs, b x s token ids and labels,
            live through every step), which stands for each step's own batch, so the
            measured step runs on a batch of its own length (the earlier steps on it too: a
            few bytes a token, Note [Steps of varying length]).
    """
    if not earlier:
        return measured
    first = earlier[0].setup
    state = _init_prefix(measured.setup if measured_state else first)
    setup: list[Item] = [*state, *first[len(_init_prefix(first)) :]]
    for sched in earlier[1:]:
        setup += sched.step
    setup += measured.step  # the step the measured one follows
    return StepSchedule(
        setup=tuple(setup),
        step=measured.step,
        name=measured.name,
        load=earlier[0].load,
        load_rule=earlier[0].load_rule,
    )


def _init_prefix(items: Sequence[Item]) -> tuple[Item, ...]:
    """The leading ``init`` ops of a setup (the state its warm-up step starts from)."""
    n = 0
    while n < len(items) and isinstance(items[n], Op) and items[n].phase == "init":  # type: ignore[union-attr]
        n += 1
    return tuple(items[:n])
