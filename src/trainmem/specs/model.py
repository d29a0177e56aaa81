"""ModelSpec: the shape of a transformer, everything both engines need and nothing else.

Legend used across trainmem: s = seq_len, b = micro_batch_size, h = hidden_size,
a = num_heads, k = num_kv_heads, d = head_dim, i = intermediate_size, V = vocab_size,
L = num_layers, E = num_experts.

A ModelSpec is built from a Hugging Face ``config.json`` by
:func:`trainmem.specs.hf.model_spec_from_hf`
(the only place where HF field names are translated).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from dataclasses import replace as _replace
from typing import Literal

from trainmem.errors import SpecError
from trainmem.specs.bounds import MAX_COUNT, describe_int
from trainmem.specs.hf_table import Family, family_row

Architecture = Literal["decoder", "encoder", "vision-encoder", "encoder-decoder"]
MLPKind = Literal["gelu", "gated"]
NormKind = Literal["layernorm", "rmsnorm"]
PositionKind = Literal["learned", "rotary", "alibi", "none"]
HeadKind = Literal[
    "causal-lm",
    "masked-lm",
    "seq2seq-lm",
    "sequence-classification",
    "image-classification",
    "none",
]
VisionPooler = Literal["dense", "cls-norm", "attention-probe", "cls"]

MAX_LAYERS = 10_000
"""Most transformer blocks a model may have: ten times the deepest published one (DeepNet, Wang
et al. 2022, arXiv:2203.00555: 1,000 layers). The step schedule grows with the layer count, so a
config claiming millions would only hang."""


_HEADS_BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "decoder": ("causal-lm", "sequence-classification", "none"),
    "encoder": ("masked-lm", "sequence-classification", "none"),
    "vision-encoder": ("image-classification", "none"),
    "encoder-decoder": ("seq2seq-lm",),
}
"""Heads transformers offers per trunk (``XForCausalLM``, ``BertForMaskedLM``, ...)."""


_TRANSFORMERS_LOSS_FUNCTION_SINCE = (4, 49)
CAUSAL_LM_LOSS_UPCAST_SINCE: dict[str, tuple[int, ...]] = {
    family: _TRANSFORMERS_LOSS_FUNCTION_SINCE
    for family in (
        "bloom",
        "falcon",
        "gpt2",
        "gpt_bigcode",
        "gpt_neox",
        "mpt",
        "opt",
        "persimmon",
        "stablelm",
    )
}
"""Families whose causal-LM head computed its loss on the 16-bit logits until a transformers
release, from which it calls ``self.loss_function`` (``ForCausalLMLoss``, which upcasts with
``logits.float()``, transformers/loss/loss_utils.py since 4.46). Before 4.49 each of these
forwards ran ``shift_logits = lm_logits[..., :-1, :].contiguous()`` and ``CrossEntropyLoss()``
on them, with no ``.float()`` (modeling_gpt_bigcode.py ``GPTBigCodeForCausalLM``,
modeling_gpt2.py ``GPT2LMHeadModel``, modeling_falcon.py, modeling_bloom.py,
modeling_gpt_neox.py, modeling_stablelm.py, modeling_opt.py, modeling_mpt.py,
modeling_persimmon.py; checked on the 4.45.2, 4.46.0, 4.47.0 and 4.48.0 wheels); 4.49.0 calls
``self.loss_function`` in all of them. GPT-J, GPT-Neo and CodeGen cast their logits with
``.to(torch.float32)`` themselves, and the Llama-style families upcast in the model before 4.46
(``logits = logits.float()``) and through ``ForCausalLMLoss`` after
(``ModelSpec.causal_lm_loss_in_logits_dtype``)."""

REMOTE_CODE_LOSS_IN_LOGITS_DTYPE = frozenset({"qwen"})
"""Remote-code families whose causal-LM head computes its loss on its 16-bit logits with a
shifted copy of them, whatever the transformers release: the Hub's modeling file runs, not
transformers' (``trust_remote_code``). Qwen-1 (Qwen/Qwen-7B modeling_qwen.py
``QWenLMHeadModel.forward``: ``lm_logits = self.lm_head(hidden_states)``, then ``shift_logits =
lm_logits[..., :-1, :].contiguous()`` and ``CrossEntropyLoss()`` on them, no ``.float()``; its
``__init__`` casts the model to bf16 / fp16 from the config's flags). The traced stand-in runs
the same loss (``trainmem.trace.remote_code.remote_code_loss``)."""

REMOTE_CODE_UPCAST_SHIFTED_LOSS = frozenset({"chatglm"})
"""Remote-code families whose causal-LM head upcasts its logits to fp32 and takes a shifted
contiguous copy of them for its loss, whatever the transformers release (the Hub's modeling
file runs, not transformers' ``ForCausalLMLoss``, which shifts the labels from 4.49):
THUDM/chatglm3-6b and glm-4-9b-chat modeling_chatglm.py
``ChatGLMForConditionalGeneration.forward`` (``lm_logits = lm_logits.to(torch.float32)``,
``shift_logits = lm_logits[..., :-1, :].contiguous()``, ``CrossEntropyLoss(ignore_index=-100)``
on them, then ``lm_logits = lm_logits.to(hidden_states.dtype)``: the returned logits are
16-bit). The traced stand-in runs the same loss (``trainmem.trace.remote_code
.remote_code_loss``). Not modelled: ChatGLM2 / ChatGLM3's ``transpose(0, 1).contiguous()``
16-bit copy of the (s, b, V) logits before the upcast and the 16-bit copy returned."""

REMOTE_CODE_OWN_LOSS = REMOTE_CODE_LOSS_IN_LOGITS_DTYPE | REMOTE_CODE_UPCAST_SHIFTED_LOSS
"""Remote-code families whose own file computes the causal-LM loss with a shifted copy of the
logits in every release (:data:`REMOTE_CODE_LOSS_IN_LOGITS_DTYPE`: on the 16-bit logits;
:data:`REMOTE_CODE_UPCAST_SHIFTED_LOSS`: on their fp32 copy)."""

FP32_LOGITS_IN_MODEL_UNTIL: dict[str, tuple[int, ...]] = {
    "llama": (4, 46),
    "mistral": (4, 48),
    "qwen2": (4, 46),
    "gemma": (4, 46),
    "phi3": (4, 46),
}
"""Families whose causal-LM forward upcasts its logits itself, so that the output it returns
holds them in fp32, until a release: ``logits = logits.float()`` before the loss in
modeling_llama.py ``LlamaForCausalLM.forward`` (4.38.2, 4.39.3, 4.40.0, 4.43.4; 4.45.2 when
labels are given) and modeling_mistral.py ``MistralForCausalLM.forward`` (4.39.3, 4.46.0,
4.47.0), in neither from the release named (4.46.0: Llama calls ``self.loss_function``; 4.48.0
Mistral too); modeling_qwen2.py ``Qwen2ForCausalLM.forward`` the same as Llama's (4.40.0 to
4.44.0 ``logits = logits.float()``, 4.45.0 ``self.lm_head(...).float()``, 4.46.0
``self.loss_function``); modeling_gemma.py ``GemmaForCausalLM.forward`` the same as Qwen2's
(4.40.0 to 4.44.0 ``logits = logits.float()``, 4.45.0 ``.float()`` on the head's output, 4.46.0
``self.loss_function``); modeling_phi3.py ``Phi3ForCausalLM.forward`` the same again (4.41.0, its
first release, to 4.44.0 ``logits = logits.float()``, 4.45.0 ``.float()`` on the head's output,
4.46.0 ``self.loss_function``). Releases before 4.38 not read (Qwen2's and Gemma's before 4.40;
Phi-3 has none before 4.41)."""

LAYER_ROPE_CACHE_UNTIL: dict[str, tuple[int, ...]] = {
    "llama": (4, 41),
    "mistral": (4, 42),
    "qwen2": (4, 45),
}
"""Families whose transformers code gave every attention layer its own rotary embedding module
with a cos and a sin table of (max_position_embeddings, head_dim) values as buffers, in the
default dtype at construction, until a release: modeling_llama.py 4.38.2 / 4.39.3 / 4.40.0
``LlamaAttention._init_rope`` (``self.rotary_emb = LlamaRotaryEmbedding(self.head_dim,
max_position_embeddings=...)``) and ``LlamaRotaryEmbedding.__init__`` ("For BC we register cos
and sin cached": ``register_buffer("_cos_cached", emb.cos().to(torch.get_default_dtype()),
persistent=False)``, the same for ``_sin_cached``, ``emb`` of (max_position_embeddings,
head_dim)); modeling_mistral.py 4.39.3 / 4.41.2 ``MistralRotaryEmbedding._set_cos_sin_cache``
(``cos_cached`` / ``sin_cached``, ``dtype=torch.get_default_dtype()``). The 4.41.2 (Llama) and
4.42.4 (Mistral) wheels register none; modeling_qwen2.py 4.40.0 to 4.44.0
``Qwen2RotaryEmbedding._set_cos_sin_cache`` (``register_buffer("cos_cached", emb.cos().to(
dtype), persistent=False)``, the same for ``sin_cached``, ``dtype=torch.get_default_dtype()``,
one per attention layer), none in 4.45.0. Gemma never registered the tables (modeling_gemma.py
4.40.0 ``GemmaRotaryEmbedding``: an ``inv_freq`` of head_dim / 2 fp32 values per layer, set in
the first forward, a buffer from 4.41.0; not modelled, 5.24 keeps one). Not looked at: the other
families' releases."""

ROTARY_IN_MODEL_SINCE: dict[str, tuple[int, ...]] = {
    "llama": (4, 43),
    "mistral": (4, 48),
    "qwen2": (4, 45),
    "gemma": (4, 48),
    "phi3": (4, 48),
}
"""Families whose decoder computes the rotary cos / sin once, at the model level, on the
residual stream, from a release; before it each attention layer computes them on its own values:
modeling_llama.py 4.40.0 / 4.41.0 / 4.42.0 ``LlamaSdpaAttention.forward`` ``cos, sin =
self.rotary_emb(value_states, position_ids)``, 4.43.0 ``LlamaModel.forward`` ``position_embeddings
= self.rotary_emb(hidden_states, position_ids)`` (handed to every layer);
modeling_mistral.py 4.42.0 to 4.47.0 ``cos, sin = self.rotary_emb(value_states, position_ids)``,
4.48.0 ``MistralModel.forward`` as Llama's; modeling_qwen2.py 4.40.0 to 4.44.0 ``cos, sin =
self.rotary_emb(value_states, seq_len=kv_seq_len)`` (``self.cos_cached[:seq_len].to(dtype=
x.dtype)``), 4.45.0 ``Qwen2Model.forward`` as Llama's; modeling_gemma.py 4.40.0 to 4.47.0
``cos, sin = self.rotary_emb(value_states, position_ids, seq_len=None)`` in every attention
layer (``GemmaRotaryEmbedding.forward`` returns ``cos.to(dtype=x.dtype)``), 4.48.0
``GemmaModel.forward`` as Llama's; modeling_phi3.py 4.41.0 to 4.47.0 ``cos, sin =
self.rotary_emb(value_states, position_ids, seq_len=kv_seq_len)`` in every attention layer
(``Phi3RotaryEmbedding.forward`` returns ``cos.to(dtype=x.dtype)``; its ``__init__`` registers
only ``inv_freq``, no cos / sin tables), 4.48.0 ``Phi3Model.forward`` as Llama's.
``LlamaRotaryEmbedding.forward`` returns
``cos.to(dtype=x.dtype)``: the tables, and so the rotated keys, are in the dtype of what it is
given, the values' compute dtype before the release, the residual's (fp32 under autocast) from it
(``ModelSpec.rotates_in_residual_dtype``). Not looked at: the other families' releases (they
take the residual's dtype, the installed 5.24's)."""

SDPA_SINCE: dict[str, tuple[int, ...]] = {"phi3": (4, 45)}
"""Families whose transformers code ran no SDPA attention until a release, so that
``from_pretrained`` picks eager attention by default and refuses ``attn_implementation="sdpa"``
("does not support an attention implementation through torch.nn.functional.
scaled_dot_product_attention yet", ``PreTrainedModel._check_and_enable_sdpa``, 4.41.0 to 4.44.0
modeling_utils.py): modeling_phi3.py 4.41.0 (its first release) to 4.44.0
``Phi3PreTrainedModel._supports_sdpa = False`` (a ``Phi3SdpaAttention`` class exists but is
never picked), 4.45.0 ``True``; its flash-attn 2 path is there in every release
(``_supports_flash_attn_2 = True``). Not looked at: the other families' releases
(``Family.eager_only`` is the installed release's)."""

FUSED_KV_PRESENTS_UNTIL: dict[str, tuple[int, ...]] = {"gpt_bigcode": (4, 54)}
"""Families whose transformers code returned each layer's keys and values as a view of the fused
projection's output until a release: modeling_gpt_bigcode.py (4.48.1 to 4.53.0 wheels)
``GPTBigCodeAttention.forward``: ``query, key_value = self.c_attn(hidden_states).split((
self.embed_dim, 2 * self.kv_dim), dim=2)``, ``present = key_value if use_cache else None``, and
``GPTBigCodeModel.forward`` appends it to ``presents`` for every layer, the checkpointed ones
too (no ``use_cache = False`` under ``gradient_checkpointing``; the config's ``use_cache``
defaults to True), returned as the output's ``past_key_values``; 4.54.0 stores copies in an
``EncoderDecoderCache`` instead (``ModelSpec.returns_fused_kv_views``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a transformer model (decoder LM, BERT-style encoder, or ViT).

    Raises:
        SpecError: a size is not a positive integer, or heads do not divide the model.
    """

    name: str
    """Preset name or the path the spec was read from."""
    model_type: str
    """Hugging Face ``model_type`` (``"gpt2"``, ``"llama"``, ``"bert"``, ``"vit"``...)."""
    architecture: Architecture
    """``decoder`` (causal LM), ``encoder`` (BERT), ``vision-encoder`` (ViT)."""
    num_layers: int
    """Transformer blocks, L."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Query heads a."""
    num_kv_heads: int
    """Key/value heads k (k == a: multi-head, k == 1: multi-query, else grouped-query)."""
    head_dim: int
    """Per-head width d (usually h / a; Gemma-7B has a * d != h)."""
    intermediate_size: int
    """MLP inner width i (4h for GPT-2/BERT, per expert for MoE)."""
    mlp_kind: MLPKind
    """``gelu``: up/down (2 matrices); ``gated``: gate/up/down (SwiGLU/GeGLU, 3 matrices)."""
    hidden_act: str
    """HF activation name (``gelu_new``, ``silu``, ``gelu_pytorch_tanh``...)."""
    norm_kind: NormKind
    """LayerNorm (weight + bias) or RMSNorm (weight only)."""
    vocab_size: int
    """Vocabulary V (0 for ViT)."""
    max_position_embeddings: int
    """Longest sequence the model was trained for (ViT: number of patches + 1)."""
    position_kind: PositionKind
    """Learned absolute positions (GPT-2, BERT, ViT), rotary (Llama), alibi, none."""
    tie_word_embeddings: bool
    """Output projection shares the input embedding matrix."""
    use_cache: bool = True
    """The config's ``use_cache`` (transformers' default True): a decoder then builds a KV cache
    in training too, when checkpointing is off (``training_kv_cache``, ``forward_kv_cache``)."""
    attention_bias: bool = False
    """Biases on the q/k/v projections."""
    attention_out_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    norm_bias: bool = True
    """LayerNorm has a bias (ignored for RMSNorm)."""
    parallel_attention: bool = False
    """Attention and MLP read the same normed input (GPT-J / Falcon / Phi style)."""
    num_experts: int = 1
    """Routed MoE experts E per layer (1 = dense)."""
    num_experts_per_tok: int = 1
    """Experts each token is routed to (top-k)."""
    head: HeadKind = "causal-lm"
    """Task head on top of the trunk, as the transformers class names it: ``causal-lm``
    (``XForCausalLM``), ``masked-lm`` (``BertForMaskedLM``), ``sequence-classification``,
    ``image-classification`` (``ViTForImageClassification``), ``none`` (``BertModel``,
    ``ViTModel``). It also decides the pooler: BERT has one for ``none`` and
    ``sequence-classification``, ViT only for ``none``, as in transformers."""
    num_labels: int = 0
    """Classes of a classification head (0 for other heads)."""
    type_vocab_size: int = 0
    """BERT token-type embeddings."""
    image_size: int = 0
    """ViT input side in pixels."""
    patch_size: int = 0
    """ViT patch side in pixels."""
    num_channels: int = 0
    """ViT input channels."""
    hidden_dropout: float = 0.0
    """Dropout probability on residual branches / MLP output."""
    attention_dropout: float = 0.0
    """Dropout probability on attention probabilities."""
    embedding_dropout: float = 0.0
    """Dropout on the embeddings."""
    fused_qkv: bool = False
    """q, k and v are one HF module (GPT-2 ``c_attn``, Falcon / GPT-NeoX ``query_key_value``)."""
    num_norms_per_layer: int = 2
    """Norm modules per block: 2 (pre-attention, pre-MLP), 1 for a shared parallel-block norm
    (Phi, Falcon-7B), 4 for Gemma-2 (pre and post norms around attention and MLP)."""
    qk_norm: bool = False
    """Per-head norms (width head_dim, kind ``norm_kind``) on queries and keys (Phi
    ``qk_layernorm``, Qwen3 ``q_norm`` / ``k_norm``)."""
    final_norm: bool = True
    """A norm after the last block (GPT-2 ``ln_f``, Llama ``norm``); BERT (post-LN) has none."""
    embedding_norm: bool = False
    """A LayerNorm on the summed embeddings (BERT ``embeddings.LayerNorm``)."""
    lm_head_bias: bool = False
    """The causal-LM output projection has a bias of size V (Phi ``lm_head``)."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated by RoPE (Phi-2 0.4, GPT-NeoX ``rotary_pct``)."""
    pooler_output_size: int | None = None
    """Width of a ViT pooler's dense layer; None means hidden_size (always so for BERT)."""
    fused_gate_up: bool = False
    """Gate and up projections are one HF module (Phi-3 ``gate_up_proj``, output chunked)."""
    fused_qkv_output_kept: bool = False
    """The fused q/k/v output is split into views and v reaches attention as one of them
    (Qwen-1 ``c_attn(...).split``, Baichuan ``W_pack(...).unflatten``, remote code), so the
    tensor attention saves as v keeps the whole (a + 2k) * d output alive (without GQA; see
    Note [Fused stand-in projections] in trainmem/trace/remote_code.py)."""
    qk_norm_full_width: bool = False
    """The q/k norms span the whole projection (OLMo-2 ``q_norm`` = RMSNorm(a * d), ``k_norm`` =
    RMSNorm(k * d)) instead of one head (Qwen3, Gemma-3: RMSNorm(head_dim))."""
    pre_norms: bool = True
    """Norms on the inputs of attention and MLP (pre-LN); OLMo-2 has none."""
    output_norms: bool = False
    """Norms on the outputs of attention and MLP before the residual add (Gemma-2/3
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``, OLMo-2)."""
    shared_expert_intermediate_size: int = 0
    """Width of an always-on gated shared expert next to the routed ones (Qwen2-MoE
    ``shared_expert``; DeepSeek-V3 ``shared_experts``, ``n_shared_experts *
    moe_intermediate_size``); 0 for none."""
    shared_expert_gate: bool = False
    """A sigmoid gate Linear(h, 1) scales the shared expert's output (Qwen2-MoE)."""
    norm_weight_in_fp32: bool = False
    """RMSNorm multiplies by its weight in fp32 and casts at the end (Gemma-3 ``x * (1 + w)``,
    OLMo-2's T5-style ``(w * x).to(input_dtype)``), so it saves its fp32 normalised tensor
    rather than one in the input dtype (Llama ``w * x.to(input_dtype)``)."""
    sliding_window: int = 0
    """Keys a sliding-window layer attends to (Gemma-3 ``sliding_window``); 0 for none."""
    num_sliding_layers: int = 0
    """Layers with sliding-window attention (Gemma-3 ``layer_types``); the rest attend to the
    whole causal prefix."""
    sliding_layers: tuple[bool, ...] = ()
    """Per layer, whether it attends within ``sliding_window`` (Gemma-2/3 ``layer_types``, or
    their ``sliding_window_pattern``; Qwen2's layers from ``max_window_layers`` on), when the
    model mixes sliding and full layers; () when every layer is of one kind. The schedule runs
    each kind's layer body (Note [Layer bodies per attention kind])."""
    local_rope: bool = False
    """The sliding-window layers have their own rotary tables (Gemma-3
    ``rope_local_base_freq``)."""
    attention_softcap: bool = False
    """Eager attention caps its scores with ``tanh`` (Gemma-2 ``attn_logit_softcapping``:
    ``softcap * tanh(scores / softcap)``, modeling_gemma2.py ``eager_attention_forward``)."""
    final_logit_softcap: bool = False
    """The causal-LM head caps its logits with ``tanh`` (Gemma-2 ``final_logit_softcapping``,
    modeling_gemma2.py ``Gemma2ForCausalLM.forward``)."""

    # -- implementations written out op by op (the CS336 course model) -------------------
    attention_written_out: bool = False
    """Eager attention written as separate ops: einsum scores, a (s, s) boolean causal mask
    applied with ``torch.where`` in every layer, and a max-shifted softmax spelled out (max,
    subtract, exp, sum, divide), cs336_basics/model.py ``scaled_dot_product_attention`` and
    nn_utils.py ``softmax``; False: ``torch.softmax`` (transformers'
    ``eager_attention_forward``)."""
    activation_written_out: bool = False
    """The gated MLP's SiLU is ``x * torch.sigmoid(x)`` (cs336_basics/model.py ``silu``), which
    saves sigmoid's output as well; False: ``F.silu``, one kernel that saves its input."""
    rotary_buffer: bool = False
    """RoPE's cos/sin are a fp32 (2, context_length, head_dim / 2) buffer built with the model
    (cs336_basics/model.py ``RotaryEmbedding._init_cache``, ``register_buffer(...,
    persistent=False)``), not per-step tables (transformers' ``LlamaRotaryEmbedding``)."""
    loss_written_out: bool = False
    """The family's own loss is a cross-entropy written out op by op (cs336_basics/nn_utils.py
    ``log_softmax`` and ``cross_entropy``: max, subtract, exp, sum, log, subtract, negate,
    gather, mean); the default of ``TrainingConfig.loss``. False: transformers'
    ``ForCausalLMLoss`` (``F.cross_entropy``)."""

    # -- vision towers (CLIP / SigLIP / DINOv2) -------------------------------------------
    class_token: bool = True
    """A learned [CLS] token is prepended to the patches (ViT, CLIP ``class_embedding``,
    DINOv2 ``cls_token``); SigLIP has none (modeling_siglip.py ``SiglipVisionEmbeddings``:
    ``num_positions = num_patches``)."""
    patch_bias: bool = True
    """The patch convolution has a bias (CLIP's ``patch_embedding`` has ``bias=False``)."""
    mask_token: bool = False
    """DINOv2's learned ``mask_token`` (1, h) parameter (``use_mask_token``, unused in training
    without ``bool_masked_pos`` but counted by ``numel``)."""
    layer_scale: bool = False
    """DINOv2 ``Dinov2LayerScale``: each residual branch is multiplied by a learned vector of
    width h (``layer_scale1`` / ``layer_scale2``, Touvron et al. 2021 CaiT, arXiv:2103.17239)."""
    vision_pooler: VisionPooler = "dense"
    """What a bare vision tower (head ``none``) returns as ``pooler_output``: ``dense`` (ViTPooler
    tanh(Linear) on [CLS]), ``cls-norm`` (CLIP ``post_layernorm`` on [CLS] only), ``cls`` (DINOv2:
    the [CLS] row of the final norm's output), ``attention-probe`` (SigLIP
    ``SiglipMultiheadAttentionPoolingHead``: a learned probe attends over all patches)."""

    # -- DeepSeek-V3 (multi-head latent attention, shared experts, first dense layers) -----
    q_lora_rank: int = 0
    """MLA query compression rank (``q_a_proj`` h -> q_lora_rank, ``q_a_layernorm``,
    ``q_b_proj``); 0 = a plain ``q_proj`` (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    """MLA key/value latent rank (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``);
    0 = no MLA. With MLA, ``head_dim`` is the query/key head width qk_nope + qk_rope."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of each query/key head (the key's is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: value head width (``o_proj`` reads a * v_head_dim)."""
    sigmoid_router: bool = False
    """DeepSeek-V3's ``DeepseekV3TopkRouter``: sigmoid scores, group-limited top-k, normalised
    weights scaled by ``routed_scaling_factor``."""
    dense_layers: int = 0
    """Leading blocks with a dense MLP instead of MoE (DeepSeek ``first_k_dense_replace``)."""
    dense_intermediate_size: int = 0
    """Inner width of those dense MLPs (DeepSeek ``intermediate_size``)."""

    # -- T5 (encoder-decoder) ---------------------------------------------------------------
    num_decoder_layers: int = 0
    """Decoder blocks of an encoder-decoder (T5 ``num_decoder_layers``); ``num_layers`` counts
    the encoder's."""
    relative_attention_buckets: int = 0
    """T5 relative position bias: an Embedding(buckets, heads) in the first block of each stack
    (modeling_t5.py ``T5Attention.relative_attention_bias``)."""
    cross_attention: bool = False
    """The block attends to the encoder output (a T5 decoder block, ``T5LayerCrossAttention``);
    set on the per-kind variants of :meth:`layer_kinds`, not on a whole model."""
    scale_tied_output: bool = False
    """T5 multiplies the decoder output by d_model**-0.5 before the LM head
    (``T5ForConditionalGeneration.forward``, ``config.scale_decoder_outputs``: original T5, not
    T5 v1.1 / Flan-T5)."""
    checkpoint_dtype: str | None = None
    """The dtype the config says its checkpoint is in (``torch_dtype``, transformers 5's
    ``dtype``; torch spelling: ``"bfloat16"``), which ``from_pretrained(dtype="auto")`` loads
    the weights in (transformers 5.0.0 modeling_utils.py ``_get_dtype``: ``config.dtype``);
    None where the config names none (then transformers reads the first floating weight of
    the checkpoint file, which trainmem does not have). See
    :mod:`trainmem.specs.load_dtype`."""
    untied_from_config: bool = False
    """The config ties the head to the token embedding (``tie_word_embeddings``) and training
    unties them: peft's ``modules_to_save`` copies of either (Note [peft modules_to_save] in
    :mod:`trainmem.analytic.tensor_states`); set by :func:`trainmem.analytic.engine.
    model_as_built`, not read from a config: the one frozen weight the two shared is then
    counted once."""

    @property
    def family_row(self) -> Family:
        """Its ``model_type``'s row of the family table (:data:`~trainmem.specs.hf_table.
        FAMILIES`), whose behaviour traits the properties below read; every trait off for a
        type without a row."""
        return family_row(self.model_type)

    @property
    def eager_only(self) -> bool:
        """Its family's code has no SDPA attention (``Family.eager_only``: BLOOM, Gemma-2, the
        CS336 course model)."""
        return self.family_row.eager_only

    @property
    def not_transformers(self) -> bool:
        """Not a transformers model, so the traced paths cannot build it
        (``Family.not_transformers``: the CS336 course model)."""
        return self.family_row.not_transformers

    @property
    def eager_softmax_fp32(self) -> bool:
        """The HF eager attention computes its softmax in fp32 and casts back
        (``softmax(..., dtype=torch.float32).to(query.dtype)``, e.g. modeling_llama.py
        ``eager_attention_forward``): its family's trait (``Family.eager_softmax_fp32``)."""
        return self.family_row.eager_softmax_fp32

    @property
    def training_kv_cache(self) -> bool:
        """transformers builds a ``DynamicCache`` in training when the config says
        ``use_cache=True`` and checkpointing is off (transformers 5 GPT-2), so SDPA saves the
        cache's ``torch.cat`` copies of k and v: its family's trait
        (``Family.training_kv_cache``, found by the trace engine)."""
        return self.family_row.training_kv_cache and self.use_cache

    @property
    def eager_scores_kept(self) -> bool:
        """The eager attention keeps its raw and masked scores until it returns (BLOOM:
        ``Family.eager_scores_kept``)."""
        return self.family_row.eager_scores_kept

    def causal_lm_loss_in_logits_dtype(self, transformers_version: tuple[int, ...]) -> bool:
        """The causal-LM head computes its loss on its 16-bit logits in this transformers
        release: the families of :data:`CAUSAL_LM_LOSS_UPCAST_SINCE` before their release.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            True when the model's own loss takes the logits as they are.
        """
        if self.head == "causal-lm" and self.model_type in REMOTE_CODE_LOSS_IN_LOGITS_DTYPE:
            return True
        since = CAUSAL_LM_LOSS_UPCAST_SINCE.get(self.model_type)
        return self.head == "causal-lm" and since is not None and transformers_version < since

    def returns_fp32_logits(self, transformers_version: tuple[int, ...]) -> bool:
        """The causal-LM forward returns its logits upcast to fp32 in this transformers release
        (:data:`FP32_LOGITS_IN_MODEL_UNTIL`), the output a loop may hold.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            True for the families of the table before their release.
        """
        until = FP32_LOGITS_IN_MODEL_UNTIL.get(self.model_type)
        return self.head == "causal-lm" and until is not None and transformers_version < until

    def rotates_in_residual_dtype(self, transformers_version: tuple[int, ...]) -> bool:
        """The rotary cos / sin, and so the rotated queries and keys, are in the residual
        stream's dtype in this transformers release (:data:`ROTARY_IN_MODEL_SINCE`), not in the
        values' compute dtype.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            False for the families of the table before their release, True otherwise.
        """
        since = ROTARY_IN_MODEL_SINCE.get(self.model_type)
        return since is None or transformers_version >= since

    def layer_rope_cache_values(self, transformers_version: tuple[int, ...]) -> int:
        """Values of the cos and sin tables each decoder layer's own rotary embedding keeps as
        buffers in this transformers release (:data:`LAYER_ROPE_CACHE_UNTIL`): 2 x
        max_position_embeddings x head_dim, or 0.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            Values per layer (their dtype is the default dtype the model was built in).
        """
        until = LAYER_ROPE_CACHE_UNTIL.get(self.model_type)
        if until is None or transformers_version >= until:
            return 0
        return 2 * self.max_position_embeddings * self.head_dim

    def has_sdpa(self, transformers_version: tuple[int, ...]) -> bool:
        """transformers' code of the family runs SDPA attention in this release: not
        ``eager_only``, nor a family of :data:`SDPA_SINCE` before its release.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            False where only eager (or flash-attn 2) attention runs.
        """
        since = SDPA_SINCE.get(self.model_type)
        return not self.eager_only and (since is None or transformers_version >= since)

    def returns_fused_kv_views(self, transformers_version: tuple[int, ...]) -> bool:
        """Each layer returns its keys and values as a view of the fused QKV output in this
        transformers release, under gradient checkpointing too: the families of
        :data:`FUSED_KV_PRESENTS_UNTIL` before their release, with ``use_cache`` on.

        Args:
            transformers_version: (major, minor, ...) of transformers.

        Returns:
            True when the layers' presents keep their fused projection outputs alive.
        """
        until = FUSED_KV_PRESENTS_UNTIL.get(self.model_type)
        return self.use_cache and until is not None and transformers_version < until

    @property
    def mlm_loss_in_logits_dtype(self) -> bool:
        """The masked-LM loss runs on the logits' own dtype: the masked-LM heads of
        ``Family.mlm_loss_in_model_dtype``."""
        return self.head == "masked-lm" and self.family_row.mlm_loss_in_model_dtype

    @property
    def sdpa_mask_materialised(self) -> bool:
        """SDPA gets an explicit causal mask in every layer: the families of
        ``Family.materialised_mask``."""
        return self.family_row.materialised_mask

    @property
    def analytic_only(self) -> bool:
        """No traced path builds the model: the families of ``Family.analytic_only``."""
        return self.family_row.analytic_only

    @property
    def mha_out_proj_copy(self) -> bool:
        """The output projection's input is a copy of the SDPA output (torch's
        ``nn.MultiheadAttention``): the families of ``Family.mha_out_proj_copy``."""
        return self.family_row.mha_out_proj_copy

    @property
    def rotary_cat(self) -> bool:
        """q is a fresh (b, a, s, d)-contiguous tensor: the families of
        ``Family.rotary_cat``."""
        return self.family_row.rotary_cat

    @property
    def module_buffer_bytes(self) -> int:
        """Bytes of the model's non-parameter buffers that matter: GPT-BigCode's boolean causal
        mask ``bias``, (max_position_embeddings, max_position_embeddings) (modeling_gpt_bigcode.py
        ``GPTBigCodeModel.__init__``: ``register_buffer("bias", torch.tril(torch.ones(...,
        dtype=torch.bool)), persistent=False)``); 0 elsewhere (rotary ``inv_freq`` is d / 2
        values). Found by the trace engine (tiny-gpt-bigcode, 1 MiB of buffers). With
        :attr:`rotary_buffer`, RoPE's fp32 cos/sin table: 2 x context_length x head_dim / 2
        values of 4 bytes (cs336_basics/model.py ``RotaryEmbedding._init_cache``: ``torch.stack((
        cos, sin))`` of a (context_length, dim / 2) ``einsum``)."""
        if self.family_row.causal_mask_buffer:
            return self.max_position_embeddings**2
        if self.rotary_buffer:
            return 4 * 2 * self.max_position_embeddings * (self.head_dim // 2)
        return 0

    @property
    def loss_holds_hidden(self) -> bool:
        """The final hidden states live until the loss has run: the families of
        ``Family.loss_holds_hidden``."""
        return self.family_row.loss_holds_hidden

    @property
    def forward_kv_cache(self) -> bool:
        """transformers builds a ``DynamicCache`` in training when the config says
        ``use_cache=True`` and checkpointing is off (``merge_with_config_defaults``); its
        ``torch.cat`` copy of the rotated keys is fp32 under autocast (cache_utils.py
        ``DynamicLayer.lazy_initialization`` creates the cache in the keys' own dtype) and lives
        until the model output is dropped after the loss: the families of
        ``Family.forward_kv_cache`` (found by the trace engine), unless the config says
        ``use_cache: false``."""
        return self.family_row.forward_kv_cache and self.use_cache

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(field, f"must be a positive integer, got {value!r}")
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            if isinstance(value, int) and value > MAX_COUNT:
                raise SpecError(
                    spec_field.name,
                    f"must be at most {MAX_COUNT:,} (2^31 - 1), got {describe_int(value)}",
                )
        if self.num_layers > MAX_LAYERS:
            raise SpecError(
                "num_layers",
                f"{self.num_layers:,} layers is beyond any real model (at most {MAX_LAYERS:,})",
            )
        if self.vocab_size < 0:
            raise SpecError("vocab_size", f"must be >= 0, got {self.vocab_size}")
        if self.num_heads % self.num_kv_heads != 0:
            raise SpecError(
                "num_key_value_heads",
                f"{self.num_kv_heads} must divide num_attention_heads={self.num_heads}",
            )
        if self.sliding_layers and (
            len(self.sliding_layers) != self.num_layers
            or sum(self.sliding_layers) != self.num_sliding_layers
        ):
            raise SpecError(
                "layer_types",
                f"{len(self.sliding_layers)} layer kinds with {sum(self.sliding_layers)} sliding"
                f" for {self.num_layers} layers with {self.num_sliding_layers} sliding",
            )
        if self.num_experts < 1:
            raise SpecError("num_experts", f"must be >= 1, got {self.num_experts}")
        if self.num_norms_per_layer < 0:
            raise SpecError("num_norms_per_layer", f"must be >= 0, got {self.num_norms_per_layer}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise SpecError(
                "partial_rotary_factor",
                f"must be in (0, 1], got {self.partial_rotary_factor}",
            )
        allowed_heads = _HEADS_BY_ARCHITECTURE[self.architecture]
        if self.head not in allowed_heads:
            raise SpecError(
                "head",
                f"{self.head!r} is not available for a {self.architecture} model; "
                f"allowed: {', '.join(allowed_heads)}",
            )
        classifies = self.head in ("sequence-classification", "image-classification")
        if classifies and self.num_labels < 1:
            raise SpecError(
                "num_labels", f"a {self.head} head needs num_labels >= 1, got {self.num_labels}"
            )
        if self.architecture == "vision-encoder":
            for field in ("image_size", "patch_size", "num_channels"):
                value = getattr(self, field)
                if value <= 0:
                    raise SpecError(field, f"must be a positive integer for a ViT, got {value}")
            if self.patch_size > self.image_size:
                raise SpecError(
                    "patch_size",
                    f"{self.patch_size} is larger than image_size={self.image_size}",
                )
        elif self.vocab_size <= 0:
            raise SpecError("vocab_size", f"must be a positive integer, got {self.vocab_size}")
        for field in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "shared_expert_intermediate_size",
            "dense_layers",
            "dense_intermediate_size",
            "num_decoder_layers",
            "relative_attention_buckets",
        ):
            if getattr(self, field) < 0:
                raise SpecError(field, f"must be >= 0, got {getattr(self, field)}")
        if self.dense_layers > self.num_layers:
            raise SpecError(
                "first_k_dense_replace",
                f"{self.dense_layers} is more than num_hidden_layers={self.num_layers}",
            )
        if self.mla and not 0 < self.qk_rope_head_dim < self.head_dim:
            raise SpecError(
                "qk_rope_head_dim",
                f"must be between 1 and the query/key head width {self.head_dim - 1}, "
                f"got {self.qk_rope_head_dim}",
            )
        if self.mla and self.v_head_dim <= 0:
            raise SpecError("v_head_dim", f"must be a positive integer, got {self.v_head_dim}")
        if self.pooler_output_size is not None and self.pooler_output_size <= 0:
            raise SpecError(
                "pooler_output_size", f"must be a positive integer, got {self.pooler_output_size}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise SpecError(
                "num_experts_per_tok",
                f"must be between 1 and num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}",
            )

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def num_blocks(self) -> int:
        """All transformer blocks: encoder + decoder blocks of an encoder-decoder, else L."""
        return self.num_layers + self.num_decoder_layers

    def layer_kinds(self) -> list[tuple[int, ModelSpec]]:
        """The distinct blocks of the model as (how many, a spec of that block alone).

        A homogeneous model is ``[(L, self)]``. DeepSeek-V3: ``first_k_dense_replace`` dense
        blocks (modeling_deepseek_v3.py ``DeepseekV3DecoderLayer``: ``DeepseekV3MLP`` of
        ``intermediate_size`` when ``layer_idx < first_k_dense_replace``) and the MoE blocks.
        T5: the encoder blocks and the decoder blocks, which add cross-attention
        (modeling_t5.py ``T5Block``, ``is_decoder``). The variants keep every other field, so
        per-block formulas read them unchanged.
        """
        kinds: list[tuple[int, ModelSpec]] = []
        if self.dense_layers:
            dense = _replace(
                self,
                num_layers=self.dense_layers,
                dense_layers=0,
                num_experts=1,
                num_experts_per_tok=1,
                shared_expert_intermediate_size=0,
                shared_expert_gate=False,
                intermediate_size=self.dense_intermediate_size or self.intermediate_size,
            )
            kinds.append((self.dense_layers, dense))
            rest = self.num_layers - self.dense_layers
            if rest:
                kinds.append((rest, _replace(self, num_layers=rest, dense_layers=0)))
            return kinds
        if self.num_decoder_layers:
            encoder = _replace(self, num_decoder_layers=0)
            decoder = _replace(
                self, num_layers=self.num_decoder_layers, num_decoder_layers=0, cross_attention=True
            )
            return [(self.num_layers, encoder), (self.num_decoder_layers, decoder)]
        return [(self.num_layers, self)]

    @property
    def num_patches(self) -> int:
        """Image patches of a ViT, (image_size / patch_size)**2; 0 for text models."""
        if self.patch_size == 0:
            return 0
        return (self.image_size // self.patch_size) ** 2
