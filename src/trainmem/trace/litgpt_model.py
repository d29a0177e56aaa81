"""litgpt's own model code on the traced paths (``framework=litgpt``, issue 26).

litgpt trains its own ``GPT`` (litgpt/model.py), not transformers' classes, so the generic path
builds that model from the run's :class:`~trainmem.specs.model.ModelSpec` and traces it on fake
tensors: the real litgpt code runs, nothing of its attention, MLP, LoRA or loss is modelled.
litgpt is optional (:data:`~trainmem.specs.frameworks.LITGPT_INSTALL`: beside transformers 5,
``pip install 'trainmem[litgpt]' && pip install --no-deps litgpt==0.5.13``, as README's test
command installs it); without it the traced paths refuse ``framework=litgpt`` and say so.

Note [litgpt's training step]
    What litgpt 0.5.13's recipes run, and the step built here (litgpt/finetune/lora.py and
    full.py at v0.5.13, litgpt/model.py, litgpt/lora.py, litgpt/utils.py):

    * the model: ``GPT(config)`` (``litgpt.lora.GPT`` with ``lora_r`` etc. under LoRA, then
      ``mark_only_lora_as_trainable``) under ``fabric.init_module()``, so every parameter,
      the adapters too, is in the precision's weight dtype; the output head is a linear of its
      own (litgpt never ties it to ``wte``);
    * the rotary tables: ``model.max_seq_length = longest_seq_length`` after
      ``fabric.setup_module`` rebuilds ``cos`` / ``sin`` with that many rows, in the default
      dtype (fp32), as buffers;
    * the forward: ``logits = model(input_ids, lm_head_chunk_size=128)`` in lora.py (a list of
      chunks of the head's output), ``logits = model(input_ids)`` in full.py; here the head is
      chunked into ``TrainingConfig.chunked_cross_entropy`` chunks of the sequence when that is
      set, whole otherwise;
    * Fabric's wrapper casts every floating output to the default dtype, fp32
      (lightning/fabric/wrappers.py ``_FabricModule.forward`` -> ``precision.convert_output``),
      under ``*-true`` and ``*-mixed`` alike;
    * the loss: litgpt.utils ``chunked_cross_entropy`` on the shifted logits and targets
      (``logits[-1] = logits[-1][..., :-1, :]`` for a list; ``logits[..., :-1, :]``
      otherwise), with ``chunk_size=0`` (one cross-entropy) for an unchunked head;
    * the loop binds ``logits`` in its own scope (``loop=previous``, a rule on the traced step:
      Note [The previous loop on a traced step]).

    The rotary scaling of a config (``rope_scaling``) changes the values of ``cos`` / ``sin``,
    never their size, and is not passed on.

Source: litgpt v0.5.13 (litgpt/model.py ``GPT``, ``CausalSelfAttention``, ``LLaMAMLP``;
litgpt/lora.py; litgpt/utils.py ``chunked_cross_entropy``; litgpt/finetune/lora.py ``fit``);
lightning 2.6 fabric/wrappers.py, fabric/plugins/precision/half.py and amp.py.
"""

from __future__ import annotations

from types import MethodType, ModuleType
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.frameworks import (
    LITGPT_INSTALL,
    LITGPT_RMSNORM_FP32_WEIGHT_SINCE,
    installed_version,
    litgpt_head_chunk_rows,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

from trainmem.trace.quantized import quantize_base  # noqa: E402

__all__ = [
    "LITGPT_INSTALL_HINT",
    "ConvertOutput",
    "LitGPTStep",
    "build_litgpt_model",
    "check_litgpt_release",
    "litgpt_available",
    "litgpt_config_kwargs",
    "litgpt_loss",
    "make_litgpt_batch",
    "require_litgpt",
]

LITGPT_INSTALL_HINT = (
    f"{LITGPT_INSTALL} (the extra is lightning, which litgpt's model code imports; litgpt "
    "itself pins huggingface-hub<1.4, which transformers 5.24 cannot share, and its model code "
    "does not import the hub, so it installs without its pins and the trace runs)"
)

_LORA_TARGETS = {"q": "lora_query", "k": "lora_key", "v": "lora_value", "o": "lora_projection"}
"""trainmem's LoRA target names -> litgpt.lora.Config flags (``lora_mlp`` covers the MLP's
three linears, ``lora_head`` the output head)."""
_MLP_TARGETS = frozenset({"gate", "up", "down"})


def litgpt_available() -> bool:
    """Whether litgpt's model code can be imported (the ``litgpt`` extra)."""
    try:
        require_litgpt()
    except ImportError:
        return False
    return True


def require_litgpt() -> tuple[ModuleType, ModuleType, ModuleType]:
    """Import litgpt's model code.

    Returns:
        ``(litgpt.config, litgpt.model, litgpt.lora)``.

    Raises:
        ImportError: litgpt is not installed; the message names the install command.
    """
    try:
        import litgpt.config
        import litgpt.lora
        import litgpt.model
    except ImportError as exc:
        raise ImportError(
            f"framework=litgpt runs litgpt's own model code, which is not installed: "
            f"{LITGPT_INSTALL_HINT}"
        ) from exc
    return litgpt.config, litgpt.model, litgpt.lora


def check_litgpt_release(training: TrainingConfig) -> None:
    """Refuse a ``litgpt_version`` the trace cannot run: one other than the installed
    litgpt's, except an older one across the RMSNorm rule alone, whose norms the build runs as
    that release's (:func:`_cast_first_norms`; Note [An older litgpt release on a traced step]
    in trainmem/traced_releases.py).

    Raises:
        UnsupportedError: naming both releases and what works.
    """
    installed = installed_version("litgpt")
    if installed is None:
        return  # (the import refuses, naming the extra)
    release = (*installed, 0, 0)[:3]
    cast_first = release >= LITGPT_RMSNORM_FP32_WEIGHT_SINCE > training.litgpt_release
    if release != training.litgpt_release and not cast_first:
        asked = ".".join(map(str, training.litgpt_release))
        raise UnsupportedError(
            f"litgpt_version={asked}: the traced paths run the installed litgpt's model code, "
            f"{'.'.join(map(str, release))}; pass --litgpt-version "
            f"{'.'.join(map(str, release))} or use --engine analytic"
        )


_GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
"""transformers' GELU names -> litgpt's ``gelu_approximate`` (``F.gelu(x, approximate=...)``)."""


def litgpt_config_kwargs(model: ModelSpec, training: TrainingConfig) -> dict[str, Any]:
    """litgpt ``Config`` fields for ``model``: the layer shapes of a decoder litgpt's ``GPT``
    builds (a sequential block with RMSNorm and a gated SiLU MLP, ``LLaMAMLP``: Llama, Mistral,
    Qwen2 / Qwen3; a parallel block with LayerNorm and a GELU MLP, ``GptNeoxMLP``: Pythia, Phi,
    Falcon), the LoRA flags of ``training``.

    Args:
        model: the model's shape (a transformers decoder's ModelSpec).
        training: ``seq_len`` (the block size at least), the LoRA settings.

    Returns:
        Keyword arguments of ``litgpt.config.Config`` (``litgpt.lora.Config`` under LoRA).

    Raises:
        UnsupportedError: a model litgpt's ``GPT`` is not mapped from here, or a LoRA target
            litgpt has no flag for.
    """
    llama = (model.mlp_kind, model.norm_kind, model.hidden_act) in (
        ("gated", "rmsnorm", "silu"),
        ("gated", "rmsnorm", "swish"),
    )
    neox = (
        model.mlp_kind == "gelu"
        and model.norm_kind == "layernorm"
        and model.hidden_act in _GELU_APPROXIMATE
        and model.norm_bias
    )
    if (
        not (llama or neox)
        or (model.architecture, model.position_kind, model.head)
        != ("decoder", "rotary", "causal-lm")
        or model.mlp_bias != model.attention_out_bias
        or model.num_experts > 1
        or model.sliding_window
        or model.attention_softcap
        or model.final_logit_softcap
        or model.q_lora_rank
        or model.kv_lora_rank
    ):
        raise UnsupportedError(
            f"framework=litgpt on the traced paths builds litgpt's GPT from a decoder with "
            f"RMSNorm and a gated SiLU MLP (Llama, Mistral, Qwen2) or LayerNorm and a GELU MLP "
            f"(Pythia, Phi, Falcon); {model.name} ({model.model_type}) is not mapped; use "
            "--engine analytic"
        )
    out: dict[str, Any] = {
        "name": model.name,
        "block_size": max(model.max_position_embeddings, training.seq_len),
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.vocab_size,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_query_groups": model.num_kv_heads,
        "head_size": model.head_dim,
        "n_embd": model.hidden_size,
        "rotary_percentage": model.partial_rotary_factor,
        "parallel_residual": model.parallel_attention,
        "shared_attention_norm": model.parallel_attention and model.num_norms_per_layer == 1,
        "bias": model.attention_out_bias,
        "attn_bias": model.attention_bias,
        "lm_head_bias": model.lm_head_bias,
        "norm_class_name": "RMSNorm" if llama else "LayerNorm",
        "mlp_class_name": "LLaMAMLP" if llama else "GptNeoxMLP",
        "intermediate_size": model.intermediate_size,
        "norm_qk": model.qk_norm,
    }
    if neox:
        out["gelu_approximate"] = _GELU_APPROXIMATE[model.hidden_act]
    if training.is_lora:
        out.update(_lora_kwargs(training))
    return out


def _lora_kwargs(training: TrainingConfig) -> dict[str, Any]:
    targets = set(training.lora_targets)
    if "all-linear" in targets:
        targets = {"q", "k", "v", "o", "gate", "up", "down"}
    unknown = targets - set(_LORA_TARGETS) - _MLP_TARGETS - {"lm_head"}
    partial_mlp = targets & _MLP_TARGETS and not _MLP_TARGETS <= targets
    if unknown or partial_mlp:
        raise UnsupportedError(
            f"lora_targets={','.join(training.lora_targets)} under framework=litgpt: litgpt's "
            "LoRA flags are lora_query / key / value / projection, lora_mlp (gate, up and down "
            "together) and lora_head; pick targets among q, k, v, o, gate+up+down, lm_head"
        )
    out: dict[str, Any] = {flag: name in targets for name, flag in _LORA_TARGETS.items()}
    out.update(
        lora_r=training.lora_rank,
        lora_alpha=2 * training.lora_rank,  # alpha only scales values, never memory
        lora_dropout=training.lora_dropout,
        lora_mlp=bool(targets & _MLP_TARGETS),
        lora_head="lm_head" in targets,
    )
    return out


class ConvertOutput(torch.nn.Module):  # type: ignore[misc,name-defined]
    """Fabric's ``precision.convert_output``: every floating output cast to the default dtype
    (fp32). A module of its own, so the trace names the fp32 logits' allocations (the
    ``previous`` loop's rule frees the last micro-batch's logits after them)."""

    def forward(self, out: Any) -> Any:
        """``out`` (a tensor or a list of tensors) in fp32."""
        fp32 = torch.get_default_dtype()
        if isinstance(out, list):
            return [t.to(fp32) for t in out]
        return out.to(fp32)


class LitGPTStep(torch.nn.Module):  # type: ignore[misc,name-defined]
    """litgpt's ``GPT`` as Fabric's wrapper runs it: the forward, then every output cast to
    fp32 (Note [litgpt's training step]).

    Args:
        gpt: litgpt's ``GPT`` (or ``litgpt.lora.GPT``).
        chunks: output-head chunks along the sequence (0: one head output).
    """

    def __init__(self, gpt: Any, chunks: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.chunks = chunks
        self.convert_output = ConvertOutput()

    def forward(self, input_ids: Any, targets: Any = None) -> Any:
        """Logits of ``input_ids`` ([b, s] int64; ``targets`` are the loss's): one fp32
        [b, s, V] tensor, or a list of [b, s / N, V] fp32 chunks."""
        size = litgpt_head_chunk_rows(input_ids.size(1), self.chunks)
        return self.convert_output(self.gpt(input_ids, lm_head_chunk_size=size))


def build_litgpt_model(model: ModelSpec, training: TrainingConfig) -> LitGPTStep:
    """litgpt's model for ``model`` as its recipes build it (call under ``torch.device("meta")``).

    Args:
        model: the model's shape (:func:`litgpt_config_kwargs`).
        training: weight dtype, ``seq_len`` (the rotary tables' rows), LoRA settings,
            ``chunked_cross_entropy`` (the head's chunks).

    Returns:
        The :class:`LitGPTStep` around ``GPT`` / ``litgpt.lora.GPT``, LoRA's adapters the only
        trainable parameters under LoRA.

    Raises:
        UnsupportedError: see :func:`litgpt_config_kwargs`.
        ImportError: litgpt is not installed (naming
            :data:`~trainmem.specs.frameworks.LITGPT_INSTALL`).
    """
    config_mod, model_mod, lora_mod = require_litgpt()
    kwargs = litgpt_config_kwargs(model, training)
    dtype = getattr(torch, training.weight_dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # fabric.init_module(): every tensor in the weight dtype
    try:
        if training.is_lora:
            gpt = lora_mod.GPT(lora_mod.Config(**kwargs))
            lora_mod.mark_only_lora_as_trainable(gpt)
        else:
            gpt = model_mod.GPT(config_mod.Config(**kwargs))
    finally:
        torch.set_default_dtype(previous)
    gpt.max_seq_length = training.seq_len  # rebuilds cos / sin: seq_len rows, fp32
    if training.litgpt_release < LITGPT_RMSNORM_FP32_WEIGHT_SINCE:
        _cast_first_norms(gpt, model_mod.RMSNorm)
    # ``--quantize bnb.*``: Lightning's BitsandbytesPrecision converts every linear, the output
    # head too (the generic path's stand-ins, Note [Traced quantized base])
    quantize_base(gpt, training, diffusers=True)
    return LitGPTStep(gpt, training.chunked_cross_entropy)


def _cast_first_norms(gpt: Any, norm_class: Any) -> None:
    """Run every RMSNorm of ``gpt`` as litgpt before 0.4.6 does (:func:`_rms_norm_cast_first`)
    instead of the installed release's fp32 weight multiply."""
    for module in gpt.modules():
        if isinstance(module, norm_class):
            module.forward = MethodType(_rms_norm_cast_first, module)


def _rms_norm_cast_first(self: Any, x: Any) -> Any:
    """litgpt's ``RMSNorm.forward`` before 0.4.6
    (:data:`~trainmem.specs.frameworks.LITGPT_RMSNORM_FP32_WEIGHT_SINCE`; v0.4.0
    litgpt/model.py): normalised in fp32, cast to the input's dtype, then multiplied by the
    weight in its own dtype, so a trained norm saves that 16-bit copy (0.4.6 on multiplies the
    fp32 normalised tensor by ``weight.float()`` and casts the product)."""
    dtype = x.dtype
    x = x.float()
    norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
    x_normed = (x * torch.rsqrt(norm_x + self.eps)).to(dtype=dtype)
    if self.add_unit_offset:
        return x_normed * (1 + self.weight)
    return x_normed * self.weight


def make_litgpt_batch(model: LitGPTStep, training: TrainingConfig) -> dict[str, Any]:
    """One micro-batch: ``input_ids`` and ``targets``, [b, s] int64 each (inside the fake
    mode).

    Args:
        model: the step (its vocabulary bounds the ids).
        training: ``micro_batch_size`` b and ``seq_len`` s.

    Returns:
        ``{"input_ids": ..., "targets": ...}``.
    """
    v = model.gpt.config.padded_vocab_size
    shape = (training.micro_batch_size, training.seq_len)
    return {"input_ids": torch.randint(0, v, shape), "targets": torch.randint(0, v, shape)}


def litgpt_loss(logits: Any, batch: dict[str, Any]) -> Any:
    """litgpt's loss on the step's output (Note [litgpt's training step]).

    Args:
        logits: :class:`LitGPTStep`'s output (a tensor, or a list of chunks).
        batch: :func:`make_litgpt_batch`'s.

    Returns:
        The scalar loss.
    """
    from litgpt.utils import chunked_cross_entropy

    targets = batch["targets"][..., 1:]
    if isinstance(logits, list):
        shifted = [*logits[:-1], logits[-1][..., :-1, :]]  # the loop's ``logits[-1] = ...``
        return chunked_cross_entropy(shifted, targets)
    return chunked_cross_entropy(logits[..., :-1, :], targets, chunk_size=0)
