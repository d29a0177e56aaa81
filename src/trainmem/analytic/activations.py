"""Activation memory: the tensors autograd saves for backward, per layer and outside the layers.

Legend (per micro-batch): s = seq_len, b = micro_batch_size, T = b * s tokens, h = hidden_size,
a = num_heads, k = num_kv_heads, d = head_dim, i = intermediate_size, V = vocab_size,
c = bytes of the compute dtype, r = bytes of the residual stream.

Note [Activation terms]
    The starting point is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", arXiv:2205.05198, sec. 4.1, Eq. 1: sbh(34 + 5as/h) bytes per layer for
    16-bit activations, eager attention and dropout. We keep its term list (two LayerNorm inputs,
    the QKV input, Q and K, V, the output-projection input, the MLP input, the GELU input and
    output, three dropout masks, softmax / dropout / attention-over-values of size a*s*s) and make
    each term's dtype and multiplicity follow what the PyTorch/Hugging Face code really keeps:

    * Residual stream dtype r. Under autocast the embeddings are fp32 and residual adds promote, so
      the residual stream and the norms run in fp32 (r = 4) while matmul outputs are 16-bit (c = 2).
      In ``*-true`` precisions r = c.
    * Autocast casts every *activation* input of a matmul on each call (only leaf weights are
      cached: aten/src/ATen/autocast_mode.cpp ``cached_cast``), so q, k and v projections reading
      one norm output save three 16-bit copies of it (gate/up save two); a fused QKV saves one.
    * Autocast also caches one 16-bit copy of every linear weight for the forward; the matmuls save
      it for backward, so it lives until that layer's backward: c bytes per linear weight,
      counted here as activations ("autocast_weight_copies").
    * HF RMSNorm (modeling_llama.py ``LlamaRMSNorm``) upcasts to fp32 and saves the fp32 input and
      the normalised fp32 tensor: 4h + r*h + 4 bytes per token; LayerNorm saves its input and fp32
      mean/rstd: r*h + 8.
    * Rotary embeddings (modeling_llama.py ``apply_rotary_pos_emb``) multiply by cos/sin, which
      saves cos/sin (counted once per step), so only the rotated q and k are saved, by attention.
    * SDPA / flash attention (Dao et al. 2022, arXiv:2205.14135) saves q, k, v, its output and a
      fp32 logsumexp of a values per token, and no a*s*s term; the output projection reads a
      view of that output. k and v are saved expanded to all query heads where the kernel or
      HF's ``repeat_kv`` expands them (eager; the fp32 memory-efficient kernel). Eager attention
      saves the softmax output (fp32 under autocast: ``softmax`` is on CUDA autocast's fp32 list),
      the dropout mask (1 byte) and the probabilities fed to the value matmul (c).
    * Activation functions: a fused GELU/SiLU saves its input (c*i); HF ``gelu_new``
      (``NewGELUActivation``, a tanh formula written as separate ops) saves four i-sized tensors
      (fp32 ones under autocast, since ``pow`` is on the fp32 list). A gated MLP
      (``down(act(gate(x)) * up(x))``) saves gate, act(gate), up and their product: 4c*i.
    * MoE layers (Mixtral) run top-k experts per token: expert-side terms times k, plus the
      gathered expert inputs and outputs and the fp32 router softmax (E per token).

    Deviation from source: Korthikanti's counts are for Megatron's fused kernels; the terms above
    follow HF transformers 5 code paths, so e.g. GPT-2's ``gelu_new`` saves more (see
    ``tests/analytic/test_activations.py`` for the exact reduction to Eq. 1).

Note [Activation checkpointing]
    ``full``: HF ``gradient_checkpointing_enable`` (non-reentrant ``torch.utils.checkpoint``) keeps
    each decoder layer's input (r*h per token) and recomputes the layer during backward, so one
    layer's full activations are live again at a time (Chen et al. 2016, arXiv:1604.06174;
    Korthikanti et al. 2022 sec. 5 "full": 2sbhL). ``selective`` with eager attention: Korthikanti
    et al. 2022 sec. 5, recompute only the attention core (softmax, dropout, attention over
    values): the a*s*s terms disappear and every other term stays. With SDPA/flash attention,
    where there is no attention core to drop, ``selective`` is op-level selective checkpointing
    as torchtitan does it: matmul and SDPA outputs are saved, the rest (norms, activation
    functions, dropout, rotary) is recomputed
    (:func:`~trainmem.analytic.op_selective.op_selective_saved_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainmem.analytic.activation_parallelism import parallel_divisor, split_for_parallelism
from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    frozen_embeddings,
    mean_terms,
    tokens_per_sequence,
)
from trainmem.analytic.attention import (
    apply_litgpt_attention,
    apply_mla,
    attention_terms,
    boolean_mask_bytes,
    eager_mask_bytes,
    materialised_mask_bias_bytes,
    sliding_mask_bias_bytes,
    sliding_mask_bytes,
)
from trainmem.analytic.autocast import autocast_weight_copy_bytes
from trainmem.analytic.float8 import apply_float8
from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.lora import apply_lora
from trainmem.analytic.mlp import experts_per_token, mlp_terms
from trainmem.analytic.norms import block_norm_bytes, norm_saved_bytes
from trainmem.analytic.op_selective import op_selective_saved_bytes
from trainmem.analytic.prompt_encoder import prompt_encoder_activation_bytes
from trainmem.analytic.t5 import apply_t5, t5_stack_bytes
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int) -> int:
    """Activation bytes of one transformer layer, 16-bit, no parallelism, eager attention, dropout.

    Source: Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.1, Eq. 1: sbh(34 + 5as/h).
    """
    return s * b * h * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h), expanded to stay in integers


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """Activation bytes of one micro-batch, laid out the way backward consumes them.

    Attributes:
        per_layer: bytes one layer keeps until its backward (after checkpointing).
        recompute: extra bytes live while one checkpointed layer is recomputed (0 without).
        embedding: bytes saved before the first layer (inputs, masks, rotary tables).
        head: bytes saved after the last layer (final norm, LM head input, logits, log-softmax).
        num_layers: L.
        terms: the per-layer terms without checkpointing (for reports).
        head_terms: the embedding's and the head's terms (for reports).
        head_parts: the head's terms alone (``head`` as the tensors the schedule allocates).
    """

    per_layer: int
    recompute: int
    embedding: int
    head: int
    num_layers: int
    terms: dict[str, int] = field(default_factory=dict)
    head_terms: dict[str, int] = field(default_factory=dict)
    head_parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All saved activations at the end of the forward pass, bytes."""
        return self.embedding + self.per_layer * self.num_layers + self.head


def layer_activation_terms(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes one transformer layer saves for backward, without checkpointing, by term.

    The attention block's terms (:func:`~trainmem.analytic.attention.attention_terms`), the
    MLP block's (:func:`~trainmem.analytic.mlp.mlp_terms`), then, in this order, what the
    family, the precision and the fine-tuning change (:func:`_layer_adjustments`).

    Returns:
        Term name -> bytes for the whole micro-batch (b sequences). Terms of size a*s*s are
        prefixed ``scores/``. See Note [Activation terms] for every term's source; a model
        with blocks of several kinds gives its mean block (``mean_terms``).
    """
    mean = mean_terms(model, lambda block: layer_activation_terms(block, training))
    if mean is not None:
        return mean
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    norm, output_norm = block_norm_bytes(model, training)
    terms = attention_terms(model, training, t=t, norm=norm, output_norm=output_norm)
    terms.update(mlp_terms(model, training, t=t, norm=norm, output_norm=output_norm))
    for applies, adjust in _layer_adjustments(model, training, t=t, norm=norm):
        if applies:
            adjust(terms)
    return split_for_parallelism(terms, training)


def _layer_adjustments(
    model: ModelSpec, training: TrainingConfig, *, t: int, norm: int
) -> tuple[tuple[bool, Callable[[dict[str, int]], None]], ...]:
    """(applies, adjust in place) for each change to the generic block's terms, in the order
    they apply: DINOv2's layer scale, multi-head latent attention, T5's blocks, float8 linears,
    autocast's weight copies, LoRA, lit-gpt's attention."""
    k_top = experts_per_token(model)
    return (
        (model.layer_scale, lambda terms: _add_layer_scale(terms, model, training, t=t)),
        (model.mla, lambda terms: apply_mla(terms, model, training, t=t)),
        (
            model.architecture == "encoder-decoder",
            lambda terms: apply_t5(terms, model, training, t=t, norm=norm),
        ),
        (training.is_fp8, lambda terms: apply_float8(terms, model, training, t=t, k_top=k_top)),
        (
            training.uses_autocast,
            lambda terms: terms.update(
                autocast_weight_copies=autocast_weight_copy_bytes(model, training)
            ),
        ),
        (training.frozen_base, lambda terms: apply_lora(terms, model, training, t=t, k_top=k_top)),
        (
            training.conventions.own_model_code,
            lambda terms: apply_litgpt_attention(terms, model, training, t=t),
        ),
    )


def _add_layer_scale(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int
) -> None:
    """Dinov2LayerScale: ``hidden_state * self.lambda1`` saves its input (the attention's /
    MLP's output, compute dtype) for lambda1's gradient (modeling_dinov2.py), in place."""
    c, _ = compute_and_residual_bytes(training)
    terms["attention/layer_scale_input"] = c * model.hidden_size * t
    terms["mlp/layer_scale_input"] = c * model.hidden_size * t


def embedding_activation_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes saved before the first layer: token ids and labels (int64), dropout mask, rotary
    cos/sin tables (fp32 under autocast, HF ``LlamaRotaryEmbedding``), BERT's embedding LayerNorm,
    ViT's (cast) pixel input."""
    b = training.micro_batch_size
    s = tokens_per_sequence(model, training)
    t = b * s
    c, r = compute_and_residual_bytes(training)
    h = model.hidden_size
    out: dict[str, int] = {}
    if model.architecture == "vision-encoder":
        out["inputs/pixel_values"] = b * model.num_channels * model.image_size**2 * (c + 4)
    elif model.architecture == "encoder-decoder":
        # input_ids (source), labels and the decoder_input_ids shifted from them (target)
        out["inputs/token_ids_and_labels"] = 8 * t + 2 * 8 * b * training.decoder_seq_len
    else:
        out["inputs/token_ids_and_labels"] = 8 * t * 2
    hf_decoder = model.architecture == "decoder" and training.conventions.hf_model_code
    if training.padding_mask and hf_decoder:
        # a padded batch's attention_mask, (b, s) int64 as tokenizers return it
        out["inputs/attention_mask"] = 8 * t
    if model.position_kind == "rotary" and not model.rotary_buffer:
        # (a model's own cos/sin buffer is counted with its buffers: ModelSpec.module_buffer_bytes)
        # transformers builds position_ids = cache_position.unsqueeze(0) when none are passed,
        # so its cos/sin tables are (1, s, d), shared by the batch (modeling_llama.py
        # ``LlamaModel.forward``; found by the trace engine); Gemma-3 has a second pair for its
        # sliding-window layers (``rope_local_base_freq``); DeepSeek's span the rotary part
        # only (DeepseekV3Config: head_dim = qk_rope_head_dim)
        rows = s if training.conventions.hf_model_code else t
        tables = 2 if model.local_rope else 1
        # over the rotated dims only (``int(head_dim * partial_rotary_factor)``,
        # modeling_rope_utils.py ``_compute_default_rope_parameters``)
        if model.mla:
            width = model.qk_rope_head_dim
        else:
            width = int(model.head_dim * model.partial_rotary_factor)
        out["rotary_cos_sin"] = 2 * r * rows * width * tables
    if model.embedding_norm:
        out["embedding_norm"] = norm_saved_bytes(model, r) * t
    eager_mask = eager_mask_bytes(model, training)
    if eager_mask and training.activation_checkpointing != "none":
        out["attention_mask"] = eager_mask  # an input of every checkpointed layer
    if sliding_mask_bias_bytes(model, training) and training.activation_checkpointing != "none":
        # the sliding layers' boolean mask is an input of every checkpointed layer, kept by
        # the checkpoint until their backward (without checkpointing it dies with the
        # forward; SDPA saves its own float bias): Note [The sliding mask is one s x s tensor]
        out["sliding_mask"] = sliding_mask_bytes(model, training)
    if (
        materialised_mask_bias_bytes(model, training)
        and training.activation_checkpointing != "none"
    ):
        # likewise the boolean causal mask Falcon builds for every layer (``create_causal_mask``
        # with ``allow_is_causal_skip=False``: one (1, 1, s, s) tensor expanded over the
        # batch, Note [The sliding mask is one s x s tensor]); with ALiBi modeling_falcon.py
        # makes a float mask of it per sequence (kept as before, not checked)
        alibi = model.position_kind == "alibi"
        out["causal_mask"] = b * s * s if alibi else boolean_mask_bytes(model, training)
    if training.dropout and model.embedding_dropout > 0 and not frozen_embeddings(training):
        out["embedding_dropout_mask"] = h * t
    if model.architecture == "encoder-decoder":
        out.update(t5_stack_bytes(model, training))
    out.update(prompt_encoder_activation_bytes(model, training))
    return split_for_parallelism(out, training)


def activation_profile(model: ModelSpec, training: TrainingConfig) -> ActivationProfile:
    """Saved activations of one micro-batch, per layer and outside the layers, after
    checkpointing. See Note [Activation terms] and Note [Activation checkpointing]."""
    terms = layer_activation_terms(model, training)
    full_layer = sum(terms.values())
    mode = training.activation_checkpointing
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    _, r = compute_and_residual_bytes(training)
    if mode == "full":
        per_layer = r * model.hidden_size * t // parallel_divisor("layer_input", training)
        recompute = full_layer
        if model.architecture == "vision-encoder":
            # the first norm's saved input is the checkpointed block input itself, already
            # held (per_layer): the recompute does not make it again (traced on CLIP, SigLIP,
            # DINOv2 and ViT towers; the formula families' decoders keep the earlier rule)
            recompute -= per_layer
        kinds = model.layer_kinds()
        if len(kinds) > 1:  # the mean block's input; the largest kind is recomputed
            mean = mean_terms(
                model,
                lambda block: {
                    "": r
                    * model.hidden_size
                    * training.micro_batch_size
                    * tokens_per_sequence(block, training)
                },
            )
            assert mean is not None
            per_layer = mean[""] // parallel_divisor("layer_input", training)
            recompute = max(sum(layer_activation_terms(b, training).values()) for _, b in kinds)
    elif mode == "selective" and training.attention == "eager":
        per_layer = sum(v for k, v in terms.items() if not k.startswith("scores/"))
        recompute = full_layer - per_layer
    elif mode == "selective":
        per_layer = min(op_selective_saved_bytes(model, training), full_layer)
        recompute = full_layer - per_layer
    else:
        per_layer, recompute = full_layer, 0
    emb = embedding_activation_bytes(model, training)
    head = head_activation_bytes(model, training)
    return ActivationProfile(
        per_layer=per_layer,
        recompute=recompute,
        embedding=sum(emb.values()),
        head=sum(head.values()),
        num_layers=model.num_blocks,
        terms=terms,
        head_terms={**emb, **head},
        head_parts=head,
    )
