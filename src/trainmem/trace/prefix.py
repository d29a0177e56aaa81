"""Prefix tuning / P-Tuning v2 and peft's other prompt learning: trained virtual tokens over a
frozen base.

Note [Prefix tuning]
    Prefix tuning (Li and Liang 2021, arXiv:2101.00190) and P-Tuning v2 (Liu et al. 2022,
    arXiv:2110.07602) train ``p`` virtual tokens whose keys and values every attention layer
    reads before the sequence's; the base is frozen. What peft 0.21.2 builds
    (``PrefixTuningConfig``, ``get_peft_model``; tuners/prefix_tuning/model.py,
    peft_model.py ``PeftModel.get_prompt`` and ``PeftModelForCausalLM.forward``):

    - trainable: ``PrefixEncoder.embedding``, an ``Embedding(p, 2 L t)`` with
      ``t = token_dim``, the key/value width of a layer (utils/other.py
      ``_prepare_prompt_learning_config``: ``head_dim * num_key_value_heads`` when the config
      has ``num_key_value_heads``, else ``hidden_size``), made in fp32 after the base, whatever
      the base's dtype (so fp32 gradients and AdamW states: 16 bytes per element). With
      ``prefix_projection`` the embedding is ``Embedding(p, t)`` and a ``Linear(t, e)``, tanh,
      ``Linear(e, 2 L t)`` reparametrise it (``e = encoder_hidden_size``, ``t`` by default);
    - each forward: the encoder's output ``[b, p, 2 L t]`` cast to the base's dtype
      (``past_key_values.to(self.base_model_torch_dtype)``), viewed as ``[2 L, b, g, p, d]``
      and split per layer into a ``DynamicCache``; every layer's ``cache.update`` concatenates
      the prefix's and the sequence's keys and values into new ``[b, g, p + s, d]`` tensors,
      which attention saves (its scores, on the eager path, are ``[b, a, s, p + s]``), and the
      attention mask grows ``p`` columns of ones;
    - the gradient flows back through every layer to the prefix, so the frozen layers keep what
      their input gradients need (not their linears' inputs: a frozen weight needs no
      gradient).

    ChatGLM2 / ChatGLM3's own ``pre_seq_len`` (modeling_chatglm.py ``PrefixEncoder``, THUDM's
    finetune_demo at 9484f82 ``load_tokenizer_and_model``: ``config.pre_seq_len =
    peft_config.num_virtual_tokens``) builds the same shapes: ``Embedding(pre_seq_len,
    num_layers * kv_channels * multi_query_group_num * 2)`` (its ``prefix_projection``
    reparametrises through ``hidden_size``, not ``t``), cast to the embeddings' dtype, its
    ``[p, b, g, d]`` halves concatenated before each layer's keys and values; beside peft's it
    adds a ``Dropout(0.1)`` on the cast prefix (a ``[b, p, 2 L g d]`` output and mask) and
    keeps its mask as a ``[b, 1, s, p + s]`` bool (``get_masks``). GLM-4's finetune_demo
    (c0a6d1e) runs peft's ``PrefixTuningConfig`` itself. On the generic path a ChatGLM runs as
    its stand-in (Note [Remote-code stand-ins]) with peft's prefix; the dropout and the
    expansion of the multi-query keys to every head are not reproduced.

    Under activation checkpointing a transformers layer that writes the cache cannot take the
    prefix: transformers 5.24's ``GradientCheckpointingLayer`` drops a checkpointed layer's
    ``cache`` unless the layer class sets ``_can_checkpoint_with_cache`` ("Writers must leave
    it False, otherwise the cache is updated a second time on the backward replay"), so the
    layers attend without the prefix while the mask has its ``p`` columns, and the step fails
    (run on CPU, tiny Llama, 64 tokens, 8 virtual: "The size of tensor a (64) must match the
    size of tensor b (72)"). Prefix tuning with checkpointing is therefore refused on
    transformers' own families. ChatGLM's remote code checkpoints its layers itself and hands
    each one its prefix as a tuple it only reads (``torch.cat((cache_k, key_layer), dim=0)``,
    a new tensor each call, recomputation included), so on its stand-in the layers keep the
    cache under checkpointing and its layers read the prefix without writing
    (:func:`_read_only_update`): the same concatenated tensors, made again when a layer is
    recomputed.

    peft's other prompt learning (``--prompt-learning``): ``p-tuning`` (``PromptEncoderConfig``:
    ``Embedding(p, h)`` through ``Linear(h, h)``, ReLU, ``Linear(h, h)``, ReLU, ``Linear(h,
    h)``, biases; peft tuners/p_tuning/model.py ``PromptEncoder``) and ``prompt-tuning``
    (``PromptTuningConfig``: ``Embedding(p, h)``; tuners/prompt_tuning/model.py) prepend the
    ``p`` prompts to the input embeddings (``PeftModelForCausalLM.forward``: ``torch.cat((prompts,
    inputs_embeds), dim=1)``, the labels padded with ``p`` ignored ones): every layer then runs
    ``p + s`` tokens, and the logits are ``p + s`` long; no cache, so checkpointing runs as
    usual.

    A loss computed outside the model on the token ids (a remote-code family's own loss on the
    stand-in's logits, :func:`trainmem.trace.remote_code.remote_code_loss`; a loop's own loss,
    ``TrainingConfig.loss``) reads the labels peft hands the model: ``p`` ignored labels (-100)
    before the ``s`` of the batch (``PeftModelForCausalLM.forward``: ``prefix_labels =
    torch.full((batch_size, num_virtual_tokens), -100)``, ``torch.cat((prefix_labels, labels),
    dim=1)``), so its shift runs over the ``p + s`` positions of the logits
    (:func:`with_prompt_labels`). Prefix tuning leaves the labels as they are (its tokens are in
    the cache, not the logits).

    The prompt token ids (``PeftModel.prompt_tokens``, an ``arange(p)`` int64 tensor kept in a
    dict, on the host until each forward moves it) are held here as a buffer of the prompt
    encoder so that the fake-tensor trace converts them with the parameters; they are ``8 p``
    bytes.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

from trainmem.trace.lora import cast_adapters  # noqa: E402

__all__ = [
    "READ_ONLY_PREFIX_TYPES",
    "apply_prefix_tuning",
    "prepended_tokens",
    "refuse_prefix_tuning",
    "with_prompt_labels",
]

READ_ONLY_PREFIX_TYPES = frozenset({"chatglm"})
"""Remote-code families whose layers read their prefix without writing a cache, so that
checkpointed layers can be recomputed (Note [Prefix tuning])."""

_TOKENS_BUFFER = "trainmem_prompt_tokens"
"""The prompt encoder's buffer that holds peft's prompt token ids (Note [Prefix tuning])."""


class _PromptTokens(dict[str, Any]):
    """``PeftModel.prompt_tokens`` read from the prompt encoders' buffers: peft reads
    ``self.prompt_tokens[adapter]`` in ``get_prompt``, and a buffer follows the model's
    tensors onto fake tensors (``materialize_fake``) where a dict entry would stay on ``meta``.
    """

    def __init__(self, encoders: Any) -> None:
        super().__init__({name: None for name in encoders})
        self._encoders = encoders

    def __getitem__(self, name: str) -> Any:
        return self._encoders[name].get_buffer(_TOKENS_BUFFER)


def _read_only_update(layer: Any, key_states: Any, value_states: Any, *a: Any, **k: Any) -> Any:
    """A cache layer's ``update`` that concatenates the prefix and the new keys / values into
    new tensors and keeps the prefix alone (ChatGLM's ``torch.cat((cache_k, key_layer))``, Note
    [Prefix tuning]): the prefix's keys and values followed by ``key_states`` /
    ``value_states`` on the sequence axis (-2), the cache left as it was."""
    return (
        torch.cat([layer.keys, key_states], dim=-2),
        torch.cat([layer.values, value_states], dim=-2),
    )


def _read_only_prompt(model: Any) -> None:
    """Make each layer of the caches ``model.get_prompt`` returns read-only
    (:func:`_read_only_update`), and let checkpointed layers keep it."""
    for module in model.modules():
        if hasattr(module, "_can_checkpoint_with_cache"):
            module._can_checkpoint_with_cache = True
    get_prompt = model.get_prompt

    def read_only(*args: Any, **kwargs: Any) -> Any:
        cache = get_prompt(*args, **kwargs)
        for layer in cache.layers:
            layer.update = types.MethodType(_read_only_update, layer)
        return cache

    model.get_prompt = read_only


def prepended_tokens(training: TrainingConfig) -> int:
    """The virtual tokens peft prepends to the input embeddings (and the labels):
    :attr:`~trainmem.specs.training.TrainingConfig.prepended_tokens` (Note [Prefix tuning])."""
    return training.prepended_tokens


def with_prompt_labels(
    loss_fn: Callable[[Any, Any], Any], training: TrainingConfig, key: str = "input_ids"
) -> Callable[[Any, Any], Any]:
    """``loss_fn(output, batch)``, which reads ``batch[key]`` as the labels, given the labels
    peft hands the model when it prepends prompts (Note [Prefix tuning]): ``p`` ignored ones
    (-100) before the batch's; ``loss_fn`` itself without prepended prompts."""
    p = prepended_tokens(training)
    if p == 0:
        return loss_fn

    def loss(output: Any, batch: Any) -> Any:
        labels = batch[key]
        ignored = torch.full((labels.shape[0], p), -100, dtype=labels.dtype, device=labels.device)
        return loss_fn(output, {**batch, key: torch.cat((ignored, labels), dim=1)})

    return loss


def refuse_prefix_tuning(training: TrainingConfig, what: str) -> None:
    """Refuse prefix tuning on a model peft's ``PrefixTuningConfig`` does not run on.

    Args:
        training: the settings (``num_virtual_tokens``).
        what: the kind of model, for the message.

    Raises:
        NotApplicableError: ``num_virtual_tokens > 0`` (peft's prompt learning trains a
            transformers language model).
    """
    if training.is_prompt_learning:
        raise NotApplicableError(
            f"num_virtual_tokens: {training.prompt_learning} on {what} is not modelled: peft's "
            "prompt learning runs on a transformers language model (virtual tokens in its "
            "key/value cache or its input embeddings); use a transformers causal or seq2seq "
            "LM, or LoRA (--lora-rank)"
        )


def _refuse_unnamed_kv_heads(config: Any) -> None:
    """Refuse prefix tuning where peft sizes the prefix for every query head while the model
    has fewer key/value heads under another name: peft 0.21.2 utils/other.py
    ``_prepare_prompt_learning_config`` reads ``num_key_value_heads`` from the config's dict and
    otherwise takes ``token_dim = hidden_size``; Falcon's config names them ``num_kv_heads``
    (one with ``multi_query``), so each layer's ``torch.cat`` of prefix and keys fails
    ("Sizes of tensors must match", the generic path's trace of a multi-query Falcon; the same
    code runs on a GPU).

    Raises:
        UnsupportedError: a multi-query / grouped Falcon.
    """
    if "num_key_value_heads" in config.to_dict() or getattr(config, "model_type", "") != "falcon":
        return
    heads = config.num_attention_heads
    if getattr(config, "new_decoder_architecture", False):
        kv = getattr(config, "num_kv_heads", None) or heads
    else:
        kv = 1 if getattr(config, "multi_query", False) else heads
    if kv < heads:
        raise UnsupportedError(
            f"num_virtual_tokens: prefix tuning on Falcon with {kv} key/value heads of {heads}: "
            "peft sizes the prefix for every head (its config has no num_key_value_heads, "
            "utils/other.py _prepare_prompt_learning_config) and each layer's concatenation "
            "with the keys fails; allowed: prompt_learning p-tuning or prompt-tuning, or LoRA "
            "(--lora-rank)"
        )


def apply_prefix_tuning(model: Any, training: TrainingConfig, model_type: str | None) -> Any:
    """Wrap ``model`` in peft's prompt learning (prefix tuning, p-tuning, prompt tuning) as
    ``training`` asks (no-op without it).

    Args:
        model: the transformers model, built on ``meta`` (or on CPU for the real-run proof).
        training: ``num_virtual_tokens``, ``prompt_learning``, ``prefix_projection``.
        model_type: the ``model_type`` of the config the user gave (a remote-code family's,
            not its stand-in's).

    Returns:
        The ``PeftModel`` (or ``model`` itself when ``num_virtual_tokens == 0``).

    Raises:
        UnsupportedError: a model that is not a transformers causal or seq2seq language
            model; prefix tuning under activation checkpointing on a family whose layers
            write the cache.
    """
    if not training.is_prompt_learning:
        return model
    import peft

    config = getattr(model, "config", None)
    causal = type(model).__name__.endswith("ForCausalLM")
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    if config is None or not (causal or seq2seq):
        refuse_prefix_tuning(training, type(model).__name__)
    prefix = training.prompt_learning == "prefix-tuning"
    if prefix and training.activation_checkpointing != "none":
        if model_type not in READ_ONLY_PREFIX_TYPES:
            raise UnsupportedError(
                "num_virtual_tokens with activation_checkpointing="
                f"{training.activation_checkpointing}: transformers drops the prefix's "
                f"key/value cache in {type(model).__name__}'s checkpointed layers "
                "(GradientCheckpointingLayer: a layer that writes the cache gets none; Note "
                "[Prefix tuning]), and the step fails on the GPU too; allowed: "
                "activation_checkpointing none with prefix tuning, prompt_learning p-tuning or "
                "prompt-tuning, or LoRA (--lora-rank)"
            )
    if prefix:
        _refuse_unnamed_kv_heads(config)
    adapter = _peft_config(training, "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = peft.get_peft_model(model, adapter)
    for name, encoder in model.prompt_encoder.items():
        tokens = model.prompt_tokens[name]
        encoder.register_buffer(_TOKENS_BUFFER, tokens, persistent=False)
    model.prompt_tokens = _PromptTokens(model.prompt_encoder)
    cast_adapters(model, training)  # DeepSpeed casts its whole module, the encoder too
    if prefix and training.activation_checkpointing != "none":
        _read_only_prompt(model)
    return model


def _peft_config(training: TrainingConfig, task_type: str) -> Any:
    """peft's config of ``training.prompt_learning`` (Note [Prefix tuning]), peft's defaults
    otherwise (p-tuning: ``PromptEncoderConfig``'s MLP reparametrisation of
    ``encoder_hidden_size = token_dim``; prompt tuning: random init)."""
    import peft

    p = training.num_virtual_tokens
    if training.prompt_learning == "p-tuning":
        return peft.PromptEncoderConfig(task_type=task_type, num_virtual_tokens=p)
    if training.prompt_learning == "prompt-tuning":
        return peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=p)
    return peft.PrefixTuningConfig(
        task_type=task_type, num_virtual_tokens=p, prefix_projection=training.prefix_projection
    )
