"""Terminal tables (rich) for estimates, presets and GPUs. Sizes are shown in GiB (2^30 bytes)
and the tables say so; the JSON output keeps exact bytes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rich.table import Table

from trainmem.breakdown import BREAKDOWN_KEYS, MemoryEstimate
from trainmem.specs.hardware import GPUSpec
from trainmem.units import GB, gib_text

BREAKDOWN_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "temporary": "temporary buffers",
    "fragmentation": "fragmentation (reserved - allocated)",
    "cuda_context": "CUDA context + kernels",
}


def gib(n_bytes: int | float) -> str:
    """Bytes as GiB with two decimals (``"12.34"``; :func:`trainmem.units.gib_text`)."""
    return gib_text(n_bytes)


VERDICT_STYLE = {"fits": "green", "tight": "yellow", "does not fit": "red"}
"""Rich colour of each verdict (``trainmem.uncertainty.VERDICTS``)."""


def verdict_text(est: MemoryEstimate) -> str:
    """The verdict with its margin, as rich markup: ``fits (+3.21 GiB)``, ``tight (+0.88 GiB;
    the band's high end is above the capacity)``, ``does not fit (-4.10 GiB)`` or, when the
    simulated allocator runs out of memory, ``does not fit (out of memory in the caching
    allocator)``; "-" without a GPU."""
    if est.verdict is None:
        return "-"
    style = VERDICT_STYLE.get(est.verdict, "bold")
    margin = est.margin_bytes
    if margin is None:
        why = "out of memory in the caching allocator"
    else:
        why = f"{'+' if margin >= 0 else '-'}{gib(abs(margin))} GiB"
        if est.verdict == "tight":
            why += "; the uncertainty band's high end is above the capacity"
    return f"[{style}]{est.verdict}[/] ({why})"


def estimate_table(est: MemoryEstimate) -> Table:
    """Breakdown at the peak, then the three peak figures and the verdict."""
    total = est.breakdown.device_total_bytes
    table = Table(
        title=f"{est.model_name}: peak of one training step ({est.engine} engine)",
        caption="GiB = 2^30 bytes; '--json' gives exact bytes",
    )
    table.add_column("memory", style="bold")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for key in BREAKDOWN_KEYS:
        value = getattr(est.breakdown, key)
        share = f"{100 * value / total:.1f}%" if total else "-"
        table.add_row(BREAKDOWN_LABELS[key], gib(value), share)
    table.add_section()
    b = est.breakdown
    table.add_row("peak allocated (max_memory_allocated)", gib(b.allocated_bytes), "")
    if est.oom_message:  # a step that cannot run has no reserved figure (see the note)
        table.add_row("peak reserved (max_memory_reserved)", "OOM", "[red]out of memory[/]")
        table.add_row("device total (nvidia-smi)", "OOM", "")
    else:
        table.add_row("peak reserved (max_memory_reserved)", gib(b.reserved_bytes), "")
        table.add_row("device total (nvidia-smi)", gib(b.device_total_bytes), "")
    load = est.details.get("load_phase")
    if load:  # Note [The load phase]: its own peak, and the cache it leaves
        oom = load.get("oom")
        table.add_row("loading: peak allocated", gib(int(load["peak_allocated_bytes"])), "")
        reserved = load.get("max_memory_reserved")
        if oom or reserved is not None:
            cell = "OOM" if oom else gib(int(reserved))
            table.add_row(
                "loading: reserved (kept by the step)", cell, "[red]out of memory[/]" if oom else ""
            )
    if est.gpu_capacity_bytes is not None:
        table.add_row(f"{est.gpu_name} usable capacity", gib(est.gpu_capacity_bytes), "")
        table.add_row("verdict", "", verdict_text(est))
    host = est.details.get("host_memory")
    if host and est.config.get("offload", "none") != "none":
        table.add_section()
        table.add_row("host RAM (pinned / pageable), per node", *host_memory_cells(host))
    return table


def host_memory_cells(host: Mapping[str, object]) -> tuple[str, str]:
    """The host-RAM row's two cells from ``details["host_memory"]`` (bytes): the node total
    in GiB, and ``pinned / pageable GiB (per process x processes per node)``."""
    n = int(str(host["processes_per_node"]))
    pinned, pageable = int(str(host["pinned_bytes"])), int(str(host["pageable_bytes"]))
    per_process = int(str(host["per_process_bytes"]))
    plural = "es" if n != 1 else ""
    return (
        gib(int(str(host["per_node_bytes"]))),
        f"{gib(pinned * n)} / {gib(pageable * n)} ({gib(per_process)} x {n} process{plural})",
    )


_RANK_LABELS = (
    ("pipeline_stage", "stage"),
    ("stages", "stages"),
    ("num_layers", "layers"),
    ("micro_batches_in_flight", "in flight"),
    ("coordinates", "coordinates"),
    ("rank", "rank"),
)


def _cell(value: object) -> str:
    """A rank label as text: coordinates as ``pp=0 dp=0 cp=0 tp=1``, lists joined by commas."""
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def per_rank_table(est: MemoryEstimate) -> Table | None:
    """One row per distinct rank the engine reported (``details["per_rank"]``: first, last and
    most loaded pipeline stages, embedding / LM-head ranks): its labels, peak allocated and
    reserved (GiB) and the phase of its peak. ``None`` when there is a single such rank."""
    ranks = est.details.get("per_rank") or []
    if len(ranks) < 2:
        return None
    labels = [(k, title) for k, title in _RANK_LABELS if any(k in r for r in ranks)]
    table = Table(title="per rank (ranks that differ)", caption="GiB = 2^30 bytes")
    for _, title in labels:
        table.add_column(title)
    table.add_column("allocated GiB", justify="right")
    table.add_column("reserved GiB", justify="right")
    table.add_column("peak in")
    for r in ranks:
        reserved = r.get("reserved_bytes")
        table.add_row(
            *(_cell(r.get(k, "")) for k, _ in labels),
            gib(int(r.get("allocated_bytes", 0))),
            "OOM" if r.get("oom") else ("-" if reserved is None else gib(int(reserved))),
            str(r.get("peak_phase", "")),
        )
    return table


def config_line(est: MemoryEstimate) -> str:
    """The resolved settings on one line, so the user sees every default that was applied."""
    c = est.config
    parts = [
        f"{k}={c[k]}"
        for k in (
            "micro_batch_size",
            "seq_len",
            "resolution",
            "frames",
            "text_seq_len",
            "precision",
            "optimizer",
            "activation_checkpointing",
            "attention",
            "gradient_accumulation_steps",
        )
        if c.get(k) is not None
    ]
    if c.get("data_parallel_size", 1) > 1:
        parts += [f"data_parallel_size={c['data_parallel_size']}", f"zero_stage={c['zero_stage']}"]
    if c.get("offload", "none") != "none":
        parts.append(f"offload={c['offload']}")
    for key, default in (
        ("tensor_parallel_size", 1),
        ("sequence_parallel", False),
        ("pipeline_parallel_size", 1),
        ("context_parallel_size", 1),
        ("framework", "pytorch-amp"),
        ("chunked_cross_entropy", 0),
        ("optimizer_in_backward", False),
        ("activation_offloading", False),
        ("zero_grad_set_to_none", True),
        ("compile", False),
    ):
        if c.get(key, default) != default:
            parts.append(f"{key}={c[key]}")
    if c.get("lora_rank"):
        parts += [
            f"lora_rank={c['lora_rank']}",
            f"lora_targets={','.join(c['lora_targets'])}",
            f"quantize_base={c['quantize_base']}",
        ]
        if c.get("lora_variant", "lora") != "lora":
            parts.append(f"lora_variant={c['lora_variant']}")
        if c.get("lora_modules_to_save"):
            parts.append(f"lora_modules_to_save={','.join(c['lora_modules_to_save'])}")
    return (
        f"{est.num_parameters:,} parameters ({est.num_trainable_parameters:,} trainable); "
        + ", ".join(parts)
    )


def models_table(rows: Iterable[Mapping[str, object]]) -> Table:
    """Presets with family, the path that serves them, shape and parameter count."""
    table = Table(title="Shipped model presets (config files, no download)")
    keys = ("preset", "family", "path", "layers", "hidden", "heads", "context", "parameters")
    for col, justify in (
        ("preset", "left"),
        ("family", "left"),
        ("path", "left"),
        ("layers", "right"),
        ("hidden", "right"),
        ("heads (q/kv)", "right"),
        ("context", "right"),
        ("parameters", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*(str(r[k]) for k in keys))
    return table


def gpus_table(gpus: Iterable[GPUSpec]) -> Table:
    """The GPU catalog: usable capacity in GiB and GB, nominal size, datasheet."""
    table = Table(
        title="GPU catalog",
        caption="usable = what torch.cuda.get_device_properties().total_memory reports",
    )
    table.add_column("name")
    table.add_column("usable GiB", justify="right")
    table.add_column("usable GB", justify="right")
    table.add_column("nominal")
    table.add_column("compute capability")
    table.add_column("datasheet")
    for g in gpus:
        table.add_row(
            g.name,
            gib(g.memory_bytes),
            f"{g.memory_bytes / GB:,.2f}",
            g.nominal,
            g.compute_capability,
            g.datasheet,
        )
    return table


def formulas_table(rows: Iterable[tuple[str, int | None, str]]) -> Table:
    """Rules of thumb next to trainmem: (name, total bytes or None, what it counts)."""
    table = Table(title="What the published formulas predict", caption="GiB = 2^30 bytes")
    table.add_column("formula")
    table.add_column("GiB", justify="right")
    table.add_column("counts")
    for name, total, what in rows:
        table.add_row(name, "-" if total is None else gib(total), what)
    return table
