"""Prefix tuning / P-Tuning v2 (and peft's p-tuning, prompt tuning) through peft on the generic
path (Note [Prefix tuning] in
trainmem/trace/prefix.py).

Expected sizes derived by hand from peft 0.21.2 tuners/prefix_tuning/model.py
``PrefixEncoder`` and utils/other.py ``_prepare_prompt_learning_config``, for
tiny-llama-test (hidden 64, 4 heads of 16, 2 key/value heads, 2 layers): ``token_dim`` t is the
key/value width, 2 x 16 = 32, and the prefix encoder is made in fp32 over any base dtype.
The real CPU runs of the same steps are in tests/trace/test_real_cpu.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("peft")

L, T = 2, 2 * 16  # tiny-llama-test: layers; key/value width (2 kv heads x head_dim 16)
BASE = 159_040 - 1_024  # tiny-llama-test's parameters (the CLI run: 159,040 with p = 8)


def _estimate(**settings: Any) -> Any:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **settings)
    return estimate("tiny-llama-test", training, engine="generic", simulate_allocator=False)


def test_the_prefix_embedding_is_the_only_trained_tensor_in_fp32() -> None:
    # Embedding(p, 2 L t) with p = 8: 8 x 2 x 2 x 32 = 1,024 elements, fp32 over a bf16 base
    # (2 bytes a parameter), AdamW's exp_avg + exp_avg_sq 8 bytes per element; beside them the
    # rotary embedding's inv_freq and original_inv_freq buffers (head_dim / 2 = 8 fp32 each)
    # and peft's prompt token ids (p int64).
    # No gradient at the peak: the prefix's is the backward's last, made after it.
    p = 8
    prefix = p * 2 * L * T
    est = _estimate(precision="bf16-true", num_virtual_tokens=p)
    assert prefix == 1_024
    assert est.num_trainable_parameters == prefix
    assert est.num_parameters == BASE + prefix
    assert est.breakdown.parameters == 2 * BASE + 4 * prefix + 2 * 8 * 4 + 8 * p
    assert est.breakdown.optimizer_states == 8 * prefix


def test_prefix_projection_trains_the_embedding_and_a_two_layer_mlp() -> None:
    # Embedding(p, t), Linear(t, t) + bias, Linear(t, 2 L t) + bias (encoder_hidden_size = t)
    p = 16
    trained = p * T + (T * T + T) + (T * 2 * L * T + 2 * L * T)
    est = _estimate(precision="bf16-true", num_virtual_tokens=p, prefix_projection=True)
    assert trained == 512 + 1_056 + 4_224
    assert est.num_trainable_parameters == trained
    assert est.breakdown.optimizer_states == 8 * trained


@pytest.mark.parametrize(
    ("method", "p", "trained"),
    [
        # PromptTuningConfig: Embedding(p, h), h = 64
        ("prompt-tuning", 16, 16 * 64),
        # PromptEncoderConfig: Embedding(p, h) + its MLP head, three Linear(h, h) with biases
        ("p-tuning", 8, 8 * 64 + 3 * (64 * 64 + 64)),
    ],
)
def test_prompt_and_p_tuning_train_virtual_token_embeddings(
    method: str, p: int, trained: int
) -> None:
    # the prompts are prepended to the input embeddings: no cache, so full checkpointing runs
    est = _estimate(
        precision="bf16-true",
        num_virtual_tokens=p,
        prompt_learning=method,
        activation_checkpointing="full",
    )
    assert est.num_trainable_parameters == trained
    assert est.breakdown.optimizer_states == 8 * trained


def test_more_virtual_tokens_cost_more_than_their_parameters() -> None:
    # the longer key / value length of every layer's attention (saved concatenations, a wider
    # mask) grows the activations as well as the prefix's states
    short = _estimate(precision="bf16-true", num_virtual_tokens=8)
    long = _estimate(precision="bf16-true", num_virtual_tokens=64)
    states = 16 * (64 - 8) * 2 * L * T  # fp32 weight, gradient, two AdamW moments
    extra = long.breakdown.allocated_bytes - short.breakdown.allocated_bytes
    assert extra > states
    assert long.breakdown.activations > short.breakdown.activations


def test_auto_runs_the_formulas_and_traces_what_they_refuse() -> None:
    # since session 29 the formulas model prefix tuning on a transformers decoder (Note [Prompt
    # learning in the formulas] in trainmem/analytic/prompt_encoder.py); their refusals
    # (sliding-window layers, encoder-decoders, remote code) go to the generic path
    training = TrainingConfig(micro_batch_size=2, seq_len=64, num_virtual_tokens=8)
    est = estimate("tiny-llama-test", training, simulate_allocator=False)
    assert est.engine == "analytic"
    assert est.num_trainable_parameters == 1_024
    gemma3 = str(MODELS_DIR / "gemma3_text.json")
    with pytest.raises(UnsupportedError, match="sliding-window layers"):
        estimate(gemma3, training, engine="analytic")
    assert estimate(gemma3, training, simulate_allocator=False).engine == "generic"


def test_checkpointing_a_transformers_family_under_prefix_tuning_is_refused() -> None:
    # transformers 5.24's GradientCheckpointingLayer drops a writing layer's cache: the step
    # fails on a real CPU run ("The size of tensor a (64) must match the size of tensor b (72)")
    with pytest.raises(UnsupportedError, match="activation_checkpointing=full"):
        _estimate(num_virtual_tokens=8, activation_checkpointing="full")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (dict(num_virtual_tokens=8, lora_rank=8), "num_virtual_tokens"),
        (dict(prefix_projection=True), "prefix_projection"),
        (dict(num_virtual_tokens=8, prompt_learning="p-tuning", prefix_projection=True),
         "prefix_projection"),
        (dict(num_virtual_tokens=8, prompt_learning="ia3"), "prompt_learning"),
        (dict(num_virtual_tokens=-1), "num_virtual_tokens"),
        (dict(num_virtual_tokens=8, framework="torchtune"), "num_virtual_tokens"),
        (dict(num_virtual_tokens=8, tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(num_virtual_tokens=8, pipeline_parallel_size=2), "pipeline_parallel_size"),
    ],
)  # fmt: skip
def test_settings_prefix_tuning_is_not_modelled_with_name_the_field(
    settings: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as exc:
        TrainingConfig(**settings)
    assert exc.value.field == field


def test_a_loss_outside_the_model_reads_peft_s_labels_for_the_prompts() -> None:
    # peft PeftModelForCausalLM.forward (p-tuning / prompt tuning): p labels of -100 before the
    # batch's; after the causal shift the last prompt position predicts the first token and
    # the others are ignored: the loss is the cross-entropy of logits[:, p - 1 : p + s - 1]
    # against the s token ids
    import torch

    from trainmem.trace.prefix import with_prompt_labels
    from trainmem.trace.remote_code import remote_code_loss

    b, p, s, v = 2, 3, 5, 7
    torch.manual_seed(0)
    logits = torch.randn(b, p + s, v)
    ids = torch.randint(0, v, (b, s))
    training = TrainingConfig(num_virtual_tokens=p, prompt_learning="p-tuning")
    loss = with_prompt_labels(remote_code_loss, training)(
        SimpleNamespace(logits=logits), {"input_ids": ids}
    )
    expected = torch.nn.functional.cross_entropy(
        logits[:, p - 1 : p + s - 1].reshape(-1, v), ids.reshape(-1)
    )
    assert torch.allclose(loss, expected)
    # prefix tuning's tokens are in the cache, not the logits: the labels stay as they are
    prefix = TrainingConfig(num_virtual_tokens=p)
    assert with_prompt_labels(remote_code_loss, prefix) is remote_code_loss


def test_qwen1_s_own_loss_runs_over_the_prompts_and_the_tokens(tmp_path: Path) -> None:
    # Qwen-1's remote code computes its loss on its 16-bit logits against the labels peft pads
    # (crashed before: "Expected input batch_size (142) to match target batch_size (126)").
    # Prompt tuning with p + s fixed (8 + 64 and 16 + 56): after peft's concatenation every
    # layer, the logits and the loss see the same [b, p + s] shapes, so the activations differ
    # by the b x s int64 input ids only; the trained Embedding(p, h) (fp32 weight, AdamW's two
    # moments) and peft's p int64 prompt token ids by their p.
    config = json.loads((MODELS_DIR / "remote_code" / "qwen-7b.json").read_text())
    config.update(hidden_size=64, num_attention_heads=4, kv_channels=16, num_hidden_layers=2)
    config.update(intermediate_size=256, vocab_size=512)
    path = tmp_path / "tiny-qwen.json"
    path.write_text(json.dumps(config))
    b, h = 2, 64
    ests = {
        p: estimate(
            str(path),
            TrainingConfig(
                micro_batch_size=b,
                seq_len=72 - p,
                precision="bf16-true",
                num_virtual_tokens=p,
                prompt_learning="prompt-tuning",
            ),
            engine="generic",
            simulate_allocator=False,
        ).breakdown
        for p in (8, 16)
    }
    short, long = ests[8], ests[16]
    assert short.activations - long.activations == 8 * b * (64 - 56)
    assert long.parameters - short.parameters == (4 * h + 8) * (16 - 8)
    assert long.optimizer_states - short.optimizer_states == 8 * h * (16 - 8)


def test_the_course_cross_entropy_cannot_ignore_the_prompts() -> None:
    # CS336's cross-entropy gathers every target (trace/course_model.py): a -100 label has no
    # row, so peft's padded labels fail it
    with pytest.raises(UnsupportedError, match="loss=cs336-cross-entropy"):
        _estimate(num_virtual_tokens=8, prompt_learning="p-tuning", loss="cs336-cross-entropy")
