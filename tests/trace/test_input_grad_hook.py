"""transformers' ``enable_input_require_grads`` hook, run for real on the CPU (issue 12, item 5):
with frozen embeddings (LoRA) and activation checkpointing, the embedding output becomes a leaf
that requires grad, and it and its ``.grad`` stay alive after the backward until the loss is
dropped; the analytic term :func:`trainmem.analytic.checkpointing.input_grad_hook_bytes` is their
size."""

from __future__ import annotations

import gc
import weakref

import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainmem.analytic.checkpointing import input_grad_hook_bytes
from trainmem.specs.hf import load_hf_config, load_model_spec
from trainmem.specs.training import TrainingConfig

B, S = 2, 32


def _model(lora: bool) -> torch.nn.Module:
    fields = {k: v for k, v in load_hf_config("tiny-llama-test").items() if k != "architectures"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _embedding_output_after_backward(lora: bool) -> tuple[int, bool]:
    """(bytes of the embedding output and its .grad alive after backward while the loss is,
    whether they are gone once the loss is dropped)."""
    model = _model(lora)
    seen: dict[str, weakref.ref[torch.Tensor]] = {}
    model.get_input_embeddings().register_forward_hook(
        lambda _m, _i, out: seen.update(out=weakref.ref(out))
    )
    ids = torch.randint(0, 512, (B, S))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    x0 = seen["out"]()
    kept = 0
    if x0 is not None:
        assert x0.is_leaf and x0.requires_grad
        kept = x0.numel() * x0.element_size()
        if x0.grad is not None:
            kept += x0.grad.numel() * x0.grad.element_size()
    del x0, out
    gc.collect()
    return kept, seen["out"]() is None


def test_lora_embedding_output_and_its_gradient_outlive_the_backward() -> None:
    kept, freed_with_loss = _embedding_output_after_backward(lora=True)
    h = 64  # tiny-llama-test hidden_size
    assert kept == 2 * 4 * B * S * h  # fp32 output + fp32 .grad
    assert freed_with_loss
    model = load_model_spec("tiny-llama-test")
    training = TrainingConfig(
        precision="32-true",
        micro_batch_size=B,
        seq_len=S,
        lora_rank=8,
        activation_checkpointing="full",
    )
    assert input_grad_hook_bytes(model, training) == kept
    # without checkpointing transformers registers no hook; torchtune runs its own model code
    for other in (
        TrainingConfig(precision="32-true", micro_batch_size=B, seq_len=S, lora_rank=8),
        TrainingConfig(
            precision="32-true",
            micro_batch_size=B,
            seq_len=S,
            lora_rank=8,
            activation_checkpointing="full",
            framework="torchtune",
        ),
    ):
        assert input_grad_hook_bytes(model, other) == 0


def test_trainable_embeddings_consume_the_gradient() -> None:
    # full fine-tuning: the output has a grad_fn (the embedding's backward takes its gradient),
    # so nothing outlives the backward and the term is 0
    kept, _ = _embedding_output_after_backward(lora=False)
    assert kept == 0
    model = load_model_spec("tiny-llama-test")
    training = TrainingConfig(activation_checkpointing="full", micro_batch_size=B, seq_len=S)
    assert input_grad_hook_bytes(model, training) == 0


def _embedding_output_outlives_backward(
    monkeypatch: pytest.MonkeyPatch, hook: bool
) -> tuple[int, bool]:
    """Trace tiny-llama-test (LoRA q, v; full checkpointing); (size of the embedding output,
    whether it is freed after the backward's last allocation) in the measured step."""
    import transformers.modeling_utils as mu

    from trainmem.estimate import estimate

    if not hook:
        monkeypatch.setattr(mu.PreTrainedModel, "enable_input_require_grads", lambda self: None)
    training = TrainingConfig(
        micro_batch_size=B, seq_len=S, lora_rank=8, activation_checkpointing="full"
    )
    est = estimate("tiny-llama-test", training, engine="trace", simulate_allocator=False)
    timeline = est.schedules[0].expand()
    events = timeline.events[timeline.steady_state_start :]
    (x0,) = [
        e
        for e in events
        if e.action == "alloc" and e.phase == "forward" and e.module.endswith("embed_tokens")
    ]
    freed_at = next(
        i for i, e in enumerate(events) if e.action == "free" and e.block_id == x0.block_id
    )
    last_backward_alloc = max(
        i for i, e in enumerate(events) if e.action == "alloc" and e.phase == "backward"
    )
    return x0.size_bytes, freed_at > last_backward_alloc


def test_trace_keeps_the_embedding_output_to_the_end_of_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the trace engine runs transformers' own hook (gradient_checkpointing_enable); with it the
    # embedding output outlives every allocation of the backward, without it (patched out) the
    # first layer's backward frees it
    size, outlives = _embedding_output_outlives_backward(monkeypatch, hook=True)
    assert outlives
    assert size == 4 * B * S * 64  # fp32 residual stream under autocast, h = 64
    model = load_model_spec("tiny-llama-test")
    training = TrainingConfig(
        micro_batch_size=B, seq_len=S, lora_rank=8, activation_checkpointing="full"
    )
    assert input_grad_hook_bytes(model, training) == 2 * size  # the output and its .grad
    _, outlives = _embedding_output_outlives_backward(monkeypatch, hook=False)
    assert not outlives
