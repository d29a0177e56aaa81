"""The named points of the analytic step where a transform inserts its tensors (issue 25).

The base order (:mod:`trainmem.analytic.schedule`) is the plain autograd order of one rank's
step; at each point below it emits the ops of the active transforms, in the fixed order of
:data:`~trainmem.analytic.transforms.ORDER`, then frees the tensors whose
:class:`~trainmem.analytic.transforms.base.Lifetime` ends there (last allocated, first freed).

In step order:

* ``setup``: once, after the parameters are allocated (before the warm-up step);
* ``step.begin``: the step starts (``where.first_step``: the warm-up step, whose lazily
  made buffers live from then on);
* ``micro_batch.begin``: a micro-batch's forward starts;
* ``stack.pre_forward`` / ``stack.post_forward``: around the forward through the layers;
* ``layer.pre_forward`` / ``layer.post_forward``: around one layer's forward (the layer's
  body; ``where.first_layer`` / ``where.last_layer`` in execution order);
* ``head.forward``: the head's forward (final norm, LM head), before the logits;
* ``backward.begin``: ``loss.backward()`` is entered (the first op of the backward phase);
* ``stack.pre_backward`` / ``stack.post_backward``: around the backward through the layers;
* ``layer.pre_backward`` / ``layer.post_backward``: around one layer's backward;
* ``root.post_backward``: after the embedding's backward (the root module's post-backward);
* ``micro_batch.end``: the micro-batch's backward has returned;
* ``step.post_backward``: after the last micro-batch, before the optimizer;
* ``optimizer.begin`` / ``optimizer.end``: around ``optimizer.step()``'s own temporaries;
* ``step.end``: after ``zero_grad()``.

A point's phase (:data:`PHASE`) is the phase of the frees emitted there.
"""

from __future__ import annotations

from typing import Final, Literal

from trainmem.timeline import Phase

Point = Literal[
    "setup",
    "step.begin",
    "micro_batch.begin",
    "stack.pre_forward",
    "layer.pre_forward",
    "layer.post_forward",
    "stack.post_forward",
    "head.forward",
    "backward.begin",
    "stack.pre_backward",
    "layer.pre_backward",
    "layer.post_backward",
    "stack.post_backward",
    "root.post_backward",
    "micro_batch.end",
    "step.post_backward",
    "optimizer.begin",
    "optimizer.end",
    "step.end",
]

PHASE: Final[dict[Point, Phase]] = {
    "setup": "init",
    "step.begin": "forward",
    "micro_batch.begin": "forward",
    "stack.pre_forward": "forward",
    "layer.pre_forward": "forward",
    "layer.post_forward": "forward",
    "stack.post_forward": "forward",
    "head.forward": "forward",
    "backward.begin": "backward",
    "stack.pre_backward": "backward",
    "layer.pre_backward": "backward",
    "layer.post_backward": "backward",
    "stack.post_backward": "backward",
    "root.post_backward": "backward",
    "micro_batch.end": "backward",
    "step.post_backward": "backward",
    "optimizer.begin": "optimizer",
    "optimizer.end": "optimizer",
    "step.end": "zero_grad",
}
"""The phase of the ops a point emits."""

POINTS: Final[tuple[Point, ...]] = tuple(PHASE)
"""Every point, in step order."""
