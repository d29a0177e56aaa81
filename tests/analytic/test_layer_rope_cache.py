"""Each decoder layer's own rotary tables under older transformers releases
(``ModelSpec.layer_rope_cache_values``, ``trainmem.analytic.buffers.layer_rope_cache_bytes``).

Bytes by hand from transformers' code: modeling_llama.py 4.38.2-4.40.0 ``LlamaRotaryEmbedding``
registers ``_cos_cached`` and ``_sin_cached`` of (max_position_embeddings, head_dim) in the
default dtype, one module per ``LlamaAttention`` (``_init_rope``); 4.41.2 registers none;
modeling_mistral.py up to 4.41.2 ``cos_cached`` / ``sin_cached`` alike, none in 4.42.4.

* Llama-2-70B: 2 x 4096 x 128 = 1,048,576 values a layer (4 MiB in fp32).
* Mistral-7B-v0.1: 2 x 32768 x 128 = 8,388,608 values a layer (32 MiB in fp32).
* a 2-layer Llama of width 64 (4 heads: head_dim 16) and 256 positions: 2 x 256 x 16 = 8,192
  values a layer; 2 x 8,192 x 4 B = 65,536 B over both layers in fp32, 32,768 B in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_LLAMA
from trainmem.analytic.buffers import layer_rope_cache_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


@pytest.mark.parametrize(
    ("preset", "version", "values"),
    [
        ("llama-2-70b", (4, 39, 3), 2 * 4096 * 128),
        ("llama-2-70b", (4, 40, 0), 1_048_576),
        ("llama-2-70b", (4, 41, 0), 0),
        ("mistral-7b-v0.1", (4, 41, 2), 2 * 32768 * 128),
        ("mistral-7b-v0.1", (4, 42, 0), 0),
    ],
)
def test_values_per_layer_by_release(preset: str, version: tuple[int, ...], values: int) -> None:
    assert load_model_spec(preset).layer_rope_cache_values(version) == values


def test_the_dtype_is_the_one_the_model_was_built_in() -> None:
    llama = load_model_spec("llama-2-70b")
    old = {"transformers_version": "4.39.3"}
    qlora = {**old, "quantize_base": "nf4", "lora_rank": 8}
    # fsdp_qlora's from_config(cfg): the fp32 default dtype, 4 MiB a layer
    fsdp_qlora = TrainingConfig(framework="fsdp-qlora", precision="bf16-true", **qlora)  # type: ignore[arg-type]
    assert layer_rope_cache_bytes(llama, fsdp_qlora) == 4 * 1_048_576 == 4_194_304
    # a QLoRA script's from_pretrained(torch_dtype=bf16), under autocast too
    hf = TrainingConfig(framework="hf-trainer", precision="bf16-mixed", **qlora)  # type: ignore[arg-type]
    assert layer_rope_cache_bytes(llama, hf) == 2 * 1_048_576
    # an unquantized model in its weights' dtype: fp32 under bf16-mixed, bf16 when bf16-true
    mixed = TrainingConfig(framework="hf-trainer", precision="bf16-mixed", **old)  # type: ignore[arg-type]
    true = TrainingConfig(framework="hf-trainer", precision="bf16-true", **old)  # type: ignore[arg-type]
    assert layer_rope_cache_bytes(llama, mixed) == 4 * 1_048_576
    assert layer_rope_cache_bytes(llama, true) == 2 * 1_048_576
    # not transformers' model code, or a current release: none
    tune = TrainingConfig(framework="torchtune", precision="bf16-true", **old)  # type: ignore[arg-type]
    assert layer_rope_cache_bytes(llama, tune) == 0
    assert layer_rope_cache_bytes(llama, TrainingConfig(transformers_version="4.41.2")) == 0


def _allocated(config: Path, **fields: object) -> int:
    training = TrainingConfig(micro_batch_size=1, seq_len=64, **fields)  # type: ignore[arg-type]
    est = estimate(str(config), training, engine="analytic", simulate_allocator=False)
    return est.breakdown.allocated_bytes


def test_the_tables_stay_through_the_step(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    plain = {"precision": "bf16-true"}
    assert (
        _allocated(config, transformers_version="4.40.0", **plain)
        - _allocated(config, transformers_version="4.41.0", **plain)
        == 2 * (2 * 256 * 16) * 2
        == 32_768
    )
    # fsdp_qlora (FSDP1 over 2 ranks, its load phase first): each layer unit's tables are
    # moved to the GPU with it and kept, never sharded nor offloaded (fp32: 65,536 B)
    fsdp = {
        "framework": "fsdp-qlora",
        "precision": "bf16-true",
        "quantize_base": "nf4",
        "lora_rank": 8,
        "data_parallel_size": 2,
        "zero_stage": 3,
        "offload": "optimizer+params",
    }
    assert (
        _allocated(config, transformers_version="4.40.0", **fsdp)
        - _allocated(config, transformers_version="4.41.0", **fsdp)
        == 2 * (2 * 256 * 16) * 4
        == 65_536
    )
