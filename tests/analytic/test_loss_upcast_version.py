"""The fp32 loss upcast as a property of the model code and the transformers release: GPTBigCode's
causal-LM loss ran on its 16-bit logits until transformers 4.49.

Source: transformers 4.48.0 modeling_gpt_bigcode.py ``GPTBigCodeForCausalLM.forward``
(``shift_logits = lm_logits[..., :-1, :].contiguous()``, ``CrossEntropyLoss()`` on them, no
``.float()``); 4.49.0 the same forward calls ``self.loss_function`` = loss/loss_utils.py
``ForCausalLMLoss`` (``logits = logits.float()``). Llama's 4.48 forward already calls
``self.loss_function``.

santacoder (V = 49280), b = 4, s = 2048: T = 8192 tokens; bf16 (c = 2 B).
"""

from __future__ import annotations

import pytest

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    loss_in_logits_dtype,
    loss_upcast,
    shifted_logits_bytes,
)
from trainmem.errors import SpecError
from trainmem.estimate import estimate, trace_unsupported_settings
from trainmem.specs.assumptions import assumptions
from trainmem.specs.frameworks import installed_transformers_version
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, T = 49280, 4 * 2048
BIGCODE = load_model_spec("santacoder")


def _training(version: str | None, **kw: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "hf-trainer",
        "micro_batch_size": 4,
        "seq_len": 2048,
        "precision": "bf16-true",
        "activation_checkpointing": "full",
        "transformers_version": version,
        **kw,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def test_gpt_bigcode_before_4_49_takes_its_bf16_logits_as_they_are() -> None:
    training = _training("4.48.1")
    assert not loss_upcast(BIGCODE, training)
    # log_softmax (and nll_loss) save its bf16 output: c V per token, not 4 V
    assert head_activation_bytes(BIGCODE, training)["log_softmax"] == 2 * V * T
    # at the loss: the bf16 logits and their shifted bf16 copy (b (s - 1) positions), no fp32
    assert loss_forward_transient_bytes(BIGCODE, training) == 2 * V * T + 2 * V * 4 * 2047
    # nll_loss's and log_softmax's gradients, bf16
    assert loss_backward_transient_bytes(BIGCODE, training) == 2 * 2 * V * T


def test_gpt_bigcode_from_4_49_upcasts_through_for_causal_lm_loss() -> None:
    for version in ("4.49.0", "5.24"):
        training = _training(version)
        assert loss_upcast(BIGCODE, training)
        assert head_activation_bytes(BIGCODE, training)["log_softmax"] == 4 * V * T
        assert loss_forward_transient_bytes(BIGCODE, training) == (2 + 4) * V * T
        assert loss_backward_transient_bytes(BIGCODE, training) == 2 * 4 * V * T


def test_under_autocast_the_old_bigcode_loss_is_cross_entropy_on_16_bit_logits() -> None:
    # Note [Cross-entropy on 16-bit logits]: the bf16 log-softmax and nll_loss's fp32 copy
    training = _training("4.48", precision="bf16-mixed")
    assert loss_in_logits_dtype(BIGCODE, training)
    assert head_activation_bytes(BIGCODE, training)["log_softmax"] == (2 + 4) * V * T
    assert not loss_in_logits_dtype(BIGCODE, _training("4.49", precision="bf16-mixed"))


def test_gpt2_and_its_generation_before_4_49_too() -> None:
    # modeling_gpt2.py 4.48.0 GPT2LMHeadModel: CrossEntropyLoss on lm_logits[..., :-1, :], no
    # .float(); 4.49.0: self.loss_function
    gpt2 = load_model_spec("gpt2")
    assert not loss_upcast(gpt2, _training("4.48.0"))
    assert loss_upcast(gpt2, _training("4.49.0"))


def test_the_release_does_not_matter_to_families_that_always_upcast() -> None:
    llama = load_model_spec("llama-3.2-1b")
    assert loss_upcast(llama, _training("4.48.1"))
    # a framework's own loss or model code: torchtune's chunked loss, lit-gpt
    assert loss_upcast(BIGCODE, _training("4.48.1", chunked_cross_entropy=8))
    assert loss_upcast(BIGCODE, _training("4.48.1", framework="litgpt"))


def test_the_release_defaults_to_the_installed_one_and_an_explicit_one_wins() -> None:
    installed = installed_transformers_version()
    assert _training(None).transformers_release == installed
    assert _training("4.48.1").transformers_release == (4, 48, 1)
    with pytest.raises(SpecError, match="transformers_version"):
        _training("four")


def test_the_release_is_reported_as_assumed() -> None:
    given = estimate("santacoder", _training("4.48.1"), simulate_allocator=False)
    assert given.details["assumed"]["transformers"] == "4.48.1"
    default = assumptions({"framework": "hf-trainer"})
    assert default["transformers"].endswith("(installed)")


def test_the_settings_check_leaves_the_release_to_the_traced_step() -> None:
    # session 27 (Note in trainmem/traced_releases.py): a release other than the installed one
    # is no longer refused before the model is known; the traced step applies the release
    # differences the formulas know (llama / mistral) or refuses naming transformers_version
    assert not any(
        s.startswith("transformers_version=")
        for s in trace_unsupported_settings(_training("4.48.1", framework="pytorch-amp"))
    )


def test_before_4_49_the_loss_shifts_a_copy_of_the_logits() -> None:
    # ForCausalLMLoss 4.46-4.48: logits.float(), then logits[..., :-1, :].contiguous(): an fp32
    # copy of b (s - 1) positions beside the bf16 logits and their fp32 upcast; 4.49 pads the
    # labels instead (llama-3.2-1b, V = 128256, b = 4, s = 2048)
    llama = load_model_spec("llama-3.2-1b")
    v, b, s = 128256, 4, 2048
    old, new = _training("4.48.1"), _training("4.49.0")
    assert shifted_logits_bytes(llama, old) == 4 * v * b * (s - 1)
    assert loss_forward_transient_bytes(llama, old) == (2 + 4) * v * b * s + 4 * v * b * (s - 1)
    assert shifted_logits_bytes(llama, new) == 0
    assert loss_forward_transient_bytes(llama, new) == (2 + 4) * v * b * s
    # a framework's own loss shifts nothing of the kind
    assert shifted_logits_bytes(llama, _training("4.48.1", framework="torchtune")) == 0
    assert shifted_logits_bytes(llama, _training("4.48.1", chunked_cross_entropy=8)) == 0
