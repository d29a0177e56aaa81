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
    functions, dropout, rotary) is recomputed (:func:`op_selective_saved_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainmem.analytic.params import linear_shapes
from trainmem.specs.frameworks import DEFAULT_TORCH_VERSION, parse_version
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

#: HF activation names implemented as one fused kernel that saves only its input.
FUSED_ACTIVATIONS = frozenset(
    {"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish", "gelu_python", "tanh"}
)
#: HF activation names written as ``x * sigmoid(1.702 * x)`` (transformers/activations.py
#: ``QuickGELUActivation``, CLIP's ``quick_gelu``): the multiplication saves x and the sigmoid's
#: output, the sigmoid its output, so three i-sized tensors with the down projection's input.
SIGMOID_FORMULA_ACTIVATIONS = frozenset({"quick_gelu"})
#: HF activation names written as separate tanh-formula ops (transformers/activations.py
#: ``NewGELUActivation``, ``FastGELUActivation``).
TANH_FORMULA_ACTIVATIONS = frozenset({"gelu_new", "gelu_fast"})


def compute_and_residual_bytes(training: TrainingConfig) -> tuple[int, int]:
    """(c, r): bytes of the compute dtype and of the residual stream.

    See Note [Activation terms]."""
    c = dtype_bytes(training.compute_dtype)
    # peft's prepare_model_for_kbit_training leaves an fp32 embedding and fp32 norms: the
    # residual stream is fp32 as under autocast
    r = 4 if training.uses_autocast or training.kbit_fp32_upcast else c
    return c, r


def _norm_saved_bytes(
    model: ModelSpec,
    r: int,
    *,
    trainable: bool = True,
    compiled: bool = False,
    width: int = 0,
    groups: int = 1,
) -> int:
    """Bytes per token one norm saves, for an input of ``r`` bytes per value (the residual
    stream for a pre-norm, the compute dtype for a norm on a projection's output) over
    ``width`` values (default h) normalised in ``groups`` (per-head q/k norms: one per head).

    LayerNorm r*w + 8 (input, fp32 mean and rstd); HF RMSNorm 4w + r*w + 4 (fp32 input or copy,
    normalised tensor in the input dtype, fp32 rstd: modeling_llama.py ``LlamaRMSNorm``), or
    4w + 4w + 4 where the weight multiplies in fp32 before the cast
    (``ModelSpec.norm_weight_in_fp32``: modeling_gemma3.py ``Gemma3RMSNorm``, modeling_olmo2.py
    ``Olmo2RMSNorm``). A frozen RMSNorm (LoRA) does not save the normalised tensor: ``weight *
    x`` saves ``x`` only for the weight's gradient (found by the trace engine). Under
    torch.compile the min-cut partition keeps only the norm's input in its own dtype and the
    fp32 rstd (r*w + 4): the fp32 upcast and the normalised tensor are fused and recomputed in
    backward (traced: AOTAutograd with ``min_cut_rematerialization_partition`` on a Llama
    layer, trainmem.trace.compile)."""
    w = width or model.hidden_size
    if model.norm_kind == "layernorm":
        return r * w + 8 * groups
    if compiled:
        return r * w + 4 * groups
    normalised = 4 if model.norm_weight_in_fp32 else r
    return 4 * w + (normalised * w if trainable else 0) + 4 * groups


def _qk_norm_saved_bytes(model: ModelSpec, c: int, **kwargs: bool) -> int:
    """Bytes per token the q and k norms save: norms of the projections' outputs (compute
    dtype), per head (modeling_qwen3.py / modeling_gemma3.py ``q_norm = RMSNorm(head_dim)``) or
    over the whole projection (modeling_olmo2.py ``q_norm = RMSNorm(a * d)``)."""
    d = model.head_dim
    total = 0
    for heads in (model.num_heads, model.num_kv_heads):
        groups = 1 if model.qk_norm_full_width else heads
        total += _norm_saved_bytes(model, c, width=heads * d, groups=groups, **kwargs)
    return total


def sliding_mask_applies(model: ModelSpec, training: TrainingConfig) -> bool:
    """The sliding-window layers get an explicit mask at SDPA: the model has sliding layers,
    ``seq_len`` reaches ``sliding_window`` (masking_utils.py ``_ignore_causal_mask_sdpa``) and
    attention is not eager (which always adds a mask, :func:`eager_mask_bytes`)."""
    s = tokens_per_sequence(model, training)
    return (
        model.num_sliding_layers > 0 and s >= model.sliding_window and training.attention != "eager"
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
    if not sliding_mask_applies(model, training):
        return 0
    s = tokens_per_sequence(model, training)
    c, _ = compute_and_residual_bytes(training)
    b = training.micro_batch_size
    per_layer = c * b * s * s
    if not sdpa_expands_kv(training):
        per_layer += 2 * c * (model.num_heads - model.num_kv_heads) * model.head_dim * b * s
    return model.num_sliding_layers * per_layer


def materialised_mask_bias_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes one layer's SDPA call saves for the explicit causal mask of a family that always
    builds it (``ModelSpec.sdpa_mask_materialised``: Falcon): SDPA converts the (b, 1, s, s)
    boolean mask to an additive bias in the compute dtype and saves it (the memory-efficient
    kernel's ``attn_bias``), c*b*s*s, as for Gemma-3's sliding layers
    (:func:`sliding_mask_bias_bytes`). Falcon calls SDPA itself, without ``repeat_kv``, so its
    k and v stay at their own heads. Found by the trace engine (tests/models/formula/falcon.json).
    Eager attention adds the mask to the scores and saves none of it."""
    if (
        not model.sdpa_mask_materialised
        or training.attention == "eager"
        or not training.conventions.hf_model_code
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    s = tokens_per_sequence(model, training)
    return c * training.micro_batch_size * s * s


def _activation_fn_saved_bytes(model: ModelSpec, training: TrainingConfig, width: int) -> int:
    """Bytes per token saved by the non-gated MLP activation and the down projection's input."""
    c, _ = compute_and_residual_bytes(training)
    # lit-gpt's own model code runs GELU as one kernel (``torch.nn.functional.gelu(x,
    # approximate=config.gelu_approximate)``, litgpt/model.py ``GptNeoxMLP``) even where the HF
    # model writes the tanh formula out.
    # torch.compile (inductor) fuses the formula into one kernel and its min-cut partitioner
    # saves only the input (torch/_functorch/partitioners.py ``min_cut_rematerialization``).
    fused = not training.conventions.hf_model_code or training.compile
    if model.hidden_act in TANH_FORMULA_ACTIVATIONS and not fused:
        if training.uses_autocast:
            # pow's fp32 input copy, tanh out, 1+tanh (fp32), 0.5*x (c), output cast for down (c)
            return (4 + 4 + 4 + c + c) * width
        # x, tanh out, 0.5*x, 1+tanh, output (saved by down): five tensors of the compute dtype
        return 5 * c * width
    if model.hidden_act in SIGMOID_FORMULA_ACTIVATIONS and not fused:
        return 3 * c * width  # x, sigmoid(1.702 x), and the product saved by down
    return 2 * c * width  # input saved by the kernel, output saved by the down projection


def layer_linear_weights(model: ModelSpec, *, autocast_only: bool = False) -> int:
    """Weight elements of the linears of one layer (all experts for MoE), no biases.

    ``autocast_only`` leaves out the routed experts of a transformers MoE layer, whose grouped
    matmul is not autocast-enabled and runs in the weights' own dtype (transformers
    integrations/moe.py ``_grouped_mm``: "torch.nn.functional.grouped_mm and torch._grouped_mm
    are not autocast-enabled"). The mean block of a model with blocks of several kinds
    (``_mean_terms``)."""
    mean = _mean_terms(
        model, lambda block: {"": layer_linear_weights(block, autocast_only=autocast_only)}
    )
    if mean is not None:
        return mean[""]
    experts = model.num_experts > 1 and autocast_only
    return sum(
        fan_in * fan_out * n
        for name, (fan_in, fan_out, n) in linear_shapes(model).items()
        if not (experts and name in ("gate", "up", "down"))
    )


def moe_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """Bytes a transformers 5 MoE block saves for backward, by term (the default
    ``experts_implementation="grouped_mm"``: transformers integrations/moe.py
    ``grouped_mm_experts_forward``; router: modeling_qwen3_moe.py ``Qwen3MoeTopKRouter``; shared
    expert: modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock``). Per token, k = top-k, w = bytes
    of the weights' dtype as computed with (the experts' grouped matmul runs in it: fp32 under
    plain autocast, the compute dtype under an FSDP mixed-precision policy):

    * router: its autocast input copy (c*h), the fp32 softmax (4E), top-k values and indices
      (12k);
    * expert inputs: the tokens gathered per expert and cast to w (w*h*k), the gather's and the
      sort's int64 indices (16k);
    * gated experts: the gate/up output (2 w*i*k), the activation's output and the product fed
      to the down projection (w*i*k each);
    * expert outputs: the down projection's output saved by the routing-weight product
      (w*h*k), the routing weights (c*k) and the un-permuting index (8k);
    * shared expert (Qwen2-MoE): a gated MLP (4 c*i_s; its autocast input copies are in
      ``mlp/input``) and the sigmoid gate's output with the expert output it scales (c*h + c).
    """
    c, _ = compute_and_residual_bytes(training)
    # the weights as the layer computes with them: an FSDP mixed-precision policy gathers them
    # in the compute dtype (TrainingConfig.gathered_weight_dtype)
    w = dtype_bytes(training.gathered_weight_dtype)
    h, i, e = model.hidden_size, model.intermediate_size, model.num_experts
    k = model.num_experts_per_tok
    mixed = training.uses_autocast
    router = (c * h * mixed + 4 * e + 12 * k) * t
    if model.sigmoid_router:
        # DeepseekV3TopkRouter: ``F.linear(x.float(), w.float())`` (autocast casts both back),
        # the sigmoid's output (E, compute dtype), the top-k indices (int64) and the
        # normalisation's operands (traced on a 2-layer DeepSeek-V3)
        router = (c * h * mixed + c * e + 8 * k + 8) * t
    terms = {
        "mlp/router": router,
        "mlp/expert_inputs": (w * h * k + 16 * k) * t,
        "mlp/gated": 4 * w * i * k * t,
        "mlp/expert_outputs": (w * h * k + c * k + 8 * k) * t,
    }
    if sequential_pre_norm_block(model):  # Note [Backward of a pre-norm block]
        terms["mlp/gated"] -= w * i * k * t
        terms["mlp/down_input"] = w * i * k * t
    si = model.shared_expert_intermediate_size
    if si:
        terms["mlp/shared_expert"] = 4 * c * si * t
        if model.shared_expert_gate:
            terms["mlp/shared_expert_gate"] = (c * h + c) * t
    return terms


def autocast_weight_copy_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """16-bit copies of one layer's linear weights that autocast makes and the matmuls save for
    the input gradient (``mm`` saves ``mat2`` when ``self`` requires grad), frozen or not; none
    for a quantized base, whose bitsandbytes matmul dequantizes inside and saves only the
    quantized weight (``MatMul4Bit``). Source: aten/src/ATen/autocast_mode.cpp ``cached_cast``;
    tools/autograd/derivatives.yaml (mm)."""
    if not training.uses_autocast:
        return 0
    c, _ = compute_and_residual_bytes(training)
    # LoRA adapters (fp32 under autocast) are cast and saved by their own matmuls too
    adapters = c * lora_adapter_elements(model, training)
    if training.quantize_base != "none":
        return adapters
    return c * layer_linear_weights(model, autocast_only=True) + adapters


def lora_adapter_elements(model: ModelSpec, training: TrainingConfig) -> int:
    """Elements of one layer's LoRA adapters: r * (fan_in + fan_out) per targeted linear (A is
    r x fan_in, B fan_out x r; Hu et al. 2021), 0 without LoRA."""
    if not training.is_lora:
        return 0
    r = training.lora_rank
    adapters = 0
    for name, (fan_in, fan_out, n) in linear_shapes(model).items():
        targeted = (
            any(t in training.lora_targets for t in ("q", "k", "v"))
            if name == "qkv"
            else name in training.lora_targets
        )
        if targeted and name != "router":
            adapters += n * r * (fan_in + fan_out)
    return adapters


def autocast_cached_weight_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of one layer's weights held in autocast's weight cache until the forward region
    exits: a 16-bit copy of every *trainable* linear weight (LoRA adapters included), none of
    a frozen base and none under ZeRO-3 / FSDP1, whose gathered weights are views (FSDP2's
    unsharded parameters are leaves: ``fsdp_unsharded_leaf_parameters``).

    Alive: forward (from the layer's forward to the end of the autocast region). This matters
    under activation checkpointing, where the copies are not saved for backward but stay in the
    cache; without checkpointing the matmuls save the same copies (the per-layer term
    ``autocast_weight_copies``).

    Source: aten/src/ATen/autocast_mode.cpp ``cached_cast``: ``can_try_cache = to_type ==
    lower_precision_fp && arg.scalar_type() == kFloat && arg.requires_grad() && arg.is_leaf()
    && !arg.is_view() && cache_enabled``; a frozen weight (requires_grad False) or an FSDP
    view is cast on every call and the cast lives only as long as autograd saves it.
    """
    sharded = training.zero_stage == 3 and training.data_parallel_size > 1
    leaves = (  # FSDP2's unsharded parameters, plain tensors without tensor parallelism
        training.conventions.fsdp_unsharded_leaf_parameters and training.tensor_parallel_size == 1
    )
    if not training.uses_autocast or (sharded and not leaves):
        return 0
    c, _ = compute_and_residual_bytes(training)
    if not training.is_lora:
        return c * layer_linear_weights(model, autocast_only=True)
    return c * lora_adapter_elements(model, training)


def sdpa_expands_kv(training: TrainingConfig) -> bool:
    """Keys and values reach attention expanded to all query heads (``repeat_kv``): eager
    attention; the fp32 memory-efficient kernel; and transformers' SDPA path unless it can hand
    GQA to the kernel, which needs torch >= 2.5 and no attention mask (a padded batch passes
    one; transformers integrations/sdpa_attention.py ``use_gqa_in_sdpa``: "attention_mask is
    None (otherwise it will fall back to the math kernel)").

    Alive: forward to the layer's backward (SDPA saves the k and v it was given).
    """
    c, _ = compute_and_residual_bytes(training)
    if training.attention == "eager" or c == 4:
        return True
    if training.attention != "sdpa" or not training.conventions.hf_model_code:
        return False
    torch = parse_version("torch_version", training.torch_version) or DEFAULT_TORCH_VERSION
    return training.padding_mask or torch < (2, 5)


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
    tests/analytic/test_sliding_window.py)."""
    c, _ = compute_and_residual_bytes(training)
    every_layer_masked = (
        sliding_mask_applies(model, training) and model.num_sliding_layers == model.num_layers
    )  # Phi-3 with s >= sliding_window: every layer takes the memory-efficient kernel
    flash = (
        training.attention == "flash"
        or (
            training.attention == "sdpa"
            and c == 2
            and not training.padding_mask
            and not every_layer_masked
        )
    ) and model.head_dim <= 256
    return model.rotary_cat and flash and training.conventions.hf_model_code


def tokens_per_sequence(model: ModelSpec, training: TrainingConfig) -> int:
    """Sequence length the layers see: ``seq_len``; patches (+ 1 for [CLS], none in SigLIP) for a
    vision encoder; the target length for a T5 decoder block (``cross_attention``) and for the
    LM head of an encoder-decoder (:attr:`TrainingConfig.decoder_seq_len`)."""
    if model.architecture == "vision-encoder":
        return model.num_patches + int(model.class_token)
    if model.cross_attention:
        return training.decoder_seq_len
    return training.seq_len


def _output_tokens(model: ModelSpec, training: TrainingConfig) -> int:
    """Tokens per sequence the head and the loss see: the decoder's for an encoder-decoder."""
    if model.architecture == "encoder-decoder":
        return training.decoder_seq_len
    return tokens_per_sequence(model, training)


def _mean_terms(
    model: ModelSpec, fn: Callable[[ModelSpec], dict[str, int]]
) -> dict[str, int] | None:
    """``fn`` of a mean block when the model has blocks of several kinds
    (:meth:`ModelSpec.layer_kinds`): every term weighted by the share of blocks of each kind,
    so the sum over all blocks is exact to a byte per term and block; None for a
    homogeneous model. The schedule holds identical layers, so DeepSeek-V3's dense and MoE
    blocks and T5's encoder and decoder blocks are each held as that mean."""
    kinds = model.layer_kinds()
    if len(kinds) == 1:
        return None
    total = model.num_blocks
    out: dict[str, int] = {}
    for count, block in kinds:
        for key, value in fn(block).items():
            out[key] = out.get(key, 0) + value * count
    return {k: -(-v // total) for k, v in out.items()}


def layer_activation_terms(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes one transformer layer saves for backward, without checkpointing, by term.

    Returns:
        Term name -> bytes for the whole micro-batch (b sequences). Terms of size a*s*s are
        prefixed ``scores/``. See Note [Activation terms] for every term's source; a model
        with blocks of several kinds gives its mean block (``_mean_terms``).
    """
    mean = _mean_terms(model, lambda block: layer_activation_terms(block, training))
    if mean is not None:
        return mean
    b = training.micro_batch_size
    s = tokens_per_sequence(model, training)
    t = b * s
    h, a, kv, d, i = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
    )
    c, r = compute_and_residual_bytes(training)
    mixed = training.uses_autocast
    dropout = training.dropout
    p_hidden = dropout and model.hidden_dropout > 0
    p_attn = dropout and model.attention_dropout > 0
    fused_qkv = model.fused_qkv
    terms: dict[str, int] = {}

    norm_kwargs = dict(
        trainable=not training.is_lora and not training.compile, compiled=training.compile
    )
    norm = _norm_saved_bytes(model, r, **norm_kwargs)
    output_norm = _norm_saved_bytes(model, c, **norm_kwargs) if model.output_norms else 0
    if model.pre_norms:
        terms["attention/norm"] = norm * t
    terms["attention/qkv_input"] = c * h * t * (1 if (fused_qkv or not mixed) else 3)
    # Keys and values reach the kernel expanded to all query heads (GQA) in eager attention
    # (HF ``repeat_kv`` + the matmul's reshape copy) and in the fp32 memory-efficient SDPA
    # kernel; flash (16-bit) takes them at kv-head size. Only the rotated q and k are saved:
    # RoPE's multiplications by cos/sin save cos/sin, not q or k.
    kv_saved = a if sdpa_expands_kv(training) else kv
    terms["attention/q_k"] = c * (a * d + kv_saved * d) * t
    terms["attention/v"] = c * kv_saved * d * t
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
        terms["attention/qk_norm"] = _qk_norm_saved_bytes(model, c, **norm_kwargs) * t
    sliding = sliding_mask_bias_bytes(model, training)
    if sliding:
        # spread over the layers (the schedule repeats one layer): exact in the total
        terms["attention/sliding_mask_bias"] = -(-sliding // model.num_layers)
    mask_bias = materialised_mask_bias_bytes(model, training)
    if mask_bias:
        terms["attention/mask_bias"] = mask_bias
    if output_norm:
        terms["attention/output_norm"] = output_norm * t
    if training.attention == "eager" and model.attention_written_out:
        terms.update(written_out_attention_terms(model, training))
        terms["attention/out_proj_input"] = c * a * d * t
    elif training.attention == "eager":
        sm = 4 if _fp32_softmax(model, training) else c
        if model.attention_softcap:
            # softcap * tanh(scores / softcap): tanh saves its output for backward (1 - y^2), in
            # the scores' dtype (tanh is on none of autocast's lists); the divisions and
            # products by a Python scalar save nothing (modeling_gemma2.py
            # ``eager_attention_forward``; tools/autograd/derivatives.yaml ``tanh``)
            terms["scores/softcap_tanh"] = c * a * s * s * b
        terms["scores/softmax"] = sm * a * s * s * b
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
        if sdpa_output_copied(model, training):
            terms["attention/out_proj_input"] = c * a * d * t
    if p_hidden:
        terms["attention/dropout_mask"] = h * t

    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    if output_norm:
        terms["mlp/output_norm"] = output_norm * t
    if not model.pre_norms:
        pass
    elif not model.parallel_attention:
        terms["mlp/norm"] = norm * t
    elif model.num_norms_per_layer >= 2:  # GPT-NeoX: both norms read the block's input
        terms["mlp/norm"] = (norm - r * h) * t  # second norm reads the same saved input
    # autocast copies of the MLP input: one per projection reading it (gate and up), one for a
    # fused gate_up (modeling_phi3.py ``Phi3MLP.gate_up_proj``)
    n_in = 2 if model.mlp_kind == "gated" and not model.fused_gate_up else 1
    if model.num_experts > 1 and training.conventions.hf_model_code:
        terms.update(moe_terms(model, training, t=t))
        # autocast copies of the block's input for the shared expert's gate and up
        # projections and its sigmoid gate; in true precisions the router saves the input
        copies = (2 if model.shared_expert_intermediate_size else 0) + model.shared_expert_gate
        terms["mlp/input"] = c * h * t * (copies if mixed else 1)
    else:
        if model.num_experts > 1:
            terms["mlp/router"] = (4 * model.num_experts + c * model.num_experts) * t
            terms["mlp/expert_inputs"] = r * h * t * k_top
            terms["mlp/expert_outputs"] = c * h * t * k_top
        terms["mlp/input"] = c * h * t * k_top * (n_in if mixed else 1)
        if model.parallel_attention and model.num_norms_per_layer == 1 and not mixed:
            # Falcon / Phi: one norm feeds attention and MLP; without autocast's casts the MLP
            # saves the very tensor q/k/v saved (``attention/qkv_input``)
            terms["mlp/input"] = 0
        if model.mlp_kind == "gated":
            # gate and up outputs, the activation's output and the down projection's input;
            # under torch.compile the activation's output is recomputed from the saved gate
            # (traced: min-cut keeps gate, up and act(gate) * up)
            terms["mlp/gated"] = (3 if training.compile else 4) * c * i * t * k_top
            if model.activation_written_out and not training.compile:
                # silu(x) = x * torch.sigmoid(x) (cs336_basics/model.py ``silu``): sigmoid
                # saves its output and the product saves it too, one i-sized tensor beyond
                # F.silu's (derivatives.yaml ``sigmoid``: result; ``mul.Tensor``: self, other)
                terms["mlp/gated"] += c * i * t * k_top
        else:
            terms["mlp/activation"] = _activation_fn_saved_bytes(model, training, i) * t * k_top
        if sequential_pre_norm_block(model):
            # the down projection's input (act(gate) * up or the activation's output), the last
            # tensor the MLP saves and the first its backward frees (Note [Backward of a pre-norm
            # block])
            key = "mlp/gated" if model.mlp_kind == "gated" else "mlp/activation"
            terms[key] -= c * i * t * k_top
            terms["mlp/down_input"] = c * i * t * k_top
    if p_hidden:
        terms["mlp/dropout_mask"] = h * t
    if model.layer_scale:
        # Dinov2LayerScale: ``hidden_state * self.lambda1`` saves its input (the attention's /
        # MLP's output, compute dtype) for lambda1's gradient (modeling_dinov2.py)
        terms["attention/layer_scale_input"] = c * h * t
        terms["mlp/layer_scale_input"] = c * h * t
    if model.mla:
        _apply_mla(terms, model, training, t=t)
    if model.architecture == "encoder-decoder":
        _apply_t5(terms, model, training, t=t, norm=norm)
    if training.is_fp8:
        _apply_float8(terms, model, training, t=t, k_top=k_top)
    if mixed:
        terms["autocast_weight_copies"] = autocast_weight_copy_bytes(model, training)
    if training.is_lora:
        _apply_lora(terms, model, training, t=t, k_top=k_top)
    if training.conventions.own_model_code:
        _apply_litgpt_attention(terms, model, training, t=t)
    return split_for_parallelism(terms, training)


def float8_tensor_parallel(training: TrainingConfig) -> bool:
    """The layer linears take torchao's float8 tensor-parallel styles: float8 training with
    tensor parallelism under a framework whose TP plan has them
    (``FrameworkConventions.float8_tensor_parallel``); see Note [Float8 tensor-parallel
    inputs]."""
    return (
        training.is_fp8
        and training.tensor_parallel_size > 1
        and training.conventions.float8_tensor_parallel
    )


def _apply_float8(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """What torchao float8 linears save instead of the 16-bit inputs, in place (float8 values
    are 1 byte). Without tensor parallelism and without compile nothing changes:
    ``Float8Linear`` saves its high-precision input (torchao/float8/float8_linear.py
    ``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(input_hp,
    weight_hp_t)``) and casts it again in backward.

    Note [Float8 tensor-parallel inputs]
        torchtitan parallelizes float8 linears with torchao's float8 styles
        (torchtitan/models/llama3/infra/parallelize.py ``apply_tp`` with
        ``enable_float8_tensorwise_tp``: ``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
        ``PrepareFloat8ModuleInput``; torchao/float8/float8_tensor_parallel.py). Each style's
        ``_prepare_input_fn`` casts the linear's input to float8
        (``hp_tensor_to_float8_dynamic``, a ``DTensor`` of a ``Float8TrainingTensor``) before
        the matmul, which uses it as is (``tensor_already_casted_to_fp8``) and saves it, so
        the saved input is float8, 1 byte a value:

        - q, k, v and gate, up: with sequence parallelism ``PrepareFloat8ModuleInput`` on the
          attention and the MLP casts the sequence shard once, before the all-gather (its
          docstring: "if there are multiple float8 users of the input activation, we perform
          fp8 allgather only once"): one full-sequence float8 [t, h] per module, h t B (not
          c h t). Without it every ``Float8ColwiseParallel`` casts the replicated input on its
          own: one h t B copy per linear (3 for q, k, v; 2 for gate, up).
        - o and down (``Float8RowwiseParallel``): their local input slice is cast, [t, a d / tp]
          and [t, i / tp]; the o projection's float8 copy is saved beside the attention
          output the kernel saves (a d t / tp B more), and the gated product act(gate) * up is
          read only by that cast, so the down projection keeps i t / tp B instead of c i t / tp.

        Traced (trainmem.trace.tensor_parallel applies the same styles): llama-3.2-1b FSDP 2 x
        TP 2 + SP float8, per layer 4 + 2 + 4 + 8 MiB for these four inputs where bf16 kept
        8 + 0 + 8 + 16 MiB.

    Note [Compiled float8 linears]
        Under torch.compile the min-cut partition chooses what a float8 linear keeps (Note
        [Tracing torch.compile], Note [Static-lifetime parameters under compile] in
        trainmem/trace/compile.py). The float8 weights are static-lifetime inputs, so the
        partition saves the weight (free) and recasts it in backward: nothing per layer.
        Without tensor parallelism an input's cast is pointwise (x * scale, clamp, to float8)
        on a tensor the partition keeps or recomputes anyway (the normed input from the norm's
        saved input and rstd; act(gate) * up from the saved gate and up outputs), with the
        scale a saved fp32 scalar: the q/k/v, gate/up and down inputs are recomputed and
        nothing is saved for them (the bf16 input eager keeps is gone too). The o projection's
        float8 input is saved (a d t B): its source is the attention kernel's output, which
        the partition sees apart from the detached output the kernel's backward saves, so
        keeping the 1-byte copy is cheaper than the 2-byte source. With tensor parallelism
        (Note [Float8 tensor-parallel inputs]) a cast that follows a collective is saved: the
        partitioner never recomputes a collective (``force_save_collectives``), so the
        sequence-parallel all-gather's float8 output is kept (q/k/v and gate/up, one h t B
        each module), and a row-parallel input's cast follows the all-reduce of its amax over
        the TP ranks, after which ``ban_if_used_far_apart`` bans recomputing it
        (torch/_functorch/partitioners.py ``solve_min_cut``): down keeps i t / tp B. Without
        sequence parallelism the column-parallel casts have a local amax and are recomputed
        as without TP. Traced on llama-3.2-1b FSDP 2, compile + float8, per layer beyond the
        bf16 compile rule's terms: 8 MiB (o) and no q/k/v, gate/up, down inputs; x TP 2 + SP
        4 + 2 + 4 + 8 MiB (q/k/v, o, gate/up, down); x TP 2 without SP 2 + 8 MiB (o, down).
    """
    if not (training.compile or float8_tensor_parallel(training)):
        return
    h, i = model.hidden_size, model.intermediate_size
    a_d = model.num_heads * model.head_dim
    f8 = 1  # bytes of float8_e4m3fn
    tp = float8_tensor_parallel(training)
    sp = tp and training.sequence_parallel
    # colwise inputs: kept in float8 in eager TP; under compile only an all-gathered one
    if sp or (tp and not training.compile):
        n_qkv = 1 if sp or model.fused_qkv else 3
        n_up = 1 if sp or model.fused_gate_up or model.mlp_kind != "gated" else 2
        terms["attention/qkv_input"] = f8 * h * t * n_qkv
        terms["mlp/input"] = f8 * h * t * k_top * n_up
    else:  # compiled: recast in backward from the norm's saved input
        terms["attention/qkv_input"] = terms["mlp/input"] = 0
    # rowwise inputs: o's float8 copy always; down's under TP (amax all-reduced), else recast
    terms["attention/out_proj_input_float8"] = f8 * a_d * t
    if "mlp/down_input" in terms:
        terms["mlp/down_input"] = f8 * i * t * k_top if tp else 0


def _apply_t5(
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
    b = training.micro_batch_size
    h, a, d, i = model.hidden_size, model.num_heads, model.head_dim, model.intermediate_size
    s = tokens_per_sequence(model, training)
    p_hidden = training.dropout and model.hidden_dropout > 0
    terms["scores/position_bias"] = c * a * s * s
    if model.cross_attention:
        t_source = b * training.seq_len
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
        act = _activation_fn_saved_bytes(model, training, i) - c * i  # without down's input
        out = 4 if model.hidden_act in TANH_FORMULA_ACTIVATIONS else c
        # act's saved tensors, its output and wi_1's (saved by the product), wo's input copy
        terms["mlp/gated"] = (act + out * i + c * i + c * i) * t


def _apply_mla(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int
) -> None:
    """Multi-head latent attention's saved tensors, in place of the q/k/v terms
    (modeling_deepseek_v3.py ``DeepseekV3Attention.forward``, SDPA path).

    * The normed input is read by two linears (``q_a_proj`` or ``q_proj``, and
      ``kv_a_proj_with_mqa``): two 16-bit copies under autocast.
    * ``q_a_layernorm`` / ``kv_a_layernorm`` are HF RMSNorms on 16-bit latents: the fp32 upcast,
      the rstd and the normalised 16-bit tensor (the ``kv_nope`` slice is strided, so its upcast
      is a copy either way); their fp32 outputs (fp32 weight times 16-bit tensor) are cast again
      for ``q_b_proj`` / ``kv_b_proj``.
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
    mixed = training.uses_autocast
    terms["attention/qkv_input"] = c * h * t * (2 if mixed else 1)
    for rank, name in ((model.q_lora_rank, "q"), (model.kv_lora_rank, "kv")):
        if rank:
            terms[f"attention/{name}_latent_norm"] = (4 * rank + c * rank + 4) * t
            terms[f"attention/{name}_latent_input"] = c * rank * t
    terms["attention/q_k"] = 2 * c * a * d * t
    terms["attention/v"] = c * a * (nope + v) * t
    if "attention/sdpa_output" in terms:
        terms["attention/sdpa_output"] = c * a * v * t
    if "attention/out_proj_input" in terms:
        terms["attention/out_proj_input"] = c * a * v * t


def _apply_litgpt_attention(
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


WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS = 5
"""fp32 score-sized tensors alive at once in the backward of a written-out softmax's division
(Note [Backward of a written-out softmax])."""


#: Terms of width h (the norm / residual / dropout region): replicated over tensor-parallel ranks
#: unless sequence parallelism splits them (Korthikanti et al. 2022, sec. 4.2.1-4.2.2).
HIDDEN_REGION_TERMS = frozenset(
    {
        "attention/norm",
        "mlp/norm",
        "attention/output_norm",
        "mlp/output_norm",
        "mlp/shared_expert_gate",
        "attention/qkv_input",
        "mlp/input",
        "attention/dropout_mask",
        "mlp/dropout_mask",
        "mlp/expert_inputs",
        "mlp/expert_outputs",
        "mlp/router",
        "layer_input",
        "final_norm",
        "lm_head_input",
        "mlm_transform",
        "pooled",
        "embedding_norm",
        "embedding_dropout_mask",
    }
)
GATHERED_INPUT_TERMS = frozenset({"attention/qkv_input", "mlp/input", "lm_head_input"})
"""The normed inputs of the column-parallel linears (q/k/v, gate/up, the output layer): under
DTensor sequence parallelism they are all-gathered to the full sequence before the linears,
which save them whole
(:attr:`~trainmem.specs.training.TrainingConfig.sequence_parallel_saves_gathered_input`)."""

ROW_PARALLEL_OUTPUT_TERMS = frozenset({"mm/o", "mm/down"})
"""The matmul outputs of the row-parallel linears (the attention's and the MLP's output
projections) that op-level selective checkpointing saves: each tensor-parallel rank multiplies
its [t, i / t_p] input slice by its [h, i / t_p] weight slice, so its output is a partial sum of
the whole [t, h], summed across the ranks only after the matmul (an all-reduce, or a
reduce-scatter over the sequence with sequence parallelism): the saved ``aten.mm`` output is
the full hidden size and the full sequence on every tensor-parallel rank (torch/distributed/
tensor/parallel/style.py ``RowwiseParallel``: ``Shard(1)`` weight, ``Partial`` output
redistributed to ``output_layouts``; Megatron megatron/core/tensor_parallel/layers.py
``RowParallelLinear.forward``: the matmul, then ``reduce_from`` / ``reduce_scatter_to``). Seen in
the trace of llama-3.1-8b FSDP 4 x TP 2 + SP, op-level SAC: down_proj's saved output 2 h t B."""

#: Inputs every tensor-parallel rank holds whole (token ids, rotary tables).
REPLICATED_INPUT_TERMS = frozenset(
    {
        "inputs/token_ids_and_labels",
        "inputs/pixel_values",
        "rotary_cos_sin",
        "sliding_mask",
        "attention/sliding_mask_bias",
        "attention/mask_bias",
        "causal_mask",
        "attention_mask",
    }
)


def parallel_divisor(term: str, training: TrainingConfig) -> int:
    """Ranks one activation term is split over: tensor parallelism t for the attention / MLP
    internals and the vocabulary-parallel logits (Korthikanti et al. 2022 Eq. 2: sbh(10 + 24/t
    + 5as/ht)), also for the hidden-size region with sequence parallelism (Eq. 3: sbh(34/t +
    5as/ht)); context parallelism splits every term by sequence. Under DTensor sequence
    parallelism (torchtitan) the column-parallel linears save their all-gathered input whole
    (:data:`GATHERED_INPUT_TERMS`)."""
    tp, cp = training.tensor_parallel_size, training.context_parallel_size
    if term in REPLICATED_INPUT_TERMS or term in ROW_PARALLEL_OUTPUT_TERMS:
        return cp
    if term.startswith("lora/"):
        return cp
    if term in GATHERED_INPUT_TERMS and training.sequence_parallel_saves_gathered_input:
        return cp
    if term in HIDDEN_REGION_TERMS and not training.sequence_parallel:
        return cp
    return tp * cp


def split_for_parallelism(terms: dict[str, int], training: TrainingConfig) -> dict[str, int]:
    """Per-rank bytes of each term; see :func:`parallel_divisor`."""
    if training.tensor_parallel_size == 1 and training.context_parallel_size == 1:
        return terms
    return {k: -(-v // parallel_divisor(k, training)) for k, v in terms.items()}


def _apply_lora(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """Adjust one layer's terms for LoRA, in place. See Note [LoRA activations].

    Note [LoRA activations]
        A frozen linear needs no weight gradient, so autograd does not save its input
        (``mm`` saves ``self`` only when ``mat2`` requires grad: torch
        tools/autograd/derivatives.yaml); the input stays saved only if a LoRA ``A`` of a targeted
        linear reads it. Each targeted linear adds ``A``'s output (r values per token, saved by
        ``B``) and, with ``lora_dropout > 0``, peft's dropout output and mask on the input (peft
        ``lora.Linear.forward``: ``lora_B(lora_A(dropout(x)))``). Under autocast each linear
        casts its own input, so the number of saved 16-bit input copies is the number of
        targeted linears reading it. Source: Hu et al. 2021 (arXiv:2106.09685); peft
        ``tuners/lora/layer.py``.
    """
    c, _ = compute_and_residual_bytes(training)
    targets = set(training.lora_targets)
    r, h = training.lora_rank, model.hidden_size
    shapes = linear_shapes(model)
    fused = "qkv" in shapes
    qkv_targets = len({"q", "k", "v"} & targets)
    # bitsandbytes' int8 matmul (``MatMul8bitLt``) and its 4-bit matmul before 0.43.2
    # (``MatMul4Bit``: ``ctx.tensors = (A, B)``) save their input whenever it requires grad,
    # frozen weight or not, so such a base keeps every linear input like full fine-tuning does;
    # ``MatMul4Bit`` since 0.43.2 keeps ``(None, B)``, and torchtune's torchao ``NF4Tensor``
    # (``linear_nf4``) saves only the weight: then a quantized base is like a frozen 16-bit one.
    # See TrainingConfig.quantized_matmul_saves_input.
    frozen_inputs_saved = training.quantized_matmul_saves_input
    # With lora_dropout the adapters read the dropout output (counted below), not x: a frozen
    # base saves no input at all.
    via_dropout = training.lora_dropout > 0 and not frozen_inputs_saved
    # Without autocast, peft casts a 16-bit input to its fp32 adapters (``_cast_input_dtype``:
    # ``x.to(lora_A.weight.dtype)``) and A saves that copy (``lora/*_input_cast``), not x.
    via_cast = (
        not training.uses_autocast
        and dtype_bytes(lora_adapter_dtype(training)) > c
        and not frozen_inputs_saved
    )
    skip_inputs = via_dropout or via_cast
    if frozen_inputs_saved:
        pass
    elif skip_inputs:
        terms["attention/qkv_input"] = 0
    elif qkv_targets == 0:
        terms["attention/qkv_input"] = 0
    elif training.uses_autocast and not fused:
        terms["attention/qkv_input"] = c * h * t * qkv_targets
    if ("o" not in targets or skip_inputs) and not frozen_inputs_saved:
        terms["attention/out_proj_input"] = 0
    elif (
        "o" in targets
        and training.uses_autocast
        and dtype_bytes(lora_adapter_dtype(training)) > c
        and not frozen_inputs_saved
    ):
        # the 16-bit attention output goes to peft's fp32 cast, then autocast's 16-bit cast
        # for A's matmul: a copy of its own, which A saves (tuners/lora/layer.py
        # ``Linear.forward``: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``)
        terms["attention/out_proj_input"] = c * model.num_heads * model.head_dim * t
    n_up = len({"gate", "up"} & targets) if model.mlp_kind == "gated" else int("up" in targets)
    if frozen_inputs_saved:
        pass
    elif n_up == 0 or skip_inputs:
        terms["mlp/input"] = 0
    elif training.uses_autocast:
        terms["mlp/input"] = c * h * t * k_top * n_up
    if ("down" not in targets or skip_inputs) and not frozen_inputs_saved:
        key = "mlp/gated" if model.mlp_kind == "gated" else "mlp/activation"
        terms[key] -= c * model.intermediate_size * t * k_top
    for name, (fan_in, _out, _n) in shapes.items():
        if name == "router":
            continue
        targeted = bool(qkv_targets) if name == "qkv" else name in targets
        if not targeted:
            continue
        active = k_top if name in ("gate", "up", "down") else 1
        a_bytes = dtype_bytes(lora_adapter_dtype(training))
        if training.uses_autocast:
            a_bytes = c  # autocast runs the adapters' matmuls in 16-bit
        terms[f"lora/{name}"] = a_bytes * r * t * active
        # lit-gpt's fused ``attn`` applies one dropout to x for q, k and v together
        # (lit_gpt/lora.py ``LoRAQKVLinear``: ``F.linear(self.lora_dropout(x), self.lora_A)``)
        first_qkv = next((n for n in ("q", "k", "v") if n in targets), None)
        shared = (
            training.conventions.own_model_code and name in ("q", "k", "v") and name != first_qkv
        )
        if training.lora_dropout > 0 and not shared:
            terms[f"lora/{name}_dropout"] = (c + 1) * fan_in * t * active
        if a_bytes > c:
            # peft casts the input to the fp32 adapter's dtype; A saves that copy
            terms[f"lora/{name}_input_cast"] = a_bytes * fan_in * t * active


def lora_adapter_dtype(training: TrainingConfig) -> str:
    """Dtype of the LoRA A and B matrices: peft upcasts adapters on a 16-bit base to fp32
    (``autocast_adapter_dtype=True``, peft tuners/tuners_utils.py); lit-gpt and torchtune keep
    them in the model's dtype."""
    if training.conventions.adapter_dtype_follows_weights:
        return training.weight_dtype
    return "float32"


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
        head_terms: the head terms (for reports).
    """

    per_layer: int
    recompute: int
    embedding: int
    head: int
    num_layers: int
    terms: dict[str, int] = field(default_factory=dict)
    head_terms: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All saved activations at the end of the forward pass, bytes."""
        return self.embedding + self.per_layer * self.num_layers + self.head


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
        out["embedding_norm"] = _norm_saved_bytes(model, r) * t
    eager_mask = eager_mask_bytes(model, training)
    if eager_mask and training.activation_checkpointing != "none":
        out["attention_mask"] = eager_mask  # an input of every checkpointed layer
    if sliding_mask_bias_bytes(model, training) and training.activation_checkpointing != "none":
        # the sliding layers' (b, 1, s, s) boolean mask is an input of every checkpointed
        # layer, kept by the checkpoint until their backward (without checkpointing it dies
        # with the forward; SDPA saves its own float bias)
        out["sliding_mask"] = b * s * s
    if (
        materialised_mask_bias_bytes(model, training)
        and training.activation_checkpointing != "none"
    ):
        # likewise the boolean causal mask Falcon builds for every layer
        out["causal_mask"] = b * s * s
    if training.dropout and model.embedding_dropout > 0:
        out["embedding_dropout_mask"] = h * t
    if model.architecture == "encoder-decoder":
        out.update(_t5_stack_bytes(model, training))
    return split_for_parallelism(out, training)


def _t5_stack_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """What T5's two stacks keep besides their blocks (modeling_t5.py ``T5Stack.forward``,
    ``T5Attention.compute_bias``): the int64 relative-position buckets (s*s, saved by the
    bias embedding), the decoder's all-zero cross-attention bias (1, a, s_target, s_source)
    made once in 16-bit by its first block and saved by every block's SDPA, the dropout masks
    of the decoder's embeddings and of both stacks' output, and under full checkpointing the
    checkpointed blocks' tensor inputs: each stack's fp32 position bias (1, a, s, s) and the
    encoder output every decoder block reads."""
    _, r = compute_and_residual_bytes(training)
    b, a, h = training.micro_batch_size, model.num_heads, model.hidden_size
    s_e, s_d = training.seq_len, training.decoder_seq_len
    c, _ = compute_and_residual_bytes(training)
    # the decoder's first block makes the zero bias and every block's SDPA saves it
    out = {"position_buckets": 8 * (s_e * s_e + s_d * s_d), "cross_bias": c * a * s_d * s_e}
    if training.dropout and model.embedding_dropout > 0:
        # the decoder's embedding dropout and both stacks' dropout after final_layer_norm
        out["stack_dropout_masks"] = h * b * (s_d + s_e + s_d)
    if training.activation_checkpointing == "full":
        out["checkpoint_inputs/position_bias"] = 4 * a * (s_e * s_e + s_d * s_d)
        out["checkpoint_inputs/encoder_output"] = r * h * b * s_e
    return out


def head_activation_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes saved after the last layer, by term.

    Causal/masked LM: final norm, LM-head input, logits (c*V, kept alive by the model output
    until the step ends), and the fp32 log-softmax output saved by ``cross_entropy``; HF
    transformers' ``ForCausalLMLoss`` upcasts logits with ``logits.float()`` before the loss
    (transformers/loss/loss_utils.py). Classification heads keep only the pooled vector.
    """
    b = training.micro_batch_size
    s = _output_tokens(model, training)
    t = b * s
    c, r = compute_and_residual_bytes(training)
    h, v = model.hidden_size, model.vocab_size
    out: dict[str, int] = {}
    if model.architecture == "vision-encoder" and model.vision_pooler != "dense":
        return split_for_parallelism(_vision_pooler_bytes(model, training, t=t), training)
    if model.architecture == "encoder-decoder":
        # the encoder stack's final_layer_norm, on the source tokens
        t_source = b * training.seq_len
        out["encoder_final_norm"] = _norm_saved_bytes(model, r) * t_source
    if model.final_norm:  # BERT (post-LN) has none
        out["final_norm"] = (
            _norm_saved_bytes(model, r, trainable=not training.is_lora and not training.compile) * t
        )
    if model.head in ("causal-lm", "masked-lm", "seq2seq-lm"):
        if model.head == "masked-lm":
            out["mlm_transform"] = (2 * c * h + _norm_saved_bytes(model, r)) * t
        lm_head_frozen = training.is_lora and "lm_head" not in training.lora_targets
        # a frozen LM head saves no input, unless bitsandbytes quantized it (lit-gpt quantizes
        # every linear, the LM head too; HF keeps it unquantized)
        if not lm_head_frozen or quantized_lm_head(training):
            out["lm_head_input"] = c * h * t
        if training.conventions.fp32_model_output:
            # Lightning Fabric casts the model output to fp32 (``_FabricModule.forward`` ->
            # ``precision.convert_output``) and lit-gpt's loop keeps ``logits`` until the step
            # ends (lightning/fabric/plugins/precision/half.py)
            out["logits_fp32_output"] = 4 * v * t
        # The logits are not saved: the training loop drops the model output after the loss,
        # log-softmax keeps only its output and the LM head its input (found by the trace
        # engine); they exist only at the end of forward (loss_forward_transient_bytes).
        # saved by cross_entropy for its backward: fp32 after HF's / torchtune's upcast,
        # the logits' dtype in lit-gpt's chunked cross-entropy
        kind = loss_kind(model, training)
        if kind in ("logits-sum", "logits-mean"):
            pass  # sum / mean save nothing (derivatives.yaml ``sum``, ``mean``)
        elif kind == "cs336-cross-entropy":
            # Note [The course's cross-entropy]: exp's output, the negated log-softmax gather
            # saves, max's int64 indices and log's input
            e = written_out_exp_bytes(training)
            out["log_softmax"] = 2 * e * v * t + (8 + e) * t
        elif loss_in_logits_dtype(model, training):
            # the 16-bit log-softmax output and nll_loss's fp32 copy of it
            # (Note [Cross-entropy on 16-bit logits])
            out["log_softmax"] = (c + 4) * v * t
        elif compiled_chunked_loss(model, training):
            # Note [Compiled chunked cross-entropy]: every chunk's logits in their own dtype and
            # two fp32 values per token (row max, log-sum-exp), no fp32 log-softmax
            out["chunk_logits"] = c * v * t
            out["chunk_row_stats"] = 8 * t
        elif megatron_cross_entropy(model, training):
            # Note [Megatron's vocabulary-parallel cross-entropy]: the fp32 copy of the logits,
            # turned into the softmax in place and saved (``exp_logits``)
            out["vocab_parallel_softmax"] = 4 * v * t
        else:
            out["log_softmax"] = (4 if loss_upcast(model, training) else c) * v * t
        if model.final_logit_softcap and model.head == "causal-lm":
            # softcap * tanh(logits / softcap) before the loss: tanh saves its output, in the
            # LM head's dtype (modeling_gemma2.py ``Gemma2ForCausalLM.forward``)
            out["final_logit_softcap_tanh"] = c * v * t
        if model.head == "seq2seq-lm" and c != 4:
            # T5ForConditionalGeneration calls CrossEntropyLoss on the 16-bit logits (no
            # ``.float()``; autocast runs it in fp32): the trace holds those logits with the
            # fp32 log-softmax output until the loss backward
            out["logits_for_loss"] = c * v * t
        if training.uses_autocast:
            out["autocast_weight_copies"] = c * v * h
    else:
        out["pooled"] = 4 * h * b * 4
    return split_for_parallelism(out, training)


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
        out["final_norm"] = _norm_saved_bytes(model, r) * t
    if model.vision_pooler == "attention-probe":
        out["pooler/kv_input"] = c * h * t
        out["pooler/kv"] = 2 * c * h * t
    out["pooled"] = 4 * h * b
    return out


def quantized_lm_head(training: TrainingConfig) -> bool:
    """The LM head is quantized with the rest of the base: lit-gpt's ``--quantize bnb.*``
    replaces every ``nn.Linear``, the LM head too (lit_gpt/utils.py, Fabric's
    ``BitsandbytesPrecision.convert_module``); HF / peft keep ``lm_head`` unquantized
    (``llm_int8_skip_modules`` defaults to the output embedding)."""
    return training.conventions.own_model_code and training.quantize_base != "none"


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


def loss_kind(model: ModelSpec, training: TrainingConfig) -> str:
    """The loss the step runs on the logits: ``TrainingConfig.loss`` when given (an explicit
    value always wins), else the model's own: the course's written-out cross-entropy for a
    family with ``ModelSpec.loss_written_out``, ``cross-entropy`` otherwise (and for every
    head but a causal LM's, where ``loss`` is refused)."""
    if model.head != "causal-lm":
        return "cross-entropy"
    if training.loss is not None:
        return training.loss
    return "cs336-cross-entropy" if model.loss_written_out else "cross-entropy"


def written_out_exp_bytes(training: TrainingConfig) -> int:
    """Bytes per value of ``torch.exp``'s output in written-out (log-)softmax code: fp32 under
    autocast (``exp`` is on CUDA autocast's fp32 list, aten/src/ATen/autocast_mode.cpp) and in
    fp32 training, the compute dtype otherwise."""
    c, _ = compute_and_residual_bytes(training)
    return 4 if training.uses_autocast else c


def written_out_loss_forward_bytes(training: TrainingConfig, *, t: int, v: int) -> int:
    """Bytes the course's cross-entropy holds at its peak besides the two tensors it saves.

    Note [The course's cross-entropy]
        cs336_basics/nn_utils.py: ``log_softmax(x) = x - x_max - torch.log(torch.sum(
        torch.exp(x - x_max)))`` (spring 2024; the 2025 copy binds ``x = x - x_max`` first and
        holds the same) and ``cross_entropy = torch.mean(torch.gather(-log_softmax(inputs),
        ...))``. With e the bytes of exp's output (:func:`written_out_exp_bytes`), c the
        logits', per (token, vocabulary) value: at the exp the logits, ``x - x_max`` twice (c
        each), exp's fp32 input cast under autocast (4) and its output (e) are alive; at the
        negation the logits, the exp output, the difference (promoted to e) and its negation:
        max(3c + cast + e, c + 3e), i.e. 16 bytes in fp32 and 14 under bf16 autocast. Saved
        for backward: the exp output and the negated log-softmax, which ``gather`` saves whole
        (derivatives.yaml ``gather``: ``gather_backward(grad, self, dim, index, ...)``), e
        bytes per value each, max's int64 indices and log's input (the row sums, e) per token.
        The backward starts with gather's gradient, ``grad.new_zeros(...).scatter_add_(...)``
        in place (FunctionsManual.cpp ``gather_backward``), one e-byte (t, V) tensor beside
        the saved ones, after which gather's saved input goes; the negation's gradient
        replaces it; at ``x - log(S)`` the passed-through gradient, its negation for log's
        side (summed to (t, 1)) and, under autocast, its cast to the 16-bit ``x`` (autograd
        casts a gradient to its input's dtype) are alive: e + e + c with the exp output, the
        same e + 2e as at gather's in fp32 (no cast). So beside what the loss saved: e per
        value, e + c under autocast. Read off S001's recorded stacks (nn_utils.py lines 12-17,
        fp32: never two (t, V) gradients with gather's saved input) and the trace of the
        course model (bf16 autocast: the peak at that ``sum``). Under fake tensors
        ``gather_backward`` takes its out-of-place branch (``areAnyTensorSubclassLike``); the
        trace engine makes it in place as on a GPU (trainmem.trace.cuda_scatter)."""
    c, _ = compute_and_residual_bytes(training)
    e = written_out_exp_bytes(training)
    cast = 4 if training.uses_autocast and c != 4 else 0
    peak = max(3 * c + cast + e, c + 3 * e)
    return (peak - 2 * e) * v * t


def loss_backward_tensors(model: ModelSpec, training: TrainingConfig) -> int:
    """(tokens x vocabulary) tensors the loss's backward holds at once besides what the loss
    saved: one for ``logits-sum`` / ``logits-mean`` (the expanded gradient, materialised for
    the LM head's matmul), for Megatron's vocabulary-parallel cross-entropy (Note [Megatron's
    vocabulary-parallel cross-entropy]) and for the course's cross-entropy, two under autocast
    (Note [The course's cross-entropy]), three under DTensor's loss parallel, two otherwise
    (:func:`loss_backward_transient_bytes`)."""
    kind = loss_kind(model, training)
    if kind == "cs336-cross-entropy":  # Note [The course's cross-entropy]
        c, _ = compute_and_residual_bytes(training)
        return 1 if written_out_exp_bytes(training) == c else 2
    if kind != "cross-entropy" or megatron_cross_entropy(model, training):
        return 1  # Megatron's: the gradient's 16-bit cast (Note [Megatron's ...])
    return 3 if training.loss_parallel else 2


def loss_forward_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes live only at the end of forward, when the loss runs: the logits (c per value) and,
    when the loss upcasts 16-bit logits, their fp32 copy (one chunk of it with a chunked loss).
    Source: transformers/loss/loss_utils.py ``ForCausalLMLoss`` (``logits.float()``).

    SigLIP's attention-pooling head: the fp32 ``last_hidden_state`` the model output holds and
    the packed key/value projection before its ``.contiguous()`` copy (torch/nn/functional.py
    ``_in_projection_packed``) are both alive while the head runs. Under autocast, the 16-bit
    copy of the (transposed) keys that autocast makes for ``linear`` is held until the call
    returns, while ``at::linear`` on that non-contiguous 3-D input runs ``matmul`` (which saves
    its own contiguous copy: ``pooler/kv_input``) and adds the bias out of place, so at that add
    the matmul output (counted as ``pooler/kv``, which takes its size once it is freed) and the
    sum are both alive (aten/src/ATen/native/Linear.cpp ``linear``; the trace engine's peak op,
    ``aten.add.Tensor`` in ``head.attention``)."""
    if model.architecture == "vision-encoder" and model.vision_pooler == "attention-probe":
        c, r = compute_and_residual_bytes(training)
        t = training.micro_batch_size * tokens_per_sequence(model, training)
        autocast_copy = c if training.uses_autocast else 0
        return (r + 2 * c + autocast_copy) * model.hidden_size * t
    if model.head not in ("causal-lm", "masked-lm", "seq2seq-lm"):
        return 0
    t = training.micro_batch_size * _output_tokens(model, training)
    c, _ = compute_and_residual_bytes(training)
    v = model.vocab_size
    chunk = -(-t // max(training.chunked_cross_entropy, 1))
    kind = loss_kind(model, training)
    if kind in ("logits-sum", "logits-mean"):
        total = c * v * t  # the logits; the sum / mean is one value
    elif kind == "cs336-cross-entropy":
        total = written_out_loss_forward_bytes(training, t=t, v=v)
    elif training.conventions.own_model_code:
        # lit-gpt's chunked LM head: one chunk of 16-bit logits before Fabric's fp32 cast (the
        # fp32 logits themselves are a head term)
        total = c * v * chunk
    elif model.head == "seq2seq-lm" and c != 4:
        total = 4 * v * chunk  # the logits are a head term (``logits_for_loss``)
    elif compiled_chunked_loss(model, training):
        # Note [Compiled chunked cross-entropy]: the logits are the saved ``chunk_logits``
        # themselves and the compiled upcast never writes an fp32 copy
        total = 0
    elif megatron_cross_entropy(model, training):
        # Note [Megatron's vocabulary-parallel cross-entropy]: the 16-bit logits beside their
        # fp32 copy, which is the saved softmax (a head term); fp32 logits are that copy
        total = c * v * t if c != 4 else 0
    else:
        upcast = loss_upcast(model, training) and c != 4
        total = c * v * t + (4 * v * chunk if upcast else 0) + shifted_logits_bytes(model, training)
    return -(-total // parallel_divisor("logits", training))


SHIFTED_LABELS_SINCE = (4, 49)
"""transformers release from which ``ForCausalLMLoss`` shifts the labels (``nn.functional.pad(
labels, (0, 1), value=ignore_index)``, then ``labels[..., 1:]``) instead of the logits
(loss/loss_utils.py, 4.49.0); see :func:`shifted_logits_bytes`."""


def shifted_logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the shifted copy of the logits a transformers causal LM makes for its loss before
    transformers 4.49 (:data:`SHIFTED_LABELS_SINCE`): ``shift_logits = logits[..., :-1, :].
    contiguous()``, b*(s - 1) positions in the loss's dtype (fp32 after the upcast, the logits'
    own under :func:`model_loss_in_logits_dtype`), alive beside the logits (and their fp32
    copy, which ``ForCausalLMLoss``'s ``logits`` local holds until it returns) while
    ``cross_entropy`` runs; freed with the forward (``clone`` saves nothing). Its backward,
    ``slice_backward`` (a zero-padded (b, s, V) gradient beside the shifted one), holds no more
    than the log-softmax's backward before it.
    Source: transformers 4.46.0 / 4.48.0 loss/loss_utils.py ``ForCausalLMLoss`` (``logits =
    logits.float()``, then the shift); 4.45.2 modeling_mistral.py / modeling_llama.py
    ``*ForCausalLM.forward`` (the same, in the model); 4.48.0 modeling_gpt_bigcode.py (the
    shift of the 16-bit logits). 0 from 4.49, for other model code, other losses and a chunked
    loss."""
    if (
        model.head != "causal-lm"
        or not training.conventions.hf_model_code
        or training.chunked_cross_entropy
        or loss_kind(model, training) != "cross-entropy"
        or training.transformers_release >= SHIFTED_LABELS_SINCE
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    b, s = training.micro_batch_size, _output_tokens(model, training)
    return (4 if loss_upcast(model, training) else c) * model.vocab_size * b * (s - 1)


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
    checkpointing: :func:`embedding_activation_bytes`). Found by the trace engine."""
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


def input_grad_hook_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes the input-embedding hook keeps after the first layer's backward: the embedding
    output, which the hook made a leaf that requires grad, and its ``.grad`` (r each per
    token and hidden unit); 0 when no hook runs.

    transformers' ``enable_input_require_grads`` registers ``output.requires_grad_(True)`` on
    the input embeddings; transformers 5 calls it from ``_activation_checkpointing_enable``
    for every ``input_ids`` model (modeling_utils.py ``needs_embedding_grads``), and peft's
    ``prepare_model_for_kbit_training`` (``use_gradient_checkpointing=True``, reentrant)
    calls it too. With the embeddings frozen (LoRA), that output has no ``grad_fn``, so it
    becomes a leaf: autograd's ``AccumulateGrad`` node holds it and stores the gradient
    reaching it as its ``.grad``, where a trainable embedding's backward would consume and free
    it; both stay until the graph is dropped with the loss (the HF Trainer's
    ``training_step`` returns before ``optimizer.step``). Checked on the real model on the CPU
    (tests/trace/test_input_grad_hook.py). The first layer's input gradient itself is computed
    as every other layer's (:func:`backward_layer_transients`), as the hook makes it needed.

    Alive: from the end of the first layer's backward to the end of the micro-batch's
    backward.

    Source: transformers modeling_utils.py ``enable_input_require_grads``,
    ``_activation_checkpointing_enable``; peft utils/other.py
    ``prepare_model_for_kbit_training``; torch/csrc/autograd/functions/accumulate_grad.h.
    """
    frozen_embeddings = training.is_lora
    if not (
        training.input_embeddings_require_grad
        and frozen_embeddings
        and model.architecture != "vision-encoder"
    ):
        return 0
    _, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return 2 * r * model.hidden_size * t // parallel_divisor("mlp/input", training)


def final_hidden_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the final norm's output, held by the causal-LM forward
    (``hidden_states = outputs.last_hidden_state``) while its loss runs, where nothing saves it:
    under autocast it is in the residual dtype r and the LM head saves its 16-bit cast (r*h per
    token); when r = c the LM head saves this very tensor (``lm_head_input``). For the
    families of ``ModelSpec.loss_holds_hidden``. Source: modeling_llama.py
    ``LlamaForCausalLM.forward``; found by the trace engine."""
    c, r = compute_and_residual_bytes(training)
    if (
        model.head != "causal-lm"
        or not model.loss_holds_hidden
        or r == c
        or not training.conventions.hf_model_code
    ):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return -(-r * model.hidden_size * t // parallel_divisor("lm_head_input", training))


def forward_kv_cache_bytes(model: ModelSpec, training: TrainingConfig, num_layers: int) -> int:
    """Bytes of the KV cache transformers builds in training (``ModelSpec.forward_kv_cache``),
    alive from each layer's attention to the end of forward (the loss): per layer the cache's
    copy of the rotated keys, r * kv_heads * head_dim bytes per token (fp32 under autocast: the
    rotary tables are fp32), which SDPA does not save (it saves its own 16-bit cast). The
    values' copy is in the values' own dtype, the compute dtype c, and is the very tensor SDPA
    saves (counted in ``attention/v``), so nothing extra. When r = c the keys' copy is the saved
    key too, and nothing is extra. Source: transformers 5.24 cache_utils.py
    ``DynamicLayer.lazy_initialization`` (an empty tensor in the keys' / values' dtype) and
    ``update`` (``torch.cat``); modeling_llama.py ``LlamaModel.forward`` (``DynamicCache``
    when ``use_cache``). transformers 4.x appends the tensors themselves, which keeps the same
    fp32 keys alive; 5.23 created the empty tensor in fp32, so its values' copy was fp32 too
    (r * kv_heads * head_dim more per token and layer, not modelled)."""
    c, r = compute_and_residual_bytes(training)
    if (
        not model.forward_kv_cache
        or r == c
        or training.activation_checkpointing != "none"
        or not training.conventions.hf_model_code
    ):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    per_layer = r * model.num_kv_heads * model.head_dim * t
    return num_layers * -(-per_layer // parallel_divisor("attention/v", training))


def loss_in_logits_dtype(model: ModelSpec, training: TrainingConfig) -> bool:
    """The model's own loss takes its 16-bit logits as they are
    (:func:`model_loss_in_logits_dtype`), under autocast.

    Note [Cross-entropy on 16-bit logits]
        ``cross_entropy`` calls ``log_softmax(input, dim, input.scalar_type())``
        (aten/src/ATen/native/LossNLL.cpp ``cross_entropy``); autocast's
        ``AT_FORALL_FP32_SET_OPT_DTYPE`` policy leaves an op with an explicit dtype alone, so
        the log-softmax runs and saves its output in 16 bits (c*V per token); ``nll_loss``, on
        the fp32 list, casts it to fp32 and saves that copy too (4V). In backward only
        ``nll_loss``'s fp32 gradient (4V) is alive on top of them: by the log-softmax's
        backward the fp32 copy and that gradient are freed and two 16-bit tensors (2cV) take
        their place. Checked with ``saved_tensors_hooks`` under trainmem's CUDA autocast
        policy and against the trace engine (tests/models/formula/bert.json)."""
    return model_loss_in_logits_dtype(model, training) and training.uses_autocast


def model_loss_in_logits_dtype(model: ModelSpec, training: TrainingConfig) -> bool:
    """The model code's own loss calls ``cross_entropy`` on the 16-bit logits, without
    ``.float()``: BERT's masked-LM head (``ModelSpec.mlm_loss_in_logits_dtype``), the causal-LM
    heads of GPT-2, GPTBigCode, Falcon, BLOOM, ... before transformers 4.49
    (``ModelSpec.causal_lm_loss_in_logits_dtype`` at ``TrainingConfig.transformers_release``);
    with HF model code, no chunked loss (which replaces the model's) and no explicit
    ``TrainingConfig.loss``. Under autocast see Note
    [Cross-entropy on 16-bit logits]; without it the log-softmax saves its 16-bit output and
    its backward holds two 16-bit gradients (:func:`loss_upcast` False)."""
    if (
        training.chunked_cross_entropy
        or not training.conventions.hf_model_code
        or loss_kind(model, training) != "cross-entropy"
    ):
        return False
    return model.mlm_loss_in_logits_dtype or model.causal_lm_loss_in_logits_dtype(
        training.transformers_release
    )


def loss_upcast(model: ModelSpec, training: TrainingConfig) -> bool:
    """The cross-entropy works on fp32 logits: transformers' ``ForCausalLMLoss`` /
    ``ForMaskedLMLoss`` (``logits.float()``, transformers/loss/loss_utils.py since 4.46; the
    model code's own ``.float()`` before), torchtune's and lit-gpt's losses
    (``TrainingConfig.loss_upcast``), unless the model's own loss takes its 16-bit logits
    (:func:`model_loss_in_logits_dtype`)."""
    return training.loss_upcast and not model_loss_in_logits_dtype(model, training)


def compiled_chunked_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """The chunked cross-entropy's per-chunk upcast and loss run compiled: torchtune's recipes
    compile ``CEWithChunkedOutputLoss.compute_cross_entropy`` when ``compile`` is on
    (``training.compile_loss``); lit-gpt's chunked loss is never compiled.

    Note [Compiled chunked cross-entropy]
        torchtune 0.4.0: the model returns the list of N chunks of logits in the compute dtype
        (``TransformerDecoder.chunked_output``: ``[self.output(chunk) for chunk in
        last_hidden_state.chunk(N, dim=1)]``, modules/transformer.py); ``CEWithChunkedOutputLoss
        .forward`` runs ``compute_cross_entropy`` = ``F.cross_entropy(logits.float(), labels,
        reduction="sum")`` on each (modules/loss/ce_chunked_output_loss.py) and the recipe
        drops the list after the loss (``del logits``, recipes/full_finetune_single_device.py
        ``_loss_step``); with ``compile`` on, ``training.compile_loss`` replaces
        ``compute_cross_entropy`` by ``torch.compile`` of it (training/_compile.py).

        Eager, each chunk's ``log_softmax`` saves its fp32 output (4V per token, the tensor
        ``nll_loss`` saves too), so the loss keeps 4V per token of every chunk, and one chunk's
        fp32 copy is alive while it runs. Compiled, AOTAutograd traces the chunk's loss on
        inductor's decompositions (``log_softmax`` -> ``amax``, ``sub``, ``exp``, ``sum``,
        ``log``, ``sub``) and the min-cut partition saves the 16-bit input chunk itself, the
        row max and the log-sum-exp (4 B per token each): c*V + 8 per token, and inductor's
        kernels never write the fp32 upcast (it is read inside the reductions). In backward
        the compiled graph recomputes ``exp(x - max - lse)`` and writes the chunk's gradient in
        the logits' dtype (c*V per token of one chunk; ``full`` + ``scatter`` is a pointwise
        ``where`` in inductor, ``scatter_upon_const_tensor``). Autograd runs the N chunks'
        loss backwards before any chunk's output projection (the projections were recorded
        first, in the model's forward, and autograd's ready queue takes the highest sequence
        number first), so when the head's backward starts every chunk's logits gradient is
        alive: c*V per token, N - 1 chunks beside the one
        :func:`loss_backward_transient_bytes` counts (:func:`chunked_loss_gradient_bytes`).
        Checked against the trace engine, which compiles the chunks' loss the same way
        (trainmem.trace.compile ``compile_loss``; tests/trace/test_chunked_loss_compiled.py;
        the bytes by hand in tests/analytic/test_chunked_loss.py).
    """
    return (
        training.compile
        and training.chunked_cross_entropy > 0
        and not training.conventions.own_model_code
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
    )


def megatron_cross_entropy(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's cross-entropy is Megatron's vocabulary-parallel one
    (``FrameworkConventions.vocab_parallel_cross_entropy``), unchunked and not replaced by
    ``TrainingConfig.loss``.

    Note [Megatron's vocabulary-parallel cross-entropy]
        megatron-core 0.9.0, megatron/core/tensor_parallel/cross_entropy.py
        ``_VocabParallelCrossEntropy`` (``GPTModel.forward`` -> ``LanguageModule.
        compute_language_model_loss`` -> ``vocab_parallel_cross_entropy(logits, labels)``; the
        fused variant, ``cross_entropy_loss_fusion``, off by default, runs the same steps).
        Per (token, vocabulary-shard) value, c the logits' bytes, T = b*s tokens, V/t the
        shard:

        * forward: ``calculate_logits_max`` makes the one fp32 copy (``.float()``) while the
          output layer's 16-bit logits are alive (c + 4); ``calculate_predicted_logits``
          subtracts the row max in place ("In-place subtraction reduces memory pressure"),
          then ``torch.exp(vocab_parallel_logits, out=exp_logits)``;
          ``calculate_cross_entropy_loss`` divides by the row sums in place
          (``exp_logits.div_``), and ``ctx.save_for_backward(exp_logits, target_mask,
          masked_target_1d)`` keeps that fp32 softmax (4). The function runs inside an
          ``autograd.Function``, so none of its ops saves anything of its own; the 16-bit
          logits go when ``GPTModel.forward`` returns the loss (the output layer's backward
          needs its input, not its output). With fp32 logits ``.float()`` returns the logits
          themselves: one tensor (4).
        * backward: ``prepare_gradient_calculation_operands`` takes the saved softmax as the
          gradient (``grad_input = softmax``), ``calculate_gradients`` subtracts at the targets
          and multiplies by the incoming gradient in place, and returns it: still the one fp32
          tensor. Autograd casts a gradient to its input's dtype (torch/csrc/autograd/
          engine.cpp ``validate_outputs``) before the node's saved tensors are released
          (``evaluate_function``: ``call_function``, then ``release_variables``), so the 16-bit
          logits gradient (c) is made beside it; the fp32 one goes, and the 16-bit one lives
          through the output layer's backward. fp32 logits need no cast: the saved buffer is
          the gradient (# NB: the schedule frees it with the head's activations, before the
          output layer's backward; Megatron runs 16-bit).

        Against the generic rule (``F.cross_entropy(logits.float())``: the fp32 copy, a
        separate fp32 log-softmax output, two fp32 gradients in backward), the forward peak is
        (c + 4) V/t per token instead of c + 4 + 4 and the backward peak 4 + c instead of
        4 + 4 + 4. # NB: the per-token tensors (the row max and sums, fp32; ``target_mask``,
        bool, and ``masked_target_1d``, int64, saved: 9 B per token) are left out.
    """
    return (
        training.conventions.vocab_parallel_cross_entropy
        and model.head == "causal-lm"
        and training.chunked_cross_entropy == 0
        and loss_kind(model, training) == "cross-entropy"
    )


def chunked_loss_gradient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the logits gradients of the other N - 1 chunks of a chunked cross-entropy,
    alive beside the last one (:func:`loss_backward_transient_bytes`) through the head's
    backward: every chunk's loss backward runs before the chunks' output projections (Note
    [Compiled chunked cross-entropy]); c*V per token. 0 without a chunked loss."""
    n = training.chunked_cross_entropy
    if n <= 1 or model.head != "causal-lm" or training.conventions.own_model_code:
        return 0
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * _output_tokens(model, training)
    chunk = -(-t // n)
    total = c * model.vocab_size * (t - chunk)
    return -(-total // parallel_divisor("logits", training))


def chunked_head_weight_grad_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes alive beside the sum so far of the head weight's gradient while the next chunk's
    is added, under a chunked loss with a trained head: the N output projections share one
    weight, and autograd sums the gradients flowing into its ``AccumulateGrad`` node in that
    node's input buffer (torch/csrc/autograd/input_buffer.cpp ``InputBuffer::add`` /
    ``accumulate``: ``old_var + var``, out of place for two dense gradients), so at each sum
    from the second chunk on the new (V, h) gradient and the sum are alive beside the old
    one: 2*c*V*h (the head's tensor-parallel shard); 0 for a frozen head or an unchunked loss.
    Seen in the trace (the peak at ``aten.add.Tensor`` in ``lm_head``).
    """
    if (
        training.chunked_cross_entropy <= 1
        or model.head != "causal-lm"
        or training.conventions.own_model_code
        or training.is_lora
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    return 2 * c * model.vocab_size * model.hidden_size // training.tensor_parallel_size


def loss_backward_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes live only at the start of backward: the gradient of the log-softmax output and the
    gradient it produces, two fp32 (T, V) tensors (``_log_softmax_backward_data``; measured as the
    step's peak in shared/notes/tracing-without-a-gpu.md sec. 2). With a chunked loss
    (``chunked_cross_entropy`` = N; torchtune ``CEWithChunkedOutputLoss``, lit-gpt
    ``chunked_cross_entropy``) only one chunk's pair is alive at a time: 1/N of it, in the logits'
    dtype when the loss does not upcast. DTensor's loss parallel (torchtitan, vocabulary-sharded
    logits) holds three: its ``_log_softmax_backward`` and the masked ``nll_loss`` gradient
    (torch/distributed/tensor/parallel/loss.py; seen in the trace of llama-3.2-1b, TP 2)."""
    if model.head not in ("causal-lm", "masked-lm", "seq2seq-lm"):
        return 0
    t = training.micro_batch_size * _output_tokens(model, training)
    c, _ = compute_and_residual_bytes(training)
    per_value = 4 if loss_upcast(model, training) else c
    chunks = max(training.chunked_cross_entropy, 1)
    n = loss_backward_tensors(model, training)
    kind = loss_kind(model, training)
    if kind in ("logits-sum", "logits-mean"):
        # ``sum`` backward expands the incoming scalar (a view), ``mean``'s divides it (one
        # tensor): the LM head's matmul backward makes it one contiguous (t, V) tensor of the
        # logits' dtype (derivatives.yaml ``sum``, ``mean``)
        per_value = c
    elif kind == "cs336-cross-entropy":
        # Note [The course's cross-entropy]: e, and under autocast c more at a subtraction
        e = written_out_exp_bytes(training)
        total = (e + (c if c != e else 0)) * model.vocab_size * t
        return -(-total // parallel_divisor("logits", training))
    if loss_in_logits_dtype(model, training):
        # nll_loss's fp32 gradient (Note [Cross-entropy on 16-bit logits])
        n, per_value = 1, 4
    if compiled_chunked_loss(model, training):
        # Note [Compiled chunked cross-entropy]: one chunk's gradient, in the logits' dtype
        n, per_value = 1, c
    if megatron_cross_entropy(model, training):
        # Note [Megatron's vocabulary-parallel cross-entropy]: the saved softmax is the fp32
        # gradient; autograd's cast of it to the logits' dtype is the one new tensor
        n, per_value = 1, (c if c != 4 else 0)
    if model.head == "seq2seq-lm":
        # T5's CrossEntropyLoss: the step's peak is at ``nll_loss_backward``, with its one
        # fp32 (tokens x V) gradient (traced on 2-layer T5 / Flan-T5)
        n = 1
    total = n * per_value * model.vocab_size * -(-t // chunks)
    return -(-total // parallel_divisor("logits", training))


def backward_layer_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """The larger of :func:`backward_layer_transients`' MLP and attention parts, plus the
    residual gradient: the most one layer's backward holds at once besides what it saved."""
    mlp, attention, residual = backward_layer_transients(model, training)
    return max(mlp, attention) + residual


def backward_layer_transients(model: ModelSpec, training: TrainingConfig) -> tuple[int, int, int]:
    """(MLP part, attention part, residual gradient) of what one layer's backward holds besides
    what it saved. MLP: the gradients of its intermediate (2 i-sized tensors, 3 for gated
    MLPs; transformers' MoE experts: see the code) and under autocast the 16-bit weight
    gradient of its largest linear before it is cast into the fp32 ``.grad``. Attention (eager
    only): two score-sized gradients, five fp32 ones for a written-out softmax (Note [Backward
    of a written-out softmax]). The MLP's backward runs first, and by the attention's
    backward the MLP's saved tensors are freed. A model with blocks of several kinds takes the
    largest of each part over its kinds.

    Note [Backward of a written-out softmax]
        cs336_basics/nn_utils.py ``softmax`` ends in ``e / torch.sum(e, ...)``. Its backward
        node (PyTorch's generated ``DivBackward0::apply``) computes the divisor's gradient
        first, ``div_tensor_other_backward``: ``-grad * ((self / other) / other)``
        (FunctionsManual.cpp), whose three temporaries live to the end of that expression, so
        the incoming fp32 gradient, ``-grad``, ``e / S``, ``(e / S) / S`` and their product are
        alive together: five fp32 (b, a, s, s) tensors (the product is then summed to S's
        shape and the temporaries freed before ``grad / S``, the dividend's gradient). Under
        autocast the incoming gradient is fp32 too (the backward of the value einsum's cast).
    """
    kinds = model.layer_kinds()
    if len(kinds) > 1:
        parts = [backward_layer_transients(block, training) for _, block in kinds]
        return (
            max(p[0] for p in parts),
            max(p[1] for p in parts),
            max(p[2] for p in parts),
        )
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c, r = compute_and_residual_bytes(training)
    i, h = model.intermediate_size, model.hidden_size
    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    n = 3 if model.mlp_kind == "gated" else 2
    if model.architecture == "vision-encoder":
        # A vision encoder's step peaks inside its last block's backward (no vocabulary-sized
        # loss), where the trace shows the down projection's saved input already freed when
        # the activation's backward runs: net of it, a fused GELU holds one more i-sized
        # tensor, CLIP's quick_gelu (three saved) and a gated MLP two.
        n = 2 if model.mlp_kind == "gated" or model.hidden_act in SIGMOID_FORMULA_ACTIVATIONS else 1
    mlp = n * c * i * t * k_top // parallel_divisor("mlp/gated", training)
    if training.uses_autocast:
        mlp += c * h * i // training.tensor_parallel_size
        if model.architecture == "vision-encoder" and n == 1 and not model.layer_scale:
            # a fused GELU's block peaks at the down projection's input gradient, while the
            # incoming fp32 residual gradient's cast to the 16-bit fc2 output (the residual
            # add's backward, ``residual + hidden_states`` in modeling_siglip.py
            # ``SiglipEncoderLayer.forward``) is still alive (traced on a 2-layer SigLIP tower,
            # full checkpointing: aten.mm in ``mlp.fc2`` with that cast alive). DINOv2's layer
            # scale makes the same cast, in place of the MLP output its ``hidden * lambda1``
            # saved and its backward has freed by then (traced on a 2-layer DINOv2), which
            # the saved terms already count
            mlp += c * h * t // parallel_divisor("mlp/input", training)
    if model.layer_scale and model.mlp_kind == "gated":
        # a gated MLP's block peaks later, at the gate * up product's backward: by then the
        # layer scale's backward (modeling_dinov2.py ``Dinov2LayerScale``, ``hidden * lambda1``)
        # has freed the MLP output it saved (a saved term here), and the down projection's
        # backward the 16-bit gradient cast that took its place (traced on a 2-layer
        # DINOv2-SwiGLU, full checkpointing: peak in ``mlp.down_proj``'s backward)
        mlp -= c * h * t // parallel_divisor("mlp/input", training)
    if model.layer_scale and training.activation_checkpointing == "none":
        # DINOv2's ``hidden * lambda1`` backward opens the block's backward, with all it saved
        # still alive: the gradient times lambda1 (fp32: lambda1 is an fp32 weight under AMP),
        # its cast to the MLP output's dtype, and the gradient times the input for lambda1's
        # own gradient (traced on a 2-layer DINOv2; under full checkpointing the trace's peak
        # is later, in the recomputed MLP's backward)
        mlp = max(mlp, (2 * r + c) * h * t // parallel_divisor("mlp/input", training))
    if model.num_experts > 1 and training.conventions.hf_model_code:
        # transformers' grouped_mm experts run in the weights' dtype w (:func:`moe_terms`); at
        # the gate/up grouped matmul's backward the gradients of its output (2i), of the
        # activation and product path (i), of the gathered inputs and of the un-permuted
        # outputs (h each) are alive, per routed token (found by the trace engine)
        w = dtype_bytes(training.weight_dtype)
        mlp = w * k_top * (2 * h + 3 * i) * t // parallel_divisor("mlp/gated", training)
    attention = 0
    if training.attention == "eager" and model.attention_written_out:
        # Note [Backward of a written-out softmax]
        s, b = tokens_per_sequence(model, training), training.micro_batch_size
        attention = WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS * 4 * model.num_heads * s * s * b
        attention //= parallel_divisor("scores/x", training)
    elif training.attention == "eager":
        # eager attention's backward holds two (b, a, s, s) tensors in the softmax dtype at its
        # peak: the probabilities' gradient (upcast when the softmax runs in fp32) and the
        # softmax input's gradient (``_softmax_backward_data``; found by the trace engine)
        s, b = tokens_per_sequence(model, training), training.micro_batch_size
        sm = 4 if _fp32_softmax(model, training) else c
        attention = 2 * sm * model.num_heads * s * s * b // parallel_divisor("scores/x", training)
    # the residual-stream gradient: the incoming one, and the one the layer's input gradient
    # accumulates into; only the incoming one at the MLP's peak in a sequential pre-norm block
    # (Note [Backward of a pre-norm block])
    residual = (1 if sequential_pre_norm_block(model) else 2) * r * h * t
    if model.architecture == "vision-encoder":
        # one (b, s, h) gradient reaches the block (LayerNorm's fused backward; the select of
        # the pooled [CLS] row): traced on CLIP, SigLIP, DINOv2 and ViT towers
        residual = r * h * t
    if model.cross_attention:
        # a T5 decoder block's backward also holds the gradients its stack accumulates over
        # all its blocks: the encoder output's (fp32 under autocast, from every
        # cross-attention's k and v), the fp32 relative position bias's, and under
        # checkpointing the cross-attention bias's, which then requires grad
        # (modeling_t5.py ``T5Attention.forward``; traced on a 2-layer Flan-T5)
        b, s = training.micro_batch_size, tokens_per_sequence(model, training)
        a, s_source = model.num_heads, training.seq_len
        residual += r * h * b * s_source + 4 * a * s * s
        if training.activation_checkpointing == "full":
            residual += c * a * s * s_source
    return mlp, attention, residual // parallel_divisor("mlp/input", training)


def sequential_pre_norm_block(model: ModelSpec) -> bool:
    """A decoder block x + attn(norm(x)), then x + mlp(norm(x)), with a gated MLP or one
    fused activation (Llama, Mistral, Qwen, Phi-3, the MoE families, StarCoder2, GPT-BigCode),
    where Note [Backward of a pre-norm block] holds.

    Note [Backward of a pre-norm block]
        Traced on Llama, Phi-3, Qwen2-MoE, Qwen3-MoE and GPT-BigCode (2-layer configs, bf16
        autocast, full activation checkpointing, tests/analytic/test_formula_families.py): the
        layer's backward peaks in its MLP, after the down projection's backward has released
        its saved input (``act(gate) * up``, or the activation's output), with one
        residual-stream gradient alive (the one the layer's input gradient accumulates into
        comes later); the recomputation does not make the layer input again (the checkpoint
        keeps it). Blocks with output norms (Gemma-3, OLMo-2), parallel attention and MLP
        (Falcon, Phi, GPT-NeoX), or GPT-2's tanh-formula GELU keep the general schedule,
        except for the layer input: in every pre-norm decoder the first norm saves the very
        tensor the checkpoint keeps (LayerNorm its input; RMSNorm ``x.to(float32)``, a no-op
        on the fp32 residual stream), so it is not counted twice under full checkpointing
        (Gemma-2 / Gemma-3 against the generic path).
    """
    return (
        model.architecture == "decoder"
        and model.pre_norms
        and not model.output_norms
        and not model.parallel_attention
        and (model.mlp_kind == "gated" or model.hidden_act in FUSED_ACTIVATIONS)
    )


def _fp32_softmax(model: ModelSpec, training: TrainingConfig) -> bool:
    """Eager softmax in fp32: under autocast (``softmax`` is on CUDA autocast's fp32 list), in
    fp32 training, or where the HF code upcasts explicitly (``ModelSpec.eager_softmax_fp32``)."""
    c, _ = compute_and_residual_bytes(training)
    return training.uses_autocast or model.eager_softmax_fp32 or c == 4


def layer_is_checkpointed(training: TrainingConfig) -> bool:
    """The whole layer runs inside a checkpoint region (full, or op-level selective with SDPA):
    its autocast weight casts are not saved but stay in autocast's cache until the forward ends
    (``cached_cast``; cleared on exiting the autocast region)."""
    mode = training.activation_checkpointing
    return mode == "full" or (mode == "selective" and training.attention != "eager")


def op_selective_saved_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes one layer keeps under op-level selective checkpointing: the sum of
    :func:`op_selective_saved_terms`."""
    return sum(op_selective_saved_terms(model, training).values())


def op_selective_saved_terms(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Tensors one layer keeps under op-level selective checkpointing as torchtitan does it
    (``selective_ac_option="op"``): the layer input, the SDPA output + logsumexp, and the output
    of every other matmul in execution order (the 1st, 3rd, ...; torchtitan's policy saves
    ``aten.mm`` "except every second mm"); everything else is recomputed in backward.

    Under ``torch.compile`` the checkpoint is a tagged region of the compiled graph and the
    min-cut partitioner keeps a ``MUST_SAVE`` output only if the backward reads it
    (``torch/_functorch/partitioners.py``: tags ban recomputation, they do not add outputs); the
    outputs of the attention and MLP output projections (``o``, ``down``) only enter the
    residual add, whose backward reads no input, so they are not kept (eager SAC's cache keeps
    every ``MUST_SAVE`` output for the replay). Seen in the trace of llama-3.2-1b (one
    ``(tokens, h)`` tensor per layer less with compile, Note [Tracing torch.compile]).

    Source: torchtitan ``apply_ac`` / ``_get_custom_policy`` (``_save_list`` and the mm counter),
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. See Note [Activation
    checkpointing].
    """
    mean = _mean_terms(model, lambda block: op_selective_saved_terms(block, training))
    if mean is not None:
        return mean
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c, r = compute_and_residual_bytes(training)
    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    # matmul outputs in execution order (experts: k_top of each)
    outputs = [
        (name, c * fan_out * t * (k_top if name in ("gate", "up", "down") else 1))
        for name, (_fan_in, fan_out, _n) in linear_shapes(model).items()
        if name != "router"
    ]
    # a linear with a bias runs as ``addmm`` (always saved); without one as ``mm`` (counted)
    biased = {
        "qkv": model.attention_bias,
        "q": model.attention_bias,
        "k": model.attention_bias,
        "v": model.attention_bias,
        "o": model.attention_out_bias,
        "gate": model.mlp_bias,
        "up": model.mlp_bias,
        "down": model.mlp_bias,
    }
    kept: dict[str, int] = {}
    mm_count = 0
    for name, size in outputs:
        if biased.get(name, False):
            kept[f"mm/{name}"] = size
            continue
        mm_count += 1
        if mm_count % 2 == 1:
            kept[f"mm/{name}"] = size
    if training.compile:  # read by no backward op: the min-cut does not keep them
        kept.pop("mm/o", None)
        kept.pop("mm/down", None)
    split = {
        "layer_input": r * model.hidden_size * t,
        "attention/sdpa_output": c * model.num_heads * model.head_dim * t,
        "attention/logsumexp": 4 * model.num_heads * t,
        **kept,
    }
    return split_for_parallelism(split, training)


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
            mean = _mean_terms(
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
    )
