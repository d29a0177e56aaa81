"""What the model keeps after its last layer: the final norm, the LM head's input, the loss's
saved tensors, classification and vision pooling heads, a quantized LM head's dequantized
weight and the final hidden states held while the loss runs. Symbols as in
:mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from typing import NamedTuple

from trainmem.analytic.activation_parallelism import parallel_divisor, split_for_parallelism
from trainmem.analytic.activation_shapes import (
    autocast_fp32_layer_norms,
    compute_and_residual_bytes,
    output_tokens,
    tokens_per_sequence,
)
from trainmem.analytic.loss import (
    compiled_chunked_loss,
    compiled_loss,
    cut_cross_entropy,
    loss_backward_tensors,
    loss_kind,
    loss_saved_terms,
    loss_upcast,
    megatron_cross_entropy,
    unsloth_fused_loss,
    unsloth_logits_loss,
)
from trainmem.analytic.norms import (
    fused_norms,
    litgpt_norm_weight_in_fp32,
    norm_saved_bytes,
    unsloth_fast_norms,
)
from trainmem.analytic.tensor_states import quantized_lm_head
from trainmem.specs.frameworks import litgpt_head_chunk_rows, trl_bf16_tensors
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def head_activation_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes saved after the last layer, by term.

    Causal/masked LM: final norm, LM-head input, logits (c*V, kept alive by the model output
    until the step ends), and the fp32 log-softmax output saved by ``cross_entropy``; HF
    transformers' ``ForCausalLMLoss`` upcasts logits with ``logits.float()`` before the loss
    (transformers/loss/loss_utils.py). Classification heads keep only the pooled vector.
    """
    b = training.micro_batch_size
    t = b * output_tokens(model, training)
    _, r = compute_and_residual_bytes(training)
    out: dict[str, int] = {}
    if model.architecture == "vision-encoder" and model.vision_pooler != "dense":
        return split_for_parallelism(_vision_pooler_bytes(model, training, t=t), training)
    if model.architecture == "encoder-decoder":
        # the encoder stack's final_layer_norm, on the source tokens (frozen under LoRA, as
        # the decoder's final norm below: it saves no normalised tensor)
        t_source = b * training.seq_len
        trained = not training.frozen_base
        out["encoder_final_norm"] = norm_saved_bytes(model, r, trainable=trained) * t_source
    if model.final_norm:  # BERT (post-LN) has none
        # Note [Chunked head's first weight-gradient sum]: eager beside a compiled loss
        trainable = not training.frozen_base and (
            not training.compile or compiled_chunked_loss(model, training)
        )
        fp32 = litgpt_norm_weight_in_fp32(training)
        # a fused norm (Unsloth's Fast_RMS_Layernorm, Megatron's TENorm) saves what a
        # compiled norm keeps: its input and rstd
        fast = unsloth_fast_final_norm(model, training) or fused_norms(training)
        # Note [Autocast over 16-bit weights]: a LayerNorm saves its fp32 cast of the input
        r_in = 4 if autocast_fp32_layer_norms(model, training) else r
        out["final_norm"] = (
            norm_saved_bytes(model, r_in, trainable=trainable, compiled=fast, weight_in_fp32=fp32)
            * t
        )
    if model.head in ("causal-lm", "masked-lm", "seq2seq-lm"):
        out.update(_lm_head_terms(model, training, t=t))
    else:
        out["pooled"] = 4 * model.hidden_size * b * 4
    return split_for_parallelism(out, training)


def _lm_head_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """A language-model head's saved tensors: BERT's masked-LM transform, the LM head's input,
    a fp32 model output, what the loss saves
    (:func:`~trainmem.analytic.loss.loss_saved_terms`), a final logit soft-cap, T5's 16-bit
    logits and autocast's copy of the head weight."""
    c, r = compute_and_residual_bytes(training)
    h, v = model.hidden_size, model.vocab_size
    out: dict[str, int] = {}
    if model.head == "masked-lm":
        out["mlm_transform"] = (2 * c * h + norm_saved_bytes(model, r)) * t
    lm_head_frozen = not training.trains_lm_head and "lm_head" not in training.lora_targets
    # a frozen LM head saves no input, unless bitsandbytes quantized it (lit-gpt quantizes
    # every linear, the LM head too; HF keeps it unquantized)
    # a quantized head saves its input only where bitsandbytes' MatMul4Bit still did (< 0.43.2)
    fused = unsloth_fused_loss(model, training)  # Note [Unsloth's fused cross-entropy]
    # Note [Unsloth's Cut Cross Entropy]: it saves the hidden states, the head's input
    cut = cut_cross_entropy(model, training)
    if cut or (
        not fused
        and (
            not lm_head_frozen
            or (quantized_lm_head(training) and training.quantized_matmul_saves_input)
        )
    ):
        out["lm_head_input"] = c * h * t
    if training.conventions.fp32_model_output:
        # Lightning Fabric casts the model output to fp32 (``_FabricModule.forward`` ->
        # ``precision.convert_output``) and lit-gpt's loop keeps ``logits`` until the step
        # ends (lightning/fabric/plugins/precision/half.py)
        out["logits_fp32_output"] = 4 * v * t
    # The logits are not saved: the training loop drops the model output after the loss,
    # log-softmax keeps only its output and the LM head its input (found by the trace
    # engine); they exist only at the end of forward (loss_forward_transient_bytes).
    out.update(loss_saved_terms(model, training, t=t))
    # Unsloth's kernels soft-cap inside (``DO_SOFTCAPPING``, ``softcap``): no tanh saved
    own = fused or cut or unsloth_logits_loss(model, training)
    if model.final_logit_softcap and model.head == "causal-lm" and not own:
        # (Unsloth's fused loss soft-caps inside its compiled piece: a transient there)
        # softcap * tanh(logits / softcap) before the loss: tanh saves its output, in the
        # LM head's dtype (modeling_gemma2.py ``Gemma2ForCausalLM.forward``)
        out["final_logit_softcap_tanh"] = c * v * t
    if model.head == "seq2seq-lm" and c != 4:
        # T5ForConditionalGeneration calls CrossEntropyLoss on the 16-bit logits (no
        # ``.float()``; autocast runs it in fp32): the trace holds those logits with the
        # fp32 log-softmax output until the loss backward
        out["logits_for_loss"] = c * v * t
    # autocast casts an fp32 head weight to 16 bits and the matmul saves the cast; not a head
    # already in the compute dtype (a quantized base's unconverted modules kept as loaded,
    # TrainingConfig.kbit_16bit_dense: ``cached_cast`` casts only a type other than the
    # target; but an fp16 head under bf16 autocast is cast, TrainingConfig.kbit_dense_cast,
    # Note [A quantized base's other weights in another 16-bit dtype]) nor a quantized head
    # (bitsandbytes dequantizes inside its matmul, lm_head_dequant_bytes), nor one TRL's
    # SFTTrainer cast back to bf16 after peft's upcast (TrainingConfig.trl_bf16_embeddings).
    # Source: aten/src/ATen/autocast_mode.cpp ``cached_cast``.
    head_bf16 = trl_bf16_head(model, training)
    if (
        training.uses_autocast
        and (not training.kbit_16bit_dense or training.kbit_dense_cast)
        and not training.autocast_over_loaded_16bit  # a 16-bit head weight: no cast
        and not quantized_lm_head(training)
        and not head_bf16
    ):
        out["autocast_weight_copies"] = c * v * h * autocast_head_casts(training)
    return out


def trl_bf16_head(model: ModelSpec, training: TrainingConfig) -> bool:
    """The LM head's weight is one TRL's SFTTrainer cast back to bf16 after peft's k-bit upcast
    (``TrainingConfig.trl_bf16_embeddings``; a saved copy of it too, Note [peft
    modules_to_save]): autocast makes no 16-bit copy of it."""
    return training.trl_bf16_embeddings and "lm_head" in trl_bf16_tensors(
        model.model_type, model.tie_word_embeddings
    )


def autocast_head_casts(training: TrainingConfig) -> int:
    """How many 16-bit casts of the LM head's weight autocast makes and the head's matmuls save
    (each chunk's matmul saves its own cast for the input gradient): one per piece when lit-gpt
    runs its head in pieces (``GPT.forward``: ``[self.lm_head(x_i) for x_i in
    x.split(lm_head_chunk_size, dim=1)]``) over a frozen head weight, which autocast does not
    cache, so every piece casts it again; one otherwise (a trained weight is cast once and
    cached until the autocast region exits).

    Source: aten/src/ATen/autocast_mode.cpp ``cached_cast`` (``can_try_cache`` needs
    ``arg.requires_grad() && arg.is_leaf()``); lit_gpt/lora.py @8641822 and litgpt/model.py
    v0.5.13 ``GPT.forward``; tools/autograd/derivatives.yaml (mm saves ``mat2`` when ``self``
    requires grad).
    """
    chunks = training.chunked_cross_entropy
    if not (training.is_lora and training.conventions.own_model_code and chunks):
        return 1
    rows = litgpt_head_chunk_rows(training.seq_len, chunks)
    return -(-training.seq_len // rows)


def _vision_pooler_bytes(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """Bytes a bare vision tower's pooling keeps for backward (``ModelSpec.vision_pooler``),
    with the loss trainmem's trace puts on it (the fp32 mean of ``pooler_output``, which saves
    nothing).

    * ``cls-norm`` (CLIP ``post_layernorm(last_hidden_state[:, 0, :])``): LayerNorm saves its
      input, a view of the last block's output, so all of it (r*h per token) stays alive.
    * ``cls`` (DINOv2 ``layernorm(sequence)[:, 0, :]``): the final LayerNorm saves its input.
    * ``attention-probe`` (SigLIP ``post_layernorm`` then ``SiglipMultiheadAttentionPoolingHead``):
      the LayerNorm's input; ``nn.MultiheadAttention`` projects keys and values of every patch
      with one packed linear (``F._in_projection_packed``, k is v), which saves its 16-bit input
      copy, and makes the (2, b, s, h) projection contiguous, which the attention's ``bmm``
      calls save (``need_weights=True`` takes the explicit path); the probe's query, scores
      and MLP are one token per image.
    Source: modeling_clip.py ``CLIPVisionModel.forward``, modeling_dinov2.py ``Dinov2Model``,
    modeling_siglip.py; torch/nn/functional.py ``multi_head_attention_forward``.
    """
    c, r = compute_and_residual_bytes(training)
    h, b = model.hidden_size, training.micro_batch_size
    out: dict[str, int] = {}
    if model.vision_pooler == "cls-norm":
        out["final_norm"] = r * h * t + 8 * b
    else:
        out["final_norm"] = norm_saved_bytes(model, r) * t
    if model.vision_pooler == "attention-probe":
        out["pooler/kv_input"] = c * h * t
        out["pooler/kv"] = 2 * c * h * t
    out["pooled"] = 4 * h * b
    return out


def lm_head_dequant_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the LM head's weight dequantized to the compute dtype while its matmul runs
    (forward, and again for the input gradient in backward) when the head is quantized
    (:func:`quantized_lm_head`): bitsandbytes ``MatMul4Bit`` dequantizes the whole (V, h) weight
    (bitsandbytes/autograd/_functions.py ``F.dequantize_4bit``), 0 otherwise."""
    if not quantized_lm_head(training) or model.head not in (
        "causal-lm",
        "masked-lm",
        "seq2seq-lm",
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    return c * model.vocab_size * model.hidden_size // training.tensor_parallel_size


def final_hidden_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the final norm's output, held by the causal-LM forward
    (``hidden_states = outputs.last_hidden_state``) while its loss runs, where nothing saves it:
    under autocast it is in the residual dtype r and the LM head saves its 16-bit cast (r*h per
    token); when r = c a trained LM head saves this very tensor (``lm_head_input``), a frozen
    one (LoRA, prompt learning) saves no input (``mm`` keeps ``self`` only for the weight's
    gradient), so the tensor is held here then too (generic path, 1024-wide agreement Llama,
    bf16-true, 2 x 256 tokens: the forward's peak under LoRA r 16 and prefix tuning alike
    c h t = 1,048,576 B over the formulas before). For the families of
    ``ModelSpec.loss_holds_hidden``. Source: modeling_llama.py ``LlamaForCausalLM.forward``;
    found by the trace engine."""
    c, r = compute_and_residual_bytes(training)
    if (
        model.head != "causal-lm"
        or not model.loss_holds_hidden
        or (r == c and training.trains_lm_head)
        or not training.conventions.hf_model_code
    ):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return -(-r * model.hidden_size * t // parallel_divisor("lm_head_input", training))


FINAL_RMSNORM_BACKWARD_TENSORS = 5
"""fp32 (tokens x h) tensors alive at once in the backward of transformers' final RMSNorm
(Note [Final RMSNorm's backward])."""


def unsloth_fast_final_norm(model: ModelSpec, training: TrainingConfig) -> bool:
    """The final norm is Unsloth's ``Fast_RMS_Layernorm`` (``FrameworkConventions.
    unsloth_fast_rms_layernorm``, LoRA on an RMSNorm model): r h + 4 saved per token, no
    backward transients (unsloth 2026.3.5 kernels/rms_layernorm.py)."""
    return unsloth_fast_norms(training) and model.norm_kind == "rmsnorm"


def final_norm_backward_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes the final RMSNorm's backward holds at once besides what it saved, right after the
    loss's and the LM head's backward (its peak, where the vocabulary is small).

    Note [Final RMSNorm's backward]
        transformers' RMSNorm (modeling_llama.py ``LlamaRMSNorm.forward``) is written out:
        ``x.to(float32)``, ``pow(2)``, ``mean(-1)``, ``+ eps``, ``rsqrt``, ``x * rstd``,
        ``.to(input_dtype)``, ``weight *``. Its backward runs those ops' formulas
        (tools/autograd/derivatives.yaml: ``mul.Tensor``, ``pow.Tensor_Scalar``,
        ``mean.dim``, ``rsqrt``, ``_to_copy``) in fp32 over (tokens x h): the incoming
        gradient's fp32 form and four temporaries (``grad * rstd``, ``grad * x`` before its
        sum, the mean's expanded gradient, ``pow``'s ``2 x``) are alive at once, 4 B each, in
        any precision (the residual stream's dtype only changes the casts around them).
        Traced (the generic path) on a 6-layer 1024-wide Qwen2 at 4 x 1,024 tokens: five
        16 MiB fp32 blocks at its peak under bf16-true, bf16-mixed and compile alike. After
        the last layer the saved activations of every layer are still alive, so with a small
        vocabulary the step peaks here. The layers' norms (``input_layernorm``,
        ``post_attention_layernorm``: the same class) run the same backward
        (``layer_norm_backward_bytes``; analytic/schedule.py ``_Layers._norm_backward``):
        after the ops that follow them in the forward have run theirs (their saved tensors
        freed, their weights' gradients made), their own saved fp32 input still alive. Where
        the gradients are kept and the MLP's transients are small (SGD, bf16-true), layer 0's
        input norm, the step's last layer op, is the peak: traced on the 2-layer 2048-wide
        Llama (tests/models/agreement/llama_h2048.json, 2 x 256 tokens) five 4 MiB fp32
        blocks beside every layer's gradient, 455,393,800 B; the formulas were 2.3 % under it
        without them, 0.5 % over with them (their normalised 16-bit output, saved by q / k / v
        and freed by those linears' backward in the trace, stays in the formulas' norm block).
    """
    if (
        model.head != "causal-lm"
        or not model.final_norm
        or model.norm_kind != "rmsnorm"
        or not training.conventions.hf_model_code
        or unsloth_fast_final_norm(model, training)  # ``dX = dY``: written in place
    ):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    one = -(-4 * model.hidden_size * t // parallel_divisor("final_norm", training))
    return FINAL_RMSNORM_BACKWARD_TENSORS * one


def layer_norm_backward_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes one of a layer's RMSNorms (``input_layernorm``, ``post_attention_layernorm``)
    holds at once in its backward besides what it saved: ``FINAL_RMSNORM_BACKWARD_TENSORS``
    fp32 (tokens x h) tensors, as the final norm's (Note [Final RMSNorm's backward]: the same
    ``LlamaRMSNorm.forward``, the same derivatives.yaml formulas). 0 where the layers' norms
    are not transformers' written-out RMSNorm (a LayerNorm, a model of its own code, Unsloth's
    fast norms). Bytes; source: transformers modeling_llama.py ``LlamaRMSNorm.forward``,
    tools/autograd/derivatives.yaml."""
    if (
        model.norm_kind != "rmsnorm"
        or not training.conventions.hf_model_code
        or unsloth_fast_norms(training)
    ):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    one = -(-4 * model.hidden_size * t // parallel_divisor("attention/norm", training))
    return FINAL_RMSNORM_BACKWARD_TENSORS * one


class HeadMatmulBackward(NamedTuple):
    """The LM head's backward transients as the tensors autograd makes them, bytes (Note [The
    LM head's matmul backward]).

    Attributes:
        logits_grad: the logits' gradient cast back to the head's dtype, c V t.
        weight_grad: the head weight's 16-bit gradient before its cast into the fp32
            gradient, c V h (under autocast, a trained head; 0 otherwise).
        input_grad: the head's input gradient, c h t.
    """

    logits_grad: int
    weight_grad: int
    input_grad: int


def head_matmul_backward_parts(
    model: ModelSpec, training: TrainingConfig
) -> HeadMatmulBackward | None:
    """The LM head's matmul backward split as :class:`HeadMatmulBackward`, or None where the
    loss's fp32 gradient stands in for it until the head's gradients are made (losses with
    rules of their own, chunked, compiled, soft-capped or unupcast logits, model
    parallelism, models of their own code).

    Note [The LM head's matmul backward]
        transformers' loss upcasts the 16-bit logits (``logits.float()``,
        transformers/loss/loss_utils.py ``ForCausalLMLoss``), so the log-softmax's fp32
        gradient goes through the upcast's backward (``ToCopyBackward0``, derivatives.yaml
        ``_to_copy``): a c V t copy in the logits' dtype, after which the fp32 one is freed
        (torch/csrc/autograd/engine.cpp ``evaluate_function`` moves a node's inputs into its
        call). The head's ``MmBackward0`` then makes the input's gradient (c h t) and the
        weight's (``mm_mat2_backward``) in the compute dtype (c V h), and releases its
        gradient input and its saved tensors (the head's input, autocast's 16-bit copy of the
        weight); under autocast the weight copy's ``ToCopyBackward0`` then casts the weight's
        gradient into the fp32 one the parameter keeps (4 V h) while the 16-bit one is alive.
        So the head's fp32 gradient is made beside its 16-bit form, not beside the loss's
        fp32 gradient, and the matmul's own point holds the 16-bit logits gradient with the
        weight copy. Traced (the generic path) on the 2-layer 2048-wide Llama, vocabulary
        32,000, 2 x 256 tokens, bf16 autocast, tied, accumulation 4: 125 MiB bf16 + 250 MiB
        fp32 weight gradients and the 2 MiB input gradient at the cast, where the formulas had
        the 62.5 MiB fp32 loss gradient (generic / formulas - 1: +2.09 %).
    """
    t = training
    if (
        model.head != "causal-lm"
        or not t.conventions.hf_model_code
        or t.chunked_cross_entropy > 1
        or model.final_logit_softcap
        or not loss_upcast(model, t)
        or loss_kind(model, t) != "cross-entropy"
        or compiled_loss(model, t)
        or megatron_cross_entropy(model, t)
        or loss_backward_tensors(model, t) != 2
        or unsloth_fused_loss(model, t)
        or cut_cross_entropy(model, t)
        or unsloth_logits_loss(model, t)
        or t.tensor_parallel_size > 1
        or t.context_parallel_size > 1
    ):
        return None
    c, _ = compute_and_residual_bytes(t)
    if c == 4:  # fp32 logits: no upcast, no cast back
        return None
    h, v = model.hidden_size, model.vocab_size
    tokens = t.micro_batch_size * output_tokens(model, t)
    cast = t.uses_autocast and t.gathered_weight_dtype != t.compute_dtype
    cast = cast and not trl_bf16_head(model, t)  # a bf16 head's gradient is its own
    trained = t.trains_lm_head and not quantized_lm_head(t)
    return HeadMatmulBackward(c * v * tokens, c * v * h if cast and trained else 0, c * h * tokens)
