"""The end of an FSDP2 x TP + SP backward with a tied embedding, traced and analytic.

Expected bytes derived by hand from torch's source (torch 2.13) on tiny-llama-test made tied
(h = 64, vocab 512, 2 layers, intermediate 176, 4 heads of 16, 2 KV heads), bf16-mixed (c = 2),
2-way FSDP2 x 2-way TP + SP, full activation checkpointing, b = 2, s = 48
(Note [Tied embedding gradient under DTensor], Note [FSDP2 post-backward] in
trainmem/analytic/schedule.py):

- the lookup's gradient is whole-vocabulary, [V, h] in bf16: V * h * 2 B;
- DTensor redistributes it to the head gradient's ``Shard(0)`` placement, a local chunk
  cloned (``Shard._replicate_to_shard``): [V / 2, h] bf16 = V * h B; autograd adds it to the
  head's gradient out of place (a tensor subclass, ``input_buffer.cpp`` ``accumulate``): the
  sum, V * h B more. So the embedding's backward raises the live bytes by 2 * V * h * 2 B;
- FSDP2 keeps layer 0's reduce-scatter input until the root's final callback, after the
  embedding's backward: the layer's tensor-parallel slice in fp32 (the reduce dtype), whole
  over the 2 FSDP ranks: (q, o 64 x 64; k, v 64 x 32; gate, up, down 64 x 176) / 2 + two
  replicated norms of 64 = 23,168 elements, 92,672 B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.specs.hf import PRESETS_DIR
from trainmem.specs.training import TrainingConfig

H, V = 64, 512
LAYER_RS_INPUT = 4 * ((2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176) // 2 + 2 * 64)


@pytest.fixture(scope="module")
def tied_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((PRESETS_DIR / "tiny-llama-test.json").read_text())
    config["tie_word_embeddings"] = True
    path = tmp_path_factory.mktemp("tied") / "config.json"
    path.write_text(json.dumps(config))
    return path


def _training(framework: str = "fsdp2") -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=2,
        seq_len=48,
        precision="bf16-mixed",
        framework=framework,
        data_parallel_size=2,
        zero_stage=3,
        tensor_parallel_size=2,
        sequence_parallel=True,
        activation_checkpointing="full",
        dropout=False,
    )


def _embedding_backward(
    engine: str, config: Path, framework: str = "fsdp2"
) -> tuple[list[int], int, list[str]]:
    """The bytes the embedding's backward allocates, in order; the most of them alive at once;
    the modules of the blocks freed after them."""
    est = estimate(str(config), _training(framework), engine=engine, simulate_allocator=False)
    events = list(est.schedules[0].events())
    module = "model.embed_tokens" if engine == "trace" else "embedding"
    start = max(i for i, e in enumerate(events) if e.phase == "forward")
    first = next(
        i for i, e in enumerate(events)
        if i > start and e.action == "alloc" and e.module == module and e.size_bytes >= V * H
    )  # fmt: skip
    live, high, sizes, end = 0, 0, [], first
    for k, e in enumerate(events[first:], first):
        if e.phase != "backward":
            break
        if e.module == module:  # the embedding's own blocks
            live += e.size_bytes if e.action == "alloc" else -e.size_bytes
            high = max(high, live)
        if e.action == "alloc" and e.module == module:
            sizes.append(e.size_bytes)
            end = k
    later = [
        e.module for e in events[end:] if e.action == "free" and e.size_bytes == LAYER_RS_INPUT
    ]
    return [s for s in sizes if s >= V * H], high, later


@pytest.mark.parametrize("engine", ["trace", "analytic"])
@pytest.mark.parametrize(("framework", "w"), [("fsdp2", 2), ("pytorch-amp", 4)])
def test_tied_embedding_backward_under_dtensor(
    engine: str, framework: str, w: int, tied_config: Path
) -> None:
    # w: bytes of the gathered weight the lookup reads: bf16 under torchtitan's FSDP2 policy,
    # the fp32 weight under autocast (the embedding is not on autocast's cast lists)
    sizes, rise, freed_after = _embedding_backward(engine, tied_config, framework)
    # whole-vocabulary, its shard cloned, the sum
    assert sizes == [V * H * w, V * H * w // 2, V * H * w // 2]
    assert rise == 2 * V * H * w
    # layer 0's reduce-scatter input is released only after the embedding's backward
    assert any(m.endswith("layers.0") or ".layers.0." in m for m in freed_after)


@pytest.mark.slow
def test_llama_1b_tied_fsdp_tp_full_ac_matches_the_trace() -> None:
    # the benchmark cell whose peak is the tied embedding's backward (-2.5% before the rule)
    training = TrainingConfig(
        micro_batch_size=1,
        seq_len=2048,
        framework="fsdp2",
        data_parallel_size=2,
        zero_stage=3,
        tensor_parallel_size=2,
        sequence_parallel=True,
        activation_checkpointing="full",
    )
    peaks = [
        estimate("llama-3.2-1b", training, engine=engine, simulate_allocator=False).details[
            "per_rank"
        ][0]["allocated_bytes"]
        for engine in ("analytic", "trace")
    ]
    assert peaks[0] == pytest.approx(peaks[1], rel=1e-3)


def test_fsdp2_root_group_reduces_after_the_whole_backward() -> None:
    # untied tiny-llama-test, same setting: the root group (embedding, final norm, head) keeps
    # its unsharded bf16 gradients, each [V / 2, h] (V * h B), until the root's final callback
    # copies them into one reduce-scatter input in fp32: 4 * (2 * V * h / 2 + h) B, allocated
    # after the embedding's backward, when layer 0's input (LAYER_RS_INPUT) is released
    # (torch/distributed/fsdp/_fully_shard/_fsdp_state.py _root_post_backward_final_callback)
    root_rs_input = 4 * (2 * V * H // 2 + H)
    for engine in ("trace", "analytic"):
        est = estimate("tiny-llama-test", _training(), engine=engine, simulate_allocator=False)
        timeline = est.schedules[0].expand()
        events = timeline.events[timeline.steady_state_start :]  # the measured step
        live: dict[int, int] = {}
        at_input: list[int] = []
        released_before = False
        for e in events:
            if e.action == "free":
                live.pop(e.block_id, None)
                released_before |= e.size_bytes == LAYER_RS_INPUT and not at_input
                continue
            if e.size_bytes == root_rs_input:
                at_input = sorted(live.values())
            if e.phase != "init":  # not the weights and states the step starts with
                live[e.block_id] = e.size_bytes
        # the head's and the embedding's unsharded gradients, nothing else of that size (the
        # gathered root weights are resharded first); layer 0's input released before
        assert at_input.count(V * H) == 2
        assert released_before
        assert V * H not in live.values()  # all gone once the backward ends
