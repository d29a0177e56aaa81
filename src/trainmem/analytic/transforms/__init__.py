"""The analytic step's mechanisms as transforms of a base autograd order (issue 25).

:mod:`~trainmem.analytic.transforms.base` holds the contract (:class:`~.base.Transform`,
:class:`~.base.RankContext`, :class:`~.base.Lifetime`, :class:`~.base.Emitter`),
:mod:`~trainmem.analytic.transforms.points` the named points; one module per mechanism holds
its transform and its Notes. :func:`active` picks the transforms of one rank in
:data:`ORDER`, the order in which their ops are emitted at a shared point.
"""

from __future__ import annotations

from trainmem.analytic.transforms.base import RankContext, Transform
from trainmem.analytic.transforms.bnb_inputs import Bnb4bitCheckpointInputs
from trainmem.analytic.transforms.checkpointing import ActivationOffloading
from trainmem.analytic.transforms.ddp import DdpReducer
from trainmem.analytic.transforms.deepspeed import DeepSpeedZero
from trainmem.analytic.transforms.deepspeed_gathers import DeepSpeedZero3Gathers
from trainmem.analytic.transforms.deepspeed_init import DeepSpeedFlatBuffers
from trainmem.analytic.transforms.dora import DoraWeightNorm
from trainmem.analytic.transforms.float8 import Float8WeightCasts
from trainmem.analytic.transforms.fsdp import FullyShardedDataParallel
from trainmem.analytic.transforms.fsdp1_reentrant import Fsdp1ReentrantInputs
from trainmem.analytic.transforms.fsdp2 import Fsdp2PostBackward
from trainmem.analytic.transforms.fsdp_pipeline import FsdpUnderPipeline
from trainmem.analytic.transforms.fsdp_units import FsdpEmbeddingHeadUnits
from trainmem.analytic.transforms.loop import TrainingLoop
from trainmem.analytic.transforms.lora import LoraFirstLayer
from trainmem.analytic.transforms.offload import TorchaoGradientOffload
from trainmem.analytic.transforms.optimizer import Optimizer
from trainmem.analytic.transforms.pipelining import Pipeline
from trainmem.analytic.transforms.quantized import QuantizedBase
from trainmem.analytic.transforms.reentrant import ReentrantRecomputedOutput
from trainmem.analytic.transforms.unsloth import UnslothOffloadedCheckpointing

ORDER: tuple[type[Transform], ...] = (
    DeepSpeedFlatBuffers,
    DeepSpeedZero,
    DeepSpeedZero3Gathers,
    FsdpEmbeddingHeadUnits,  # its units' shards exist before an optimizer in backward steps them
    Optimizer,
    TorchaoGradientOffload,
    FullyShardedDataParallel,
    Fsdp2PostBackward,
    FsdpUnderPipeline,
    ActivationOffloading,
    UnslothOffloadedCheckpointing,
    ReentrantRecomputedOutput,
    QuantizedBase,
    Float8WeightCasts,
    Pipeline,
    TrainingLoop,
    DdpReducer,
    DoraWeightNorm,
    LoraFirstLayer,
    Fsdp1ReentrantInputs,
    Bnb4bitCheckpointInputs,
)
"""Every transform, in emission order at a point they share (the order that reproduces the
recorded schedules, tests/golden)."""


def active(ctx: RankContext) -> list[Transform]:
    """The transforms that apply to the rank of ``ctx``, in :data:`ORDER`."""
    return [kind(ctx) for kind in ORDER if kind.applies(ctx)]
