"""Where DoRA's weight-norm moments sit in a layer (Note [DoRA's moment at each linear] in
``analytic/lora_variants.py``) and what LoRA's first layer leaves unsaved when its first adapters
come after q / k / v (Note [LoRA's first layer] in ``analytic/lora.py``): bytes by hand from
peft 0.21.2 tuners/lora/layer.py ``Linear.forward`` and tuners/lora/dora.py on a 2-layer Llama
(tests/models/lora_variants/llama_h1024.json: h 1024, 16 heads of 64, 4 KV heads -> k / v out
256, MLP 2816), b 2 x s 256 = 512 tokens, r 16, bf16-mixed (c = 2 B, adapters fp32 = 4 B)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from trainmem.analytic.lora import first_layer_unsaved
from trainmem.analytic.lora_variants import UP_LINEARS, dora_forward_transient_bytes
from trainmem.estimate import estimate, resolve_model
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "lora_variants" / "llama_h1024.json")
T, H, KV, INNER, R = 2 * 256, 1024, 256, 2816, 16
C, A = 2, 4  # bf16 compute, fp32 adapters
LAYERS = 2
BASE = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=R)


def _peak(training: TrainingConfig) -> int:
    est = estimate(MODEL, training, engine="analytic", simulate_allocator=False)
    return est.breakdown.allocated_bytes


def _ops(items: Sequence[Item]) -> Iterator[Op]:
    for item in items:
        if isinstance(item, Op):
            yield item
        else:
            assert isinstance(item, Repeat)
            yield from _ops(item.body)


def test_dora_on_o_under_full_checkpointing_keeps_loras_peak_at_down() -> None:
    # o's DoRA moment in the recompute runs where o runs, before the MLP's recomputed blocks
    # and copies (layer.o.recompute), so the peak stays LoRA's, at the recomputed frozen down
    # projection; DoRA adds there layer 1's recomputed DoRA tensors of o (base_result and
    # lora_result [t, 1024] in bf16, weight_norm / mag_norm_scale / mag_norm_scale - 1 [1024]
    # in fp32) and the magnitudes with their AdamW states (fp32, 3 x [1024] per layer).
    # Before: the o moment beside the whole recomputed layer set the peak (-5.3 % vs the trace)
    lora = dataclasses.replace(BASE, lora_targets=("o",), activation_checkpointing="full")
    dora = dataclasses.replace(lora, lora_variant="dora")
    recomputed = (C + C) * T * H + 3 * A * H
    states = 3 * A * H * LAYERS
    assert _peak(dora) - _peak(lora) == recomputed + states == 2_134_016


def test_up_moment_by_hand() -> None:
    # up (1024 -> 2816) at layer.mlp.up.*: its input, the second RMSNorm's fp32 output (peft's
    # cast to the fp32 adapters' dtype is the tensor itself; autocast's bf16 cast for the
    # frozen base's matmul was freed when that matmul returned: Note [DoRA's input at a norm's
    # reader]), the eye's bf16 cast (saved by lora_A's matmul) and lora_A's [1024, 16] output,
    # up's base output [t, 2816] (made before DoRA's branch, not yet a block); then the norm's
    # three fp32 [2816, 1024] tensors (lora_weight, scaling * lora_weight, the sum; the fp32
    # base weight is the parameter itself). The trace's moment in layer 1's recompute shows
    # the three 11,534,336 B tensors, the 2 MiB fp32 norm output (no cast of it) and the
    # 2.75 MiB base output. Before the Note: c t h + a t h, 1,048,576 B more.
    held = A * T * H + C * H * H + C * H * R + C * T * INNER
    expected = held + 3 * A * H * INNER
    training = dataclasses.replace(BASE, lora_targets=("gate", "up"), lora_variant="dora")
    got = dora_forward_transient_bytes(
        resolve_model(MODEL), training, adapter_bytes=A, linears=UP_LINEARS, at_start=True
    )
    assert got == expected == 41_713_664


def test_gate_up_moment_in_the_recompute_comes_before_downs_copy() -> None:
    # Llama's MLP runs down(act(gate(x)) * up(x)): at up's DoRA norm the recompute has made
    # the frozen gate and up copies (bf16 [2816, 1024]: up's base matmul runs first), not
    # down's (the last of the seven copies), nor up's own saved DoRA block
    training = dataclasses.replace(
        BASE, lora_targets=("gate", "up"), lora_variant="dora", activation_checkpointing="full"
    )
    est = estimate(MODEL, training, engine="analytic", simulate_allocator=False)
    keys = [op.key for op in _ops(est.schedules[0].step) if op.phase == "backward"]
    norm = keys.index("dora_norm")  # the first one of the backward: layer 1's up moment
    assert keys.index("wcopy/frozen/5") < norm < keys.index("wcopy/frozen/6")


def test_first_layer_with_adapters_on_o_only() -> None:
    # nothing in layer 0 requires grad before o's adapters: the input norm, the attention
    # core (q / k after RoPE, v, the SDPA output and logsumexp) record nothing, and the frozen
    # q, k, v and o keep no bf16 weight copy (their input needs no gradient), nor o's lora_A
    # its copy (r x 1024); o's input, saved by lora_A, stays (traced: layer 0 keeps 31,246,336 B
    # of layer 1's 43,880,472 B on the 1024-wide agreement Llama)
    training = dataclasses.replace(BASE, lora_targets=("o",))
    unsaved = first_layer_unsaved(resolve_model(MODEL), training)
    assert unsaved is not None
    assert set(unsaved.whole) >= {
        "attention/norm", "attention/q_k", "attention/v", "attention/sdpa_output",
        "attention/logsumexp",
    }  # fmt: skip
    assert "attention/out_proj_input" not in unsaved.whole and "mlp/norm" not in unsaved.whole
    copies = C * (H * H + 2 * H * KV + H * H) + C * R * H
    assert unsaved.less == {"autocast_weight_copies": copies} and copies == 5_275_648


def test_first_layer_with_adapters_on_the_mlp_only() -> None:
    # gate / up first: the attention's output projection input and the second norm's saved
    # input record nothing either, and the gate / up copies are not saved (their input needs
    # no grad); down first: nothing of the layer but down's adapters' input is saved (the
    # MLP's input, gate / act / up outputs), down's copy neither
    spec = resolve_model(MODEL)
    gate_up = first_layer_unsaved(spec, dataclasses.replace(BASE, lora_targets=("gate", "up")))
    assert gate_up is not None
    assert {"attention/out_proj_input", "mlp/norm"} <= set(gate_up.whole)
    assert "mlp/gated" not in gate_up.whole
    attention = C * (H * H + 2 * H * KV + H * H)
    assert gate_up.less == {"autocast_weight_copies": attention + 2 * C * H * INNER + 2 * C * R * H}
    down = first_layer_unsaved(spec, dataclasses.replace(BASE, lora_targets=("down",)))
    assert down is not None
    assert {"mlp/input", "mlp/gated"} <= set(down.whole)
    assert down.less == {"autocast_weight_copies": attention + 3 * C * H * INNER + C * R * INNER}
