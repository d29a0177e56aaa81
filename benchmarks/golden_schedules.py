"""Golden step schedules: every mechanism of the analytic engine on a small grid, recorded as
hashes of the expanded allocation stream (issue 25, "record first").

A refactor of the analytic step (issue 25: a base autograd order plus one transform per
mechanism) must reproduce every schedule byte for byte; a deliberate change of the memory model
is re-recorded in its own commit that says why:

    python benchmarks/golden_schedules.py --write     # rewrites tests/golden/schedules.json

``tests/golden/test_golden_schedules.py`` recomputes them in the test suite. Each entry holds
the configuration, the peak allocated bytes and phase, and one SHA-256 per rank over that
rank's expanded events (action, size, category, phase, module, stream; block ids renumbered in
order of first appearance, so only the stream's shape and bytes count), or the refusal's text.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from trainmem.errors import TrainmemError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "schedules.json"

_BASE: dict[str, Any] = {"micro_batch_size": 2, "seq_len": 256}
_DP: dict[str, Any] = {"data_parallel_size": 4}
#: name -> (model, TrainingConfig fields); small models so the whole grid runs in seconds
GRID: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2 fp32 eager": ("gpt2", {"precision": "32-true", "attention": "eager"}),
    "gpt2 bf16-mixed": ("gpt2", {}),
    "gpt2 bf16-true sgd": ("gpt2", {"precision": "bf16-true", "optimizer": "sgd"}),
    "llama ac none": ("llama-3.2-1b", {}),
    "llama ac selective": ("llama-3.2-1b", {"activation_checkpointing": "selective"}),
    "llama ac full": ("llama-3.2-1b", {"activation_checkpointing": "full"}),
    "llama fused adamw": ("llama-3.2-1b", {"optimizer_implementation": "fused"}),
    "llama for-loop adamw": ("llama-3.2-1b", {"optimizer_implementation": "for-loop"}),
    "llama adafactor": ("llama-3.2-1b", {"optimizer": "adafactor"}),
    "llama adamw-8bit": ("llama-3.2-1b", {"optimizer": "adamw-8bit"}),
    "llama paged-adamw-8bit": ("llama-3.2-1b", {"optimizer": "paged-adamw-8bit"}),
    "llama lion": ("llama-3.2-1b", {"optimizer": "lion"}),
    "llama grad accumulation 4": ("llama-3.2-1b", {"gradient_accumulation_steps": 4}),
    "llama optimizer in backward": ("llama-3.2-1b", {"optimizer_in_backward": True}),
    "llama keep logits": ("llama-3.2-1b", {"keep_logits": True}),
    "llama zero-grad keep": ("llama-3.2-1b", {"zero_grad_set_to_none": False}),
    "llama chunked ce": ("llama-3.2-1b", {"chunked_cross_entropy": 8}),
    "llama compile": ("llama-3.2-1b", {"compile": True}),
    "llama activation offloading": (
        "llama-3.2-1b",
        {"activation_offloading": True, "activation_checkpointing": "full"},
    ),
    "llama lora": ("llama-3.2-1b", {"lora_rank": 16}),
    "llama qlora nf4": ("llama-3.2-1b", {"lora_rank": 16, "quantize_base": "nf4"}),
    "llama qlora int8": ("llama-3.2-1b", {"lora_rank": 8, "quantize_base": "int8"}),
    "llama ddp": ("llama-3.2-1b", {**_DP}),
    "llama zero1": ("llama-3.2-1b", {**_DP, "zero_stage": 1}),
    "llama zero2": ("llama-3.2-1b", {**_DP, "zero_stage": 2}),
    "llama zero3": ("llama-3.2-1b", {**_DP, "zero_stage": 3}),
    "llama zero3 offload": ("llama-3.2-1b", {**_DP, "zero_stage": 3, "offload": "optimizer"}),
    "llama deepspeed zero2": ("llama-3.2-1b", {**_DP, "zero_stage": 2, "framework": "deepspeed"}),
    "llama deepspeed zero3": ("llama-3.2-1b", {**_DP, "zero_stage": 3, "framework": "deepspeed"}),
    "llama accelerate-fsdp": (
        "llama-3.2-1b",
        {**_DP, "zero_stage": 3, "framework": "accelerate-fsdp"},
    ),
    "llama fsdp2": ("llama-3.2-1b", {**_DP, "zero_stage": 3, "framework": "fsdp2"}),
    # the release pinned: the load dtype follows it (trainmem/specs/load_dtype.py)
    "llama hf-trainer": (
        "llama-3.2-1b",
        {"framework": "hf-trainer", "transformers_version": "4.57"},
    ),
    "llama hf-trainer transformers 5": (
        "llama-3.2-1b",
        {"framework": "hf-trainer", "transformers_version": "5.0"},
    ),
    "llama torchtune": ("llama-3.2-1b", {"framework": "torchtune"}),
    "llama litgpt": ("llama-3.2-1b", {"framework": "litgpt"}),
    "llama megatron tp2": ("llama-3.2-1b", {"framework": "megatron", "tensor_parallel_size": 2}),
    "llama tp2 sp": ("llama-3.2-1b", {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "llama cp2": ("llama-3.2-1b", {**_DP, "zero_stage": 3, "context_parallel_size": 2}),
    "llama pp2 1f1b": (
        "llama-3.2-1b",
        {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4},
    ),
    "llama pp2 gpipe": (
        "llama-3.2-1b",
        {
            "pipeline_parallel_size": 2,
            "gradient_accumulation_steps": 4,
            "pipeline_schedule": "gpipe",
        },
    ),
    "llama fp8 fsdp2": (
        "llama-3.2-1b",
        {**_DP, "zero_stage": 3, "framework": "fsdp2", "precision": "fp8-mixed"},
    ),
    "t5 encoder-decoder": ("t5-base", {"target_seq_len": 64}),
    "bert eager": ("bert-large-uncased", {"attention": "eager"}),
}


def _events_hash(timeline: Any) -> str:
    ids: dict[int, int] = {}
    digest = hashlib.sha256()
    for e in timeline:
        bid = ids.setdefault(e.block_id, len(ids))
        fields = (e.action, bid, e.size_bytes, str(e.category), str(e.phase), e.module, e.stream)
        digest.update(repr(fields).encode())
    return digest.hexdigest()


def record(name: str) -> dict[str, Any]:
    """One grid entry as stored: config, peak, per-rank hashes, or the refusal."""
    model, fields = GRID[name]
    entry: dict[str, Any] = {"model": model, "settings": fields}
    try:
        training = TrainingConfig(**{**_BASE, **fields})
        est = estimate(model, training, engine="analytic", simulate_allocator=False)
    except TrainmemError as exc:
        entry["refused"] = str(exc)
        return entry
    entry["peak_allocated_bytes"] = est.breakdown.allocated_bytes
    entry["peak_phase"] = est.peak_phase
    entry["ranks"] = [_events_hash(s.expand()) for s in est.schedules]
    return entry


def main(argv: list[str]) -> int:
    recorded = {name: record(name) for name in GRID}
    if "--write" in argv:
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {len(recorded)} schedules to {GOLDEN}")
        return 0
    stored = json.loads(GOLDEN.read_text(encoding="utf-8"))
    changed = sorted(n for n in recorded if recorded[n] != stored.get(n))
    print(f"{len(recorded) - len(changed)}/{len(recorded)} schedules as recorded")
    for name in changed:
        print(f"  changed: {name}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
