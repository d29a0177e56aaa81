"""Model states per precision x optimizer, from the papers' and PyTorch's byte counts."""

from __future__ import annotations

import pytest

from trainmem.analytic.model_states import optimizer_state_bytes, zero_paper_model_state_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

P = 1_000_000  # parameters, all in one large matrix (1000 x 1000)

# A small model built directly; for the optimizers tested through it every tensor keeps the same
# bytes per element, so per-element figures are the hand calculation whatever the shapes.
ONE_MATRIX = ModelSpec(
    name="one-matrix",
    model_type="llama",
    architecture="decoder",
    num_layers=1,
    hidden_size=1000,
    num_heads=10,
    num_kv_heads=10,
    head_dim=100,
    intermediate_size=1,
    mlp_kind="gelu",
    hidden_act="gelu",
    norm_kind="rmsnorm",
    vocab_size=1000,
    max_position_embeddings=16,
    position_kind="rotary",
    tie_word_embeddings=True,
    num_norms_per_layer=0,
    final_norm=False,
)


def states(**kw: object) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) per parameter element, from the per-tensor table."""
    table = tensor_states(ONE_MATRIX, TrainingConfig(**kw))  # type: ignore[arg-type]
    n = sum(s.numel for s in table)
    total = [
        sum(getattr(s, f) for s in table) for f in ("param_bytes", "grad_bytes", "state_bytes")
    ]
    assert all(x % n == 0 for x in total[:2])
    return total[0] // n, total[1] // n, round(total[2] / n)


def test_mixed_precision_adamw_is_16_bytes_per_parameter() -> None:
    # PyTorch AMP: fp32 weights (4) + fp32 grads (4) + exp_avg and exp_avg_sq in fp32 (8).
    assert states(precision="bf16-mixed", optimizer="adamw") == (4, 4, 8)
    assert sum(states(precision="16-mixed", optimizer="adam")) == 16


def test_zero_paper_split_is_also_16_bytes_per_parameter() -> None:
    # Rajbhandari et al. 2020 sec. 3.1: 2 + 2 + 12 bytes; GPT-2 1.5B -> 24 GB of model states.
    assert zero_paper_model_state_bytes(P) == (2 + 2 + 12) * P
    assert zero_paper_model_state_bytes(1_500_000_000) == 24 * 10**9


@pytest.mark.parametrize(
    ("precision", "optimizer", "expected"),
    [
        ("32-true", "sgd", (4, 4, 0)),  # no state without momentum
        ("32-true", "sgd-momentum", (4, 4, 4)),  # momentum_buffer
        ("32-true", "lion", (4, 4, 4)),  # one exp_avg
        ("bf16-true", "adamw", (2, 2, 4)),  # Lightning bf16-true: states in bf16
        ("16-true", "sgd-momentum", (2, 2, 2)),
    ],
)
def test_bytes_per_parameter(
    precision: str, optimizer: str, expected: tuple[int, int, int]
) -> None:
    assert states(precision=precision, optimizer=optimizer) == expected


def test_adamw_8bit_is_2_bytes_plus_blockwise_absmax() -> None:
    # bitsandbytes AdamW8bit: two uint8 states + one fp32 absmax per 256-value block for each.
    blocks = -(-P // 256)
    training = TrainingConfig(optimizer="adamw-8bit")
    assert optimizer_state_bytes(training, [(1000, 1000, 1)], 0) == 2 * P + 2 * 4 * blocks


def test_adafactor_is_factored() -> None:
    # torch.optim.Adafactor: row (1000) and column (1000) second-moment vectors in fp32, no
    # first moment by default (beta1=None): far below one value per parameter.
    training = TrainingConfig(optimizer="adafactor")
    assert optimizer_state_bytes(training, [(1000, 1000, 1)], 0) == 4 * (1000 + 1000)
