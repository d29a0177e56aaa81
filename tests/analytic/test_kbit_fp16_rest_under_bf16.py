"""A quantized base whose other weights stay fp16 under bf16 autocast (issue 24, helper
bnbgap; Note [A quantized base's other weights in another 16-bit dtype] in
trainmem/specs/training.py): transformers forces float16 on a bitsandbytes model loaded with
no ``torch_dtype`` (4.36.2 modeling_utils.py ``from_pretrained``), as ms-swift @4312aeb loads
Qwen-1 for its bnb cells, which then train under the Trainer's bf16 autocast.

Hand-derived from the sources for tests/models/formula/qwen2.json (h = 64, V = 512, untied
head, separate q / k / v, gated MLP) at 2 x 64 tokens (t = 128), nf4 with bitsandbytes 0.41.3,
no peft k-bit preparation, LoRA on q / v with dropout:

* the LM head's fp16 weight is cast to bf16 by autocast (``cached_cast`` casts another dtype;
  a frozen weight is not cached) and the matmul saves the cast for the input gradient:
  2 * V * h = 65,536 B, none when the rest is bf16 (already the compute dtype);
* each base ``Linear4bit`` casts its fp16 input itself (bitsandbytes 0.41.3 nn/modules.py
  ``x = x.to(self.compute_dtype)``) and ``MatMul4Bit`` keeps that copy (``ctx.tensors = (A,
  B)``): three bf16 copies of the attention norm's output (q, k, v) and two of the MLP
  norm's (gate, up), 2 * h * t = 16,384 B each; a bf16 norm output is the tensor every base
  linear keeps, once;
* flash-attn takes the fp16 q / k / v as they are (transformers casts only fp32 ones:
  integrations/flash_attention.py ``get_target_dtype``) and returns fp16, so the output
  projection's ``Linear4bit`` casts that too and keeps its bf16 copy, beside the kernel's own
  saved fp16 output: 2 * a * d * t = 16,384 B a layer (both layers: the attention output
  requires grad from q's and v's adapters on), where a bf16 rest's output projection keeps
  the kernel's output itself;
* the weights' bytes are the same (2 a value).

The generic path traces the same (the rest loaded in fp16, each stand-in casting its output
back to its fp16 input's dtype as ``Linear4bit.forward`` does, ``out.to(inp_dtype)``).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.head import head_activation_bytes
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig
from trainmem.traced_quantized import quantized_base_refusals

PATH = str(MODELS_DIR / "formula" / "qwen2.json")
MODEL = load_model_spec(PATH)
COPY = 2 * 64 * 128
HEAD_COPY = 2 * 512 * 64


def _nf4(**changes: Any) -> TrainingConfig:
    base: dict[str, Any] = {
        "framework": "hf-trainer",
        "micro_batch_size": 2,
        "seq_len": 64,
        "lora_rank": 16,
        "lora_targets": ("q", "v"),
        "lora_dropout": 0.05,
        "quantize_base": "nf4",
        "bitsandbytes_version": "0.41.3",
        "precision": "bf16-mixed",
        "prepare_kbit_training": False,
        "attention": "flash",
    }
    return TrainingConfig(**{**base, **changes})


def test_the_rest_in_fp16_is_accepted_where_it_stays_as_loaded() -> None:
    fp16 = _nf4(load_dtype="float16")
    assert fp16.kbit_dense_cast and fp16.kbit_dense_dtype == "float16"
    kept = _nf4()
    assert not kept.kbit_dense_cast and kept.kbit_dense_dtype == "bfloat16"
    assert not fp16.autocast_over_loaded_16bit  # the unquantized model's rule does not apply
    # peft's k-bit preparation upcasts the rest to fp32: no 16-bit load to model there
    with pytest.raises(SpecError, match="load_dtype") as info:
        _nf4(load_dtype="float16", prepare_kbit_training=True)
    assert "allowed here: float32" in str(info.value)
    # SDPA under autocast returns bf16, and the fp16 + bf16 residual add turns fp32
    with pytest.raises(SpecError, match="--attention flash"):
        _nf4(load_dtype="float16", attention="sdpa")


def test_the_fp16_head_weight_is_cast_and_saved() -> None:
    assert head_activation_bytes(MODEL, _nf4(load_dtype="float16"))["autocast_weight_copies"] == (
        HEAD_COPY
    )
    assert "autocast_weight_copies" not in head_activation_bytes(MODEL, _nf4())


def test_each_base_linear_keeps_its_own_bf16_copy_of_an_fp16_input() -> None:
    fp16 = layer_activation_terms(MODEL, _nf4(load_dtype="float16"))
    kept = layer_activation_terms(MODEL, _nf4())
    assert (fp16["attention/qkv_input"], fp16["mlp/input"]) == (3 * COPY, 2 * COPY)
    assert (kept["attention/qkv_input"], kept["mlp/input"]) == (COPY, COPY)
    # a = 4 heads of d = 16: the output projection's own bf16 copy of flash's fp16 output
    assert fp16["attention/out_proj_input"] == 2 * 4 * 16 * 128 == COPY
    assert kept.get("attention/out_proj_input", 0) == 0


def test_same_weight_bytes_and_the_difference_in_the_estimate() -> None:
    runs = [
        estimate(PATH, t, engine="analytic", simulate_allocator=False)
        for t in (_nf4(), _nf4(load_dtype="float16"))
    ]
    assert runs[0].breakdown.parameters == runs[1].breakdown.parameters
    # no checkpointing: both layers keep theirs, but the first layer's q / k / v save no
    # input (the frozen embedding's output needs no gradient, so MatMul4Bit keeps
    # ``(None, None)``): its MLP's two copies for one and the output projection's copy, the
    # second layer's three for one, two for one and the output projection's, beside the
    # head's weight copy
    layers = (2 - 1 + 1) * COPY + (3 - 1 + 2 - 1 + 1) * COPY
    assert runs[1].breakdown.activations - runs[0].breakdown.activations == layers + HEAD_COPY


@pytest.mark.slow  # two traces (~25 s on a loaded machine); the stand-in's run on real CPU
# tensors is fast: tests/trace/test_traced_quantized.py
def test_the_traced_paths_run_it() -> None:
    # the same difference on the generic path's trace (the stand-in's own copies)
    assert quantized_base_refusals(_nf4(load_dtype="float16")) == []
    traced = [
        estimate(PATH, t, engine="generic", simulate_allocator=False).breakdown
        for t in (_nf4(), _nf4(load_dtype="float16"))
    ]
    layers = (2 - 1 + 1) * COPY + (3 - 1 + 2 - 1 + 1) * COPY
    assert traced[1].activations - traced[0].activations == layers + HEAD_COPY
    assert traced[0].parameters == traced[1].parameters


def test_bitsandbytes_before_0_43_dequantizes_through_fp16() -> None:
    # bitsandbytes 0.41.3 ``Params4bit.cuda`` quantizes ``self.data.contiguous().half()``
    # (QuantState.dtype float16), 0.43.0 ``_quantize`` the weight as loaded: under bf16
    # ``MatMul4Bit`` then has an fp16 dequantization (2 B a value) beside its bf16 cast
    from trainmem.analytic.buffers import dequantize_cast_bytes

    n = 64 * 128  # the MLP's gate weight
    assert dequantize_cast_bytes(n, _nf4()) == 2 * n
    assert dequantize_cast_bytes(n, _nf4(bitsandbytes_version="0.42.0")) == 2 * n
    assert dequantize_cast_bytes(n, _nf4(bitsandbytes_version="0.43.0")) == 0
    assert dequantize_cast_bytes(n, _nf4(precision="16-mixed")) == 0  # the cast is a no-op
    assert dequantize_cast_bytes(n, _nf4(quantize_base="int8")) == 0
