"""The transforms' contract (issue 25): a transform fed a rank's model states, as a trace would
measure them, inserts its tensors into a recorded step at named points; its lifetimes free
what it allocates."""

from __future__ import annotations

import pytest

from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms import ORDER, active
from trainmem.analytic.transforms.base import (
    Emitter,
    Lifetime,
    PipelineRank,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    splice,
)
from trainmem.analytic.transforms.deepspeed import DeepSpeedZero
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Op, StepSchedule
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

BUCKET = 1_000  # reduce_bucket_size, elements
LAYER = 4_000  # trainable elements of one (measured) layer
LAYERS = 3


def _context(**fields: object) -> RankContext:
    training = TrainingConfig(
        framework="deepspeed", data_parallel_size=4, reduce_bucket_size=BUCKET, **fields
    )
    g = 2  # bf16 gradients
    layer = TensorState("layers.0", "q", LAYER, True, 0, 0, 0, 2 * LAYER, g * LAYER)
    return RankContext(
        model=load_model_spec("gpt2"),
        training=training,
        rank=PipelineRank(0, LAYERS, 1, False, False),
        emb_states=[],
        head_states=[],
        layer_states=[layer],
        head_grad_states=[],
        emb_grad_states=[],
        num_layers=LAYERS,
        zero_stage=training.zero_stage,
        grad_stream=0,
    )


def _recorded_step() -> list[Op]:
    """A flat traced step: one activation saved in the forward, freed in the backward, and
    an optimizer phase with nothing of its own."""
    act = alloc(10_000, Cat.ACTIVATION, "forward", "b0", "layers.0")
    marker = alloc(0, Cat.TEMPORARY, "optimizer", "b1", "(optimizer)")
    return [act, free(act, "backward"), marker, free(marker, "optimizer")]


def test_deepspeed_zero2_on_a_recorded_step() -> None:
    ctx = _context(zero_stage=2)
    assert DeepSpeedZero.applies(ctx)
    positions = {"backward.begin": 1, "micro_batch.end": 2, "optimizer.step": 3,
                 "optimizer.end": 3}  # fmt: skip
    out = splice(_recorded_step(), positions, [DeepSpeedZero(ctx)])
    added = [(op.action, op.size_bytes) for op in out if op not in _recorded_step()]
    # DeepSpeed stage_1_and_2.py: one bf16 bucket of reduce_bucket_size (overlap_comm off
    # below stage 3); at the step the rank's partition of the 12,000 trainable elements,
    # padded to a multiple of 2 x 4 and split 4 ways (3,000), flattened in bf16 (6,000 B) then
    # copied to fp32 (12,000 B), the bf16 copy freed first; before them step() takes the
    # gradient norm (step -> scaled_global_norm -> get_grad_norm_direct, v0.16.4 lines
    # 1857 / 1699: ``g.data.double()``), an fp64 copy of the rank's one 3,000-element piece
    # (24,000 B), freed once its norm is taken
    assert added == [
        ("alloc", 2 * BUCKET),
        ("free", 2 * BUCKET),
        ("alloc", 24_000),
        ("free", 24_000),
        ("alloc", 6_000),
        ("alloc", 12_000),
        ("free", 6_000),
        ("free", 12_000),
    ]
    assert [op.phase for op in out[1:3]] == ["backward", "backward"]  # bucket, then act freed
    # the backward's high is the saved activation and the bucket; the step's, the fp64 norm
    # copy alone (24,000 B), above both partition copies together (6,000 + 12,000 B)
    backward = [op for op in out if op.phase != "optimizer"]
    assert _max_live(backward) == 10_000 + 2 * BUCKET
    peak = StepSchedule(setup=(), step=tuple(out)).peak()
    assert (peak.peak_bytes, peak.phase) == (max(3_000 * 8, 6_000 + 12_000), "optimizer")


def _max_live(ops: list[Op]) -> int:
    live = high = 0
    for op in ops:
        live += op.size_bytes if op.action == "alloc" else -op.size_bytes
        high = max(high, live)
    return high


def test_zero2_fresh_partition_only_after_the_first_micro_batch() -> None:
    ctx = _context(zero_stage=2, gradient_accumulation_steps=2)
    ds = DeepSpeedZero(ctx)
    assert ds.stack_pre_backward(Where(new_grads=True)) == ()
    (fresh,) = ds.stack_pre_backward(Where(new_grads=False))
    assert isinstance(fresh, Lifetime)
    assert fresh.op.size_bytes == 2 * 3_000  # a bf16 partition (see above)
    assert fresh.release == "micro_batch.end"


def test_lifetimes_free_last_allocated_first() -> None:
    class Two(Transform):
        def backward_begin(self, where: Where) -> list[Lifetime]:
            ops = [alloc(n, Cat.TEMPORARY, "backward", f"k{n}") for n in (1, 2)]
            return [Lifetime(op, "micro_batch.end") for op in ops]

    em = Emitter([Two(_context())])
    assert [op.size_bytes for op in em.at("backward.begin", Where())] == [1, 2]
    with pytest.raises(ScheduleError, match="never released"):
        em.check()
    frees = em.at("micro_batch.end", Where())
    assert [(op.action, op.size_bytes) for op in frees] == [("free", 2), ("free", 1)]
    em.check()


def test_splice_refuses_points_out_of_step_order() -> None:
    ctx = _context(zero_stage=2)
    with pytest.raises(ScheduleError, match="step order"):
        splice(_recorded_step(), {"backward.begin": 3, "micro_batch.end": 1}, [DeepSpeedZero(ctx)])


def test_a_plain_run_has_no_deepspeed_transform() -> None:
    ctx = _context(zero_stage=2)
    plain = RankContext(**{**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__},
                           "training": TrainingConfig()})  # fmt: skip
    assert DeepSpeedZero not in {type(t) for t in active(plain)}
    assert DeepSpeedZero in ORDER
