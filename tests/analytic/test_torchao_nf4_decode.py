"""torchao's NF4 decode in torchtune's eager QLoRA, traced: the trace's quantized-linear
stand-in allocates ``get_original_weight()``'s tensors in its order (trainmem/trace/quantized.py
``_torchao_decode``), whose peak the analytic engine counts
(``trainmem.analytic.buffers.torchao_nf4_dequantize_bytes``; the bytes by hand in
tests/analytic/test_torchao_dequantize.py).

Source: torchao dtypes/nf4tensor.py ``get_original_weight``, ``dequantize_scalers``,
``LinearNF4`` (v0.1 .. v0.10); torchtune modules/peft/lora.py @fef3ed1 ``linear_nf4``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig


def _qlora(**settings: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "torchtune",
        "micro_batch_size": 1,
        "seq_len": 64,
        "precision": "bf16-true",
        "optimizer": "adamw",
        "activation_checkpointing": "none",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "quantize_base": "nf4",
        "load_phase": False,
    }
    return TrainingConfig(**{**base, **settings})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "decodes"),
    [
        ({}, True),
        ({"quantize_base": "nf4-dq"}, True),
        ({"compile": True}, False),  # the decode is compiled into the graph
        ({"framework": "pytorch-amp", "precision": "bf16-mixed"}, False),  # bitsandbytes
        ({"quantize_base": "int8"}, False),
    ],
)
def test_which_runs_decode(settings: dict[str, object], decodes: bool) -> None:
    assert _qlora(**settings).torchao_nf4_decode is decodes


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 4096,
    "max_position_embeddings": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "vocab_size": 512,
}


@pytest.mark.slow  # ~9-15 s on 2 cores; the bytes are checked by hand in test_torchao_dequantize
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_generic_trace_decodes_alike(tmp_path: Path) -> None:
    # MLP 256 x 4096 (n = 1,048,576): the decode (14n + n/32, 14.7 MB) sets the backward's
    # peak; with the stand-in's single 2n weight the trace would be 12n (12.6 MB) lower
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    peaks = {
        engine: estimate(str(path), _qlora(), engine=engine, simulate_allocator=False)
        .schedules[0]
        .phase_peaks()
        for engine in ("analytic", "generic")
    }
    assert peaks["generic"]["backward"] == pytest.approx(peaks["analytic"]["backward"], rel=1e-3)
