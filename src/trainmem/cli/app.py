"""Command-line interface (typer + rich): ``trainmem estimate | models | gpus | formulas``.

Every error trainmem raises on purpose (:class:`~trainmem.errors.TrainmemError`) is printed as
one line ``error: <field>: <message>`` on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
import warnings
from typing import TYPE_CHECKING, Annotated

import typer

from trainmem.cli import coercion
from trainmem.cli.common import clean_errors, console, progress
from trainmem.cli.options import (
    AllocConfOpt,
    EngineOpt,
    GpuOpt,
    JsonOpt,
    ModelArg,
    with_training_options,
)
from trainmem.errors import SpecError
from trainmem.specs.assumptions import assumptions_line
from trainmem.specs.hardware import GPUS, resolve_gpu
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig

if TYPE_CHECKING:
    from trainmem.breakdown import MemoryEstimate

__all__ = ["app", "main"]

app = typer.Typer(
    help="How much GPU memory does training this model need, where does it go, and what fits?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def untried_fixes(t: TrainingConfig) -> list[str]:
    """The flags that usually make a run fit, leaving out what the run already does and what
    this configuration refuses (TrainingConfig's own checks, as ``trainmem estimate`` would
    meet them: no LoRA beside prefix tuning)."""
    out: list[tuple[str, dict[str, object]]] = []
    if t.activation_checkpointing != "full":
        out.append(("--activation-checkpointing full", {"activation_checkpointing": "full"}))
    if t.micro_batch_size > 1:
        out.append(("a smaller --micro-batch-size", {"micro_batch_size": 1}))
    if t.lora_rank == 0:
        out.append(("--lora-rank 16", {"lora_rank": 16}))
    elif t.quantize_base == "none":
        out.append(("--quantize-base nf4", {"quantize_base": "nf4"}))
    eight_bit = OPTIMIZER_TABLE[t.optimizer].eight_bit
    if eight_bit is not None and t.lora_rank == 0:
        out.append((f"--optimizer {eight_bit}", {"optimizer": eight_bit}))
    if t.data_parallel_size == 1 or t.zero_stage < 3:
        more: dict[str, object] = {
            "data_parallel_size": max(t.data_parallel_size, 2),
            "zero_stage": 3,
        }
        out.append(("more GPUs (--data-parallel-size N --zero-stage 3)", more))
    return [flag for flag, changes in out if _accepted(t, changes)]


def _accepted(t: TrainingConfig, changes: dict[str, object]) -> bool:
    from trainmem.specs.training import derived

    try:
        derived(t, **changes)
    except SpecError:
        return False
    return True


def _print_version(value: bool) -> None:
    if value:
        from trainmem import __version__

        print(f"trainmem {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print trainmem's version and exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """How much GPU memory does training this model need, where does it go, and what fits?"""


SnapshotOpt = Annotated[
    str | None,
    typer.Option(
        "--snapshot",
        help="Write the simulated step as a PyTorch memory snapshot "
        "(open it at https://pytorch.org/memory_viz).",
        rich_help_panel="Reports",
    ),
]
ModulesOpt = Annotated[
    int,
    typer.Option(
        "--modules",
        help="Also print the top N modules by activations and at the peak.",
        rich_help_panel="Reports",
    ),
]
UncertaintyOpt = Annotated[
    bool,
    typer.Option(
        "--uncertainty",
        help="Low / expected / high from the benchmark's error spread.",
        rich_help_panel="Reports",
    ),
]
PlotOpt = Annotated[
    str | None,
    typer.Option(
        "--plot",
        help="Write the timeline of the step as a picture (.png or .svg).",
        rich_help_panel="Reports",
    ),
]
HtmlOpt = Annotated[
    str | None,
    typer.Option(
        "--html", help="Write a self-contained HTML report (offline).", rich_help_panel="Reports"
    ),
]

GpusPerNodeOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus-per-node",
        help="GPU processes per node, for the host RAM of an offloaded run "
        "(default: min(GPUs of the run, 8)).",
        rich_help_panel="Reports",
    ),
]


def print_estimate(est: MemoryEstimate, as_json: bool) -> None:
    """Table (with the resolved settings and where the peak falls) or JSON on stdout."""
    from trainmem.report.table import config_line, estimate_table, per_rank_table

    if as_json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
        return
    console.print(estimate_table(est))
    ranks = per_rank_table(est)
    if ranks is not None:
        console.print(ranks)
    console.print(config_line(est), highlight=False)
    console.print(assumptions_line(est.details["assumed"]), highlight=False, markup=False)
    console.print(
        f"peak falls in the {est.peak_phase}: {est.peak_reason}", highlight=False, markup=False
    )
    for note in est.notes:  # a warning says so itself ("warning: ...")
        line = note if note.startswith("warning: ") else f"note: {note}"
        console.print(line, highlight=False, markup=False)


@app.command(name="estimate")
@clean_errors
@with_training_options()
def estimate_cmd(
    model: ModelArg,
    gpu: GpuOpt = None,
    engine: EngineOpt = "auto",
    alloc_conf: AllocConfOpt = "",
    snapshot: SnapshotOpt = None,
    plot: PlotOpt = None,
    html: HtmlOpt = None,
    uncertainty: UncertaintyOpt = False,
    modules: ModulesOpt = 0,
    gpus_per_node: GpusPerNodeOpt = None,
    as_json: JsonOpt = False,
    *,
    training: TrainingConfig,
    config_notes: list[str],
    framework_chosen: bool,
) -> None:
    """Peak GPU memory of one training step per GPU, broken down, with a verdict for --gpu."""
    if modules < 0:
        raise SpecError("modules", f"must be a non-negative number of rows, got {modules}")
    from trainmem.estimate import estimate, resolve_model  # Note [--help imports no engine]
    from trainmem.report.compare import check_output_paths

    check_output_paths(snapshot=snapshot, plot=plot, html=html)
    with progress(f"estimating {model} (a traced model takes a while)"):
        est = estimate(model, training, gpu=gpu, engine=engine, alloc_conf=alloc_conf)
    est.notes.extend(config_notes)
    if gpus_per_node is not None:
        set_gpus_per_node(est, gpus_per_node)
    if snapshot is not None:
        write_step_snapshot(est, gpu, alloc_conf, snapshot)
        est.notes.append(f"memory snapshot written to {snapshot}")
    if plot is not None or html is not None:
        from trainmem.report.compare import emit_reports

        est.notes.extend(emit_reports(est, plot=plot, html=html, alloc_conf=alloc_conf))
    if uncertainty:
        add_uncertainty(est)
    if est.engine == "analytic" and not framework_chosen:  # only for an assumed framework
        from trainmem.planner.sensitivity import framework_note

        note = framework_note(resolve_model(model), training, resolve_gpu(gpu))
        if note:
            est.notes.append(note)
    if est.fits is False and est.engine == "analytic":  # `fit` runs the formulas only
        est.notes.append(
            f"does not fit {est.gpu_name}: `trainmem fit {model} --gpu {gpu} [same options]` "
            "ranks the changes that make it fit"
        )
    elif est.fits is False:
        note = (
            f"does not fit {est.gpu_name}: `trainmem fit {model} --gpu {gpu} [same options]` "
            f"traces the changes that make it fit on the {est.engine} path (one traced step "
            "per candidate)"
        )
        by_hand = untried_fixes(training)
        if by_hand:
            note += "; by hand, re-run `trainmem estimate` with " + ", or ".join(by_hand)
        est.notes.append(note)
    if modules and as_json:
        from trainmem.report.modules import activation_rows, peak_rows

        est.details["modules"] = {
            "activations": activation_rows(est, top=modules),
            "at_peak": peak_rows(est, top=modules),
        }
    print_estimate(est, as_json)
    if modules and not as_json:
        from trainmem.report.modules import module_tables

        for table in module_tables(est, top=modules):
            console.print(table)


def set_gpus_per_node(est: MemoryEstimate, gpus_per_node: int) -> None:
    """Recount the node's host RAM (``details["host_memory"]``) for ``gpus_per_node`` GPU
    processes per node, or note that the option has no effect (no offload)."""
    from trainmem.analytic.host_memory import HostMemory

    host = est.details.get("host_memory")
    if host is None:
        HostMemory().on_node(gpus_per_node)  # still refuse a bad value
        est.notes.append(
            "warning: --gpus-per-node only counts the host RAM of an offloaded run "
            "(--offload); it has no effect here"
        )
        return
    est.details["host_memory"] = HostMemory.from_details(host).on_node(gpus_per_node).as_details()


def add_uncertainty(est: MemoryEstimate) -> None:
    """Attach the low / expected / high band of the device total (trainmem.uncertainty) to the
    estimate's details and notes."""
    from trainmem.report.table import gib
    from trainmem.uncertainty import uncertainty_band

    band = uncertainty_band(est, metric="device_total")
    est.details["uncertainty"] = band
    least = ", ".join(str(k) for k in band.get("least_sure_of", [])[:3]) or "-"
    est.notes.append(
        f"device total {gib(band['low'])} / {gib(band['expected'])} / {gib(band['high'])} GiB "
        f"(low / expected / high, from the benchmark's errors); least sure of: {least}"
    )


def write_step_snapshot(est: MemoryEstimate, gpu: str | None, alloc_conf: str, path: str) -> None:
    """Write the estimate's replayed step (whichever engine made it) as a PyTorch snapshot."""
    from trainmem.allocator.snapshot import write_snapshot
    from trainmem.estimate import replay_estimate, resolve_gpu

    result = replay_estimate(est, gpu=resolve_gpu(gpu), alloc_conf=alloc_conf, record_history=True)
    assert result.snapshot is not None  # record_history=True always fills it
    try:
        write_snapshot(path, result.snapshot)
    except OSError as exc:
        raise SpecError("snapshot", f"cannot write {path}: {exc.strerror or exc}") from exc


@app.command(name="compare-snapshot")
@clean_errors
@with_training_options()
def compare_snapshot_cmd(
    snapshot_file: Annotated[str, typer.Argument(help="torch.cuda.memory._dump_snapshot file.")],
    model: ModelArg,
    gpu: GpuOpt = None,
    alloc_conf: AllocConfOpt = "",
    *,
    training: TrainingConfig,
) -> None:
    """Compare a snapshot you recorded on a GPU with trainmem's prediction for the same run.

    The snapshot is read with a restricted unpickler (plain containers and numbers only)."""
    from trainmem.allocator.stream_compare import compare_snapshot
    from trainmem.estimate import estimate, replay_estimate, resolve_gpu

    est = estimate(model, training, gpu=gpu, alloc_conf=alloc_conf)
    prediction = replay_estimate(est, gpu=resolve_gpu(gpu), alloc_conf=alloc_conf)
    try:
        report = compare_snapshot(snapshot_file, prediction, timeline=est.timeline)
    except OSError as exc:
        raise SpecError(
            "snapshot_file", f"cannot read {snapshot_file}: {exc.strerror or exc}"
        ) from exc
    print(json.dumps(report, indent=2, default=str))


@app.command(name="formulas")
@clean_errors
@with_training_options()
def formulas_cmd(
    model: ModelArg,
    as_json: JsonOpt = False,
    *,
    training: TrainingConfig,
) -> None:
    """The published rules of thumb next to trainmem's own estimate, for one configuration."""
    from trainmem.analytic.formulas import rules_of_thumb
    from trainmem.estimate import estimate, formula_model
    from trainmem.report.table import formulas_table

    spec = formula_model(model, "formulas", "sets rules of thumb beside the analytic formulas")
    est = estimate(spec, training)
    rows = rules_of_thumb(spec, training)
    rows.append(
        (
            "trainmem (analytic), peak allocated",
            est.breakdown.allocated_bytes,
            "every tensor alive at the peak: " + est.peak_reason,
        )
    )
    if as_json:
        print(
            json.dumps(
                [{"formula": n, "total_bytes": t, "counts": w} for n, t, w in rows], indent=2
            )
        )
        return
    console.print(formulas_table(rows))
    console.print(
        f"{spec.name}: micro-batch {training.micro_batch_size}, seq_len {training.seq_len}, "
        f"{training.precision}, {training.optimizer}",
        highlight=False,
    )


@app.command(name="models")
@clean_errors
def models_cmd(as_json: JsonOpt = False) -> None:
    """The shipped model presets (real HF / diffusers config files, no download): family,
    parameter count and the path that serves them (``analytic`` formulas or the ``generic``
    traced path)."""
    from trainmem.report.table import models_table
    from trainmem.specs.hf import list_presets, preset_index

    index = preset_index()
    rows = [_preset_row(name, index[name]) for name in list_presets()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    console.print(models_table(rows))


def _preset_row(name: str, entry: dict[str, str | int | None]) -> dict[str, object]:
    """One row of ``trainmem models``: a formula family's shape and count from its ModelSpec;
    any other preset's family (``model_type`` or diffusers ``_class_name``) and the count
    recorded in the index (``num_parameters``, tested against the meta-built model)."""
    from trainmem.analytic.params import num_parameters
    from trainmem.specs.hf import SUPPORTED_MODEL_TYPES, load_hf_config, load_model_spec

    config = load_hf_config(name)
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        spec = load_model_spec(name)
        count = num_parameters(spec)
        return {
            "preset": name,
            "family": spec.model_type,
            "model_type": spec.model_type,
            "path": "analytic",
            "layers": spec.num_layers,
            "hidden": spec.hidden_size,
            "heads": f"{spec.num_heads}/{spec.num_kv_heads}",
            "context": spec.max_position_embeddings,
            "parameters": f"{count:,}",
            "num_parameters": count,
        }
    recorded = entry.get("num_parameters")
    count_or_none = recorded if isinstance(recorded, int) else None
    return {
        "preset": name,
        "family": str(model_type or config.get("_class_name") or "?"),
        "model_type": model_type if isinstance(model_type, str) else None,
        "path": "generic",
        "layers": "-",
        "hidden": "-",
        "heads": "-",
        "context": "-",
        "parameters": "-" if count_or_none is None else f"{count_or_none:,}",
        "num_parameters": count_or_none,
    }


@app.command(name="gpus")
@clean_errors
def gpus_cmd(as_json: JsonOpt = False) -> None:
    """The GPU catalog: usable capacity, nominal size, datasheet."""
    from trainmem.report.table import gpus_table

    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": g.name,
                        "capacity_bytes": g.memory_bytes,
                        "nominal": g.nominal,
                        "compute_capability": g.compute_capability,
                        "datasheet": g.datasheet,
                    }
                    for g in GPUS.values()
                ],
                indent=2,
            )
        )
        return
    console.print(gpus_table(GPUS.values()))


def _register_commands() -> None:
    """Add ``plan``, ``fit``, ``sweep`` (:mod:`trainmem.cli.planner`), ``compare``
    (:mod:`trainmem.cli.compare`), ``replay-snapshot`` (:mod:`trainmem.cli.replay_snapshot`)
    and ``serve`` (:mod:`trainmem.cli.serve`)."""
    from trainmem.cli.compare import register as register_compare
    from trainmem.cli.planner import register as register_planner
    from trainmem.cli.replay_snapshot import register as register_replay_snapshot
    from trainmem.cli.serve import register as register_serve

    register_planner(app)
    register_compare(app)
    register_replay_snapshot(app)
    register_serve(app)


_register_commands()
coercion.install()  # Note [Plain options skip pydantic]


def main() -> None:
    """Console-script entry point: the app with only the command the command line names
    (Note [Only the invoked command is built]), the objects made so far frozen.

    Note [The CLI's start-up objects frozen]
        By the time the console script calls this, importing the CLI (typer, rich, the
        training options) has made about 24,000 objects the collector tracks that live as
        long as the process: modules, classes, functions, option tables. CPython's cyclic
        collector would walk them again at every older-generation pass the command's own
        work triggers (its imports of the engines, the planner's estimates). ``gc.freeze()``
        moves them to the permanent generation, which no pass walks (Python's gc docs:
        "ignore them in all the future collections"); nothing is freed or kept differently,
        the command just skips re-examining objects that were never garbage: about 1 % of
        ``trainmem plan``'s CPU instructions (issue 28). Only the console script (and
        ``python -m trainmem``) freezes: a program that imports ``trainmem.cli`` keeps its
        collector as it set it.
    """
    gc.freeze()
    quiet_library_deprecations()
    only_invoked(sys.argv[1:])()


def quiet_library_deprecations() -> None:
    """Drop FutureWarnings in the console script's process, unless the user gave ``-W`` /
    ``PYTHONWARNINGS`` (``sys.warnoptions``).

    Note [Library deprecations kept off the CLI's output]
        The libraries the traced paths drive warn each other of their own API changes as
        FutureWarning: transformers 5.24 on peft's prefix tuning (``past_key_values`` "is
        deprecated and will be removed in version 5.40.0 for Qwen2ForCausalLM.forward",
        ``is_gradient_checkpointing`` "is deprecated"), printed with their source lines after
        every traced prompt-learning estimate (session 28's ChatGLM P-Tuning v2 paths). They
        say nothing about the user's run or its memory; trainmem raises none itself. As
        ``gc.freeze`` above, only the console script does this: a program that imports
        trainmem keeps its own warning filters.
    """
    if not sys.warnoptions:
        warnings.filterwarnings("ignore", category=FutureWarning)


def only_invoked(args: list[str]) -> typer.Typer:
    """``app`` with only the command ``args`` names first, else ``app`` itself (no command,
    an option such as ``--help`` first, or an unknown name: typer answers as ever).

    Note [Only the invoked command is built]
        ``app()`` builds the click command of every registered command (each from its
        function's signature: ~50 options for ``estimate``, ``plan``, ``fit`` and ``sweep``),
        ~14 ms of CPU of which the one command run needs ~2 ms. The console script runs a
        shallow copy of ``app`` that keeps its root callback (``--version``) and the one
        command named, so the command parses, helps and fails exactly as under ``app``
        (``tests/test_cli_coercion.py`` compares both); ``app`` itself, which the tests
        import, is unchanged.
    """
    from typer.main import get_command_name

    if not args or args[0].startswith("-"):
        return app
    keep = [
        info
        for info in app.registered_commands
        if info.callback is not None
        and (info.name or get_command_name(info.callback.__name__)) == args[0]
    ]
    if len(keep) != 1:
        return app
    narrow = copy.copy(app)
    narrow.registered_commands = keep
    return narrow


if __name__ == "__main__":  # pragma: no cover
    main()
