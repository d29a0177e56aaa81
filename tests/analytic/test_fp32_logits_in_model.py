"""transformers' Llama / Mistral code before 4.46 / 4.48 upcasts its logits in the model
(``logits = logits.float()`` in ``LlamaForCausalLM.forward``, 4.38.2-4.45.2; in
``MistralForCausalLM.forward``, 4.39.3-4.47.0), so the output a loop binds holds them in fp32;
and the loss's shifted copy (``shift_logits = logits[..., :-1, :].contiguous()``, before 4.49)
is a tensor of its own beside that upcast.

Bytes by hand, a 2-layer Llama of width 64 with V = 512 at b x s = 2 x 64 (T = 128 tokens):
the fp32 logits 4 x 512 x 128 = 262,144 B, the bf16 logits 131,072 B, the shifted copy
4 x 512 x 2 x 63 = 258,048 B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_LLAMA
from trainmem.analytic.held_outputs import output_logits_bytes
from trainmem.analytic.loss import shifted_copy_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

FP32, BF16, SHIFTED = 4 * 512 * 128, 2 * 512 * 128, 4 * 512 * 2 * 63


@pytest.fixture
def tiny(tmp_path: Path) -> str:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    return str(config)


@pytest.mark.parametrize(
    ("preset", "version", "fp32"),
    [
        ("llama-2-7b", (4, 40, 0), True),
        ("llama-2-7b", (4, 45, 2), True),
        ("llama-2-7b", (4, 46, 0), False),
        ("mistral-7b-v0.1", (4, 47, 0), True),
        ("mistral-7b-v0.1", (4, 48, 0), False),
        ("gpt2", (4, 40, 0), False),  # its loss runs on the 16-bit logits
    ],
)
def test_which_releases_return_fp32_logits(
    preset: str, version: tuple[int, ...], fp32: bool
) -> None:
    assert load_model_spec(preset).returns_fp32_logits(version) is fp32


def _training(version: str, **fields: object) -> TrainingConfig:
    settings = {"micro_batch_size": 2, "seq_len": 64, "precision": "bf16-true", **fields}
    return TrainingConfig(transformers_version=version, **settings)  # type: ignore[arg-type]


def test_the_bound_output_holds_fp32_logits_before_4_46(tiny: str) -> None:
    model = load_model_spec(tiny)
    assert output_logits_bytes(model, _training("4.40.0")) == FP32 == 262_144
    assert output_logits_bytes(model, _training("4.46.0")) == BF16 == 131_072
    # the step loop frees the output it holds after the optimizer step
    est = estimate(tiny, _training("4.40.0", loop="step"), engine="analytic")
    events = est.timeline.events
    sizes = {e.block_id: e.size_bytes for e in events if e.action == "alloc"}
    held = [e for e in events if e.action == "free" and e.phase == "optimizer"]
    assert FP32 in {sizes[e.block_id] for e in held}


def test_the_shifted_copy_is_its_own_block(tiny: str) -> None:
    model = load_model_spec(tiny)
    assert shifted_copy_bytes(model, _training("4.40.0")) == SHIFTED == 258_048
    assert shifted_copy_bytes(model, _training("4.49.0")) == 0  # labels shifted, no copy
    est = estimate(tiny, _training("4.40.0"), engine="analytic")
    head = {
        e.size_bytes
        for e in est.timeline.events
        if e.action == "alloc" and e.module == "head" and e.phase == "forward"
    }
    # the bf16 logits, the upcast and the shifted copy, three allocations (not one of 520,192)
    assert {BF16, FP32, SHIFTED} <= head
    assert FP32 + SHIFTED not in head
