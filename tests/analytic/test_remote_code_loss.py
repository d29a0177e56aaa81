"""Qwen-1's remote code computes its causal-LM loss on the 16-bit logits, in every transformers
release (the Hub's modeling file runs, not transformers').

Source: Qwen/Qwen-7B modeling_qwen.py ``QWenLMHeadModel.forward``: ``lm_logits =
self.lm_head(hidden_states)``; ``shift_logits = lm_logits[..., :-1, :].contiguous()``;
``CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))``, no ``.float()``.
Found by benchmarks/published_probe.py: the Qwen README's Q-LoRA cells (DeepSpeed fp16, no
autocast) at 8192 tokens were predicted 31-45 % high with the fp32 upcast.

Qwen-7B (V = 151,936), b = 1, s = 2048: T = 2048 tokens; bf16 (c = 2 B), no autocast.
"""

from __future__ import annotations

from conftest import MODELS_DIR
from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    loss_upcast,
    shifted_logits_bytes,
)
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, T = 151_936, 2048
QWEN1 = load_model_spec(str(MODELS_DIR / "remote_code" / "qwen-7b.json"))


def _training(version: str | None) -> TrainingConfig:
    return TrainingConfig(
        framework="hf-trainer",
        micro_batch_size=1,
        seq_len=2048,
        precision="bf16-true",
        activation_checkpointing="full",
        transformers_version=version,
    )


def test_qwen1_loss_on_its_bf16_logits_in_any_release() -> None:
    for version in ("4.32.0", "4.57.0", None):  # None: the installed release
        training = _training(version)
        assert not loss_upcast(QWEN1, training)
        # the shifted bf16 copy: b (s - 1) positions of V values, 2 B each = 622,025,984 B
        assert shifted_logits_bytes(QWEN1, training) == 2 * V * 2047 == 622_025_984
        # log_softmax saves its bf16 output: c V per token, not 4 V
        assert head_activation_bytes(QWEN1, training)["log_softmax"] == 2 * V * T
        # at the loss: the bf16 logits and their shifted copy, no fp32 tensor
        assert loss_forward_transient_bytes(QWEN1, training) == 2 * V * T + 2 * V * 2047
        # nll_loss's and log_softmax's gradients, bf16
        assert loss_backward_transient_bytes(QWEN1, training) == 2 * 2 * V * T


def test_transformers_qwen2_still_upcasts() -> None:
    # transformers' own Qwen2 class (Qwen2.5-7B): ForCausalLMLoss upcasts, shifts the labels
    qwen2 = load_model_spec("qwen2.5-7b")
    assert loss_upcast(qwen2, _training("4.57.0"))
    assert shifted_logits_bytes(qwen2, _training("4.57.0")) == 0


# ChatGLM3-6B (V = 65,024; tests/models/remote_code/chatglm3-6b.json), b = 1, s = 2048
CHATGLM3 = load_model_spec(str(MODELS_DIR / "remote_code" / "chatglm3-6b.json"))
V_GLM = 65_024


def test_chatglm_shifts_its_fp32_logits_in_any_release() -> None:
    # THUDM/chatglm3-6b modeling_chatglm.py: lm_logits.to(torch.float32), then
    # shift_logits = lm_logits[..., :-1, :].contiguous(): its own file, not ForCausalLMLoss
    # (which shifts the labels from transformers 4.49), so the fp32 shifted copy stays:
    # b (s - 1) V values of 4 B = 65,024 x 2,047 x 4 = 532,416,512 B
    for version in ("4.37.1", "4.48.0", "4.57.0", None):
        training = _training(version)
        assert loss_upcast(CHATGLM3, training)
        assert shifted_logits_bytes(CHATGLM3, training) == 4 * V_GLM * 2047 == 532_416_512
    # transformers' own Llama-style family from 4.49: the labels are shifted, no copy
    qwen2 = load_model_spec("qwen2.5-7b")
    assert shifted_logits_bytes(qwen2, _training("4.49.0")) == 0
