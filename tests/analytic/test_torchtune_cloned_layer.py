"""torchtune before 0.3 builds one decoder layer on the GPU and deep-copies it per layer (Note
[torchtune's cloned layer at load] in trainmem/analytic/load.py).

Source: torchtune @fef3ed1 models/llama2/_component_builders.py ``lora_llama2`` (the layer, then
the embedding and the output projection, then ``TransformerDecoder(layer=layer,
num_layers=...)``), modules/transformer.py ``_get_clones`` (``copy.deepcopy``);
recipes/lora_finetune_single_device.py ``_setup_model`` (built under ``self._device``).

Llama-2-7B, LoRA r = 8 on q and v, bf16 (2 B per value), by hand:
* the model: 6,738,415,616 base weights + 32 x 2 x (8 x 4096 + 4096 x 8) = 4,194,304 adapter
  weights = 6,742,609,920 values, 13,485,219,840 bytes;
* one layer: q, k, v, o 4 x 4096 x 4096 = 67,108,864; gate, up, down 3 x 4096 x 11008 =
  135,266,304; two norms 2 x 4096; the adapters of q and v 131,072: 202,514,432 values,
  405,028,864 bytes.
The QLoRA tutorial (docs/source/tutorials/qlora_finetune.rst @fef3ed1) logs this config's init
peak at 13.96 GB allocated: the two above are 13.89 GB, each layer's RoPE cache (not counted
here) the rest.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.analytic.load import CLONE_RULE, load_rule
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

MODEL_BYTES = 13_485_219_840
LAYER_BYTES = 405_028_864


def _lora(**settings: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "torchtune",
        "torchtune_version": "0.1.0",
        "micro_batch_size": 2,
        "seq_len": 512,
        "precision": "bf16-true",
        "activation_checkpointing": "full",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
    }
    return TrainingConfig(**{**base, **settings})  # type: ignore[arg-type]


def test_the_load_peaks_at_the_model_and_the_built_layer() -> None:
    est = estimate("llama-2-7b", _lora(), engine="analytic", simulate_allocator=False)
    sched = est.schedules[0]
    assert sched.model_states()["parameters"] == MODEL_BYTES
    assert sched.load_peak() == MODEL_BYTES + LAYER_BYTES
    assert est.details["assumed"]["load"] == CLONE_RULE


def test_the_step_is_the_one_without_the_load() -> None:
    loaded = estimate("llama-2-7b", _lora(), engine="analytic", simulate_allocator=False)
    plain = estimate(
        "llama-2-7b", _lora(load_phase=False), engine="analytic", simulate_allocator=False
    )
    assert loaded.schedules[0].peak() == plain.schedules[0].peak()


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        ({}, CLONE_RULE),
        ({"torchtune_version": "0.2.1"}, CLONE_RULE),  # v0.2.1 still clones
        ({"lora_rank": 0, "lora_targets": ()}, CLONE_RULE),  # full_finetune_single_device
        ({"torchtune_version": "0.3.0"}, None),  # from b74f4b49 it depends on the family
        ({"torchtune_version": None}, None),  # the default release, 0.6.1
        ({"data_parallel_size": 2, "zero_stage": 3}, None),  # built on the CPU / meta device
        ({"framework": "pytorch-amp"}, None),
        ({"load_phase": False}, None),
    ],
)
def test_which_runs_have_the_rule(settings: dict[str, object], rule: str | None) -> None:
    assert load_rule(replace(_lora(), **settings)) == rule  # type: ignore[arg-type]
