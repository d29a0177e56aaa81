"""LoRA's first layer (Note [LoRA's first layer], trainmem/analytic/lora.py): without activation
checkpointing nothing before layer 0's first adapters requires grad, so that layer saves less
than the others.

Hand derivation on tests/models/formula/qwen2.json (h = 64, 4 query heads and 2 kv heads of
16: q is 64 x 64, k and v 64 x 32; sequential pre-norm; fp32 residual under bf16 autocast, so
c = 2, r = 4) with peft's default targets q and v at rank 16, b = 4, s = 256 (t = 1024 tokens):

* the input RMSNorm records nothing: its input (r h t = 4 * 64 * 1024 = 262,144 B) and its
  fp32 statistics (4 t = 4,096 B) are not saved: the whole ``attention/norm`` term, 266,240 B;
* the frozen q, k, v keep no 16-bit weight copy (torchgen ``guard_for``: mm keeps ``mat2`` only
  for ``self``'s gradient, and their input needs none): 2 * (64*64 + 2 * 64*32) = 16,384 B;
* the two adapters' A (16 x 64) keep their input but not their weight copy: 2 * 2 * 16*64 =
  4,096 B;
* with ``lora_dropout > 0`` peft's dropout on the normed input keeps no mask: 64 * 1024 B for
  each of q and v;
* over a quantized base whose matmul saves its 16-bit input (int8), the q / k / v matmuls are
  not recorded either, so their saved inputs (``attention/qkv_input``) go too, and no frozen
  weight copy exists (the weight is dequantized inside): only the A copies, 4,096 B. Every
  other layer's A keeps its own autocast copy of the input beside the base matmul's:
  c * h * t = 2 * 64 * 1024 = 131,072 B for each of q and v (``lora/*_input_copy``).

Checked against the generic path (peft on the transformers model): this Qwen2 at b4 s256,
28,344,576 B analytic vs 28,344,696 B traced (was 28,631,296, -1.0 %); the wider 4-layer
Qwen2 of the session notes -1.4 % -> +0.04 %; Phi and GPT-NeoX (parallel blocks, whose
frozen MLP records nothing in layer 0) -7.1 % / -2.2 % -> 0.000 %.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.lora import first_layer_unsaved
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

FORMULA = Path(__file__).resolve().parents[1] / "models" / "formula"
T = 4 * 256
NORM = 4 * 64 * T + 4 * T  # attention/norm: the fp32 input and its statistics
COPIES = 2 * (64 * 64 + 2 * 64 * 32) + 2 * 2 * 16 * 64  # q/k/v copies + the two A copies


def _training(**kw: object) -> TrainingConfig:
    settings: dict[str, object] = {"micro_batch_size": 4, "seq_len": 256, "lora_rank": 16, **kw}
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def test_unsaved_terms_by_hand() -> None:
    qwen = load_model_spec(str(FORMULA / "qwen2.json"))
    got = first_layer_unsaved(qwen, _training())
    assert got is not None
    assert got.whole == ("attention/norm",)
    assert got.less == {"autocast_weight_copies": COPIES}
    dropout = first_layer_unsaved(qwen, _training(lora_dropout=0.1))
    assert dropout is not None
    assert dropout.less == {
        "lora/q_dropout": 64 * T,
        "lora/v_dropout": 64 * T,
        "autocast_weight_copies": COPIES,
    }
    # bf16-true: no autocast copies; only the norm goes
    true16 = first_layer_unsaved(qwen, _training(precision="bf16-true"))
    assert true16 is not None and true16.less == {}


def test_quantized_base_that_saves_its_input() -> None:
    qwen = load_model_spec(str(FORMULA / "qwen2.json"))
    got = first_layer_unsaved(qwen, _training(quantize_base="int8"))
    assert got is not None
    assert got.whole == ("attention/norm", "attention/qkv_input")
    assert got.less == {"autocast_weight_copies": 2 * 2 * 16 * 64}
    terms = layer_activation_terms(qwen, _training(quantize_base="int8"))
    assert terms["lora/q_input_copy"] == terms["lora/v_input_copy"] == 2 * 64 * T
    # with dropout A reads the dropout output (its own term), no second copy of the input
    dropout = layer_activation_terms(qwen, _training(quantize_base="int8", lora_dropout=0.1))
    assert "lora/q_input_copy" not in dropout
    # a current 4-bit matmul saves no input: A's input is the layer's one copy
    assert "lora/q_input_copy" not in layer_activation_terms(qwen, _training(quantize_base="nf4"))


def test_parallel_block_mlp_records_nothing() -> None:
    phi = load_model_spec(str(FORMULA / "phi.json"))  # one shared norm, fc1 / fc2
    got = first_layer_unsaved(phi, _training())
    assert got is not None
    assert got.whole == ("attention/norm", "mlp/")
    # q, k, v 64 x 64 each, fc1 64 x 128 and fc2 128 x 64, the A of q and v (16 x 64)
    assert got.less == {"autocast_weight_copies": 2 * (3 * 64 * 64 + 2 * 64 * 128 + 2 * 16 * 64)}
    # adapters on the MLP: its inputs need a gradient again (not modelled)
    assert first_layer_unsaved(phi, _training(lora_targets=("q", "v", "up"))) is None


@pytest.mark.parametrize(
    "settings",
    [
        {"activation_checkpointing": "full"},  # the hook makes the layer input require grad
        {"lora_rank": 0},
    ],
)
def test_not_applied(settings: dict[str, object]) -> None:
    qwen = load_model_spec(str(FORMULA / "qwen2.json"))
    assert first_layer_unsaved(qwen, _training(**settings)) is None


def _saved_at_forward_end(training: TrainingConfig) -> Counter[str]:
    est = estimate(str(FORMULA / "qwen2.json"), training, engine="analytic",
                   simulate_allocator=False)  # fmt: skip
    timeline = est.schedules[0].expand()
    live = {}
    for ev in timeline.events[timeline.steady_state_start :]:
        if ev.phase == "backward":
            break
        if ev.action == "alloc":
            live[ev.block_id] = ev
        else:
            live.pop(ev.block_id, None)
    out: Counter[str] = Counter()
    for ev in live.values():
        if ev.category.value == "activations":
            out[ev.module] += ev.size_bytes
    return out


def test_schedule_layer_zero_saves_less() -> None:
    saved = _saved_at_forward_end(_training())
    assert saved["layers.1"] - saved["layers.0"] == NORM + COPIES
    # every layer alike with checkpointing (the rule does not apply)
    full = _saved_at_forward_end(_training(activation_checkpointing="full"))
    assert full["layers.1"] == full["layers.0"]
