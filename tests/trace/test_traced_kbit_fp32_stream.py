"""A 4-bit base on a 16-bit model that peft upcast to fp32, without autocast (``bf16-true``
under a framework that calls ``prepare_model_for_kbit_training``: Note [peft's fp32 upcast of a
16-bit quantized model] in trainmem/trace/quantized.py).

Hand derivation from the sources: peft 0.21.2 utils/other.py casts every bf16 parameter that is
not a ``Params4bit`` to fp32; bitsandbytes 0.45.0 nn/modules.py ``Linear4bit.forward`` casts its
input to the compute dtype, multiplies by the dequantized weight in that dtype and returns
``.to(inp_dtype)``. So the residual stream and every op but the quantized matmuls are fp32 (the
activations of a 32-true step), and at the down projection of the agreement model (2-layer
2048-wide Llama, i = 5,632, 2 x 256 = 512 tokens, nf4 LoRA r16 on q / v, bitsandbytes 0.45: no
saved input) the forward holds, beside the saved blocks and the 2 x 5632 x 2048 = 23,068,672 B
bf16 weight: down's bf16 output 2 x 512 x 2048 = 2,097,152 B, the bf16 cast of its input
2 x 512 x 5632 = 5,767,168 B, its fp32 input ``act(gate) * up`` 4 x 512 x 5632 = 11,534,336 B,
the MLP's fp32 input 4 x 512 x 2048 = 4,194,304 B and, from layer 1 on, ``inputs_embeds``
(4,194,304 B: the frozen embeddings' output, which layer 0's norm does not save). The residual
and the layer's input are the norms' saved inputs (``x.to(float32)`` of an fp32 tensor is the
tensor itself).
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import activation_profile
from trainmem.analytic.forward_transients import down_projection_held_bytes
from trainmem.analytic.transforms.checkpointing import first_norm_saves_its_input
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER = 2 * 256, 2048, 5632
QLORA_BF16 = {"lora_rank": 16, "quantize_base": "nf4", "precision": "bf16-true"}


def test_the_stand_in_casts_its_output_back_to_the_fp32_input() -> None:
    from trainmem.trace.quantized import quantize_base

    # a bf16 model: a trainable Linear(16 -> 64) before a frozen Linear(64 -> 32)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 32, bias=False))
    model.to(torch.bfloat16)
    model[1].weight.requires_grad_(False)
    training = TrainingConfig(lora_rank=1, quantize_base="nf4", precision="bf16-true")
    assert training.kbit_fp32_stream
    assert quantize_base(model, training, diffusers=True) == 1
    # peft's upcast: the trainable linear fp32; the quantized one a uint8 packed weight
    assert model[0].weight.dtype == torch.float32 and model[0].bias.dtype == torch.float32
    assert model[1].weight.dtype == torch.uint8
    seen: list[torch.dtype] = []
    saved: list[int] = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    x = model[0](torch.ones(3, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model[1](x)
    # fp32 in, fp32 out (``.to(inp_dtype)``); MatMul4Bit saves nothing from 0.43.2 on
    assert seen == [torch.float32] and out.dtype == torch.float32
    assert saved == []
    out.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.float32


def test_under_autocast_or_in_the_compute_dtype_the_output_is_left_as_made() -> None:
    # autocast (not modelled by either engine yet) and a 16-bit stream: no cast back
    for precision, changes in (("bf16-mixed", {}), ("bf16-true", {"prepare_kbit_training": False})):
        training = TrainingConfig(lora_rank=1, quantize_base="nf4", precision=precision, **changes)
        assert not training.kbit_fp32_stream


def _held(first_layer: bool) -> list[int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **QLORA_BF16)  # type: ignore[arg-type]
    model = resolve_model(AGREEMENT)
    return down_projection_held_bytes(
        model,
        training,
        activation_profile(model, training).terms,
        input_saved=first_norm_saves_its_input(model, training),
        first_layer=first_layer,
        has_embedding=True,
    )


def test_held_tensors_at_the_down_projection_by_hand() -> None:
    out16, cast16, product, x, embeds = (
        2 * T * H,
        2 * T * INTER,
        4 * T * INTER,
        4 * T * H,
        4 * T * H,
    )
    assert (out16, cast16, product) == (2_097_152, 5_767_168, 11_534_336)
    assert _held(False) == [out16, cast16, product, x, embeds]
    assert _held(True) == [out16, cast16, product, x]  # layer 0's input is inputs_embeds


def test_activations_are_those_of_a_32_true_step() -> None:
    # every saved tensor is fp32 on both engines: the same activation bytes as 32-true
    def activations(precision: str, engine: str) -> int:
        training = TrainingConfig(
            micro_batch_size=2, seq_len=256, **{**QLORA_BF16, "precision": precision}
        )
        est = estimate(AGREEMENT, training, engine=engine, simulate_allocator=False)
        return est.breakdown.activations

    fp32 = activations("32-true", "analytic")
    assert activations("bf16-true", "analytic") == fp32
    # the generic path (refused before) traces peft's upcast and bitsandbytes' cast back
    assert abs(activations("bf16-true", "generic") - fp32) <= 64
