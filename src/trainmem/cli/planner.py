"""CLI commands ``plan``, ``fit`` and ``sweep``, added to trainmem's typer app by
:func:`register` (:mod:`trainmem.cli.app` calls ``register(app)``).

This module deliberately has no ``from __future__ import annotations``: typer reads the option
annotations at registration time, and the aliases are local names of :func:`register`.
"""

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

from trainmem.specs.training import TrainingConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trainmem.breakdown import MemoryEstimate
    from trainmem.planner.fixes import Fix
    from trainmem.planner.search import PlanResult
    from trainmem.specs.hardware import GPUSpec


def register(app: typer.Typer) -> None:
    """Add ``plan``, ``fit`` and ``sweep`` to ``app`` (trainmem's CLI app)."""
    from typing import Annotated

    from trainmem.cli.common import clean_errors, console
    from trainmem.cli.options import GpuOpt, JsonOpt, ModelArg, with_training_options
    from trainmem.errors import SpecError
    from trainmem.specs.grid import SWEEPABLE, parse_over

    def traced_only(model: str) -> bool:
        # Note [--help imports no engine]: the planner loads only when a command runs
        from trainmem.planner.traced import traced_only as traced

        return traced(model)

    def traced_run(model: str, training: TrainingConfig) -> bool:
        from trainmem.planner.traced import traced_run as traced

        return traced(model, training)

    MultipleOf = Annotated[
        int | None,
        typer.Option(
            "--seq-len-multiple-of",
            help="Granularity of the planned seq_len, tokens; 1 for the exact longest "
            "length. [default: 8, the padding that puts 16-bit matmuls on Tensor Cores]",
            show_default=False,
        ),
    ]
    Limit = Annotated[
        int | None,
        typer.Option(
            "--limit",
            help="At most this many fixes. [default: 10; 3 for a model only the generic path "
            "traces, each candidate being a traced step]",
            show_default=False,
        ),
    ]
    Over = Annotated[
        list[str],
        typer.Option(
            "--over",
            help="FIELD=V1,V2,... (repeatable; tuple values joined by +, e.g. "
            "lora-targets=q+v,q+k+v+o); fields: "
            + ", ".join(n.replace("_", "-") for n in SWEEPABLE),
        ),
    ]
    AllGpus = Annotated[
        bool,
        typer.Option(
            "--gpus",
            help="Every catalog GPU: the largest micro-batch size and, for a sharded run, the "
            "fewest GPUs of each kind that fit.",
        ),
    ]
    FormatOpt = Annotated[str, typer.Option("--format", "-f", help="table|csv|json")]
    SimulateOpt = Annotated[
        bool,
        typer.Option(
            "--simulate-allocator/--no-simulate-allocator",
            help="Replay every row through the allocator simulator (slow; fragmentation).",
        ),
    ]

    @app.command(name="plan")
    @clean_errors
    @with_training_options()
    def plan_cmd(
        model: ModelArg,
        gpu: GpuOpt = None,
        seq_len_multiple_of: MultipleOf = None,
        all_gpus: AllGpus = False,
        as_json: JsonOpt = False,
        *,
        training: TrainingConfig,
    ) -> None:
        """The largest micro-batch size (at --seq-len) and the longest sequence length (at
        --micro-batch-size) that fit --gpu, with the margin left; with --gpus, every catalog
        GPU (and the fewest of each that fit a sharded run)."""
        # Note [--help imports no engine]: the planner and its engines load only to run
        from trainmem.errors import UnsupportedError
        from trainmem.estimate import formula_model
        from trainmem.planner.evaluate import require_gpu
        from trainmem.planner.search import (
            SEQ_LEN_MULTIPLE_OF,
            max_micro_batch_size,
            max_seq_len,
            plan_gpus,
        )
        from trainmem.report import render

        if all_gpus:
            if traced_only(model):
                raise UnsupportedError(
                    "--gpus plans every catalog GPU with the formulas, which do not model this "
                    "family; `trainmem plan MODEL --gpu NAME` traces the micro-batch search on "
                    "one GPU"
                )
            if gpu is not None:
                raise SpecError("gpus", "--gpus lists every catalog GPU; drop --gpu")
            _no_seq_len_search(seq_len_multiple_of, "--gpus plans the micro-batch size")
            gpu_plan = plan_gpus(formula_model(model, "plan"), training)
            if as_json:
                print(render.gpus_json(gpu_plan))
                return
            console.print(render.gpus_table(gpu_plan))
            console.print(
                f"at: micro-batch search at seq_len={training.seq_len}"
                + (
                    f"; fewest GPUs = data_parallel_size in 1, 2, 4, ..., 1024 at "
                    f"micro_batch_size={training.micro_batch_size}"
                    if gpu_plan.sharded
                    else ""
                )
                + f"; {training.precision}, {training.optimizer}, checkpointing "
                f"{training.activation_checkpointing}, framework {training.framework}",
                highlight=False,
            )
            if gpu_plan.assumption:
                console.print(f"assumed: {gpu_plan.assumption}", highlight=False)
            return
        gpu_spec = require_gpu(gpu)
        if traced_only(model):
            _no_seq_len_search(seq_len_multiple_of, "the generic path plans the micro-batch size")
            _plan_traced(model, gpu_spec, training, as_json)
            return
        spec = formula_model(model, "plan")
        results = [max_micro_batch_size(spec, training, gpu_spec)]
        multiple_of = SEQ_LEN_MULTIPLE_OF if seq_len_multiple_of is None else seq_len_multiple_of
        if spec.architecture != "vision-encoder":
            results.append(max_seq_len(spec, training, gpu_spec, multiple_of=multiple_of))
        else:
            _no_seq_len_search(seq_len_multiple_of, f"{spec.name} is a vision encoder")
        if as_json:
            print(render.plan_json(spec.name, results))
            return
        console.print(render.plan_table(spec.name, results))
        console.print(
            f"fixed: seq_len={training.seq_len} for the micro-batch search, "
            + (
                f"micro_batch_size={training.micro_batch_size} for the seq_len search"
                + (f" (multiples of {multiple_of} tokens)" if multiple_of > 1 else "")
                if len(results) > 1
                else "no seq_len search (a vision encoder's sequence is its image's patches: "
                "--resolution)"
            )
            + "; "
            f"{training.precision}, {training.optimizer} ({training.step_implementation}), "
            f"checkpointing {training.activation_checkpointing}, attention {training.attention}",
            highlight=False,
        )
        _print_assumed(results)
        for r in results:
            console.print(f"{r.dimension}: {r.reason}", highlight=False)

    @app.command(name="fit")
    @clean_errors
    @with_training_options()
    def fit_cmd(
        model: ModelArg,
        gpu: GpuOpt = None,
        limit: Limit = None,
        as_json: JsonOpt = False,
        *,
        training: TrainingConfig,
    ) -> None:
        """Whether the run fits --gpu and, if not, ranked changes that make it fit, each with
        the memory it saves and what it costs."""
        from trainmem.estimate import formula_model
        from trainmem.planner.evaluate import fits, require_gpu, simulated_estimate
        from trainmem.planner.fixes import fixes
        from trainmem.report import render

        gpu_spec = require_gpu(gpu)
        if limit is not None and limit < 1:  # before any engine runs, on either path
            raise SpecError("limit", f"must be a positive number of fixes, got {limit}")
        if traced_run(model, training):
            base, found = _fit_traced(model, gpu_spec, training, limit)
            name = base.model_name
        else:
            spec = formula_model(model, "fit")
            name = spec.name
            base = simulated_estimate(spec, training, gpu_spec)
            found = (
                []
                if fits(base)
                else fixes(
                    spec, training, gpu_spec, limit=10 if limit is None else limit, simulated=base
                )
            )
        if as_json:
            print(render.fixes_json(base, found))
            return
        total, cap = base.breakdown.device_total_bytes, gpu_spec.memory_bytes
        head = (
            f"{name} needs {render.gib(total)} GiB at the peak ({base.peak_phase}) "
            f"on {gpu_spec.name} ({render.gib(cap)} GiB usable): "
        )
        if fits(base):
            spare = f"{render.gib(cap - total)} GiB to spare"
            tail = (
                "tight: the uncertainty band's high end is above the capacity; leave headroom"
                if base.verdict == "tight"
                else "nothing to change"
            )
            console.print(head + f"fits with {spare}; {tail}.", highlight=False)
            _print_assumed([base])
            return
        b = base.breakdown
        if base.oom_message and b.allocated_bytes + b.cuda_context <= cap:
            # the device total (allocated + context) fits: the OOM is fragmentation's
            head = (
                f"{name} runs out of memory in the {base.peak_phase} on {gpu_spec.name} "
                f"({render.gib(cap)} GiB usable): {render.gib(b.allocated_bytes)} GiB allocated "
                f"plus the CUDA context ({render.gib(b.cuda_context)} GiB) would fit, but the "
                "simulated caching allocator finds no free block large enough (fragmentation): "
            )
        console.print(head + "does not fit.", highlight=False)
        _print_assumed([base])
        if not found:
            from trainmem.planner.traced import beyond_any_fix

            why = beyond_any_fix(base, gpu_spec)
            console.print(
                f"no change can make it fit: {why}."
                if why
                else "no change in the planner's table, nor any two of them, makes it fit.",
                highlight=False,
            )
            return
        console.print(render.fixes_table(base, found))
        console.print("to check one, paste its command:", highlight=False)
        for i, fix in enumerate(found, 1):
            line = f"{i}. {estimate_command(model, gpu_spec.name, fix.training)}"
            console.print(line, highlight=False, markup=False, soft_wrap=True)

    @app.command(name="sweep")
    @clean_errors
    @with_training_options()
    def sweep_cmd(
        model: ModelArg,
        over: Over,
        gpu: GpuOpt = None,
        output_format: FormatOpt = "table",
        simulate_allocator: SimulateOpt = False,
        *,
        training: TrainingConfig,
    ) -> None:
        """Estimates over a grid (--over FIELD=V1,V2,... repeated), with the verdict (fits /
        tight / does not fit) for --gpu, as a table, CSV or JSON (exact bytes)."""
        from trainmem.estimate import formula_model
        from trainmem.planner.sweep import sweep
        from trainmem.report import render

        if output_format not in ("table", "csv", "json"):
            raise SpecError("format", f"unknown value {output_format!r}; allowed: table, csv, json")
        grid = parse_over(over)
        traced = traced_only(model)
        name = model if traced else formula_model(model, "sweep").name
        rows = sweep(
            model,
            training,
            gpu,
            grid,
            simulate_allocator=simulate_allocator,
            on_point=_point_progress(model) if traced else None,
        )
        if output_format == "csv":
            print(render.sweep_csv(rows), end="")
        elif output_format == "json":
            print(render.sweep_json(rows))
        else:
            title = f"{name}" + (f" on {gpu}" if gpu else "") + ": sweep"
            console.print(render.sweep_table(title, rows, simulated=simulate_allocator or traced))


def _progress(model: str, base: TrainingConfig) -> "Callable[[TrainingConfig], None]":
    """A line on stderr per traced candidate: the settings it changes from the run's."""
    from trainmem.planner.fixes import changed_settings

    def say(training: TrainingConfig) -> None:
        changed = changed_settings(base, training)
        what = ", ".join(f"{k}={v[1]}" for k, v in changed.items()) or "as given"
        print(f"tracing {model}: {what}", file=sys.stderr, flush=True)

    return say


def _point_progress(model: str) -> "Callable[[dict[str, object]], None]":
    """A line on stderr per traced grid point."""

    def say(settings: dict[str, object]) -> None:
        what = ", ".join(f"{k}={v}" for k, v in settings.items())
        print(f"tracing {model}: {what}", file=sys.stderr, flush=True)

    return say


def _no_seq_len_search(seq_len_multiple_of: int | None, why: str) -> None:
    """Warn (on stderr, so that ``--json`` stays JSON) that an explicit
    ``--seq-len-multiple-of`` has no effect: this plan has no sequence-length search."""
    if seq_len_multiple_of is not None:
        print(
            f"warning: --seq-len-multiple-of has no effect here: {why}, no sequence length",
            file=sys.stderr,
            flush=True,
        )


def _fit_traced(
    model: str, gpu: "GPUSpec", training: TrainingConfig, limit: int | None
) -> "tuple[MemoryEstimate, list[Fix]]":
    """``trainmem fit`` on the generic path (:func:`trainmem.planner.traced.traced_fit`)."""
    from trainmem.planner.traced import traced_fit

    return traced_fit(
        model,
        training,
        gpu,
        limit=3 if limit is None else limit,
        on_probe=_progress(model, training),
    )


def _plan_traced(model: str, gpu: "GPUSpec", training: TrainingConfig, as_json: bool) -> None:
    """``trainmem plan`` on the generic path: the largest micro-batch size, traced."""
    from trainmem.cli.common import console
    from trainmem.planner.traced import traced_max_micro_batch_size, traced_probe
    from trainmem.report import render

    result = traced_max_micro_batch_size(
        training, gpu, traced_probe(model, gpu, _progress(model, training))
    )
    name = (result.estimate or result.next_estimate or _never()).model_name
    if as_json:
        print(render.plan_json(name, [result]))
        return
    console.print(render.plan_table(name, [result]))
    console.print(
        f"fixed: {training.precision}, {training.optimizer}, checkpointing "
        f"{training.activation_checkpointing}; each candidate traced on the generic path (the "
        "formulas do not model this family); the sequence-length search needs the formulas",
        highlight=False,
    )
    _print_assumed([result])
    console.print(f"{result.dimension}: {result.reason}", highlight=False)


def _print_assumed(results: "Sequence[PlanResult | MemoryEstimate]") -> None:
    """The ``assumed:`` line ``trainmem estimate`` prints (framework, loop, versions), of the
    first estimate among ``results`` (a plan's, or the first value that does not fit)."""
    from trainmem.breakdown import MemoryEstimate
    from trainmem.cli.common import console
    from trainmem.estimate import assumed_of
    from trainmem.specs.assumptions import assumptions_line

    for r in results:
        for est in (r,) if isinstance(r, MemoryEstimate) else (r.estimate, r.next_estimate):
            if est is not None:
                line = assumptions_line(assumed_of(est))
                console.print(line, highlight=False, markup=False)
                return


def _never() -> "MemoryEstimate":  # pragma: no cover - a plan always probes micro-batch 1
    raise AssertionError("a traced plan without an estimate")


def estimate_command(model_arg: str, gpu: str, training: TrainingConfig) -> str:
    """The ``trainmem estimate`` command of a configuration, every setting that differs from
    the default spelled out (the web page's own :func:`trainmem.web.form.cli_command`)."""
    from dataclasses import asdict

    from trainmem.web.form import cli_command, default_values

    values = {**default_values(), **asdict(training), "model": model_arg, "gpu": gpu}
    return cli_command(values)
