"""ChatGLM's own ``quantize(bits)`` (``--quantize-base chatglm-int8 | chatglm-int4``) on the
generic path (Note [ChatGLM's quantize] in trainmem/trace/chatglm_quantized.py).

Expected numbers by hand from THUDM/chatglm3-6b quantization.py (``QuantizedLinear``: an int8
weight of [out, in * bits / 8] and a 16-bit scale of [out]; ``W8A16Linear``: the 16-bit weight
rebuilt in forward and backward, the input saved, a full 16-bit ``grad_weight`` made in every
backward) and the tiny ChatGLM config's shapes.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR, storage_peak
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

TINY_CHATGLM = str(MODELS_DIR / "remote_code" / "tiny-chatglm-test.json")


def _stand_in(quantize: str) -> Any:
    """A trainable fp16 Linear(16 -> 64) before a frozen fp16 Linear(64 -> 32) with a bias,
    quantized by ChatGLM's quantize."""
    from trainmem.trace.quantized import quantize_base

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 32)).half()
    model[1].requires_grad_(False)
    training = TrainingConfig(quantize_base=quantize, num_virtual_tokens=1, precision="16-true")
    assert quantize_base(model, training, diffusers=True, model_type="chatglm") == 1
    return model


@pytest.mark.parametrize(("quantize", "packed"), [("chatglm-int8", 2_112), ("chatglm-int4", 1_088)])
def test_the_stand_in_stores_the_int8_weight_and_a_16_bit_scale(quantize: str, packed: int) -> None:
    # [32, 64 * bits / 8] int8 + 32 fp16 scales: 2,048 + 64 (int8), 1,024 + 64 (int4)
    model = _stand_in(quantize)
    assert model[1].weight.dtype == torch.uint8 and model[1].weight.numel() == packed
    assert model[1].bias.dtype == torch.float16 and not model[1].weight.requires_grad
    assert model[0].weight.requires_grad


@pytest.mark.parametrize("quantize", ["chatglm-int8", "chatglm-int4"])
def test_the_backward_makes_a_full_gradient_of_the_frozen_weight(quantize: str) -> None:
    """A real CPU step (x: 3 x 16 fp16, made before it), storages by hand in bytes, as
    conftest's counter sees them: Linear0's weight (64 x 16 fp16, 2,048), whose transposed
    view addmm saves (the counter counts a view's storage when an op returns it); forward:
    h = Linear0(x) 384; the rebuilt weight 4,096 (int8: its cast 4,096 too, freed after the
    scaled product); mm 192; + bias 192 (the mm freed); W8A16Linear saves h (its 2-D view),
    so h lives to the backward; sum 2. Backward: the root gradient 2 (the output of + bias
    gone); the weight rebuilt (int8: cast + product, 8,192 at once); sum's gradient is an
    expanded view, so ``grad_output.contiguous()`` copies it (192); grad_input 384;
    grad_weight, 32 x 64 fp16 = 4,096, beside the rebuilt weight:
    2,048 + 384 + 2 + 2 + 4,096 + 192 + 384 + 4,096 = 11,204, above the int8 forward's
    2,048 + 384 + 8,192 = 10,624 and the int8 rebuild's 10,628 (without the weight's gradient
    the int8 step would peak there)."""
    model = _stand_in(quantize)
    x = torch.ones(3, 16, dtype=torch.float16)

    def step() -> None:
        model(x).sum().backward()

    assert storage_peak(step) == 11_204
    assert model[1].weight.grad is None  # the gradient was made and dropped
    assert model[0].weight.grad is not None


def test_the_tiny_chatglm_stores_its_four_linears_quantized() -> None:
    # tiny ChatGLM: hidden 64, 4 heads x 16, 2 key/value groups, ffn 96, 2 layers. Linears per
    # layer (out x in): query_key_value 128 x 64, dense 64 x 64, dense_h_to_4h 192 x 64,
    # dense_4h_to_h 64 x 96: 30,720 values, 448 output rows. fp16: 2 x 30,720 x 2 = 122,880 B;
    # int8: 2 x (30,720 + 2 x 448) = 63,232 B; int4: 2 x (15,360 + 896) = 32,512 B
    def params(quantize: str) -> int:
        t = TrainingConfig(
            micro_batch_size=2, seq_len=32, num_virtual_tokens=8, precision="16-true",
            quantize_base=quantize,
        )  # fmt: skip
        est = estimate(TINY_CHATGLM, t, engine="generic", simulate_allocator=False)
        return int(est.breakdown.parameters)

    fp16 = params("none")
    assert fp16 - params("chatglm-int8") == 122_880 - 63_232
    assert fp16 - params("chatglm-int4") == 122_880 - 32_512


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"lora_rank": 8}, "quantize_base"),  # peft cannot wrap its QuantizedLinear
        ({}, "quantize_base"),  # a frozen base: needs virtual tokens
        ({"num_virtual_tokens": 8, "precision": "bf16-mixed"}, "precision"),
        ({"num_virtual_tokens": 8, "precision": "32-true"}, "precision"),
    ],
)
def test_settings_it_does_not_run_with_name_the_field(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        TrainingConfig(quantize_base="chatglm-int4", **{"precision": "16-true", **settings})
    assert err.value.field == field


def test_a_model_without_chatglm_quantize_is_refused() -> None:
    t = TrainingConfig(
        micro_batch_size=2, seq_len=32, num_virtual_tokens=8, precision="16-true",
        quantize_base="chatglm-int8",
    )  # fmt: skip
    with pytest.raises(SpecError, match="model_type chatglm") as err:
        estimate("tiny-llama-test", t, engine="generic", simulate_allocator=False)
    assert err.value.field == "quantize_base"
