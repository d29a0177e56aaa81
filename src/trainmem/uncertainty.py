"""Low / expected / high band around an estimate, from the accuracy benchmark's error spread.

The band is empirical, not a model: ``benchmarks/validate.py --write-results`` (and ``--dev2
--write-results`` for the analytic engine) runs every expressible row of both development sets
(``shared/validation/dev_measurements.csv``, ``dev_measurements_2.csv``) and stores, per *kind
of configuration* (``method=lora``, ``attention=eager``, ``sharded=yes``, ...), the spread of
the signed relative error ``e = (predicted - measured) / measured`` in
``trainmem/data/uncertainty.json``. For a new configuration, every kind it belongs to that has
at least :data:`MIN_ROWS` measured rows contributes its 10th and 90th percentiles; the band is
their union:

    measured = predicted / (1 + e)  =>  low = expected / (1 + e_p90), high = expected / (1 + e_p10)

with ``e_p10 <= 0 <= e_p90`` so the band always brackets the expected value: for each kind, 8 of
10 development rows fell inside it. (With 33 rows the band was min/max; over the 172 rows of
both sets the extremes are rows whose reading of the source is in doubt, +202 % and -66 %,
which would make every band meaningless.) A kind with too few rows (or none) falls back to the
spread over all rows and is named first in ``least_sure_of``: nothing was measured there.

Known limitations: the rows come from a dozen sources, not a sample of all stacks; the
held-out measurements err more (see README). Rows measured as allocated, reserved and device
totals are pooled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from trainmem.breakdown import MemoryEstimate
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig

MIN_ROWS = 3
"""A kind needs this many benchmark rows before its own spread is used; below it, the spread
over all rows stands in (min/max of one or two rows says nothing about the spread)."""

TABLE_RESOURCE = ("trainmem", "data/uncertainty.json")
"""Package resource holding the table written by ``benchmarks/validate.py --write-results``."""

_METRICS = {
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "device_total": "device_total_bytes",
}


_DEFAULT_TRAINING = TrainingConfig()


def configuration_kinds(training: TrainingConfig | Mapping[str, Any]) -> list[str]:
    """The kinds of configuration a training setup belongs to, as ``key=value`` labels.

    One label per axis along which the benchmark's errors are grouped: fine-tuning method,
    sharding, attention kernel, activation checkpointing, precision, optimizer family.

    Args:
        training: the training settings, or an estimate's resolved ``config`` dict (the same
            field names and values; read as it is, not rebuilt into a TrainingConfig, which
            validated every field again for every row of a sweep).

    Returns:
        Labels such as ``["method=lora", "sharded=no", "attention=sdpa", ...]``.
    """

    def get(name: str) -> Any:
        if isinstance(training, Mapping):  # a field left out has its default
            return training.get(name, getattr(_DEFAULT_TRAINING, name))
        return getattr(training, name)

    if get("quantize_base") != "none":
        method = "qlora"
    elif get("lora_rank") > 0:
        method = "lora"
    else:
        method = "full"
    sharded = get("data_parallel_size") > 1 and get("zero_stage") > 0
    optimizer = get("optimizer")
    row = OPTIMIZER_TABLE.get(optimizer)
    family = optimizer if row is None else row.uncertainty_family
    return [
        f"method={method}",
        f"sharded={'yes' if sharded else 'no'}",
        f"offload={get('offload')}",
        f"attention={get('attention')}",
        f"checkpointing={get('activation_checkpointing')}",
        f"precision={get('precision')}",
        f"optimizer={family}",
    ]


@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    """The committed error table (``trainmem/data/uncertainty.json``).

    Returns:
        The parsed table: ``{"engines": {engine: {kind: {"n", "min", "max", ...}}}, ...}``.
    """
    # NB: pkgutil, here: only a verdict reads the table, not --help; the package's loader
    # reads it (a file, or a member of a zip archive) without importlib.resources' readers,
    # which import zipfile, pathlib's zip support and more (~5 ms of a `trainmem plan`)
    import pkgutil

    package, name = TABLE_RESOURCE
    data = pkgutil.get_data(package, name)
    if data is None:  # pragma: no cover - a loader without get_data (none that installs us)
        raise FileNotFoundError(f"{package}/{name}: the package's loader cannot read it")
    table: dict[str, Any] = json.loads(data.decode("utf-8"))
    return table


def uncertainty_band(
    est_or_training: Any,
    expected_bytes: int | None = None,
    *,
    engine: str | None = None,
    metric: str = "allocated",
    table: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Low / expected / high peak bytes for one configuration, from the benchmark's errors.

    Args:
        est_or_training: a :class:`~trainmem.breakdown.MemoryEstimate` (its config, engine and
            peak are used), or a :class:`~trainmem.specs.training.TrainingConfig` together with
            ``expected_bytes``.
        expected_bytes: the point estimate in bytes; required with a TrainingConfig, overrides
            the estimate's own peak otherwise.
        engine: whose errors to use (``analytic`` or ``trace``); default the estimate's engine,
            or ``analytic``. An engine missing from the table falls back to ``analytic``.
        metric: which peak of an estimate is banded: ``allocated``, ``reserved`` or
            ``device_total``.
        table: an error table in the format of :func:`load_table`; default the shipped one.

    Returns:
        ``{"low": int, "expected": int, "high": int, "least_sure_of": [str, ...],
        "kinds": [str, ...], "engine": str, "metric": str}``; bytes are ints,
        ``low <= expected <= high``; ``least_sure_of`` names the (at most three) settings with
        the widest error spread, unmeasured ones first, then widest first.

    Raises:
        TypeError: a TrainingConfig without ``expected_bytes``.
        ValueError: an unknown ``metric``.
    """
    if metric not in _METRICS:
        raise ValueError(f"metric: unknown value {metric!r}; allowed: {', '.join(_METRICS)}")
    training: TrainingConfig | Mapping[str, Any]
    if isinstance(est_or_training, TrainingConfig):
        if expected_bytes is None:
            raise TypeError("uncertainty_band(TrainingConfig, ...) needs expected_bytes")
        training = est_or_training
        engine = engine or "analytic"
        expected = int(expected_bytes)
    else:
        training = est_or_training.config
        engine = engine or est_or_training.engine
        expected = (
            int(expected_bytes)
            if expected_bytes is not None
            else int(getattr(est_or_training.breakdown, _METRICS[metric]))
        )
    kinds = configuration_kinds(training)
    e_min, e_max, least_sure = (
        _spread(engine, tuple(kinds)) if table is None else _spread_in(table, engine, tuple(kinds))
    )
    # measured = predicted / (1 + e); e > -1 always (a prediction is never 0 bytes).
    low = int(expected / (1.0 + e_max))
    high = int(expected / (1.0 + e_min))
    return {
        "low": min(low, expected),
        "expected": expected,
        "high": max(high, expected),
        "least_sure_of": list(least_sure),
        "kinds": kinds,
        "engine": engine,
        "metric": metric,
    }


@lru_cache(maxsize=256)
def _spread(engine: str, kinds: tuple[str, ...]) -> tuple[float, float, tuple[str, ...]]:
    return _spread_in(load_table(), engine, kinds)


def _spread_in(
    table: dict[str, Any], engine: str, kinds: tuple[str, ...]
) -> tuple[float, float, tuple[str, ...]]:
    """(e_min, e_max, least sure of): the lowest 10th and highest 90th percentile of the kinds'
    signed errors in ``table``."""
    engines: dict[str, Any] = table["engines"]
    per_kind: dict[str, Any] = engines.get(engine) or engines["analytic"]
    overall = per_kind["all"]
    e_min = e_max = 0.0
    ranked: list[tuple[float, str]] = []
    for kind in kinds:
        stats = per_kind.get(kind)
        if stats is None or stats["n"] < MIN_ROWS:
            n = 0 if stats is None else stats["n"]
            stats = overall
            # Unmeasured settings rank above every measured one.
            why = f"{kind}: {n} dev rows measured; band from all {overall['n']} rows"
            ranked.append((float("inf"), why))
        else:
            width = stats["p90"] - stats["p10"]
            why = (
                f"{kind}: error {100 * stats['p10']:+.0f}% to {100 * stats['p90']:+.0f}% "
                f"(10th to 90th percentile) over {stats['n']} dev rows"
            )
            ranked.append((width, why))
        e_min = min(e_min, stats["p10"])
        e_max = max(e_max, stats["p90"])
    ranked.sort(key=lambda item: -item[0])
    return e_min, e_max, tuple(why for _width, why in ranked[:3])


VERDICTS = ("fits", "tight", "does not fit")
"""The one verdict every command, the JSON and the web page show."""


def verdict_of(est: MemoryEstimate) -> str | None:
    """``"fits"``, ``"tight"`` or ``"does not fit"`` for an estimate with a GPU; None without.

    - ``does not fit``: the simulated caching allocator runs out of memory (after freeing its
      cache and retrying), or without the simulation the device total exceeds the capacity
      (:attr:`MemoryEstimate.fits` is False);
    - ``tight``: it fits, but the high end of the device total's uncertainty band
      (:func:`uncertainty_band`, ``metric="device_total"``) is above the usable capacity, so
      the benchmark's error spread allows an out-of-memory;
    - ``fits``: the band's high end is within the capacity.
    """
    if est.gpu_capacity_bytes is None:
        return None
    if not est.fits:
        return "does not fit"
    high = uncertainty_band(est, metric="device_total")["high"]
    return "tight" if high > est.gpu_capacity_bytes else "fits"
