"""T5's encoder-decoder activations beyond the generic block: the relative position bias, the
decoder's cross-attention, the MLP's inner dropout and fp32 ``wo`` cast, and what the two stacks
keep besides their blocks (modeling_t5.py). Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    frozen_embeddings,
    tokens_per_sequence,
)
from trainmem.analytic.mlp import TANH_FORMULA_ACTIVATIONS, activation_fn_saved_bytes
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def apply_t5(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, norm: int
) -> None:
    """T5 blocks beyond the generic terms, in place (modeling_t5.py, SDPA path; traced with
    ``trainmem.trace`` on 2-layer T5 and Flan-T5 configs).

    * Relative position bias: the stack's fp32 bias (1, a, s, s) goes to SDPA as a float mask
      (integrations/sdpa_attention.py ``create_position_bias_mask``), so the memory-efficient
      kernel runs and saves autocast's 16-bit copy of it, one per block (a*s*s values, not per
      sequence). A decoder block's self-attention adds the causal ``torch.where`` (its bool
      condition, s*s bytes, is saved).
    * Decoder blocks attend to the encoder output (``T5LayerCrossAttention``): a third norm,
      q from the decoder (input copy and output), k and v from the encoder output (two input
      copies and the cache's copies of k and v, source length), the kernel's output and
      logsumexp, and a dropout mask on the residual branch.
    * ``T5DenseActDense`` / ``T5DenseGatedActDense`` apply dropout between the activation and
      ``wo`` (a mask of i bytes) and cast to ``wo``'s fp32 weight dtype, which autocast casts
      back (``wo`` saves that 16-bit copy). Flan-T5's gated MLP multiplies the tanh-formula
      GELU output (fp32 under autocast) by ``wi_1``'s output; the product saves both.
    """
    c, _ = compute_and_residual_bytes(training)
    h, a, d, i = model.hidden_size, model.num_heads, model.head_dim, model.intermediate_size
    s = tokens_per_sequence(model, training)
    p_hidden = training.dropout and model.hidden_dropout > 0
    terms["scores/position_bias"] = c * a * s * s
    if model.cross_attention:
        t_source = source_tokens(training)
        terms["scores/causal_mask"] = s * s
        terms["cross/norm"] = norm * t
        terms["cross/q_input"] = c * h * t * (1 if training.uses_autocast else 0)
        terms["cross/q"] = c * a * d * t
        terms["cross/kv_input"] = 2 * c * h * t_source * (1 if training.uses_autocast else 0)
        terms["cross/kv"] = 2 * c * a * d * t_source
        terms["cross/sdpa_output"] = c * a * d * t
        terms["cross/logsumexp"] = 4 * a * t
        if p_hidden:
            terms["cross/dropout_mask"] = h * t
    if p_hidden:
        terms["mlp/inner_dropout_mask"] = i * t
    if model.mlp_kind == "gated" and training.uses_autocast:
        act = activation_fn_saved_bytes(model, training, i) - c * i  # without down's input
        out = 4 if model.hidden_act in TANH_FORMULA_ACTIVATIONS else c
        # act's saved tensors, its output and wi_1's (saved by the product), wo's input copy
        terms["mlp/gated"] = (act + out * i + c * i + c * i) * t


def source_tokens(training: TrainingConfig) -> int:
    """Tokens a decoder block's cross-attention reads keys and values from: the encoder's
    ``b * seq_len``, whatever the decoder's ``target_seq_len`` (modeling_t5.py
    ``T5LayerCrossAttention``: ``key_value_states`` is the encoder output)."""
    return training.micro_batch_size * training.seq_len


def t5_stack_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """What T5's two stacks keep besides their blocks (modeling_t5.py ``T5Stack.forward``,
    ``T5Attention.compute_bias``): the int64 relative-position buckets (s*s, saved by the
    bias embedding; the recompute of each stack's first block where
    :func:`buckets_in_first_blocks`), the decoder's all-zero cross-attention bias
    (1, a, s_target, s_source) made once in 16-bit by its first block and saved by every
    block's SDPA, the dropout masks of the decoder's embeddings and of both stacks' output,
    and under full checkpointing the checkpointed blocks' tensor inputs: each stack's fp32
    position bias (1, a, s, s) and the encoder output every decoder block reads."""
    _, r = compute_and_residual_bytes(training)
    b, a, h = training.micro_batch_size, model.num_heads, model.hidden_size
    s_e, s_d = training.seq_len, training.decoder_seq_len
    c, _ = compute_and_residual_bytes(training)
    # the decoder's first block makes the zero bias and every block's SDPA saves it
    out = {"position_buckets": 0, "cross_bias": c * a * s_d * s_e}
    if not buckets_in_first_blocks(training):
        out["position_buckets"] = sum(position_bucket_bytes(model, training))
    frozen = frozen_embeddings(training)
    if training.dropout and model.embedding_dropout > 0:
        # the decoder's embedding dropout and both stacks' dropout after final_layer_norm
        out["stack_dropout_masks"] = h * b * ((0 if frozen else s_d) + s_e + s_d)
    if training.activation_checkpointing == "full":
        out["checkpoint_inputs/position_bias"] = 4 * a * (s_e * s_e + s_d * s_d)
        out["checkpoint_inputs/encoder_output"] = r * h * b * s_e
    return out


def position_bucket_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """The int64 relative-position buckets (s, s) each stack's bias embedding saves, bytes:
    (encoder's at the source length, decoder's at the target length).

    Only block 0 of a stack has the bias (modeling_t5.py, transformers 5.24: ``T5Stack``
    builds ``T5Block(config, has_relative_attention_bias=bool(i == 0))``); its
    ``T5Attention.forward`` runs ``compute_bias`` when no ``position_bias`` is passed, whose
    ``self.relative_attention_bias(relative_position_bucket)`` saves the bucket indices for the
    weight's gradient, and the later blocks take the returned bias. So under full
    checkpointing the buckets are made (and saved) by the recompute of each stack's first
    block only (Note [Layer bodies per stack and block 0]). Under LoRA the bias weight is
    frozen (peft trains the adapters only): the lookup saves no buckets (torch 2.13
    tools/autograd/derivatives.yaml ``embedding``: the indices serve the weight's gradient
    only), whether or not the token embeddings' output is made to require a gradient (the
    input-grad hook under checkpointing, :func:`~trainmem.analytic.activation_shapes.
    frozen_embeddings`): traced on tiny-t5 LoRA r4 under full checkpointing, the recompute
    frees the buckets right after the lookup."""
    if training.frozen_base:
        return 0, 0
    s_e, s_d = training.seq_len, training.decoder_seq_len
    return 8 * s_e * s_e, 8 * s_d * s_d


def buckets_in_first_blocks(training: TrainingConfig) -> bool:
    """Whether the relative-position buckets belong to the recompute of each stack's first
    block (:func:`position_bucket_bytes`) rather than to the stacks' saved tensors: under full
    checkpointing, where the schedule runs each stack's blocks as their own bodies (one
    pipeline stage: a stage's first layer index is not known to the layer bodies)."""
    return training.activation_checkpointing == "full" and training.pipeline_parallel_size == 1
