"""Step schedules filled from a template: the builder run once per structure, its sizes
re-evaluated per micro-batch size and sequence length (issue 28: the planner's inner loop).

Note [Schedule templates]
    A sweep evaluates thousands of configurations that differ only in the micro-batch size
    ``b`` and the sequence length ``s``. The analytic builder
    (:func:`~trainmem.analytic.schedule.rank_schedule`) is a deterministic program of the
    configuration: for fixed other settings, its control flow depends on ``b`` and ``s`` only
    where it compares or converts a size, and every op size is the arithmetic the formulas do
    on them. So the builder is run once with ``b`` and ``s`` as :class:`Sym` values: each holds
    its concrete value (the run computes exactly what it computes for that configuration) and
    records the arithmetic that made it. Every comparison, truth test, conversion to an index
    or text, and hash of a recorded value is a *guard*: the expression and the outcome the run
    saw. The recording compiles to one Python function of ``(b, s)`` that checks every guard
    in recording order and, when all hold, evaluates the recorded arithmetic and builds the
    same items (the same ops in the same order, the same repeated bodies, the pieces that do
    not depend on ``b`` and ``s`` shared as they are); when a guard fails, the configuration
    takes another path through the builder, which is recorded in turn. A configuration whose
    guards all hold runs the builder's exact control flow, so its filled schedule is the one
    the builder makes (the same ops; sizes computed by the same operations in the same order,
    floats included); each recording is checked at once against the builder's own schedule,
    and tests/analytic/test_template.py compares filled and built schedules over thousands
    of configurations of five models with every setting varied. ``peak()``, the breakdown and
    the verdict come from the filled schedule through the one driver
    (:func:`trainmem.estimate.finish`): nothing here computes a peak. The same run records the
    two terms one estimate's details report beside the schedules (the activation profile and
    the loss's backward transients: :class:`Filled`), so an estimate filled from a template
    does not run those formulas again; a sweep's row, which reads no details, fills the
    schedules alone.

    Anything the recording cannot follow (an operation on a recorded value with a type it does
    not know, a recorded value leaking into a cache that outlives the recording) raises, and
    that structure is built by the builder every time (:data:`_UNRECORDABLE`).

Note [When a template is recorded]
    A recording costs about ten builds (the recorded run, the check against the builder, the
    compilation: :data:`RECORD_AFTER_BUILDS`). A sweep's rows (``lean``) record at once; one
    estimate records a template only when the builder has already built
    :data:`RECORD_AFTER_BUILDS` configurations of the structure that no template of it served
    (the rule of renting skis until the rent paid equals the price: never more than twice the
    cheaper choice's time, Karlin et al. 1988, "Competitive snoopy caching"). A single
    ``trainmem estimate`` never pays for a recording; a program asking for many configurations
    of one structure (the searches of ``trainmem plan``, the estimates of a user's loop) gets
    them filled after the first few, and a filled schedule is the builder's (Note [Schedule
    templates]).

Source: tracing with guards, as torch.fx / TorchDynamo record a Python function once and
re-run the recorded graph while its guards hold (torch/_dynamo/guards.py).
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import fields
from enum import Enum
from types import CodeType
from typing import Any, NamedTuple

from trainmem.analytic.activations import ActivationProfile, activation_profile
from trainmem.analytic.loss import loss_backward_transient_bytes
from trainmem.analytic.schedule import rank_schedule
from trainmem.analytic.tensor_states import state_layout
from trainmem.analytic.transforms.base import PipelineRank
from trainmem.memo import by_value
from trainmem.schedule import Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import _ALL_FIELDS, _SLOT, _SLOTS, TrainingConfig


class RecordingError(Exception):
    """A recorded value was used in a way the recording cannot follow."""


class _Recorder:
    """The expressions (one per operation on a recorded value) and guards of one recording."""

    def __init__(self) -> None:
        self.nodes: list[tuple[str, tuple[int, ...]]] = []
        self.index: dict[str, int] = {}  # an expression recorded twice is one node
        self.guards: list[tuple[int, str, tuple[int, ...]]] = []
        self.seen_guards: set[str] = set()
        self.consts: list[object] = []

    def node(self, value: object, code: str, deps: tuple[int, ...]) -> Sym:
        i = self.index.get(code)
        if i is None:
            i = self.index[code] = len(self.nodes)
            self.nodes.append((code, deps))
        return Sym(value, i, self)

    def guard(self, code: str, deps: tuple[int, ...]) -> None:
        if code not in self.seen_guards:
            self.seen_guards.add(code)
            self.guards.append((len(self.nodes), code, deps))


_REC: list[_Recorder] = []
"""The recording under way (at most one)."""


def _rec(*values: Sym) -> _Recorder:
    """The recording under way, which made ``values``.

    Raises:
        RecordingError: none is under way, or another made one of ``values``.
    """
    if not _REC or any(v.r is not _REC[-1] for v in values):
        raise RecordingError("a recorded value was used after its recording ended")
    return _REC[-1]


_NUMBER = (int, float, bool)


def _operand(x: object) -> tuple[object, str, tuple[int, ...]] | None:
    """(value, code, dependencies) of an operand, or None for a type the recording does not
    follow."""
    if type(x) is Sym:
        _rec(x)
        return x.v, f"x{x.i}", (x.i,)
    if type(x) in _NUMBER:
        if isinstance(x, float) and not math.isfinite(x):
            rec = _rec()
            rec.consts.append(x)
            return x, f"K[{len(rec.consts) - 1}]", ()
        return x, repr(x), ()
    return None


_IDENTITY = {"+": (0, 0), "-": (0, None), "*": (1, 1), "//": (1, None)}
"""Per operator, the int operand that leaves an int unchanged on the right and on the left."""


def _binary(symbol: str, fn: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """The operator's method and its reflected method (``__add__``, ``__radd__``)."""
    right_identity, left_identity = _IDENTITY.get(symbol, (None, None))
    return (
        _operator(symbol, fn, right_identity, reflected=False),
        _operator(symbol, fn, left_identity, reflected=True),
    )


def _operator(
    symbol: str, fn: Callable[[Any, Any], Any], identity: int | None, *, reflected: bool
) -> Callable[[Sym, object], object]:
    def method(a: Sym, b: object) -> object:
        other = _operand(b)
        if other is None:
            return NotImplemented
        if type(b) is int and b == identity and type(a.v) is int:
            return a
        value, code, deps = other
        if reflected:
            return _rec(a).node(fn(value, a.v), f"({code} {symbol} x{a.i})", (*deps, a.i))
        return _rec(a).node(fn(a.v, value), f"(x{a.i} {symbol} {code})", (a.i, *deps))

    return method


def _compare(symbol: str, fn: Callable[[Any, Any], bool]) -> Callable[[Sym, object], object]:
    def compare(a: Sym, b: object) -> object:
        right = _operand(b)
        if right is None:
            return NotImplemented
        result = bool(fn(a.v, right[0]))
        if type(b) is Sym and b.i == a.i:  # one expression: the outcome is the operator's
            return result
        code = f"(x{a.i} {symbol} {right[1]})"
        _rec(a).guard(code if result else f"not {code}", (a.i, *right[2]))
        return result

    return compare


def _unary(template: str, fn: Callable[[Any], Any]) -> Callable[[Sym], Sym]:
    def unary(a: Sym) -> Sym:
        return _rec(a).node(fn(a.v), template.format(f"x{a.i}"), (a.i,))

    return unary


class Sym:
    """A number recorded for a template (Note [Schedule templates]): its concrete value ``v``
    and the index ``i`` of the expression that made it. Arithmetic with numbers gives recorded
    values; comparisons, truth tests and conversions give plain answers and record guards."""

    __slots__ = ("i", "r", "v")

    def __init__(self, v: object, i: int, r: _Recorder) -> None:
        self.v, self.i, self.r = v, i, r

    __add__, __radd__ = _binary("+", operator.add)
    __sub__, __rsub__ = _binary("-", operator.sub)
    __mul__, __rmul__ = _binary("*", operator.mul)
    __truediv__, __rtruediv__ = _binary("/", operator.truediv)
    __floordiv__, __rfloordiv__ = _binary("//", operator.floordiv)
    __mod__, __rmod__ = _binary("%", operator.mod)
    __pow__, __rpow__ = _binary("**", operator.pow)
    __and__, __rand__ = _binary("&", operator.and_)
    __or__, __ror__ = _binary("|", operator.or_)
    __xor__, __rxor__ = _binary("^", operator.xor)
    __lshift__, __rlshift__ = _binary("<<", operator.lshift)
    __rshift__, __rrshift__ = _binary(">>", operator.rshift)
    __lt__ = _compare("<", operator.lt)
    __le__ = _compare("<=", operator.le)
    __gt__ = _compare(">", operator.gt)
    __ge__ = _compare(">=", operator.ge)
    __eq__ = _compare("==", operator.eq)  # type: ignore[assignment]
    __ne__ = _compare("!=", operator.ne)  # type: ignore[assignment]
    __neg__ = _unary("(-{})", operator.neg)
    __pos__ = _unary("(+{})", operator.pos)
    __abs__ = _unary("abs({})", abs)
    __trunc__ = _unary("_trunc({})", math.trunc)
    __floor__ = _unary("_floor({})", math.floor)
    __ceil__ = _unary("_ceil({})", math.ceil)

    def __round__(self, ndigits: int | None = None) -> Sym:
        if ndigits is None:
            return _rec(self).node(round(self.v), f"round(x{self.i})", (self.i,))  # type: ignore[call-overload]
        return _rec(self).node(
            round(self.v, ndigits),  # type: ignore[call-overload]
            f"round(x{self.i}, {ndigits!r})",
            (self.i,),
        )

    def __divmod__(self, other: object) -> object:
        return (self // other, self % other)

    def __rdivmod__(self, other: object) -> object:
        return (other // self, other % self)

    def __bool__(self) -> bool:
        result = bool(self.v)
        _rec(self).guard(f"bool(x{self.i})" if result else f"not x{self.i}", (self.i,))
        return result

    def _pin(self) -> Any:
        """The concrete value, guarded to be exactly it (a structure decision)."""
        _rec(self).guard(f"(x{self.i} == {self.v!r})", (self.i,))
        return self.v

    def __index__(self) -> int:
        value = self._pin()
        if type(value) is not int:
            raise RecordingError(f"a recorded {type(value).__name__} used as an index")
        return value

    def __int__(self) -> int:
        return int(self._pin())

    def __float__(self) -> float:
        return float(self._pin())

    def __format__(self, spec: str) -> str:
        return format(self._pin(), spec)

    def __str__(self) -> str:
        return str(self._pin())

    def __repr__(self) -> str:
        return repr(self._pin())

    def __hash__(self) -> int:
        # one hash for every recorded value: a set or dict of them compares each pair, so
        # their deduplication and order are guarded
        return 0


class Filled(NamedTuple):
    """What a template fills for one configuration: the step schedules of its ranks and, when
    asked for (one estimate's details, not a sweep's row), the two terms the details report
    beside them, each what the builder's run computes (recorded in the same run, so under the
    same guards)."""

    schedules: list[StepSchedule]
    profile: ActivationProfile | None
    """:func:`~trainmem.analytic.activations.activation_profile` (None: not asked for)."""
    loss_backward_bytes: int | None
    """:func:`~trainmem.analytic.loss.loss_backward_transient_bytes` (None: not asked for)."""


Fill = Callable[[int, int, bool], "Filled | None"]
"""A template's fill function of ``(b, s, details)``."""


class _Structure:
    """The templates of one configuration key (every setting but ``b`` and ``s``): the
    recorded paths, the one that served each sequence length last (a sweep meets each length
    at every micro-batch size, and the sizes the builder compares mostly scale with it) and
    the one that served last."""

    __slots__ = ("by_seq_len", "fills")

    def __init__(self) -> None:
        self.fills: list[Fill] = []
        self.by_seq_len: dict[int, Fill] = {}

    def fill(self, b: int, s: int, details: bool) -> Filled | None:
        hint = self.by_seq_len.get(s)
        if hint is not None:
            out = hint(b, s, details)
            if out is not None:
                return out
        for k, fill in enumerate(self.fills):
            if fill is hint:
                continue
            out = fill(b, s, details)
            if out is not None:
                if k:  # the next configuration likely takes the same path: try it first
                    self.fills.insert(0, self.fills.pop(k))
                self.by_seq_len[s] = fill
                return out
        return None


_TEMPLATES: dict[tuple[object, ...], _Structure] = {}
_UNRECORDABLE: set[tuple[object, ...]] = set()
MAX_TEMPLATES_PER_STRUCTURE = 32
"""Recordings kept per configuration key; beyond them the builder runs (a structure whose
guards split the (b, s) plane very finely gains nothing from templates)."""
MAX_TEMPLATES = 1024
"""Recordings kept in all (about 60 kB each for llama-3.1-8b); the oldest keys' go first."""
_MAX_KEYS = 256
RECORD_AFTER_BUILDS = 10
"""Configurations of one structure that single estimates build while none of its templates'
guards hold before one records a template: a recording costs about ten builds (2.5-3 ms
against 0.25-0.3 ms for gpt2, llama-3.2-1b and llama-3.1-8b on one CPU core; Note [When a
template is recorded])."""
_BUILT: dict[tuple[object, ...], int] = {}
"""Per structure, the configurations built since its last recording."""
_TOTAL = [0]  # recordings in _TEMPLATES
_CODE: dict[str, CodeType] = {}
"""Compiled fill functions by their source (compiling is most of a recording's time)."""


def _key(model: ModelSpec, training: TrainingConfig, per_handle: int) -> tuple[object, ...]:
    """Every setting but ``b`` and ``s``, the model (by value) and the cuBLAS workspace."""
    fields = _ALL_FIELDS(training)
    rest = fields[:_B_AT] + fields[_B_AT + 1 : _S_AT] + fields[_S_AT + 1 :]
    return (by_value(model), per_handle, rest)


_NAMES = tuple(_SLOT)
_B_AT = _NAMES.index("micro_batch_size")
_S_AT = _NAMES.index("seq_len")
assert _B_AT < _S_AT


def templated_schedules(
    model: ModelSpec,
    training: TrainingConfig,
    ranks: Sequence[PipelineRank],
    per_handle: int,
    *,
    eager: bool = True,
    details: bool = False,
) -> Filled | None:
    """The step schedules of ``ranks`` (as :func:`~trainmem.analytic.schedule.rank_schedule`
    builds them), with the activation profile and the loss's backward transients the details
    report (``details``; else None), filled from a template (Note [Schedule templates]),
    recording one when no template's guards hold; None when this structure cannot be recorded
    (the caller builds).
    ``eager=False`` (one estimate, not a sweep's row): None (the caller builds) instead of a
    recording until :data:`RECORD_AFTER_BUILDS` configurations of the structure were built
    (Note [When a template is recorded]). One thread at a time (a recording's values record
    into the one recording under way).
    """
    with _LOCK:
        return _templated(model, training, ranks, per_handle, eager, details)


_LOCK = threading.Lock()


def _templated(
    model: ModelSpec,
    training: TrainingConfig,
    ranks: Sequence[PipelineRank],
    per_handle: int,
    eager: bool,
    details: bool,
) -> Filled | None:
    key = _key(model, training, per_handle)
    b, s = training.micro_batch_size, training.seq_len
    found = _TEMPLATES.get(key)
    if found is None and key in _UNRECORDABLE:
        return None
    out = None if found is None else found.fill(b, s, details)
    if out is not None or (found is not None and len(found.fills) >= MAX_TEMPLATES_PER_STRUCTURE):
        return out
    if not eager:  # Note [When a template is recorded]
        built = _BUILT.get(key, 0)
        if built < RECORD_AFTER_BUILDS:
            if len(_BUILT) >= _MAX_KEYS:
                _BUILT.clear()
            _BUILT[key] = built + 1
            return None
        del _BUILT[key]
    if found is None:
        if len(_TEMPLATES) >= _MAX_KEYS:
            _TOTAL[0] -= len(_TEMPLATES.pop(next(iter(_TEMPLATES))).fills)
        found = _TEMPLATES[key] = _Structure()
    try:
        fill = record(model, training, ranks, per_handle)
    except RecordingError:
        if len(_UNRECORDABLE) >= _MAX_KEYS:
            _UNRECORDABLE.clear()
        _UNRECORDABLE.add(key)
        _TOTAL[0] -= len(_TEMPLATES.pop(key).fills)
        return None
    found.fills.insert(0, fill)
    found.by_seq_len[s] = fill
    _TOTAL[0] += 1
    while _TOTAL[0] > MAX_TEMPLATES and len(_TEMPLATES) > 1:
        _TOTAL[0] -= len(_TEMPLATES.pop(next(iter(_TEMPLATES))).fills)
    out = fill(b, s, details)
    assert out is not None
    return out


def _symbolic(training: TrainingConfig) -> TrainingConfig:
    """``training`` with ``micro_batch_size`` and ``seq_len`` as the recording's two leaves."""
    rec = _rec()
    new = object.__new__(TrainingConfig)
    for slot, value in zip(_SLOTS, _ALL_FIELDS(training), strict=True):
        slot.__set__(new, value)
    _SLOT["micro_batch_size"].__set__(new, rec.node(training.micro_batch_size, "b", ()))
    _SLOT["seq_len"].__set__(new, rec.node(training.seq_len, "s", ()))
    return new


def record(
    model: ModelSpec,
    training: TrainingConfig,
    ranks: Sequence[PipelineRank],
    per_handle: int,
) -> Fill:
    """Run the builder for ``ranks`` with ``b`` and ``s`` recorded and compile the template
    (Note [Schedule templates]); checked against the builder's schedules at this
    configuration.

    Raises:
        RecordingError: the builder used a recorded value in a way the recording cannot follow,
            or the filled template differs from the builder's schedules.
    """
    layout = state_layout(model, training)
    rec = _Recorder()
    _REC.append(rec)
    try:
        sym = _symbolic(training)
        prof = activation_profile(model, sym)
        recorded = Filled(
            [
                rank_schedule(
                    model, sym, r, layout=layout, prof=prof, workspace_per_handle=per_handle
                )
                for r in ranks
            ],
            prof,
            loss_backward_transient_bytes(model, sym),
        )
        fill = _compile(rec, recorded)
    except Exception as exc:  # noqa: BLE001 -- any failure: this structure is built instead
        raise RecordingError(f"the builder cannot be recorded: {exc!r}") from exc
    finally:
        _REC.pop()
    prof = activation_profile(model, training)
    built = Filled(
        [
            rank_schedule(
                model, training, r, layout=layout, prof=prof, workspace_per_handle=per_handle
            )
            for r in ranks
        ],
        prof,
        loss_backward_transient_bytes(model, training),
    )
    try:
        filled = fill(training.micro_batch_size, training.seq_len, True)
    except Exception as exc:  # noqa: BLE001 -- a fill that cannot run: built instead
        raise RecordingError(f"the template cannot be filled: {exc!r}") from exc
    if filled != built or _holds_sym(built):
        raise RecordingError("the filled template differs from the builder's schedule")
    return fill


def _holds_sym(items: object, seen: dict[int, bool] | None = None) -> bool:
    """Whether ``items`` (a schedule, its items, a list of them) hold a recorded value: a
    template's items that must be made per configuration, or, in a schedule built without
    recording, a recorded value a cache shared with the recording kept. ``seen``: the answers
    per object already walked (a body shared by several repeats is walked once)."""
    if type(items) is Sym:
        return True
    if type(items) is Op:  # NB: most of what is walked; its fields are numbers and text
        return Sym in map(type, items)
    seen = {} if seen is None else seen
    known = seen.get(id(items))
    if known is not None:
        return known
    parts: tuple[object, ...] = ()
    if isinstance(items, StepSchedule):
        parts = (items.setup, items.step, items.load)
    elif isinstance(items, Repeat):
        parts = (items.count, items.body)
    elif isinstance(items, tuple | list):
        parts = tuple(items)
    elif isinstance(items, ActivationProfile):
        parts = tuple(getattr(items, f.name) for f in fields(items))
    elif isinstance(items, dict):
        parts = (*items, *items.values())
    out = seen[id(items)] = any(_holds_sym(x, seen) for x in parts)
    return out


class _Codegen:
    """The source of a template's fill function: the guards and expressions in recording
    order, then the items, each distinct object once."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.consts: list[object] = list(rec.consts)
        self.keep: list[object] = []  # the recorded objects whose ids name variables
        self.used: set[int] = set()
        self.seen: dict[int, bool] = {}  # _holds_sym's answers (the recorded items stay alive)

    def const(self, value: object) -> str:
        self.consts.append(value)
        return f"K[{len(self.consts) - 1}]"

    def value(self, x: object) -> str:
        """An expression for ``x`` (an item, a field of one, or a recorded value)."""
        if type(x) is Sym:
            self.used.add(x.i)
            return f"x{x.i}"
        if type(x) in (str, int, bool, type(None)):
            return repr(x)
        name = self.names.get(id(x))
        if name is not None:
            return name
        if not _holds_sym(x, self.seen):
            name = self.names[id(x)] = self.const(x)
            self.keep.append(x)
            return name
        if isinstance(x, Op):
            code = "_op(Op, (" + ", ".join(self.value(f) for f in x) + ",))"
        elif isinstance(x, Repeat | StepSchedule | ActivationProfile):
            return self.instance(x)
        elif type(x) is dict:
            code = "{" + ", ".join(f"{self.value(k)}: {self.value(v)}" for k, v in x.items()) + "}"
        elif type(x) is tuple:
            code = "(" + "".join(self.value(e) + ", " for e in x) + ")"
        elif type(x) is list:
            code = "[" + ", ".join(self.value(e) for e in x) + "]"
        elif isinstance(x, Enum | float):
            return self.const(x)
        else:
            raise RecordingError(f"a recorded value in a {type(x).__name__}")
        name = self.names[id(x)] = f"v{len(self.names)}"
        self.keep.append(x)
        self.lines.append(f"    {name} = {code}")
        return name

    def instance(self, x: Repeat | StepSchedule | ActivationProfile) -> str:
        """A repeat, a schedule or a profile made without its dataclass ``__init__`` (which
        sets each field through ``object.__setattr__``, the most of a fill's time): each slot
        set, the uncompared caches (``memo``, ``_cache``) fresh."""
        cls = type(x)
        values = ["{}" if not f.compare else self.value(getattr(x, f.name)) for f in fields(cls)]
        name = self.names[id(x)] = f"v{len(self.names)}"
        self.keep.append(x)
        self.lines.append(f"    {name} = _new({cls.__name__})")
        self.lines += [
            f"    _{cls.__name__}_{f.name}({name}, {v})"
            for f, v in zip(fields(cls), values, strict=True)
        ]
        return name

    def source(self, schedules: str, details: tuple[str, str], lines: int) -> str:
        """The fill function: guards and the expressions they and the items need, the
        schedules (made by the first ``lines`` of the items' lines), and the details'
        profile and loss transients (the rest) when asked for."""
        nodes, guards = self.rec.nodes, self.rec.guards
        needed = set(self.used)
        for _, _, deps in guards:
            needed.update(deps)
        for i in range(len(nodes) - 1, -1, -1):  # expressions feed later ones only
            if i in needed:
                needed.update(nodes[i][1])
        body: list[str] = []
        g = 0
        for i, (code, _) in enumerate(nodes):
            while g < len(guards) and guards[g][0] <= i:
                body.append(f"    if not {guards[g][1]}: return None")
                g += 1
            if i in needed:
                body.append(f"    x{i} = {code}")
        body += [f"    if not {code}: return None" for _, code, _ in guards[g:]]
        body += self.lines[:lines]
        body.append(f"    if not details: return _op(_Filled, ({schedules}, None, None))")
        body += self.lines[lines:]
        body.append(f"    return _op(_Filled, ({schedules}, {details[0]}, {details[1]}))")
        return "def fill(b, s, details):\n" + "\n".join(body) + "\n"


_MADE = (Repeat, StepSchedule, ActivationProfile)
"""The frozen dataclasses a fill makes slot by slot (:meth:`_Codegen.instance`)."""


def _compile(rec: _Recorder, recorded: Filled) -> Fill:
    gen = _Codegen(rec)
    schedules = gen.value(recorded.schedules)
    lines = len(gen.lines)  # the rest make the details' terms (the schedules hold no dict)
    details = (gen.value(recorded.profile), gen.value(recorded.loss_backward_bytes))
    source = gen.source(schedules, details, lines)
    namespace: dict[str, Any] = {
        "K": gen.consts,
        "Op": Op,
        "Repeat": Repeat,
        "StepSchedule": StepSchedule,
        "ActivationProfile": ActivationProfile,
        "_Filled": Filled,
        "_op": tuple.__new__,
        "_new": object.__new__,
        **{
            f"_{cls.__name__}_{f.name}": getattr(cls, f.name).__set__
            for cls in _MADE
            for f in fields(cls)
        },
        "_trunc": math.trunc,
        "_floor": math.floor,
        "_ceil": math.ceil,
    }
    code = _CODE.get(source)
    if code is None:  # recordings of other settings often make the same source
        if len(_CODE) >= MAX_TEMPLATES:
            del _CODE[next(iter(_CODE))]
        code = _CODE[source] = compile(source, "<schedule template>", "exec")
    exec(code, namespace)  # noqa: S102
    raw: Fill = namespace["fill"]

    def fill(b: int, s: int, details: bool) -> Filled | None:
        try:
            return raw(b, s, details)
        except (ArithmeticError, ValueError):  # a path the recording did not take
            return None

    fill.source = source  # type: ignore[attr-defined]
    return fill
