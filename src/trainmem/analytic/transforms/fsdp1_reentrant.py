"""FSDP1 frozen units under transformers' reentrant checkpointing as a transform: each layer's
input and its gradient kept from the layer's backward to the end of the backward.

Note [FSDP1 frozen units under reentrant checkpointing]
    transformers 4.x checkpoints each decoder layer with torch's reentrant ``checkpoint``
    (``gradient_checkpointing_kwargs`` default ``{"use_reentrant": True}``) around the
    ``FullyShardedDataParallel`` unit accelerate wrapped it in, and under LoRA that unit's flat
    parameter is frozen (peft's ``fsdp_auto_wrap_policy`` puts each LoRA leaf in a unit of its
    own). The first forward runs under ``no_grad``, so FSDP registers nothing. In the backward
    ``CheckpointFunction.backward`` recomputes the layer on ``detach_variable(inputs)``: leaves
    that share the saved input's storage and require grad. FSDP's pre-forward then registers
    its reshard-only hook (torch 2.4.1 distributed/fsdp/_runtime_utils.py
    ``_register_post_backward_reshard_only_hook``: frozen ``flat_param``, grad mode on) as
    ``register_multi_grad_hook(inp_tensors, ...)`` on that leaf, and keeps the handle in
    ``flat_param._post_backward_hook_state``. The multi-grad hook's closure holds
    ``grad_fns = [_get_grad_fn_or_grad_acc(t)]`` (autograd/graph.py), for a leaf its
    ``AccumulateGrad`` node, which owns the leaf, while the leaf's ``_backward_hooks`` hold
    the closure: a cycle through a C++ node that ``gc`` cannot break. So the leaf, the
    checkpointed input whose storage it shares, and the ``.grad`` the recomputation's
    backward accumulated into it (the layer's input gradient, handed on to the layer below)
    stay alive until FSDP's final callback removes the hook (``_post_backward_final_callback``
    -> ``_finalize_params``: ``flat_param._post_backward_hook_state[-1].remove()``), after the
    whole backward. Per layer that is two tensors of the residual stream's size (r b s h)
    kept past the layer's backward; at the stack's first layer only the gradient, since the
    input-embedding hook already keeps that layer's input (Note in
    :func:`~trainmem.analytic.checkpointing.input_grad_hook_bytes`). A unit with a trainable
    flat parameter registers no such hook, nor does non-reentrant checkpointing leave a leaf
    (checked in ``tests/analytic/test_fsdp1_reentrant.py`` on the real FSDP1 on the CPU under
    the fake process group: 2 L + 1 residual-sized tensors alive when the layers' backward
    ends, 2 without FSDP, with a trainable unit or without reentrancy). A run whose peak is
    the start of the backward (a large vocabulary's loss against a few layers) does not feel
    it; a deep, wide stack (llama-2-70b: 80 layers of b s h) peaks at the end of the layers'
    backward with about one more copy of its checkpoints.

    All this needs the checkpoint OUTSIDE the unit, as transformers through 4.51 placed it
    (4.39.3 / 4.51.3 modeling_llama.py ``LlamaModel.forward``:
    ``self._gradient_checkpointing_func(decoder_layer.__call__, hidden_states, ...)``, the
    decoder layer being the FSDP1 wrapper). From 4.52.0 the decoder layer is a
    ``GradientCheckpointingLayer`` (modeling_layers.py, new in 4.52.0) whose own ``__call__``
    runs ``self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)``:
    FSDP1's forward calls the wrapped layer, which checkpoints itself INSIDE the unit. FSDP's
    pre-forward then runs once, in the forward with grad on, on the previous checkpoint's
    non-leaf output (no ``AccumulateGrad`` owns it: nothing kept); the recomputation calls the
    inner layer only, never FSDP's pre-forward, so no detached leaf gets the hook. Nothing is
    kept (the same CPU test, the layer checkpointing itself: 2 tensors); the rule applies
    before ``GRADIENT_CHECKPOINTING_LAYER_SINCE`` (trainmem/specs/frameworks.py) only.

Source: torch 2.4.1 distributed/fsdp/_runtime_utils.py, autograd/graph.py,
utils/checkpoint.py (cited above); transformers 4.48 modeling_utils.py
``gradient_checkpointing_enable``, trainer.py ``_fsdp_qlora_plugin_updates``; transformers
4.51.3 / 4.52.0 modeling_llama.py and 4.52.0 modeling_layers.py (cited above).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.checkpointing import fsdp1_kept_input_bytes, input_grad_hook_bytes
from trainmem.analytic.transforms.base import Emitted, RankContext, Transform, Where, alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Op, Repeat

KEY = "fsdp1_kept/{i}"
LABEL = "a layer's checkpointed input and its gradient, kept by FSDP1's reshard-only hook"


def kept_per_layer(ctx: RankContext, *, first: bool) -> int:
    """Bytes a layer keeps past its backward (Note [FSDP1 frozen units under reentrant
    checkpointing]): its input and the input's gradient; the stack's first layer only the
    gradient when the input-embedding hook already keeps its input."""
    unit = fsdp1_kept_input_bytes(ctx.model, ctx.training)
    if first and input_grad_hook_bytes(ctx.model, ctx.training):
        return unit
    return 2 * unit


class Fsdp1ReentrantInputs(Transform):
    """Inserts: ``layer.post_backward`` the layer's kept input and gradient
    (:func:`kept_per_layer`); ``root.post_backward`` their frees, every layer's (FSDP's final
    callback)."""

    name = "fsdp1_reentrant"
    layer_position = frozenset({"last"})

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return ctx.rank.stage == 0 and fsdp1_kept_input_bytes(ctx.model, ctx.training) > 0

    def _kept(self, *, first: bool) -> Op:
        size = kept_per_layer(self.ctx, first=first)
        return alloc(size, Cat.ACTIVATION, "backward", KEY, "layers.{i}", LABEL)

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        # the backward's last layer run is the stack's first
        return (self._kept(first=where.last_layer),)

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        n = self.ctx.num_layers
        out: list[Emitted] = []
        if n > 1:
            out.append(Repeat((free(self._kept(first=False), "backward"),), n - 1, start=1))
        # the first layer's under its own index (outside a repeat ``{i}`` would be the
        # micro-batch's)
        out.append(Repeat((free(self._kept(first=True), "backward"),), 1))
        return out
