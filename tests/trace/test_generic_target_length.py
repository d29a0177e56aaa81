"""The generic path's batch of an encoder-decoder: the decoder reads ``--target-seq-len``."""

from __future__ import annotations

from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig
from trainmem.trace.hf_model import build_hf_model


def test_the_generic_path_feeds_t5_the_target_length() -> None:
    # Found checking issue 26's cross-attention lengths: the generic path's batch took
    # labels [b, seq_len] whatever --target-seq-len said (the trace engine's passed it), so a
    # T5 run with 1,024 source and 128 target tokens was traced at 1,024 target tokens
    from conftest import MODELS_DIR
    from trainmem.trace.generic import recipe_for_config

    raw = dict(load_hf_config(str(MODELS_DIR / "t5.json")))
    training = TrainingConfig(micro_batch_size=2, seq_len=64, target_seq_len=16)
    recipe = recipe_for_config("t5", raw, training)
    batch = recipe.make_batch(build_hf_model(raw))
    assert tuple(batch["input_ids"].shape) == (2, 64)
    assert tuple(batch["labels"].shape) == (2, 16)
