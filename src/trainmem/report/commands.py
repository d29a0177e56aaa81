"""CLI pieces for pictures of memory: the ``compare`` command, added to trainmem's typer app by
:func:`register`, and :func:`emit_reports`, which ``trainmem estimate --plot FILE --html FILE``
calls after the estimate.

``cli.py`` calls ``register(app)``; the import of ``trainmem.cli`` is inside the function so that
``trainmem.cli`` can import this module at any point without a cycle. Like
``trainmem.planner.commands``, this module has no ``from __future__ import annotations``: typer
reads the option annotations at registration time, and the aliases are local names of
:func:`register`.
"""

import dataclasses
import re
from typing import Any

import typer

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError

#: ``--set`` keys that are not TrainingConfig fields: they choose how the estimate is made.
ESTIMATE_KEYS = ("engine", "gpu", "alloc_conf", "fsdp")

# Assignments are separated by ';' or whitespace, or by a ',' that starts a new KEY=...
_SPLIT = re.compile(r"[;\s]+|,(?=\s*[A-Za-z][\w-]*\s*=)")


def emit_reports(
    est: MemoryEstimate, *, plot: str | None, html: str | None, alloc_conf: str = ""
) -> list[str]:
    """Write the timeline plot and/or the HTML report of ``est``; return one note per file.

    Args:
        est: the estimate (with its timeline, which both engines attach).
        plot: ``.png`` / ``.svg`` path for :func:`trainmem.report.plots.plot_timeline`, or None.
        html: path for :func:`trainmem.report.html.write_html`, or None.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` of the estimate, for the reserved outline.

    Returns:
        Notes such as ``"timeline plot written to timeline.png"``.

    Raises:
        SpecError: no timeline on ``est``, a bad suffix, or a file that cannot be written.
        ImportError: matplotlib (the ``plot`` extra) is not installed.
    """
    notes: list[str] = []
    if plot is not None:
        from trainmem.report.plots import plot_timeline

        plot_timeline(est, plot, alloc_conf=alloc_conf)
        notes.append(f"timeline plot written to {plot}")
    if html is not None:
        from trainmem.report.html import write_html

        write_html(est, html, alloc_conf=alloc_conf)
        notes.append(f"HTML report written to {html}")
    return notes


def parse_set(text: str) -> dict[str, Any]:
    """One ``--set`` option: ``"activation-checkpointing=full micro-batch-size=4"`` ->
    ``{"activation_checkpointing": "full", "micro_batch_size": 4}``.

    Keys are TrainingConfig fields (dashes or underscores) or :data:`ESTIMATE_KEYS`; values are
    typed like the field's default (:func:`trainmem.planner.sweep.parse_value`);
    ``lora-targets`` takes ``q,v`` or ``q+v`` or ``all-linear``.

    Raises:
        SpecError: an empty set, an item without ``=``, an unknown key or a mistyped value.
    """
    from trainmem.planner.sweep import field_name, parse_value

    out: dict[str, Any] = {}
    for item in (p for p in _SPLIT.split(text.strip()) if p):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError("set", f"{item!r} is not KEY=VALUE")
        name = key.strip().replace("-", "_")
        if name in ESTIMATE_KEYS:
            out[name] = value.strip()
        elif name == "lora_targets":
            from trainmem.cli_options import parse_lora_targets

            out[name] = parse_lora_targets(value.replace("+", ","))
        else:
            try:
                name = field_name(key)
            except SpecError:
                raise SpecError(
                    "set",
                    f"unknown key {key.strip()!r} in {text!r} (TrainingConfig fields, "
                    "engine, gpu, alloc-conf or fsdp)",
                ) from None
            out[name] = parse_value(name, value)
    if not out:
        raise SpecError("set", "empty; give KEY=VALUE, e.g. activation-checkpointing=full")
    return out


def compare_estimates(
    model: str,
    base: Any,
    sets: list[dict[str, Any]],
    *,
    gpu: str | None,
    engine: str,
    alloc_conf: str,
) -> list[MemoryEstimate]:
    """One estimate per option set: ``base`` (a TrainingConfig) with the set's fields replaced.

    Raises:
        SpecError: an invalid combination (TrainingConfig validates it), an unknown GPU/engine.
    """
    from trainmem.cli_options import zero_stage_from
    from trainmem.estimate import estimate

    out = []
    for overrides in sets:
        fields = {k: v for k, v in overrides.items() if k not in ESTIMATE_KEYS}
        if "fsdp" in overrides:
            fields["zero_stage"] = zero_stage_from(base.zero_stage, overrides["fsdp"])
        training = dataclasses.replace(base, **fields)
        out.append(
            estimate(
                model,
                training,
                gpu=overrides.get("gpu", gpu),
                engine=overrides.get("engine", engine),
                alloc_conf=overrides.get("alloc_conf", alloc_conf),
            )
        )
    return out


def compare_table(estimates: list[MemoryEstimate], labels: list[str]) -> Any:
    """Rich table: one row per configuration, GiB (2^30 bytes) per category and the peaks."""
    from rich.table import Table

    from trainmem.breakdown import BREAKDOWN_KEYS
    from trainmem.report.modules import gib_text

    names = ", ".join(sorted({e.model_name for e in estimates}))
    table = Table(
        title=f"{names}: peak of one training step per configuration",
        caption="GiB = 2^30 bytes; '--json' gives exact bytes",
    )
    table.add_column(
        "configuration", style="bold", no_wrap=True, min_width=max(len(x) for x in labels)
    )
    short = {
        "parameters": "params",
        "gradients": "grads",
        "optimizer_states": "optim",
        "activations": "acts",
        "temporary": "temp",
        "fragmentation": "frag",
        "cuda_context": "ctx",
    }
    for key in BREAKDOWN_KEYS:
        table.add_column(short[key], justify="right")
    for col in ("allocated", "reserved", "device"):
        table.add_column(col, justify="right")
    table.add_column("peak in")
    table.add_column("fits")
    for label, e in zip(labels, estimates, strict=True):
        b = e.breakdown
        fits = "-" if e.fits is None else ("[green]yes[/]" if e.fits else "[red]no[/]")
        table.add_row(
            label,
            *(gib_text(getattr(b, k)) for k in BREAKDOWN_KEYS),
            gib_text(b.allocated_bytes),
            gib_text(b.reserved_bytes),
            gib_text(b.device_total_bytes),
            e.peak_phase,
            fits,
        )
    return table


def register(app: typer.Typer) -> None:
    """Add ``compare`` to ``app`` (trainmem's CLI app)."""
    import json
    from typing import Annotated

    from trainmem.cli import clean_errors, console
    from trainmem.cli_options import (
        AllocConfOpt,
        EngineOpt,
        GpuOpt,
        JsonOpt,
        ModelArg,
        with_training_options,
    )
    from trainmem.specs.training import TrainingConfig

    SetOpt = Annotated[
        list[str],
        typer.Option(
            "--set",
            help="One configuration: KEY=VALUE pairs (separated by spaces or ';') applied to the "
            "common options, e.g. --set activation-checkpointing=full. Repeat for each "
            "configuration; keys are the estimate options (dashes) plus engine, gpu, alloc-conf.",
        ),
    ]
    PlotOpt = Annotated[
        str | None,
        typer.Option("--plot", help="Write a stacked bar chart of the configurations (.png/.svg)."),
    ]
    HtmlOpt = Annotated[
        str | None,
        typer.Option("--html", help="Write a self-contained HTML report of the configurations."),
    ]

    @app.command(name="compare")
    @clean_errors
    @with_training_options(set_option=False)
    def compare_cmd(
        model: ModelArg,
        set_: SetOpt,
        gpu: GpuOpt = None,
        engine: EngineOpt = "analytic",
        alloc_conf: AllocConfOpt = "",
        plot: PlotOpt = None,
        html: HtmlOpt = None,
        as_json: JsonOpt = False,
        *,
        training: TrainingConfig,
    ) -> None:
        """Estimates for several option sets side by side: a table and a stacked bar chart."""
        base = training
        sets = [parse_set(text) for text in set_]
        labels = [" ".join(text.split()) for text in set_]
        estimates = compare_estimates(
            model, base, sets, gpu=gpu, engine=engine, alloc_conf=alloc_conf
        )
        notes: list[str] = []
        if plot is not None:
            from trainmem.report.plots import plot_breakdown

            plot_breakdown(estimates, labels, plot)
            notes.append(f"comparison plot written to {plot}")
        if html is not None:
            from trainmem.report.html import write_html

            write_html(estimates[0], html, estimates[1:], labels=labels, alloc_conf=alloc_conf)
            notes.append(f"HTML report written to {html}")
        if as_json:
            rows = [
                {"label": label, "settings": settings, **e.to_dict()}
                for label, settings, e in zip(labels, sets, estimates, strict=True)
            ]
            print(json.dumps({"configurations": rows, "notes": notes}, indent=2, default=str))
            return
        console.print(compare_table(estimates, labels))
        for note in notes:
            console.print(f"note: {note}", highlight=False)
