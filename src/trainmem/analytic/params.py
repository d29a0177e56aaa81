"""Parameter counts of a :class:`~trainmem.specs.model.ModelSpec`, tensor by tensor.

Every count mirrors the ``nn.Parameter`` tensors the transformers class builds (one module per
family, named in each branch below) and equals ``sum(p.numel() for p in model.parameters())``
of that class built on the meta device; ``tests/analytic/test_params.py`` checks this for every
shipped preset. Tied weights are counted once, as ``model.parameters()`` does.

No torch is imported here.
"""

from __future__ import annotations

from trainmem.specs.model import ModelSpec

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
        for MoE; ``router`` for MoE; ``shared_gate`` / ``shared_up`` / ``shared_down`` and
        ``shared_expert_gate`` for a shared expert (Qwen2-MoE). A fused module (Phi-3
        ``gate_up_proj``, GPT-2 ``c_attn``) has the parameters of its parts.

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
    if model.fused_qkv:
        shapes["qkv"] = (h, (a + 2 * k) * d, 1)
    else:
        shapes["q"] = (h, a * d, 1)
        shapes["k"] = (h, k * d, 1)
        shapes["v"] = (h, k * d, 1)
    shapes["o"] = (a * d, h, 1)
    e = model.num_experts
    if model.mlp_kind == "gated":
        shapes["gate"] = (h, i, e)
    shapes["up"] = (h, i, e)
    shapes["down"] = (i, h, e)
    if e > 1:
        shapes["router"] = (h, e, 1)
    si = model.shared_expert_intermediate_size
    if si:
        # Qwen2MoeSparseMoeBlock.shared_expert (a gated MLP) and shared_expert_gate
        shapes["shared_gate"] = (h, si, 1)
        shapes["shared_up"] = (h, si, 1)
        shapes["shared_down"] = (si, h, 1)
        if model.shared_expert_gate:
            shapes["shared_expert_gate"] = (h, 1, 1)
    return shapes


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
    attn = ((a + 2 * k) * d if model.attention_bias else 0) + (h if model.attention_out_bias else 0)
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
    h, L, V = model.hidden_size, model.num_layers, model.vocab_size
    out: dict[str, int] = {}
    if model.architecture == "vision-encoder":
        p, ch = model.patch_size, model.num_channels
        # ViTPatchEmbeddings.projection: Conv2d(C, h, kernel=p, stride=p) with bias.
        out["embedding/patches"] = ch * p * p * h + h
        out["embedding/cls"] = h
        out["embedding/positions"] = (model.num_patches + 1) * h
    else:
        out["embedding/tokens"] = V * h
        if model.position_kind == "learned":
            out["embedding/positions"] = model.max_position_embeddings * h
        if model.type_vocab_size:
            out["embedding/token_types"] = model.type_vocab_size * h
        if model.embedding_norm:
            out["embedding/norm"] = _norm_params(model, h)

    attn_bias, mlp_bias = _layer_bias_params(model)
    shapes = linear_shapes(model)
    attn_w = sum(
        i * o * n for name, (i, o, n) in shapes.items() if name in ("qkv", "q", "k", "v", "o")
    )
    mlp_w = sum(i * o * n for name, (i, o, n) in shapes.items() if name in MLP_LINEARS)
    qk_norm = 0
    if model.qk_norm and model.qk_norm_full_width:
        # Olmo2Attention: q_norm = RMSNorm(a * d), k_norm = RMSNorm(k * d)
        qk_norm = _norm_params(model, model.num_heads * model.head_dim) + _norm_params(
            model, model.num_kv_heads * model.head_dim
        )
    elif model.qk_norm:
        qk_norm = 2 * _norm_params(model, model.head_dim)
    out["layers/attention"] = L * (attn_w + attn_bias + qk_norm)
    out["layers/mlp"] = L * (mlp_w + mlp_bias)
    if "router" in shapes:
        i, o, n = shapes["router"]
        out["layers/router"] = L * i * o * n
    out["layers/norms"] = L * model.num_norms_per_layer * _norm_params(model, h)
    if model.final_norm:
        out["final_norm"] = _norm_params(model, h)

    head = model.head
    if model.architecture == "encoder" and head in ("none", "sequence-classification"):
        out["pooler"] = h * h + h  # BertPooler.dense
    if model.architecture == "vision-encoder" and head == "none":
        width = model.pooler_output_size or h
        out["pooler"] = h * width + width  # ViTPooler.dense
    if head == "causal-lm":
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
    return {k: v for k, v in out.items() if v}


def num_parameters(model: ModelSpec) -> int:
    """All parameter elements of the model (tied weights once); see :func:`parameter_counts`."""
    return sum(parameter_counts(model).values())
