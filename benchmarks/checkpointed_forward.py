"""A checkpointed layer's forward and recompute, the formulas' step schedule against the generic
path's trace (same model, same configuration; issue 24, helper ckfwd).

Under full checkpointing the formulas' forward of a layer makes every block the layer drops
(``LayerPlan.dropped``) live at once and frees them after the MLP; the real forward runs inside
torch's checkpoint without grad (torch utils/checkpoint.py: reentrant
``CheckpointFunction.forward`` under ``torch.no_grad()``, non-reentrant ``_checkpoint_hook``
packing nothing), so each intermediate is freed when transformers' code drops its last reference
(modeling_llama.py ``LlamaDecoderLayer.forward``: the norm's output until the attention returns,
``residual`` until the layer's end; ``LlamaMLP.forward``: gate, act and up until the product).
The generic path records that order from the model's own code on fake tensors. Per
configuration this prints, for each engine: peak allocated and peak reserved (the replay); the
second layer's forward and its backward (recompute included) as the most bytes live above the
layer's start; and where the replay's reserved grew (the layers' forward, the layers' backward,
the rest), the last step's. ``--rows`` runs dev-2 rows (their amended arguments, as
``validate.py --dev2`` does) on both engines: the row's metric, peak allocated and reserved,
about a minute a row. Usage::

    PYTHONPATH=src python benchmarks/checkpointed_forward.py [--seq-len 2048]
    PYTHONPATH=src python benchmarks/checkpointed_forward.py --rows GT119,GT123,GT128
"""

from __future__ import annotations

import argparse
import logging
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainmem.allocator.caching import CachingAllocatorSim
from trainmem.allocator.config import AllocatorConfig
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import AllocEvent

AGREEMENT = Path(__file__).resolve().parents[1] / "tests" / "models" / "agreement"
MODEL = AGREEMENT / "llama_h2048.json"
MiB = 2**20
#: name -> TrainingConfig fields besides micro-batch size, sequence length and checkpointing
CONFIGS: dict[str, dict[str, Any]] = {
    "bf16-mixed": {},
    "lora r16": {"lora_rank": 16},
    "qlora nf4": {"lora_rank": 16, "quantize_base": "nf4"},
    "fsdp-qlora 1 gpu": {
        "lora_rank": 16,
        "quantize_base": "nf4",
        "framework": "fsdp-qlora",
        "zero_stage": 3,
    },
}
_LAYER = re.compile(r"layers\.(\d+)")


def _last_step(events: Iterable[AllocEvent]) -> tuple[list[AllocEvent], int]:
    """All events and the index where the last step's forward starts."""
    out = list(events)
    starts = [
        i
        for i, e in enumerate(out)
        if e.phase == "forward" and (i == 0 or out[i - 1].phase != "forward")
    ]
    return out, starts[-1]


def layer_peaks(events: Iterable[AllocEvent], layer: int = 1) -> dict[str, int]:
    """Per phase (forward, backward) of the last step: the most bytes live above the live bytes
    just before the layer's first event of that phase, over the layer's events."""
    out, first = _last_step(events)
    live, sizes = 0, {}
    base: dict[str, int] = {}
    peak: dict[str, int] = {}
    for i, e in enumerate(out):
        before = live
        if e.action == "alloc":
            sizes[e.block_id] = e.size_bytes
            live += e.size_bytes
        else:
            live -= sizes.pop(e.block_id)
        m = _LAYER.search(e.module)
        if i < first or m is None or int(m.group(1)) != layer:
            continue
        if e.phase in ("forward", "backward"):
            base.setdefault(e.phase, before)
            peak[e.phase] = max(peak.get(e.phase, 0), live - base[e.phase])
    return peak


def reserved_growth(events: Iterable[AllocEvent]) -> dict[str, int]:
    """Where the replay's reserved bytes first reach a new high (torch's default allocator
    settings, no capacity), split by the layers' forward, the layers' backward, the rest."""
    sim = CachingAllocatorSim(None, AllocatorConfig.from_string(""))
    reserved = sim.stats.reserved_bytes[0]
    handles: dict[int, int] = {}
    grown: dict[str, int] = {}
    high = 0
    for e in events:
        if e.action == "alloc":
            handles[e.block_id] = sim.malloc(e.size_bytes, e.stream)
        else:
            sim.free(handles.pop(e.block_id))
        if reserved.current > high:
            inside = _LAYER.search(e.module) is not None and e.phase in ("forward", "backward")
            key = f"layers' {e.phase}" if inside else "rest"
            grown[key] = grown.get(key, 0) + reserved.current - high
            high = reserved.current
    return grown


def dev2_rows(ids: list[str]) -> None:
    """Dev-2 rows on both engines: measured, each engine's figure on the row's metric (signed
    error), peak allocated and peak reserved, GB."""
    from validate import _invoke_estimate, cli_args, load_dev2, metric_of

    rows = {row.id: row for row in load_dev2()}
    print("| row | metric | measured | engine | predicted | allocated | reserved |")
    print("|---|---|---:|---|---:|---:|---:|")
    for rid in ids:
        row = rows[rid]
        for engine in ("analytic", "generic"):
            answer, error = _invoke_estimate([*cli_args(row), "--engine", engine])
            if answer is None:
                print(f"| {rid} | {row.metric} | {row.measured / 1e9:.2f} | {engine} | {error} |")
                continue
            value = metric_of(answer, row.metric, row.rank) or 0
            peak = answer["peak"]
            print(
                f"| {rid} | {row.metric} | {row.measured / 1e9:.2f} | {engine} "
                f"| {value / 1e9:.2f} ({(value - row.measured) / row.measured:+.1%}) "
                f"| {peak['allocated_bytes'] / 1e9:.2f} | {peak['reserved_bytes'] / 1e9:.2f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rows", default="", help="dev-2 row ids, comma-separated")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    if args.rows:
        dev2_rows(args.rows.split(","))
        return 0
    print(f"{MODEL.name}, b{args.micro_batch_size} s{args.seq_len}, full checkpointing; MiB")
    print("| config | engine | allocated | reserved | layer 1 forward | layer 1 backward "
          "| reserved grew in |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---|")
    for name, settings in CONFIGS.items():
        training = TrainingConfig(
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
            activation_checkpointing="full",
            **settings,
        )
        for engine in ("analytic", "generic"):
            est = estimate(str(MODEL), training, engine=engine)
            events = list(est.timeline.events)
            peaks = layer_peaks(events)
            grown = sorted(reserved_growth(events).items())
            where = ", ".join(f"{k} {v / MiB:.0f}" for k, v in grown)
            b = est.breakdown
            print(
                f"| {name} | {engine} | {b.allocated_bytes / MiB:.1f} "
                f"| {b.reserved_bytes / MiB:.1f} "
                f"| +{peaks.get('forward', 0) / MiB:.1f} | +{peaks.get('backward', 0) / MiB:.1f} "
                f"| {where} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
