"""Compose the full-depth step schedule from the trace of a model whose block lists were cut.

Note [Composing the full depth]
    The cut model (``trainmem.trace.blocks``) keeps a few units of every run of identical
    blocks; its traced event stream is split into *stretches*: consecutive events that belong
    to one kept unit. An allocation belongs to the unit its module path names (``layers.3.mlp``;
    registered parameters, gradients and optimizer states carry their parameter's name), or,
    outside any module in the forward and backward, to the unit running (the last event's).
    Optimizer temporaries carry no module: a run of allocations as long as the trainable
    parameter list (one per parameter, sizes proportional to their ``numel``: the foreach
    kernels, ``torch/optim/adam.py`` ``_multi_tensor_adam``) is labelled parameter by parameter.
    A free in the forward or backward belongs to the unit running when that unit is of the
    block's run; elsewhere (optimizer, ``zero_grad``, the end of the forward that drops
    transformers' key/value cache layer by layer) to its block's unit.

    Every unit of a run is visited the same number of times (*passes*: forward, backward,
    optimizer lists, ``zero_grad``...). In each pass the middle unit's stretch becomes a
    :class:`~trainmem.schedule.Repeat` of ``count`` iterations (reversed when the pass visits
    the units downwards, as backward does). A block is keyed by its run, its pass and its
    position among the allocations of its stretch (its *role*), and the index of its unit in the
    full model: ``{i}`` in the repeated body, ``{i_prev}`` / ``{i_prev2}`` / ``{i_prev3}``
    (``{i_next}``...) for a block of the unit one to three before (after), a literal index
    elsewhere. A kept unit that uses a block of a role the repeated body uses as many units
    away (FSDP1's gather, freed three layers on: Note [FSDP1's gathers three layers on] in
    trainmem/trace/generic.py) means the unit that far away in the full model too, not the
    kept unit's literal index. A stretch of the middle unit outside its run's pass that only
    frees blocks of such roles (the end of a pass releasing what is still pending) frees one
    iteration's: the repeat next to the kept units on the side of the unit that would have
    freed them. The composition refuses (:class:`CompositionError`) rather than guess: passes
    that differ between units, a unit referenced whose allocations differ from the middle
    one's, a repeated block freed from outside its run, references more than three units away.
    Composing with ``count = 1`` must give back the traced stream event for event, and with
    ``count = 3`` must expand without an unpaired free and leave allocated at the step's end
    what the traced units leave, each repeat what the middle unit leaves (a block freed
    further away than the kept units reach is freed by no repeat): all are checked.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.errors import CompositionError, ScheduleError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.timeline import AllocEvent, Timeline
from trainmem.trace.blocks import Run
from trainmem.trace.module_paths import clean_module_path

__all__ = ["CompositionError", "ParamInfo", "compose", "count_parameters", "trainable_params"]

_REL = {0: "i", -1: "i_prev", -2: "i_prev2", -3: "i_prev3", 1: "i_next", 2: "i_next2", 3: "i_next3"}

Label = tuple[int, int]  # (run id, kept unit)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A trainable parameter of the cut model in optimizer order: ``name``, ``numel``,
    ``dtype`` (as text), ``ndim``."""

    name: str
    numel: int
    dtype: str
    ndim: int = 2


class _Paths:
    """Module path -> (run id, kept unit, full block index) of the cut model."""

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = runs
        lists = sorted({r.list_path for r in runs}, key=len, reverse=True)
        self._patterns = [(p, re.compile(re.escape(p) + r"\.(\d+)(?:\.|$)")) for p in lists]
        self._cache: dict[str, tuple[int, int, int, int] | None] = {}

    def locate(self, path: str) -> tuple[int, int, int, int] | None:
        """``(run id, kept unit, offset in unit, cut index)`` of a module or parameter path."""
        if path in self._cache:
            return self._cache[path]
        found = None
        for list_path, pattern in self._patterns:
            m = pattern.match(path) if path.startswith(list_path) else None
            if m is None:
                continue
            q = int(m.group(1))
            for rid, run in enumerate(self.runs):
                if run.list_path != list_path:
                    continue
                end = run.cut_first + run.kept * run.unit
                if run.cut_first <= q < end:
                    t, o = divmod(q - run.cut_first, run.unit)
                    found = (rid, t, o, q)
                    break
            break
        self._cache[path] = found
        return found

    def label(self, path: str) -> Label | None:
        loc = self.locate(path)
        if loc is None or self.runs[loc[0]].middle < 0:
            return None
        return loc[0], loc[1]

    def rewrite(self, path: str, count: int, body: bool, full: int | None = None) -> str:
        """The module path with the cut index replaced by the full model's (``{i}`` in a
        repeated body of one-block units; ``full``: the full model's unit, when known)."""
        loc = self.locate(path)
        if loc is None:
            return path
        rid, t, o, q = loc
        run = self.runs[rid]
        if body:
            if run.unit != 1:
                return path
            index = "{" + _REL.get(t - run.middle, "i") + "}"  # (a block of a unit nearby)
        else:
            unit = run.full_unit(t, count) if full is None else full
            index = str(run.first + unit * run.unit + o)
        m = self._patterns_for(run.list_path).match(path)
        assert m is not None
        return path[: m.start(1)] + index + path[m.end(1) :]

    def _patterns_for(self, list_path: str) -> re.Pattern[str]:
        return next(p for lp, p in self._patterns if lp == list_path)


def count_parameters(model: Any) -> tuple[int, int]:
    """(all, trainable) elements of ``model``'s unique parameters."""
    params = list(dict.fromkeys(model.parameters()))
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def trainable_params(model: Any) -> list[ParamInfo]:
    """``model``'s trainable parameters in optimizer order (``model.parameters()``, ties once),
    named by their first path."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), clean_module_path(n))
    return [
        ParamInfo(names.get(id(p), ""), p.numel(), str(p.dtype), p.dim())
        for p in dict.fromkeys(model.parameters())
        if p.requires_grad
    ]


def _optimizer_labels(
    events: Sequence[AllocEvent], params: Sequence[ParamInfo], paths: _Paths
) -> dict[int, Label | None]:
    """Labels of optimizer temporaries allocated one per trainable parameter (Note [Composing
    the full depth])."""
    # the optimizer skips parameters without a gradient (a headless tower's unused pooler):
    # those with optimizer states (registered under the parameter's name) had one
    graded = {e.module for e in events if e.category is MemoryCategory.OPTIMIZER_STATE}
    params = [p for p in params if p.name in graded] or list(params)
    groups: list[list[ParamInfo]] = [list(params)]
    for dtype in dict.fromkeys(p.dtype for p in params):
        groups.append([p for p in params if p.dtype == dtype])
    # Adafactor factors matrices only (torch/optim/_adafactor.py): lists of the >= 2-D ones
    groups.append([p for p in params if p.ndim >= 2])
    groups.append([p for p in params if p.ndim < 2])
    groups = list({tuple(p.name for p in g): g for g in groups}.values())
    out: dict[int, Label | None] = {}
    run: list[AllocEvent] = []

    def flush() -> None:
        fits = [g for g in groups if g and len(g) == len(run)]
        s0 = run[0].size_bytes if run else 0
        proportional = [
            g
            for g in fits
            if all(e.size_bytes * g[0].numel == s0 * p.numel for e, p in zip(run, g, strict=True))
        ]
        # one allocation per parameter: sizes proportional to numel (an elementwise op), else
        # the only list of that length (row / column factors), else the only list that
        # several lists back to back make up (Adafactor's row and column factors)
        chosen = proportional[0] if proportional else (fits[0] if len(fits) == 1 else None)
        if chosen is None:
            whole = [g for g in groups if g and len(run) % len(g) == 0 and len(g) > 1]
            chosen = whole[0] * (len(run) // len(whole[0])) if len(whole) == 1 else None
        if chosen is not None:
            for e, p in zip(run, chosen, strict=True):
                out[e.block_id] = paths.label(p.name)
        run.clear()

    for e in events:
        if e.phase == "optimizer" and e.action == "alloc" and not e.module:
            run.append(e)
        elif run:
            flush()
    if run:
        flush()
    return out


def compose(
    timeline: Timeline,
    runs: Sequence[Run],
    params: Sequence[ParamInfo],
    *,
    counts: Sequence[int] | None = None,
    check: bool = True,
    module_names: set[str] | None = None,
) -> StepSchedule:
    """The full-depth schedule of the traced cut model (Note [Composing the full depth]).

    Args:
        timeline: the traced step of the cut model.
        runs: its runs (``trainmem.trace.blocks.truncate``).
        params: its trainable parameters in optimizer order.
        counts: repeats of each run's middle unit (default: each run's ``count``).
        check: verify the composition (count 1 gives the traced stream back; count 3 expands).
        module_names: the cut model's module paths; a forward / backward allocation under
            another name (a module instance shared by every layer, as transformers'
            ``ACT2FN`` activations, is named by its class) belongs to the unit running.

    Returns:
        The :class:`~trainmem.schedule.StepSchedule`.

    Raises:
        CompositionError: the stream does not split into identical units.
    """
    counts = [r.count for r in runs] if counts is None else list(counts)
    if not any(r.middle >= 0 for r in runs):
        return StepSchedule.from_timeline(timeline)
    events = timeline.events
    paths = _Paths(runs)
    opt = _optimizer_labels(events, params, paths)

    # unit label of every block and segment of every event
    blab: dict[int, Label | None] = {}
    segs: list[Label | None] = []
    ctx: Label | None = None  # the unit of the last allocation
    for e in events:
        if e.action == "alloc":
            if e.phase == "optimizer" and not e.module:
                lab = opt.get(e.block_id)
            elif e.phase in ("forward", "backward") and (
                not e.module or (module_names is not None and e.module not in module_names)
            ):
                lab = ctx
            else:
                lab = paths.label(e.module)
            blab[e.block_id] = lab
            segs.append(lab)
            ctx = lab
            continue
        own = blab.get(e.block_id)
        inside = ctx is not None and own is not None and ctx[0] == own[0]
        segs.append(ctx if e.phase in ("forward", "backward") and inside else own)

    # stretches: [start, end) of consecutive events of one segment (cut at the steady state)
    stretches: list[tuple[int, int, Label | None]] = []
    start = 0
    for k in range(1, len(events) + 1):
        if k == len(events) or segs[k] != segs[start] or k == timeline.steady_state_start:
            stretches.append((start, k, segs[start]))
            start = k

    # roles: a block's position among its unit's allocations of one phase
    role: dict[int, tuple[str, int]] = {}
    allocs: dict[tuple[Label, str], list[tuple[int, str]]] = {}
    for e in events:
        lab = blab.get(e.block_id)
        if e.action == "alloc" and lab is not None:
            mine = allocs.setdefault((lab, e.phase), [])
            role[e.block_id] = (e.phase, len(mine))
            mine.append((e.size_bytes, e.category.value))

    descending = _directions(events, stretches, runs)

    checked: set[tuple[Label, str]] = set()
    shifted, far = _body_references(events, stretches, runs, blab, role)

    def key(block: int, seg: Label | None, in_body: bool, count_of: Sequence[int]) -> str:
        lab = blab.get(block)
        if lab is None:
            return f"f{block}"
        rid, u = lab
        run = runs[rid]
        phase, k = role[block]
        base = f"r{rid}.{phase}.{k}@"
        if in_body:
            assert seg is not None
            rel = u - run.middle
            if seg[0] != rid or rel not in _REL:
                raise CompositionError(
                    f"a block of {run.list_path} is used {rel} units away from where it was made"
                )
            if rel and (lab, phase) not in checked:
                if allocs[(lab, phase)] != allocs.get(((rid, run.middle), phase)):
                    raise CompositionError(f"units of {run.list_path} allocate differently")
                checked.add((lab, phase))
            return base + "{" + _REL[rel] + "}"
        if seg is not None and seg[0] == rid and u == run.middle:
            # a repeated block used next to the repeat: its first or last iteration's
            t = seg[1]
            index = run.full_unit(t, count_of[rid]) + (u - t)
        elif seg is not None and seg[0] == rid and (rid, phase, k, u - seg[1]) in shifted:
            # a block as many units away as the repeated body uses its own (FSDP1's gather freed
            # three layers on by the rate limiter): the same distance in the full model
            index = run.full_unit(seg[1], count_of[rid]) + (u - seg[1])
        elif seg is not None and seg[0] == rid:
            # a kept unit's block, wherever in its run it is used (a pipeline stage's input
            # gradient is freed when the next micro-batch's forward is past the repeat)
            index = run.full_unit(u, count_of[rid])
        elif u == run.middle:
            raise CompositionError(
                f"a repeated block of {run.list_path} is freed outside its list's blocks"
            )
        else:
            index = run.full_unit(u, count_of[rid])
        return base + str(run.first + index)

    def build(count_of: Sequence[int]) -> StepSchedule:
        setup: list[Item] = []
        step: list[Item] = []
        for sid, (a, b, seg) in enumerate(stretches):
            target = setup if a < timeline.steady_state_start else step
            body_run = seg is not None and runs[seg[0]].middle == seg[1]
            side = _edge_side(events[a:b], seg, blab, role, far) if body_run else 0
            if side:  # one iteration's blocks: keyed as next to the repeat on that side
                assert seg is not None
                body_run, seg = False, (seg[0], seg[1] + side)
            ops = [
                Op(
                    e.action,
                    e.size_bytes,
                    e.category,
                    e.phase,
                    k := key(e.block_id, seg, body_run, count_of),
                    _module_path(paths, e.module, k, blab.get(e.block_id), count_of, body_run),
                    stream=e.stream,
                )
                for e in events[a:b]
            ]
            if not body_run:
                target.extend(ops)
                continue
            assert seg is not None
            rid = seg[0]
            run = runs[rid]
            target.append(
                Repeat(
                    tuple(ops),
                    count_of[rid],
                    reverse=descending[sid],
                    start=run.first + run.middle,
                )
            )
        return StepSchedule(setup=tuple(setup), step=tuple(step), name=timeline.name)

    schedule = build(counts)
    if check:
        one = build([1] * len(runs))
        _check(one, timeline)
        three = [min(c, 3) for c in counts]
        _check_kept_blocks(one, build(three), runs, three)
    return schedule


def _module_path(
    paths: _Paths,
    module: str,
    key: str,
    lab: Label | None,
    counts: Sequence[int],
    body: bool,
) -> str:
    """An event's module path in the full model: a module of its block's own unit numbered as
    the block's ``key`` (a block freed by the unit three on, or one repeat's at a pass's end,
    is not the kept unit's literal index)."""
    loc = paths.locate(module)
    if loc is None:
        return module
    tail = key.rpartition("@")[2]
    full = None
    if not body and lab is not None and loc[:2] == lab and tail.isdigit():
        full = int(tail) - paths.runs[lab[0]].first
    return paths.rewrite(module, counts[loc[0]], body, full)


def _directions(
    events: Sequence[AllocEvent],
    stretches: Sequence[tuple[int, int, Label | None]],
    runs: Sequence[Run],
) -> dict[int, bool]:
    """Whether each repeated stretch visits the units downwards: the nearest unit of its run
    before it in the stream is the one below (ascending) or above (descending).

    Raises:
        CompositionError: a repeated stretch with neither neighbour next to it.
    """
    descending: dict[int, bool] = {}
    for sid, (_, _, seg) in enumerate(stretches):
        if seg is None or runs[seg[0]].middle != seg[1]:
            continue
        before = next(
            (x[2] for x in reversed(stretches[:sid]) if x[2] is not None and x[2][0] == seg[0]),
            None,
        )
        after = next(
            (x[2] for x in stretches[sid + 1 :] if x[2] is not None and x[2][0] == seg[0]), None
        )
        below, above = (seg[0], seg[1] - 1), (seg[0], seg[1] + 1)
        if before == below or after == above:
            descending[sid] = False
        elif before == above or after == below:
            descending[sid] = True
        else:
            first = events[stretches[sid][0]]
            raise CompositionError(
                f"a stretch of {runs[seg[0]].list_path} is not between its neighbours "
                f"({first.phase}, {first.action} in {first.module or 'no module'}; "
                f"before {before}, after {after})"
            )
    return descending


def _body_references(
    events: Sequence[AllocEvent],
    stretches: Sequence[tuple[int, int, Label | None]],
    runs: Sequence[Run],
    blab: dict[int, Label | None],
    role: dict[int, tuple[str, int]],
) -> tuple[set[tuple[int, str, int, int]], dict[tuple[int, str, int], int]]:
    """What the repeated stretches do with blocks of other units of their run (Note [Composing
    the full depth]): ``(run id, phase, role, units away)`` of every such block allocated or
    freed (a kept unit using the same role as far away means the same thing), and the units
    away of each ``(run id, phase, role)`` freed."""
    out: set[tuple[int, str, int, int]] = set()
    far: dict[tuple[int, str, int], int] = {}
    for a, b, seg in stretches:
        if seg is None or runs[seg[0]].middle != seg[1]:
            continue
        for e in events[a:b]:
            lab = blab.get(e.block_id)
            if lab is not None and lab[0] == seg[0] and lab[1] != seg[1]:
                out.add((seg[0], *role[e.block_id], lab[1] - seg[1]))
                if e.action == "free":
                    far[(seg[0], *role[e.block_id])] = lab[1] - seg[1]
    return out, far


def _edge_side(
    events: Sequence[AllocEvent],
    seg: Label | None,
    blab: dict[int, Label | None],
    role: dict[int, tuple[str, int]],
    far: dict[tuple[int, str, int], int],
) -> int:
    """-1 (+1) when the middle unit's stretch ``events`` only frees its own blocks of roles
    that the repeated body frees units further up (down): 0 otherwise.

    Such a stretch (outside its unit's run: the end of a pass releasing what is pending) frees
    one iteration's blocks, not every repeat's: the others were freed by the units that far
    away. The one left is the repeat next to the kept units below (above), as the middle unit
    is in the cut model: its freeing unit is that far below (above), where the cut model's
    freed nothing (FSDP1's backward: layer 0 prefetches no layer, so no unshard frees the
    gather three layers up, Note [FSDP1's gathers three layers on] in
    trainmem/trace/generic.py)."""
    sides: set[int] = set()
    for e in events:
        away = far.get((seg[0], *role[e.block_id])) if seg is not None else None
        if e.action != "free" or blab.get(e.block_id) != seg or away is None:
            return 0
        sides.add(-1 if away > 0 else 1)
    return sides.pop() if len(sides) == 1 else 0


_RUN_KEY = re.compile(r"r(\d+)\.([^@]+)@(-?\d+)")


def _kept_by_unit(
    schedule: StepSchedule, runs: Sequence[Run], counts: Sequence[int]
) -> Counter[Any]:
    """The blocks left allocated at the step's end, a run's block by ``(run id, role, kept
    unit)`` (every repeat of the middle unit counted as the middle one), others by key.

    Raises:
        CompositionError: a free without its allocation.
    """
    try:
        keys = schedule.live_keys()
    except ScheduleError as exc:
        raise CompositionError(f"the composed step does not pair its frees: {exc}") from exc
    out: Counter[Any] = Counter()
    for key in keys:
        m = _RUN_KEY.fullmatch(key)
        if m is None:
            out[key] += 1
            continue
        rid = int(m[1])
        run, unit = runs[rid], int(m[3]) - runs[rid].first
        if run.middle >= 0 and unit >= run.middle:
            unit = run.middle if unit < run.middle + counts[rid] else unit - counts[rid] + 1
        out[rid, m[2], unit] += 1
    return out


def _check_kept_blocks(
    one: StepSchedule, many: StepSchedule, runs: Sequence[Run], counts: Sequence[int]
) -> None:
    """Each repeat of a middle unit leaves allocated at the step's end what the traced middle
    unit leaves, and the other units what they leave (``one``: the composition with one repeat
    per run, which gives back the traced stream; ``many``: with ``counts``). A repeated body
    that allocates a block whose free the cut model makes in a unit it does not repeat (a
    reference further than the kept units reach) fails here.

    Raises:
        CompositionError: the blocks left differ, or a free has no allocation.
    """
    want = Counter(
        {
            k: n * (counts[k[0]] if isinstance(k, tuple) and runs[k[0]].middle == k[2] else 1)
            for k, n in _kept_by_unit(one, runs, [1] * len(runs)).items()
        }
    )
    got = _kept_by_unit(many, runs, counts)
    if got != want:
        extra = sorted(map(str, (got - want) or (want - got)))[:3]
        raise CompositionError(
            "the repeated units leave blocks allocated that the traced units free "
            f"({', '.join(extra)}): a block is freed further away than the kept units reach"
        )


def _check(schedule: StepSchedule, timeline: Timeline) -> None:
    """The composition with one repeat per run gives back the traced stream."""
    try:
        got = [(e.action, e.size_bytes) for e in schedule.events()]
    except ScheduleError as exc:
        raise CompositionError(f"the composed step does not pair its frees: {exc}") from exc
    want = [(e.action, e.size_bytes) for e in timeline.events if e.size_bytes > 0]
    if got != want:
        k = next((k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), -1)
        raise CompositionError(
            f"the composed step differs from the traced one at event {k} of {len(want)}"
        )
