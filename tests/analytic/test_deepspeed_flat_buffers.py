"""DeepSpeed's flat model-state buffers at init (Note [DeepSpeed's flat buffers at init] in
trainmem/analytic/transforms/deepspeed_init.py), sizes and order by hand from DeepSpeed's code.

The model: the Qwen2 formula config (tests/models/formula/qwen2.json): hidden 64, intermediate
128, 4 heads of 16, 2 KV heads, vocabulary 512, 2 layers, q/k/v biases, untied head; every
tensor trainable (tests/analytic/test_flat_optimizer_states.py counts them): embedding 32,768;
per layer q 4,096 + 64, k 2,048 + 32, v 2,048 + 32, o 4,096, gate / up / down 3 x 8,192, two
norms 2 x 64; final norm 64; head 32,768: 139,840 elements. bf16-mixed, AdamW, 3 ranks.

ZeRO-3 (partition_parameters.py ``_partition_param``: ceil(numel / 3) per parameter):
embedding and head 10,923 each; per layer 1,366 + 22 + 683 + 11 + 683 + 11 + 1,366 + 3 x
2,731 + 2 x 22 = 12,379; final norm 22: 46,626 partition elements, one sub-group (< 1e9).

ZeRO-1/2 (stage_1_and_2.py ``flatten_dense_tensors_aligned(..., 2 x 3)``, utils.py
``align_dense_tensors``): 139,840 padded to 139,842, partitions of 46,614.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
Z3_PART = 46_626
Z12_PADDED = 139_842
Z12_PART = 46_614


def _ops(items: tuple[Item, ...]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        if isinstance(item, Repeat):
            out += _ops(item.body) * item.count
        else:
            out.append(item)
    return out


def _setup(**fields: Any) -> list[Op]:
    training = TrainingConfig(
        framework="deepspeed",
        precision="bf16-mixed",
        optimizer="adamw",
        data_parallel_size=3,
        micro_batch_size=1,
        seq_len=16,
        reduce_bucket_size=4096,
        **fields,
    )
    est = estimate(load_model_spec(QWEN2), training, engine="analytic", simulate_allocator=False)
    return _ops(est.schedules[0].setup)


def _flat(ops: list[Op]) -> list[tuple[str, str, int]]:
    keys = ("ds/", "bucket/persistent")
    return [(o.action, o.key, o.size_bytes) for o in ops if o.key.startswith(keys)]


def test_zero3_flat_buffers_at_init_in_stage3_order() -> None:
    # stage3.py v0.12.3 __init__: defragment's flat bf16 partitions; _create_fp32_partitions:
    # .clone() (bf16) then .float() (fp32, kept); initialize_optimizer_states: the fp32
    # gradient_buffer of the largest sub-group, _optimizer_step(0): FusedAdam's exp_avg and
    # exp_avg_sq (zeros_like of the fp32 partition), the buffer dropped; then the IPG bucket
    # (reduce_bucket_size bf16) and grad_partitions_flat_buffer (bf16 gradients)
    ops = _setup(zero_stage=3, deepspeed_version="0.12.3")
    assert _flat(ops) == [
        ("alloc", "ds/flat_params", 2 * Z3_PART),
        ("alloc", "ds/clone/0", 2 * Z3_PART),
        ("alloc", "ds/fp32/0", 4 * Z3_PART),
        ("free", "ds/clone/0", 2 * Z3_PART),
        ("alloc", "ds/init_grad/0", 4 * Z3_PART),
        ("alloc", "ds/state/0/0", 4 * Z3_PART),
        ("alloc", "ds/state/0/1", 4 * Z3_PART),
        ("free", "ds/init_grad/0", 4 * Z3_PART),
        ("alloc", "bucket/persistent", 2 * 4096),
        ("alloc", "ds/grad_partitions", 2 * Z3_PART),
    ]
    # no per-tensor block of its own for a trainable parameter, a state or a kept gradient
    # (the loop's at the warm-up step's start)
    assert not [o for o in ops if o.key.startswith(("param/", "state/"))]
    assert not [o for o in ops if o.category == Cat.GRADIENT and o.phase == "forward"]


def test_zero3_states_made_by_the_first_step_from_0_13_2() -> None:
    # PR #5104 (0.13.2): no _optimizer_step at init; the gradient_buffer is still made and
    # dropped, the states come with the first step (optimizer.begin of the warm-up step)
    ops = _setup(zero_stage=3, deepspeed_version="0.13.2")
    flat = _flat(ops)
    assert ("alloc", "ds/init_grad/0", 4 * Z3_PART) in flat
    states = [(o.action, o.size_bytes, o.phase) for o in ops if o.key.startswith("ds/state/")]
    assert states == [("alloc", 4 * Z3_PART, "optimizer")] * 2
    assert flat.index(("alloc", "ds/init_grad/0", 4 * Z3_PART)) + 1 == flat.index(
        ("free", "ds/init_grad/0", 4 * Z3_PART)
    )


def test_zero2_flat_group_moved_to_the_cpu_before_0_19() -> None:
    # stage_1_and_2.py v0.12.3: move_to_cpu + empty_cache, the flat group padded to 2 x 3,
    # then the partition's .clone().float(), initialize_optimizer_states' zeros partition as
    # .grad, optimizer.step() (exp_avg, exp_avg_sq), .grad = None; no ZeRO-3 bucket
    ops = _setup(zero_stage=2, deepspeed_version="0.12.3")
    assert _flat(ops) == [
        ("alloc", "ds/flat_params", 2 * Z12_PADDED),
        ("alloc", "ds/clone/0", 2 * Z12_PART),
        ("alloc", "ds/fp32/0", 4 * Z12_PART),
        ("free", "ds/clone/0", 2 * Z12_PART),
        ("alloc", "ds/init_grad/0", 4 * Z12_PART),
        ("alloc", "ds/state/0/0", 4 * Z12_PART),
        ("alloc", "ds/state/0/1", 4 * Z12_PART),
        ("free", "ds/init_grad/0", 4 * Z12_PART),
    ]
    assert not [o for o in ops if o.key.startswith("param/")]


def test_zero2_flattens_beside_the_parameters_from_0_19() -> None:
    # stage_1_and_2.py v0.19.0: flatten_on_accelerator, the parameters' blocks freed once they
    # are views of the flat group (every one of the 139,840 bf16 elements), no empty_cache
    ops = _setup(zero_stage=2, deepspeed_version="0.19.0")
    flat_at = [o.key for o in ops].index("ds/flat_params")
    before = [o for o in ops[:flat_at] if o.key.startswith("param/")]
    after = [o for o in ops[flat_at:] if o.key.startswith("param/")]
    assert sum(o.size_bytes for o in before) == 2 * 139_840
    assert [o.action for o in after] == ["free"] * len(before)
    assert sum(o.size_bytes for o in after) == 2 * 139_840


def test_offloaded_optimizer_keeps_the_per_tensor_blocks() -> None:
    # the fp32 partitions, states and ZeRO-3's gradient buffer live on the host (stage3.py
    # ``self.device`` is the CPU under offload_optimizer): not modelled as flat blocks, the
    # per-tensor ones stay
    ops = _setup(zero_stage=3, offload="optimizer")
    assert not [o for o in ops if o.key.startswith("ds/")]
    assert [o for o in ops if o.key.startswith("param/")]


def test_zero3_sub_groups_each_get_their_partition_and_states() -> None:
    from trainmem.analytic.buffers import deepspeed_zero3_sub_groups

    # stage3.py _create_fp16_sub_groups: a group closes once it reaches sub_group_size
    assert deepspeed_zero3_sub_groups([6 * 10**8, 6 * 10**8, 3 * 10**8]) == [12 * 10**8, 3 * 10**8]
    assert deepspeed_zero3_sub_groups([4, 4, 4], sub_group_size=5) == [8, 4]
    assert deepspeed_zero3_sub_groups([]) == []
    # llama-2-7b on one rank (6,738,415,616 trainable elements, more than one 1e9 sub-group),
    # v0.12.3: per sub-group a bf16 clone then its fp32 partition; one fp32 gradient_buffer of
    # the largest; each sub-group's exp_avg and exp_avg_sq as large as its fp32 partition
    psi = 6_738_415_616
    training = TrainingConfig(
        framework="deepspeed", precision="bf16-mixed", zero_stage=3, seq_len=16,
        micro_batch_size=1, deepspeed_version="0.12.3",
    )  # fmt: skip
    est = estimate("llama-2-7b", training, engine="analytic", simulate_allocator=False)
    flat = _flat(_ops(est.schedules[0].setup))
    clones = [s for a, k, s in flat if a == "alloc" and k.startswith("ds/clone/")]
    fp32 = [s for a, k, s in flat if a == "alloc" and k.startswith("ds/fp32/")]
    states = [s for a, k, s in flat if a == "alloc" and k.startswith("ds/state/")]
    assert len(fp32) > 1 and sum(fp32) == 4 * psi and sum(clones) == 2 * psi
    assert [2 * s for s in clones] == fp32
    assert states == [s for s in fp32 for _ in range(2)]
    assert ("alloc", "ds/init_grad/0", max(fp32)) in flat
    keys = [k for a, k, _ in flat if a == "alloc"]
    assert keys.index("ds/fp32/1") < keys.index("ds/init_grad/0") < keys.index("ds/state/0/0")
