"""torchtitan's cross-entropy, eager (0.0.2, Dec 2024) and compiled (0.1 on): the bytes of Note
[torchtitan's compiled cross-entropy] derived by hand from torchtitan's source.

Source: torchtitan/components/loss.py at e7c0cae (version.txt 0.1.0, June 2025):
``cross_entropy_loss`` is ``F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``
and ``build_cross_entropy_loss`` wraps it in ``torch.compile`` when ``training.compile`` (since
bbb1b616e, PR #1033); train.py at 9dec370 (version.txt 0.0.2) left it eager ("TODO: compiling
loss function causes CUDA errors"). Both loops ``del pred`` before ``loss.backward()``.

llama-3.1-8b (V = 128256), b = 2, s = 8192: t = 16384 tokens, bf16 logits (c = 2 B), FSDP 32.
"""

from __future__ import annotations

import pytest

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    torchtitan_compiled_loss,
)
from trainmem.errors import SpecError
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, T = 128256, 16384
MODEL = load_model_spec("llama-3.1-8b")


def _training(version: str | None, **kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "micro_batch_size": 2,
        "seq_len": 8192,
        "precision": "bf16-mixed",
        "activation_checkpointing": "selective",
        "data_parallel_size": 32,
        "zero_stage": 3,
        "framework": "fsdp2",
        "compile": True,
        "torchtitan_version": version,
    }
    base.update(kw)
    return TrainingConfig(**base)  # type: ignore[arg-type]


def test_torchtitan_0_1_compiled_loss_keeps_the_logits_and_two_row_statistics() -> None:
    training = _training("0.1")
    assert torchtitan_compiled_loss(MODEL, training)
    head = head_activation_bytes(MODEL, training)
    # the compiled graph saves its input, the bf16 logits (2 B x V a token), and the row max and
    # log-sum-exp (fp32, 4 B each a token); no fp32 log-softmax
    assert head["chunk_logits"] == 2 * V * T == 4_202_692_608
    assert head["chunk_row_stats"] == 8 * T
    assert "log_softmax" not in head
    # the logits are the saved input itself; inductor never writes the fp32 upcast
    assert loss_forward_transient_bytes(MODEL, training) == 0
    # backward: one bf16 gradient of the logits, written while the saved logits are alive
    assert loss_backward_transient_bytes(MODEL, training) == 2 * V * T


def test_torchtitan_0_0_2_runs_the_loss_eager() -> None:
    training = _training(None)  # default: 0.0.2, the Dec 2024 tree
    assert training.torchtitan_release == (0, 0, 2)
    assert not torchtitan_compiled_loss(MODEL, training)
    head = head_activation_bytes(MODEL, training)
    assert head["log_softmax"] == 4 * V * T  # log_softmax's fp32 output, saved
    # forward: the bf16 logits and their fp32 copy; backward: two fp32 gradients
    assert loss_forward_transient_bytes(MODEL, training) == (2 + 4) * V * T
    assert loss_backward_transient_bytes(MODEL, training) == 2 * 4 * V * T


@pytest.mark.parametrize(
    "kw",
    [
        {"compile": False},  # nothing to compile
        {"tensor_parallel_size": 2, "data_parallel_size": 16},  # loss parallel: DTensor logits
        {"pipeline_parallel_size": 2, "data_parallel_size": 16},  # the loss inside the schedule
        {"chunked_cross_entropy": 4},  # a chunked loss is the torchtune rule's
    ],
)
def test_the_compiled_torchtitan_loss_needs_its_conditions(kw: dict[str, object]) -> None:
    assert not torchtitan_compiled_loss(MODEL, _training("0.1", **kw))


def test_other_frameworks_ignore_the_torchtitan_version() -> None:
    training = _training("0.1", framework="pytorch-amp", zero_stage=0, data_parallel_size=1)
    assert not torchtitan_compiled_loss(MODEL, training)


def test_a_torchtitan_version_must_be_a_version() -> None:
    with pytest.raises(SpecError, match="torchtitan_version"):
        _training("june")
