"""Note [FSDP1 NO_SHARD's 16-bit copy] for a full fine-tune (trainmem/analytic/transforms/
sharding.py, fsdp1_flat.py), bytes by hand on Llama-2-7B under accelerate's FSDP1 ``NO_SHARD``
(4 ranks, bf16-mixed: each unit's bf16 copy is its unsharded parameter, fp32 gradients).

torch 2.13 distributed/fsdp: ``_should_free_in_backward`` is False for NO_SHARD, so no free
event is queued and ``post_reshard`` frees a unit's copy at once: after its forward, the root's
after the head's; in the backward ``_post_backward_hook`` reshards before
``_reduce_grad_no_shard`` all-reduces the concatenated bf16 gradient in place and casts it to
fp32 (``_cast_grad_to_param_dtype``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from trainmem.breakdown import MemoryCategory as Cat
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat, _format_index
from trainmem.specs.training import TrainingConfig

V, H, FF = 32000, 4096, 11008
LAYER = 4 * 2 * H * H + 3 * 2 * H * FF + 2 * 2 * H  # bf16: q, k, v, o; gate, up, down; norms
ROOT = 2 * (2 * V * H + H)  # bf16: embedding, head, final norm
GATHERS = ("gather/root", "gather/a", "gather/b")


def _ops() -> Iterator[tuple[Op, str]]:
    training = TrainingConfig(
        framework="accelerate-fsdp",
        zero_stage=0,  # --fsdp no-shard
        data_parallel_size=4,
        seq_len=512,
        micro_batch_size=1,
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]

    def walk(items: Sequence[Item], i: int) -> Iterator[tuple[Op, str]]:
        for x in items:
            if isinstance(x, Repeat):
                for k in range(x.count):
                    yield from walk(x.body, x.index(k))
            else:
                yield x, _format_index(x.key, i)

    yield from walk(sched.step, 0)


def test_each_layer_runs_on_its_copy_and_the_next_ones_layer_0_on_its_own() -> None:
    live: dict[str, int] = {}
    at_flat: list[int] = []
    forward_most = 0
    for op, key in _ops():
        if key in GATHERS:
            if op.action == "alloc":
                live[key] = op.size_bytes
            else:
                live.pop(key)
            if op.phase == "forward":
                forward_most = max(forward_most, sum(live.values()))
        if op.action == "alloc" and key == "flat_grad/layer":
            at_flat.append(sum(live.values()))
    # 31 layers with their copy and the prefetched next one, layer 0 with its own only
    assert at_flat == [ROOT + 2 * LAYER] * 31 + [ROOT + LAYER]
    # the forward prefetches none: the root's copy and the running layer's
    assert forward_most == ROOT + LAYER


def test_the_copy_is_freed_before_the_fp32_cast() -> None:
    ops = list(_ops())
    keys = [key for _, key in ops]
    flat = keys.index("flat_grad/layer")  # layer 31's
    end = keys.index("flat_grad/layer", flat + 1)  # its free
    between = [(op.action, key, op.size_bytes) for op, key in ops[flat + 1 : end]]
    reshard = between.index(("free", "gather/b", LAYER))
    grads = [k for k, (a, key, _) in enumerate(between) if a == "alloc" and key.startswith("grad/")]
    assert grads and min(grads) > reshard
    # the fp32 gradient: twice the bf16 concatenation's bytes
    assert sum(between[k][2] for k in grads) == 2 * LAYER
    # the root: its copy freed before its fp32 gradients, which are twice its concatenation
    root = keys.index("flat_grad/root")
    tail = [(op.action, key, op.size_bytes, op.category) for op, key in ops[root:]]
    assert tail[0][2] == ROOT
    freed = tail.index(("free", "gather/root", ROOT, Cat.TEMPORARY))
    made = [k for k, t in enumerate(tail) if t[0] == "alloc" and t[3] == Cat.GRADIENT]
    assert made and min(made) > freed
    assert sum(tail[k][2] for k in made) == 2 * ROOT


def test_without_mixed_precision_the_concatenation_is_the_kept_gradient() -> None:
    # bf16-true: no 16-bit copies, and _cast_grad_to_param_dtype keeps a gradient of the
    # parameter's dtype, so each layer's gradient (bf16, LAYER bytes) is made by the
    # concatenation while its views' gradients (LAYER bytes) are alive, then they are freed
    training = TrainingConfig(
        framework="accelerate-fsdp", zero_stage=0, data_parallel_size=4, seq_len=512,
        micro_batch_size=1, precision="bf16-true",
    )  # fmt: skip
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    views = made = 0
    at_made: list[int] = []

    def once(items: Sequence[Item]) -> Iterator[Op]:  # each repeated body once
        for x in items:
            yield from once(x.body) if isinstance(x, Repeat) else (x,)

    for op in once(sched.step):
        if op.phase == "backward" and op.module == "layers.{i}":
            if op.key.startswith("view_grad/"):
                views += op.size_bytes if op.action == "alloc" else -op.size_bytes
            elif op.category == Cat.GRADIENT and op.action == "alloc":
                made += op.size_bytes
                at_made.append(views)
            assert not op.key.startswith(("flat_grad", "gather/"))
    # each backward layer body (the stack's first, middle and last runs) makes one layer's
    assert made and made % LAYER == 0
    assert set(at_made) == {LAYER}


def test_a_later_micro_batch_casts_the_kept_gradient_twice() -> None:
    # with 2 micro-batches the second's hook finds the kept fp32 gradient (its concatenation
    # added in place): a bf16 copy for the all-reduce (LAYER bytes) and a new fp32 gradient
    # (2 LAYER) beside the kept one, freed when the hook returns
    training = TrainingConfig(
        framework="accelerate-fsdp", zero_stage=0, data_parallel_size=4, seq_len=512,
        micro_batch_size=1, gradient_accumulation_steps=2,
    )  # fmt: skip
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]

    def once(items: Sequence[Item]) -> Iterator[Op]:
        for x in items:
            yield from once(x.body) if isinstance(x, Repeat) else (x,)

    later = [
        (op.key, op.size_bytes)
        for op in once(sched.step)
        if op.action == "alloc" and op.key.startswith(("ns_copy/layer", "ns_cast/layer"))
    ]
    assert later and set(later) == {("ns_copy/layer", LAYER), ("ns_cast/layer", 2 * LAYER)}
