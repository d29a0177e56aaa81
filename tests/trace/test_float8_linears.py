"""What a layer of torchao float8 linears saves, eager and compiled, with and without tensor
parallelism: traced and analytic, against bytes derived by hand.

tiny-llama-test (h = 64, 2 layers, intermediate i = 176, 4 heads of 16 (a d = 64), 2 KV heads),
b = 2, s = 48 (t = 96 tokens), ``framework="fsdp2"`` on 2 FSDP ranks (bf16 compute, c = 2, no
autocast), no dropout. Every linear is a ``Float8Linear`` (all dimensions are multiples of 16).
The figure is one layer's activations under ``fp8-mixed`` minus the same under ``bf16-mixed``
(everything else in the layer is the same tensors), from Note [Float8 tensor-parallel inputs]
and Note [Compiled float8 linears] (trainmem/analytic/float8.py):

- eager, no TP: ``Float8Linear`` saves its bf16 input (``matmul_with_hp_or_float8_args``):
  0 B;
- eager, TP 2 + SP: q/k/v and gate/up keep one all-gathered float8 [t, h] each instead of the
  bf16 one: 2 * (1 - 2) * h t; o keeps a float8 copy of its [t, a d / 2] input beside the
  attention output: + a d t / 2; down keeps its float8 [t, i / 2] input, not the bf16 one:
  (1 - 2) * i t / 2. -12,288 + 3,072 - 8,448 = -17,664 B;
- eager, TP 2 without SP: each column-parallel linear casts the replicated input itself:
  q, k, v three float8 copies (3 h t) for one bf16 (2 h t), gate and up two (2 h t) for one
  (2 h t); o and down as above: 6,144 + 0 + 3,072 - 8,448 = 768 B;
- compiled, no TP: the min-cut recasts q/k/v's, gate/up's and down's inputs in backward, so
  the bf16 compile rule's normed inputs (2 * 2 h t) and down input (2 i t) go, and o's float8
  input (a d t) is kept: -24,576 + 6,144 - 33,792 = -52,224 B;
- compiled, TP 2 + SP: the all-gathered and the all-reduced-amax casts are kept as in eager:
  -17,664 B;
- compiled, TP 2 without SP: q/k/v's and gate/up's casts have a local amax and are recast
  (-2 * 2 h t); o and down as with SP: -24,576 + 3,072 - 8,448 = -29,952 B.

The trace also keeps float8's fp32 amax / scale scalars (4 B each, a few per linear), which the
formulas leave out: the traced figure is the hand one plus at most 128 B.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

H, FFN, AD, T = 64, 176, 64, 96  # h, i, a d, tokens
TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
TP2 = {"tensor_parallel_size": 2}
CASES = [
    ("eager", {}, False, 0),
    ("eager TP 2 + SP", TP2_SP, False, 2 * (1 - 2) * H * T + AD * T // 2 + (1 - 2) * FFN * T // 2),
    ("eager TP 2", TP2, False, (3 - 2) * H * T + (2 - 2) * H * T + AD * T // 2 - FFN * T // 2),
    ("compiled", {}, True, -2 * 2 * H * T + AD * T - 2 * FFN * T),
    (
        "compiled TP 2 + SP",
        TP2_SP,
        True,
        2 * (1 - 2) * H * T + AD * T // 2 + (1 - 2) * FFN * T // 2,
    ),
    ("compiled TP 2", TP2, True, -2 * 2 * H * T + AD * T // 2 - FFN * T // 2),
]
SCALARS_BYTES = 128


def _layer_bytes(engine: str, precision: str, parallel: dict[str, object], compiled: bool) -> int:
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=48,
        precision=precision,  # type: ignore[arg-type]
        framework="fsdp2",
        data_parallel_size=2,
        zero_stage=3,
        compile=compiled,
        dropout=False,
        **parallel,  # type: ignore[arg-type]
    )
    est = estimate("tiny-llama-test", training, engine=engine, simulate_allocator=False)
    if engine == "analytic":
        return int(est.details["activations_per_layer_bytes"])
    acts = est.details["activation_bytes_by_module"]
    return sum(
        v for k, v in acts.items() if k == "model.layers.0" or k.startswith("model.layers.0.")
    )


@pytest.mark.parametrize(
    ("case", "parallel", "compiled", "expected"), CASES, ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_float8_layer_saves_what_the_notes_derive(
    engine: str, case: str, parallel: dict[str, object], compiled: bool, expected: int
) -> None:
    del case
    delta = _layer_bytes(engine, "fp8-mixed", parallel, compiled) - _layer_bytes(
        engine, "bf16-mixed", parallel, compiled
    )
    if engine == "analytic":
        assert delta == expected
    else:
        assert expected <= delta <= expected + SCALARS_BYTES


def test_hand_figures() -> None:
    # the docstring's sums, so a reader can check them against the table above
    assert [c[3] for c in CASES] == [0, -17_664, 768, -52_224, -17_664, -29_952]


def test_float8_under_fsdp_gathers_the_other_weights_in_bf16_whatever_the_framework() -> None:
    """fp8-mixed under FSDP2 is torchao's float8 recipe run with
    ``MixedPrecisionPolicy(param_dtype=bf16)`` (torchtitan's), also when the framework is left
    at ``pytorch-amp``: the token embedding is gathered in bf16, so under tensor parallelism
    its whole-vocabulary gradient (DTensor's embedding backward) is bf16, V * h * 2 bytes, at
    the stage's peak in both engines (tiny-llama-test: V = 512, h = 64)."""
    pytest.importorskip("torchao")
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    v, h = 512, 64
    t = TrainingConfig(micro_batch_size=2, seq_len=48, precision="fp8-mixed", zero_stage=3,
                       data_parallel_size=4, tensor_parallel_size=2, sequence_parallel=True,
                       pipeline_parallel_size=2, gradient_accumulation_steps=2)  # fmt: skip
    assert t.framework == "pytorch-amp"
    peaks = {
        engine: estimate("tiny-llama-test", t, engine=engine, simulate_allocator=False).details[
            "per_rank"
        ][0]["allocated_bytes"]
        for engine in ("trace", "analytic")
    }
    # an fp32 new gradient would put the formulas V * h * 2 bytes above the trace at the peak
    # (the embedding's backward); a few small tensors are not modelled
    assert abs(peaks["analytic"] - peaks["trace"]) < v * h, peaks
