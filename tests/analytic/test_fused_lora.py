"""LoRA on fused modules (issue 26): peft adapts the module it targets, so a fused gate / up
(Phi-3 ``gate_up_proj``, ChatGLM ``dense_h_to_4h``) gets one ``lora_A`` (r x h) and one
``lora_B`` (2i x r), not two of each (peft tuners/lora/layer.py ``LoraLayer.update_layer``;
:func:`trainmem.analytic.params.adapted_linears`).

Phi-3-mini by hand (its preset: h = 3072, i = 8192, 32 heads of 96, no GQA, 32 layers), r = 8,
every linear targeted: qkv_proj 8 x (3072 + 3 x 3072) = 98,304; o_proj 8 x (3072 + 3072) =
49,152; gate_up_proj 8 x (3072 + 2 x 8192) = 155,648; down_proj 8 x (8192 + 3072) = 90,112;
393,216 per layer (separate gate and up adapters would add one A, 8 x 3072 = 24,576).
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.analytic.lora import lora_adapter_elements
from trainmem.analytic.params import adapted_linears, lora_targeted
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def test_a_fused_gate_up_gets_one_adapter() -> None:
    spec = load_model_spec("phi-3-mini-4k")
    assert spec.fused_gate_up and spec.fused_qkv
    training = TrainingConfig(lora_rank=8, lora_targets=ALL)
    assert lora_adapter_elements(spec, training) == 393_216
    separate = replace(spec, fused_gate_up=False)
    assert lora_adapter_elements(separate, training) == 393_216 + 24_576


def test_either_part_targets_the_fused_module() -> None:
    spec = load_model_spec("phi-3-mini-4k")
    assert adapted_linears(spec)["gate_up"] == (3072, 2 * 8192, 1)
    assert lora_targeted("gate_up", ("up",)) and lora_targeted("gate_up", ("gate",))
    assert not lora_targeted("gate_up", ("q", "v", "down"))
    only_up = TrainingConfig(lora_rank=8, lora_targets=("up",))
    assert lora_adapter_elements(spec, only_up) == 155_648
