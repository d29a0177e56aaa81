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
"""

from __future__ import annotations

from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

__all__ = ["PROMPT_ENCODER", "prompt_encoder_tensors"]

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
