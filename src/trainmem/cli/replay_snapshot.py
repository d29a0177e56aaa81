"""``trainmem replay-snapshot``: a real GPU's memory snapshot replayed through the allocator
simulator, real against simulated; added to the app by :func:`register`.

This module has no ``from __future__ import annotations``: typer reads the option annotations at
registration time, and the aliases are local names of :func:`register`.
"""

import typer


def register(app: typer.Typer) -> None:
    """Add ``replay-snapshot`` to ``app`` (trainmem's CLI app)."""
    import json
    from typing import Annotated

    from trainmem.cli.common import clean_errors, console
    from trainmem.cli.options import GpuOpt, JsonOpt

    SnapshotArg = Annotated[
        str,
        typer.Argument(
            help="A torch.cuda.memory._dump_snapshot pickle (read without running code)."
        ),
    ]
    ReplayAllocConfOpt = Annotated[
        str | None,
        typer.Option(
            "--alloc-conf",
            help="PYTORCH_CUDA_ALLOC_CONF for the simulator (default: the snapshot's own).",
        ),
    ]
    DeviceOpt = Annotated[
        int | None,
        typer.Option("--device", help="Device of the snapshot (default: the busiest one)."),
    ]

    @app.command(name="replay-snapshot")
    @clean_errors
    def replay_snapshot_cmd(
        snapshot_file: SnapshotArg,
        gpu: GpuOpt = None,
        alloc_conf: ReplayAllocConfOpt = None,
        device: DeviceOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Replay a real snapshot's trace through the simulator from the state it started in.

        Prints real against simulated peak allocated, peak reserved and segment count. The
        real peak allocated is the 512-byte-rounded requested peak (a snapshot does not record
        block sizes). With --gpu the simulator gets that GPU's capacity; without, the capacity
        is inferred from the trace's free-and-retry events (or unlimited)."""
        from trainmem.allocator.device import allocator_capacity_bytes
        from trainmem.allocator.snapshot import read_snapshot
        from trainmem.allocator.snapshot_replay import replay_snapshot
        from trainmem.errors import SpecError
        from trainmem.specs.hardware import get_gpu

        spec = get_gpu(gpu) if gpu is not None else None
        try:
            snapshot = read_snapshot(snapshot_file)
        except OSError as exc:
            raise SpecError(
                "snapshot_file", f"cannot read {snapshot_file}: {exc.strerror or exc}"
            ) from None
        traces = snapshot.get("device_traces", [])
        devices = {s.get("device", 0) for s in snapshot["segments"]} | set(range(len(traces)))
        if device is not None and device not in devices:
            raise SpecError("device", f"{device} is not in the snapshot (it has {sorted(devices)})")
        result = replay_snapshot(
            snapshot,
            device=device,
            alloc_conf=alloc_conf,
            capacity_bytes=allocator_capacity_bytes(spec) if spec is not None else None,
            device_total_bytes=spec.memory_bytes if spec is not None else None,
        )
        keys = ("peak_allocated_bytes", "peak_reserved_bytes", "num_segments")
        if as_json:
            out = {
                "real": {k: result.real[k] for k in keys},
                "simulated": {k: result.simulated[k] for k in keys},
                "device": result.device,
                "alloc_conf": result.alloc_conf,
                "capacity_bytes": result.capacity_bytes,
                "capacity_source": result.capacity_source,
                "reserved_relative_error": result.reserved_relative_error,
                "num_trace_entries": result.num_events,
                "first_address_divergence": result.first_address_divergence,
                "notes": result.notes,
            }
            print(json.dumps(out, indent=2))
            return
        from rich.table import Table

        from trainmem.units import format_bytes

        table = Table(
            title=f"{snapshot_file} (device {result.device}, {result.num_events} entries)"
        )
        table.add_column("")
        table.add_column("real GPU", justify="right")
        table.add_column("simulated", justify="right")
        labels = {
            "peak_allocated_bytes": "peak allocated",
            "peak_reserved_bytes": "peak reserved",
            "num_segments": "segments at the end",
        }
        for k in keys:
            real, sim = result.real[k], result.simulated[k]
            if k.endswith("_bytes"):
                table.add_row(labels[k], format_bytes(real), format_bytes(sim))
            else:
                table.add_row(labels[k], str(real), str(sim))
        console.print(table)
        err = result.reserved_relative_error
        conf = result.alloc_conf or "(default)"
        cap = (
            "unlimited"
            if result.capacity_bytes is None
            else f"{format_bytes(result.capacity_bytes)} ({result.capacity_source})"
        )
        console.print(
            f"reserved error {err:+.2%}; PYTORCH_CUDA_ALLOC_CONF {conf}; capacity {cap}"
            if err is not None
            else f"PYTORCH_CUDA_ALLOC_CONF {conf}; capacity {cap}",
            highlight=False,
            markup=False,
        )
        console.print(
            "real peak allocated = 512-byte-rounded requested peak (a lower bound)",
            highlight=False,
            markup=False,
        )
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, markup=False)
