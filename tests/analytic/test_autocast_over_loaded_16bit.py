"""Autocast over a model loaded in 16 bits (``load_dtype``; ``TrainingConfig.
autocast_over_loaded_16bit``, issue 24): ``from_pretrained(..., torch_dtype=torch.bfloat16)``
with ``TrainingArguments(bf16=True)``.

Expected bytes by hand, tiny-llama-test (h 64, i 176, 2 layers, 4 heads of 16, 2 KV heads,
vocabulary 512, untied head):

* parameters: embedding and head 2 x 512 x 64 = 65,536; a layer q 4,096 + k 2,048 + v 2,048 +
  o 4,096 + gate / up / down 3 x 11,264 + two norms 128 = 46,208, twice; final norm 64:
  158,016 in all. Loaded in bf16: 2 B each, 316,032 B (fp32: 632,064 B).
* AdamW's exp_avg and exp_avg_sq in the parameter's dtype (torch/optim/adamw.py
  ``torch.zeros_like(p, memory_format=torch.preserve_format)``): 2 x 2 x 158,016 = 632,064 B
  (fp32 weights: 1,264,128 B).
* LoRA r 8 on q, v: 8 x (64 + 64) + 8 x (64 + 32) = 1,792 a layer, 3,584 in all, kept fp32 by
  peft (``autocast_adapter_dtype=True``, peft tuners/tuners_utils.py ``_cast_adapter_dtype``):
  parameters 316,032 + 4 x 3,584 = 330,368 B, AdamW states 2 x 4 x 3,584 = 28,672 B.
* no autocast copy of a 16-bit weight (aten/src/ATen/autocast_mode.cpp ``cached_cast`` casts
  only another dtype): a layer's weight copies are none for full fine-tuning (fp32 weights:
  2 x (4,096 + 2 x 2,048 + 4,096 + 3 x 11,264) = 92,160 B) and the adapters' bf16 casts only,
  2 x 1,792 = 3,584 B, under LoRA.
* the residual stream in bf16 (embedding and RMSNorm outputs in bf16): r = 2 (fp32 weights: 4).
"""

from __future__ import annotations

import pytest

from trainmem import estimate
from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.autocast import autocast_weight_copy_bytes
from trainmem.errors import SpecError
from trainmem.estimate import resolve_model
from trainmem.specs.training import TrainingConfig


def _training(load_dtype: object = "bfloat16", **fields: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "hf-trainer",
        "precision": "bf16-mixed",
        "micro_batch_size": 2,
        "seq_len": 128,
        "load_dtype": load_dtype,
        **fields,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("framework", ["hf-trainer", "pytorch-amp"])
def test_dtypes(framework: str) -> None:
    t = _training(framework=framework)
    assert t.autocast_over_loaded_16bit and t.uses_autocast
    assert (t.weight_dtype, t.grad_dtype, t.optimizer_state_dtype) == ("bfloat16",) * 3
    default = _training(None, framework=framework)
    assert not default.autocast_over_loaded_16bit
    assert (default.weight_dtype, default.grad_dtype) == ("float32", "float32")
    assert _training("float32").weight_dtype == "float32"


@pytest.mark.parametrize(
    ("lora_rank", "parameters", "optimizer_states"),
    [(0, 316_032, 632_064), (8, 330_368, 28_672)],
)
def test_model_states_bytes(lora_rank: int, parameters: int, optimizer_states: int) -> None:
    est = estimate(
        "tiny-llama-test",
        _training(lora_rank=lora_rank),
        engine="analytic",
        simulate_allocator=False,
    )
    assert est.breakdown.parameters == parameters
    assert est.breakdown.optimizer_states == optimizer_states
    fp32 = estimate("tiny-llama-test", _training(None), engine="analytic", simulate_allocator=False)
    assert (fp32.breakdown.parameters, fp32.breakdown.optimizer_states) == (632_064, 1_264_128)


def test_no_weight_copies_and_16bit_residual() -> None:
    model = resolve_model("tiny-llama-test")
    assert autocast_weight_copy_bytes(model, _training()) == 0
    assert autocast_weight_copy_bytes(model, _training(None)) == 92_160
    assert autocast_weight_copy_bytes(model, _training(lora_rank=8)) == 3_584
    assert compute_and_residual_bytes(_training()) == (2, 2)
    assert compute_and_residual_bytes(_training(None)) == (2, 4)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"framework": "deepspeed"}, "runs no torch.autocast"),
        ({"precision": "bf16-true"}, "runs no torch.autocast"),
        ({"load_dtype": "float16"}, "autocast computes in bfloat16"),
        ({"precision": "16-mixed", "load_dtype": "float16"}, "refuses fp16 gradients"),
        ({"quantize_base": "nf4", "lora_rank": 8}, "quantized base"),
        ({"zero_stage": 3, "data_parallel_size": 2}, "sharding"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, object], says: str) -> None:
    with pytest.raises(SpecError, match="load_dtype") as err:
        _training(**fields)
    assert says in str(err.value)
    # the allowed values offer the compute dtype only where the dtype alone was the mismatch:
    # bfloat16 under bf16-mixed over a quantized base is the value refused, not an alternative
    allowed = str(err.value).split("allowed here: ")[1].split(" (")[0]
    if "autocast computes in" in says:
        assert allowed == "float32 or bfloat16"
    else:
        assert allowed == "float32"


def test_fp16_lora_is_accepted() -> None:
    # GradScaler unscales the adapters' fp32 gradients only
    t = _training("float16", precision="16-mixed", lora_rank=8)
    assert t.weight_dtype == "float16"


def test_planner_proposals_drop_or_skip_the_load_dtype() -> None:
    from trainmem.planner.fixes import CHANGES, _apply
    from trainmem.specs.hardware import get_gpu

    model, gpu = resolve_model("tiny-llama-test"), get_gpu("A10G")
    by_name = {c.name: c for c in CHANGES}
    # pure 16-bit is a model in bf16 already: proposed without a load dtype beside it
    pure16 = by_name["pure 16-bit weights and optimizer states"]
    (true16,) = _apply(model, _training(), gpu, (pure16,))
    assert (true16.precision, true16.load_dtype) == ("bf16-true", None)
    # ZeRO-3 refuses a 16-bit load dtype (not modelled there): no proposal, and no error
    zero3 = by_name["ZeRO-3 / FSDP full-shard over N GPUs"]
    assert list(_apply(model, _training(), gpu, (zero3,))) == []
    assert list(_apply(model, _training(None), gpu, (zero3,)))  # fp32 weights: proposed
    # LoRA on the 16-bit model stays as loaded
    lora = next(_apply(model, _training(), gpu, (by_name["LoRA (rank 16)"],)))
    assert (lora.lora_rank, lora.load_dtype) == (16, "bfloat16")
