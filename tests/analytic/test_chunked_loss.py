"""torchtune's chunked cross-entropy, eager and compiled: the bytes of Note [Compiled chunked
cross-entropy] derived by hand from torchtune 0.4.0.

Source (torchtune 0.4.0): ``TransformerDecoder.chunked_output`` returns ``[self.output(chunk)
for chunk in h.chunk(N, dim=1)]`` (16-bit logits, modules/transformer.py);
``CEWithChunkedOutputLoss.compute_cross_entropy`` is ``F.cross_entropy(logits.float(), labels,
reduction="sum")`` per chunk (modules/loss/ce_chunked_output_loss.py), compiled by
``training.compile_loss`` when ``compile`` is on (training/_compile.py).

llama-3.2-3b (V = 128256, h = 3072), b = 2, s = 4096: t = 8192 tokens, N = 8 chunks of 1024,
bf16-true (c = 2 B).
"""

from __future__ import annotations

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    chunked_head_weight_grad_bytes,
    chunked_loss_gradient_bytes,
    compiled_chunked_loss,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
)
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, H, T, N = 128256, 3072, 8192, 8
CHUNK = T // N


def _training(*, compiled: bool, **kw: object) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=2,
        seq_len=4096,
        precision="bf16-true",
        framework="torchtune",
        activation_checkpointing="full",
        chunked_cross_entropy=N,
        compile=compiled,
        **kw,  # type: ignore[arg-type]
    )


MODEL = load_model_spec("llama-3.2-3b")


def test_eager_chunked_loss_keeps_every_chunks_fp32_log_softmax() -> None:
    training = _training(compiled=False)
    assert not compiled_chunked_loss(MODEL, training)
    head = head_activation_bytes(MODEL, training)
    # each chunk's log_softmax saves its fp32 output: 4 B x V for every token
    assert head["log_softmax"] == 4 * V * T
    assert "chunk_logits" not in head
    # at the last chunk's loss: all 16-bit logits (the model's output) + that chunk's fp32 copy
    assert loss_forward_transient_bytes(MODEL, training) == 2 * V * T + 4 * V * CHUNK
    # one chunk's nll_loss and log_softmax gradients, fp32
    assert loss_backward_transient_bytes(MODEL, training) == 2 * 4 * V * CHUNK


def test_compiled_chunked_loss_keeps_the_16_bit_logits_and_two_values_per_token() -> None:
    training = _training(compiled=True)
    assert compiled_chunked_loss(MODEL, training)
    head = head_activation_bytes(MODEL, training)
    assert "log_softmax" not in head
    assert head["chunk_logits"] == 2 * V * T  # the saved input chunks, bf16
    assert head["chunk_row_stats"] == (4 + 4) * T  # amax and log-sum-exp, fp32
    # the logits are the saved chunks; the fused upcast writes no fp32 copy
    assert loss_forward_transient_bytes(MODEL, training) == 0
    # the compiled backward writes one chunk's gradient in bf16
    assert loss_backward_transient_bytes(MODEL, training) == 2 * V * CHUNK


def test_every_chunks_gradient_reaches_the_head_and_its_weight_gradients_are_summed() -> None:
    for compiled in (False, True):
        training = _training(compiled=compiled)
        # the other 7 chunks' bf16 logits gradients wait for the projections' backward
        assert chunked_loss_gradient_bytes(MODEL, training) == 2 * V * (T - CHUNK)
        # InputBuffer: old + new out of place, beside the old sum: new + result
        assert chunked_head_weight_grad_bytes(MODEL, training) == 2 * (2 * V * H)
    lora = _training(compiled=True, lora_rank=8, lora_targets=("q", "v"))
    assert chunked_head_weight_grad_bytes(MODEL, lora) == 0  # frozen head
    assert chunked_loss_gradient_bytes(MODEL, lora) == 2 * V * (T - CHUNK)


def test_compiling_the_chunked_loss_lowers_the_peak_by_the_fp32_log_softmax() -> None:
    # LoRA: the head is frozen, so the peak is at the loss (forward end or its backward)
    kw = {"lora_rank": 8, "lora_targets": ("q", "v")}
    eager = estimate("llama-3.2-3b", _training(compiled=False, **kw), engine="analytic")
    compiled = estimate("llama-3.2-3b", _training(compiled=True, **kw), engine="analytic")
    eager_peak = eager.schedules[0].peak().peak_bytes
    compiled_peak = compiled.schedules[0].peak().peak_bytes
    # eager: the forward end holds the bf16 logits, every chunk's fp32 log-softmax and one
    # fp32 chunk; compiled: the loss backward holds the bf16 logits, their stats and one
    # bf16 gradient chunk (the rest of the step, the same, cancels)
    eager_head = 2 * V * T + 4 * V * T + 4 * V * CHUNK
    compiled_head = 2 * V * T + 8 * T + 2 * V * CHUNK
    assert eager.peak_phase == "forward"
    assert eager_peak - compiled_peak == eager_head - compiled_head
