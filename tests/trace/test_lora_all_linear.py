"""``--lora-targets all-linear`` on a model whose layers have no attention q / k / v / o to
name (a ConvNeXt): every linear but the output layer, as peft's ``target_modules="all-linear"``
adapts them; checked against peft itself run on the CPU. A model peft refuses that way (Mamba's
``out_proj``) gets peft's reason as one line, and the default q,v targets say what works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

CONVNEXT = {
    "model_type": "convnext",
    "architectures": ["ConvNextForImageClassification"],
    "num_channels": 3,
    "hidden_sizes": [8, 16],
    "depths": [1, 1],
    "num_stages": 2,
    "image_size": 32,
    "id2label": {"0": "a", "1": "b"},
    "label2id": {"a": 0, "b": 1},
}


@pytest.fixture
def convnext(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(CONVNEXT))
    return str(tmp_path)


def test_all_linear_on_a_cnn_adapts_what_peft_adapts(convnext: str) -> None:
    import peft
    import torch
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    model = ConvNextForImageClassification(ConvNextConfig(**CONVNEXT))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    expected = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    # by hand: pwconv1 / pwconv2 of each stage and the classifier, r (in + out) each:
    # 8 (8 + 32) x 2 + 8 (16 + 64) x 2 + 8 (16 + 2) = 2,064
    assert expected == 2_064
    lora = ("q", "k", "v", "o", "gate", "up", "down")  # what all-linear expands to here
    est = estimate(convnext, TrainingConfig(lora_rank=8, lora_targets=lora))
    assert est.engine == "generic"
    assert est.num_trainable_parameters == expected


def test_q_v_on_a_cnn_names_all_linear(convnext: str) -> None:
    with pytest.raises(UnsupportedError, match="--lora-targets all-linear"):
        estimate(convnext, TrainingConfig(lora_rank=8))
