"""Attention's activations: what the kernels save (SDPA / flash / memory-efficient, eager
softmax, a written-out softmax), the masks and biases they are given (sliding-window, a
materialised causal mask, eager additive masks), the tensors held in the forward beyond the
saved ones (BLOOM's eager scores, the training KV cache), and the variants of multi-head latent
attention (DeepSeek-V3) and lit-gpt's own attention. Symbols as in
:mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import (
    autocast_casts_layer_inputs,
    cast_copies,
    compute_and_residual_bytes,
    tokens_per_sequence,
)
from trainmem.analytic.norms import norm_options, qk_norm_saved_bytes
from trainmem.specs.frameworks import (
    DEFAULT_TORCH_VERSION,
    TRANSFORMERS_SDPA_GQA_SINCE,
    UNSLOTH_SDPA_GQA_SINCE,
    parse_version,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def sdpa_expands_kv(training: TrainingConfig) -> bool:
    """Keys and values reach attention expanded to all query heads (``repeat_kv``): eager
    attention; the fp32 memory-efficient kernel; and transformers' SDPA path unless it can hand
    GQA to the kernel, which needs torch >= 2.5 and no attention mask (a padded batch passes
    one; transformers integrations/sdpa_attention.py ``use_gqa_in_sdpa``: "attention_mask is
    None (otherwise it will fall back to the math kernel)"), a check transformers has only from
    4.54 (:data:`~trainmem.specs.frameworks.TRANSFORMERS_SDPA_GQA_SINCE`): an older
    ``transformers_version`` always expands them.

    Alive: forward to the layer's backward (SDPA saves the k and v it was given).

    Note [Unsloth's attention]
        Unsloth's ``LlamaAttention_fast_forward`` (unsloth/models/llama.py) runs flash-attn's
        ``flash_attn_func`` when flash-attn is installed (``HAS_FLASH_ATTENTION``, an Ampere
        or newer GPU; trainmem's ``--attention flash``), k and v at their own heads. Without
        it (``--attention sdpa``, the default), through 2025.12.1 (tags ``2025-01`` to
        ``November-2025``), training with no attention mask takes xformers'
        ``memory_efficient_attention`` (a requirement of the install then: the README's
        conda / pip lines and the Colab cells install xformers; 2025.1.5 has no other path)
        with, for grouped keys, ``K.view(...).expand(bsz, kv_seq_len, n_kv_heads, n_groups,
        head_dim)`` and, ``if hidden_states.requires_grad``, ``K.reshape(bsz, kv_seq_len,
        n_heads, head_dim)`` (V the same): contiguous copies at every query head, which
        xformers saves for its backward; its SDPA fallback (no xformers either) expands them
        the same way. From 2025.12.2 (:data:`~trainmem.specs.frameworks.
        UNSLOTH_SDPA_GQA_SINCE`, utils/attention_dispatch.py ``run_attention``) the SDPA
        fallback passes ``enable_gqa = True`` (no copy); xformers still expands, but
        2026.3.5's ``huggingface`` dependencies no longer include it (pyproject.toml lists
        it only in per-CUDA extras and for Windows), so the default there is SDPA's. Not
        modelled: the fallback's extra ``A.transpose(1, 2).contiguous()`` of the output
        before 2025.12.2.
    """
    c, _ = compute_and_residual_bytes(training)
    if training.attention == "eager" or c == 4:
        return True
    if training.conventions.unsloth_attention:  # Note [Unsloth's attention]
        return training.attention != "flash" and training.unsloth_release < UNSLOTH_SDPA_GQA_SINCE
    return transformers_repeats_kv(training)


def transformers_repeats_kv(training: TrainingConfig) -> bool:
    """transformers' SDPA path calls ``repeat_kv`` itself before the kernel (the release or the
    batch's mask keeps GQA out of the kernel: :func:`sdpa_expands_kv`)."""
    if (
        training.attention != "sdpa"
        or not training.conventions.hf_model_code
        or training.conventions.unsloth_attention
    ):
        return False
    if training.transformers_release < TRANSFORMERS_SDPA_GQA_SINCE:
        return True
    torch = parse_version("torch_version", training.torch_version) or DEFAULT_TORCH_VERSION
    return explicit_mask(training) or torch < (2, 5)


def explicit_mask(training: TrainingConfig) -> bool:
    """transformers hands SDPA an explicit mask in every layer: a padded batch's
    (``padding_mask``), or prefix tuning's, whose ``p`` cached keys make the key length differ
    from the query's (masking_utils.py ``_ignore_causal_mask_sdpa`` skips the mask only when
    ``kv_length == query_length``; Note [Prompt learning in the formulas] in
    trainmem/analytic/prompt_encoder.py)."""
    return training.padding_mask or training.prefix_tokens > 0


def repeat_kv_copies(model: ModelSpec) -> bool:
    """transformers' ``repeat_kv`` of this model's keys and values is a copy: two or more kv
    heads, fewer than the query heads (Note [repeat_kv of one kv head is a view])."""
    return 1 < model.num_kv_heads < model.num_heads


def kv_saved_repeated(model: ModelSpec, training: TrainingConfig) -> bool:
    """Attention saves keys and values repeated to every query head, new tensors of c x heads x
    head_dim per token each: grouped kv heads that reach it expanded (:func:`sdpa_expands_kv`),
    except one kv head expanded by transformers' own ``repeat_kv`` before SDPA, a view of the
    kv-size tensors, which SDPA saves (Note [repeat_kv of one kv head is a view]).

    Note [repeat_kv of one kv head is a view]
        transformers' ``repeat_kv`` (4.40.0 modeling_llama.py; integrations/sdpa_attention.py
        from 4.48) is ``hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads,
        n_rep, slen, head_dim)`` then ``.reshape(batch, num_key_value_heads * n_rep, slen,
        head_dim)``. ``reshape`` returns a view wherever the strides allow one and copies only
        otherwise (torch docs ``torch.reshape``; aten/src/ATen/TensorUtils.cpp
        ``computeStride``, called by ``reshape`` through ``_reshape_view`` /
        ``view``): with one kv head the merged dims are a size-1 dim (any stride) and the
        expand's stride-0 one, so ``computeStride`` finds strides (a stride-0 head dim) and
        the result is a view of the kv-size tensor; with two or more the kv dim's stride is
        not 0 x n_rep, no view exists and it copies. SDPA's kernels save the tensors they are
        given, so with one kv head they save views of the kv-size keys and values. Found on a
        real transformers 4.40.0 trace of the formula Gemma (1 of 4 kv heads: ``v_proj``'s
        output and the rotated keys saved at kv size, no copy; Note [repeat_kv under SDPA on
        a traced step] in trainmem/traced_releases.py). Not this rule: eager attention's
        ``torch.matmul`` reshapes the expanded (b, heads, ...) tensor to (b x heads, ...),
        which merges the batch dim with the stride-0 head dim: a copy for b > 1, which
        ``bmm`` saves (counted as repeated; b = 1 not modelled); the kernel's own repeat
        (fp32 with GQA in SDPA: ``repeat_interleave``, a copy) and Unsloth's expand (not
        read for one kv head) stay counted as copies.
    """
    if model.num_kv_heads >= model.num_heads or not sdpa_expands_kv(training):
        return False
    return repeat_kv_copies(model) or not transformers_repeats_kv(training)


def prefix_view_cast(model: ModelSpec, training: TrainingConfig) -> bool:
    """Under prefix tuning, autocast over a wider base casts one kv head's repeated keys and
    values to every query head: the cache's keys / values are in the base's dtype (peft's
    prefix, ``torch.cat`` promoting the layer's own), transformers' ``repeat_kv`` of one kv
    head is a view of them (Note [repeat_kv of one kv head is a view]) and SDPA's autocast
    cast of that expanded view writes a (b, heads, p + s, d) tensor in the compute dtype,
    which SDPA saves (generic path, a 1024-wide Gemma of 8 query heads and 1 kv head,
    bf16-mixed, 2 x 256 tokens, 16 virtual: 2 c (heads - 1) d b (p + s) a layer, -1.7 %
    before). Note [Prompt learning in the formulas] in trainmem/analytic/prompt_encoder.py."""
    c, _ = compute_and_residual_bytes(training)
    return (
        training.prefix_tokens > 0
        and model.num_kv_heads == 1 < model.num_heads
        and training.uses_autocast
        and transformers_repeats_kv(training)
        and dtype_bytes(training.weight_dtype) > c
    )


def sdpa_output_copied(model: ModelSpec, training: TrainingConfig) -> bool:
    """The output projection saves a copy of the SDPA output, not a view of it: the flash
    kernel allocates its output like the (b, s, a, d) transpose of q (``empty_like``:
    aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp ``mha_fwd``; mirrored by
    torch/_meta_registrations.py ``meta__scaled_dot_product_flash_attention``), so where q is a
    (b, a, s, d)-contiguous tensor (``ModelSpec.rotary_cat``) the output is too and
    transformers' ``attn_output.transpose(1, 2).contiguous()`` (integrations/sdpa_attention.py)
    copies it. The memory-efficient kernel (fp32, an explicit mask, head_dim > 256) always
    allocates (b, s, a, d), and then the transpose is a view. Found by the trace engine
    (tests/models/formula/gpt_neox.json, phi.json; Phi-3 with a sliding-window mask:
    tests/analytic/test_sliding_window.py).

    litgpt's own attention (``FrameworkConventions.own_model_code``) builds q with
    ``torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)`` whatever the rotary fraction, and
    ``y.transpose(1, 2)`` then ``y.reshape(B, T, head_size * n_head)`` before ``self.proj``
    copies the kernel's output the same way (litgpt/model.py v0.5.13
    ``CausalSelfAttention.forward`` / ``scaled_dot_product_attention``; v0.4.0 and lit-gpt
    @8641822 alike). Found by the generic path on litgpt's own GPT (trace/litgpt_model.py)."""
    c, _ = compute_and_residual_bytes(training)
    every_layer_masked = (
        sliding_mask_applies(model, training) and model.num_sliding_layers == model.num_layers
    )  # Phi-3 with s >= sliding_window: every layer takes the memory-efficient kernel
    flash = (
        training.attention == "flash"
        or (
            training.attention == "sdpa"
            and c == 2
            and not explicit_mask(training)
            and not every_layer_masked
        )
    ) and model.head_dim <= 256
    conventions = training.conventions
    q_cat = (model.rotary_cat and conventions.hf_model_code) or conventions.own_model_code
    return flash and q_cat


SLIDING_MASK_BIAS = "attention/sliding_mask_bias"
"""The term of the sliding-window layers' SDPA bias (:func:`sliding_mask_bias_bytes`)."""


def sliding_mask_applies(model: ModelSpec, training: TrainingConfig) -> bool:
    """The sliding-window layers get an explicit mask at SDPA: the model has sliding layers,
    ``seq_len`` reaches ``sliding_window`` (masking_utils.py ``_ignore_causal_mask_sdpa``) and
    attention is SDPA: eager always adds a mask (:func:`eager_mask_bytes`), and flash-attn 2
    gets none, the window going to the kernel as ``window_size`` (transformers 4.48
    modeling_mistral.py ``MistralModel._update_causal_mask``: under ``flash_attention_2`` it
    returns the 2D ``attention_mask`` only if it holds a 0, else None; transformers 5
    masking_utils.py ``flash_attention_mask`` likewise; modeling_flash_attention_utils.py
    ``_flash_attention_forward`` passes ``sliding_window``). Found on the fms-hf-tuning
    Mistral-7B-v0.1 FSDP rows (dev set 2, GT141-GT158: flash_attention_2 at s = 4096 = the
    window), over by a recomputed layer's 168 MB bias and expanded k / v and the checkpoint's
    34 MB boolean mask."""
    s = tokens_per_sequence(model, training)
    return (
        model.num_sliding_layers > 0
        and s >= model.sliding_window
        and training.attention not in ("eager", "flash")
    )


def sliding_mask_bias_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes the sliding-window layers' SDPA calls save beyond a full-attention layer's, summed
    over those layers: once ``seq_len`` reaches ``sliding_window``, transformers passes them an
    explicit (b, 1, s, s) boolean mask (masking_utils.py ``_ignore_causal_mask_sdpa``: "if
    local_attention_size is not None and kv_length >= local_attention_size: return False"),
    which SDPA converts to an additive bias in the compute dtype and saves (the
    memory-efficient kernel's ``attn_bias``), and k and v reach it expanded to all query heads
    (``repeat_kv``, as with any mask: :func:`sdpa_expands_kv`). Found by the trace engine on a
    Gemma-3 layer. Eager attention adds the mask to the scores and saves none of it."""
    return model.num_sliding_layers * sliding_layer_mask_bias_bytes(model, training)


def sliding_layer_mask_bias_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """:func:`sliding_mask_bias_bytes` of one sliding-window layer (0 where none applies)."""
    if not sliding_mask_applies(model, training):
        return 0
    s = tokens_per_sequence(model, training)
    c, _ = compute_and_residual_bytes(training)
    b = training.micro_batch_size
    per_layer = c * b * s * s
    if not sdpa_expands_kv(training) and repeat_kv_copies(model):
        per_layer += 2 * c * (model.num_heads - model.num_kv_heads) * model.head_dim * b * s
    return per_layer


def sliding_mask_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the boolean mask transformers builds for the sliding-window layers once
    ``seq_len`` reaches the window (:func:`sliding_mask_applies`): s*s, or b*s*s with a padded
    batch's ``attention_mask``.

    Note [The sliding mask is one s x s tensor]
        transformers 5.24 masking_utils.py ``sdpa_mask`` builds the mask by broadcasting the
        mask function over ``_non_vmap_expansion_sdpa``'s index tensors (batch (b, 1, 1, 1),
        head (1, 1, 1, 1), q (1, 1, s, 1), kv (1, 1, 1, s)), then
        ``attention_mask.expand(batch_size, -1, q_length, kv_length)``, a view. The sliding
        window's function (``and_masks(sliding_window_overlay(w), causal_mask_function)``)
        reads only the q and kv indices, so the one tensor allocated is (1, 1, s, s): s*s
        bytes, whatever the batch. Only a 2D ``attention_mask`` (``padding_mask``) adds
        ``padding_mask_function``, which indexes the batch: then (b, 1, s, s). The layers'
        checkpoints keep that tensor; SDPA's additive bias of it (``convert_boolean_attn_mask``
        on the expanded view) is (b, 1, s, s) either way (:func:`sliding_mask_bias_bytes`).
        Found by comparing both engines' schedules of tiny-gemma3-text under full
        checkpointing (session 20, helper moeorder): 1 MB in the trace, 8 MB in the formulas.
    """
    if not sliding_mask_applies(model, training):
        return 0
    return boolean_mask_bytes(model, training)


def boolean_mask_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of a boolean mask transformers' ``sdpa_mask`` builds from a mask function of the
    q and kv indices alone (causal, sliding window): one (1, 1, s, s) tensor expanded over the
    batch, (b, 1, s, s) with a padded batch's mask (Note [The sliding mask is one s x s
    tensor]). Code other than transformers' keeps one mask per sequence (not checked)."""
    s = tokens_per_sequence(model, training)
    per_sequence = training.padding_mask or not training.conventions.hf_model_code
    # (s, p + s) under prefix tuning: the p cached keys' columns too
    return (training.micro_batch_size if per_sequence else 1) * s * (s + training.prefix_tokens)


def materialised_mask_bias_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes one layer's SDPA call saves for an explicit (b, 1, s, s) boolean mask: SDPA
    converts it to an additive bias in the compute dtype and saves it (the memory-efficient
    kernel's ``attn_bias``), c*b*s*s, as for Gemma-3's sliding layers
    (:func:`sliding_mask_bias_bytes`). Two masks are explicit:

    * the causal mask of a family that always builds it (``ModelSpec.sdpa_mask_materialised``:
      Falcon, which calls SDPA itself, without ``repeat_kv``, so its k and v stay at their own
      heads). Found by the trace engine (tests/models/formula/falcon.json);
    * a padded batch's mask (``padding_mask``) in a transformers decoder: with a 0 in its
      ``attention_mask`` the causal mask cannot be left to ``is_causal`` (transformers 5.24
      masking_utils.py ``_ignore_causal_mask_sdpa`` returns False unless every position is
      attended), so ``create_causal_mask`` builds the boolean (b, 1, s, s) mask and every layer
      passes it to ``torch.nn.functional.scaled_dot_product_attention`` (integrations/
      sdpa_attention.py, k and v repeated: :func:`sdpa_expands_kv`), which turns it into a
      bias of the query's dtype (torch 2.13 aten/src/ATen/native/transformers/attention.cpp
      ``convert_boolean_attn_mask``: ``at::where(attn_mask.logical_not(), -inf, 0)``) that the
      memory-efficient kernel saves (tools/autograd/derivatives.yaml
      ``_scaled_dot_product_efficient_attention``: ``attn_bias``). The sliding layers' bias is
      :func:`sliding_mask_bias_bytes`'s, so a model with sliding layers gets the others' share.
      Checked against the generic path (transformers Qwen2, b4 s256: +2.1 % -> 0.0 %).

    Eager attention adds the mask to the scores and saves none of it; flash attention unpads
    the batch instead."""
    hf = training.conventions.hf_model_code
    padded = (
        explicit_mask(training)
        and training.attention == "sdpa"
        and model.architecture == "decoder"
        and not model.sdpa_mask_materialised
    )
    if not (model.sdpa_mask_materialised or padded) or training.attention == "eager" or not hf:
        return 0
    c, _ = compute_and_residual_bytes(training)
    s = tokens_per_sequence(model, training)
    # prefix tuning's mask has the p cached keys' columns too: (b, 1, s, p + s)
    per_layer = c * training.micro_batch_size * s * (s + training.prefix_tokens)
    if padded and sliding_mask_applies(model, training):
        full = model.num_layers - model.num_sliding_layers
        return -(-per_layer * full // model.num_layers)
    return per_layer


def eager_mask_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the additive (b, 1, s, s) causal masks a transformers decoder builds for eager
    attention, in the model's dtype r (fp32 under autocast): one per attention kind, full and
    sliding-window (modeling_gemma2.py ``causal_mask_mapping``), alive through the forward and
    kept by the checkpoint of every layer that takes one under activation checkpointing.
    Source: masking_utils.py ``create_causal_mask`` / ``eager_mask`` (an eager mask is always
    materialised, ``torch.where(mask, 0, min_dtype)``); BLOOM adds ALiBi to it
    (:func:`eager_scores_forward_bytes`). Found by the trace engine (tiny-llama-test and
    tests/models/formula/gemma2.json, eager, full checkpointing)."""
    if (
        training.attention != "eager"
        or model.architecture != "decoder"
        or not training.conventions.hf_model_code
        or model.attention_written_out  # a boolean (s, s) mask per layer, a saved term there
    ):
        return 0
    _, r = compute_and_residual_bytes(training)
    s = tokens_per_sequence(model, training)
    kinds = 2 if model.num_sliding_layers else 1
    return kinds * r * training.micro_batch_size * s * s


def fp32_softmax(model: ModelSpec, training: TrainingConfig) -> bool:
    """Eager softmax in fp32: under autocast (``softmax`` is on CUDA autocast's fp32 list), in
    fp32 training, or where the HF code upcasts explicitly (``ModelSpec.eager_softmax_fp32``)."""
    c, _ = compute_and_residual_bytes(training)
    return training.uses_autocast or model.eager_softmax_fp32 or c == 4


def written_out_attention_terms(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """The (b, a, s, s)-sized and softmax tensors one layer of a written-out attention
    (``ModelSpec.attention_written_out``) saves for backward, by term.

    cs336_basics/model.py ``scaled_dot_product_attention``: ``einsum(Q, K) / sqrt(d_k)`` (the
    einsum saves Q and K, counted in ``attention/q_k``; the division by a Python number saves
    nothing), ``torch.where(mask, scores, -inf)`` (saves its (s, s) boolean condition, built
    by ``qi >= kj`` in every layer's ``CausalMultiHeadSelfAttention.forward``), then
    nn_utils.py ``softmax``: ``x - torch.max(x, dim, keepdim=True)[0]`` (max saves its int64
    indices, a*s*b of them; the subtraction nothing), ``torch.exp`` (saves its output; fp32
    under autocast, where exp is on the fp32 list), ``/ torch.sum(...)`` (the division saves
    both operands: the exp output again and the fp32 row sums), and ``einsum(weights, V)``
    saves the quotient (its c-byte cast under autocast). With n = a*s*s*b: 4n + c*n +
    (8 + 4)*a*s*b + s*s bytes, against torch.softmax's one output. Sources: PyTorch
    tools/autograd/derivatives.yaml (``exp``: result; ``div.Tensor``: self, other;
    ``max.dim``: indices; ``where.self``: condition; ``mul``/``div`` by a scalar: nothing).
    """
    c, _ = compute_and_residual_bytes(training)
    b, s, a = training.micro_batch_size, tokens_per_sequence(model, training), model.num_heads
    n = a * s * s * b
    return {
        "scores/softmax_exp": 4 * n,
        "scores/probs_for_values": c * n,
        "scores/softmax_max_indices": 8 * a * s * b,
        "scores/softmax_row_sums": 4 * a * s * b,
        "scores/causal_mask": s * s,
    }


def written_out_scores_forward_tensors(model: ModelSpec, training: TrainingConfig) -> list[int]:
    """The tensors a written-out attention (``ModelSpec.attention_written_out``) holds in its
    forward beyond what it saves, at their peak, exp's: the masked scores (``torch.where``'s
    output, the ``attention_scores`` local of ``scaled_dot_product_attention``, c*n), the
    max-shifted scores (``rescaled_input`` in nn_utils.py ``softmax``, c*n) and, under
    autocast, exp's fp32 copy of its 16-bit input (4n); the scores einsum's output and its
    division by sqrt(d_k) are freed before (each is the next op's only reference). Read in
    this order off S002's and S026's recorded stacks (../shared/validation/snapshots)."""
    c, _ = compute_and_residual_bytes(training)
    b, s, a = training.micro_batch_size, tokens_per_sequence(model, training), model.num_heads
    n = a * s * s * b // parallel_divisor("scores/x", training)
    return [c * n, c * n] + ([4 * n] if training.uses_autocast and c != 4 else [])


def eager_scores_forward_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(per layer, per model) bytes BLOOM's eager attention holds in the forward beyond what it
    saves (``ModelSpec.eager_scores_kept``), 0 for other families or attention kernels.

    Per layer, alive at the end of its attention (modeling_bloom.py ``BloomAttention.forward``
    keeps its locals until it returns): the raw ``baddbmm`` scores (c*a*s*s*b), the scores
    plus the additive causal mask in the mask's dtype (r*a*s*s*b), the fused
    ``query_key_value`` output (3c*h per token), the block's LayerNorm output (r*h) and the
    ``dense`` output (c*h); under checkpointing also the previous block's returned attention
    probabilities (c*a*s*s*b, modeling_bloom.py ``BloomBlock.forward`` returns ``output,
    attn_weights``). Per model, the additive (b, 1, s, s) causal mask in the model's
    dtype r, alive through the forward (and kept by the checkpoint under activation
    checkpointing: :func:`~trainmem.analytic.activations.embedding_activation_bytes`). Found
    by the trace engine."""
    if model.attention_written_out and training.attention == "eager":
        return sum(written_out_scores_forward_tensors(model, training)), 0
    if not model.eager_scores_kept or training.attention != "eager":
        return 0, 0
    c, r = compute_and_residual_bytes(training)
    b, s, h = training.micro_batch_size, tokens_per_sequence(model, training), model.hidden_size
    t = b * s
    # under checkpointing the previous block's attention probabilities (c), returned by every
    # BloomBlock and held in BloomModel's ``outputs`` until the next block returns, are not
    # saved activations any more but still alive
    kept = c if training.activation_checkpointing != "none" else 0
    scores = (c + r + kept) * model.num_heads * s * s * b // parallel_divisor("scores/x", training)
    hidden = (3 * c + r + c) * h * t
    if training.activation_checkpointing == "full":
        # the checkpointed forward runs without autograd: its peak is the probabilities' cast,
        # the fp32 softmax output (freed right after, nothing saves it) still alive; the qkv
        # linear's 16-bit input is freed by then and the context (``dense``'s input) and the
        # ``dense`` output are not made yet, three c*h tensors the dropped terms and this count
        # (traced on a 2-layer BLOOM, eager, full checkpointing: peak at the cast in
        # ``self_attention``)
        hidden -= 3 * c * h * t
    hidden //= parallel_divisor("attention/qkv_input", training)
    return scores + hidden, eager_mask_bytes(model, training)


def builds_training_kv_cache(model: ModelSpec, training: TrainingConfig) -> bool:
    """transformers' model code builds a KV cache in the training forward
    (``ModelSpec.forward_kv_cache``, or peft's prefix handed in as ``past_key_values``; no
    activation checkpointing: Note [The training KV cache's copies])."""
    return (
        (model.forward_kv_cache or bool(training.prefix_tokens))
        and training.activation_checkpointing == "none"
        and training.conventions.hf_model_code
    )


def forward_kv_cache_bytes(model: ModelSpec, training: TrainingConfig, num_layers: int) -> int:
    """Bytes of the KV cache transformers builds in training (``ModelSpec.forward_kv_cache``),
    alive from each layer's attention to the end of forward (the loss), beyond what SDPA saves.

    Note [The training KV cache's copies]
        transformers 5.24 cache_utils.py ``DynamicLayer.lazy_initialization`` makes an empty
        tensor in the keys' / values' own dtype and ``update`` concatenates onto it
        (``torch.cat``: a copy), and modeling_llama.py ``LlamaAttention.forward`` hands the
        cache's copies on to attention (``key_states, value_states =
        past_key_values.update(...)``); ``LlamaModel.forward`` builds a ``DynamicCache`` when
        ``use_cache`` and returns it in the output. Per layer, r * kv_heads * head_dim bytes
        per token of rotated keys (fp32 under autocast: the rotary tables are fp32; r = c
        otherwise) and c * kv_heads * head_dim of values. What SDPA saves decides which are
        extra:

        * k and v handed to the kernel as they are (GQA in the kernel, or as many kv heads as
          query heads): it saves the cache's tensors themselves, except the fp32 keys under
          autocast, of which it saves its own 16-bit cast: the keys' copy is extra when r != c;
        * k and v repeated to every query head first (:func:`sdpa_expands_kv` with fewer kv
          heads: integrations/sdpa_attention.py ``repeat_kv``, a new tensor; or the kernel's
          own repeat; in a sliding-window layer past the window, whose explicit mask makes
          transformers repeat them, :func:`sliding_mask_applies`): it saves the repeated
          tensors, so both of the cache's copies are extra, whatever r and c (32-true,
          bf16-true, and a quantized base's fp32 stream alike). A model mixing sliding and
          full layers gets the layers' mean (the schedule's layer body is one for all).

        Checked on a real CPU run (transformers 5.24, peft 0.21.2 LoRA on q / v, bitsandbytes
        0.50.2 nf4 under peft's k-bit preparation, a 2-layer Llama with 2 of 4 kv heads, saved
        tensors by storage): without a mask no cache tensor but the autocast run's fp32 keys is
        unsaved; with a padded batch's mask (transformers repeats k / v) none of them is saved,
        under 32-true, bf16-true and bf16-mixed, plain and nf4. transformers 4.x appends the
        tensors themselves, which keeps the same tensors alive; 5.23 created the empty tensor in
        fp32, so its values' copy was fp32 too (r * kv_heads * head_dim more per token and
        layer, not modelled).

    Note [The rotated keys' dtype by release]
        The keys are fp32 under autocast only where the rotary tables are: transformers'
        ``LlamaRotaryEmbedding.forward`` returns ``cos.to(dtype=x.dtype)``, and Llama before
        4.43 (Mistral before 4.48: :data:`~trainmem.specs.model.ROTARY_IN_MODEL_SINCE`) calls
        it in every attention layer on ``value_states``, the 16-bit output of ``v_proj`` under
        autocast (4.40.0 modeling_llama.py ``LlamaSdpaAttention.forward``), so ``q * cos +
        rotate_half(q) * sin`` stays 16-bit and the cache's keys (4.x ``DynamicCache.update``
        appends the tensor itself) are the ones SDPA saves: none extra, as at r = c. From the
        release the model computes them once on ``hidden_states``, the fp32 residual (4.43.0
        ``LlamaModel.forward``), and the keys are promoted to fp32. Checked on a real CPU trace
        of transformers 4.40.0 (benchmarks/transformers_release_trace.py)."""
    c, r = compute_and_residual_bytes(training)
    if not builds_training_kv_cache(model, training):
        return 0
    # the layers whose k / v SDPA takes repeated, as a fraction of num_layers (integers only:
    # the sizes may be a template's symbols, Note [Schedule templates])
    if kv_saved_repeated(model, training):
        part, whole = 1, 1
    elif repeat_kv_copies(model) and sliding_mask_applies(model, training):
        # the sliding layers' explicit mask makes transformers repeat their k / v
        # (:func:`sliding_mask_bias_bytes`); the layers' mean where only some slide
        part, whole = model.num_sliding_layers, model.num_layers
    else:
        part, whole = 0, 1
    # prefix tuning: the cache holds the prefix's p rows before each layer's (Note [Prompt
    # learning in the formulas] in trainmem/analytic/prompt_encoder.py)
    s = tokens_per_sequence(model, training) + training.prefix_tokens
    t = training.micro_batch_size * s
    width = -(-model.num_kv_heads * model.head_dim * t // parallel_divisor("attention/v", training))
    repeated = width * num_layers * part // whole
    # Note [The rotated keys' dtype by release]: the rotary tables are in the residual's dtype
    # from the release that computes them at the model level, in the values' before it
    k = r if model.rotates_in_residual_dtype(training.transformers_release) else c
    v = c
    if training.prefix_tokens:
        # peft casts the prefix to the base model's dtype; ``torch.cat`` promotes each layer's
        # keys / values to the wider of it and the layer's own
        prefix = dtype_bytes(training.weight_dtype)
        k, v = max(k, prefix), max(v, prefix)
    keys = k * width * num_layers if k != c else c * repeated  # the keys' copies
    # the values' copies: SDPA saves the repeated tensors (or its own 16-bit cast)
    values = v * width * num_layers if v != c else c * repeated
    return keys + values


def returned_presents_bytes(model: ModelSpec, training: TrainingConfig, num_layers: int) -> int:
    """Bytes of the fused QKV outputs the layers' returned presents keep alive under
    activation checkpointing (``ModelSpec.returns_fused_kv_views``: transformers < 4.54
    GPT-BigCode): each checkpointed layer runs without saving, but its ``present`` is a view of
    the whole ``c_attn`` output, c * (a + 2 kv) * d bytes per token, appended to the model's
    ``presents`` and alive from the layer's forward until the model output is dropped after the
    loss (HF Trainer ``compute_loss``). 0 without checkpointing (the attention's saved views
    keep the output then) or with ``use_cache`` off. Source: transformers 4.48.1
    modeling_gpt_bigcode.py ``GPTBigCodeAttention.forward`` / ``GPTBigCodeModel.forward``
    (:data:`~trainmem.specs.model.FUSED_KV_PRESENTS_UNTIL`)."""
    if (
        not model.returns_fused_kv_views(training.transformers_release)
        or training.activation_checkpointing == "none"
        or not training.conventions.hf_model_code
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    per_layer = c * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim * t
    return num_layers * -(-per_layer // parallel_divisor("attention/v", training))


def apply_mla(terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int) -> None:
    """Multi-head latent attention's saved tensors, in place of the q/k/v terms
    (modeling_deepseek_v3.py ``DeepseekV3Attention.forward``, SDPA path).

    * The normed input is read by two linears (``q_a_proj`` or ``q_proj``, and
      ``kv_a_proj_with_mqa``): two 16-bit copies under autocast.
    * ``q_a_layernorm`` / ``kv_a_layernorm`` are HF RMSNorms on 16-bit latents: the fp32 upcast,
      the rstd and the normalised 16-bit tensor (none under LoRA: frozen, as
      :func:`~trainmem.analytic.norms.norm_saved_bytes`; the ``kv_nope`` slice is strided, so
      its upcast is a copy either way); their fp32 outputs (fp32 weight times 16-bit tensor)
      are cast again for ``q_b_proj`` / ``kv_b_proj``.
    * The rotary halves are multiplied by the fp32 cos / sin, so ``torch.cat((q_pass, q_rot))``
      is fp32; SDPA (on autocast's lower-precision list) saves its 16-bit cast. The keys are a
      new (b, a, s, qk_nope + qk_rope) tensor (``expand_kv``: ``new_empty`` + two ``copy_``).
      The values are a slice of ``kv_b_proj``'s output, so SDPA's saved value keeps all of it
      (a * (qk_nope + v_head_dim) per token).
    * Queries/keys (qk_nope + qk_rope) and values (v_head_dim) differ in width, which FlashAttention
      refuses (``check_head_dim_size_flash``); the memory-efficient kernel runs and saves its
      output (a * v_head_dim) and a fp32 logsumexp.
    """
    c, _ = compute_and_residual_bytes(training)
    h, a, d, v = model.hidden_size, model.num_heads, model.head_dim, model.v_head_dim
    nope = d - model.qk_rope_head_dim
    mixed = autocast_casts_layer_inputs(training)
    terms["attention/qkv_input"] = c * h * t * (cast_copies(2, training) if mixed else 1)
    # a frozen norm (LoRA) saves no normalised tensor: only its weight's gradient reads it
    normalised = 0 if training.frozen_base else c
    for rank, name in ((model.q_lora_rank, "q"), (model.kv_lora_rank, "kv")):
        if rank:
            terms[f"attention/{name}_latent_norm"] = (4 * rank + normalised * rank + 4) * t
            terms[f"attention/{name}_latent_input"] = c * rank * t
    terms["attention/q_k"] = 2 * c * a * d * t
    terms["attention/v"] = c * a * (nope + v) * t
    if "attention/sdpa_output" in terms:
        terms["attention/sdpa_output"] = c * a * v * t
    if "attention/out_proj_input" in terms:
        terms["attention/out_proj_input"] = c * a * v * t


def apply_litgpt_attention(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int
) -> None:
    """lit-gpt's own attention code, in place (found by tracing lit-gpt's ``GPT``,
    benchmarks/litgpt_trace.py).

    * The fused qkv output is viewed into q, k, v (``qkv.view(...).permute(...).split(...)``);
      without GQA ``v.reshape`` stays a view, so the tensor SDPA saves as v keeps the whole
      (a + 2k) * d qkv output alive: + c * (a + k) * d over our v term. With GQA, k and v are
      expanded to all heads and copied (``expand`` + ``reshape``): k and v at a heads.
    * With LoRA on some but not all of q, k, v, ``LoRAQKVLinear.zero_pad`` scatters the adapter
      output with ``index_copy``, whose backward saves its source: c * (targeted widths).

    Source: lit_gpt/model.py ``CausalSelfAttention.forward``, lit_gpt/lora.py ``zero_pad``.
    """
    c, _ = compute_and_residual_bytes(training)
    a, k, d = model.num_heads, model.num_kv_heads, model.head_dim
    if k == a:
        terms["attention/qkv_view_kept"] = c * (a + k) * d * t
    else:
        terms["attention/q_k"] = 2 * c * a * d * t
        terms["attention/v"] = c * a * d * t
    if training.is_lora:
        widths = {"q": a * d, "k": k * d, "v": k * d}
        chosen = [w for name, w in widths.items() if name in training.lora_targets]
        if chosen and len(chosen) < 3:
            terms["lora/zero_pad_source"] = c * sum(chosen) * t


def attention_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int, norm: int, output_norm: int
) -> dict[str, int]:
    """Bytes one layer's attention block saves for backward, by term (``attention/...``; the
    a*s*s-sized ones ``scores/...``), for t tokens, with ``norm`` / ``output_norm`` the bytes per
    token of the block's pre-norm and output norm
    (:func:`~trainmem.analytic.norms.block_norm_bytes`). See Note [Activation terms]
    (trainmem/analytic/activations.py)."""
    c, _ = compute_and_residual_bytes(training)
    h, a, kv, d = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    terms: dict[str, int] = {}
    if model.pre_norms:
        terms["attention/norm"] = norm * t
    # under autocast each linear casts its own 16-bit copy of the input: one for a fused qkv
    # (litgpt's ``CausalSelfAttention.qkv`` always is: litgpt/model.py v0.5.13, ``attn`` in
    # lit-gpt @8641822), three for separate q / k / v projections, one under torch.compile
    # (Note [Compiled casts are computed once])
    fused = model.fused_qkv or training.conventions.own_model_code
    casts = autocast_casts_layer_inputs(training, model)
    copies = 1 if fused or not casts else cast_copies(3, training)
    terms["attention/qkv_input"] = c * h * t * copies
    # Keys and values reach the kernel expanded to all query heads (GQA) in eager attention
    # (HF ``repeat_kv`` + the matmul's reshape copy) and in the fp32 memory-efficient SDPA
    # kernel; flash (16-bit) takes them at kv-head size. Only the rotated q and k are saved:
    # RoPE's multiplications by cos/sin save cos/sin, not q or k. One kv head repeated by
    # transformers is a view, saved at kv size (Note [repeat_kv of one kv head is a view]).
    kv_saved = a if kv_saved_repeated(model, training) or prefix_view_cast(model, training) else kv
    terms["attention/q_k"] = c * (a * d + kv_saved * d) * t
    terms["attention/v"] = c * kv_saved * d * t
    if training.prefix_tokens:
        # prefix tuning: the keys and values SDPA saves are the cache's p + s rows
        # (Note [Prompt learning in the formulas] in trainmem/analytic/prompt_encoder.py)
        prefix = training.micro_batch_size * training.prefix_tokens
        terms["attention/prefix_kv"] = 2 * c * kv_saved * d * prefix
    if model.fused_qkv_output_kept and kv == a:
        # v is a view of the fused (a + 2k) * d output, which it keeps alive (remote-code Qwen-1
        # ``c_attn(...).split``, Baichuan ``W_pack``; Note [Fused stand-in projections] in
        # trainmem/trace/remote_code.py): the q and k widths beside v's
        terms["attention/qkv_view_kept"] = c * (a + kv) * d * t
    if (
        model.training_kv_cache
        and training.activation_checkpointing == "none"
        and training.conventions.hf_model_code
    ):
        # transformers 5 GPT-2 builds a DynamicCache in training (config ``use_cache=True``,
        # disabled under gradient checkpointing); its ``torch.cat`` copies of k and v are what
        # SDPA saves (found by the trace engine, benchmarks/analytic_vs_trace.py).
        # (GPT-BigCode likewise, at its kv_heads * head_dim width)
        terms["attention/kv_cache_copy"] = 2 * c * kv * d * t
    if model.qk_norm:
        terms["attention/qk_norm"] = qk_norm_saved_bytes(model, c, **norm_options(training)) * t
    sliding = sliding_mask_bias_bytes(model, training)
    if sliding:
        # spread over the layers (the mean layer): exact in the total; where a layer's
        # recompute holds it, the schedule gives each kind its own (Note [Layer bodies per
        # attention kind])
        terms[SLIDING_MASK_BIAS] = -(-sliding // model.num_layers)
    mask_bias = materialised_mask_bias_bytes(model, training)
    if mask_bias:
        terms["attention/mask_bias"] = mask_bias
    if output_norm:
        terms["attention/output_norm"] = output_norm * t
    terms.update(_kernel_terms(model, training, t=t))
    if training.dropout and model.hidden_dropout > 0:
        terms["attention/dropout_mask"] = h * t
    return terms


def _kernel_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """What the attention kernel and the output projection save: a written-out softmax's
    tensors, eager attention's scores, or SDPA's output and logsumexp."""
    c, _ = compute_and_residual_bytes(training)
    a, d = model.num_heads, model.head_dim
    b, s = training.micro_batch_size, tokens_per_sequence(model, training)
    terms: dict[str, int] = {}
    if training.attention == "eager" and model.attention_written_out:
        terms.update(written_out_attention_terms(model, training))
        terms["attention/out_proj_input"] = c * a * d * t
    elif training.attention == "eager":
        p_attn = training.dropout and model.attention_dropout > 0
        sm = 4 if fp32_softmax(model, training) else c
        if model.attention_softcap:
            # softcap * tanh(scores / softcap): tanh saves its output for backward (1 - y^2), in
            # the scores' dtype (tanh is on none of autocast's lists); the divisions and
            # products by a Python scalar save nothing (modeling_gemma2.py
            # ``eager_attention_forward``; tools/autograd/derivatives.yaml ``tanh``)
            terms["scores/softcap_tanh"] = c * a * s * s * b
        terms["scores/softmax"] = sm * a * s * s * b
        if training.softmax_saves_input:
            # torch < 1.11 saves the softmax's input too, in the output's dtype (autocast casts
            # it to fp32 first; SOFTMAX_BACKWARD_INPUT_DTYPE_SINCE)
            terms["scores/softmax_input"] = sm * a * s * s * b
        if p_attn:
            terms["scores/dropout_mask"] = a * s * s * b
        if p_attn or sm != c:
            terms["scores/probs_for_values"] = c * a * s * s * b
        terms["attention/out_proj_input"] = c * a * d * t
    else:
        # SDPA output + logsumexp saved by the kernel; the flash / efficient output is already
        # (b, s, a, d)-contiguous, so ``transpose(1, 2).reshape`` before the output projection
        # is a view and that projection saves the same storage.
        terms["attention/sdpa_output"] = c * a * d * t
        terms["attention/logsumexp"] = 4 * a * t
        mha_copy = model.mha_out_proj_copy and training.micro_batch_size > 1
        # flash-attn over an fp16 stream under bf16 autocast returns fp16, which the output
        # projection (a quantized linear) casts to bf16 itself: its own copy, not the
        # kernel's output (Note [A quantized base's other weights in another 16-bit dtype])
        cast = training.kbit_dense_cast
        if sdpa_output_copied(model, training) or mha_copy or cast:
            # nn.MultiheadAttention: ``permute(2, 0, 1, 3).contiguous()`` of the (b, s, a, d)
            # kernel output (Family.mha_out_proj_copy); a view for one sequence
            terms["attention/out_proj_input"] = c * a * d * t
    return terms
