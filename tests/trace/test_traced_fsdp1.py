"""accelerate's FSDP1 traced for real on fake tensors (issue 26, Note [Tracing FSDP1] in
trainmem/trace/fsdp.py): ``FullyShardedDataParallel`` wrapped as accelerate wraps a
transformers model, one flat parameter per unit.

Expected sizes derived by hand for the 2-layer Qwen2 formula config (tests/models/formula/
qwen2.json: h = 64, i = 128, 4 heads of 16, 2 key/value heads, V = 512, untied head):
one layer q 64 x 64 + 64, k and v 64 x 32 + 32 each, o 64 x 64, gate / up / down 3 x 64 x 128,
two norms of 64: 37,120 elements; the root unit (embedding, final norm, head) 2 x 512 x 64 + 64
= 65,600. FSDP1 (``use_orig_params=False``) pads each flat parameter to a multiple of the world
size and keeps this rank's 1/N in fp32: 37,120 / 4 x 4 B = 37,120 B per layer, 65,600 B for the
root over 4 ranks. The agreement with the formulas (accelerate-fsdp rows: gathers in the compute
dtype, the reduce in it) is the issue's 1 % bar.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.breakdown import MemoryCategory  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.schedule import Op, Repeat, StepSchedule  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
LAYER, ROOT = 37_120, 65_600


def _fsdp1(**changes: Any) -> TrainingConfig:
    base: dict[str, Any] = {
        "micro_batch_size": 2,
        "seq_len": 64,
        "framework": "accelerate-fsdp",
        "data_parallel_size": 4,
        "zero_stage": 3,
    }
    return TrainingConfig(**{**base, **changes})


def _flat_parameters(schedule: StepSchedule) -> dict[str, int]:
    """The weights the step starts from, by name (a repeated body's once per repeat)."""
    out: dict[str, int] = {}

    def walk(items: Any, count: int) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body, count * x.count)
            elif x.action == "alloc" and x.category is MemoryCategory.PARAMETER:
                assert isinstance(x, Op)
                out[x.module] = out.get(x.module, 0) + count * x.size_bytes

    walk(schedule.setup or schedule.step, 1)
    return out


def test_fsdp1_shards_one_flat_parameter_per_unit_and_matches_the_formulas() -> None:
    training = _fsdp1()
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    flat = _flat_parameters(generic.schedules[0])
    assert flat == {"_flat_param": ROOT, "model.layers.0._flat_param": LAYER,
                    "model.layers.1._flat_param": LAYER}  # fmt: skip
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_fsdp1_hybrid_shard_keeps_a_shard_group_share() -> None:
    # HYBRID_SHARD over groups of 2: each flat parameter split in 2, not 4
    generic = estimate(
        QWEN2, _fsdp1(shard_group_size=2), engine="generic", simulate_allocator=False
    )
    flat = _flat_parameters(generic.schedules[0])
    assert flat["_flat_param"] == 2 * ROOT
    assert flat["model.layers.1._flat_param"] == 2 * LAYER


def test_fsdp1_reshards_a_frozen_unit_on_fake_tensors() -> None:
    # LoRA: the frozen units (root, layers) are resharded by FSDP1's final callback, which
    # compares data pointers (fsdp1_fake_pointers): the step starts from their fp32 shards,
    # not from a 16-bit unsharded copy (2 x 65,600 B for the root)
    generic = estimate(QWEN2, _fsdp1(lora_rank=8), engine="generic", simulate_allocator=False)
    flat = _flat_parameters(generic.schedules[0])
    assert flat["_flat_param"] == ROOT
    assert flat["base_model.model.model.layers.0._flat_param"] == LAYER


def _forward_copies(schedule: StepSchedule, size: int) -> tuple[int, int]:
    """(allocations, frees) of ``size``-byte temporaries in the forward of the expanded step."""
    made = freed = 0
    for ev in schedule.events():
        if ev.size_bytes == size and ev.category is MemoryCategory.TEMPORARY:
            if ev.phase == "forward":
                made += ev.action == "alloc"
                freed += ev.action == "free"
    return made, freed


def test_fsdp1_no_shard_keeps_whole_flat_parameters_and_remakes_its_16bit_copies() -> None:
    # NO_SHARD over 4 ranks: whole fp32 flat parameters (4 B x 37,120 per layer, 4 B x 65,600
    # for the root); no DDP reducer buckets (FSDP1 all-reduces flat_param.grad itself); each
    # unit's bf16 copy (2 B x 37,120 = 74,240 B per layer) made in its pre-forward and freed by
    # post_reshard after its forward (Note [FSDP1 NO_SHARD's 16-bit copy]): in the step, one
    # per layer made and freed in the forward (none kept for the backward)
    training = _fsdp1(zero_stage=0)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    schedule = generic.schedules[0]
    flat = _flat_parameters(schedule)
    assert flat == {"_flat_param": 4 * ROOT, "model.layers.0._flat_param": 4 * LAYER,
                    "model.layers.1._flat_param": 4 * LAYER}  # fmt: skip
    assert schedule.live_before_step().get(MemoryCategory.GRADIENT, 0) == 0
    made, freed = _forward_copies(schedule, 2 * LAYER)
    assert (made, freed) == (2, 2)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        {"data_parallel_size": 1},  # torch switches FSDP1 on one rank to NO_SHARD
        {"zero_stage": 0, "gradient_accumulation_steps": 4},
    ],
    # no context parallelism: accelerate runs it with FSDP2 only (a SpecError under FSDP1)
    ids=["one-gpu", "no-shard-accumulation"],
)
def test_fsdp1_variants_match_the_formulas(changes: dict[str, Any]) -> None:
    # the fast representative is the NO_SHARD test above
    training = _fsdp1(**changes)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_fsdp1_lora_under_checkpointing_runs_and_matches_the_formulas(checkpointing: str) -> None:
    # accelerate FSDP1 + LoRA + bf16-mixed + activation checkpointing used to fail in the
    # warm-up: full in the metadata check (peft cast its input to the fp32 views an adapter
    # unit is built with, the recompute to the bf16 ones of its first forward: Note [FSDP1
    # views between steps] in trainmem/trace/fsdp.py), selective in SAC's replay (FSDP1's
    # record_function ops, Note [Profiler ops under selective checkpointing] in
    # trainmem/trace/sac.py). The step must run and agree with the formulas (issue 26's 1 %)
    training = _fsdp1(lora_rank=8, precision="bf16-mixed", activation_checkpointing=checkpointing)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_fsdp1_allocates_on_its_streams_and_holds_rate_limited_frees() -> None:
    # Note [FSDP1 streams on the trace]: under bf16-mixed (MixedPrecision(param_dtype=bf16))
    # over 4 ranks, each unit's 16-bit shard is made on the pre-unshard stream (2 B x 37,120 / 4
    # = 18,560 B per layer, 2 B x 65,600 / 4 = 32,800 B for the root), its gathered flat
    # parameter on the unshard stream (74,240 / 131,200 B), the sharded gradient on the
    # post-backward stream (bf16 reduce-scatter output, then the fp32 shard: 37,120 / 65,600 B)
    schedule = estimate(
        QWEN2, _fsdp1(precision="bf16-mixed"), engine="generic", simulate_allocator=False
    ).schedules[0]
    sizes: dict[int, set[int]] = {}
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for ev in schedule.events():
        if ev.action == "alloc":
            sizes.setdefault(ev.stream, set()).add(ev.size_bytes)
        sign = 1 if ev.action == "alloc" else -1
        live[ev.stream] = live.get(ev.stream, 0) + sign * ev.size_bytes
        peak[ev.stream] = max(peak.get(ev.stream, 0), live[ev.stream])
    assert sizes[3] == {LAYER // 2, ROOT // 2}
    assert sizes[1] == {2 * LAYER, 2 * ROOT}
    assert sizes[2] == {LAYER // 2, ROOT // 2, LAYER, ROOT}
    # the rate limiter's frees are held until it synchronises on them (two in flight): the
    # root and two layer blocks at most on a 2-layer stack (the backward's first layer has no
    # freed layer before it, its last prefetches none), R + 2 L on the unshard stream, as Note
    # [FSDP1 unshard stream pool] derives (R + 3 L from the third layer on)
    assert peak[1] == 2 * ROOT + 2 * 2 * LAYER == 279_680


def test_accelerate_runs_the_forward_under_autocast_over_16bit_units() -> None:
    # accelerate's native_amp wraps the forward in torch.autocast (accelerator.py
    # prepare_model) over FSDP1's bf16 units: CUDA's autocast runs layer_norm in fp32 (its
    # AT_FORALL_FP32 list), so phi's input LayerNorm (2 x 64 tokens, h = 64) returns a
    # 4 B x 128 x 64 = 32,768 B fp32 tensor, which q, k and v each cast to bf16 for their
    # matmul (2 B x 128 x 64 = 16,384 B each); without autocast it would return 16,384 B bf16
    phi = str(MODELS_DIR / "formula" / "phi.json")
    schedule = estimate(
        phi, _fsdp1(precision="bf16-mixed"), engine="trace", simulate_allocator=False
    ).schedules[0]
    made: dict[str, list[int]] = {}
    for ev in schedule.events():
        if ev.phase == "forward" and ev.action == "alloc" and ".layers.0." in ev.module:
            made.setdefault(ev.module.rsplit("layers.0.", 1)[1], []).append(ev.size_bytes)
    assert 4 * 128 * 64 in made["input_layernorm"]
    assert 2 * 128 * 64 not in made["input_layernorm"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert made[f"self_attn.{proj}"].count(2 * 128 * 64) == 2  # its input copy, its output
