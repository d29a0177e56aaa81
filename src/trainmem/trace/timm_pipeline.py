"""Pipeline parallelism of a timm ViT: what it feeds torch's pipeline frontend (issue 26: every
option on the generic path's timm models)."""

from __future__ import annotations

from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.trace.frontend_pipeline import FrontendInputs
from trainmem.trace.timm_parallel import TRACED, base_model, transformer_blocks

__all__ = ["timm_pipeline_inputs"]


def timm_pipeline_inputs() -> FrontendInputs:
    """How a timm ViT is fed to torch's pipeline frontend (Note [Pipeline stages of a timm
    ViT]).

    Returns:
        The :class:`~trainmem.trace.frontend_pipeline.FrontendInputs`.

    Note [Pipeline stages of a timm ViT]
        ``pipeline_parallel_size=p`` on a timm model cuts it with torch's pipeline frontend
        (Note [Pipeline stages cut by torch's frontend], trainmem/trace/frontend_pipeline.py)
        before the first transformer block of each stage but the first (the blocks of
        :func:`~trainmem.trace.timm_parallel.attention_blocks`: ViT's ``blocks.i``, Swin's
        ``layers.i.blocks.j``), split as the rank map splits layers. Stage 0 holds the patch
        embedding, the class / register tokens and the position table with its blocks, the
        last stage its blocks, the final norm, the pooling and the head (timm 1.0.31
        vision_transformer.py ``VisionTransformer.forward_features`` / ``forward_head``); the
        ViT's residual stream [b, tokens, d] crosses each cut. The step's input is the whole
        step's images [m x b, 3, h, w], passed as the forward's ``x``
        (``VisionTransformer.forward(self, x)``) and chunked by the schedule; the loss is timm
        train.py's cross-entropy of the last stage's logits against the class ids
        (:func:`trainmem.trace.timm_model.timm_loss`), chunked with the images. timm's
        train.py runs no pipeline; this is what torch's pipelining runs on its model. A CNN
        has no transformer blocks to cut at: refused, naming what is traced on it.
    """
    from trainmem.trace.timm_model import make_timm_batch, timm_loss

    def blocks(model: Any) -> list[Any]:
        found = transformer_blocks(model)
        if not found:
            raise UnsupportedError(
                f"pipeline_parallel_size: the traced stages of a timm model are cut before its "
                f"transformer blocks, and {type(base_model(model)).__name__} has none (a "
                f"convolutional network); {TRACED}"
            )
        return found

    return FrontendInputs(
        kind="a timm model",
        blocks=blocks,
        make_batch=make_timm_batch,
        forward_kwargs=lambda batch: {"x": batch["input"]},
        target_key=lambda _batch: "target",
        loss_fn=timm_loss,
    )
