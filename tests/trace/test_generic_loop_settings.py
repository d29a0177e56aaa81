"""The loop settings on the generic path (issue 26): a composed step (a few layers traced, the
middle one repeated) with the logits kept to the step's end or zero_grad before the backward
is the whole model's trace to the byte, as without them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """qwen2 with 6 layers: one more than the generic path keeps (trainmem.trace.blocks
    .COPIES), so it composes (5 traced, the middle one repeated)."""
    config = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    config["num_hidden_layers"] = 6
    path = tmp_path_factory.mktemp("qwen2") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def plain_bytes(config_path: str) -> int:
    """The generic path's peak without the loop settings (traced once for the module)."""
    training = TrainingConfig(micro_batch_size=4, seq_len=256)
    return estimate(config_path, training, engine="generic").breakdown.allocated_bytes


@pytest.mark.parametrize(
    "settings",
    [{"keep_logits": True}, {"zero_grad_before_backward": True}],
    ids=["keep-logits", "zero-grad-before-backward"],
)
def test_composed_step_equals_the_whole_trace(
    settings: dict, config_path: str, plain_bytes: int
) -> None:
    training = TrainingConfig(micro_batch_size=4, seq_len=256, **settings)
    generic = estimate(config_path, training, engine="generic", simulate_allocator=False)
    whole = estimate(config_path, training, engine="trace", simulate_allocator=False)
    runs = generic.details["generic"]["block_lists"]
    assert runs and runs[0]["units"] > runs[0]["units_traced"]  # composed, not traced whole
    assert generic.breakdown.allocated_bytes == whole.breakdown.allocated_bytes
    assert generic.breakdown.allocated_bytes != plain_bytes
