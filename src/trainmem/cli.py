"""Command-line interface (typer + rich): ``trainmem estimate | models | gpus | formulas``.

Every error trainmem raises on purpose (:class:`~trainmem.errors.TrainmemError`) is printed as
one line ``error: <field>: <message>`` on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import TrainmemError
from trainmem.estimate import ENGINES, default_seq_len, estimate, resolve_model
from trainmem.errors import SpecError
from trainmem.specs.hardware import GPUS
from trainmem.specs.training import (
    ACTIVATION_CHECKPOINTING,
    ATTENTIONS,
    FSDP_TO_ZERO,
    LORA_TARGETS,
    OFFLOADS,
    OPTIMIZER_IMPLEMENTATIONS,
    OPTIMIZERS,
    PRECISIONS,
    FRAMEWORKS,
    PIPELINE_SCHEDULES,
    QUANTIZE_BASE,
    TrainingConfig,
)

app = typer.Typer(
    help="How much GPU memory does training this model need, where does it go, and what fits?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_stdout_probe = Console()
# Piped output (CI logs, files) gets room for the tables instead of rich's 80-column default.
console = _stdout_probe if _stdout_probe.is_terminal else Console(width=160)

F = TypeVar("F", bound=Callable[..., Any])


def clean_errors(func: F) -> F:
    """Turn trainmem's own errors into one line on stderr and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (TrainmemError, ImportError) as exc:
            # plain print: one line whatever the terminal width (rich would wrap it)
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _choices(values: tuple[str, ...]) -> str:
    return "|".join(values)


ModelArg = Annotated[
    str, typer.Argument(help="Preset name (see `trainmem models`), or a HF config.json / folder.")
]
MicroBatch = Annotated[
    int, typer.Option("--micro-batch-size", "-b", help="Sequences per GPU per step.")
]
SeqLen = Annotated[
    int | None,
    typer.Option("--seq-len", "-s", help="Tokens per sequence [default: model context, max 4096]."),
]
PrecisionOpt = Annotated[
    str, typer.Option("--precision", "-p", help=f"Lightning precision: {_choices(PRECISIONS)}.")
]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", "-o", help=_choices(OPTIMIZERS))]
OptimizerImplOpt = Annotated[
    str,
    typer.Option("--optimizer-implementation", help=_choices(OPTIMIZER_IMPLEMENTATIONS)),
]
CheckpointingOpt = Annotated[
    str,
    typer.Option("--activation-checkpointing", "-c", help=_choices(ACTIVATION_CHECKPOINTING)),
]
AttentionOpt = Annotated[str, typer.Option("--attention", help=_choices(ATTENTIONS))]
AccumulationOpt = Annotated[
    int, typer.Option("--gradient-accumulation-steps", help="Micro-batches per optimizer step.")
]
DropoutOpt = Annotated[
    bool, typer.Option("--dropout/--no-dropout", help="Apply the model's dropout.")
]
GpuOpt = Annotated[
    str | None, typer.Option("--gpu", "-g", help="GPU for the verdict (see `trainmem gpus`).")
]
EngineOpt = Annotated[str, typer.Option("--engine", "-e", help=_choices(ENGINES))]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print JSON (exact bytes) instead of a table.")
]
DataParallelOpt = Annotated[
    int, typer.Option("--data-parallel-size", help="Ranks the model states are sharded over.")
]
ZeroStageOpt = Annotated[int, typer.Option("--zero-stage", help="ZeRO stage 0|1|2|3.")]
FsdpOpt = Annotated[
    str | None,
    typer.Option(
        "--fsdp",
        help="full-shard|shard-grad-op|hybrid-shard|no-shard (sets the ZeRO stage it shards like)",
    ),
]
OffloadOpt = Annotated[str, typer.Option("--offload", help=_choices(OFFLOADS))]
LoraRankOpt = Annotated[int, typer.Option("--lora-rank", help="LoRA rank r (0: full fine-tuning).")]
LoraAlphaOpt = Annotated[
    float, typer.Option("--lora-alpha", help="LoRA scaling (no effect on memory).")
]
LoraTargetsOpt = Annotated[
    str,
    typer.Option("--lora-targets", help=",".join(LORA_TARGETS) + ",lm_head or all-linear"),
]
LoraDropoutOpt = Annotated[float, typer.Option("--lora-dropout", help="peft lora_dropout.")]
AllocConfOpt = Annotated[
    str,
    typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for the allocator simulator."),
]
SnapshotOpt = Annotated[
    str | None,
    typer.Option("--snapshot", help="Write the simulated step as a PyTorch memory snapshot "
                 "(open it at https://pytorch.org/memory_viz)."),
]
TensorParallelOpt = Annotated[
    int, typer.Option("--tensor-parallel-size", help="Megatron tensor parallelism t.")
]
SequenceParallelOpt = Annotated[
    bool, typer.Option("--sequence-parallel", help="Megatron sequence parallelism (needs t > 1).")
]
PipelineParallelOpt = Annotated[
    int, typer.Option("--pipeline-parallel-size", help="Pipeline stages p.")
]
PipelineScheduleOpt = Annotated[
    str, typer.Option("--pipeline-schedule", help=_choices(PIPELINE_SCHEDULES))
]
ContextParallelOpt = Annotated[
    int, typer.Option("--context-parallel-size", help="Sequence split over this many ranks.")
]
FrameworkOpt = Annotated[
    str, typer.Option("--framework", help=_choices(FRAMEWORKS) + " (bytes per parameter, loss)")
]
ChunkedLossOpt = Annotated[
    int, typer.Option("--chunked-cross-entropy", help="Loss in N chunks of tokens (0: whole).")
]
OptimizerInBackwardOpt = Annotated[
    bool, typer.Option("--optimizer-in-backward", help="Step and free each gradient in backward.")
]
ActivationOffloadOpt = Annotated[
    bool, typer.Option("--activation-offloading", help="Saved activations offloaded to CPU.")
]
CompileOpt = Annotated[
    bool, typer.Option("--compile", help="torch.compile: fused pointwise chains (see docs).")
]
SetToNoneOpt = Annotated[
    bool,
    typer.Option(
        "--zero-grad-set-to-none/--zero-grad-keep",
        help="zero_grad(set_to_none=...); keep = torch < 2.0 behaviour (gradients stay allocated).",
    ),
]
DeepSpeedConfigOpt = Annotated[
    str | None, typer.Option("--deepspeed-config", help="Read settings from a ds_config.json.")
]
AccelerateConfigOpt = Annotated[
    str | None, typer.Option("--accelerate-config", help="Read settings from an accelerate config.")
]
ModulesOpt = Annotated[
    int,
    typer.Option("--modules", help="Also print the top N modules by activations and at the peak."),
]
UncertaintyOpt = Annotated[
    bool,
    typer.Option("--uncertainty", help="Low / expected / high from the benchmark's error spread."),
]
PlotOpt = Annotated[
    str | None,
    typer.Option("--plot", help="Write the timeline of the step as a picture (.png or .svg)."),
]
HtmlOpt = Annotated[
    str | None, typer.Option("--html", help="Write a self-contained HTML report (offline).")
]
QuantizeOpt = Annotated[
    str, typer.Option("--quantize-base", help=_choices(QUANTIZE_BASE) + " (QLoRA and kin)")
]


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """``"q,v"`` -> ("q", "v"); ``all-linear`` -> every layer linear (peft's ``all-linear``)."""
    if text.strip() == "all-linear":
        return LORA_TARGETS
    targets = tuple(part.strip() for part in text.split(",") if part.strip())
    if not targets:
        raise SpecError(
            "lora_targets", "empty; allowed: " + ",".join(LORA_TARGETS) + ",lm_head or all-linear"
        )
    return targets


def zero_stage_from(zero_stage: int, fsdp: str | None) -> int:
    """The ZeRO stage, from ``--zero-stage`` or the FSDP strategy that shards like it
    (``hybrid-shard`` shards like ``full-shard`` within its shard group)."""
    if fsdp is None:
        return zero_stage
    if fsdp == "hybrid-shard":
        return 3
    if fsdp not in FSDP_TO_ZERO:
        allowed = ", ".join((*FSDP_TO_ZERO, "hybrid-shard"))
        raise SpecError("fsdp", f"unknown value {fsdp!r}; allowed: {allowed}")
    return FSDP_TO_ZERO[fsdp]


def training_config(
    model: str,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    optimizer_implementation: str = "foreach",
    activation_checkpointing: str = "none",
    attention: str = "sdpa",
    gradient_accumulation_steps: int = 1,
    dropout: bool = True,
    **parallel_and_peft: Any,
) -> TrainingConfig:
    """A validated TrainingConfig from CLI options; seq_len defaults to the model's context.
    ``parallel_and_peft`` holds the other TrainingConfig fields (ZeRO, LoRA...)."""
    spec = resolve_model(model)
    return TrainingConfig(
        **parallel_and_peft,
        micro_batch_size=micro_batch_size,
        seq_len=default_seq_len(spec) if seq_len is None else seq_len,
        precision=precision,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        optimizer_implementation=optimizer_implementation,  # type: ignore[arg-type]
        activation_checkpointing=activation_checkpointing,  # type: ignore[arg-type]
        attention=attention,  # type: ignore[arg-type]
        gradient_accumulation_steps=gradient_accumulation_steps,
        dropout=dropout,
    )


def with_config_files(
    settings: dict[str, Any], deepspeed_config: str | None, accelerate_config: str | None
) -> dict[str, Any]:
    """Fill TrainingConfig settings from a DeepSpeed / accelerate config file where the command
    line left them at their defaults (an explicit flag wins over the file)."""
    from dataclasses import fields

    from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config

    from_files: dict[str, Any] = {}
    if accelerate_config:
        from_files.update(read_accelerate_config(accelerate_config))
    if deepspeed_config:
        from_files.update(read_deepspeed_config(deepspeed_config))
    defaults = {f.name: f.default for f in fields(TrainingConfig)}
    out = dict(settings)
    for key, value in from_files.items():
        if key not in out or out[key] == defaults.get(key):
            out[key] = value
    return out


def print_estimate(est: MemoryEstimate, as_json: bool) -> None:
    """Table (with the resolved settings and where the peak falls) or JSON on stdout."""
    from trainmem.report.table import config_line, estimate_table

    if as_json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
        return
    console.print(estimate_table(est))
    console.print(config_line(est), highlight=False)
    console.print(f"peak falls in the {est.peak_phase}: {est.peak_reason}", highlight=False)
    for note in est.notes:
        console.print(f"note: {note}", highlight=False)


@app.command(name="estimate")
@clean_errors
def estimate_cmd(
    model: ModelArg,
    micro_batch_size: MicroBatch = 1,
    seq_len: SeqLen = None,
    precision: PrecisionOpt = "bf16-mixed",
    optimizer: OptimizerOpt = "adamw",
    optimizer_implementation: OptimizerImplOpt = "foreach",
    activation_checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = "sdpa",
    gradient_accumulation_steps: AccumulationOpt = 1,
    dropout: DropoutOpt = True,
    data_parallel_size: DataParallelOpt = 1,
    zero_stage: ZeroStageOpt = 0,
    fsdp: FsdpOpt = None,
    offload: OffloadOpt = "none",
    lora_rank: LoraRankOpt = 0,
    lora_alpha: LoraAlphaOpt = 16.0,
    lora_targets: LoraTargetsOpt = "q,v",
    lora_dropout: LoraDropoutOpt = 0.0,
    quantize_base: QuantizeOpt = "none",
    tensor_parallel_size: TensorParallelOpt = 1,
    sequence_parallel: SequenceParallelOpt = False,
    pipeline_parallel_size: PipelineParallelOpt = 1,
    pipeline_schedule: PipelineScheduleOpt = "1f1b",
    context_parallel_size: ContextParallelOpt = 1,
    framework: FrameworkOpt = "pytorch-amp",
    chunked_cross_entropy: ChunkedLossOpt = 0,
    optimizer_in_backward: OptimizerInBackwardOpt = False,
    activation_offloading: ActivationOffloadOpt = False,
    zero_grad_set_to_none: SetToNoneOpt = True,
    compile: CompileOpt = False,
    deepspeed_config: DeepSpeedConfigOpt = None,
    accelerate_config: AccelerateConfigOpt = None,
    gpu: GpuOpt = None,
    engine: EngineOpt = "analytic",
    alloc_conf: AllocConfOpt = "",
    snapshot: SnapshotOpt = None,
    plot: PlotOpt = None,
    html: HtmlOpt = None,
    uncertainty: UncertaintyOpt = False,
    modules: ModulesOpt = 0,
    as_json: JsonOpt = False,
) -> None:
    """Peak GPU memory of one training step per GPU, broken down, with a verdict for --gpu."""
    del lora_alpha  # scales the adapter update, not the memory
    settings = with_config_files(
        {
            "micro_batch_size": micro_batch_size,
            "precision": precision,
            "optimizer": optimizer,
            "optimizer_implementation": optimizer_implementation,
            "activation_checkpointing": activation_checkpointing,
            "attention": attention,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "dropout": dropout,
            "data_parallel_size": data_parallel_size,
            "zero_stage": zero_stage_from(zero_stage, fsdp),
            "offload": offload,
            "lora_rank": lora_rank,
            "lora_targets": parse_lora_targets(lora_targets),
            "lora_dropout": lora_dropout,
            "quantize_base": quantize_base,
            "tensor_parallel_size": tensor_parallel_size,
            "sequence_parallel": sequence_parallel,
            "pipeline_parallel_size": pipeline_parallel_size,
            "pipeline_schedule": pipeline_schedule,
            "context_parallel_size": context_parallel_size,
            "framework": framework,
            "chunked_cross_entropy": chunked_cross_entropy,
            "optimizer_in_backward": optimizer_in_backward,
            "activation_offloading": activation_offloading,
            "zero_grad_set_to_none": zero_grad_set_to_none,
            "compile": compile,
        },
        deepspeed_config,
        accelerate_config,
    )
    training = training_config(model, seq_len=seq_len, **settings)
    est = estimate(model, training, gpu=gpu, engine=engine, alloc_conf=alloc_conf)
    if training.compile:
        est.notes.append(
            "--compile: only inductor's fused pointwise chains (GELU formula, RMSNorm) are "
            "modelled; other recomputation by its partitioner is not, so this is an upper bound"
        )
    if snapshot is not None:
        write_step_snapshot(model, training, gpu, alloc_conf, snapshot)
        est.notes.append(f"memory snapshot written to {snapshot}")
    if plot is not None or html is not None:
        from trainmem.report.commands import emit_reports

        est.notes.extend(emit_reports(est, plot=plot, html=html, alloc_conf=alloc_conf))
    if uncertainty:
        add_uncertainty(est)
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


def write_step_snapshot(
    model: str, training: TrainingConfig, gpu: str | None, alloc_conf: str, path: str
) -> None:
    """Replay the analytic step with history and write it as a PyTorch snapshot pickle."""
    from trainmem.allocator.snapshot import write_snapshot
    from trainmem.analytic.engine import replay_step
    from trainmem.estimate import resolve_gpu

    result = replay_step(
        resolve_model(model), training, gpu=resolve_gpu(gpu), alloc_conf=alloc_conf,
        record_history=True,
    )
    try:
        write_snapshot(path, result.snapshot)
    except OSError as exc:
        raise SpecError("snapshot", f"cannot write {path}: {exc.strerror or exc}") from exc


@app.command(name="compare-snapshot")
@clean_errors
def compare_snapshot_cmd(
    snapshot_file: Annotated[str, typer.Argument(help="torch.cuda.memory._dump_snapshot file.")],
    model: ModelArg,
    micro_batch_size: MicroBatch = 1,
    seq_len: SeqLen = None,
    precision: PrecisionOpt = "bf16-mixed",
    optimizer: OptimizerOpt = "adamw",
    optimizer_implementation: OptimizerImplOpt = "foreach",
    activation_checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = "sdpa",
    gpu: GpuOpt = None,
    alloc_conf: AllocConfOpt = "",
) -> None:
    """Compare a snapshot you recorded on a GPU with trainmem's prediction for the same run.

    The snapshot is read with a restricted unpickler (plain containers and numbers only)."""
    from trainmem.allocator.snapshot import compare_snapshot
    from trainmem.analytic.engine import replay_step
    from trainmem.estimate import resolve_gpu

    training = training_config(
        model, micro_batch_size, seq_len, precision, optimizer, optimizer_implementation,
        activation_checkpointing, attention, 1, True,
    )
    prediction = replay_step(resolve_model(model), training, gpu=resolve_gpu(gpu),
                             alloc_conf=alloc_conf)
    try:
        report = compare_snapshot(snapshot_file, prediction)
    except OSError as exc:
        raise SpecError("snapshot_file", f"cannot read {snapshot_file}: "
                        f"{exc.strerror or exc}") from exc
    print(json.dumps(report, indent=2, default=str))


@app.command(name="formulas")
@clean_errors
def formulas_cmd(
    model: ModelArg,
    micro_batch_size: MicroBatch = 1,
    seq_len: SeqLen = None,
    precision: PrecisionOpt = "bf16-mixed",
    optimizer: OptimizerOpt = "adamw",
    activation_checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = "sdpa",
    as_json: JsonOpt = False,
) -> None:
    """The published rules of thumb next to trainmem's own estimate, for one configuration."""
    from trainmem.analytic.formulas import rules_of_thumb
    from trainmem.report.table import formulas_table

    training = training_config(
        model,
        micro_batch_size,
        seq_len,
        precision,
        optimizer,
        "foreach",
        activation_checkpointing,
        attention,
        1,
        True,
    )
    spec = resolve_model(model)
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
    """The shipped model presets (real HF config files, no download) with parameter counts."""
    from trainmem.analytic.params import num_parameters
    from trainmem.report.table import models_table
    from trainmem.specs.hf import list_presets, load_model_spec

    rows = []
    for name in list_presets():
        spec = load_model_spec(name)
        rows.append(
            {
                "preset": name,
                "model_type": spec.model_type,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "heads": f"{spec.num_heads}/{spec.num_kv_heads}",
                "context": spec.max_position_embeddings,
                "parameters": f"{num_parameters(spec):,}",
                "num_parameters": num_parameters(spec),
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    console.print(models_table(rows))


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


def _register_planner() -> None:
    """Add ``plan``, ``fit`` and ``sweep`` (trainmem.planner.commands)."""
    from trainmem.planner.commands import register

    register(app)


_register_planner()


def _register_report() -> None:
    """Add ``compare`` (trainmem.report.commands)."""
    from trainmem.report.commands import register

    register(app)


_register_report()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
