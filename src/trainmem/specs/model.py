"""ModelSpec: the shape of a transformer, everything both engines need and nothing else.

Legend used across trainmem: s = seq_len, b = micro_batch_size, h = hidden_size,
a = num_heads, k = num_kv_heads, d = head_dim, i = intermediate_size, V = vocab_size,
L = num_layers, E = num_experts.

A ModelSpec is built from a Hugging Face ``config.json`` by :func:`trainmem.specs.hf.model_spec_from_hf`
(the only place where HF field names are translated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainmem.errors import SpecError

Architecture = Literal["decoder", "encoder", "vision-encoder"]
MLPKind = Literal["gelu", "gated"]
NormKind = Literal["layernorm", "rmsnorm"]
PositionKind = Literal["learned", "rotary", "alibi", "none"]
HeadKind = Literal[
    "causal-lm", "masked-lm", "sequence-classification", "image-classification", "none"
]


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
    """Task head on top of the trunk."""
    num_labels: int = 0
    """Classes of a classification head."""
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
        if self.vocab_size < 0:
            raise SpecError("vocab_size", f"must be >= 0, got {self.vocab_size}")
        if self.num_heads % self.num_kv_heads != 0:
            raise SpecError(
                "num_key_value_heads",
                f"{self.num_kv_heads} must divide num_attention_heads={self.num_heads}",
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise SpecError(
                "num_experts_per_tok",
                f"must be between 1 and num_experts={self.num_experts}, "
                f"got {self.num_experts_per_tok}",
            )

    @property
    def num_patches(self) -> int:
        """Image patches of a ViT, (image_size / patch_size)**2; 0 for text models."""
        if self.patch_size == 0:
            return 0
        return (self.image_size // self.patch_size) ** 2
