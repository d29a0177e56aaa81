"""Megatron's vocabulary-parallel cross-entropy on a traced causal LM's logits (one
tensor-parallel rank).

Note [Megatron's cross-entropy on a traced step]
    ``--framework megatron`` on the generic path traces the transformers model's layers as a
    stand-in for megatron-core's ``GPTModel`` (Note [Megatron on a traced step] in
    trainmem/traced_megatron.py), but its loss is Megatron's own, which runs as plain torch ops
    and so runs here for real: the model is run without labels (its 16-bit logits, [b, s, V]),
    and an ``autograd.Function`` makes the allocations of megatron-core 0.9.0
    megatron/core/tensor_parallel/cross_entropy.py ``_VocabParallelCrossEntropy`` with one
    tensor-parallel rank (its all-reduces are no-ops), as Note [Megatron's vocabulary-parallel
    cross-entropy] (trainmem/analytic/loss.py) reads them:

    * forward: one fp32 copy of the logits (``calculate_logits_max``: ``.float()``, the logits
      themselves when they are fp32), the row max subtracted in place, ``torch.exp(..., out=)``
      into the same tensor, divided by the row sums in place: that fp32 softmax is the one
      saved tensor (``ctx.save_for_backward(exp_logits, ...)``); the per-token loss is
      ``log(sum_exp) - predicted_logit``, fp32;
    * backward: the saved softmax is the gradient (``grad_input = softmax``), the targets' 1
      subtracted and the incoming gradient multiplied in place; autograd casts it to the
      logits' dtype (one 16-bit tensor, torch/csrc/autograd/engine.cpp ``validate_outputs``).

    The per-token losses are averaged over the loss mask as Megatron-LM's ``pretrain_gpt.py``
    ``loss_func`` does (``torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()``, fp32).
    Labels are taken as they are: Megatron's data loader gives the next tokens, no shift of
    the logits. The 16-bit logits go when the model's forward returns the loss (this function
    drops them on return). Models that post-process their logits (Gemma-2
    ``final_logit_softcapping``) are refused: ``GPTModel``'s output layer does not.

Source: megatron-core 0.9.0 megatron/core/tensor_parallel/cross_entropy.py; Megatron-LM
pretrain_gpt.py ``loss_func``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.trace._torch import require_torch

torch = require_torch()

from torch.autograd import Function  # noqa: E402

__all__ = ["megatron_cross_entropy_forward", "megatron_loss", "megatron_model_refusal"]


def megatron_model_refusal(raw: Mapping[str, Any]) -> str | None:
    """Why Megatron's ``GPTModel`` does not run the model of config ``raw``, or None when it
    does: a transformers decoder-only causal LM with attention (a ``*ForCausalLM`` /
    ``*LMHeadModel`` architecture, or a ``model_type`` in transformers' causal-LM mapping; a
    remote-code config as its stand-in, ``trainmem.trace.remote_code``), not an
    encoder-decoder, not a vision-language model, not attention-free (Mamba, RWKV: no
    attention-heads field; megatron-core builds those as its ``MambaModel``, not
    ``GPTModel``). Diffusers and timm configs are refused by the caller.

    Args:
        raw: the parsed ``config.json`` of a transformers model.
    """
    from trainmem.trace.remote_code import REMOTE_CODE_TYPES, stand_in_config

    if raw.get("model_type") in REMOTE_CODE_TYPES:
        raw = stand_in_config(raw)
    archs = raw.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    model_type = str(raw.get("model_type", ""))
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if not archs:
        from transformers.models.auto import modeling_auto

        causal = model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    attention = any(k in raw for k in ("num_attention_heads", "n_head", "n_heads", "num_heads"))
    multimodal = "vision_config" in raw or "audio_config" in raw
    if causal and attention and not multimodal and not raw.get("is_encoder_decoder"):
        return None
    what = ", ".join(archs) or f"model_type {model_type!r}"
    return (
        f"framework=megatron: Megatron-LM's GPTModel is a decoder-only transformer (a causal "
        f"LM with standard attention and MLP or MoE), and {what} is not one (an "
        "encoder-decoder, masked-LM, vision, speech, multimodal or attention-free model); "
        "traced with --framework megatron: a causal language model (a *ForCausalLM config); "
        "for this model use --framework pytorch-amp, fsdp2 or deepspeed"
    )


class _VocabParallelCrossEntropy(Function):
    """The allocations of Megatron's ``_VocabParallelCrossEntropy`` on one rank (Note
    [Megatron's cross-entropy on a traced step])."""

    @staticmethod
    def forward(ctx: Any, logits: Any, target: Any) -> Any:
        x = logits.float()  # calculate_logits_max: the fp32 copy (the logits if fp32)
        if x is logits:
            x = x.clone()  # Megatron writes into the fp32 logits; keep the caller's intact
        row_max = x.max(dim=-1)[0]
        x.sub_(row_max.unsqueeze(-1))  # "In-place subtraction reduces memory pressure"
        predicted = x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        torch.exp(x, out=x)
        sum_exp = x.sum(dim=-1)
        loss = torch.log(sum_exp) - predicted
        x.div_(sum_exp.unsqueeze(-1))  # the softmax, saved
        ctx.save_for_backward(x, target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Any) -> tuple[Any, None]:
        softmax, target = ctx.saved_tensors
        grad = softmax  # prepare_gradient_calculation_operands: the softmax is the gradient
        grad.scatter_add_(
            -1, target.unsqueeze(-1), torch.full_like(target, -1.0, dtype=grad.dtype).unsqueeze(-1)
        )
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None


def _vocab_shard(logits: Any, target: Any) -> tuple[Any, Any]:
    """Rank 0's shard of vocabulary-sharded ``DTensor`` logits ``[b, s, V / t]`` (the
    output layer's ``ColwiseParallel``, as megatron-core's ``ColumnParallelLinear`` with
    ``gather_output=False``) and the targets as that rank's
    ``calculate_predicted_logits`` masks them: ids outside ``[0, V / t)`` read position 0
    (``masked_target[target_mask] = 0``). The cross-rank all-reduces of the row max, the
    predicted logit and the row sum are ``[tokens]`` fp32 tensors, in place (Note
    [Megatron's cross-entropy on a traced step])."""
    local = logits.to_local()  # differentiable: the gradient goes back as the same shard
    outside = target >= local.size(-1)  # rank 0's vocab_start_index is 0
    masked = target.clone()
    masked[outside] = 0
    return local, masked


def megatron_cross_entropy_forward() -> Any:
    """A ``forward_loss(model, batch)`` computing Megatron's vocabulary-parallel cross-entropy
    on the model's logits (Note [Megatron's cross-entropy on a traced step]).

    Returns:
        ``forward_loss(model, batch) -> scalar``, for :func:`trainmem.trace.step.run_step`.
    """

    def forward_loss(model: Any, batch: Any) -> Any:
        config = getattr(model, "config", None)
        if getattr(config, "final_logit_softcapping", None):
            raise UnsupportedError(
                "framework=megatron with final_logit_softcapping: megatron-core's GPTModel "
                "output layer does not cap its logits; use --engine analytic or another "
                "--framework"
            )
        if not isinstance(batch, dict) or "labels" not in batch:
            raise UnsupportedError(
                "framework=megatron is traced for causal language models (token ids and "
                "labels); use --engine analytic or another --framework"
            )
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits  # [b, s, V], the output layer's dtype
        return megatron_loss(logits=logits, labels=batch["labels"])

    return forward_loss


def megatron_loss(*, logits: Any, labels: Any, **_: Any) -> Any:
    """Megatron's vocabulary-parallel cross-entropy of ``logits`` ``[b, s, V]`` (or their
    vocabulary-sharded ``DTensor``) averaged over the loss mask, as ``pretrain_gpt.py``
    ``loss_func`` (Note [Megatron's cross-entropy on a traced step]); it takes the keywords of
    transformers' ``loss_function``, as a pipeline's last stage calls it
    (trainmem/trace/pipeline.py)."""
    target = labels.reshape(-1)
    if hasattr(logits, "to_local"):  # tensor parallelism: this rank's vocabulary shard
        logits, target = _vocab_shard(logits, target)
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), target)
    del logits
    loss_mask = torch.ones_like(labels, dtype=torch.float32).view(-1)
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
