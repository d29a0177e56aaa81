"""Chunked cross-entropy for HF causal LMs: the loss computed over N chunks of tokens.

Shapes: b = micro_batch_size, s = seq_len, h = hidden_size, V = vocab_size.

The model runs with its output head made the identity, so ``output.logits`` is the final hidden
state [b, s, h] (a view; transformers v5 computes ``lm_head(hidden_states[:, slice_indices])``).
Then, as torchtune's ``CEWithChunkedOutputLoss`` (``torchtune/modules/loss/ce_chunked_output_
loss.py``) with the model's chunked output (``TransformerDecoder.chunked_output``; torchtune 0.4.0):
the head runs on each of N chunks along the sequence, ``head(hidden_chunk)`` [b, s/N, V] in
the compute dtype, and the list of all N is the model's output; then, chunk by chunk, upcast
to fp32 (unless ``TrainingConfig.loss_upcast`` is False, lit-gpt), ``cross_entropy(...,
reduction="sum")``; the sum is divided by the number of labelled tokens. Labels are shifted as
HF's ``ForCausalLMLoss`` shifts them (pad one ``-100`` at the end, drop the first). Under
``compile`` the upcast and the cross-entropy of each chunk are compiled together, as torchtune's
recipes do when ``compile`` is on (``training.compile_loss``: ``torch.compile(loss.compute_cross_
entropy)``, torchtune 0.4.0 ``torchtune/training/_compile.py``); see Note [Compiled
cross-entropy] in ``trainmem.trace.compile``.

Known limitations: models that post-process their logits (Gemma-2 ``final_logit_softcapping``)
are refused; only causal LMs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["chunked_cross_entropy_forward"]

IGNORE_INDEX = -100
"""HF / torchtune ``ignore_index``."""


@contextlib.contextmanager
def _identity_head(head: Any) -> Iterator[None]:
    head.forward = lambda x: x
    try:
        yield
    finally:
        del head.forward


def chunked_cross_entropy_forward(
    chunks: int, *, upcast: bool = True, compiled: bool = False, keep_output: bool = False
) -> Any:
    """A ``forward_loss(model, batch)`` computing the causal-LM loss in ``chunks`` pieces.

    Args:
        chunks: N, the number of token chunks (``torch.chunk`` along the sequence).
        upcast: cast each chunk's logits to fp32 before the loss (torchtune); False keeps the
            compute dtype (lit-gpt).
        compiled: compile each chunk's upcast + cross-entropy (torchtune's ``compile_loss``).
        keep_output: the loop binds the model's output past the loss
            (``TrainingConfig.training_loop`` ``step`` or ``previous``).

    Returns:
        ``forward_loss(model, batch) -> scalar`` (the chunks' logits dropped after the loss),
        or with ``keep_output`` ``-> (scalar, (the chunks' logits, the returned cache))``, for
        :func:`trainmem.trace.step.run_step`, which holds that output as the loop does.
    """
    nn_f = torch.nn.functional

    def compute_cross_entropy(logits: Any, labels: Any) -> Any:
        # torchtune ``CEWithChunkedOutputLoss.compute_cross_entropy``
        return nn_f.cross_entropy(
            logits.float() if upcast else logits,
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    loss_of_chunk = compute_cross_entropy
    if compiled:
        from trainmem.trace.compile import compile_loss

        loss_of_chunk = compile_loss(compute_cross_entropy)

    def forward_loss(model: Any, batch: Any) -> Any:
        config = getattr(model, "config", None)
        if getattr(config, "final_logit_softcapping", None):
            raise UnsupportedError(
                "chunked cross-entropy with final_logit_softcapping is not traced; use "
                "--engine analytic"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not isinstance(batch, dict) or "labels" not in batch:
            raise UnsupportedError(
                "chunked cross-entropy is traced for HF causal LMs only (an output head and "
                "labels); use --engine analytic"
            )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with _identity_head(head):
            output = model(**inputs)
        hidden = output.logits  # [b, s, h]
        # the KV cache a transformers model returns, alive as long as its output is
        cache = getattr(output, "past_key_values", None) if keep_output else None
        del output
        shifted = nn_f.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # [b, s]
        # the model's output: every chunk's logits, [b, s/N, V] each, before the loss runs
        # (torchtune ``TransformerDecoder.chunked_output``)
        logits = [head(hc) for hc in hidden.chunk(chunks, dim=1)]
        total = None
        for lg, lc in zip(logits, shifted.chunk(chunks, dim=1), strict=True):
            part = loss_of_chunk(lg.reshape(-1, lg.size(-1)), lc.reshape(-1))
            total = part if total is None else total + part
        if keep_output:
            # the model's output to the loop that holds it (``keep_logits``, loop
            # ``previous``): every chunk's logits and the KV cache a transformers model
            # returns with them (Note [The current micro-batch's bound output] in
            # trainmem/analytic/transforms/loop.py)
            return total / (shifted != IGNORE_INDEX).sum(), (logits, cache)
        del logits  # the recipe's ``del logits`` after the loss (``_loss_step``)
        return total / (shifted != IGNORE_INDEX).sum()

    return forward_loss
