"""lit-gpt's QLoRA under Lightning's ``BitsandbytesPrecision``: the LM head is quantized like
every ``nn.Linear`` (lightning fabric/plugins/precision/bitsandbytes.py ``_convert_layers``, no
``ignore_modules`` from litgpt finetune/lora.py @43c44323), and every 4-bit weight is quantized
from an fp16 copy (``_Linear4bit.quantize``: ``.to(device=device, dtype=torch.half)``), so
bitsandbytes' ``MatMul4Bit`` dequantizes to fp16 and then casts to the compute dtype
(``F.dequantize_4bit(B, quant_state).to(A.dtype)``, bitsandbytes 0.42.0
autograd/_functions.py): both copies are alive at the cast.

Expected by hand for Llama-2-7B (V = 32,000, h = 4,096, the largest layer linear 11,008 x
4,096 = 45,088,768 elements):
* the head's nf4 storage: V h / 2 = 65,536,000 B of codes + 4 B x V h / 64 = 8,192,000 B of
  absmax = 73,728,000 B (bf16 it would be 262,144,000 B); nf4-dq: 65,536,000 + 2,048,000
  uint8 absmax + 4 x 2,048,000 / 256 = 32,000 B = 67,616,000 B;
* under 32-true (fp32 compute) the head's fp16 dequantization is 2 V h = 262,144,000 B and its
  cast 4 V h = 524,288,000 B; the layer's 90,177,536 B and 180,355,072 B; under 16-true the
  cast returns the fp16 tensor itself: no second copy.
"""

from __future__ import annotations

from trainmem.analytic.tensor_states import tensor_states
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

VH = 32_000 * 4_096
LAYER = 11_008 * 4_096


def _training(**kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "micro_batch_size": 1,
        "seq_len": 128,
        "precision": "bf16-true",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "quantize_base": "nf4",
        "framework": "litgpt",
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def _head_param_bytes(training: TrainingConfig) -> int:
    states = tensor_states(load_model_spec("llama-2-7b"), training)
    return next(s.param_bytes for s in states if s.name == "lm_head")


def test_litgpt_stores_its_lm_head_in_4_bits() -> None:
    assert _head_param_bytes(_training()) == VH // 2 + 4 * (VH // 64) == 73_728_000
    dq = VH // 2 + VH // 64 + 4 * (VH // 64 // 256)
    assert _head_param_bytes(_training(quantize_base="nf4-dq")) == dq == 67_616_000


def test_transformers_keeps_the_lm_head_unquantized() -> None:
    # fsdp_qlora builds a transformers model and keeps lm_head in the model dtype
    assert _head_param_bytes(_training(framework="fsdp-qlora")) == 2 * VH


def _dequant_pairs(training: TrainingConfig, module: str, n: int = 4) -> list[tuple[str, int]]:
    """(action, bytes) of the first ``n`` dequantization events in ``module``'s forward."""
    sched = estimate("llama-2-7b", training, engine="analytic", simulate_allocator=False)
    sizes = {2 * LAYER, 4 * LAYER, 2 * VH, 4 * VH}
    out = [
        (ev.action, ev.size_bytes)
        for ev in sched.schedules[0].events()
        if ev.module == module and ev.phase == "forward" and ev.size_bytes in sizes
    ]
    return out[:n]


def test_fp16_dequantization_is_alive_at_the_cast() -> None:
    fp32 = _training(precision="32-true")
    # fp16 made, the fp32 cast made, the fp16 freed, then (after the matmul) the cast
    assert _dequant_pairs(fp32, "layers.0") == [
        ("alloc", 2 * LAYER),
        ("alloc", 4 * LAYER),
        ("free", 2 * LAYER),
        ("free", 4 * LAYER),
    ]
    head = _dequant_pairs(fp32, "head")
    assert head[:3] == [("alloc", 2 * VH), ("alloc", 4 * VH), ("free", 2 * VH)]


def test_no_second_copy_when_the_compute_dtype_is_fp16() -> None:
    # 16-true: ``.to(torch.float16)`` of the fp16 dequantization is the same tensor
    assert _dequant_pairs(_training(precision="16-true"), "layers.0", 3) == [
        ("alloc", 2 * LAYER),
        ("free", 2 * LAYER),
        ("alloc", 2 * LAYER),  # the next iteration's forward
    ]


def test_head_backward_dequantizes_after_the_loss_backward() -> None:
    # Note [Quantized head after the loss's backward]: unchunked, t = 128 tokens; the log-
    # softmax (4 V t = 16,384,000 B) freed, then the bf16 logits gradient (2 V t = 8,192,000 B)
    # beside the head's fp16 dequantization and its bf16 cast (2 V h = 262,144,000 B each)
    sched = estimate("llama-2-7b", _training(), engine="analytic", simulate_allocator=False)
    head = [
        (ev.action, ev.size_bytes)
        for ev in sched.schedules[0].events()
        if ev.phase == "backward" and ev.module == "head"
    ]
    grad, vh = 2 * 32_000 * 128, 2 * VH
    start = head.index(("alloc", grad))
    assert ("free", 4 * 32_000 * 128) in head[:start]
    assert head[start : start + 6] == [
        ("alloc", grad),
        ("alloc", vh),
        ("alloc", vh),
        ("free", vh),
        ("free", vh),
        ("free", grad),
    ]
