"""The trainable tensors of peft's prompt learning (prefix tuning / P-Tuning v2, p-tuning,
prompt tuning) over a frozen base, for the model-state layout.

Note [Prompt encoder tensors]
    Under prompt learning the base is frozen and peft's prompt encoder holds the only trained
    tensors (Note [Prefix tuning] in trainmem/trace/prefix.py, which traces peft itself). Their
    shapes, from peft 0.21.2 (``p`` virtual tokens of a causal LM, ``num_transformer_submodules``
    1; ``L`` layers; ``h`` the hidden size):

    * prefix tuning (tuners/prefix_tuning/model.py ``PrefixEncoder``): ``Embedding(p, 2 L t)``,
      ``t = token_dim`` the key/value width ``head_dim * num_key_value_heads``
      (utils/other.py ``_prepare_prompt_learning_config``); with ``prefix_projection``:
      ``Embedding(p, t)``, ``Linear(t, e)`` and ``Linear(e, 2 L t)`` with biases
      (``e = encoder_hidden_size``, ``t`` by default);
    * p-tuning (tuners/p_tuning/model.py ``PromptEncoder``, MLP reparametrisation):
      ``Embedding(p, h)`` and three ``Linear`` with biases, ``h -> e -> e -> h`` (``e = h``);
    * prompt tuning (tuners/prompt_tuning/model.py ``PromptEmbedding``): ``Embedding(p, h)``.

    They are made after the base in fp32, whatever the base's dtype, as LoRA's adapters are on
    a 16-bit base (so :func:`~trainmem.analytic.lora.lora_adapter_dtype` gives their dtype: a
    framework that casts its whole module, DeepSpeed's engine, casts them too). The layout
    lists them before the layers (``owner`` ``embedding``), names prefixed
    :data:`PROMPT_ENCODER`; the sharding, offload and optimizer rules read them as any trained
    tensor. Checked against peft's own modules on the generic path
    (tests/analytic/test_prompt_encoder_states.py).

Note [Prompt learning in the formulas]
    The formulas' rules for peft 0.21.2's prompt learning on a transformers 5.24 decoder
    (peft_model.py ``get_prompt``, ``PeftModelForCausalLM.forward``), ``p`` virtual tokens:

    * the base is frozen (``TrainingConfig.frozen_base``): LoRA's frozen-base rules with no
      adapter (Note [LoRA activations] in trainmem/analytic/lora.py: no linear saves its
      input, no norm its normalised output, the down projection's input goes);
    * p-tuning / prompt tuning (``TrainingConfig.prepended_tokens``) prepend the prompts to the
      input embeddings: every layer and the head run ``p + s`` tokens
      (:func:`~trainmem.analytic.activation_shapes.tokens_per_sequence`); the first layer's
      input needs a gradient, so it saves what the others do; peft's forward holds its
      ``prompts`` and, where the first norm saves a cast instead, the prompted embeddings to
      the end of the loss (:func:`prompted_inputs_held_bytes`); under checkpointing the input
      embeddings' leaf (transformers' input-grad hook) is held from the forward on, not the
      first layer's input (``prompt_encoder/embedding_leaf``);
    * prefix tuning (``TrainingConfig.prefix_tokens``): each layer's cache concatenates the
      prefix's keys and values before its own (cache_utils.py ``DynamicLayer.update``), so
      SDPA saves ``p + s`` rows of them (``attention/prefix_kv``); the key length differs from
      the query's, so transformers builds an explicit (1, 1, s, p + s) mask
      (masking_utils.py ``_ignore_causal_mask_sdpa``) that SDPA turns into a saved
      (b, 1, s, p + s) bias, and repeats grouped keys / values itself
      (:func:`~trainmem.analytic.attention.explicit_mask`); the cache's tensors are in the
      wider of the base's dtype (peft's ``past_key_values.to(base_model_torch_dtype)``) and
      the layer's, held to the end of the forward where SDPA saves its own cast
      (:func:`~trainmem.analytic.attention.forward_kv_cache_bytes`); the first layer's input
      needs no gradient up to the concatenation (:func:`~trainmem.analytic.lora.
      first_layer_unsaved`);
    * the prompt encoder's own saved tensors (:func:`prompt_encoder_activation_bytes`).

    Checked against the generic path (peft on the transformers model) on the 1024-wide
    agreement Llama with 8 and 2 kv heads and a Gemma with 1, bf16-mixed and bf16-true, the
    three methods, the projection, checkpointed p-tuning, ZeRO-2: every step peak within
    0.01 % (tests/analytic/test_prompt_learning_formulas.py); before, the formulas refused
    prompt learning. Not modelled (:func:`check_prompt_learning` refuses, the generic path
    traces): encoder-decoders (peft's two-submodule prefix), remote-code families (their own
    prompt code), sharded weights (ZeRO-3 / FSDP: -1.4 / +8.8 % against the generic path on
    the 2048-wide agreement Llama, not diagnosed), prefix tuning with multi-head latent
    attention, sliding-window layers or activation checkpointing (which fails for real). Not
    modelled either: peft before the single-row encoder run of p-tuning / prompt tuning
    (``prompt_tokens[:1]`` then ``repeat``), the prefix's copies held in the cache during the
    first layers' forward (2 L b k p d at most), the autocast bias copies of the encoders'
    linears.
"""

from __future__ import annotations

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.errors import UnsupportedError
from trainmem.specs.hf_table import REMOTE_CODE_TYPES
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

__all__ = [
    "PROMPT_ENCODER",
    "check_prompt_learning",
    "prompt_encoder_activation_bytes",
    "prompt_encoder_tensors",
    "prompted_inputs_held_bytes",
]

PROMPT_ENCODER = "prompt_encoder."
"""Name prefix of the prompt encoder's tensors in the layout (Note [Prompt encoder tensors])."""


def prompt_encoder_tensors(
    model: ModelSpec, training: TrainingConfig
) -> list[tuple[str, int, int]]:
    """(name, elements, out_features) of each trained tensor of ``training``'s prompt learning
    on ``model`` (Note [Prompt encoder tensors]); [] without prompt learning."""
    if not training.is_prompt_learning:
        return []
    p, h = training.num_virtual_tokens, model.hidden_size
    name = PROMPT_ENCODER
    if training.prompt_learning == "prompt-tuning":
        return [(name + "embedding", p * h, h)]
    if training.prompt_learning == "p-tuning":
        out = [(name + "embedding", p * h, h)]
        for k in range(3):  # h -> e -> e -> h, e = h
            layer = f"{name}mlp_head.{2 * k}"
            out += [(layer + ".weight", h * h, h), (layer + ".bias", h, h)]
        return out
    t = model.head_dim * model.num_kv_heads
    width = 2 * model.num_layers * t
    if not training.prefix_projection:
        return [(name + "embedding", p * width, width)]
    return [
        (name + "embedding", p * t, t),
        (name + "transform.0.weight", t * t, t),
        (name + "transform.0.bias", t, t),
        (name + "transform.2.weight", t * width, width),
        (name + "transform.2.bias", width, width),
    ]


def prompt_encoder_activation_bytes(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Bytes the prompt encoder's forward saves for its backward, by term (Note [Prompt
    learning in the formulas]); {} without prompt learning or where it saves nothing but its
    embedding's indices (a view of peft's prompt ids): prompt tuning, prefix tuning without
    the projection.

    p-tuning runs the encoder on one row of ``p`` virtual tokens and repeats its output ``b``
    times (peft 0.21.2 peft_model.py ``get_prompt``: ``prompt_tokens[:1]``, then
    ``prompts.repeat(batch_size, 1, 1)``), prefix tuning on ``b`` rows. They run in the
    encoder's dtype ``w`` (:func:`~trainmem.analytic.lora.lora_adapter_dtype`, fp32 unless the
    framework casts it);
    under autocast each linear casts its fp32 weight and its input to the compute dtype ``c``
    and saves both casts (``mm``: ``mat2`` for the input's gradient, ``self`` for the
    weight's), and the activations between the linears are ``c``:

    * p-tuning's MLP (peft 0.21.2 tuners/p_tuning/model.py ``PromptEncoder``: ``Linear(h, e)``,
      ReLU, ``Linear(e, e)``, ReLU, ``Linear(e, h)``, ``e = h``): the first linear's input,
      the two ReLU outputs (``relu`` saves its result, which the next linear saves too), and
      under autocast the three weights' copies;
    * prefix tuning's projection (tuners/prefix_tuning/model.py ``PrefixEncoder``:
      ``Linear(t, e)``, Tanh, ``Linear(e, 2 L t)``): the first linear's input, the tanh output
      (saved by ``tanh`` and the second linear) and under autocast the two weights' copies.
    """
    out: dict[str, int] = {}
    if training.prepended_tokens and training.input_embeddings_require_grad:
        # the embedding's output, made a leaf by transformers' input-grad hook, held by its
        # AccumulateGrad node: not the first layer's input, which is peft's concatenation
        # (its gradient: trainmem.analytic.checkpointing.input_grad_hook_bytes)
        _, r = compute_and_residual_bytes(training)
        out["prompt_encoder/embedding_leaf"] = (
            r * training.micro_batch_size * training.seq_len * model.hidden_size
        )
    if training.prompt_learning == "p-tuning":
        h = e = model.hidden_size
        linears = [(h, e), (e, e), (e, h)]
        inner = 2 * e  # the two ReLU outputs
        rows = training.num_virtual_tokens  # one row, repeated b times after the encoder
    elif training.prompt_learning == "prefix-tuning" and training.prefix_projection:
        t = model.head_dim * model.num_kv_heads
        h, e = t, t
        linears = [(t, e), (e, 2 * model.num_layers * t)]
        inner = e  # the tanh output
        rows = training.micro_batch_size * training.num_virtual_tokens
    else:
        return out
    c, _ = compute_and_residual_bytes(training)
    w = dtype_bytes(lora_adapter_dtype(training))
    cast = training.uses_autocast and w != c
    a = c if training.uses_autocast else w  # the activations' dtype inside the encoder
    out["prompt_encoder/activations"] = a * rows * (h + inner)
    if cast:
        out["prompt_encoder/weight_copies"] = c * sum(i * o for i, o in linears)
    return out


def prompted_inputs_held_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes peft's forward holds from the embedding to the end of the loss under p-tuning /
    prompt tuning, where nothing saves them (Note [Prompt learning in the formulas]): the
    ``b`` repeated prompts in the residual dtype ``r`` (r b p h) and, unless the first layer's
    norm saves it as it is (an fp32 residual stream, whose ``to(float32)`` is the tensor
    itself; nor under checkpointing, whose first layer saves it as its input), the prompted
    input embeddings (r b (p + s) h). 0 otherwise."""
    p = training.prepended_tokens
    if not p:
        return 0
    _, r = compute_and_residual_bytes(training)
    b, h = training.micro_batch_size, model.hidden_size
    held = r * b * p * h  # ``prompts``
    # ``inputs_embeds``: the first norm saves its fp32 cast instead, a checkpointed first layer
    # the tensor itself
    if r < 4 and training.activation_checkpointing == "none":
        held += r * b * (training.seq_len + p) * h
    return held


def check_prompt_learning(model: ModelSpec, training: TrainingConfig) -> None:
    """Refuse the prompt learning the formulas do not model (Note [Prompt learning in the
    formulas]); the generic path traces peft itself.

    Raises:
        UnsupportedError: an encoder-decoder, a remote-code family (its own prefix code), or
            prefix tuning with multi-head latent attention, sliding-window layers, or
            activation checkpointing, or sharded weights (ZeRO-3 / FSDP).
    """
    if not training.is_prompt_learning:
        return
    method = f"num_virtual_tokens: {training.prompt_learning}"
    generic = "the generic path traces peft on the transformers model (--engine generic)"
    reason = None
    if model.architecture != "decoder":
        reason = f"on a {model.architecture} model"
    elif model.model_type in REMOTE_CODE_TYPES:
        reason = f"on {model.model_type}'s remote code (its own prompt code)"
    elif training.prefix_tokens and model.mla:
        reason = "with multi-head latent attention"
    elif training.prefix_tokens and model.num_sliding_layers:
        reason = "with sliding-window layers"
    elif training.zero_stage == 3 and training.sharding_degree > 1:
        # generic / formulas on the 2048-wide agreement Llama (benchmarks/generic_options.py):
        # ZeRO-3 prefix -1.4 %, FSDP2 p-tuning +8.8 % (ZeRO-2, DDP, one GPU within 0.01 %)
        reason = "with sharded weights (ZeRO-3 / FSDP: not checked against the generic path)"
    if (
        training.prefix_tokens
        and model.model_type == "falcon"
        and model.num_kv_heads < model.num_heads
    ):
        # peft sizes the prefix for every head (Falcon's config has no num_key_value_heads):
        # the step fails (trainmem/trace/prefix.py ``_refuse_unnamed_kv_heads``)
        raise UnsupportedError(
            f"{method} on Falcon with {model.num_kv_heads} key/value heads of "
            f"{model.num_heads}: peft sizes the prefix for every head and each layer's "
            "concatenation with the keys fails; allowed: prompt_learning p-tuning or "
            "prompt-tuning, or LoRA (--lora-rank)"
        )
    if reason is not None:
        raise UnsupportedError(f"{method} {reason} is not in the formulas; {generic}")
    if training.prefix_tokens and training.activation_checkpointing != "none":
        raise UnsupportedError(
            f"{method} with activation_checkpointing={training.activation_checkpointing}: "
            "transformers drops the prefix's key/value cache in checkpointed layers "
            "(GradientCheckpointingLayer) and the step fails (Note [Prefix tuning] in "
            "trainmem/trace/prefix.py); allowed: activation_checkpointing none with prefix "
            "tuning, or prompt_learning p-tuning or prompt-tuning"
        )
