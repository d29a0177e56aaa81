"""The loop settings on the generic path (issue 26): a composed step (a few layers traced, the
middle one repeated) with the logits kept to the step's end or zero_grad before the backward
is the whole model's trace to the byte, as without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402


@pytest.mark.parametrize(
    "settings",
    [{"keep_logits": True}, {"zero_grad_before_backward": True}],
    ids=["keep-logits", "zero-grad-before-backward"],
)
def test_composed_step_equals_the_whole_trace(settings: dict, tmp_path: Path) -> None:
    config = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    config["num_hidden_layers"] = 9  # deep enough that the generic path composes
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    training = TrainingConfig(micro_batch_size=4, seq_len=256, **settings)
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    whole = estimate(str(path), training, engine="trace", simulate_allocator=False)
    runs = generic.details["generic"]["block_lists"]
    assert runs and runs[0]["units"] > runs[0]["units_traced"]  # composed, not traced whole
    assert generic.breakdown.allocated_bytes == whole.breakdown.allocated_bytes
    plain = estimate(str(path), TrainingConfig(micro_batch_size=4, seq_len=256), engine="generic")
    assert generic.breakdown.allocated_bytes != plain.breakdown.allocated_bytes
