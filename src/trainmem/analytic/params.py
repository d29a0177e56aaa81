"""Parameter counts of a :class:`~trainmem.specs.model.ModelSpec`, tensor by tensor.

Every count mirrors the ``nn.Parameter`` tensors the transformers class builds (one module per
family, named in each branch below) and equals ``sum(p.numel() for p in model.parameters())``
of that class built on the meta device; ``tests/analytic/test_params.py`` checks this for every
shipped preset. Tied weights are counted once, as ``model.parameters()`` does.

No torch is imported here.
"""

from __future__ import annotations

from functools import lru_cache

from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

LinearShapes = dict[str, tuple[int, int, int]]
"""Linear name -> (in_features, out_features, count per layer)."""


def linear_shapes(model: ModelSpec) -> LinearShapes:
    """The weight matrices of one transformer layer, without biases.

    Args:
        model: the transformer's shape.

    Returns:
        ``{name: (in_features, out_features, count_per_layer)}``; ``qkv`` when the HF module is
        fused (GPT-2 ``c_attn``, Falcon / GPT-NeoX ``query_key_value``), else ``q``, ``k``,
        ``v``; ``o``; ``up`` / ``down`` (and ``gate`` for gated MLPs), counted once per expert
        for MoE; ``router`` for MoE; MLA's ``q_a`` / ``q_b`` / ``kv_a`` / ``kv_b``; T5 decoder
        blocks' ``cross_q`` ... ``cross_o``; ``shared_gate`` / ``shared_up`` / ``shared_down``
        and ``shared_expert_gate`` for a shared expert (Qwen2-MoE, DeepSeek-V3). A fused module
        (Phi-3 ``gate_up_proj``, GPT-2 ``c_attn``) has the parameters of its parts. One block of
        one kind (:meth:`ModelSpec.layer_kinds`).

    Source: the attention and MLP modules of each family (e.g. transformers
    ``models/llama/modeling_llama.py`` ``LlamaAttention``, ``LlamaMLP``).
    """
    h, a, k, d, i = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
    )
    shapes: LinearShapes = {}
    if model.mla:
        # modeling_deepseek_v3.py DeepseekV3Attention: q_a_proj / q_b_proj (or q_proj),
        # kv_a_proj_with_mqa (latent + the shared rotary key), kv_b_proj (per-head no-rope key
        # and value), o_proj
        nope = d - model.qk_rope_head_dim
        if model.q_lora_rank:
            shapes["q_a"] = (h, model.q_lora_rank, 1)
            shapes["q_b"] = (model.q_lora_rank, a * d, 1)
        else:
            shapes["q"] = (h, a * d, 1)
        shapes["kv_a"] = (h, model.kv_lora_rank + model.qk_rope_head_dim, 1)
        shapes["kv_b"] = (model.kv_lora_rank, a * (nope + model.v_head_dim), 1)
        shapes["o"] = (a * model.v_head_dim, h, 1)
    elif model.fused_qkv:
        shapes["qkv"] = (h, (a + 2 * k) * d, 1)
        shapes["o"] = (a * d, h, 1)
    else:
        shapes["q"] = (h, a * d, 1)
        shapes["k"] = (h, k * d, 1)
        shapes["v"] = (h, k * d, 1)
        shapes["o"] = (a * d, h, 1)
    if model.cross_attention:
        # modeling_t5.py T5LayerCrossAttention: q from the decoder, k and v from the encoder
        shapes["cross_q"] = (h, a * d, 1)
        shapes["cross_k"] = (h, k * d, 1)
        shapes["cross_v"] = (h, k * d, 1)
        shapes["cross_o"] = (a * d, h, 1)
    e = model.num_experts
    if model.mlp_kind == "gated":
        shapes["gate"] = (h, i, e)
    shapes["up"] = (h, i, e)
    shapes["down"] = (i, h, e)
    if e > 1:
        shapes["router"] = (h, e, 1)
    si = model.shared_expert_intermediate_size
    if si:
        # Qwen2MoeSparseMoeBlock.shared_expert (a gated MLP) and shared_expert_gate;
        # DeepseekV3MoE.shared_experts, a DeepseekV3MLP of n_shared_experts * moe_intermediate
        shapes["shared_gate"] = (h, si, 1)
        shapes["shared_up"] = (h, si, 1)
        shapes["shared_down"] = (si, h, 1)
        if model.shared_expert_gate:
            shapes["shared_expert_gate"] = (h, 1, 1)
    return shapes


FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "gate_up": ("gate", "up"),
    "q_a": ("q",),
    "q_b": ("q",),
    "kv_a": ("k", "v"),
    "kv_b": ("k", "v"),
}
"""The ``--lora-targets`` names a fused linear of :func:`adapted_linears` stands for. Multi-head
latent attention's (transformers modeling_deepseek_v3.py ``DeepseekV3Attention``): the query's
down and up projections ``q_a_proj`` / ``q_b_proj`` are ``q``; the joint key-value compression
``kv_a_proj_with_mqa`` and its up projection ``kv_b_proj`` feed keys and values alike, so
either ``k`` or ``v`` targets both, as any of q, k, v targets a fused qkv (the generic path's
``trainmem.trace.lora._mla_roles``). Before, ``q,v`` adapted no MLA linear: 0 trainable."""


def adapted_linears(model: ModelSpec) -> LinearShapes:
    """The linears peft adapts in one layer: :func:`linear_shapes`, with a fused gate / up
    module (``ModelSpec.fused_gate_up``: Phi-3 ``gate_up_proj``, ChatGLM ``dense_h_to_4h``) as
    the one ``gate_up`` linear (h, 2i) it is. peft wraps the module it targets, so a fused
    module gets one adapter of its own shape: one ``lora_A`` (r x h) reading the input, one
    ``lora_B`` (2i x r) (peft tuners/lora/layer.py ``LoraLayer.update_layer``:
    ``nn.Linear(self.in_features, r)``, ``nn.Linear(r, self.out_features)``), where separate
    gate and up linears would have two A's and two inputs read.

    Args:
        model: the architecture.

    Returns:
        Linear name -> (in_features, out_features, count per layer); ``qkv`` and ``gate_up``
        name fused modules (:data:`FUSED_PARTS`).
    """
    shapes = linear_shapes(model)
    if not model.fused_gate_up or "gate" not in shapes:
        return shapes
    out: LinearShapes = {}
    for name, (fan_in, fan_out, n) in shapes.items():
        if name == "gate":
            out["gate_up"] = (fan_in, 2 * fan_out, n)
        elif name != "up":
            out[name] = (fan_in, fan_out, n)
    return out


def lora_targeted(name: str, targets: tuple[str, ...] | set[str]) -> bool:
    """Whether the linear ``name`` of :func:`adapted_linears` gets an adapter for the
    ``--lora-targets`` ``targets`` (a fused one when any of its parts is named; a decoder
    block's cross-attention ``cross_q`` ... ``cross_o`` when ``q`` ... ``o`` is: peft adapts
    every module whose name ends with the target, T5's ``EncDecAttention.q`` as its
    ``SelfAttention.q``, peft tuners_utils.py ``check_target_module_exists``)."""
    name = name.removeprefix("cross_")
    return any(part in targets for part in FUSED_PARTS.get(name, (name,)))


def adapter_targets(training: TrainingConfig) -> tuple[str, ...]:
    """The linears LoRA adapts (``--lora-targets``); none without LoRA, whose default targets
    a full fine-tune or prompt learning's frozen base leaves unread."""
    return training.lora_targets if training.is_lora else ()


ATTENTION_LINEARS = frozenset(
    {"qkv", "q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b"}
    | {"cross_q", "cross_k", "cross_v", "cross_o"}
)
"""The linears of :func:`linear_shapes` that belong to the attention (``layers/attention``)."""
MLP_LINEARS = frozenset(
    {"gate", "up", "down", "shared_gate", "shared_up", "shared_down", "shared_expert_gate"}
)
"""The linears of :func:`linear_shapes` that belong to the MLP (``layers/mlp``)."""


def _norm_params(model: ModelSpec, width: int) -> int:
    """Elements of one norm of ``width``: LayerNorm weight (+ bias), RMSNorm weight."""
    if model.norm_kind == "layernorm" and model.norm_bias:
        return 2 * width
    return width


def _layer_bias_params(model: ModelSpec) -> tuple[int, int]:
    """(attention biases, MLP biases) of one layer."""
    h, a, k, d, i = (
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.intermediate_size,
    )
    if model.mla:
        # DeepseekV3Attention: bias=config.attention_bias on q_a_proj, kv_a_proj_with_mqa, o_proj
        attn = (
            model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim + h
            if model.attention_bias
            else 0
        )
    else:
        attn = ((a + 2 * k) * d if model.attention_bias else 0) + (
            h if model.attention_out_bias else 0
        )
    mlp = 0
    if model.mlp_bias:
        ups = 2 if model.mlp_kind == "gated" else 1
        mlp = (ups * i + h) * model.num_experts
    return attn, mlp


def parameter_counts(model: ModelSpec) -> dict[str, int]:
    """Parameter elements by component, over the whole model.

    Args:
        model: the transformer's shape.

    Returns:
        Component -> elements. Keys: ``embedding/tokens``, ``embedding/positions`` (learned
        positions), ``embedding/token_types`` (BERT), ``embedding/patches`` and
        ``embedding/cls`` (ViT), ``embedding/norm`` (BERT), ``layers/attention``,
        ``layers/mlp``, ``layers/router``, ``layers/norms`` (sums over all layers),
        ``final_norm``, ``pooler``, ``lm_head`` (absent when tied), ``head`` (MLM transform and
        decoder bias, or a classifier). Zero-sized components are omitted.

    Source: per family, ``XEmbeddings`` / ``XModel.__init__`` / ``XFor...`` heads in
    transformers (gpt2, bert, vit, llama, mistral, mixtral, qwen2, gemma, phi, falcon,
    gpt_neox, phi3, olmo2, starcoder2, gpt_bigcode, bloom, gemma3, qwen2_moe, qwen3_moe
    modeling files).
    """
    out = _embedding_counts(model)
    for count, block in model.layer_kinds():
        for key, n in _block_counts(block).items():
            out[key] = out.get(key, 0) + count * n
    if model.final_norm:
        # an encoder-decoder has one per stack (T5Stack.final_layer_norm)
        stacks = 2 if model.num_decoder_layers else 1
        out["final_norm"] = stacks * _norm_params(model, model.hidden_size)
    out.update(_head_counts(model))
    return {k: v for k, v in out.items() if v}


def _embedding_counts(model: ModelSpec) -> dict[str, int]:
    """Parameter elements before the first block, by component: token (or patch) embeddings,
    learned positions, token types, the embedding norm, T5's relative position biases."""
    h = model.hidden_size
    out: dict[str, int] = {}
    if model.architecture == "vision-encoder":
        p, ch = model.patch_size, model.num_channels
        # ViTPatchEmbeddings.projection / CLIP, SigLIP patch_embedding / Dinov2PatchEmbeddings:
        # Conv2d(C, h, kernel=p, stride=p), with a bias except CLIP's
        out["embedding/patches"] = ch * p * p * h + (h if model.patch_bias else 0)
        if model.class_token:
            out["embedding/cls"] = h
        out["embedding/positions"] = (model.num_patches + int(model.class_token)) * h
        if model.mask_token:
            out["embedding/mask_token"] = h  # Dinov2Embeddings.mask_token
    else:
        out["embedding/tokens"] = model.vocab_size * h
        if model.position_kind == "learned":
            out["embedding/positions"] = model.max_position_embeddings * h
        if model.type_vocab_size:
            out["embedding/token_types"] = model.type_vocab_size * h
    if model.embedding_norm:  # BERT embeddings.LayerNorm, CLIP pre_layrnorm
        out["embedding/norm"] = _norm_params(model, h)
    if model.relative_attention_buckets:
        # T5Attention.relative_attention_bias: Embedding(buckets, heads) in block 0 of each stack
        stacks = 2 if model.num_decoder_layers else 1
        out["embedding/relative_bias"] = stacks * model.relative_attention_buckets * model.num_heads
    return out


def _head_counts(model: ModelSpec) -> dict[str, int]:
    """Parameter elements after the final norm, by component: BERT's pooler, a vision tower's
    pooler, an untied LM head and its bias, BERT's MLM transform, a classifier."""
    h, V = model.hidden_size, model.vocab_size
    head = model.head
    out: dict[str, int] = {}
    if model.architecture == "encoder" and head in ("none", "sequence-classification"):
        out["pooler"] = h * h + h  # BertPooler.dense
    if model.architecture == "vision-encoder" and head == "none":
        out.update(_vision_pooler_counts(model))
    if head in ("causal-lm", "seq2seq-lm"):
        if not model.tie_word_embeddings:
            out["lm_head"] = V * h
        if model.lm_head_bias:
            out["head"] = V
    elif head == "masked-lm":
        # BertOnlyMLMHead: transform.dense (h*h + h), transform.LayerNorm, decoder.bias (V);
        # decoder.weight is tied to the word embeddings unless tie_word_embeddings is false.
        out["head"] = h * h + h + _norm_params(model, h) + V
        if not model.tie_word_embeddings:
            out["lm_head"] = V * h
    elif head in ("sequence-classification", "image-classification"):
        # BertForSequenceClassification.classifier has a bias; LlamaForSequenceClassification's
        # score does not.
        bias = model.num_labels if model.architecture != "decoder" else 0
        out["head"] = h * model.num_labels + bias
    return out


def _block_counts(block: ModelSpec) -> dict[str, int]:
    """Parameter elements of one block of one kind, by component."""
    attn_bias, mlp_bias = _layer_bias_params(block)
    shapes = linear_shapes(block)
    attn_w = sum(i * o * n for name, (i, o, n) in shapes.items() if name in ATTENTION_LINEARS)
    mlp_w = sum(i * o * n for name, (i, o, n) in shapes.items() if name in MLP_LINEARS)
    qk_norm = 0
    if block.qk_norm and block.qk_norm_full_width:
        # Olmo2Attention: q_norm = RMSNorm(a * d), k_norm = RMSNorm(k * d)
        qk_norm = _norm_params(block, block.num_heads * block.head_dim) + _norm_params(
            block, block.num_kv_heads * block.head_dim
        )
    elif block.qk_norm:
        qk_norm = 2 * _norm_params(block, block.head_dim)
    # MLA: q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm) on the latents
    latent_norms = (
        _norm_params(block, block.q_lora_rank) + _norm_params(block, block.kv_lora_rank)
        if block.mla
        else 0
    )
    out = {
        "layers/attention": attn_w + attn_bias + qk_norm + latent_norms,
        "layers/mlp": mlp_w + mlp_bias,
        # T5LayerCrossAttention brings its own layer_norm
        "layers/norms": (block.num_norms_per_layer + int(block.cross_attention))
        * _norm_params(block, block.hidden_size),
    }
    if "router" in shapes:
        i, o, n = shapes["router"]
        out["layers/router"] = i * o * n
    if block.layer_scale:
        out["layers/layer_scale"] = 2 * block.hidden_size  # Dinov2LayerScale.lambda1, twice
    return out


def _vision_pooler_counts(model: ModelSpec) -> dict[str, int]:
    """The pooler of a bare vision tower (head ``none``), see ``ModelSpec.vision_pooler``."""
    h, i = model.hidden_size, model.intermediate_size
    if model.vision_pooler == "dense":
        width = model.pooler_output_size or h
        return {"pooler": h * width + width}  # ViTPooler.dense
    if model.vision_pooler == "cls-norm":
        return {"pooler": _norm_params(model, h)}  # CLIPVisionModel.post_layernorm
    if model.vision_pooler == "attention-probe":
        # SiglipMultiheadAttentionPoolingHead: probe (1, 1, h); nn.MultiheadAttention
        # in_proj (3h, h) + bias, out_proj (h, h) + bias; layernorm; SiglipMLP fc1, fc2
        mha = 3 * h * h + 3 * h + h * h + h
        return {"pooler": h + mha + _norm_params(model, h) + (h * i + i) + (i * h + h)}
    return {}  # Dinov2Model: pooler_output is the [CLS] row of the final norm


@lru_cache(maxsize=64)
def num_parameters(model: ModelSpec) -> int:
    """All parameter elements of the model (tied weights once); see :func:`parameter_counts`.
    Cached per model: the planner asks once per configuration it evaluates."""
    return sum(parameter_counts(model).values())
