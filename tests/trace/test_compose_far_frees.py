"""The composition of a step whose layers free tensors three layers away (issue 26: FSDP1's rate
limiter, Note [FSDP1's gathers three layers on] in trainmem/trace/generic.py).

Expected streams are written directly for the full depth from the mechanism's rule (layer k's
forward gather freed by layer k + 3's unshard, the backward's by layer k - 3's, the last three
pending to the pass's end, layer 0 prefetching nothing in the backward), not taken from the
composition: the composition of the 7-layer stream must give the N-layer stream event for
event. The slow test traces the 8-layer Qwen2 formula config under accelerate's FSDP1 both ways
(the composed cut model and the whole model, independent executions) and compares the streams.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.errors import CompositionError
from trainmem.timeline import AllocEvent, Phase, Timeline
from trainmem.trace.blocks import Run, kept_units
from trainmem.trace.compose import compose

ACT, GATHER, PREFETCH, GRAD, ROOT = 1000, 300, 310, 50, 7  # bytes, distinct on purpose
A, W, G = MemoryCategory.ACTIVATION, MemoryCategory.PARAMETER, MemoryCategory.GRADIENT


def _fsdp1_like(n: int) -> Timeline:
    """An ``n``-layer step with FSDP1's limiter pattern (sizes above), written out directly."""
    ev: list[AllocEvent] = []
    ids: dict[str, int] = {}

    def alloc(name: str, size: int, cat: MemoryCategory, phase: Phase, module: str, s: int = 0):
        ids[name] = len(ids)
        ev.append(AllocEvent("alloc", ids[name], size, cat, phase, module, s))

    def free(name: str, size: int, cat: MemoryCategory, phase: Phase, module: str, s: int = 0):
        ev.append(AllocEvent("free", ids[name], size, cat, phase, module, s))

    layer = "model.layers.{}".format
    for k in range(n):  # forward: the gather three layers back freed before this one's
        alloc(f"act{k}", ACT, A, "forward", layer(k))
        if k >= 3:
            free(f"gather{k - 3}", GATHER, W, "forward", layer(k - 3), 1)
        alloc(f"gather{k}", GATHER, W, "forward", layer(k), 1)
    for k in range(n - 3, n):  # the stack's end releases what is pending
        free(f"gather{k}", GATHER, W, "forward", layer(k), 1)
    for k in reversed(range(n)):  # backward: layer k >= 1 gathers (k - 1's, labelled k)
        alloc(f"grad{k}", GRAD, G, "backward", layer(k), 2)
        if k >= 1 and k + 3 < n:
            free(f"pre{k + 3}", PREFETCH, W, "backward", layer(k + 3), 1)
        if k >= 1:
            alloc(f"pre{k}", PREFETCH, W, "backward", layer(k), 1)
        free(f"act{k}", ACT, A, "backward", layer(k))
    alloc("root", ROOT, G, "backward", "model.norm")
    for k in (3, 2, 1):  # the final callback: layers 3, 2, 1's still pending
        free(f"pre{k}", PREFETCH, W, "backward", layer(k), 1)
    free("root", ROOT, G, "backward", "model.norm")
    for k in range(n):
        free(f"grad{k}", GRAD, G, "zero_grad", layer(k), 2)
    return Timeline(events=ev, name=f"{n} layers")


def _stream(events: Iterable[AllocEvent]) -> list[tuple[str, int, str, int, str]]:
    return [(e.action, e.size_bytes, e.phase, e.stream, e.module) for e in events]


@pytest.mark.parametrize("layers", [7, 8, 12, 40])
def test_frees_three_layers_away_compose_to_the_full_stream(layers: int) -> None:
    kept = kept_units(1, reach=3)
    assert kept == 7  # three units on each side of the repeated one
    run = Run("model.layers", 0, 1, layers, kept, 3, 0)
    schedule = compose(_fsdp1_like(kept), [run], [])
    full = _fsdp1_like(layers)
    assert _stream(schedule.events()) == _stream(full.events)
    assert schedule.peak().peak_bytes == max(full.live_bytes())
    # at the last layer's gather: every layer's activation and three gathers (two pending)
    assert schedule.peak().peak_bytes == layers * ACT + 3 * GATHER


def test_five_kept_units_are_refused_rather_than_composed() -> None:
    # the repeated layer's gather is freed by no repeated layer: composing would keep every
    # middle layer's (the bug: 9.84 GB for llama-3.2-1b instead of 7.16 GB)
    run = Run("model.layers", 0, 1, 12, 5, 2, 0)
    with pytest.raises(CompositionError, match="leave blocks allocated"):
        compose(_fsdp1_like(5), [run], [])


def test_kept_units_cover_the_reach() -> None:
    # 2 * ceil(reach / unit) + 1, at least the defaults (5 single blocks, 3 longer units)
    assert [kept_units(u) for u in (1, 2, 6)] == [5, 3, 3]
    assert [kept_units(u, reach=3) for u in (1, 2, 3, 6)] == [7, 5, 3, 3]


@pytest.mark.slow  # ~10-20 s: two traces of FSDP1 over 8 layers
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"framework": "accelerate-fsdp"}, id="accelerate-fsdp"),
        pytest.param(
            {"framework": "fsdp-qlora", "lora_rank": 16, "quantize_base": "nf4",
             "precision": "bf16-true"},
            id="fsdp-qlora",
        ),
    ],
)  # fmt: skip
def test_fsdp1_composed_trace_equals_the_whole_trace(
    settings: dict[str, Any], tmp_path: Path
) -> None:
    from trainmem.estimate import finish
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.generic import estimate_generic

    raw = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    raw["num_hidden_layers"] = 8
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, data_parallel_size=4, zero_stage=3, **settings
    )
    composed = estimate_generic(str(path), training)
    assert not any("could not stand" in n for n in composed.notes), composed.notes
    assert composed.details["generic"]["block_lists"][0]["units_traced"] == 7
    whole = estimate_generic(str(path), training, copies=20)  # nothing cut
    assert whole.details["generic"]["block_lists"] == []
    c, w = (finish(e, gpu=None, alloc_conf="", simulate_allocator=False) for e in (composed, whole))
    assert _stream(c.schedules[0].events()) == _stream(w.schedules[0].events())
    assert c.breakdown.allocated_bytes == w.breakdown.allocated_bytes
