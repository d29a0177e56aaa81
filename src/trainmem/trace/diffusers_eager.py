"""diffusers' eager attention processors in the trace (``--attention eager`` on a diffusers
model).

Note [diffusers' eager attention]
    diffusers' models compute attention in processors: the ``Attention`` class of
    ``models/attention_processor.py`` (SD / SDXL UNets, PixArt, ...) defaults to
    ``AttnProcessor2_0`` (``F.scaled_dot_product_attention``), the newer classes (FLUX, Wan,
    QwenImage...) to processors that call the attention dispatch (``attention_dispatch.py``
    ``dispatch_attention_fn``, whose backends are SDPA's kernels, flash-attn, sage, xformers:
    ``AttentionBackendName`` has its ``EAGER = "eager"`` commented out, diffusers 0.42.1).
    diffusers' eager path is the processor its models fall back to without SDPA:
    ``AttnProcessor`` (``AttnAddedKVProcessor`` for the added-KV attention of a few UNets),
    which materialises the scores: ``attn.get_attention_scores`` runs
    ``torch.baddbmm(empty [b*h, s_q, s_k], q, k^T, beta=0, alpha=scale)``, the softmax (upcast
    when the block sets ``upcast_softmax``), ``.to(dtype)``, then ``torch.bmm(probs, v)``:
    the [b*h, s_q, s_k] probabilities are saved for the backward as eager attention's are.
    The rule that picks it is the one ``set_default_attn_processor`` applies
    (``UNet2DConditionModel``, v0.42.1): every processor in ``ADDED_KV_ATTENTION_PROCESSORS``
    -> ``AttnAddedKVProcessor()``, every one in ``CROSS_ATTENTION_PROCESSORS`` ->
    ``AttnProcessor()``; a model with any other processor (FLUX's ``FluxAttnProcessor``,
    SD3's ``JointAttnProcessor2_0``...) has no eager processor in diffusers and is refused.
    The trace runs the processor itself (no SDPA routing: ``--attention eager`` leaves
    ``F.scaled_dot_product_attention`` alone, trainmem/trace/engine.py ``_emulation``).
"""

from __future__ import annotations

from typing import Any

from trainmem.errors import UnsupportedError

__all__ = ["use_eager_attention"]


def use_eager_attention(model: Any) -> None:
    """Give ``model`` diffusers' eager attention processor, in place (Note [diffusers' eager
    attention]).

    Args:
        model: a diffusers model (``AttentionMixin``: ``attn_processors``,
            ``set_attn_processor``).

    Raises:
        UnsupportedError: a model without processors or with one diffusers has no eager
            counterpart for (naming the classes and what runs instead).
    """
    import diffusers
    from diffusers.models import attention_processor as ap

    name = type(model).__name__
    processors = getattr(model, "attn_processors", None) or {}
    kinds = sorted({type(p).__name__ for p in processors.values()})
    if processors and all(
        isinstance(p, ap.ADDED_KV_ATTENTION_PROCESSORS) for p in processors.values()
    ):
        model.set_attn_processor(ap.AttnAddedKVProcessor())
    elif processors and all(
        isinstance(p, ap.CROSS_ATTENTION_PROCESSORS) for p in processors.values()
    ):
        model.set_attn_processor(ap.AttnProcessor())
    else:
        what = f"attention processors {', '.join(kinds)}" if kinds else "no attention processors"
        raise UnsupportedError(
            f"attention=eager: {name} has {what}, and diffusers {diffusers.__version__} has "
            "no eager processor for them (AttnProcessor / AttnAddedKVProcessor replace the "
            "self- and cross-attention processors of its Attention class only; the attention "
            "dispatch has no eager backend); use --attention sdpa or flash (traced: sdpa, "
            "flash; eager on SD / SDXL UNets, PixArt and the other Attention-class models)"
        )
