"""StepSchedule: one training step as data, the one description both engines produce.

Note [One description of the step]
    A training step is an ordered list of allocations and frees. Both engines hand the driver
    (:mod:`trainmem.estimate`) a :class:`StepSchedule`: the analytic engine builds it from its
    cited formulas (:mod:`trainmem.analytic.schedule`), the trace engine records it op by op
    (:meth:`StepSchedule.from_timeline`). Everything the user sees comes from it:

    * :meth:`StepSchedule.peak` (the fast path, linear in the number of segments): the peak of
      live requested bytes of the steady-state step, the bytes per category at that moment and
      the operation that set it. It is the closed form: a repeated block (``Repeat``: identical
      layers, identical micro-batches) is summarised once by its net change and its highest
      excursion, so a 126-layer model or 1024 micro-batches cost no more than one;
    * :meth:`StepSchedule.expand` gives the events (:class:`~trainmem.timeline.Timeline`) the
      caching-allocator simulator replays for ``max_memory_reserved``, fragmentation and the
      out-of-memory verdict; ``peak()`` equals the peak of the expanded live bytes
      (a property test checks it).

    A schedule has two parts: ``setup`` brings the device into the state the measured step starts
    from (weights, a warm-up step that allocates the optimizer states lazily, as a real run
    does), and ``step`` is the steady-state step whose peak is reported. An optional third,
    ``load``, comes before both: building and loading the model where that has transients of
    its own (Note [The load phase]).

    Frees are paired with their allocations by ``key``. Inside a :class:`Repeat`, ``{i}`` in a
    key or module name is the iteration's index (``{i_prev}`` / ``{i_next}`` one less / more,
    ``{i_prev2}`` / ``{i_next2}`` two, ``{i_prev3}`` / ``{i_next3}`` three: a tensor some layers
    free two layers later, FSDP1's rate-limited gathers three), so layer
    ``j``'s saved activations allocated in the forward are the ones layer ``j``'s backward
    frees. Sizes and categories of a repeated body do not depend on the index.

Source: the step order of PyTorch training (forward, autograd's reverse-order backward,
``optimizer.step()``, ``zero_grad()``), as in the seeds' four-phase picture
(shared/seeds, "How GPU gets utilized during model training").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Literal, NamedTuple, cast

from trainmem.breakdown import MemoryCategory
from trainmem.errors import ScheduleError
from trainmem.timeline import AllocEvent, EventFields, Phase, Timeline

Action = Literal["alloc", "free"]


class Op(NamedTuple):
    """One allocation or free (immutable; a named tuple rather than a frozen dataclass because
    the planner builds about 140 of them per configuration it evaluates, and a tuple is built
    in 0.4 us instead of 1.0 us).

    Attributes:
        action: ``"alloc"`` or ``"free"``.
        size_bytes: requested bytes (the free repeats its allocation's size).
        category: what the storage holds.
        phase: step phase.
        key: pairs a free with its allocation; may hold ``{i}``, ``{i_prev}``, ``{i_next}``,
            ``{i_prev2}``, ``{i_next2}``, ``{i_prev3}``, ``{i_next3}``.
        module: module path (``layers.{i}.mlp``), formatted like ``key``.
        label: what the tensor is, for the peak's explanation ("log-softmax gradients").
        stream: CUDA stream (0 = default).
    """

    action: Action
    size_bytes: int
    category: MemoryCategory
    phase: Phase
    key: str
    module: str = ""
    label: str = ""
    stream: int = 0


@dataclass(frozen=True, slots=True)
class Repeat:
    """``body`` run ``count`` times; iteration ``k`` has index ``start + k``, or counts down
    from ``start + count - 1`` when ``reverse`` (backward through the layers). ``independent``:
    every iteration frees what it allocates and nothing else (Note [Balanced repeats])."""

    body: tuple[Item, ...]
    count: int
    reverse: bool = False
    start: int = 0
    independent: bool = False
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def index(self, k: int) -> int:
        """The index of iteration ``k`` (0-based)."""
        return self.start + (self.count - 1 - k if self.reverse else k)


Item = Op | Repeat


@dataclass(frozen=True, slots=True)
class SchedulePeak:
    """The peak of live requested bytes of the steady-state step.

    Attributes:
        peak_bytes: live bytes at the peak (predicted ``max_memory_allocated`` before the
            allocator's 512-byte rounding).
        by_category: live bytes per category at that moment.
        phase / module / label: the operation that set the peak ("" labels: none given).
    """

    peak_bytes: int
    by_category: dict[MemoryCategory, int]
    phase: str
    module: str
    label: str


class _Summary(NamedTuple):
    """Net change and highest excursion of a run of items, per category at the excursion (a
    named tuple: about ten are built per configuration the planner evaluates, each in a fifth
    of a frozen dataclass's time)."""

    total: int
    delta: dict[MemoryCategory, int]
    excursion: int
    at_excursion: dict[MemoryCategory, int]
    op: Op | None
    at_index: dict[str, int]
    phase_high: dict[str, int]


def _add(
    a: dict[MemoryCategory, int], b: dict[MemoryCategory, int], k: int = 1
) -> dict[MemoryCategory, int]:
    out = dict(a)
    for cat, v in b.items():
        out[cat] = out.get(cat, 0) + k * v
    return out


def _split_at_high(
    at: dict[MemoryCategory, int],
    at_repeat: tuple[dict[MemoryCategory, int], _Summary, int] | None,
) -> dict[MemoryCategory, int]:
    """The split by category at the highest point: ``at``, or, when a repeated body set it,
    the live bytes before the body plus ``k`` iterations of it plus its split at its own high
    (``at_repeat`` = (live before, the body's summary, ``k``))."""
    if at_repeat is None:
        return at
    before, body, k = at_repeat
    return _add(_add(before, body.delta, k), body.at_excursion)


def _summarise(items: Sequence[Item], memo: dict[int, _Summary] | None = None) -> _Summary:
    """Walk ``items`` once for the totals, the split by category and its value at the
    highest point; repeated bodies are summarised once (Note [One description of the step]):
    over ``n`` iterations of a body with net change ``d`` and excursion ``m`` the highest point
    is ``(n - 1) * d + m`` in the last iteration when ``d > 0``, else ``m`` in the first.
    ``memo`` reuses the summary of a body object met twice (the warm-up and measured steps
    share their micro-batches)."""
    memo = {} if memo is None else memo
    total = best = 0
    phase_high: dict[str, int] = {}
    high_get = phase_high.get
    live: dict[MemoryCategory, int] = {}
    live_get = live.get
    at: dict[MemoryCategory, int] = {}
    # a repeated body's high, kept as (live before it, its summary, iterations before its high)
    # and added up once at the end: only the last new high's split is ever read
    at_repeat: tuple[dict[MemoryCategory, int], _Summary, int] | None = None
    op: Op | None = None
    index: dict[str, int] = {}
    # NB: the hot loop of the planner's fast path (every configuration it evaluates walks its
    # freshly built micro-batch here): one pass, the op unpacked at once, and a free, which can
    # never set a new high, skips the comparison with ``best``. The split by category at the
    # high is copied once per climb (at the first free or repeat after it), not at every
    # allocation that raises it; the high of the phase being walked is kept in a local and
    # written back when the phase changes (ops come in runs of one phase).
    rising = False
    run_phase: str | None = None
    run_high = 0
    for item in items:
        if type(item) is Op:
            action, size, cat, phase, _, _, _, _ = item
            if action == "alloc":
                total += size
                live[cat] = live_get(cat, 0) + size
                if total > best:
                    best, op, rising = total, item, True
            else:
                if rising:
                    at, index, rising, at_repeat = dict(live), {}, False, None
                total -= size
                live[cat] = live_get(cat, 0) - size
            if phase != run_phase:
                if run_phase is not None:
                    phase_high[run_phase] = run_high
                run_phase, run_high = phase, high_get(phase, total - 1)
            if total > run_high:
                run_high = total
            continue
        if rising:
            at, index, rising, at_repeat = dict(live), {}, False, None
        if run_phase is not None:
            phase_high[run_phase] = run_high
            run_phase = None
        assert isinstance(item, Repeat)
        items_id, count = id(item.body), item.count
        body = memo.get(items_id)
        if body is None:
            cached = item.memo.get("summary")
            body = cached if isinstance(cached, _Summary) else _summarise(item.body, memo)
            memo[items_id] = body
            item.memo["summary"] = body
        if count <= 0:
            continue
        # NB: the summary unpacked once (a named tuple's fields are read through descriptors)
        b_total, b_delta, b_excursion, _, b_op, b_index, b_phase_high = body
        k = count - 1 if b_total > 0 else 0
        base = total + k * b_total
        if base + b_excursion > best and b_op is not None:
            best, at_repeat = base + b_excursion, (dict(live), body, k)
            op, index = b_op, {"i": item.index(k), **b_index}
        for name, rel in b_phase_high.items():
            value = base + rel
            if value > high_get(name, value - 1):
                phase_high[name] = value
        total += count * b_total
        for cat, v in b_delta.items():
            live[cat] = live_get(cat, 0) + count * v
    if rising:
        at, index, at_repeat = dict(live), {}, None
    at = _split_at_high(at, at_repeat)
    if run_phase is not None:
        phase_high[run_phase] = run_high
    return _Summary(total, live, best, at, op, index, phase_high)


@dataclass(frozen=True, slots=True)
class StepSchedule:
    """One training step (and the state it starts from) as ordered allocations and frees.

    Attributes:
        setup: items that bring the device to the start of the measured step.
        step: the steady-state step.
        name: free text for reports (model and engine).
        load: building and loading the model (phase ``"load"``), replayed before ``setup``;
            empty where loading has no transients of its own (Note [The load phase]).
        load_rule: what the load phase models, for reports ("" without one).

    Note [The load phase]
        Loading a model can have a peak of its own and leaves blocks in the caching
        allocator: torchtune's QLoRA on torchao 0.1 builds each linear in bf16 on the GPU and
        quantizes it there with (numel, 16) temporaries (:mod:`trainmem.analytic.load`).
        ``max_memory_reserved`` is the run's peak, so those cached blocks are part of it: the
        driver replays ``load``, then ``setup`` and ``step``, through one allocator. The load
        allocates the weights the setup allocates, under the same keys, in their final form;
        the expansion *adopts* them (a setup allocation of a key the load left live is no
        event), so the setup and step are unchanged and :meth:`peak` is the step's as before;
        :meth:`load_peak` is the load's own peak of live bytes. A weight the load replaces
        (built, then loaded again) is allocated under another key first and freed when its
        final form exists.
    """

    setup: tuple[Item, ...]
    step: tuple[Item, ...]
    name: str = ""
    _cache: dict[str, object] = field(default_factory=dict, compare=False, repr=False)
    load: tuple[Item, ...] = ()
    load_rule: str = ""

    def live_before_step(self) -> dict[MemoryCategory, int]:
        """Bytes per category alive when the measured step starts (weights, optimizer states,
        gradients kept from the previous step...)."""
        return {k: v for k, v in _summarise(self.setup).delta.items() if v}

    def peak(self) -> SchedulePeak:
        """The peak of the steady-state step (fast path; Note [One description of the step])."""
        cached = self._cache.get("peak")
        if isinstance(cached, SchedulePeak):
            return cached
        setup, step = self._summaries()
        before = setup.delta
        base = sum(before.values())
        if step.op is None:  # nothing allocated in the step: the state it starts from
            by_cat, op_phase, module, label = before, "init", "", ""
        else:
            by_cat = _add(before, step.at_excursion)
            op_phase, label = step.op.phase, step.op.label
            module = _format(step.op.module, step.at_index)
        result = SchedulePeak(
            peak_bytes=base + step.excursion,
            by_category={k: v for k, v in by_cat.items() if v},
            phase=op_phase,
            module=module,
            label=label,
        )
        self._cache["peak"] = result
        return result

    def load_peak(self) -> int:
        """The highest live bytes of the load phase (0 without one; Note [The load phase])."""
        if not self.load:
            return 0
        return _summarise(self.load).excursion

    def phase_peaks(self) -> dict[str, int]:
        """The highest live bytes of the steady-state step within each phase (``forward``,
        ``backward``, ``optimizer``...), the state carried in included."""
        setup, step = self._summaries()
        return {phase: setup.total + high for phase, high in step.phase_high.items()}

    def _summaries(self) -> tuple[_Summary, _Summary]:
        """The summaries of ``setup`` and ``step`` (cached: :meth:`peak` and
        :meth:`phase_peaks` both read them)."""
        cached = self._cache.get("summaries")
        if cached is None:
            memo: dict[int, _Summary] = {}
            cached = self._cache["summaries"] = (
                _summarise(self.setup, memo),
                _summarise(self.step, memo),
            )
        return cached  # type: ignore[return-value]

    def category_peak(self, category: MemoryCategory) -> int:
        """The most bytes of one category alive at once during the steady-state step (those
        carried in from the setup included)."""
        before = _summarise(_only(self.setup, category)).delta.get(category, 0)
        return before + _summarise(_only(self.step, category)).excursion

    def model_states(self) -> dict[str, int]:
        """Persistent bytes of this rank: ``parameters`` (buffers included) and
        ``optimizer_states`` held when the step starts, ``gradients`` the most gradient bytes
        held during it (as DeepSpeed's ``estimate_zero*_model_states_mem_needs`` report)."""
        before = self.live_before_step()
        return {
            "parameters": before.get(MemoryCategory.PARAMETER, 0)
            + before.get(MemoryCategory.BUFFER, 0),
            "gradients": self.category_peak(MemoryCategory.GRADIENT),
            "optimizer_states": before.get(MemoryCategory.OPTIMIZER_STATE, 0),
        }

    def expand(self) -> Timeline:
        """The events of ``setup`` then ``step``, block ids paired by key (cached).

        Raises:
            ScheduleError: a free of a key that is not live, or an allocation of a live key.
        """
        cached = self._cache.get("timeline")
        if isinstance(cached, Timeline):
            return cached
        events = list(self.events())
        start = int(self._cache["steady_state_start"])  # type: ignore[call-overload]
        timeline = Timeline(events=events, name=self.name, steady_state_start=start)
        self._cache["timeline"] = timeline
        return timeline

    def events(self) -> Iterator[AllocEvent]:
        """:meth:`expand`'s events, built a run of items at a time (a repeated body's
        iteration, the items between two repeats) as they are read, so a replay that stops at
        an out-of-memory error does not build the rest.

        Raises:
            ScheduleError: as :meth:`expand` (when the run holding the bad key is built).
        """
        cached = self._cache.get("timeline")
        if isinstance(cached, Timeline):
            return iter(cached.events)
        return cast("Iterator[AllocEvent]", self._events(records=False))

    def replay_events(self) -> Iterator[AllocEvent | EventFields]:
        """:meth:`events` for a replay that keeps none of them (the driver's): the same events
        as plain tuples of their fields (:data:`~trainmem.timeline.EventFields`, Note [Plain
        event tuples]), unless the timeline is built, their ``module`` left as the schedule
        holds it (a layer's ``{i}`` not filled in): a replay reads module names only to record
        a memory history, which the driver's does not (about a sixth of the events' cost in the
        planner's searches, issue 28).

        Raises:
            ScheduleError: as :meth:`events`.
        """
        cached = self._cache.get("timeline")
        if isinstance(cached, Timeline):
            return iter(cached.events)
        return self._events(records=True)

    def _events(self, *, records: bool) -> Iterator[AllocEvent | EventFields]:
        # NB: the runs of events chained in C (a replay reads thousands of events; a
        # generator resumed per event cost a tenth of a microsecond each)
        return chain.from_iterable(self._runs(records))

    def _runs(
        self, records: bool, live: dict[str, tuple[int, int]] | None = None
    ) -> Iterator[list[AllocEvent] | list[EventFields]]:
        live = {} if live is None else live  # key -> (block id, size) of what is allocated
        counter = [0, 0]  # next block id, events written
        adopt: frozenset[str] = frozenset()
        if self.load:  # Note [The load phase]
            yield from _expand(self.load, 0, live, counter, records)
            adopt = frozenset(live)
        yield from _expand(self.setup, 0, live, counter, records, adopt)
        self._cache["steady_state_start"] = counter[1]
        yield from _expand(self.step, 0, live, counter, records)

    def live_keys(self) -> list[str]:
        """The keys still allocated when the step ends (weights, optimizer states, anything the
        schedule never frees), each repeated body's iterations written out.

        Raises:
            ScheduleError: as :meth:`expand`.
        """
        live: dict[str, tuple[int, int]] = {}
        for _ in self._runs(True, live):
            pass
        return list(live)

    def num_segments(self) -> int:
        """Items in the schedule counting a repeated body once (its compact size)."""

        def count(items: Iterable[Item]) -> int:
            return sum(1 if isinstance(x, Op) else 1 + count(x.body) for x in items)

        return count(self.setup) + count(self.step)

    @classmethod
    def from_timeline(cls, timeline: Timeline) -> StepSchedule:
        """A flat schedule from a recorded event stream (the trace engine's), its steady-state
        step starting at ``timeline.steady_state_start``."""
        ops = [
            Op(
                ev.action,
                ev.size_bytes,
                ev.category,
                ev.phase,
                f"b{ev.block_id}",
                ev.module,
                stream=ev.stream,
            )
            for ev in timeline.events
        ]
        start = max(timeline.steady_state_start, 0)
        return cls(setup=tuple(ops[:start]), step=tuple(ops[start:]), name=timeline.name)

    def with_lazy_optimizer_states(self) -> StepSchedule:
        """This recorded step (the trace engine's: its leading ``"init"`` items hold the state it
        starts from, weights and optimizer states) with a setup as a real run reaches it: the
        state without the optimizer states, then one warm-up step that allocates them lazily
        where the first ``optimizer.step()`` does (Note [Lazy optimizer states]). ``peak()`` is
        unchanged; the replay (``max_memory_reserved``) starts from the warm-up's layout.

        Returns ``self`` when there is nothing to move or the step cannot be run twice: a
        schedule with a setup already, no optimizer states or optimizer phase, or a step that
        frees part of the state it starts from or keeps a block it allocates.

        Note [Lazy optimizer states]
            torch optimizers create their states in the first ``step()``
            (torch/optim/adam.py ``_init_group``: ``state["exp_avg"] =
            torch.zeros_like(p, memory_format=torch.preserve_format)`` per parameter, before
            the update), after the first backward has freed the activations: they take cached
            blocks the activations left, and the steps after it start from that layout.
            ``max_memory_reserved`` is the peak over the run, so a replay that allocates the
            states with the weights misses it: real GPU snapshot S026 (the course's 2.7B
            model, bf16 autocast, torch's foreach AdamW) reserves 72.79 GiB; its traced step
            replays to 76.91 GiB with the states allocated first and to 72.81 GiB with them
            created by a first step (benchmarks/snapshot_traced_step.py). The analytic
            engine's schedule has the same warm-up (trainmem.analytic.schedule, ``first``).
        """
        if self.setup:
            return self
        items = self.step
        n = 0
        while n < len(items) and _phases(items[n]) == {"init"}:
            n += 1
        init, body = items[:n], items[n:]
        first = next((k for k, x in enumerate(body) if "optimizer" in _phases(x)), None)
        states = _only(init, MemoryCategory.OPTIMIZER_STATE)
        if first is None or not states or not _runs_twice(body):
            return self
        weights = _only(init, MemoryCategory.OPTIMIZER_STATE, keep=False)
        warm = (*body[:first], *states, *body[first:])
        return StepSchedule(setup=(*weights, *warm), step=body, name=self.name)


def _phases(item: Item) -> set[str]:
    if isinstance(item, Op):
        return {item.phase}
    return set().union(*(_phases(x) for x in item.body))


def _runs_twice(items: Sequence[Item]) -> bool:
    """The items free only what they allocate and leave nothing allocated (so the same items
    can run again, as the next step)."""
    live: dict[str, tuple[int, int]] = {}
    try:
        for _ in _expand(items, 0, live, [0, 0], True):  # runs of events
            pass
    except ScheduleError:
        return False
    return not live


BALANCED_REPEATS = 2
"""Iterations of a balanced repeated body that :meth:`StepSchedule.expand` writes out.

Note [Balanced repeats]
    A repeated body marked ``independent`` frees everything it allocates and nothing else (a
    micro-batch of gradient accumulation once the gradients exist), so it leaves the caching
    allocator where it found it after its first iterations: the same requests meet the same
    cached blocks. ``expand()`` writes out
    :data:`BALANCED_REPEATS` iterations of such a body, so 1024 micro-batches replay like two
    (their live bytes are identical, so ``peak()`` is unchanged; a property test checks
    ``peak()`` against the expansion)."""


def _only(
    items: Sequence[Item], category: MemoryCategory, *, keep: bool = True
) -> tuple[Item, ...]:
    """The items of ``category`` (``keep=False``: of every other category), Repeats kept."""
    out: list[Item] = []
    for x in items:
        if isinstance(x, Op):
            if (x.category == category) == keep:
                out.append(x)
        else:
            body = _only(x.body, category, keep=keep)
            if body:
                out.append(Repeat(body, x.count, x.reverse, x.start, x.independent))
    return tuple(out)


def _format(text: str, index: dict[str, int]) -> str:
    if "{" not in text:
        return text
    return _format_index(text, index.get("i", 0))


@lru_cache(maxsize=1 << 16)
def _format_index(text: str, i: int) -> str:
    """``text`` with ``{i}`` and its neighbours filled in; cached, since every replay of a
    schedule (the planner's boundary checks replay several) formats the same keys and module
    names for the same layers."""
    return text.format(
        i=i, i_prev=i - 1, i_next=i + 1, i_prev2=i - 2, i_next2=i + 2, i_prev3=i - 3, i_next3=i + 3
    )


def _events_of(run: list[EventFields]) -> list[AllocEvent]:
    """The :class:`~trainmem.timeline.AllocEvent` of each tuple of fields."""
    return [AllocEvent(*fields) for fields in run]


def _expand(
    items: Sequence[Item],
    i: int,
    live: dict[str, tuple[int, int]],
    counter: list[int],
    records: bool,
    adopt: frozenset[str] = frozenset(),
) -> Iterator[list[AllocEvent] | list[EventFields]]:
    """The events of ``items`` with ``{i}`` (the innermost repeat's index, 0 outside any) filled
    in (in keys always, in module names only for :class:`~trainmem.timeline.AllocEvent`), as
    plain tuples of their fields when ``records`` (Note [Plain event tuples]), in runs: a list per
    run of ops walked without entering or leaving a repeated body (a replay that stops early
    leaves the later runs unbuilt); an allocation of a
    key in ``adopt`` that is live (the load phase made it) is no event (Note [The load
    phase]). NB: a replay's hot
    path (every event of every replay the planner runs passes here): the op is unpacked at once
    and a key or module without ``{`` is not formatted; a repeated body is walked from an
    explicit stack of (items, index) frames rather than by a nested generator, so each event
    is yielded once instead of through one ``yield from`` per level of nesting.

    Note [Plain event tuples]
        A replay reads an event's seven fields by unpacking it. The walk writes each event as
        a plain tuple of them (:data:`~trainmem.timeline.EventFields`): ``BUILD_TUPLE`` from
        the values on the stack, where an ``EventRecord`` (a ``NamedTuple`` subclass) takes a
        call that copies a tuple into a new instance of the subclass: the walk of
        llama-3.2-3b's step (5,302 events) went from about 5,400 to 3,100 CPU instructions
        an event (valgrind callgrind; issue 28: ``trainmem plan``'s 18 probes walk ~81,000
        events). A run is turned into :class:`~trainmem.timeline.AllocEvent` objects only
        for :meth:`StepSchedule.events`, whose readers read fields by name.
    """
    fmt = _format_index
    frames: list[tuple[Iterator[Item], int]] = []  # what is left to walk, innermost last
    walk: Iterator[Item] = iter(items)
    # the next block id and the events written so far, kept in locals and written back to
    # ``counter`` when the walk ends (a walk left unfinished is never continued)
    block_id, written = counter
    run: list[EventFields] = []
    add = run.append
    while True:
        for item in walk:
            if type(item) is not Op:
                assert isinstance(item, Repeat)
                count = item.count
                if count > BALANCED_REPEATS and item.independent:
                    count = BALANCED_REPEATS  # Note [Balanced repeats]
                if count <= 0:
                    continue
                frames.append((walk, i))
                body = item.body
                frames.extend((iter(body), item.index(k)) for k in range(count - 1, 0, -1))
                walk, i = iter(body), item.index(0)
                break  # walk the body's first iteration
            action, size_bytes, category, phase, key, module, _, stream = item
            if "{" in key:
                key = fmt(key, i)
            if not records and "{" in module:  # a replay's record reads no module name
                module = fmt(module, i)
            if action == "alloc":
                if key in live:
                    if key in adopt:  # the load phase allocated it (Note [The load phase])
                        continue
                    raise ScheduleError(f"key {key!r} allocated while live")
                if size_bytes <= 0:
                    live[key] = (-1, 0)
                    continue
                live[key] = (block_id, size_bytes)
                add((action, block_id, size_bytes, category, phase, module, stream))
                block_id += 1
            else:
                entry = live.pop(key, None)
                if entry is None:
                    raise ScheduleError(f"free of key {key!r}, which is not live")
                block, size = entry
                if block >= 0:
                    add((action, block, size, category, phase, module, stream))
        else:  # this list is done: back to the one it was entered from
            if not frames:
                counter[0], counter[1] = block_id, written + len(run)
                yield run if records else _events_of(run)
                return
            walk, i = frames.pop()
        written += len(run)  # (counted a run at a time)
        # a repeated body entered or left: the run so far (maybe empty)
        yield run if records else _events_of(run)
        run = []
        add = run.append
