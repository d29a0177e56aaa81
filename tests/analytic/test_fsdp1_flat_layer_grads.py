"""Note [FSDP1 flat gradient of a layer unit] (trainmem/analytic/transforms/fsdp.py): under
FSDP1 with ``use_orig_params=False`` a trainable layer unit's weights are views of its flat
parameter, so autograd makes each weight's unsharded gradient where its op's backward runs and
concatenates them into the flat gradient at the layer's end (torch 2.13 distributed/fsdp/
_flat_param.py ``_use_unsharded_views``; ``split_with_sizes_backward``), which the
post-backward hook reduce-scatters (_runtime_utils.py ``_post_backward_hook``)."""

from __future__ import annotations

from typing import Any

from trainmem.analytic.schedule import REDUCE_SCATTER_STREAM
from trainmem.estimate import estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.training import TrainingConfig

# Llama-2-7B, bf16: q, o 4096 x 4096; k, v the same (no GQA); gate, up, down 4096 x 11008;
# two norms of 4096
ATTENTION = 2 * 4096 * 4096
MLP = 2 * 4096 * 11008
NORM = 2 * 4096
LAYER = 4 * ATTENTION + 3 * MLP + 2 * NORM


def _layer_gradient_ops(framework: str) -> list[tuple[str, str, int, int]]:
    """(action, key, bytes, stream) of the layer gradients' ops in a backward layer body of the
    measured step: 4 ranks, bf16-true, full fine-tune, full checkpointing."""
    training = TrainingConfig(
        framework=framework,
        zero_stage=3,
        data_parallel_size=4,
        precision="bf16-true",
        seq_len=512,
        micro_batch_size=1,
        activation_checkpointing="full",
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    out: list[tuple[str, str, int, int]] = []

    def walk(items: Any) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body)
            elif isinstance(x, Op) and x.phase == "backward" and x.module == "layers.{i}":
                if x.key.startswith(("view_grad/", "flat_grad", "rs_out", "grad/", "reduce")):
                    out.append((x.action, x.key.split("/")[0], x.size_bytes, x.stream))

    walk(sched.step)
    end = out.index(("free", "flat_grad", LAYER, 0))
    return out[: end + 1]


def test_accelerate_fsdp1_makes_the_flat_gradient_at_the_layer_end() -> None:
    ops = _layer_gradient_ops("accelerate-fsdp")
    views = [size for action, key, size, _ in ops if action == "alloc" and key == "view_grad"]
    # the down projection's first (beside the MLP's transients), then gate's, up's and the
    # attention output projection's, then q's, k's, v's and the norms': the whole layer,
    # unsharded (Note [Gradients where their linear's backward runs])
    assert views[0] == MLP
    assert sorted(views[1:4]) == [ATTENTION, MLP, MLP]
    assert sorted(views[4:]) == [NORM] * 2 + [ATTENTION] * 3
    assert sum(views) == LAYER
    # then their concatenation, the views freed, this rank's quarter on the post-backward
    # stream (bf16-true: the reduce dtype is the gradient's, no cast), the concatenation freed
    flat = ops.index(("alloc", "flat_grad", LAYER, 0))
    assert all(key == "view_grad" for _, key, _, _ in ops[:flat])
    after = ops[flat + 1 :]
    assert [a for a, key, _, _ in after if key == "view_grad"] == ["free"] * 9
    grads = [(size, stream) for a, key, size, stream in after if a == "alloc" and key == "grad"]
    assert sum(size for size, _ in grads) == LAYER // 4
    assert {stream for _, stream in grads} == {REDUCE_SCATTER_STREAM}
    # no whole-layer reduce bucket from the MLP's backward on (the rule before)
    assert not [key for _, key, _, _ in ops if key == "reduce"]
