"""The synthetic batch's token ids (trainmem/trace/hf_inputs.py): text only, never a reserved
id of the config, the same each trace, and known to the forward (Note [Known values of a
synthetic batch])."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from trainmem.trace.hf_inputs import special_token_ids, token_ids  # noqa: E402
from trainmem.trace.known_values import value_of  # noqa: E402


def _llava_config() -> object:
    # a VLM whose image placeholder sits inside the text vocabulary (id 5 of 8)
    return transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 8, "pad_token_id": 0},
        image_token_id=5,
    )


def test_reserved_ids_come_from_the_config_and_its_sub_configs() -> None:
    cfg = _llava_config()
    assert {0, 5} <= special_token_ids(cfg)  # text_config's pad, the image placeholder


def test_ids_avoid_every_reserved_id_and_are_known_and_repeatable() -> None:
    cfg = _llava_config()
    reserved = special_token_ids(cfg)
    with FakeTensorMode():
        ids = token_ids(cfg, 8, (4, 64))
        again = token_ids(cfg, 8, (4, 64))
    value = value_of(ids)
    assert value is not None and value.shape == (4, 64)
    assert not any(int(v) in reserved for v in value.flatten())
    assert torch.equal(value, value_of(again))
    assert len(set(value.flatten().tolist())) > 1  # not one constant id
