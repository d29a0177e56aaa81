"""The family table: one row per Hugging Face ``model_type`` the formulas model.

Part of :mod:`trainmem.specs.hf` (the rows are split out to keep modules small). A row says
where a family's config stores each quantity and what its modeling code fixes:

- ``aliases``: the family config's ``attribute_map`` (canonical name -> stored name, e.g.
  ``GPT2Config.attribute_map`` maps ``hidden_size`` to ``n_embd``); the canonical name is read
  first, then the alias, and errors about a missing field name the stored one.
- ``legacy``: backward-compatible names a config class still accepts (``FalconConfig`` pops
  ``n_embed``); read after the canonical name.
- ``renames``: a quantity the family stores only under its own name (GPT-2
  ``activation_function``, Gemma-2 ``hidden_activation``, Phi ``qk_layernorm``); the canonical
  name is not read.
- ``defaults``: the fields this family's config has beyond the shape fields, with the
  defaults of ``configuration_<family>.py`` (transformers 5.x); a field absent here is not
  read. A callable default is computed from the spec read so far (GPT-2's ``4 * hidden_size``).
- ``traits``: ModelSpec fields the modeling code fixes (MLP kind, norm, positions, biases,
  parallel attention, fused q/k/v...), from ``modeling_<family>.py``.
- ``derived``: a quantity the modeling code computes and never reads (BLOOM's 4h MLP).
- ``adjust``: the rare rule a table cannot state (Falcon's three attention layouts).

The shape fields (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``intermediate_size``, ``vocab_size``) are required unless a row defaults them or a trait fixes
them: an estimate silently built on a library default would be worse than an error.
``head_dim`` is read when present, else the row's default, else hidden / heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.hf_fields import Fields, short

__all__ = ["FAMILIES", "NO_FAMILY", "REMOTE_CODE_TYPES", "Family", "family_row"]

SpecDict = dict[str, Any]
Default = Any | Callable[[SpecDict], Any]


@dataclass(frozen=True, slots=True)
class Family:
    """One ``model_type``: where its config keeps each quantity, and its fixed traits."""

    model_type: str
    modeling: str
    """The transformers file the traits mirror (``models/llama/modeling_llama.py``)."""
    traits: Mapping[str, Any]
    defaults: Mapping[str, Default] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    legacy: Mapping[str, str] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)
    derived: Mapping[str, Callable[[SpecDict], Any]] = field(default_factory=dict)
    """Quantities the modeling code computes instead of reading (BLOOM's MLP width 4h)."""
    adjust: Callable[[Fields, SpecDict], None] | None = None
    refuse: Callable[[Fields], None] | None = None
    """Raises for a config of this ``model_type`` that another architecture shares, before any
    field is read (ChatGLM-6B's first generation under ``model_type`` chatglm)."""

    # Behaviour traits: what the family's modeling code does at run time (read by ModelSpec's
    # properties of the same names); each found by the trace engine or read in the source cited.
    eager_softmax_fp32: bool = False
    """Its HF eager attention upcasts the softmax to fp32 and casts back
    (``softmax(..., dtype=torch.float32).to(query.dtype)``, e.g. modeling_llama.py
    ``eager_attention_forward``; ``ModelSpec.eager_softmax_fp32``)."""
    training_kv_cache: bool = False
    """Its transformers code builds a KV cache during training (``ModelSpec.training_kv_cache``;
    transformers 5 GPT-2 with ``use_cache=True``, found by the trace engine)."""
    loss_holds_hidden: bool = False
    """Its final hidden states stay alive while the loss runs (transformers'
    ``XForCausalLM.forward`` computes the loss with ``hidden_states`` in scope), checked against
    the trace engine (``ModelSpec.loss_holds_hidden``; Llama / Mistral: tests/analytic/
    test_forward_kv_cache.py). Only with HF model code: frameworks with their own (Megatron,
    lit-gpt, torchtune) and the course model (``cs336_basics``) are not affected."""
    eager_only: bool = False
    """Its code has no SDPA attention, so none of the SDPA kernels (``--attention sdpa`` /
    ``flash``): ``BloomForCausalLM`` computes ALiBi scores with ``baddbmm`` (modeling_bloom.py
    ``BloomAttention``); ``Gemma2PreTrainedModel`` sets ``_supports_sdpa = False`` ("sdpa does
    not support softcapping", modeling_gemma2.py; its ``_supports_flash_attn`` is the flash-attn
    package's kernel, not SDPA's); the CS336 course model writes its attention out
    (cs336_basics/model.py ``scaled_dot_product_attention``: einsum scores, ``torch.where``
    mask, ``nn_utils.softmax``)."""
    not_transformers: bool = False
    """Not a transformers model, so the traced paths (which build the model with transformers)
    cannot run it: the CS336 course's ``BasicsTransformerLM`` (stanford-cs336
    ``cs336_basics/model.py``); the analytic engine models its code."""
    analytic_only: bool = False
    """No traced path builds it (``ModelSpec.analytic_only``): torchvision's
    ``VisionTransformer`` (torchvision is not a dependency); the analytic engine models its
    code, the traced engines refuse it."""
    eager_scores_kept: bool = False
    """Its eager attention keeps its raw and masked scores until it returns (BLOOM;
    ``ModelSpec.eager_scores_kept``)."""
    mlm_loss_in_model_dtype: bool = False
    """Its masked-LM head calls ``CrossEntropyLoss`` on its 16-bit logits itself
    (modeling_bert.py ``BertForMaskedLM.forward``: ``loss_fct = CrossEntropyLoss()``) instead of
    transformers' ``ForMaskedLMLoss``, which upcasts with ``logits.float()``
    (``ModelSpec.mlm_loss_in_logits_dtype``)."""
    materialised_mask: bool = False
    """Its model always builds the (b, 1, s, s) boolean causal mask and hands it to SDPA, even
    without padding (modeling_falcon.py ``FalconModel.forward``: ``create_causal_mask(...,
    allow_is_causal_skip=False)``, "Always materialize the mask so alibi can be added onto it
    below"; ``ModelSpec.sdpa_mask_materialised``)."""
    rotary_cat: bool = False
    """Its rotary embedding concatenates the rotated and the passed-through part of q and k
    (``torch.cat([q_rot_embed, q_pass], dim=-1)``: modeling_gpt_neox.py / modeling_phi3.py
    ``apply_rotary_pos_emb``, modeling_phi.py ``PhiAttention.forward``), so q reaches SDPA as a
    new (b, a, s, d)-contiguous tensor rather than a transposed view of the projection
    (``ModelSpec.rotary_cat``)."""
    forward_kv_cache: bool = False
    """A rotary family whose transformers code builds a KV cache during training that keeps an
    fp32 copy of the rotated keys until the forward ends (``ModelSpec.forward_kv_cache``; the
    rotary tables are fp32 under autocast, so the rotated keys are); checked against the trace
    engine with transformers 5.24 (tests/analytic/test_forward_kv_cache.py, tests/analytic/
    test_formula_families.py). OLMo-2 casts the rotated q and k back to their dtype
    (modeling_olmo2.py ``apply_rotary_pos_emb``: ``q_embed.to(q_type)``), so its cache's copy
    is the 16-bit key SDPA saves; not set there."""
    mha_out_proj_copy: bool = False
    """Its attention is torch's ``nn.MultiheadAttention`` (``batch_first=True``, called with
    ``need_weights=False``), whose SDPA path makes the output projection's input a copy
    (``ModelSpec.mha_out_proj_copy``): torch/nn/functional.py ``multi_head_attention_forward``
    (torch 2.0 / 2.1): ``attn_output = scaled_dot_product_attention(q, k, v, ...)``, then
    ``attn_output.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)`` before
    ``linear(attn_output, out_proj_weight, out_proj_bias)``; the kernel's output is
    (b, s, a, d)-contiguous, so its (s, b, a, d) permutation copies for b > 1 (later releases
    ``.reshape``, the same copy)."""
    causal_mask_buffer: bool = False
    """Its model registers a boolean causal-mask buffer of (max_position_embeddings,
    max_position_embeddings) (modeling_gpt_bigcode.py ``GPTBigCodeModel.__init__``:
    ``register_buffer("bias", torch.tril(torch.ones(..., dtype=torch.bool)),
    persistent=False)``; ``ModelSpec.module_buffer_bytes``)."""


def _four_h(spec: SpecDict) -> int:
    return 4 * int(spec["hidden_size"])


# ---------------------------------------------------------------------------------------
# Traits shared by several rows
# ---------------------------------------------------------------------------------------

_BIASED = dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)

GPT2_TRAITS: Mapping[str, Any] = dict(
    architecture="decoder",
    mlp_kind="gelu",
    norm_kind="layernorm",
    position_kind="learned",
    fused_qkv=True,
    **_BIASED,
)
"""GPT-2: modeling_gpt2.py (``c_attn`` fused q/k/v, ``c_fc`` / ``c_proj``, biases everywhere)."""

LLAMA_TRAITS: Mapping[str, Any] = dict(
    architecture="decoder",
    mlp_kind="gated",
    norm_kind="rmsnorm",
    norm_bias=False,
    position_kind="rotary",
)
"""Llama: modeling_llama.py (LlamaAttention, LlamaMLP gate/up/down, two RMSNorms per layer)."""

LLAMA_DEFAULTS: Mapping[str, Default] = dict(
    num_key_value_heads=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
)
"""``LlamaConfig`` defaults; ``num_key_value_heads`` None means as many as query heads."""

_NO_MLP_BIAS = dict(mlp_bias=False)


def _llama_defaults(**changes: Default) -> dict[str, Default]:
    """Llama's defaults with a family's changes; a change of None drops the field (not read)."""
    out = {**LLAMA_DEFAULTS, **changes}
    return {k: v for k, v in out.items() if v is not None or k == "num_key_value_heads"}


# ---------------------------------------------------------------------------------------
# Rules a table cannot state
# ---------------------------------------------------------------------------------------


def _bert_positions(f: Fields, spec: SpecDict) -> None:
    position_type = f.string("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UnsupportedError(
            f"position_embedding_type: {position_type!r} (relative position embeddings) is "
            "not modelled, only 'absolute'; use --engine trace"
        )


def _gemma_act(f: Fields, spec: SpecDict) -> None:
    # GemmaConfig rewrites the legacy "gelu" of the official releases to the tanh
    # approximation the model was trained with.
    if spec["hidden_act"] == "gelu":
        spec["hidden_act"] = "gelu_pytorch_tanh"


def _falcon(f: Fields, spec: SpecDict) -> None:
    """Falcon: modeling_falcon.py (FalconAttention, FalconDecoderLayer).

    Fused ``query_key_value`` of width (a + 2k) * d where k = ``num_kv_heads`` for the new
    decoder architecture (40B/180B), 1 for ``multi_query`` (7B), else a. Parallel blocks
    share one ``input_layernorm`` unless the new architecture has ``ln_attn`` and
    ``ln_mlp`` (``num_ln_in_parallel_attn`` 2, its default there).
    """
    a = spec["num_heads"]
    new_arch = f.flag("new_decoder_architecture", False)
    multi_query = f.flag("multi_query", True)
    if new_arch:
        spec["num_kv_heads"] = f.kv_heads("num_kv_heads", a)
    elif multi_query:
        spec["num_kv_heads"] = 1
    parallel = f.flag("parallel_attn", True)
    if not parallel:
        num_norms = 2
    else:
        num_norms = f.positive_int("num_ln_in_parallel_attn", 2 if new_arch else 1)
    bias = f.flag("bias", False)
    spec.update(
        parallel_attention=parallel,
        num_norms_per_layer=num_norms,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bias,
        position_kind="alibi" if f.flag("alibi", False) else "rotary",
    )
    if f.flag("apply_residual_connection_post_layernorm", False):
        raise UnsupportedError(
            "apply_residual_connection_post_layernorm: true is not modelled; use --engine trace"
        )


def _neox_rotary(f: Fields, spec: SpecDict) -> None:
    # GPTNeoXConfig: ``rotary_pct`` (legacy) or rope_parameters["partial_rotary_factor"].
    rope = f.config.get("rope_parameters")
    if f.config.get("rotary_pct") is None and isinstance(rope, dict):
        rotary = Fields(rope, f.model_type).fraction("partial_rotary_factor", 0.25)
    else:
        rotary = f.fraction("rotary_pct", 0.25)
    spec["partial_rotary_factor"] = rotary


def _square(f: Fields, key: str, default: int) -> int:
    value = f.config.get(key)
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise SpecError(key, f"got {short(value)}; allowed: an int or [height, width]")
        side = Fields({key: value[0]}, f.model_type).positive_int(key)
        if Fields({key: value[1]}, f.model_type).positive_int(key) != side:
            raise UnsupportedError(
                f"{key}: non-square {value[0]}x{value[1]} is not in the formulas; use --engine "
                "generic (it traces the model with that input)"
            )
        return side
    return f.positive_int(key, default)


def _vit_image(f: Fields, spec: SpecDict) -> None:
    """ViT: modeling_vit.py (ViTEmbeddings, ViTPatchEmbeddings, ViTPooler)."""
    image = _square(f, "image_size", 224)
    patch = _square(f, "patch_size", 16)
    if patch > image:
        raise SpecError("patch_size", f"{patch} is larger than image_size={image}")
    pooler = f.config.get("pooler_output_size")
    spec.update(
        image_size=image,
        patch_size=patch,
        num_channels=f.positive_int("num_channels", 3),
        # ViTEmbeddings.position_embeddings: [1, num_patches + 1, h] (the +1 is [CLS]).
        max_position_embeddings=(image // patch) ** 2 + 1,
        pooler_output_size=None if pooler is None else f.positive_int("pooler_output_size"),
    )


def _multi_query(f: Fields, spec: SpecDict) -> None:
    # GPTBigCodeConfig.__post_init__: num_key_value_heads = 1 if multi_query else n_head
    if f.flag("multi_query", True):
        spec["num_kv_heads"] = 1


def _bloom(f: Fields, spec: SpecDict) -> None:
    if f.flag("apply_residual_connection_post_layernorm", False):
        raise UnsupportedError(
            "apply_residual_connection_post_layernorm: true is not modelled; use --engine trace"
        )


def _sparse_layers(f: Fields, spec: SpecDict) -> None:
    """Qwen2/3-MoE: layer i is sparse unless ``i in mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step != 0`` (Qwen2MoeDecoderLayer.__init__); a mix of dense and sparse
    layers is not modelled by the formulas."""
    step = f.positive_int("decoder_sparse_step", 1)
    only = f.config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(n, int) for n in only):
        raise SpecError("mlp_only_layers", f"must be a list of layer indices, got {short(only)}")
    layers = spec["num_layers"]
    dense = [n for n in range(layers) if n in only or (n + 1) % step != 0]
    if dense:
        raise UnsupportedError(
            f"mlp_only_layers / decoder_sparse_step: {len(dense)} of {layers} layers are dense "
            "MLPs, the rest MoE; the formulas model all-MoE layers only; use --engine trace"
        )


def _qwen2_moe(f: Fields, spec: SpecDict) -> None:
    _sparse_layers(f, spec)
    spec["shared_expert_intermediate_size"] = f.positive_int(
        "shared_expert_intermediate_size", 5632
    )


def _gemma2_softcaps(f: Fields, spec: SpecDict) -> None:
    """Gemma2Config: ``attn_logit_softcapping`` (default 50.0) and ``final_logit_softcapping``
    (default 30.0); an explicit null switches the cap off (modeling_gemma2.py: ``if softcap is
    not None``)."""
    for key, target, default in (
        ("attn_logit_softcapping", "attention_softcap", 50.0),
        ("final_logit_softcapping", "final_logit_softcap", 30.0),
    ):
        value = f.config.get(key, default)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            raise SpecError(key, f"must be a positive number or null, got {short(value)}")
        spec[target] = value is not None


def _gemma2(f: Fields, spec: SpecDict) -> None:
    """Gemma2Config: soft-capping, and ``layer_types`` alternating sliding and full
    attention by default (``"sliding_attention" if bool((i + 1) % 2)``)."""
    _gemma2_softcaps(f, spec)
    _sliding_layers(f, spec, default_pattern=2)


def _gemma3_layers(f: Fields, spec: SpecDict) -> None:
    """Gemma3TextConfig: ``layer_types`` lists each layer's attention, by default every
    ``sliding_window_pattern``-th layer (6) full and the others sliding, of ``sliding_window``
    keys (4096)."""
    _sliding_layers(f, spec, default_pattern=6)


def _sliding_layers(f: Fields, spec: SpecDict, *, default_pattern: int) -> None:
    layers = spec["num_layers"]
    types = f.config.get("layer_types")
    if types is None:
        pattern = f.positive_int("sliding_window_pattern", default_pattern)
        types = ["sliding" if (n + 1) % pattern else "full" for n in range(layers)]
    elif not isinstance(types, list) or len(types) != layers:
        raise SpecError(
            "layer_types", f"must list one attention type per layer ({layers}), got {short(types)}"
        )
    _set_sliding_layers(spec, [str(kind).startswith("sliding") for kind in types])
    spec["sliding_window"] = f.positive_int("sliding_window", 4096)


def _set_sliding_layers(spec: SpecDict, sliding: list[bool]) -> None:
    """``num_sliding_layers`` and, where the layers mix both kinds, ``sliding_layers``."""
    spec["num_sliding_layers"] = sum(sliding)
    if 0 < sum(sliding) < len(sliding):
        spec["sliding_layers"] = tuple(sliding)


def _window(f: Fields, default: int | None) -> int | None:
    """``sliding_window`` of the config (``default``: the config class's), None for none."""
    if "sliding_window" not in f.config:
        return default
    if f.config["sliding_window"] is None:
        return None
    return f.positive_int("sliding_window", default or 4096)


def _every_layer_sliding(default: int | None) -> Callable[[Fields, SpecDict], None]:
    """Mistral / Mixtral / Phi-3 / Starcoder2: every layer attends within ``sliding_window``
    keys when the config sets one (``mask_function = create_causal_mask if
    self.config.sliding_window is None else create_sliding_window_causal_mask``,
    modeling_mistral.py ``MistralModel.forward``; the same line in modeling_mixtral.py,
    modeling_phi3.py, modeling_starcoder2.py); ``default`` is the config class's
    (``MistralConfig.sliding_window = 4096``, the others None)."""

    def adjust(f: Fields, spec: SpecDict) -> None:
        window = _window(f, default)
        if window is not None:
            spec["num_sliding_layers"] = spec["num_layers"]
            spec["sliding_window"] = window

    return adjust


def _qwen_sliding(f: Fields, spec: SpecDict, *, every_layer: bool = False) -> None:
    """Qwen2 / Qwen3 (and Qwen3-MoE, every layer): ``sliding_window`` applies only with
    ``use_sliding_window`` (default False; configuration_qwen2.py ``self.sliding_window =
    self.sliding_window if self.use_sliding_window else None``), then to the layers from
    ``max_window_layers`` (28) on (``layer_types``: ``"sliding_attention" if
    self.sliding_window is not None and i >= self.max_window_layers``), or as ``layer_types``
    lists them."""
    if not f.config.get("use_sliding_window", False):
        return
    window = _window(f, 4096)
    if window is None:
        return
    layers = spec["num_layers"]
    types = f.config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        kinds = [str(kind).startswith("sliding") for kind in types]
    elif every_layer:
        kinds = [True] * layers
    else:
        first = f.config.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise SpecError("max_window_layers", f"must be an integer >= 0, got {short(first)}")
        kinds = [n >= first for n in range(layers)]
    if any(kinds):
        _set_sliding_layers(spec, kinds)
        spec["sliding_window"] = window


def _qwen3_moe(f: Fields, spec: SpecDict) -> None:
    """Qwen3-MoE: sparse layers, and every layer sliding when the config enables it
    (modeling_qwen3_moe.py: ``mask_function = create_causal_mask if self.config.sliding_window
    is None else create_sliding_window_causal_mask``)."""
    _sparse_layers(f, spec)
    _qwen_sliding(f, spec, every_layer=True)


# ---------------------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------------------

_GPT2_NAMES = dict(
    hidden_size="n_embd",
    max_position_embeddings="n_positions",
    num_attention_heads="n_head",
    num_hidden_layers="n_layer",
)
"""``GPT2Config.attribute_map`` (also ``GPTBigCodeConfig``'s)."""

_ROWS: tuple[Family, ...] = (
    Family(
        "gpt2",
        "models/gpt2/modeling_gpt2.py",
        GPT2_TRAITS,
        defaults=dict(
            # GPT2MLP: inner_dim = n_inner if not None else 4 * hidden_size
            intermediate_size=_four_h,
            hidden_act="gelu_new",
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            embedding_dropout=0.1,
        ),
        aliases=_GPT2_NAMES,
        renames=dict(
            intermediate_size="n_inner",
            hidden_act="activation_function",
            hidden_dropout="resid_pdrop",
            attention_dropout="attn_pdrop",
            embedding_dropout="embd_pdrop",
        ),
        training_kv_cache=True,
    ),
    Family(
        "bert",
        "models/bert/modeling_bert.py (BertEmbeddings, BertLayer; post-LN, no final norm)",
        dict(
            architecture="encoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="learned",
            final_norm=False,
            embedding_norm=True,
            **_BIASED,
        ),
        defaults=dict(
            hidden_act="gelu",
            max_position_embeddings=512,
            tie_word_embeddings=True,
            type_vocab_size=2,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            embedding_dropout=0.1,
        ),
        renames=dict(
            hidden_dropout="hidden_dropout_prob",
            attention_dropout="attention_probs_dropout_prob",
            embedding_dropout="hidden_dropout_prob",
        ),
        adjust=_bert_positions,
        mlm_loss_in_model_dtype=True,
    ),
    Family(
        "vit",
        "models/vit/modeling_vit.py (ViTEmbeddings, ViTLayer, ViTPooler)",
        dict(
            architecture="vision-encoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="learned",
            vocab_size=0,
            tie_word_embeddings=False,
            attention_out_bias=True,
            mlp_bias=True,
        ),
        defaults=dict(
            hidden_act="gelu",
            qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            hidden_dropout="hidden_dropout_prob",
            attention_dropout="attention_probs_dropout_prob",
            embedding_dropout="hidden_dropout_prob",
        ),
        adjust=_vit_image,
    ),
    Family(
        "llama",
        "models/llama/modeling_llama.py",
        LLAMA_TRAITS,
        defaults=LLAMA_DEFAULTS,
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "mistral",
        "models/mistral/modeling_mistral.py (no biases)",
        {**LLAMA_TRAITS, "attention_bias": False, "attention_out_bias": False, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=8,
            max_position_embeddings=4096 * 32,
            attention_bias=None,
            mlp_bias=None,
        ),
        adjust=_every_layer_sliding(4096),
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "mixtral",
        "models/mixtral/modeling_mixtral.py (MixtralSparseMoeBlock: router gate Linear(h, E, "
        "bias=False), experts gated MLPs of width intermediate_size)",
        {**LLAMA_TRAITS, "attention_bias": False, "attention_out_bias": False, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=8,
            max_position_embeddings=4096 * 32,
            attention_bias=None,
            mlp_bias=None,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        aliases=dict(num_experts="num_local_experts"),
        adjust=_every_layer_sliding(None),
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "qwen2",
        "models/qwen2/modeling_qwen2.py (q/k/v bias=True, o_proj no bias)",
        {**LLAMA_TRAITS, "attention_bias": True, "attention_out_bias": False, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=32,
            max_position_embeddings=32768,
            attention_bias=None,
            mlp_bias=None,
        ),
        adjust=_qwen_sliding,
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "qwen3",
        "models/qwen3/modeling_qwen3.py (q_norm / k_norm RMSNorm(head_dim))",
        {**LLAMA_TRAITS, "qk_norm": True, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=32, max_position_embeddings=32768, head_dim=128, mlp_bias=None
        ),
        adjust=_qwen_sliding,
        loss_holds_hidden=True,
    ),
    Family(
        "gemma",
        "models/gemma/modeling_gemma.py (GeGLU, tied, head_dim 256; GemmaRMSNorm computes "
        "x * (1 + w) in fp32 and casts at the end)",
        {**LLAMA_TRAITS, "norm_weight_in_fp32": True, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=16,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            head_dim=256,
            mlp_bias=None,
        ),
        adjust=_gemma_act,
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
    ),
    Family(
        "gemma2",
        "models/gemma2/modeling_gemma2.py (Gemma2DecoderLayer: 4 RMSNorms computing x * (1 + w) "
        "in fp32, post norms on the attention and MLP outputs; tanh logit soft-capping in the "
        "eager attention and on the logits)",
        {
            **LLAMA_TRAITS,
            "num_norms_per_layer": 4,
            "output_norms": True,
            "norm_weight_in_fp32": True,
            **_NO_MLP_BIAS,
        },
        defaults=_llama_defaults(
            num_key_value_heads=4,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            head_dim=256,
            mlp_bias=None,
        ),
        renames=dict(hidden_act="hidden_activation"),
        adjust=_gemma2,
        eager_softmax_fp32=True,
        eager_only=True,
    ),
    Family(
        "phi",
        "models/phi/modeling_phi.py (PhiAttention, PhiMLP: one shared input_layernorm feeds "
        "attention and MLP in parallel; every linear has a bias, lm_head too; qk_layernorm adds "
        "LayerNorm(head_dim) on q and k)",
        dict(
            architecture="decoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="rotary",
            parallel_attention=True,
            num_norms_per_layer=1,
            lm_head_bias=True,
            **_BIASED,
        ),
        defaults=dict(
            num_key_value_heads=None,
            hidden_act="gelu_new",
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            qk_norm=False,
            partial_rotary_factor=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            qk_norm="qk_layernorm", hidden_dropout="resid_pdrop", embedding_dropout="embd_pdrop"
        ),
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        rotary_cat=True,
        forward_kv_cache=True,
    ),
    Family(
        "falcon",
        "models/falcon/modeling_falcon.py (FalconAttention, FalconDecoderLayer)",
        dict(architecture="decoder", mlp_kind="gelu", norm_kind="layernorm", fused_qkv=True),
        defaults=dict(
            intermediate_size=_four_h,
            hidden_act="gelu",
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        legacy=dict(
            hidden_size="n_embed", num_attention_heads="n_head", num_hidden_layers="n_layer"
        ),
        renames=dict(intermediate_size="ffn_hidden_size", hidden_act="activation"),
        adjust=_falcon,
        materialised_mask=True,
    ),
    Family(
        "gpt_neox",
        "models/gpt_neox/modeling_gpt_neox.py (fused query_key_value, two LayerNorms per layer "
        "even with the parallel residual, biases on every linear)",
        dict(
            architecture="decoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="rotary",
            fused_qkv=True,
            mlp_bias=True,
        ),
        defaults=dict(
            hidden_act="gelu",
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            attention_bias=True,
            parallel_attention=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        renames=dict(parallel_attention="use_parallel_residual"),
        adjust=_neox_rotary,
        eager_softmax_fp32=True,
        loss_holds_hidden=True,
        rotary_cat=True,
        forward_kv_cache=True,
    ),
)

_NEW_ROWS: tuple[Family, ...] = (
    Family(
        "phi3",
        "models/phi3/modeling_phi3.py (Phi3Attention: fused qkv_proj of width (a + 2k) * d and "
        "o_proj, no biases; Phi3MLP: fused gate_up_proj chunked into gate and up; RMSNorms; "
        "resid_pdrop on both branches, embd_pdrop unused)",
        {**LLAMA_TRAITS, "fused_qkv": True, "fused_gate_up": True, **_NO_MLP_BIAS}
        | dict(attention_bias=False, attention_out_bias=False),
        defaults=_llama_defaults(
            max_position_embeddings=4096,
            attention_bias=None,
            mlp_bias=None,
            partial_rotary_factor=1.0,
            hidden_dropout=0.0,
        ),
        renames=dict(hidden_dropout="resid_pdrop"),
        adjust=_every_layer_sliding(None),
        loss_holds_hidden=True,
        rotary_cat=True,
        forward_kv_cache=True,
    ),
    Family(
        "olmo2",
        "models/olmo2/modeling_olmo2.py (Olmo2Attention: q_norm RMSNorm(a * d), k_norm "
        "RMSNorm(k * d); Olmo2DecoderLayer: no pre-norms, post_attention_layernorm and "
        "post_feedforward_layernorm on the branch outputs)",
        {
            **LLAMA_TRAITS,
            "qk_norm": True,
            "qk_norm_full_width": True,
            "pre_norms": False,
            "output_norms": True,
            "norm_weight_in_fp32": True,
            **_NO_MLP_BIAS,
        },
        defaults=_llama_defaults(mlp_bias=None),
        loss_holds_hidden=True,
    ),
    Family(
        "starcoder2",
        "models/starcoder2/modeling_starcoder2.py (GQA q/k/v/o and c_fc/c_proj biased by "
        "use_bias; LayerNorm with bias; non-gated gelu MLP; residual and embedding dropout)",
        dict(
            architecture="decoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="rotary",
        ),
        defaults=dict(
            num_key_value_heads=2,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            attention_bias="use_bias",
            mlp_bias="use_bias",
            hidden_dropout="residual_dropout",
        ),
        adjust=_every_layer_sliding(None),
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "gpt_bigcode",
        "models/gpt_bigcode/modeling_gpt_bigcode.py (GPTBigCodeAttention: c_attn Linear(h, h + "
        "2 * kv_dim), one kv head if multi_query; otherwise GPT-2's block)",
        GPT2_TRAITS,
        defaults=dict(
            intermediate_size=_four_h,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            embedding_dropout=0.1,
        ),
        aliases=_GPT2_NAMES,
        renames=dict(
            intermediate_size="n_inner",
            hidden_act="activation_function",
            hidden_dropout="resid_pdrop",
            attention_dropout="attn_pdrop",
            embedding_dropout="embd_pdrop",
        ),
        adjust=_multi_query,
        training_kv_cache=True,
        loss_holds_hidden=True,
        causal_mask_buffer=True,
    ),
    Family(
        "bloom",
        "models/bloom/modeling_bloom.py (word_embeddings_layernorm, fused query_key_value, "
        "dense_h_to_4h / dense_4h_to_h of 4h, biases everywhere, ALiBi, eager attention)",
        dict(
            architecture="decoder",
            mlp_kind="gelu",
            norm_kind="layernorm",
            position_kind="alibi",
            fused_qkv=True,
            embedding_norm=True,
            hidden_act="bloom_gelu",
            max_position_embeddings=2048,
            **_BIASED,
        ),
        defaults=dict(tie_word_embeddings=True, hidden_dropout=0.0, attention_dropout=0.0),
        aliases=dict(num_hidden_layers="n_layer", num_attention_heads="n_head"),
        legacy=dict(hidden_size="n_embed"),
        # BloomMLP: dense_h_to_4h = Linear(hidden_size, 4 * hidden_size)
        derived=dict(intermediate_size=_four_h),
        adjust=_bloom,
        eager_only=True,
        eager_scores_kept=True,
    ),
    Family(
        "gemma3_text",
        "models/gemma3/modeling_gemma3.py (Gemma3Attention: q_norm / k_norm RMSNorm(head_dim); "
        "Gemma3DecoderLayer: 4 RMSNorms computing x * (1 + w) in fp32; sliding and global "
        "layers share one shape; Gemma3TextScaledWordEmbedding)",
        {
            **LLAMA_TRAITS,
            "qk_norm": True,
            "num_norms_per_layer": 4,
            "output_norms": True,
            "norm_weight_in_fp32": True,
            "local_rope": True,
            **_NO_MLP_BIAS,
        },
        defaults=_llama_defaults(
            num_key_value_heads=4,
            hidden_act="gelu_pytorch_tanh",
            max_position_embeddings=131_072,
            tie_word_embeddings=True,
            head_dim=256,
            mlp_bias=None,
        ),
        renames=dict(hidden_act="hidden_activation"),
        adjust=_gemma3_layers,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "qwen2_moe",
        "models/qwen2_moe/modeling_qwen2_moe.py (Qwen2MoeAttention: q/k/v bias qkv_bias, o_proj "
        "none; Qwen2MoeSparseMoeBlock: router Linear(h, E), experts of moe_intermediate_size, "
        "a shared expert of shared_expert_intermediate_size with a sigmoid gate Linear(h, 1))",
        {**LLAMA_TRAITS, "attention_out_bias": False, "shared_expert_gate": True, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=16,
            max_position_embeddings=32768,
            attention_bias=None,
            mlp_bias=None,
            qkv_bias=True,
            num_experts=60,
            num_experts_per_tok=4,
            intermediate_size=1408,
        ),
        renames=dict(intermediate_size="moe_intermediate_size"),
        adjust=_qwen2_moe,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
    Family(
        "qwen3_moe",
        "models/qwen3_moe/modeling_qwen3_moe.py (Qwen3MoeAttention: q_norm / k_norm "
        "RMSNorm(head_dim); Qwen3MoeSparseMoeBlock: router Linear(h, E), experts of "
        "moe_intermediate_size, no shared expert)",
        {**LLAMA_TRAITS, "qk_norm": True, **_NO_MLP_BIAS},
        defaults=_llama_defaults(
            num_key_value_heads=4,
            max_position_embeddings=32768,
            mlp_bias=None,
            num_experts=128,
            num_experts_per_tok=8,
            intermediate_size=768,
        ),
        aliases=dict(num_experts="num_local_experts"),
        renames=dict(intermediate_size="moe_intermediate_size"),
        adjust=_qwen3_moe,
        loss_holds_hidden=True,
        forward_kv_cache=True,
    ),
)

# ---------------------------------------------------------------------------------------
# Issue 15 rows of helper "hardfamilies": DeepSeek-V3 (MLA, shared + routed experts, first
# dense layers), T5 (encoder-decoder), CLIP / SigLIP / DINOv2 vision towers
# ---------------------------------------------------------------------------------------


def _first_architecture(f: Fields) -> object:
    archs = f.config.get("architectures")
    return archs[0] if isinstance(archs, list) and archs else archs


def _vision_tower_image(f: Fields, spec: SpecDict, *, patch: int, class_token: bool) -> None:
    """Image and patch sides of a CLIP / SigLIP / DINOv2 tower; positions for the patches
    (+ 1 for [CLS]); only the bare tower (head ``none``) is modelled."""
    if spec["head"] != "none":
        raise UnsupportedError(
            f"architectures: {short(_first_architecture(f))} is not modelled for "
            f"model_type {f.model_type!r}, only the bare vision model; use --engine trace"
        )
    image = _square(f, "image_size", 224)
    side = _square(f, "patch_size", patch)
    if side > image:
        raise SpecError("patch_size", f"{side} is larger than image_size={image}")
    spec.update(
        image_size=image,
        patch_size=side,
        num_channels=f.positive_int("num_channels", 3),
        max_position_embeddings=(image // side) ** 2 + int(class_token),
    )


def _clip_vision(f: Fields, spec: SpecDict) -> None:
    """CLIPVisionConfig: patch_size 32 by default."""
    _vision_tower_image(f, spec, patch=32, class_token=True)


def _siglip_vision(f: Fields, spec: SpecDict) -> None:
    """SiglipVisionConfig: patch_size 16; the pooling head unless ``vision_use_head`` is
    false."""
    _vision_tower_image(f, spec, patch=16, class_token=False)
    if not f.flag("vision_use_head", True):
        raise UnsupportedError(
            "vision_use_head: false (a SigLIP tower without its pooling head) is not "
            "modelled; use --engine trace"
        )


def _dinov2(f: Fields, spec: SpecDict) -> None:
    """Dinov2Config: the MLP width is ``int(hidden_size * mlp_ratio)`` (``Dinov2MLP``), or with
    ``use_swiglu_ffn`` ``(int(int(h * mlp_ratio) * 2 / 3) + 7) // 8 * 8`` in a biased SiLU-gated
    MLP (``Dinov2SwiGLUFFN``); ``mask_token`` exists when ``use_mask_token``."""
    _vision_tower_image(f, spec, patch=14, class_token=True)
    ratio = f.config.get("mlp_ratio", 4)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio < 2**20:
        raise SpecError("mlp_ratio", f"must be a positive number, got {short(ratio)}")
    width = int(spec["hidden_size"] * ratio)
    if f.flag("use_swiglu_ffn", False):
        width = (int(width * 2 / 3) + 7) // 8 * 8
        spec.update(mlp_kind="gated", hidden_act="silu")
    if width <= 0:
        raise SpecError("mlp_ratio", f"{ratio} gives an MLP of width {width}")
    if f.prob("drop_path_rate", 0.0) > 0:
        raise UnsupportedError(
            "drop_path_rate > 0 (stochastic depth) is not modelled; set it to 0 or use "
            "--engine trace"
        )
    spec.update(intermediate_size=width, mask_token=f.flag("use_mask_token", True))


def _deepseek_v3(f: Fields, spec: SpecDict) -> None:
    """DeepseekV3Attention (multi-head latent attention): q_a_proj / q_a_layernorm / q_b_proj
    (q_proj when ``q_lora_rank`` is null), kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj;
    the query/key head is qk_nope + qk_rope wide, the value head v_head_dim; keys and values
    are expanded to every head. DeepseekV3MoE: ``n_shared_experts * moe_intermediate_size``
    shared MLP; the first ``first_k_dense_replace`` layers a DeepseekV3MLP of
    ``intermediate_size``. The MTP module (``num_nextn_predict_layers``) is not in
    transformers' model."""
    rope = f.positive_int("qk_rope_head_dim", 64)
    nope = f.positive_int("qk_nope_head_dim", 128)
    layers = spec["num_layers"]
    first_dense = f.config.get("first_k_dense_replace", 3)
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise SpecError(
            "first_k_dense_replace", f"must be a non-negative integer, got {short(first_dense)}"
        )
    if first_dense > layers:
        raise SpecError(
            "first_k_dense_replace", f"{first_dense} is more than num_hidden_layers={layers}"
        )
    q_rank = f.config.get("q_lora_rank", 1536)
    shared = f.config.get("n_shared_experts", 1)
    spec.update(
        num_kv_heads=spec["num_heads"],
        head_dim=nope + rope,
        partial_rotary_factor=rope / (nope + rope),
        attention_out_bias=spec["attention_bias"],
        q_lora_rank=0 if q_rank is None else f.positive_int("q_lora_rank"),
        kv_lora_rank=f.positive_int("kv_lora_rank", 512),
        qk_rope_head_dim=rope,
        v_head_dim=f.positive_int("v_head_dim", 128),
        shared_expert_intermediate_size=(
            0
            if shared in (None, 0)
            else spec["intermediate_size"] * f.positive_int("n_shared_experts")
        ),
        dense_layers=first_dense,
        dense_intermediate_size=f.positive_int("intermediate_size", 18432),
    )
    if first_dense == layers:
        # every layer a DeepseekV3MLP (``layer_idx >= config.first_k_dense_replace`` never
        # holds): the dense block of ``ModelSpec.layer_kinds`` is the whole model, so the
        # readers of a homogeneous model (one kind) see no expert
        spec.update(
            num_experts=1,
            num_experts_per_tok=1,
            shared_expert_intermediate_size=0,
            intermediate_size=spec["dense_intermediate_size"],
            dense_layers=0,
        )


def _t5(f: Fields, spec: SpecDict) -> None:
    """T5Config: ``feed_forward_proj`` ``relu`` (T5DenseActDense) or ``gated-{act}``
    (T5DenseGatedActDense; ``gated-gelu`` runs ``gelu_new``); ``num_decoder_layers`` defaults
    to ``num_layers``; transformers 5 always ties the LM head to the shared embedding
    (``T5Config.__post_init__``: "we tie weights always and force it to be True"), and the
    config's ``tie_word_embeddings`` only says whether the decoder output is scaled by
    d_model**-0.5 (``scale_decoder_outputs``). So flan-t5-xl has 2.78B parameters in
    transformers 5, not the checkpoint's 2.85B with its separate lm_head."""
    projection = f.string("feed_forward_proj", "relu")
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise SpecError(
            "feed_forward_proj",
            f"must be 'gated-{{ACT_FN}}' or '{{ACT_FN}}' (e.g. 'gated-gelu', 'relu'), got "
            f"{short(projection)}",
        )
    spec.update(
        # the published configs' n_positions (512, the trained length; not a T5Config
        # attribute, relative buckets set no limit): the default --seq-len
        max_position_embeddings=f.positive_int("n_positions", 512),
        head_dim=f.positive_int("d_kv", 64),
        mlp_kind="gated" if parts[0] == "gated" else "gelu",
        hidden_act="gelu_new" if projection == "gated-gelu" else parts[-1],
        num_decoder_layers=f.positive_int("num_decoder_layers", spec["num_layers"]),
        relative_attention_buckets=f.positive_int("relative_attention_num_buckets", 32),
        tie_word_embeddings=True,
        scale_tied_output=f.flag("tie_word_embeddings", True),
    )


def _placeholder(spec: SpecDict) -> int:
    """A value the row's ``adjust`` replaces (it needs config fields a table cannot read)."""
    return 1


_VISION_TOWER_TRAITS: Mapping[str, Any] = dict(
    architecture="vision-encoder",
    mlp_kind="gelu",
    norm_kind="layernorm",
    position_kind="learned",
    vocab_size=0,
    tie_word_embeddings=False,
    attention_out_bias=True,
    mlp_bias=True,
)
"""CLIP / SigLIP / DINOv2 towers: pre-LN blocks with biased q/k/v/o and fc1/fc2, learned
positions, a patch convolution."""

_HARD_ROWS: tuple[Family, ...] = (
    Family(
        "clip_vision_model",
        "models/clip/modeling_clip.py (CLIPVisionEmbeddings: bias-free patch_embedding, "
        "class_embedding; pre_layrnorm; CLIPEncoderLayer; post_layernorm on [CLS] only)",
        {
            **_VISION_TOWER_TRAITS,
            "attention_bias": True,
            "patch_bias": False,
            "embedding_norm": True,
            "final_norm": False,
            "vision_pooler": "cls-norm",
        },
        defaults=dict(hidden_act="quick_gelu", attention_dropout=0.0),
        adjust=_clip_vision,
    ),
    Family(
        "siglip_vision_model",
        "models/siglip/modeling_siglip.py (SiglipVisionEmbeddings: no class token; "
        "post_layernorm on every patch; SiglipMultiheadAttentionPoolingHead)",
        {
            **_VISION_TOWER_TRAITS,
            "attention_bias": True,
            "class_token": False,
            "vision_pooler": "attention-probe",
        },
        defaults=dict(hidden_act="gelu_pytorch_tanh", attention_dropout=0.0),
        adjust=_siglip_vision,
    ),
    Family(
        "dinov2",
        "models/dinov2/modeling_dinov2.py (Dinov2Embeddings: cls_token, mask_token; "
        "Dinov2Layer with Dinov2LayerScale twice; Dinov2MLP or Dinov2SwiGLUFFN; final layernorm, "
        "pooler_output = its [CLS] row)",
        {**_VISION_TOWER_TRAITS, "layer_scale": True, "vision_pooler": "cls"},
        defaults=dict(
            hidden_act="gelu",
            qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            hidden_dropout="hidden_dropout_prob",
            attention_dropout="attention_probs_dropout_prob",
            embedding_dropout="hidden_dropout_prob",
        ),
        derived=dict(intermediate_size=_placeholder),
        adjust=_dinov2,
    ),
    Family(
        "torchvision_vit",
        "torchvision/models/vision_transformer.py (VisionTransformer: conv_proj patch embedding, "
        "class_token, Encoder of EncoderBlock: ln_1, nn.MultiheadAttention(batch_first=True) "
        "called with need_weights=False, ln_2, MLPBlock; heads.head); not a transformers model: "
        "a config.json with model_type torchvision_vit and the vit keys",
        # the vit row's traits (the same biased blocks) with one packed in-projection:
        # ``in_proj_weight`` [3h, h] (torch/nn/functional.py ``_in_projection_packed``)
        {**_VISION_TOWER_TRAITS, "fused_qkv": True},
        defaults=dict(
            hidden_act="gelu",
            qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            hidden_dropout="hidden_dropout_prob",
            attention_dropout="attention_probs_dropout_prob",
            embedding_dropout="hidden_dropout_prob",
        ),
        adjust=_vit_image,
        analytic_only=True,
        mha_out_proj_copy=True,
    ),
    Family(
        "deepseek_v3",
        "models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3Attention: MLA; DeepseekV3MoE: "
        "DeepseekV3TopkRouter Linear(h, E), DeepseekV3Experts of moe_intermediate_size, "
        "shared_experts; DeepseekV3MLP in the first first_k_dense_replace layers)",
        {**LLAMA_TRAITS, **_NO_MLP_BIAS, "sigmoid_router": True},
        defaults=_llama_defaults(
            num_key_value_heads=None,
            max_position_embeddings=4096,
            mlp_bias=None,
            num_experts=256,
            num_experts_per_tok=8,
            intermediate_size=2048,
        ),
        renames=dict(num_experts="n_routed_experts", intermediate_size="moe_intermediate_size"),
        derived=dict(head_dim=_placeholder),
        adjust=_deepseek_v3,
    ),
    Family(
        "t5",
        "models/t5/modeling_t5.py (T5ForConditionalGeneration: shared embedding, T5Stack "
        "encoder and decoder, T5Block self-attention + cross-attention in the decoder + "
        "T5LayerFF, T5LayerNorm without bias, relative_attention_bias in block 0 of each stack)",
        dict(
            architecture="encoder-decoder",
            norm_kind="rmsnorm",
            norm_bias=False,
            position_kind="none",
            mlp_kind="gelu",
            hidden_act="relu",
        ),
        defaults=dict(
            vocab_size=32128,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            embedding_dropout=0.1,
        ),
        # T5Config.attribute_map
        aliases=dict(
            hidden_size="d_model",
            num_attention_heads="num_heads",
            num_hidden_layers="num_layers",
            head_dim="d_kv",
        ),
        renames=dict(
            intermediate_size="d_ff",
            hidden_dropout="dropout_rate",
            attention_dropout="dropout_rate",
            embedding_dropout="dropout_rate",
        ),
        adjust=_t5,
    ),
)


_COURSE_ROWS: tuple[Family, ...] = (
    Family(
        "cs336_basics",
        "stanford-cs336 cs336_basics/model.py (BasicsTransformerLM: Embedding, pre-norm "
        "TransformerBlock of RMSNorm, CausalMultiHeadSelfAttention with RotaryEmbedding and "
        "bias-free q/k/v/output_proj, SwiGLU w1/w2/w3 with silu = x * sigmoid(x); ln_final; "
        "untied lm_head); nn_utils.py softmax / log_softmax / cross_entropy",
        {
            **LLAMA_TRAITS,
            "attention_bias": False,
            "attention_out_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_written_out": True,
            "activation_written_out": True,
            "rotary_buffer": True,
            "loss_written_out": True,
        },
        # BasicsTransformerLM(vocab_size, context_length, d_model, num_layers, num_heads, d_ff,
        # rope_theta): every size is required (no defaults in the course code); context_length
        # sizes the RoPE buffer
        defaults=dict(max_position_embeddings=None),
        renames=dict(
            num_hidden_layers="num_layers",
            hidden_size="d_model",
            num_attention_heads="num_heads",
            intermediate_size="d_ff",
            max_position_embeddings="context_length",
        ),
        eager_only=True,
        not_transformers=True,
    ),
)
"""The CS336 course's reference transformer (Stanford CS336, assignments 1-2), a config.json
with ``"model_type": "cs336_basics"`` and the constructor's arguments as fields."""


# ---------------------------------------------------------------------------------------
# Remote-code families (issue 26): ``trust_remote_code`` models whose layers are Llama /
# Qwen2 shapes under their own field names. The rows read the published config.json only;
# no remote code runs. The modeling files are the ones on the Hub next to each config.
# ---------------------------------------------------------------------------------------


def _qwen1(f: Fields, spec: SpecDict) -> None:
    """Qwen (1): modeling_qwen.py (Qwen/Qwen-7B). ``QWenAttention`` splits ``c_attn``'s
    3 * kv_channels * a outputs into heads of hidden_size / a, so kv_channels must be that
    width; ``QWenMLP`` has ``w1`` / ``w2`` = Linear(h, intermediate_size // 2), so the config's
    ``intermediate_size`` is twice the gated MLP's width; ``c_attn`` is always biased, ``c_proj``
    and the MLP only when ``no_bias`` is false. ``seq_length`` is the trained context (Qwen-7B:
    8192, beside ``max_position_embeddings`` 32768)."""
    h, a = spec["hidden_size"], spec["num_heads"]
    d = f.positive_int("kv_channels", 128)
    if d * a != h:
        raise SpecError(
            "kv_channels",
            f"{d} x num_attention_heads={a} must equal hidden_size={h} (QWenAttention splits "
            "c_attn into heads of hidden_size / num_attention_heads)",
        )
    width = spec["intermediate_size"] // 2
    if width == 0:
        raise SpecError(
            "intermediate_size", "must be at least 2 (QWenMLP's w1 / w2 are intermediate_size // 2)"
        )
    bias = not f.flag("no_bias", True)
    spec.update(
        head_dim=d,
        intermediate_size=width,
        attention_out_bias=bias,
        mlp_bias=bias,
        max_position_embeddings=f.positive_int("seq_length", spec["max_position_embeddings"]),
    )


def _chatglm(f: Fields, spec: SpecDict) -> None:
    """ChatGLM2 / ChatGLM3 / GLM-4: modeling_chatglm.py (THUDM/chatglm3-6b). Heads of
    ``kv_channels``; ``multi_query_group_num`` key/value groups when ``multi_query_attention``;
    ``query_key_value`` biased by ``add_bias_linear or add_qkv_bias``, ``dense`` and the MLP by
    ``add_bias_linear``; RMSNorm if ``rmsnorm`` else LayerNorm; ``final_layernorm`` if
    ``post_layer_norm``. ``ChatGLMModel`` itself holds ``output_layer``, and the published
    ``architectures`` name it (or ``ChatGLMForConditionalGeneration``, a causal LM)."""
    a = spec["num_heads"]
    if f.flag("multi_query_attention", False):
        spec["num_kv_heads"] = f.kv_heads("multi_query_group_num", a, 1)
    linear_bias = f.flag("add_bias_linear", False)
    rmsnorm = f.flag("rmsnorm", True)
    spec.update(
        head_dim=f.positive_int("kv_channels", 128),
        attention_bias=linear_bias or f.flag("add_qkv_bias", False),
        attention_out_bias=linear_bias,
        mlp_bias=linear_bias,
        norm_kind="rmsnorm" if rmsnorm else "layernorm",
        norm_bias=not rmsnorm,
        final_norm=f.flag("post_layer_norm", True),
    )
    if spec["head"] in ("none", "seq2seq-lm"):
        spec["head"], spec["num_labels"] = "causal-lm", 0
    elif spec["head"] != "causal-lm":
        raise UnsupportedError(
            f"architectures: {short(_first_architecture(f))} is not modelled for chatglm, only "
            "the causal LM (ChatGLMModel / ChatGLMForConditionalGeneration)"
        )
    if f.flag("apply_residual_connection_post_layernorm", False):
        raise UnsupportedError(
            "apply_residual_connection_post_layernorm: true is not modelled; set it to false"
        )
    if f.config.get("pre_seq_len") is not None:
        raise UnsupportedError(
            "pre_seq_len: P-Tuning v2's prefix is a training setting here: remove pre_seq_len "
            "from the config and pass --num-virtual-tokens with its value (ChatGLM's "
            "PrefixEncoder has the shapes of peft's prefix tuning, traced on the generic path)"
        )


def _chatglm_first_generation(f: Fields) -> None:
    """THUDM/chatglm-6b (the first generation, May 2023) shares ``model_type`` "chatglm" with
    ChatGLM2 / ChatGLM3 / GLM-4 but is another architecture: GLM blocks with 2D rotary positions
    (``position_encoding_2d``), a plain GELU MLP of ``inner_hidden_size``, LayerNorm and a
    130,528-token vocabulary (its config.json and modeling_chatglm.py ``GLMBlock``), none of
    which the ChatGLM2 row models; adding ``ffn_hidden_size`` by hand would read its MLP as
    gated."""
    for key in ("position_encoding_2d", "inner_hidden_size"):
        if key in f.config:
            raise UnsupportedError(
                f"{key}: a ChatGLM-6B (first generation) config; its GLM blocks (2D positions, "
                "a GELU MLP of inner_hidden_size, LayerNorm) are not modelled, only ChatGLM2 / "
                "ChatGLM3 / GLM-4 configs (ffn_hidden_size, padded_vocab_size, "
                "multi_query_group_num)"
            )


_BAICHUAN_ROPE_WIDTH = 4096
"""Baichuan's two modeling files share ``model_type`` and ``architectures``: the 4096-wide
models (Baichuan-7B, Baichuan2-7B) use RoPE, the 5120-wide ones (Baichuan-13B, Baichuan2-13B)
ALiBi. The width is the only config field that tells them apart (vLLM
model_executor/models/baichuan.py ``BaichuanForCausalLM``: ``if config.hidden_size == 4096:
# baichuan2 7b`` ROPE, else ALIBI)."""


def _baichuan(f: Fields, spec: SpecDict) -> None:
    """Baichuan: the RoPE models only (:data:`_BAICHUAN_ROPE_WIDTH`)."""
    if spec["hidden_size"] != _BAICHUAN_ROPE_WIDTH:
        raise UnsupportedError(
            f"hidden_size: {spec['hidden_size']} is a Baichuan-13B-style model whose ALiBi "
            "attention (its own alibi mask in modeling_baichuan.py) the formulas do not model, "
            "only the RoPE models of hidden_size 4096 (Baichuan-7B, Baichuan2-7B) are; "
            "transformers ships no Baichuan class to trace either"
        )


_REMOTE_CODE_ROWS: tuple[Family, ...] = (
    Family(
        "qwen",
        "Qwen/Qwen-7B modeling_qwen.py (remote code; QWenAttention: fused c_attn Linear(h, 3h) "
        "with bias, c_proj; QWenMLP: w1, w2 Linear(h, intermediate_size // 2), c_proj, "
        "a1 * silu(a2); RMSNorm ln_1 / ln_2 / ln_f; untied lm_head)",
        {
            **LLAMA_TRAITS,
            "fused_qkv": True,
            "fused_qkv_output_kept": True,
            "attention_bias": True,
            "hidden_act": "silu",
        },
        # QWenConfig defaults (configuration_qwen.py)
        defaults=dict(
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            partial_rotary_factor=1.0,
            attention_dropout=0.0,
            embedding_dropout=0.0,
        ),
        renames=dict(
            partial_rotary_factor="rotary_pct",
            attention_dropout="attn_dropout_prob",
            embedding_dropout="emb_dropout_prob",
        ),
        derived=dict(head_dim=_placeholder),
        adjust=_qwen1,
    ),
    Family(
        "chatglm",
        "THUDM/chatglm3-6b modeling_chatglm.py (remote code; SelfAttention: fused "
        "query_key_value Linear(h, (a + 2g) * kv_channels), dense; MLP: dense_h_to_4h "
        "Linear(h, 2 * ffn_hidden_size) chunked into silu(x1) * x2, dense_4h_to_h; rotary on "
        "half of each head; untied output_layer)",
        {
            **LLAMA_TRAITS,
            "fused_qkv": True,
            "fused_gate_up": True,
            "hidden_act": "silu",
            # RotaryEmbedding(rotary_dim // 2) with rotary_dim = kv_channels: half the head
            "partial_rotary_factor": 0.5,
            "tie_word_embeddings": False,
        },
        # ChatGLMConfig defaults (configuration_chatglm.py)
        defaults=dict(max_position_embeddings=2048, hidden_dropout=0.0, attention_dropout=0.0),
        renames=dict(
            num_hidden_layers="num_layers",
            intermediate_size="ffn_hidden_size",
            vocab_size="padded_vocab_size",
            max_position_embeddings="seq_length",
        ),
        derived=dict(head_dim=_placeholder),
        adjust=_chatglm,
        refuse=_chatglm_first_generation,
    ),
    Family(
        "baichuan",
        "baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py (remote code; Attention: fused "
        "W_pack Linear(h, 3h, bias=False), o_proj; Llama's gate/up/down MLP and RMSNorms; "
        "NormHead lm_head (V, h), untied)",
        {
            **LLAMA_TRAITS,
            "fused_qkv": True,
            "fused_qkv_output_kept": True,
            "attention_bias": False,
            "attention_out_bias": False,
            "mlp_bias": False,
        },
        # BaichuanConfig defaults (configuration_baichuan.py)
        defaults=dict(hidden_act="silu", max_position_embeddings=4096, tie_word_embeddings=False),
        adjust=_baichuan,
    ),
)
"""Families whose modeling code is on the Hub, not in transformers (``trust_remote_code``):
transformers knows no such ``model_type``, so the traced paths build the transformers class with
the same tensors instead (trainmem.trace.remote_code, Note [Remote-code stand-ins])."""

REMOTE_CODE_TYPES = frozenset(row.model_type for row in _REMOTE_CODE_ROWS)
"""The ``model_type`` of :data:`_REMOTE_CODE_ROWS`: no transformers configuration class."""


FAMILIES: Mapping[str, Family] = {
    row.model_type: row for row in _ROWS + _NEW_ROWS + _HARD_ROWS + _COURSE_ROWS + _REMOTE_CODE_ROWS
}
"""``model_type`` -> its row."""


NO_FAMILY = Family("", "", {})
"""The row of a ``model_type`` without one (every behaviour trait off)."""


def family_row(model_type: str | None) -> Family:
    """The row of ``model_type`` in :data:`FAMILIES`, or :data:`NO_FAMILY`.

    Args:
        model_type: a config's ``model_type`` (None: none given).

    Returns:
        Its row; its behaviour traits (``eager_only``, ``forward_kv_cache``...) are what the
        family's modeling code does.
    """
    return FAMILIES.get(model_type or "", NO_FAMILY)
