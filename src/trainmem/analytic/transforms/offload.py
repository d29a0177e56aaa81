"""torchao's CPU offload of the gradients as a transform: each offloaded gradient freed on the
GPU by the post-accumulate-grad hook that copies it to the CPU.

Note [torchao gradient offload]
    torchao's ``CPUOffloadOptimizer(offload_gradients=True)`` (``offload="optimizer+gradients"``
    without ZeRO / FSDP under a framework with ``FrameworkConventions.
    optimizer_offload_torchao``: the plain loop, torchtune's low-memory recipes) registers on
    every trainable parameter of at least ``minimal_size`` (4096) elements a post-accumulate-grad
    hook that copies ``p.grad`` to the parameter's pinned CPU gradient on a side stream, then
    ``p.grad.record_stream(stream)`` and ``p.grad = None`` (torchao 0.18 optim/cpu_offload.py
    ``CPUOffloadOptimizer.__init__``, ``backward_hook``). torch runs the hook as soon as
    ``AccumulateGrad`` has stored the gradient (torch/_tensor.py
    ``register_post_accumulate_grad_hook``; a tied weight's once the lookup's part is added),
    and the caching allocator lowers its allocated bytes at that free, before the block, which
    the side stream still uses, can be reused (c10/cuda/CUDACachingAllocator.cpp ``free``:
    ``allocated_bytes`` decreased, then ``insert_events`` for a block with stream uses). So an
    offloaded gradient is allocated only from its op's backward to its hook: made and freed
    where its linear's backward makes it (Note [Gradients where their linear's backward
    runs]); the smaller parameters keep theirs on the GPU (with their optimizer there). Not
    modelled: the freed block's reuse waiting for its copy (reserved memory only).

    Before, both engines kept each offloaded gradient until its layer's backward was done (the
    formulas as one layer-sized unsharded bucket, the trace as the layer's gradients): on the
    agreement model (benchmarks/generic_options.py: a 2-layer 2048-wide Llama, vocabulary
    4096, 2 x 256 tokens, bf16 autocast, AdamW) the formulas peaked at 932,937,728 B, with the
    180,371,456 B bucket beside the MLP's backward transients, and the trace at 812,335,672 B,
    with three of layer 1's 46,137,344 B MLP gradients (-12.9 %); with the rule the trace
    peaks at the head's gradient, 797,649,464 B, the formulas in the loss's forward,
    791,357,440 B (+0.8 %), at most one offloaded gradient alive in either.

Source: torchao optim/cpu_offload.py, torch/_tensor.py (cited per rule above).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    gradient_ops,
)
from trainmem.analytic.transforms.sharding import group_states
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase


def torchao_gradient_offload(training: TrainingConfig) -> bool:
    """The gradients are offloaded by torchao's ``CPUOffloadOptimizer(offload_gradients=True)``
    (Note [torchao gradient offload])."""
    return training.torchao_cpu_offload and training.offload == "optimizer+gradients"


class TorchaoGradientOffload(Transform):
    """torchao's gradient offload (Note [torchao gradient offload]).

    Makes every gradient where the base order does: kept on the GPU (a parameter under 4096
    elements), or, offloaded, allocated and freed at once (a tied weight's freed at
    ``embedding.post_backward``, once the lookup's part is added); a layer's, each at its
    tensor's place.
    """

    name = "torchao-gradient-offload"
    places_layer_gradients = True

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return torchao_gradient_offload(ctx.training)

    def _sent(self, n: int, state: TensorState, key: str, module: str) -> Op:
        """The ``n``-th tensor's gradient on the GPU until its hook sends it to the CPU (0 bytes
        for a gradient kept on the GPU)."""
        sent = state.trainable and not state.grad_bytes
        return alloc(
            state.full_grad_bytes if sent else 0,
            Cat.GRADIENT,
            "backward",
            f"sent_grad/{key}/{n}",
            module,
            "a gradient until its post-accumulate-grad hook copies it to the CPU",
            self.ctx.grad_stream,
        )

    def _tied(self, group: str, state: TensorState) -> bool:
        return group == "head" and state.name == "embedding/tokens"

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        states, key, module = group_states(self.ctx, group)
        kept = gradient_ops(self.ctx, states, "backward", key, module)
        b: Phase = "backward"
        out: list[Op] = []
        for n, (state, op) in enumerate(zip(states, kept, strict=True)):
            sent = self._sent(n, state, key, module)
            tied = self._tied(group, state)
            out += [op, sent] if tied else [op, sent, free(sent, b)]
        return out  # torchao's offload refuses gradient accumulation: every batch is new

    def embedding_post_backward(self, where: Where) -> Sequence[Emitted]:
        states, key, module = group_states(self.ctx, "head")
        b: Phase = "backward"
        return [
            free(self._sent(n, s, key, module), b)
            for n, s in enumerate(states)
            if self._tied("head", s)
        ]
