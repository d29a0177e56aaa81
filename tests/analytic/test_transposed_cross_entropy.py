"""torchtune's 2024 recipes' loss: ``nn.CrossEntropyLoss`` on the shifted fp32 logits'
transposed view (Note [torchtune's transposed cross-entropy]).

Source: torchtune recipes/lora_finetune_single_device.py @fef3ed1 ``train()``: ``logits =
self._model(input_ids)`` (modules/transformer.py: ``self.output(h).float()``), ``logits =
logits[..., :-1, :].contiguous()``, ``logits = logits.transpose(1, 2)``, ``self._loss_fn(logits,
labels)``; aten/src/ATen/native/cuda/SoftMax.cu ``host_softmax``: ``input_.contiguous()``.

Llama-2-7B (V = 32000), b = 2, s = 512: t = 1024 tokens, t' = 2 x 511 = 1022 shifted positions;
bf16 (c = 2 B).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.held_outputs import previous_output_bytes
from trainmem.analytic.loss import (
    loss_backward_tensors,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    loss_kind,
)
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, T, T_SHIFTED = 32000, 2 * 512, 2 * 511
LLAMA = load_model_spec("llama-2-7b")


def _training(**kw: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "torchtune",
        "micro_batch_size": 2,
        "seq_len": 512,
        "precision": "bf16-true",
        "activation_checkpointing": "full",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "loop": "drop",
        **kw,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


TRANSPOSED = _training(loss="transposed-cross-entropy")


def test_the_loss_holds_the_shifted_logits_and_the_kernels_contiguous_copy() -> None:
    # the shifted fp32 copy (4 V t') and log_softmax's contiguous copy of its transposed view
    # (4 V t'), beside the saved fp32 log-softmax of the shifted positions (4 V t')
    assert loss_forward_transient_bytes(LLAMA, TRANSPOSED) == 8 * V * T_SHIFTED
    assert head_activation_bytes(LLAMA, TRANSPOSED)["log_softmax"] == 4 * V * T_SHIFTED
    # the plain upcasting cross-entropy: the bf16 logits and their fp32 copy, t positions
    assert loss_forward_transient_bytes(LLAMA, _training()) == (2 + 4) * V * T


def test_its_backward_holds_two_fp32_gradients_of_the_shifted_positions() -> None:
    # nll_loss2d_backward's and the log-softmax backward's (b, V, s - 1) gradients
    assert loss_backward_tensors(LLAMA, TRANSPOSED) == 2
    assert loss_backward_transient_bytes(LLAMA, TRANSPOSED) == 2 * 4 * V * T_SHIFTED


def test_the_previous_loop_holds_the_shifted_fp32_logits() -> None:
    held = _training(loss="transposed-cross-entropy", loop="previous")
    assert previous_output_bytes(LLAMA, held) == 4 * V * T_SHIFTED
    # torchtune without it: the logits in the compute dtype, t positions
    assert previous_output_bytes(LLAMA, _training(loop="previous")) == 2 * V * T


def test_the_forward_peak_at_the_loss_is_12_v_t_shifted_not_10_v_t() -> None:
    # forward ends at the loss: 12 V t' (transposed) against 10 V t (bf16 logits + fp32 copy +
    # saved fp32 log-softmax); the backward's start: 12 V t' against 12 V t
    plain = estimate(LLAMA, _training(), engine="analytic").details["phase_peaks_bytes"]
    moved = estimate(LLAMA, TRANSPOSED, engine="analytic").details["phase_peaks_bytes"]
    assert isinstance(plain, dict) and isinstance(moved, dict)
    assert moved["forward"] - plain["forward"] == 12 * V * T_SHIFTED - 10 * V * T
    assert moved["backward"] - plain["backward"] == 12 * V * (T_SHIFTED - T)


@pytest.mark.parametrize(
    ("version", "kind"),
    [
        ("0.1.0", "transposed-cross-entropy"),  # fef3ed1, 20747cd
        ("0.2.1", "transposed-cross-entropy"),  # v0.2.1: the transpose, before 4fba6cd4
        ("0.3.0", "cross-entropy"),  # 4fba6cd4 is in v0.3.0: logits reshaped to (b s, V)
        (None, "cross-entropy"),  # the default release, 0.6.1
    ],
)
def test_torchtunes_release_chooses_its_recipes_loss(version: str | None, kind: str) -> None:
    assert loss_kind(LLAMA, _training(torchtune_version=version)) == kind


def test_the_release_changes_no_other_loss() -> None:
    # an explicit loss wins; a chunked loss is torchtune's later one; other frameworks keep theirs
    old = {"torchtune_version": "0.1"}
    assert loss_kind(LLAMA, _training(loss="logits-sum", **old)) == "logits-sum"
    assert loss_kind(LLAMA, _training(chunked_cross_entropy=8, **old)) == "cross-entropy"
    assert loss_kind(LLAMA, _training(framework="hf-trainer", **old)) == "cross-entropy"
    assert TrainingConfig(framework="torchtune", torchtune_version="0.2").torchtune_release == (
        0,
        2,
        0,
    )


def test_it_cannot_be_chunked() -> None:
    with pytest.raises(SpecError, match="chunk"):
        _training(loss="transposed-cross-entropy", chunked_cross_entropy=8)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_position_embeddings": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "vocab_size": 8192,
}


@pytest.mark.slow  # ~8 s on 2 cores; the bytes are checked by hand above
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_generic_trace_runs_the_recipes_loss(tmp_path: Path) -> None:
    # b = 2, s = 256, V = 8192: the backward's start agrees with the trace within 0.1%; the
    # trace's forward holds the HF model output's bf16 logits (c V t = 8 MiB) through the loss,
    # which torchtune's TransformerDecoder casts inside its forward (``.float()``)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    training = TrainingConfig(
        framework="torchtune",
        micro_batch_size=2,
        seq_len=256,
        precision="bf16-true",
        optimizer="sgd",
        activation_checkpointing="full",
        loss="transposed-cross-entropy",
    )
    peaks = {
        engine: estimate(str(path), training, engine=engine, simulate_allocator=False)
        .schedules[0]
        .phase_peaks()
        for engine in ("analytic", "generic")
    }
    assert peaks["generic"]["backward"] == pytest.approx(peaks["analytic"]["backward"], rel=1e-3)
    held = peaks["generic"]["forward"] - peaks["analytic"]["forward"]
    assert held == pytest.approx(2 * 8192 * 2 * 256, rel=0.01)
