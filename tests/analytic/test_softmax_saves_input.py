"""torch before 1.11 saves the softmax's input beside its output (autograd's formula for
``_softmax``: ``_softmax_backward_data(grad, result, dim, self)``; transformers 4.21.0
pytorch_utils.py ``softmax_backward_data`` passes ``self`` when ``is_torch_less_than_1_11``,
``self.dtype`` after), so eager attention keeps its pre-softmax scores too.

Bytes by hand, the 2-layer BERT formula config (4 heads) at b x s = 2 x 64: one layer's scores
are 4 x 64 x 64 x 2 = 32,768 values; under autocast the softmax runs in fp32 (its input cast
first): 131,072 B more per layer on torch 1.10; in bf16 without autocast 65,536 B.
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.estimate import trace_unsupported_settings
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

BERT = str(MODELS_DIR / "formula" / "bert.json")
SCORES = 4 * 64 * 64 * 2


def _terms(**fields: object) -> dict[str, int]:
    settings = {"micro_batch_size": 2, "seq_len": 64, "attention": "eager", **fields}
    return layer_activation_terms(load_model_spec(BERT), TrainingConfig(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "per_value"), [("16-mixed", 4), ("32-true", 4), ("bf16-true", 2)]
)
def test_torch_1_10_saves_the_scores_before_the_softmax(precision: str, per_value: int) -> None:
    old = _terms(precision=precision, torch_version="1.10")
    assert old["scores/softmax_input"] == per_value * SCORES
    assert old["scores/softmax"] == per_value * SCORES  # the output, in the same dtype
    assert "scores/softmax_input" not in _terms(precision=precision, torch_version="1.11")


def test_the_traced_paths_run_it() -> None:
    # they were refused (the installed torch's autograd saves the output only); the trace now
    # keeps the input as the older release did (Note [Softmax saving its input before torch
    # 1.11], trainmem/trace/older_softmax.py; tests/trace/test_older_softmax.py)
    old = TrainingConfig(attention="eager", torch_version="1.10")
    assert not any("softmax" in r for r in trace_unsupported_settings(old))
