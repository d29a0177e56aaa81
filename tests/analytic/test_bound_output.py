"""The ``previous`` loop's binding of the current micro-batch's output (Note [The current
micro-batch's bound output], trainmem/analytic/transforms/loop.py): a plain loop's ``outputs =
model(**batch); loss = outputs.loss; loss.backward()`` (peft's and accelerate's examples)
keeps the output through its own backward, and the last micro-batch's through
``optimizer.step()``.

Expected bytes by hand on the 2-layer Qwen2 formula config (h 64, 4 heads of 16, 2 key/value
heads, V 512) at b 2 x s 64 = 128 tokens:

* the output the loop binds: under the HF Trainer's accelerate at bf16-mixed its fp32 copy of
  the logits, 4 x 512 x 128 = 262,144 B; under pytorch-amp at bf16-true the bf16 logits,
  2 x 512 x 128 = 131,072 B;
* the KV cache the output returns (transformers builds one in training): 2 layers x (k, v) x
  2 heads x 16 x 128 tokens x 2 B (bf16 under autocast) = 32,768 B.

Held constantly over the whole backward and the optimizer step, they raise those phases' peaks
by exactly their bytes over the ``drop`` loop (which frees both at the loss).
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
FP32_LOGITS = 4 * 512 * 128
BF16_LOGITS = 2 * 512 * 128
CACHE = 2 * 2 * 2 * 16 * 128 * 2


HF_AMP = {
    "framework": "hf-trainer",
    "micro_batch_size": 2,
    "seq_len": 64,
    "precision": "bf16-mixed",
    "gradient_accumulation_steps": 2,
}


def _training(**fields: object) -> TrainingConfig:
    return TrainingConfig(**{**HF_AMP, **fields})  # type: ignore[arg-type]


def _phases(training: TrainingConfig, engine: str = "analytic") -> dict[str, int]:
    est = estimate(QWEN2, training, engine=engine, simulate_allocator=False)
    return dict(est.details["phase_peaks_bytes"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "held"),
    [({}, FP32_LOGITS + CACHE), ({"framework": "pytorch-amp", "precision": "bf16-true"}, None)],
)
def test_the_backward_and_the_step_hold_the_bound_output(fields: dict, held: int | None) -> None:
    previous, dropped = (
        _phases(_training(loop="previous", **fields)),
        _phases(_training(loop="drop", **fields)),
    )
    # bf16-true: the bf16 logits; its cache aliases the k / v the attention saves (no block)
    assert previous["backward"] - dropped["backward"] == (held or BF16_LOGITS)
    assert previous["optimizer"] - dropped["optimizer"] == (held or BF16_LOGITS)


@pytest.mark.slow  # two traces; the analytic tests above are the fast representatives
def test_the_trace_runs_the_binding() -> None:
    # the traced loop holds the output object itself: its logits, cache and the 4-byte loss
    pytest.importorskip("torch")
    previous = _phases(_training(loop="previous"), "trace")
    dropped = _phases(_training(loop="drop"), "trace")
    assert previous["backward"] - dropped["backward"] == FP32_LOGITS + CACHE + 4


def test_the_step_loop_holds_the_output_and_its_cache_to_the_step_end() -> None:
    # the step function's ``outputs`` (logits and KV cache) until it returns, one micro-batch
    step = _phases(_training(loop="step", gradient_accumulation_steps=1))
    dropped = _phases(_training(loop="drop", gradient_accumulation_steps=1))
    assert step["backward"] - dropped["backward"] == FP32_LOGITS + CACHE
    assert step["optimizer"] - dropped["optimizer"] == FP32_LOGITS + CACHE
