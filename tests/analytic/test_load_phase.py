"""The load phase (Note [The load phase], Note [torchao 0.1 NF4 at load]): torchtune's
single-device QLoRA on torchao 0.1 builds each base linear in bf16 on the GPU and quantizes it
there, then quantizes it again from the checkpoint in ``load_state_dict``.

Expected bytes by hand from torchao v0.1 dtypes/nf4tensor.py, for a bf16 weight of ``n``
elements (blocks of 64: ``n / 64`` scalers): ``convert_to_norm_float_weight`` holds the scaled
blocks (2n), ``(value - nf4)`` over (n, 16) (32n) and its ``.abs()`` (32n) at once, beside the
double quantization's int8 scalers (n / 64), their factors (2 n / 64, over the expanded view)
and the block maxima (2 n / 64): 66n + 5n / 64 above what was live. In ``load_state_dict`` the
checkpoint's bf16 copy (2n) is live too, and every weight of the model (built once): the load
peaks at the model's parameter bytes + 68n + 5n / 64 on the largest linear.

Llama-3.2-1B: its MLP linears are 2048 x 8192 = 16,777,216 elements, the largest; 68n + 5n / 64
= 1,140,850,688 + 1,310,720 = 1,142,161,408 bytes.
"""

from __future__ import annotations

import pytest

from trainmem.analytic.load import FSDP1_RULE, LOAD_RULE, load_rule, to_nf4_ops
from trainmem.analytic.transforms.base import alloc
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.schedule import StepSchedule
from trainmem.specs.training import TrainingConfig

MLP = 2048 * 8192  # Llama-3.2-1B's gate / up / down weights
ALL_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def _qlora(torchao: str | None, **settings: object) -> TrainingConfig:
    return TrainingConfig(  # type: ignore[arg-type]
        micro_batch_size=1,
        seq_len=256,
        precision="bf16-true",
        lora_rank=8,
        lora_targets=ALL_LINEARS,
        quantize_base="nf4-dq",
        framework="torchtune",
        activation_checkpointing="full",
        torchao_version=torchao,
        **settings,
    )


def test_one_weight_peaks_at_the_16_way_difference_and_its_absolute_value() -> None:
    n = 4096 * 11008  # Llama-2-7B's MLP weight
    kept = alloc(n, MemoryCategory.PARAMETER, "load", "w")
    ops = to_nf4_ops(n, kept, "t", "layers.0")
    sched = StepSchedule(setup=(), step=(), load=tuple(ops))
    assert sched.load_peak() == 66 * n + 5 * n // 64
    live = sum(op.size_bytes if op.action == "alloc" else -op.size_bytes for op in ops)
    assert live == n  # only the quantized weight is left, in its pieces
    left = {op.key for op in ops if op.action == "alloc"} - {
        op.key for op in ops if op.action == "free"
    }
    assert left == {"w", "w/factor", "w/scalers"}


def test_load_peak_of_a_1b_qlora() -> None:
    est = estimate("llama-3.2-1b", _qlora("0.1"), engine="analytic", simulate_allocator=False)
    sched = est.schedules[0]
    weights = sched.model_states()["parameters"]
    assert sched.load_peak() == weights + 68 * MLP + 5 * MLP // 64
    assert est.details["load_phase"]["peak_allocated_bytes"] == sched.load_peak()


def test_the_step_is_unchanged_by_the_load() -> None:
    """The load makes the weights the setup allocates (adopted: no second event), so the
    step's peak and every event after the load are those of the run without a load phase
    (``load_phase=False``)."""
    off = _qlora("0.1", load_phase=False)
    plain = estimate("llama-3.2-1b", off, engine="analytic", simulate_allocator=False)
    loaded = estimate("llama-3.2-1b", _qlora("0.1"), engine="analytic", simulate_allocator=False)
    a, b = plain.schedules[0], loaded.schedules[0]
    assert not a.load and b.load
    assert a.peak() == b.peak()

    def shape(events: list) -> list:  # type: ignore[type-arg]
        return [(e.action, e.size_bytes, e.category, e.phase) for e in events]

    after_load = [e for e in b.expand().events if e.phase != "load"]
    first = a.expand().events
    weights = 0
    while first[weights].phase == "init" and first[weights].category == MemoryCategory.PARAMETER:
        weights += 1
    assert shape(after_load) == shape(first[weights:])


@pytest.mark.parametrize(
    ("torchao", "settings", "rule"),
    [
        ("0.1", {}, LOAD_RULE),
        ("0.1.0", {"quantize_base": "nf4"}, LOAD_RULE),
        (None, {}, None),  # a current torchao: quantized in chunks
        ("0.2", {}, None),
        ("0.1", {"framework": "pytorch-amp"}, None),
        ("0.1", {"quantize_base": "none", "lora_targets": ("q",)}, None),
    ],
)
def test_which_runs_have_the_rule(
    torchao: str | None, settings: dict[str, object], rule: str | None
) -> None:
    base = _qlora(torchao)
    from dataclasses import replace

    assert load_rule(replace(base, **settings)) == rule  # type: ignore[arg-type]


def test_distributed_recipe_is_not_the_single_device_rule() -> None:
    training = _qlora("0.1", data_parallel_size=2, zero_stage=3)
    assert load_rule(training) is None


def test_loading_that_does_not_fit_is_the_verdict() -> None:
    """On 2.5 GB the step fits (tight) but the 1B model's load peak (its weights + 1.14 GB, of
    a 2.33 GiB allocator capacity) does not: the verdict says so, the note names loading."""
    plain = estimate("llama-3.2-1b", _qlora(None), engine="analytic", gpu="2.5GB")
    assert plain.verdict != "does not fit"
    est = estimate("llama-3.2-1b", _qlora("0.1"), engine="analytic", gpu="2.5GB")
    assert est.verdict == "does not fit"
    assert est.details["load_phase"]["oom"] is True
    assert any(n.startswith("loading the model does not fit") for n in est.notes)
    assert est.details["assumed"]["torchao"] == "0.1"
    assert est.details["assumed"]["load"] == LOAD_RULE
    assert "load" not in plain.details["assumed"]
    assert (
        "torchao" not in plain.details["assumed"]
        or "(default)" in plain.details["assumed"]["torchao"]
    )


def test_reserved_includes_the_cache_the_load_leaves() -> None:
    """max_memory_reserved is the run's: at least what the load reserved."""
    est = estimate("llama-3.2-1b", _qlora("0.1"), engine="analytic")
    load = est.details["load_phase"]
    assert load["max_memory_allocated"] >= load["peak_allocated_bytes"]
    assert est.breakdown.reserved_bytes >= load["max_memory_reserved"]
    plain = estimate("llama-3.2-1b", _qlora(None), engine="analytic")
    assert est.breakdown.reserved_bytes > plain.breakdown.reserved_bytes


def _fsdp_qlora(**settings: object) -> TrainingConfig:
    return TrainingConfig(  # type: ignore[arg-type]
        micro_batch_size=1,
        seq_len=512,
        precision="bf16-true",
        activation_checkpointing="full",
        data_parallel_size=2,
        zero_stage=3,
        lora_rank=64,
        lora_targets=ALL_LINEARS,
        framework="fsdp-qlora",
        **settings,
    )


def test_fsdp1_sync_init_peaks_at_the_root_unit() -> None:
    """Note [FSDP1 sync_module_states init], by hand for Llama-2-7B (bf16 base, LoRA) on two
    ranks: a decoder layer's frozen unit is U = 4 x 4096^2 x 2 + 3 x 4096 x 11008 x 2 + 2 x
    4096 x 2 = 404,766,720 bytes and peaks at its moved tensors + flat parameter + shard, 2.5
    U = 1.01 GB above the shards before it; the root (embedding 32000 x 4096, head 4096 x
    32000, final norm 4096, all bf16: R = 524,296,192 bytes) peaks at 2.5 R with every layer
    sharded: the load's peak is the model's parameter bytes on the rank (every shard, the
    buffers) + R moved + R flat = + 1,048,592,384 bytes."""
    est = estimate("llama-2-7b", _fsdp_qlora(), engine="analytic", simulate_allocator=False)
    sched = est.schedules[0]
    assert est.details["load_phase"]["rule"] == FSDP1_RULE
    assert sched.load_peak() == sched.model_states()["parameters"] + 2 * 524_296_192
    off = estimate(
        "llama-2-7b", _fsdp_qlora(load_phase=False), engine="analytic", simulate_allocator=False
    )
    assert not off.schedules[0].load and "load_phase" not in off.details
    assert sched.peak() == off.schedules[0].peak()


def test_fsdp1_broadcast_buckets() -> None:
    """A layer's frozen tensors q, k, v, o (33,554,432 B each), gate, up (90,177,536 B) fill the
    first 250 MiB bucket (314,572,800 B >= 262,144,000), down and the two norms the second
    (90,193,920 B); both are in flight before either is freed."""
    from trainmem.analytic.load import _fsdp1_unit

    sizes = [33_554_432] * 4 + [90_177_536] * 3 + [8_192] * 2
    moved = [alloc(b, MemoryCategory.TEMPORARY, "load", f"m{k}") for k, b in enumerate(sizes)]
    ops = _fsdp1_unit(moved, [], sizes, "u", "layers.0")
    buckets = [op.size_bytes for op in ops if op.action == "alloc" and "bucket" in op.key]
    assert buckets == [314_572_800, 90_193_920]
    sched = StepSchedule(setup=(), step=(), load=tuple(ops))
    assert sched.load_peak() == 2 * sum(sizes)  # moved + flat (no shard given)


def test_fsdp1_broadcast_bucket_of_one_tensor_is_the_tensor() -> None:
    """torch/csrc/utils/tensor_flatten.h ``flatten_dense_tensors``: one tensor is flattened as
    a view (no block); more are concatenated. Llama-2-7B's embedding (32000 x 4096 bf16,
    262,144,000 B = the 250 MiB bucket size) fills a bucket alone; the final norm (8,192 B) and
    the head (262,144,000 B) make the next, one block of 262,152,192 B. The peak is the moved
    tensors + that bucket: 2 x 262,144,000 + 8,192 + 262,152,192 (flat parameter 524,296,192 B
    comes after the buckets are freed: moved + flat = 1,048,592,384, the larger)."""
    from trainmem.analytic.load import _fsdp1_unit

    sizes = [262_144_000, 8_192, 262_144_000]
    moved = [alloc(b, MemoryCategory.TEMPORARY, "load", f"m{k}") for k, b in enumerate(sizes)]
    ops = _fsdp1_unit(moved, [], sizes, "root", "(model)")
    buckets = [op.size_bytes for op in ops if op.action == "alloc" and "bucket" in op.key]
    assert buckets == [262_152_192]
    sched = StepSchedule(setup=(), step=(), load=tuple(ops))
    assert sched.load_peak() == 2 * sum(sizes) == 1_048_592_384


def test_fsdp1_rule_needs_sharding() -> None:
    from dataclasses import replace

    assert load_rule(_fsdp_qlora()) == FSDP1_RULE
    assert load_rule(replace(_fsdp_qlora(), data_parallel_size=1, zero_stage=0)) is None
    assert load_rule(replace(_fsdp_qlora(), zero_stage=0)) == FSDP1_RULE  # NO_SHARD
    assert load_rule(_qlora("0.1", load_phase=False)) is None  # an explicit setting wins


def test_torchao_before_0_3_keeps_the_factor_view() -> None:
    """torchao 0.1 / 0.2 keep each NF4 weight's quantization factor as a view of its (n / 64 /
    256, 256) bf16 base: 2 x (n / 64 - n / 64 / 256) bytes more than a contiguous factor. Per
    Llama-3.2-1B layer: q, o 2048 x 2048 (65,536 scalers: 2 x (65,536 - 256) = 130,560 B
    each), k, v 512 x 2048 (16,384: 32,640 B each), gate, up, down 8192 x 2048 (262,144:
    522,240 B each); 16 layers."""
    per_layer = 2 * 130_560 + 2 * 32_640 + 3 * 522_240
    old = estimate("llama-3.2-1b", _qlora("0.2"), engine="analytic", simulate_allocator=False)
    new = estimate("llama-3.2-1b", _qlora("0.3"), engine="analytic", simulate_allocator=False)
    assert not old.schedules[0].load  # 0.2 quantizes in chunks: no load rule
    params = old.model_states_bytes["parameters"] - new.model_states_bytes["parameters"]
    assert params == 16 * per_layer


def test_without_the_replay_the_load_peak_still_decides_the_fit() -> None:
    """The planner's fast path (no allocator replay): the load's peak of live bytes + the CUDA
    context against the capacity, beside the step's device total."""
    est = estimate(
        "llama-3.2-1b", _qlora("0.1"), engine="analytic", gpu="2.5GB", simulate_allocator=False
    )
    load = est.details["load_phase"]
    assert load["peak_allocated_bytes"] + est.breakdown.cuda_context > 2_500_000_000
    assert est.fits is False and est.verdict == "does not fit"


def test_the_page_shows_the_load_phase() -> None:
    from trainmem.web.compute import numbers
    from trainmem.web.views import breakdown_html

    est = estimate("llama-3.2-1b", _qlora("0.1"), engine="analytic", gpu="2.5GB")
    html = breakdown_html(numbers(est))
    assert 'data-key="load_allocated"' in html
    assert 'data-key="load_reserved"><td>loading: reserved</td><td>OOM</td>' in html
    plain = breakdown_html(numbers(estimate("llama-3.2-1b", _qlora(None), engine="analytic")))
    assert "loading" not in plain


def test_fsdp1_no_shard_keeps_the_flat_parameter() -> None:
    """NO_SHARD: the unit's flat parameter is its weight, nothing cloned; after the unit only
    the (full-size) weights are left."""
    from trainmem.analytic.load import _fsdp1_unit

    sizes = [33_554_432, 90_177_536]
    moved = [alloc(b, MemoryCategory.TEMPORARY, "load", f"m{k}") for k, b in enumerate(sizes)]
    kept = [alloc(b, MemoryCategory.PARAMETER, "load", f"w{k}") for k, b in enumerate(sizes)]
    ops = _fsdp1_unit(moved, kept, sizes, "u", "layers.0")
    assert not any("flat" in op.key for op in ops)
    live = sum(op.size_bytes if op.action == "alloc" else -op.size_bytes for op in ops)
    assert live == sum(sizes)
    assert StepSchedule(setup=(), step=(), load=tuple(ops)).load_peak() == 2 * sum(sizes)


def test_broadcast_buckets_fill_to_the_limit() -> None:
    """c10d ``compute_bucket_assignment_by_size`` with the 250 MiB limit (262,144,000 B): a
    bucket closes at the tensor that brings it to the limit or past it, the rest is the last."""
    from trainmem.analytic.load import broadcast_buckets

    assert broadcast_buckets([]) == []
    assert broadcast_buckets([262_144_000]) == [[0]]  # exactly the limit: a bucket alone
    assert broadcast_buckets([262_143_999, 1, 5]) == [[0, 1], [2]]
    assert broadcast_buckets([100_000_000] * 3 + [10]) == [[0, 1, 2], [3]]
