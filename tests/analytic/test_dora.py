"""peft's DoRA on the analytic path (issue 26, ``--lora-variant dora``): bytes by hand from
peft tuners/lora/dora.py (Note [DoRA], Note [DoRA forward transients] in
``analytic/lora_variants.py``) on a 2-layer Llama (tests/models/lora_variants/llama_h1024.json:
h 1024, 16 heads of 64, 4 KV heads -> v out 256, MLP 2816), b 2 x s 256 = 512 tokens, r 16,
bf16-mixed (c = 2 B, adapters fp32 = 4 B)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainmem.analytic.lora_variants import (
    dora_forward_transient_bytes,
    dora_recompute_down_held_bytes,
)
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "lora_variants" / "llama_h1024.json")
T = 2 * 256  # tokens
Q_OUT, V_OUT = 1024, 4 * 64
LAYERS = 2
LORA = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16, lora_targets=("q", "v"))
DORA = dataclasses.replace(LORA, lora_variant="dora")


def _analytic(training: TrainingConfig) -> object:
    return estimate(MODEL, training, engine="analytic", simulate_allocator=False).breakdown


def test_dora_magnitude_is_a_trainable_fp32_vector_per_targeted_linear() -> None:
    lora, dora = _analytic(LORA), _analytic(DORA)
    magnitude = (Q_OUT + V_OUT) * LAYERS  # DoraLinearLayer.weight: [out_features]
    assert dora.parameters - lora.parameters == 4 * magnitude  # type: ignore[attr-defined]
    # AdamW: exp_avg and exp_avg_sq, fp32
    assert dora.optimizer_states - lora.optimizer_states == 8 * magnitude  # type: ignore[attr-defined]


def test_dora_saves_the_base_and_adapter_outputs_and_three_vectors() -> None:
    # base_result and lora_result [t, out] in bf16 (autocast), weight_norm, mag_norm_scale and
    # mag_norm_scale - 1 [out] in fp32, per targeted linear and layer, but layer 0's q and v
    # read an input that needs no grad: no mag_norm_scale - 1 there (Note [LoRA's first
    # layer]); the peak is in the backward with every layer's saved tensors alive
    saved = LAYERS * ((2 + 2) * T * (Q_OUT + V_OUT) + 3 * 4 * (Q_OUT + V_OUT))
    saved -= 4 * (Q_OUT + V_OUT)
    states = 12 * (Q_OUT + V_OUT) * LAYERS  # magnitude + its two AdamW states
    lora, dora = _analytic(LORA), _analytic(DORA)
    assert dora.allocated_bytes - lora.allocated_bytes == saved + states  # type: ignore[attr-defined]


def test_dora_with_dropout_also_saves_the_relinear_weight() -> None:
    # lora_dropout: base_result = F.linear(dropout(x), weight) again; autocast's 16-bit cast of
    # the weight [out, in] is saved for the input gradient (dora.py DoraLinearLayer.forward)
    lora = _analytic(dataclasses.replace(LORA, lora_dropout=0.1))
    dora = _analytic(dataclasses.replace(DORA, lora_dropout=0.1))
    saved = LAYERS * ((2 + 2) * T * (Q_OUT + V_OUT) + 3 * 4 * (Q_OUT + V_OUT))
    saved -= 4 * (Q_OUT + V_OUT)  # layer 0: no mag_norm_scale - 1
    weights = (LAYERS - 1) * 2 * 1024 * (Q_OUT + V_OUT)  # layer 0: nor the re-linear weight
    states = 12 * (Q_OUT + V_OUT) * LAYERS
    assert dora.allocated_bytes - lora.allocated_bytes == saved + weights + states  # type: ignore[attr-defined]


def test_forward_transient_of_the_down_projection_by_hand() -> None:
    # all-linear: the largest is down_proj (in 2816, out 1024) at lora_B's matmul on the eye:
    # its bf16 input [t, 2816] and that input's fp32 cast, torch.eye(2816) fp32, its bf16 cast,
    # lora_A's [2816, 16] bf16 output and the [2816, 1024] bf16 product (the live tensors of
    # peft 0.21's forward on CPU under autocast, listed in Note [DoRA forward transients])
    i, o = 2816, 1024
    expected = 2 * T * i + 4 * T * i + 4 * i * i + 2 * i * i + 2 * i * 16 + 2 * i * o
    training = dataclasses.replace(DORA, lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
    spec = resolve_model(MODEL)
    assert dora_forward_transient_bytes(spec, training, adapter_bytes=4) == expected == 62_087_168


def test_checkpointed_dora_q_v_norm_sits_at_the_recompute_start() -> None:
    # full checkpointing: the recompute runs q / v's DoRA forward again at its start, beside
    # the checkpoint's input and the incoming gradient only (Note [DoRA's moments in the
    # recompute]), far below layer 1's MLP backward, where LoRA peaks too: DoRA adds there
    # only layer 1's recomputed DoRA tensors (base_result, lora_result in bf16, three fp32
    # [out] vectors, with dropout the re-linear's bf16 weight) and the magnitudes with their
    # AdamW states. Dropout on both: plain LoRA's recompute rule (Note [The recompute's
    # tensors held at an autocast down projection]) is for no dropout only.
    lora = _analytic(dataclasses.replace(LORA, activation_checkpointing="full", lora_dropout=0.1))
    dora = _analytic(dataclasses.replace(DORA, activation_checkpointing="full", lora_dropout=0.1))
    recomputed = (2 + 2) * T * (Q_OUT + V_OUT) + 3 * 4 * (Q_OUT + V_OUT)
    relinear = 2 * 1024 * (Q_OUT + V_OUT)
    states = 12 * (Q_OUT + V_OUT) * LAYERS
    assert dora.allocated_bytes - lora.allocated_bytes == recomputed + relinear + states  # type: ignore[attr-defined]


def test_recompute_holds_down_output_and_mlp_input_at_down_dora_norm() -> None:
    # peft 0.21.2 variants.py: DoraLinearVariant.forward adds the DoRA term to ``result``,
    # down's base output (bf16 [t, 1024] under autocast), made first; the MLP's input, the
    # second RMSNorm's fp32 output [t, 1024], is referenced by the layer's code until down
    # returns (gate / up save its bf16 cast, not it)
    spec = resolve_model(MODEL)
    all_linear = ("q", "k", "v", "o", "gate", "up", "down")
    full = dataclasses.replace(DORA, lora_targets=all_linear, activation_checkpointing="full")
    assert dora_recompute_down_held_bytes(spec, full, adapter_bytes=4) == [
        2 * T * 1024,
        4 * T * 1024,
    ]
    q_v = dataclasses.replace(DORA, activation_checkpointing="full")
    assert dora_recompute_down_held_bytes(spec, q_v, adapter_bytes=4) == []  # no DoRA on down
    none = dataclasses.replace(full, activation_checkpointing="none")
    assert dora_recompute_down_held_bytes(spec, none, adapter_bytes=4) == []  # no recompute


def test_bf16_true_q_moment_holds_the_saved_input_cast_by_hand() -> None:
    # bf16-true, no autocast, adapters fp32 (peft's autocast_adapter_dtype): peft 0.21.2
    # lora/layer.py Linear.forward makes ``result = self.base_layer(x)`` (bf16 [t, 1024]),
    # then ``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` (fp32 [t, 1024], saved by
    # lora_A later, not yet a block) before DoraLinearLayer.forward builds the norm: with the
    # bf16 input, the fp32 eye (4 in^2) and lora_A's [in, 16] output, then the norm's four fp32
    # [out, in] tensors (lora_weight, the weight's cast, scaling * lora_weight, the sum)
    t, i, o = T, 1024, 1024
    held = 2 * t * i + 4 * t * i + 4 * i * i + 4 * i * 16 + 2 * t * o
    expected = held + 4 * 4 * o * i
    training = dataclasses.replace(DORA, precision="bf16-true")
    spec = resolve_model(MODEL)
    got = dora_forward_transient_bytes(
        spec, training, adapter_bytes=4, linears=frozenset({"q"}), at_start=True
    )
    assert got == expected == 25_231_360


def test_dora_needs_a_rank_and_is_refused_where_the_formulas_stop() -> None:
    with pytest.raises(SpecError, match="lora_variant: dora is a kind of adapter"):
        TrainingConfig(lora_variant="dora")
    with pytest.raises(SpecError, match="lora_variant: unknown value 'dorra'"):
        TrainingConfig(lora_rank=8, lora_variant="dorra")
    head = dataclasses.replace(DORA, lora_targets=("q", "lm_head"))
    with pytest.raises(UnsupportedError, match="DoRA on lm_head .* use --engine generic"):
        estimate(MODEL, head, engine="analytic")
