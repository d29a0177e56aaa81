"""FSDP2's layer gradients are unsharded until the layer's post-backward, and its backward
gathers a layer by copy-out (Note [FSDP2 post-backward], analytic/transforms/fsdp2.py).

torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py: autograd makes each weight's
``.grad`` on the unsharded parameter, in the unsharded parameters' dtype, where its linear's
backward runs; ``post_backward`` takes them off the parameters, reshards the layer (frees its
unsharded parameters), releases the previous layer's reduce-scatter input, and
``foreach_reduce`` (_fsdp_collectives.py) copies them into this layer's reduce-scatter input
in the reduce dtype, drops them, and leaves the reduce-scatter's output (this rank's shard) as
the sharded ``.grad``. ``wait_for_unshard`` copies a layer's unsharded parameters out of its
all-gather output (``foreach_all_gather_copy_out``) and, in backward, frees that output at once;
the layer's pre-backward then prefetches the next layer's all-gather (none after layer 0).

The agreement model (a 2-layer 2048-wide Llama, 4 KV heads of 128, MLP 5632, vocabulary 4096,
untied) at 2 x 256 tokens, FSDP2 over 4 ranks, torchtitan's policy (bf16 parameters, fp32
reduce). One layer has 2048 x 2048 (q, o) x 2 + 2048 x 512 (k, v) x 2 + 2048 x 5632 x 3 (gate,
up, down) + 2048 x 2 (norms) = 45,092,864 elements.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MODELS_DIR, layer_bodies
from trainmem.estimate import MemoryEstimate, estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H = 2 * 256, 2048
LAYER = 2 * H * H + 2 * H * 512 + 3 * H * 5632 + 2 * H  # 45,092,864 elements
FSDP2 = {"data_parallel_size": 4, "zero_stage": 3, "framework": "fsdp2"}


def _estimate(**changes: object) -> MemoryEstimate:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **FSDP2, **changes)  # type: ignore[arg-type]
    return estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)


def _backward_bodies(**changes: object) -> list[list[Op]]:
    """The layer bodies of the backward (those holding the MLP's transients), in order."""
    return layer_bodies(_estimate(**changes).schedules[0].step)


def test_layer_gradients_are_unsharded_bf16_where_their_linear_runs() -> None:
    body = _backward_bodies()[0]
    made = [op for op in body if op.action == "alloc" and op.key.startswith("layer_grad/")]
    # 2 B (bf16, the unsharded parameters' dtype) x each weight's full elements, in the
    # backward's order: down first, then gate and up, o, then q, k, v and the norms
    assert sorted(op.size_bytes for op in made) == sorted(
        2 * n for n in [H * H, H * 512, H * 512, H * H, H * 5632, H * 5632, H * 5632, H, H]
    )
    assert made[0].size_bytes == 2 * H * 5632
    keys = [(op.action, op.key) for op in body]
    mlp_end = keys.index(("free", "mlp_tmp"))
    assert keys.index(("alloc", made[0].key)) < mlp_end < keys.index(("alloc", made[1].key))
    # no sharded gradient during the layer's backward
    sharded = [k for k, op in enumerate(body) if op.category.value == "gradients"]
    assert min(sharded) > max(keys.index(("alloc", op.key)) for op in made)


def test_post_backward_reshards_then_reduce_scatters_then_leaves_the_shard() -> None:
    for body in _backward_bodies():
        keys = [(op.action, op.key) for op in body]
        reshard = keys.index(("free", "gather/unsharded"))
        rs_input = keys.index(("alloc", "reduce/{i}"))
        dropped = [k for k, (a, key) in enumerate(keys) if a == "free" and "layer_grad/" in key]
        shards = [k for k, op in enumerate(body) if op.category.value == "gradients"]
        assert reshard < rs_input < min(dropped) and max(dropped) < min(shards)
        rs = body[rs_input]
        assert rs.size_bytes == 4 * LAYER  # fp32 reduce dtype
        # this rank's shard in fp32: a quarter of the layer
        assert sum(body[k].size_bytes for k in shards) == 4 * LAYER // 4


def test_only_layer_zero_prefetches_nothing() -> None:
    first, last = _backward_bodies()  # layer 1 (runs first), layer 0 (runs last)
    for body, prefetch in ((first, True), (last, False)):
        keys = [(op.action, op.key) for op in body]
        copy_out = keys.index(("alloc", "gather/unsharded"))
        assert keys.index(("free", "gather/a")) == copy_out + 1  # the all-gather output goes
        assert (("alloc", "gather/a") in keys) is prefetch


def test_peak_is_layer_zero_copy_out_as_on_the_trace() -> None:
    # Layer 0's copy-out, before its all-gather output is freed: both bf16 copies of the layer
    # (2 x 2 B x LAYER), layer 1's fp32 reduce-scatter input (4 B x LAYER) and its fp32 shard
    # (LAYER B), the root's bf16 gathered embedding, head and final norm (2 B x (2 x 4096 x H
    # + H)), the head's and final norm's unsharded bf16 gradients (2 B x (4096 x H + H)), the
    # two 8,519,680 B cuBLAS workspaces and the residual stream's bf16 gradient (2 B x T x H).
    est = _estimate()
    peak = est.schedules[0].peak()
    assert peak.label == "the layer's unsharded parameters, copied out of its all-gather output"
    by = {c.value: b for c, b in peak.by_category.items()}
    assert by["temporary"] == (
        2 * 2 * LAYER
        + 4 * LAYER
        + 2 * (2 * 4096 * H + H)
        + 2 * (4096 * H + H)
        + 2 * 8_519_680
        + 2 * T * H
    )
    assert by["gradients"] == LAYER
    # torch's FSDP2 traced on fake tensors (the generic path): 841,472,544 B; the formulas'
    # per-weight sharded gradients made during the layer's backward put them 3.5 % above
    assert abs(est.breakdown.allocated_bytes / 841_472_544 - 1) < 0.001


def test_accumulation_adds_the_reduce_scatter_output_into_the_kept_shard() -> None:
    bodies = _backward_bodies(gradient_accumulation_steps=2)
    later = [b for b in bodies if any(op.key == "rs_output" for op in b)]
    assert later  # the second micro-batch's layers
    for body in later:
        added = next(op for op in body if op.key == "rs_output" and op.action == "alloc")
        assert added.size_bytes == LAYER  # the fp32 shard, freed once added
        assert not [op for op in body if op.category.value == "gradients"]


def _tied(tmp_path: Path) -> str:
    config = json.loads(Path(AGREEMENT).read_text())
    config.update(tie_word_embeddings=True, vocab_size=32768)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _walk(items: tuple[object, ...]) -> list[Op]:
    out: list[Op] = []
    for x in items:
        out += _walk(x.body) if isinstance(x, Repeat) else [x] if isinstance(x, Op) else []
    return out


def test_tied_sum_is_out_of_place_without_autocast(tmp_path: Path) -> None:
    # Note [FSDP2 root group]: under torchtitan's bf16 policy the head's weight gradient is a
    # view (storage shared with its base), so the lookup's is added out of place: three
    # 2 B x 32768 x 2048 blocks at once (the head's, the lookup's, their sum)
    vocab = 2 * 32768 * H
    model = _tied(tmp_path)
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **FSDP2)  # type: ignore[arg-type]
    est = estimate(model, training, engine="analytic", simulate_allocator=False)
    ops = _walk(est.schedules[0].step)
    keys = [(op.action, op.key) for op in ops]
    sum_at = keys.index(("alloc", "grad/embedding/tied_sum"))
    assert ops[sum_at].size_bytes == vocab
    assert keys.index(("alloc", "grad/embedding/vocab")) < sum_at
    assert sum_at < keys.index(("free", "root_grad/head/0"))  # the head's, the tied weight's
    assert est.schedules[0].peak().label == (
        "the tied weight's gradient: the head's plus the lookup's, added out of place"
    )
    # under autocast (the plain loop's ZeRO-3: fp32 unsharded weights, cast for the head) the
    # head's gradient is the cast's fresh fp32 tensor: added in place, no sum
    amp = TrainingConfig(micro_batch_size=2, seq_len=256, data_parallel_size=4, zero_stage=3)
    est = estimate(model, amp, engine="analytic", simulate_allocator=False)
    assert not [op for op in _walk(est.schedules[0].step)
                if op.key == "grad/embedding/tied_sum" and op.size_bytes]  # fmt: skip
