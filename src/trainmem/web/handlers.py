"""The page's event handlers, as plain functions of the widget values (no gradio here).

Every handler turns trainmem's own errors (:class:`~trainmem.errors.TrainmemError`) into one
line in the page's message box; anything else is logged on the server and shown as one line
too, so a user never sees a traceback and the server keeps serving. Widget values arrive in the
order of :data:`INPUT_NAMES`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainmem.errors import TrainmemError
from trainmem.web import views
from trainmem.web.compute import (
    Request,
    band,
    fix_rows,
    numbers,
    plan_rows,
    resolve_request,
    run,
    timeline_points,
)
from trainmem.web.form import (
    DEFAULTS,
    FLAG_DEFAULT,
    GROUPS,
    MODEL_DEFAULT,
    NO_FSDP,
    TRISTATE_CHOICES,
    cli_command,
    coerce,
    default_values,
    field,
    from_query,
    to_query,
)
from trainmem.web.uploads import (
    accelerate_from_upload,
    deepspeed_from_upload,
    model_from_upload,
    trainer_config_from_upload,
)

log = logging.getLogger("trainmem.web")

TRAINING_NAMES: tuple[str, ...] = tuple(name for names in GROUPS.values() for name in names)
INPUT_NAMES: tuple[str, ...] = ("model", "gpu", "alloc_conf", "engine", "fsdp", *TRAINING_NAMES)
"""The widgets every handler reads, in this order."""

MAX_PINS = 4
_FILE_MAX_AGE_SECONDS = 3600
T = TypeVar("T")


def problem(exc: BaseException) -> str:
    """One line for the page: trainmem's message, or the exception type for anything else."""
    if isinstance(exc, TrainmemError | ImportError):
        return f"error: {exc}"
    log.exception("unexpected error in the web calculator")
    return f"unexpected error ({type(exc).__name__}): {exc}; please report it"


def _guard(compute: Callable[[], T], fallback: Callable[[str], T]) -> T:
    try:
        return compute()
    except Exception as exc:  # noqa: BLE001 - the page must show one line, never a traceback
        return fallback(problem(exc))


def collect(raw: Sequence[Any]) -> dict[str, Any]:
    """A values dict from widget values in :data:`INPUT_NAMES` order (checkbox-group lists
    as tuples, an empty one as None: ``lora_targets`` left to the framework;
    :data:`~trainmem.web.form.MODEL_DEFAULT` and an empty text box of a setting whose default
    is None as None; a three-valued flag's choice as True, False or None (its
    :data:`~trainmem.web.form.FLAG_DEFAULT`); the rest is typed by
    :func:`trainmem.web.form.coerce` when it is used)."""
    base = default_values()
    return {
        name: _collected(name, v, base.get(name, 0))
        for name, v in zip(INPUT_NAMES, raw, strict=True)
    }


def _collected(name: str, value: Any, default: Any) -> Any:
    if isinstance(value, list):  # a checkbox group; none ticked: the framework's
        return tuple(value) or None
    if name in _TRISTATES and value in (*TRISTATE_CHOICES, True, False, None):
        return coerce(name, value)  # typed: the CLI command spells True / False as a flag
    return None if _unset(value, default) else value


def _unset(value: Any, default: Any) -> bool:
    """A widget value that leaves the setting at None: the model's default, or an empty text
    box (a shown text box reports ``""``, a collapsed one None) or no ``--fsdp`` strategy
    (:data:`~trainmem.web.form.NO_FSDP`) where the default is None."""
    return value == MODEL_DEFAULT or (value in ("", NO_FSDP) and default is None)


def widget_values(values: Mapping[str, Any]) -> list[Any]:
    """Widget values in :data:`INPUT_NAMES` order (tuples as lists for checkbox groups, None
    there as none ticked: ``lora_targets`` left to the framework; an ``attention`` left to the
    model as :data:`~trainmem.web.form.MODEL_DEFAULT`; a three-valued flag as ``"true"``,
    ``"false"`` or :data:`~trainmem.web.form.FLAG_DEFAULT`)."""
    return [_widget_value(n, values[n]) for n in INPUT_NAMES]


def _widget_value(name: str, value: Any) -> Any:
    if isinstance(value, tuple) or (value is None and name in _CHECKBOX_GROUPS):
        return list(value or ())
    if value is None and name == "fsdp":
        return NO_FSDP
    if name in _TRISTATES:
        return FLAG_DEFAULT if value is None else ("true" if value else "false")
    return MODEL_DEFAULT if value is None and name == "attention" else value


_CHECKBOX_GROUPS = frozenset(n for n in DEFAULTS if field(n).kind == "multi")
_TRISTATES = frozenset(n for n in DEFAULTS if field(n).kind == "tristate")
"""The settings shown as checkbox groups (``lora_targets``)."""


def request_of(config_path: str | None, values: Mapping[str, Any]) -> Request:
    """The resolved request; an uploaded config.json replaces the preset (but under the
    ``analytic`` engine as its path, as the CLI's path argument: the traced paths build the
    model from the file, and ``auto`` sends a setting the formulas refuse there, prefix
    tuning or ChatGLM's quantize on a formula family's config, whose fix search then traces
    each candidate as the CLI's does)."""
    uploaded = model_from_upload(config_path)[0] if config_path else None
    if config_path and values.get("engine") != "analytic":
        uploaded = config_path
    return resolve_request(values, uploaded)


def _query(values: Mapping[str, Any], config_path: str | None, pins: list[dict[str, Any]]) -> str:
    shown = dict(values)
    if config_path:  # an uploaded file cannot travel in a link
        shown["model"] = default_values()["model"]
    return to_query(shown, pins)


# ---------------------------------------------------------------------------------------
# The estimate (fast: every change) and its details (plot, modules, fit, plan)
# ---------------------------------------------------------------------------------------

ESTIMATE_OUTPUTS = ("result", "cli", "query", "message")


def update(
    pins: list[dict[str, Any]] | None, config_path: str | None, *raw: Any
) -> tuple[Any, ...]:
    """The result (verdict, breakdown, uncertainty band, per-rank table, notes), the CLI
    command, the URL query and the message (:data:`ESTIMATE_OUTPUTS`) for the current widgets."""
    values = collect(raw)
    pins = pins or []

    def compute() -> tuple[Any, ...]:
        req = request_of(config_path, values)
        est = run(req)
        n = numbers(est)
        return (
            views.result_html(n, band(est), framework_notes(req, est)),
            cli_command(values, req.model_arg),
            _query(values, config_path, pins),
            "",
        )

    def failed(message: str) -> tuple[Any, ...]:
        blank = '<div class="verdict none" id="verdict">No estimate: see the message above.</div>'
        try:
            cli = cli_command(values, Path(config_path).name if config_path else None)
        except Exception:  # noqa: BLE001 - the command is a courtesy
            cli = ""
        query = _guard(lambda: _query(values, config_path, pins), lambda _m: "")
        return (blank, cli, query, views.message_html([message]))

    return _guard(compute, failed)


def framework_notes(req: Request, est: Any) -> list[str]:
    """That another common framework moves the peak by more than 10%
    (:func:`trainmem.planner.sensitivity.framework_note`), for the formula families."""
    if est.engine != "analytic":
        return []
    from trainmem.estimate import resolve_model
    from trainmem.planner.sensitivity import framework_note
    from trainmem.specs.hardware import resolve_gpu

    gpu = None if req.gpu is None else resolve_gpu(req.gpu)
    note = framework_note(resolve_model(req.model), req.training, gpu)
    return [note] if note else []


DETAIL_OUTPUTS = ("interactive", "plot", "modules")


PICTURE_TAB = "picture"
FIT_TAB = "fit"
"""Names of the result tabs whose content takes seconds: it is computed only while shown."""


def details(tab: str, config_path: str | None, *raw: Any) -> tuple[Any, ...]:
    """Interactive timeline (a pandas DataFrame), timeline picture (PNG path, only while
    ``tab`` is :data:`PICTURE_TAB`: matplotlib takes a second or more) and per-module tables
    (:data:`DETAIL_OUTPUTS`); they follow the estimate."""
    values = collect(raw)

    def compute() -> tuple[Any, ...]:
        import pandas as pd  # type: ignore[import-untyped]  # a dependency of gradio

        from trainmem.report.modules import activation_rows, peak_rows
        from trainmem.report.plots import plot_timeline

        req = request_of(config_path, values)
        est = run(req)
        if est.timeline is None or not len(est.timeline):
            why = "<p>No step timeline for this estimate (the allocator was not simulated).</p>"
            return None, None, why
        plot = None
        if tab == PICTURE_TAB:
            plot = _new_file("timeline", ".png")
            plot_timeline(est, plot, alloc_conf=req.alloc_conf)
        return (
            pd.DataFrame(timeline_points(est)),
            None if plot is None else str(plot),
            views.modules_html(activation_rows(est), peak_rows(est)),
        )

    return _guard(compute, lambda m: (None, None, views.message_html([m])))


def fit_and_plan(tab: str, config_path: str | None, *raw: Any) -> tuple[str, str]:
    """``trainmem fit`` suggestions (when the run does not fit) and ``trainmem plan``, as HTML;
    the searches take seconds, so they run only while ``tab`` is :data:`FIT_TAB`."""
    if tab != FIT_TAB:
        return "", ""
    values = collect(raw)

    def compute() -> tuple[str, str]:
        req = request_of(config_path, values)
        n = numbers(run(req))
        found = fix_rows(req) if n.fits is False else []
        return views.fixes_html(found, n), views.plan_html(plan_rows(req))

    return _guard(compute, lambda m: (views.message_html([m]), ""))


# ---------------------------------------------------------------------------------------
# Downloads
# ---------------------------------------------------------------------------------------


_OUT_DIR: Path | None = None


def _out_dir() -> Path:
    """This server's private folder for generated files (``tempfile.mkdtemp``: a new name,
    mode 0700, made by this process, removed at exit); files in it older than an hour are
    removed.

    The folder is never a fixed name in the shared temp directory, so nobody can plant it or a
    link in its place, and the cleanup removes only regular files this folder holds itself: a
    symbolic link is unlinked, never followed (``lstat``)."""
    global _OUT_DIR
    if _OUT_DIR is None or not _OUT_DIR.is_dir():
        _OUT_DIR = Path(tempfile.mkdtemp(prefix="trainmem-web-"))
        atexit.register(shutil.rmtree, _OUT_DIR, True)
    cutoff = time.time() - _FILE_MAX_AGE_SECONDS
    with os.scandir(_OUT_DIR) as entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_mtime < cutoff and not stat.S_ISDIR(info.st_mode):
                    os.unlink(entry.path)  # a link itself, never its target
            except OSError:
                pass
    return _OUT_DIR


def _new_file(stem: str, suffix: str) -> Path:
    return _out_dir() / f"{stem}-{uuid.uuid4().hex[:12]}{suffix}"


def downloads(config_path: str | None, *raw: Any) -> tuple[list[str] | None, str]:
    """The estimate as JSON (``MemoryEstimate.to_dict()``), the HTML report
    (:func:`trainmem.report.html.write_html`) and a PyTorch memory snapshot of the simulated
    step (open it at https://pytorch.org/memory_viz); (paths, message)."""
    values = collect(raw)

    def compute() -> tuple[list[str] | None, str]:
        from trainmem.allocator.snapshot import write_snapshot
        from trainmem.estimate import replay_estimate, resolve_gpu
        from trainmem.report.html import write_html

        req = request_of(config_path, values)
        est = run(req)
        stem = Path(req.model_arg).name.removesuffix(".json").replace("/", "-")
        as_json = _new_file(f"{stem}-estimate", ".json")
        as_json.write_text(json.dumps(est.to_dict(), indent=2, default=str), encoding="utf-8")
        report = _new_file(f"{stem}-report", ".html")
        write_html(est, report, alloc_conf=req.alloc_conf)
        replay = replay_estimate(
            est, gpu=resolve_gpu(req.gpu), alloc_conf=req.alloc_conf, record_history=True
        )
        snapshot = _new_file(f"{stem}-snapshot", ".pickle")
        if replay.snapshot is not None:
            write_snapshot(snapshot, replay.snapshot)
        files = [as_json, report] + ([snapshot] if replay.snapshot is not None else [])
        return [str(p) for p in files], ""

    return _guard(compute, lambda m: (None, views.message_html([m])))


# ---------------------------------------------------------------------------------------
# Uploaded framework configs, links, comparison
# ---------------------------------------------------------------------------------------


def apply_framework_file(kind: str, path: str | None, *raw: Any) -> list[Any]:
    """Set the widgets from an uploaded ``ds_config.json`` (``kind="deepspeed"``), accelerate
    config (``kind="accelerate"``) or trainer config (``kind="trainer"``: axolotl, torchtune,
    TrainingArguments); returns the widget values, then the message."""
    values = collect(raw)
    if not path:
        return [*widget_values(values), ""]

    def compute() -> list[Any]:
        ignored: list[str] = []
        if kind == "trainer":
            settings, notes = trainer_config_from_upload(path)
            ignored = [n for n in notes if " ignored (" in n]
        else:
            read = deepspeed_from_upload if kind == "deepspeed" else accelerate_from_upload
            settings = read(path)
        for name, value in settings.items():
            values[name] = coerce(name, value)
        applied = ", ".join(f"{k}={_shown(v)}" for k, v in settings.items()) or "nothing"
        message = " ".join([f"{Path(path).name}: set {applied}.", *ignored])
        return [*widget_values(values), views.info_html(message)]

    return _guard(compute, lambda m: [*widget_values(values), views.message_html([m])])


def _shown(value: Any) -> str:
    return "+".join(value) if isinstance(value, tuple) else str(value)


def load_query(query: Mapping[str, str]) -> list[Any]:
    """The page state of a link: widget values, the pinned configurations, the comparison and
    the message (problems with the link, if any)."""
    values, pins, problems = from_query(query)
    pins = pins[:MAX_PINS]
    return [*widget_values(values), pins, compare(pins), views.message_html(problems)]


def compare(pins: list[dict[str, Any]]) -> str:
    """The comparison view of the pinned configurations."""

    def compute() -> str:
        from trainmem.report.html import comparison_labels

        estimates = [run(resolve_request(p)) for p in pins]
        labels = comparison_labels(estimates)
        if len({e.model_name for e in estimates}) > 1:
            labels = [f"{e.model_name} {label}" for e, label in zip(estimates, labels, strict=True)]
        return views.compare_html(labels, [numbers(e) for e in estimates])

    return _guard(compute, lambda m: views.message_html([m]))


def pin(
    pins: list[dict[str, Any]] | None, config_path: str | None, *raw: Any
) -> tuple[list[dict[str, Any]], str, str]:
    """Add the current configuration to the comparison (at most :data:`MAX_PINS`);
    (pins, comparison, message)."""
    pins = list(pins or [])
    values = collect(raw)
    if config_path:
        message = "compare works with presets and hub ids; clear the uploaded config.json first"
    elif len(pins) >= MAX_PINS:
        message = f"at most {MAX_PINS} configurations can be compared; clear the comparison first"
    else:
        try:
            run(resolve_request(values))
        except Exception as exc:  # noqa: BLE001 - one line in the page
            return pins, compare(pins), views.message_html([problem(exc)])
        pins.append({k: values[k] for k in INPUT_NAMES})
        return pins, compare(pins), ""
    return pins, compare(pins), views.message_html([message])
