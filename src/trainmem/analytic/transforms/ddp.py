"""PyTorch DistributedDataParallel's gradient buckets as a transform.

Note [DDP gradient buckets]
    ``DistributedDataParallel`` builds a ``Reducer`` at wrap time that allocates, for every
    bucket of parameters that require grad, one flat ``bucket.gradients`` tensor of their total
    size in the parameters' dtype (torch/csrc/distributed/c10d/reducer.cpp
    ``Reducer::initialize_buckets``: ``bucket.gradients = at::empty({bucketSize}, options)``),
    kept for the life of the model. With ``gradient_as_bucket_view=False``, the default
    (torch/nn/parallel/distributed.py), each ``param.grad`` is its own tensor that the reducer
    copies into its bucket view before the all-reduce and back after it
    (``mark_variable_ready_dense``: ``bucket_view.copy_(grad)``), so a DDP rank holds the
    trainable parameters' gradients twice: once as ``.grad`` (freed by ``zero_grad``) and once
    in the buckets (never freed). Frameworks that wrap with torch DDP at ZeRO stage 0 and data
    parallelism > 1 (``FrameworkConventions.ddp_reducer_buckets``): a plain PyTorch loop, the
    HF Trainer and accelerate (``accelerator.prepare`` -> ``DistributedDataParallel``),
    Lightning Fabric's DDP strategy (lit-gpt), torchtitan's ``replicate``; not DeepSpeed or
    Megatron (their own buffers), not torchtune (FSDP). Modelled without tensor, context or
    pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op


class DdpReducer(Transform):
    """The reducer's flat gradient buckets (Note [DDP gradient buckets]), allocated at setup
    after the parameters and never freed: every trainable parameter's gradient bytes."""

    name = "ddp"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        # a gradient has its parameter's dtype (LoRA adapters fp32 where peft upcasts them)
        outer = sum(s.full_grad_bytes for s in ctx.emb_states + ctx.head_states if s.trainable)
        layer = sum(s.full_grad_bytes for s in ctx.layer_states if s.trainable)
        self.bucket_bytes = outer + ctx.num_layers * layer

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        t = ctx.training
        return (
            t.conventions.ddp_reducer_buckets
            and t.data_parallel_size > 1
            and ctx.zero_stage == 0
            and t.tensor_parallel_size == 1
            and t.context_parallel_size == 1
            and t.pipeline_parallel_size == 1
        )

    def setup(self, where: Where) -> Sequence[Emitted]:
        return (bucket_op(self.bucket_bytes),)


def bucket_op(size: int) -> Op:
    """The reducer's flat gradient buckets, ``size`` bytes (every trainable parameter's
    gradient bytes), allocated at wrap time (Note [DDP gradient buckets])."""
    label = "DDP's flat gradient buckets"
    return alloc(size, Cat.GRADIENT, "init", "ddp/buckets", "", label)
