"""A ViT config with a non-square ``image_size`` (issue 29, item 7): the formulas refuse it in
one line that names the path that models it, and that path feeds a [b, c, height, width] batch
(it fed a square one, and transformers raised "Input image size (224*224) doesn't match")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke

TINY_VIT = {
    "architectures": ["ViTForImageClassification"],
    "model_type": "vit",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_channels": 3,
    "num_labels": 10,
    "patch_size": 16,
    "image_size": [32, 64],
}


def _config(tmp_path: Path, image_size: object) -> str:
    path = tmp_path / f"vit-{json.dumps(image_size).strip('[]').replace(', ', 'x')}.json"
    path.write_text(json.dumps({**TINY_VIT, "image_size": image_size}))
    return str(path)


def test_the_formulas_refuse_in_one_line(invoke: Invoke, tmp_path: Path) -> None:
    result = invoke("estimate", _config(tmp_path, [32, 64]), "--engine", "analytic", exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("error: image_size: non-square 32x64"), err
    assert "--engine generic" in err


def test_a_malformed_image_size_is_a_spec_error(invoke: Invoke, tmp_path: Path) -> None:
    result = invoke("estimate", _config(tmp_path, [32, 64, 3]), exit_code=2)
    assert result.stderr.strip().startswith("error: image_size: "), result.stderr


def test_the_traced_batch_is_the_non_square_image() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")  # imported at collection (the end of this file)
    from transformers import ViTConfig, ViTForImageClassification

    from trainmem.trace.hf_model import make_hf_batch

    fields = {k: v for k, v in TINY_VIT.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = ViTForImageClassification(ViTConfig(**fields))
        batch = make_hf_batch(model, 2, 0)
        assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 64)
        model(**batch)  # transformers refused a square batch: "doesn't match model (32*64)"


try:  # the imports take seconds: pay them at collection, not in the test's time budget
    import transformers.models.vit.modeling_vit  # noqa: F401

    import trainmem.trace.hf_model  # noqa: F401
except ImportError:
    pass
