"""Megatron's vocabulary-parallel cross-entropy and its last pipeline stage, which keeps the
loss, not the logits: the bytes of Note [Megatron's vocabulary-parallel cross-entropy] and Note
[Pipeline stage buffers] derived by hand from megatron-core 0.9.0.

Source (megatron-core 0.9.0): megatron/core/tensor_parallel/cross_entropy.py
``_VocabParallelCrossEntropy`` (one fp32 copy of the logits, max-subtracted, exponentiated and
normalised in place, saved as ``exp_logits``; the backward makes the gradient in that tensor in
place); megatron/core/pipeline_parallel/schedules.py ``forward_step`` (the last stage's output
tensor is ``loss_func``'s loss).

llama-3.2-1b (V = 128256), b = 2, s = 1024: T = 2048 tokens; bf16 (c = 2 B).
"""

from __future__ import annotations

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    loss_backward_tensors,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    megatron_cross_entropy,
)
from trainmem.analytic.pipeline import stage_buffers
from trainmem.estimate import estimate
from trainmem.schedule import Op, Repeat
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, T = 128256, 2 * 1024
MODEL = load_model_spec("llama-3.2-1b")


def _training(**kw: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "megatron",
        "micro_batch_size": 2,
        "seq_len": 1024,
        "precision": "bf16-mixed",
        **kw,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def _alloc_sizes(schedule: object, key: str) -> list[int]:
    out: list[int] = []

    def walk(items: object) -> None:
        for item in items:  # type: ignore[attr-defined]
            if isinstance(item, Repeat):
                walk(item.body)
            elif isinstance(item, Op) and item.action == "alloc" and item.key == key:
                out.append(item.size_bytes)

    walk(schedule.step)  # type: ignore[attr-defined]
    return out


def test_vocab_parallel_cross_entropy_saves_one_fp32_softmax() -> None:
    for tp in (1, 2):
        training = _training(tensor_parallel_size=tp)
        assert megatron_cross_entropy(MODEL, training)
        head = head_activation_bytes(MODEL, training)
        # exp_logits: the fp32 copy of this rank's [T, V / t] logits, softmax in place
        assert head["vocab_parallel_softmax"] == 4 * V * T // tp
        assert "log_softmax" not in head
        # at .float(): the output layer's bf16 logits beside their fp32 copy (the saved one)
        assert loss_forward_transient_bytes(MODEL, training) == 2 * V * T // tp
        # backward: the saved softmax is the fp32 gradient; autograd's cast to bf16 is new
        assert loss_backward_tensors(MODEL, training) == 1
        assert loss_backward_transient_bytes(MODEL, training) == 2 * V * T // tp


def test_the_generic_rule_is_what_megatron_does_not_do() -> None:
    # F.cross_entropy(logits.float()): the fp32 copy and a separate fp32 log-softmax output,
    # then nll_loss's and log_softmax's fp32 gradients (hf-trainer under bf16 autocast)
    training = _training(framework="hf-trainer")
    assert not megatron_cross_entropy(MODEL, training)
    assert head_activation_bytes(MODEL, training)["log_softmax"] == 4 * V * T
    assert loss_forward_transient_bytes(MODEL, training) == (2 + 4) * V * T
    assert loss_backward_transient_bytes(MODEL, training) == 2 * 4 * V * T


def test_fp32_logits_are_their_own_copy_and_their_own_gradient() -> None:
    # .float() on fp32 logits returns them: the saved softmax is the logits themselves, and
    # the gradient returned in it needs no cast
    training = _training(precision="32-true")
    assert head_activation_bytes(MODEL, training)["vocab_parallel_softmax"] == 4 * V * T
    assert loss_forward_transient_bytes(MODEL, training) == 0
    assert loss_backward_transient_bytes(MODEL, training) == 0


def test_an_explicit_loss_or_a_chunked_one_is_not_megatrons() -> None:
    assert not megatron_cross_entropy(MODEL, _training(loss="logits-sum"))
    assert not megatron_cross_entropy(MODEL, _training(chunked_cross_entropy=8))


def test_the_step_holds_bf16_logits_with_the_softmax_then_its_bf16_gradient() -> None:
    # the schedule: the logits (2 V T) while the loss runs, beside the head activations (the
    # 4 V T softmax among them); in backward one loss tensor, the bf16 gradient (2 V T)
    result = estimate("llama-3.2-1b", _training(), simulate_allocator=False)
    schedule = result.schedules[0]
    assert _alloc_sizes(schedule, "logits") == [2 * V * T]
    assert _alloc_sizes(schedule, "loss/2") == [2 * V * T]
    assert _alloc_sizes(schedule, "loss/1") == [0]
    # the forward's peak at the head: (2 + 4) V T of loss tensors, not 2 + 4 + 4 (the generic
    # rule) and, in backward, 4 + 2 V T, not 4 + 4 + 4
    assert result.peak_phase == "forward"


def test_megatron_last_stage_keeps_no_logits() -> None:
    # schedules.py forward_step: the last stage's output tensor is the loss; torch's
    # pipelining keeps every micro-batch's logits in output_chunks (fsdp2, torchtitan)
    megatron = _training(pipeline_parallel_size=2, gradient_accumulation_steps=4)
    titan = _training(framework="fsdp2", pipeline_parallel_size=2, gradient_accumulation_steps=4)
    assert stage_buffers(MODEL, megatron, in_flight=1, first=False, last=True).output_chunk == 0
    kept = stage_buffers(MODEL, titan, in_flight=1, first=False, last=True).output_chunk
    assert kept == 2 * V * T  # bf16 logits of one micro-batch
    result = estimate("llama-3.2-1b", megatron, simulate_allocator=False)
    last = result.schedules[-1]
    assert _alloc_sizes(last, "pp/chunk/{i}") == []
    assert set(_alloc_sizes(last, "pp/merged")) == {0}
    # the loss's bf16 logits are a transient of each micro-batch's forward instead
    assert set(_alloc_sizes(last, "logits")) == {2 * V * T}
