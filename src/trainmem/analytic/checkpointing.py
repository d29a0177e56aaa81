"""Activation checkpointing beyond the whole-layer rule of
:func:`~trainmem.analytic.activations.activation_profile` (Note [Activation checkpointing] in
trainmem/analytic/activations.py): op-level selective checkpointing as torchtitan does it,
which layers run inside a checkpoint region, and the input-embedding hook transformers
registers when it enables checkpointing. Symbols as in
:mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    tokens_per_sequence,
)
from trainmem.specs.frameworks import GRADIENT_CHECKPOINTING_LAYER_SINCE
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def layer_is_checkpointed(training: TrainingConfig) -> bool:
    """The whole layer runs inside a checkpoint region (full, or op-level selective with SDPA):
    its autocast weight casts are not saved but stay in autocast's cache until the forward ends
    (``cached_cast``; cleared on exiting the autocast region)."""
    mode = training.activation_checkpointing
    return mode == "full" or (mode == "selective" and training.attention != "eager")


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
    as every other layer's
    (:func:`~trainmem.analytic.backward_transients.backward_layer_transients`), as the hook makes
    it needed.

    Alive: from the end of the first layer's backward to the end of the micro-batch's
    backward.

    Source: transformers modeling_utils.py ``enable_input_require_grads``,
    ``_activation_checkpointing_enable``; peft utils/other.py
    ``prepare_model_for_kbit_training``; torch/csrc/autograd/functions/accumulate_grad.h.
    """
    frozen_embeddings = not training.trains_embedding  # Note [peft modules_to_save]
    if not (
        training.input_embeddings_require_grad
        and frozen_embeddings
        and model.architecture != "vision-encoder"
    ):
        return 0
    _, r = compute_and_residual_bytes(training)
    if training.prepended_tokens:
        # p-tuning / prompt tuning: the leaf is the embedding's s tokens, not the first layer's
        # input (peft's concatenation with the prompts), so it is held from the forward on
        # (:func:`~trainmem.analytic.prompt_encoder.prompt_encoder_activation_bytes`); here
        # its gradient alone
        t = training.micro_batch_size * training.seq_len
        return r * model.hidden_size * t // parallel_divisor("mlp/input", training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return 2 * r * model.hidden_size * t // parallel_divisor("mlp/input", training)


def layer_checkpoint_reentrant(training: TrainingConfig) -> bool:
    """The layers' checkpoint is torch's reentrant ``CheckpointFunction``
    (:attr:`~trainmem.specs.training.TrainingConfig.layer_checkpoint_reentrant`, which the
    trace reads too). Whether the layers are checkpointed at all is
    :func:`layer_is_checkpointed`'s."""
    return training.layer_checkpoint_reentrant


def fsdp1_kept_input_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of one layer's input (its checkpoint, r per token and hidden unit) that FSDP1
    keeps, with the input's gradient of the same size, from the layer's backward to the end of
    the backward (Note [FSDP1 frozen units under reentrant checkpointing] in
    trainmem/analytic/transforms/fsdp1_reentrant.py); 0 where the rule does not apply.

    Applies when transformers' gradient checkpointing (``full``) is reentrant
    (``TrainingConfig.hf_checkpoint_reentrant``) around FSDP1 units
    (``FrameworkConventions.fsdp1_checkpoint_outside_units``, sharded: ZeRO stage >= 2) whose
    flat parameters are frozen (LoRA), the input embeddings' hook on (every layer's input then
    requires grad), without pipelining, and only with a transformers release before
    :data:`~trainmem.specs.frameworks.GRADIENT_CHECKPOINTING_LAYER_SINCE` (4.52): from 4.52 the
    decoder layer checkpoints itself in its own ``__call__``, inside FSDP1's forward, where
    FSDP1's pre-forward sees the layer's input once, with grad enabled, as the previous
    checkpoint's non-leaf output; no detached leaf input is recomputed inside the unit, so
    nothing is kept.

    Source: torch 2.4.1 distributed/fsdp/_runtime_utils.py
    ``_register_post_backward_reshard_only_hook``, autograd/graph.py
    ``register_multi_grad_hook``, utils/checkpoint.py ``CheckpointFunction.backward``.
    """
    t = training
    if not (
        t.conventions.fsdp1_checkpoint_outside_units
        and t.zero_stage >= 2
        and t.activation_checkpointing == "full"
        and t.is_lora
        and t.pipeline_parallel_size == 1
        and t.input_embeddings_require_grad
        and model.architecture != "vision-encoder"
        and t.hf_checkpoint_reentrant
        and t.transformers_release < GRADIENT_CHECKPOINTING_LAYER_SINCE
    ):
        return 0
    _, r = compute_and_residual_bytes(t)
    tokens = t.micro_batch_size * tokens_per_sequence(model, t)
    return r * model.hidden_size * tokens // parallel_divisor("mlp/input", t)
