"""Note [FSDP1 flat gradient of the root] (trainmem/analytic/transforms/fsdp.py) and the pending
block's start in Note [FSDP1 unshard stream pool] (trainmem/analytic/transforms/sharding.py),
with bytes by hand on Llama-2-7B under accelerate's FSDP1 (use_orig_params=False, FULL_SHARD,
bf16-mixed: bf16 gathered weights and gradients, fp32 shards), 4 ranks.

The root unit (embedding, final norm, head) is one FlatParameter: its weights' gradients are
unsharded bf16 views' gradients until the split's backward concatenates them after the
embedding's backward (torch 2.13 distributed/fsdp/_flat_param.py ``_use_unsharded_views``,
``split_with_sizes_backward``), then reduce-scattered by the root's post-backward hook
(_runtime_utils.py ``_post_backward_hook`` -> ``_reduce_grad``). A layer's post-backward hook
frees the block that layer ran on (``_post_backward_reshard``): the pool gains a third block
only when the next layer's pre-backward gathers one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from trainmem.analytic.schedule import ALL_GATHER_STREAM
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat, _format_index
from trainmem.specs.training import TrainingConfig

V, H, FF = 32000, 4096, 11008
HEAD, NORM = 2 * V * H, 2 * H  # bf16, unsharded
EMBEDDING = 2 * V * H
LAYER = 4 * 2 * H * H + 3 * 2 * H * FF + 2 * 2 * H  # q, k, v, o; gate, up, down; two norms
ROOT = HEAD + NORM + EMBEDDING
# this rank's fp32 shards of the head, the final norm and the embedding (per tensor)
ROOT_SHARDS = 4 * (V * H // 4) + 4 * (H // 4) + 4 * (V * H // 4)


def _ops(model: str = "llama-2-7b") -> Iterator[tuple[Op, str]]:
    """The measured step's ops, repeats unrolled, each with its key formatted."""
    training = TrainingConfig(
        framework="accelerate-fsdp",
        zero_stage=3,
        data_parallel_size=4,
        seq_len=512,
        micro_batch_size=1,
    )
    sched = estimate(model, training, simulate_allocator=False).schedules[0]

    def walk(items: Sequence[Item], i: int) -> Iterator[tuple[Op, str]]:
        for x in items:
            if isinstance(x, Repeat):
                for k in range(x.count):
                    yield from walk(x.body, x.index(k))
            else:
                yield x, _format_index(x.key, i)

    yield from walk(sched.step, 0)


def test_the_roots_gradients_are_views_until_its_post_backward() -> None:
    ops = list(_ops())
    views = [(op.action, op.module, op.size_bytes) for op, key in ops if "root weight" in op.label]
    # the head's and the final norm's from the head's backward, the embedding's at its own;
    # all three freed once concatenated
    assert sorted(views[:2]) == [("alloc", "head", NORM), ("alloc", "head", HEAD)]
    assert views[2] == ("alloc", "embedding", EMBEDDING)
    assert sorted(v[2] for v in views[3:] if v[0] == "free") == [NORM, HEAD, EMBEDDING]
    keys = [key for _, key in ops]
    head_view = keys.index("view_grad/head/0")
    flat = keys.index("flat_grad/root")
    assert ops[flat][0].size_bytes == ROOT
    # nothing of the root's sharded gradient before its concatenation: the head's was made
    # at the head's backward (the rule before)
    made = [
        k
        for k, (op, key) in enumerate(ops)
        if op.category == Cat.GRADIENT and op.phase == "backward" and op.module != "layers.{i}"
    ]
    assert made and min(made) > flat > head_view
    # the reduce-scatter's bf16 chunk of the (padded) flat gradient, then the fp32 shards
    rs_out = ops[keys.index("rs_out/root")][0]
    assert rs_out.size_bytes == 2 * -(-(ROOT // 2) // 4)
    assert sum(ops[k][0].size_bytes for k in made if ops[k][0].action == "alloc") == ROOT_SHARDS


def test_the_pool_holds_two_layers_through_the_first_layers_reduce_scatter_then_three() -> None:
    live: dict[str, int] = {}
    at: dict[str, list[int]] = {"rs_out/layer": [], "flat_grad/layer": [], "rs_out/root": []}
    for op, key in _ops():
        if op.stream == ALL_GATHER_STREAM:
            if op.action == "alloc":
                live[key] = op.size_bytes
            else:
                live.pop(key)
        if op.action == "alloc" and key in at:
            at[key].append(sum(live.values()))
    # R + 2 L through the first backward layer (31), R + 3 L from layer 30 on: at layer 0 (it
    # prefetches none, so the limiter dequeues nothing) layers 2's and 1's frees are pending
    # beside its own block, and after it, through the embedding's backward and the root's
    # reduce-scatter, layers 2's, 1's and 0's (_limiter_utils.py: two in flight, dequeued
    # only by an unshard)
    assert at["rs_out/layer"][0] == at["flat_grad/layer"][0] == ROOT + 2 * LAYER
    assert set(at["flat_grad/layer"][1:]) == {ROOT + 3 * LAYER}
    assert at["rs_out/root"] == [ROOT + 3 * LAYER]


def test_a_tied_embeddings_lookup_gradient_is_added_out_of_place() -> None:
    # llama-3.2-1b ties its 128,256 x 2,048 embedding to the head: one view of the root's flat
    # parameter, whose gradient from the head's backward waits for the lookup's
    tied = 2 * 128256 * 2048
    live: dict[str, int] = {}
    at_sum: list[int] = []
    flat = 0
    for op, key in _ops("llama-3.2-1b"):
        if op.action == "alloc":
            live[key] = op.size_bytes
        else:
            live.pop(key)
        if op.action == "alloc" and key == "view_grad/tied":
            at_sum = sorted(size for size in live.values() if size == tied)
        if op.action == "alloc" and key == "flat_grad/root":
            flat = op.size_bytes
            # the head's view and the lookup's gradient freed before the concatenation
            assert sorted(size for size in live.values() if size == tied) == [tied]
    # the head's view gradient, the lookup's and their sum (the gathered root is 4 KiB more)
    assert at_sum == [tied] * 3
    assert flat == tied + 2 * 2048  # the tied weight once, and the final norm
