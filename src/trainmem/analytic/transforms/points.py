"""The named points of the analytic step where a transform inserts its tensors (issue 25).

The base order (:mod:`trainmem.analytic.schedule`) is the plain autograd order of one rank's
step; at each point below it emits the ops of the active transforms, in the fixed order of
:data:`~trainmem.analytic.transforms.ORDER`, then frees the tensors whose
:class:`~trainmem.analytic.transforms.base.Lifetime` ends there (last allocated, first freed).

In step order:

* ``setup``: once, after the parameters are allocated (before the warm-up step);
* ``step.begin``: the step starts (``where.first_step``: the warm-up step, whose lazily
  made buffers live from then on);
* ``micro_batches.begin``: the micro-batch loop (a pipeline schedule's ``step``) starts;
* ``micro_batch.begin``: a micro-batch's forward starts;
* ``stack.pre_forward`` / ``stack.post_forward``: around the forward through the layers;
* ``layer.pre_forward``, ``layer.forward`` (its weights are ready), ``layer.o.forward`` (the
  attention's output projection runs: the attention's saved blocks exist, not o's own or the
  MLP's), ``layer.mlp.up.forward`` (the MLP's up projection runs: the gate's and the
  activation's blocks exist, not up's own; both only where :func:`~trainmem.analytic.
  lora_variants.dora_moments_per_linear` orders the blocks by linear), ``layer.mlp.forward``
  (its MLP's down projection runs: the layer's saved blocks exist, with what its code still
  holds there, Note [Forward tensors held at the down projection]), ``layer.post_forward``:
  one layer's forward (the layer's body; ``where.first_layer`` / ``where.last_layer`` in
  execution order);
* ``head.forward`` / ``head.post_forward``: before / after the logits are made;
* ``forward.end``: the loss is computed (before ``zero_grad`` and ``loss.backward()``);
* ``backward.begin``: ``loss.backward()`` is entered;
* ``head.backward``: the head's backward, its input gradients made;
* ``head.post_backward``: the head's weight gradients exist;
* ``stack.pre_backward`` / ``stack.post_backward``: around the backward through the layers;
* ``layer.pre_backward``, ``layer.o.recompute`` / ``layer.mlp.up.recompute`` (the recompute at
  o / up, as ``layer.o.forward`` / ``layer.mlp.up.forward``), ``layer.backward``
  (recomputation done), ``layer.mlp.pre_backward``,
  ``layer.mlp.down_backward`` (the down projection's input gradient is made between what a
  transform allocates there and the free of its last allocation; before the recompute
  where Note [A frozen 4-bit down projection before the recompute] holds),
  ``layer.mlp.down_weight_backward`` (right after down's input gradient is made, before
  its weight gradient),
  ``layer.mlp.post_backward`` (the layer's first weight gradient, its MLP's down
  projection's, exists, or all of them where a transform makes them; Note [Gradients where
  their linear's backward runs]), ``layer.attention.pre_backward``,
  ``layer.attention.post_backward``, ``layer.post_backward``: one layer's backward;
* ``embedding.pre_backward``, ``embedding.backward``, ``embedding.post_backward`` (its
  gradients exist): the embedding's backward;
* ``root.post_backward``: the root module's post-backward (the end of ``loss.backward()``);
* ``micro_batch.end``: the micro-batch's backward has returned;
* ``micro_batches.end``: after the last micro-batch (deferred gradient reduction);
* ``step.post_backward``: the micro-batch loop has returned (before the optimizer);
* ``optimizer.begin``, ``optimizer.step`` (the update's own tensors), ``optimizer.end``;
* ``step.post_optimizer``: ``optimizer.step()`` has returned (before ``zero_grad()``);
* ``step.end``: after ``zero_grad()``.

A point's phase (:data:`PHASE`) is the phase of the frees emitted there.
"""

from __future__ import annotations

from typing import Final, Literal

from trainmem.timeline import Phase

Point = Literal[
    "setup",
    "step.begin",
    "micro_batches.begin",
    "micro_batch.begin",
    "stack.pre_forward",
    "layer.pre_forward",
    "layer.forward",
    "layer.o.forward",
    "layer.mlp.up.forward",
    "layer.mlp.forward",
    "layer.post_forward",
    "stack.post_forward",
    "head.forward",
    "head.post_forward",
    "forward.end",
    "backward.begin",
    "head.backward",
    "head.post_backward",
    "stack.pre_backward",
    "layer.pre_backward",
    "layer.o.recompute",
    "layer.mlp.up.recompute",
    "layer.backward",
    "layer.mlp.pre_backward",
    "layer.mlp.down_backward",
    "layer.mlp.down_weight_backward",
    "layer.mlp.post_backward",
    "layer.attention.pre_backward",
    "layer.attention.post_backward",
    "layer.post_backward",
    "stack.post_backward",
    "embedding.pre_backward",
    "embedding.backward",
    "embedding.post_backward",
    "root.post_backward",
    "micro_batch.end",
    "micro_batches.end",
    "step.post_backward",
    "optimizer.begin",
    "optimizer.step",
    "optimizer.end",
    "step.post_optimizer",
    "step.end",
]

PHASE: Final[dict[Point, Phase]] = {
    "setup": "init",
    "step.begin": "forward",
    "micro_batches.begin": "forward",
    "micro_batch.begin": "forward",
    "stack.pre_forward": "forward",
    "layer.pre_forward": "forward",
    "layer.forward": "forward",
    "layer.o.forward": "forward",
    "layer.mlp.up.forward": "forward",
    "layer.mlp.forward": "forward",
    "layer.post_forward": "forward",
    "stack.post_forward": "forward",
    "head.forward": "forward",
    "head.post_forward": "forward",
    "forward.end": "forward",
    "backward.begin": "backward",
    "head.backward": "backward",
    "head.post_backward": "backward",
    "stack.pre_backward": "backward",
    "layer.pre_backward": "backward",
    "layer.o.recompute": "backward",
    "layer.mlp.up.recompute": "backward",
    "layer.backward": "backward",
    "layer.mlp.pre_backward": "backward",
    "layer.mlp.down_backward": "backward",
    "layer.mlp.down_weight_backward": "backward",
    "layer.mlp.post_backward": "backward",
    "layer.attention.pre_backward": "backward",
    "layer.attention.post_backward": "backward",
    "layer.post_backward": "backward",
    "stack.post_backward": "backward",
    "embedding.pre_backward": "backward",
    "embedding.backward": "backward",
    "embedding.post_backward": "backward",
    "root.post_backward": "backward",
    "micro_batch.end": "backward",
    "micro_batches.end": "backward",
    "step.post_backward": "backward",
    "optimizer.begin": "optimizer",
    "optimizer.step": "optimizer",
    "optimizer.end": "optimizer",
    "step.post_optimizer": "optimizer",
    "step.end": "zero_grad",
}
"""The phase of the ops a point emits."""

POINTS: Final[tuple[Point, ...]] = tuple(PHASE)
"""Every point, in step order."""
