"""torchao's ``CPUOffloadOptimizer(offload_gradients=True)`` frees each gradient of at least
4096 elements in the post-accumulate-grad hook that copies it to the CPU, as soon as it is made
(Note [torchao gradient offload], analytic/transforms/offload.py; torchao optim/cpu_offload.py
``backward_hook``).

The agreement model (a 2-layer 2048-wide Llama, 4 KV heads of 128, MLP 5632, vocabulary 4096,
untied) at 2 x 256 tokens under the plain loop's bf16 autocast: fp32 parameters, so fp32
gradients, 4 B per element. The norms (2048 elements) keep theirs on the GPU.
"""

from __future__ import annotations

from conftest import MODELS_DIR, layer_bodies
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import MemoryEstimate, estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
H = 2048


def _estimate() -> MemoryEstimate:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, offload="optimizer+gradients")
    return estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)


def _all_ops(items: tuple[object, ...]) -> list[Op]:
    out: list[Op] = []
    for x in items:
        out += _all_ops(x.body) if isinstance(x, Repeat) else [x] if isinstance(x, Op) else []
    return out


def test_each_offloaded_gradient_is_freed_as_it_is_made() -> None:
    est = _estimate()
    body = layer_bodies(est.schedules[0].step)[0]
    sent = [k for k, op in enumerate(body) if op.action == "alloc" and op.size_bytes
            and op.key.startswith("sent_grad/")]  # fmt: skip
    # fp32: 4 B x each weight's elements, the down projection's first
    assert [body[k].size_bytes for k in sent][0] == 4 * H * 5632
    assert sorted(body[k].size_bytes for k in sent) == sorted(
        4 * n for n in [H * H, H * 512, H * 512, H * H, H * 5632, H * 5632, H * 5632]
    )
    for k in sent:
        assert (body[k + 1].action, body[k + 1].key) == ("free", body[k].key)
    # the two norms' gradients stay on the GPU (4 B x 2048), until zero_grad
    kept = [op for op in body if op.category.value == "gradients" and op.size_bytes
            and not op.key.startswith("sent_grad/")]  # fmt: skip
    assert [op.size_bytes for op in kept] == [4 * H, 4 * H]
    assert all(op.action == "alloc" for op in kept)
    # no layer-sized reduce bucket (ZeRO-Offload's) anywhere in the step
    assert not [op for op in _all_ops(est.schedules[0].step) if op.key == "reduce"]


def test_at_most_one_offloaded_gradient_is_alive() -> None:
    # the most gradient bytes at once: layer 0's down projection's fp32 gradient (4 B x 2048 x
    # 5632, the largest, made while the final norm's and layer 1's two norms' kept gradients,
    # 3 x 4 B x 2048, exist); the embedding's and the head's (4 B x 4096 x 2048) are smaller.
    # Before the rule a 180,371,456 B layer bucket stood for them (ZeRO-Offload's reduce
    # bucket) and the formulas were 12.9 % above the trace, which kept the layer's gradients
    # until its end; the trace (generic path) now peaks at 797,649,464 B
    est = _estimate()
    assert est.schedules[0].category_peak(MemoryCategory.GRADIENT) == 4 * H * 5632 + 3 * 4 * H
    assert abs(est.breakdown.allocated_bytes / 797_649_464 - 1) < 0.01
