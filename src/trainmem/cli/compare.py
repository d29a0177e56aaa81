"""``trainmem compare``: several option sets side by side, added to the app by :func:`register`.

This module has no ``from __future__ import annotations``: typer reads the option annotations at
registration time, and the aliases are local names of :func:`register`.
"""

import typer

from trainmem.cli.options import model_spec_or_none, parse_set
from trainmem.report.compare import check_output_paths, compare_estimates, compare_table


def register(app: typer.Typer) -> None:
    """Add ``compare`` to ``app`` (trainmem's CLI app)."""
    import json
    from typing import Annotated

    from trainmem.cli.common import clean_errors, console
    from trainmem.cli.options import (
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
        engine: EngineOpt = "auto",
        alloc_conf: AllocConfOpt = "",
        plot: PlotOpt = None,
        html: HtmlOpt = None,
        as_json: JsonOpt = False,
        *,
        training: TrainingConfig,
        config_notes: list[str],
    ) -> None:
        """Estimates for several option sets side by side: a table and a stacked bar chart."""
        check_output_paths(plot=plot, html=html)
        base = training
        spec = model_spec_or_none(model)
        sets = [parse_set(text, spec, model) for text in set_]
        labels = [" ".join(text.split()) for text in set_]
        estimates = compare_estimates(
            model, base, sets, gpu=gpu, engine=engine, alloc_conf=alloc_conf
        )
        notes = list(config_notes)
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
        for i, e in enumerate(estimates, 1):  # a setting a configuration ignores, as estimate
            for note in e.notes:  # says it (the JSON rows carry every note)
                if note.startswith("warning: "):
                    console.print(f"#{i}: {note}", highlight=False, markup=False)
        for note in notes:
            console.print(f"note: {note}", highlight=False)
