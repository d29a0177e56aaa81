"""torchvision's VisionTransformer (``model_type: torchvision_vit``): the attention is torch's
``nn.MultiheadAttention`` with one packed in-projection, the bytes derived by hand from its code.

Source: torchvision/models/vision_transformer.py ``EncoderBlock.forward`` (``x, _ =
self.self_attention(x, x, x, need_weights=False)``, ``batch_first=True``); torch 2.0 / 2.1
torch/nn/functional.py ``multi_head_attention_forward``: ``_in_projection_packed`` runs one
``linear(q, in_proj_weight [3h, h], in_proj_bias)``; after SDPA,
``attn_output.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)`` feeds
``out_proj``. The kernel's output is (b, s, a, d)-contiguous, so the (s, b, a, d) permutation is
a copy for b > 1, which the output projection saves (c h bytes a token) beside the kernel's own
saved output; for b = 1 it is a view.

ViT-L/16 at 224 px: h = 1024, 197 tokens an image (196 patches + [CLS]).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.params import num_parameters
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

H, S = 1024, 197
PRESET = Path(__file__).parents[2] / "src/trainmem/specs/presets/vit-large-patch16-224.json"


def _model(tmp_path: Path, model_type: str, num_labels: int = 10):  # type: ignore[no-untyped-def]
    config = {**json.loads(PRESET.read_text()), "model_type": model_type, "num_labels": num_labels}
    path = tmp_path / f"{model_type}-{num_labels}" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    return load_model_spec(str(path))


def _training(b: int, precision: str) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=b, seq_len=S, precision=precision, optimizer="adam", attention="sdpa"
    )


def test_torchvision_vit_l_16_has_torchvisions_parameter_count(tmp_path: Path) -> None:
    # torchvision's ViT_L_16_Weights.IMAGENET1K_V1 meta: num_params 304,326,632; the rows'
    # Linear(1024, 10) head has 990 x 1025 fewer
    assert num_parameters(_model(tmp_path, "torchvision_vit", 1000)) == 304_326_632
    assert num_parameters(_model(tmp_path, "torchvision_vit")) == 304_326_632 - 990 * 1025


@pytest.mark.parametrize(("b", "copied"), [(16, True), (1, False)])
def test_the_output_projection_saves_the_permuted_copy(
    tmp_path: Path, b: int, copied: bool
) -> None:
    terms = layer_activation_terms(_model(tmp_path, "torchvision_vit"), _training(b, "bf16-true"))
    t = b * S
    assert terms["attention/sdpa_output"] == 2 * H * t  # the kernel's saved output
    assert terms.get("attention/out_proj_input", 0) == (2 * H * t if copied else 0)


def test_hf_vit_output_projection_takes_a_view(tmp_path: Path) -> None:
    # transformers' ViTSelfAttention: ``context_layer.transpose(1, 2)`` of the (b, s, a, d)
    # kernel output is contiguous, the reshape a view
    terms = layer_activation_terms(_model(tmp_path, "vit"), _training(16, "bf16-true"))
    assert "attention/out_proj_input" not in terms


def test_one_packed_in_projection_saves_one_autocast_copy(tmp_path: Path) -> None:
    t = 64 * S
    mixed = _training(64, "16-mixed")
    # one linear: autocast casts the (fp32) normed input once, and the matmul saves the fp16
    # contiguous copy of that transposed cast (c h a token); transformers' ViT casts it for
    # each of its query, key and value linears (3 c h)
    packed = layer_activation_terms(_model(tmp_path, "torchvision_vit"), mixed)
    separate = layer_activation_terms(_model(tmp_path, "vit"), mixed)
    assert packed["attention/qkv_input"] == 2 * H * t
    assert separate["attention/qkv_input"] == 3 * 2 * H * t


def test_the_traced_engines_refuse_torchvision(tmp_path: Path) -> None:
    from trainmem.errors import UnsupportedError
    from trainmem.estimate import estimate

    model = _model(tmp_path, "torchvision_vit")
    for engine in ("trace", "generic"):
        with pytest.raises(UnsupportedError, match="analytic engine only"):
            estimate(model, _training(2, "bf16-true"), engine=engine)
