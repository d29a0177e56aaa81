"""Find a model's repeated blocks and cut each list of them to a few (the generic path's model).

Note [Runs of blocks]
    A block list is an ``nn.ModuleList`` of modules holding parameters (decoder layers, T5's
    encoder and decoder blocks, FLUX's double and single blocks, Jamba's Mamba and attention
    layers), not inside another list that is cut (a list with nothing to cut, as a UNet's four
    different down blocks, is looked into: its blocks' transformer blocks are cut). Blocks of
    one list whose structure differs are distinct *kinds*: their classes, parameters (names,
    shapes, dtypes), their submodules' classes, and their submodules' scalar attributes other
    than indices (``attention_type``, ``sliding_window``, ``is_sliding``...), so DeepSeek-V3's
    dense and MoE layers, Gemma 2's sliding and global layers, or T5's first block (it owns the
    relative-position bias) differ. A list is split into *runs*: a unit of ``unit``
    consecutive blocks repeated ``reps`` times (Gemma 3: five sliding + one global; Jamba: its
    attention / expert period).
    A run of more than :data:`COPIES` units keeps ``COPIES`` of them in the traced model: the
    first ``middle + 1`` and the last ``COPIES - middle - 1``; the kept unit ``middle`` stands
    for the ``reps - COPIES + 1`` identical units in the middle of the full model
    (``trainmem.trace.compose``). Two units on each side of the middle one let a tensor be freed
    up to two blocks after (or before) the block that allocated it. A step whose tensors are
    freed further away (FSDP1's rate-limited gathers, three layers: Note [FSDP1's gathers three
    layers on] in trainmem/trace/generic.py) keeps more: ``reach`` blocks on each side, ``2 *
    ceil(reach / unit) + 1`` units (seven single blocks for a reach of three).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["COPIES", "Run", "block_kind", "find_block_lists", "find_runs", "kept_units", "truncate"]

COPIES = 5
"""Units of a run kept in the traced model (the middle one repeated); units of several blocks
keep :data:`UNIT_COPIES`."""
UNIT_COPIES = 3
MAX_UNIT = 8
"""Longest unit of blocks searched for (Gemma 3's five sliding + one global is six)."""

_INDEX_ATTR = re.compile(r"idx|index|layer_id|layer_num|block_id|block_num", re.IGNORECASE)
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a block list (Note [Runs of blocks]).

    Attributes:
        list_path: dotted path of the ``nn.ModuleList`` (the same in the cut model).
        first: index of the run's first block in the full list.
        unit: blocks per repeated unit.
        reps: units in the full model.
        kept: units kept in the cut model.
        middle: the kept unit that stands for the repeated ones, or -1 (all kept).
        cut_first: index of the run's first block in the cut list.
    """

    list_path: str
    first: int
    unit: int
    reps: int
    kept: int
    middle: int
    cut_first: int

    @property
    def count(self) -> int:
        """Units the middle one stands for in the full model."""
        return self.reps - self.kept + 1 if self.middle >= 0 else 0

    def full_unit(self, t: int, count: int | None = None) -> int:
        """The full model's unit index of kept unit ``t`` (``count``: the middle's repeats)."""
        n = self.count if count is None else count
        return t if self.middle < 0 or t <= self.middle else t + n - 1


def find_block_lists(model: Any) -> list[tuple[str, Any]]:
    """The candidate block lists of ``model``: every ``nn.ModuleList`` of >= 2 modules holding
    parameters, outermost first (:func:`truncate` skips a list inside one it cut).

    Args:
        model: the ``nn.Module`` (meta tensors are fine).

    Returns:
        ``(dotted path, ModuleList)`` pairs in module order.
    """
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList)
        and len(mod) >= 2
        and all(next(iter(b.parameters()), None) is not None for b in mod)
    ]


def block_kind(block: Any) -> tuple[Any, ...]:
    """What makes two blocks allocate alike (Note [Runs of blocks]); equal tuples = one kind."""
    params = tuple(
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    mods = []
    for n, m in block.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_")
                and k != "training"
                and isinstance(v, _SCALARS)
                and not _INDEX_ATTR.search(k)
            )
        )
        mods.append((n, type(m).__name__, attrs))
    return params, buffers, tuple(mods)


def find_runs(kinds: list[Any]) -> list[tuple[int, int, int]]:
    """Split a list's block kinds into runs ``(first, unit, reps)``: at each position the unit
    (up to :data:`MAX_UNIT` blocks) repeated most often covers the most blocks."""
    out: list[tuple[int, int, int]] = []
    s, n = 0, len(kinds)
    while s < n:
        best_unit, best_reps = 1, 1
        for p in range(1, min(MAX_UNIT, n - s) + 1):
            r = 1
            while s + (r + 1) * p <= n and kinds[s + r * p : s + (r + 1) * p] == kinds[s : s + p]:
                r += 1
            if r >= 2 and p * r > best_unit * best_reps:
                best_unit, best_reps = p, r
        out.append((s, best_unit, best_reps))
        s += best_unit * best_reps
    return out


def kept_units(unit: int, reach: int = 2) -> int:
    """Units of ``unit`` blocks kept of a long run (Note [Runs of blocks]): :data:`COPIES` for
    single blocks, :data:`UNIT_COPIES` for longer units, more when a tensor is freed more than
    two blocks from the block that allocated it (``reach`` blocks: ``reach / unit`` units,
    rounded up, on each side of the middle one)."""
    return max(COPIES if unit == 1 else UNIT_COPIES, 2 * (-(-reach // unit)) + 1)


def truncate(model: Any, copies: int | None = None, *, reach: int = 2) -> list[Run]:
    """Cut every block list of ``model`` in place to the kept units of its runs.

    Args:
        model: the full model on ``meta``.
        copies: units kept per run (default :func:`kept_units`); at least 3.
        reach: the most blocks between the one that allocates a tensor and the one that frees
            it (:func:`kept_units`; ignored with ``copies``).

    Returns:
        The runs of every list, in list order.
    """
    runs: list[Run] = []
    cut: list[str] = []
    for path, mod in find_block_lists(model):
        if any(path.startswith(c + ".") for c in cut):
            continue
        kinds = [block_kind(b) for b in mod]
        found = find_runs(kinds)
        limit = copies if copies is not None else kept_units(1, reach)
        if all(
            reps <= (limit if unit == 1 else kept_units(unit, reach)) for _, unit, reps in found
        ):
            continue  # nothing to cut here: look for lists inside its blocks
        cut.append(path)
        keep: list[Any] = []
        for first, unit, reps in found:
            c = copies if copies is not None else kept_units(unit, reach)
            middle = (c - 1) // 2
            if reps <= c:
                units, kept, middle = list(range(reps)), reps, -1
            else:
                units = list(range(middle + 1)) + list(range(reps - (c - middle - 1), reps))
                kept = c
            runs.append(Run(path, first, unit, reps, kept, middle, len(keep)))
            for u in units:
                keep.extend(mod[first + u * unit + o] for o in range(unit))
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, torch.nn.ModuleList(keep))
    return runs
