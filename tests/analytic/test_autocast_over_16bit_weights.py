"""Autocast over 16-bit weights (Note [Autocast over 16-bit weights],
trainmem/analytic/activation_shapes.py): accelerate's ``native_amp`` autocast over the weights
FSDP1's ``MixedPrecision`` gathers in bf16 (``--framework accelerate-fsdp``, ``bf16-mixed``,
4 ranks). CUDA autocast runs ``layer_norm`` and ``pow`` in fp32 (aten/src/ATen/
autocast_mode.cpp), so a LayerNorm saves its fp32 cast of the bf16 input and returns fp32,
each linear reading it saves its own bf16 cast, and a written-out tanh GELU runs fp32 after
its ``pow``; RMSNorm models return bf16 and are unchanged.

Expected bytes by hand (tiny formula configs: h 64, i 128; b x s = 2 x 64 = 128 tokens, so
2 h T = 16,384 B):

* a LayerNorm's saved input and statistics: (4 h + 8) T = 33,792 B (bf16-true: (2 h + 8) T =
  17,408);
* phi (separate q, k, v and one norm feeding attention and MLP): q, k, v save 3 x 16,384 B of
  casts and fc1 its own 16,384 B (bf16-true: one shared normed output, 16,384 B, the MLP's
  input counted with q / k / v); the tanh GELU saves pow's fp32 input copy, tanh's output and
  1 + tanh in fp32 and 0.5 x and fc2's cast in bf16: (4 + 4 + 4 + 2 + 2) i T = 262,144 B
  (bf16-true: five bf16 tensors, 163,840 B);
* GPT-NeoX (two norms on one input, fused qkv): each norm saves its own fp32 cast, 33,792 B
  twice (bf16-true: the second norm shares the saved input, its statistics only, 8 T = 1,024).
"""

from __future__ import annotations

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.head import head_activation_bytes
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


def _training(precision: str, **fields: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "accelerate-fsdp",
        "micro_batch_size": 2,
        "seq_len": 64,
        "precision": precision,
        "data_parallel_size": 4,
        "zero_stage": 3,
        **fields,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def _model(name: str):  # type: ignore[no-untyped-def]
    return load_model_spec(str(MODELS_DIR / "formula" / f"{name}.json"))


def test_which_runs_autocast_over_16bit_weights() -> None:
    assert _training("bf16-mixed").autocast_over_16bit_weights
    assert not _training("bf16-true").autocast_over_16bit_weights
    # one GPU: FSDP1 gathers nothing in the formulas' terms (the weights stay fp32)
    assert not _training(
        "bf16-mixed", data_parallel_size=1, zero_stage=0
    ).autocast_over_16bit_weights
    # the HF Trainer's autocast is over fp32 weights (TrainingConfig.uses_autocast)
    assert not _training("bf16-mixed", framework="hf-trainer").autocast_over_16bit_weights


def test_phi_layer_norms_casts_and_gelu() -> None:
    phi = _model("phi")
    mixed, true = (layer_activation_terms(phi, _training(p)) for p in ("bf16-mixed", "bf16-true"))
    assert (mixed["attention/norm"], true["attention/norm"]) == (33_792, 17_408)
    assert (mixed["attention/qkv_input"], true["attention/qkv_input"]) == (3 * 16_384, 16_384)
    assert (mixed["mlp/input"], true["mlp/input"]) == (16_384, 0)
    assert (mixed["mlp/activation"], true["mlp/activation"]) == (262_144, 163_840)
    head = head_activation_bytes(phi, _training("bf16-mixed"))
    assert head["final_norm"] == 33_792 and head["lm_head_input"] == 16_384


def test_gpt_neox_second_norm_saves_its_own_cast() -> None:
    neox = _model("gpt_neox")
    mixed, true = (layer_activation_terms(neox, _training(p)) for p in ("bf16-mixed", "bf16-true"))
    assert (mixed["attention/norm"], mixed["mlp/norm"]) == (33_792, 33_792)
    assert (true["attention/norm"], true["mlp/norm"]) == (17_408, 1_024)
    assert mixed["attention/qkv_input"] == true["attention/qkv_input"] == 16_384  # fused qkv


def test_rms_norm_models_are_unchanged() -> None:
    qwen2 = _model("qwen2")
    mixed = layer_activation_terms(qwen2, _training("bf16-mixed"))
    true = layer_activation_terms(qwen2, _training("bf16-true"))
    assert mixed == true
