"""bitsandbytes' 4-bit inputs under torch's non-reentrant checkpoint on the generic path: the
stand-in keeps its cast input as a ``ctx`` attribute as ``MatMul4Bit`` does before 0.43.2
(Note [bitsandbytes' inputs under non-reentrant checkpointing]), so the traced step holds every
layer's inputs through the backward, as the analytic engine's schedule does. Expected rise by
hand from the layer's linears; the two engines within 1 % of each other."""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("peft")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")  # h 64, i 128, 2 layers


def _rises_and_peaks(**fields: object) -> tuple[list[int], list[int]]:
    """Per engine (generic, analytic): the rise of the peak from reentrant to non-reentrant
    full checkpointing, and the non-reentrant peak."""

    def training(reentrant: bool) -> TrainingConfig:
        settings: dict[str, object] = dict(
            micro_batch_size=2,
            seq_len=128,
            lora_rank=16,
            activation_checkpointing="full",
            checkpoint_reentrant=reentrant,
            **fields,
        )
        return TrainingConfig(**settings)  # type: ignore[arg-type]

    rises, peaks = [], []
    for engine in ("generic", "analytic"):
        plain = estimate(QWEN2, training(True), engine=engine, simulate_allocator=False)
        held = estimate(QWEN2, training(False), engine=engine, simulate_allocator=False)
        rises.append(held.breakdown.allocated_bytes - plain.breakdown.allocated_bytes)
        peaks.append(held.breakdown.allocated_bytes)
    return rises, peaks


@pytest.mark.parametrize(
    ("prepare", "values"),
    [
        # peft's fp32 upcast under bf16 autocast: q, k, v, gate, up each cast their own copy
        (True, 5 * 64 + 64 + 128),
        # a bf16 stream: q / k / v share the normed input, gate / up theirs
        (False, 64 + 64 + 64 + 128),
    ],
)
def test_both_engines_keep_every_layers_inputs_under_non_reentrant_checkpointing(
    prepare: bool, values: int
) -> None:
    rises, peaks = _rises_and_peaks(
        quantize_base="nf4-dq", bitsandbytes_version="0.42.0", prepare_kbit_training=prepare
    )
    kept = 2 * 256 * values * 2  # bf16 x 2 x 128 tokens x values, 2 layers
    assert rises == [kept, kept]
    assert abs(peaks[0] - peaks[1]) <= 0.01 * peaks[1], peaks


@pytest.mark.parametrize(
    ("prepare", "bnb", "per_token"),
    [
        # MatMul8bitLt keeps its input as given (Note [bitsandbytes' int8 inputs under
        # non-reentrant checkpointing]): under peft's fp32 upcast the normed inputs are fp32,
        # q / k / v one tensor and gate / up one (4 B x 64 each), o's and down's bf16 (the
        # step's attention output and MLP product): 4 x 64 + 2 x 64 + 4 x 64 + 2 x 128
        (True, "0.45.0", 4 * 64 + 2 * 64 + 4 * 64 + 2 * 128),
        # a bf16 stream: the same four tensors, 2 B each
        (False, "0.45.0", 2 * (64 + 64 + 64 + 128)),
        # before 0.45.0 each linear's int8 transposed copy CAt besides (1 B a value): q, k, v,
        # o, gate, up read 64 values a token, down 128
        (False, "0.42.0", 2 * (64 + 64 + 64 + 128) + 6 * 64 + 128),
    ],
)
def test_both_engines_keep_an_int8_bases_inputs_under_non_reentrant_checkpointing(
    prepare: bool, bnb: str, per_token: int
) -> None:
    rises, peaks = _rises_and_peaks(
        quantize_base="int8", bitsandbytes_version=bnb, prepare_kbit_training=prepare
    )
    kept = 2 * 256 * per_token  # 2 layers x 2 x 128 tokens
    assert rises == [kept, kept]
    assert abs(peaks[0] - peaks[1]) <= 0.01 * peaks[1], peaks
