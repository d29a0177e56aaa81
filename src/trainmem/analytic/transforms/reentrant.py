"""torch's reentrant activation checkpoint as a transform: the recomputed layer's output held
through the layer's backward.

Note [Reentrant checkpoint's recomputed output]
    torch's reentrant checkpoint (torch/utils/checkpoint.py ``CheckpointFunction.backward``,
    the same code at torch 2.2.2 and 2.13) recomputes the layer under ``enable_grad``, binding
    ``outputs = ctx.run_function(*detached_inputs)``, collects ``outputs_with_grad`` and runs
    ``torch.autograd.backward(outputs_with_grad, args_with_grad)``; it returns only the
    inputs' gradients. So the recomputed layer's output stays alive from the end of the
    recompute until the layer's backward has returned. A decoder layer's output is ``residual
    + hidden_states`` (transformers 4.40 modeling_llama.py ``LlamaDecoderLayer.forward``:
    ``outputs = (hidden_states,)``), a new tensor of the residual stream's size (r b s h) that
    no node saves (an add's backward reads no input): without the binding it would be freed
    as the recompute returned. The schedule makes it at ``layer.backward`` (after the
    recomputed activations) and frees it at ``layer.post_backward``. The layer's incoming
    gradient (``args``) is the residual-stream gradient the base order already holds there.
    The recompute's own peak comes before the output exists (Note [The recompute's tensors
    held at an autocast down projection]: under autocast LoRA it is the step's, the same
    bytes as non-reentrant's).

    Where it applies: full checkpointing by torch's reentrant checkpoint. transformers'
    gradient checkpointing before 5.0 (:attr:`~trainmem.specs.training.TrainingConfig.
    hf_checkpoint_reentrant`), and Answer.AI fsdp_qlora's train.py, which wraps each decoder
    layer in ``checkpoint_wrapper(checkpoint_impl=CheckpointImpl.REENTRANT)`` under
    ``--reentrant_checkpointing True`` (train.py 50efa1e, which the README asks for with
    bitsandbytes and every command of benchmarks_03_2024.md passes; torch 2.2.2
    distributed/algorithms/_checkpoint/checkpoint_wrapper.py: ``use_reentrant=(
    self.checkpoint_impl == CheckpointImpl.REENTRANT)``). Unsloth's own patched checkpoint
    holds its output the same way and is modelled by its transform (Note [Recomputed output
    held through the backward] in trainmem/analytic/transforms/unsloth.py). Non-reentrant
    checkpointing recomputes inside the saved tensors' unpack hooks and keeps only what the
    nodes saved, not the output.

Source: torch/utils/checkpoint.py ``CheckpointFunction.backward``; fsdp_qlora train.py
(50efa1e) ``apply_activation_checkpointing``; transformers modeling_utils.py
``gradient_checkpointing_enable``.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.checkpointing import layer_checkpoint_reentrant
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.analytic.transforms.unsloth import unsloth_offload_patched
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

KEY = "reentrant_output"
LABEL = "the recomputed layer's output, held by the reentrant checkpoint's backward"


def torch_reentrant_checkpoint(training: TrainingConfig) -> bool:
    """Full checkpointing runs torch's reentrant ``CheckpointFunction`` (Note [Reentrant
    checkpoint's recomputed output]): fsdp_qlora's ``CheckpointImpl.REENTRANT``, or
    transformers' gradient checkpointing where it is reentrant; not Unsloth's patched
    checkpoint (its own transform)."""
    t = training
    if t.activation_checkpointing != "full" or unsloth_offload_patched(t):
        return False
    return layer_checkpoint_reentrant(t)


def reentrant_output_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the recomputed layer's output the reentrant checkpoint holds through the
    layer's backward: r b s h (r the residual stream's bytes per value; divided as the
    layer input is under sequence / context parallelism); 0 where it does not apply.

    Source: torch/utils/checkpoint.py ``CheckpointFunction.backward`` (Note [Reentrant
    checkpoint's recomputed output])."""
    if not torch_reentrant_checkpoint(training) or model.architecture != "decoder":
        return 0
    _, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return r * model.hidden_size * t // parallel_divisor("mlp/input", training)


class ReentrantRecomputedOutput(Transform):
    """Inserts: ``layer.backward`` the recomputed layer's output
    (:func:`reentrant_output_bytes`), freed at ``layer.post_backward``."""

    name = "reentrant_output"

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return reentrant_output_bytes(ctx.model, ctx.training) > 0

    def _output(self) -> Op:
        size = reentrant_output_bytes(self.ctx.model, self.ctx.training)
        return alloc(size, Cat.ACTIVATION, "backward", KEY, "layers.{i}", LABEL)

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        return (self._output(),)

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        return (free(self._output(), "backward"),)
