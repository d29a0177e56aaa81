"""torchao's NF4 dequantization in torchtune's QLoRA step (eager): ``LinearNF4`` calls
``weight.to(input.dtype)`` in forward and backward, i.e. ``NF4Tensor.get_original_weight``,
whose locals (the nibbles widened to int64, their bf16 lookups, the scaled halves, the stacked
result) are all alive when it stacks. Source: torchao v0.1 dtypes/nf4tensor.py (unchanged in
v0.12.0).

llama-3.1-8b's largest linear: 14336 x 4096 = 58,720,256 elements (n); n / 2 = 29,360,128.
"""

from __future__ import annotations

from trainmem.analytic.buffers import dequantized_weight_bytes, torchao_nf4_dequantize_bytes
from trainmem.analytic.tensor_states import state_layout
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

N = 14336 * 4096


def test_get_original_weight_peak_by_hand() -> None:
    half = N // 2
    first_second = 2 * 8 * half  # (quantized_data >> 4).to(torch.long), (... & 0b1111)
    lookups = 2 * 2 * half  # nf4[first], nf4[second], bf16
    scalers = 2 * (N // 64)  # dequantize_scalers, bf16, one per 64-block
    scaled = 2 * 2 * half  # dequantized_* x repeated.flatten()
    stacked = 2 * N  # torch.stack([...], dim=-1), bf16
    assert first_second + lookups + scalers + scaled + stacked == 14 * N + N // 32
    assert torchao_nf4_dequantize_bytes(N) == 823_918_592


def test_only_torchtunes_eager_nf4_base() -> None:
    model = load_model_spec("llama-3.1-8b")
    kw = {"precision": "bf16-true", "lora_rank": 8, "quantize_base": "nf4-dq"}

    def size(**extra: object) -> int:
        t = TrainingConfig(**{**kw, **extra})  # type: ignore[arg-type]
        return dequantized_weight_bytes(state_layout(model, t).layer, t)

    assert size(framework="torchtune") == 823_918_592
    # compiled: the chain is fused, the bf16 weight alone; bitsandbytes: dequantize_4bit's
    assert size(framework="torchtune", compile=True) == 2 * N
    assert size(framework="hf-trainer") == 2 * N
