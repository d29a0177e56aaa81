"""Every row of the optimizer table against bytes worked out by hand from its source.

A row added to :data:`trainmem.specs.optimizers.OPTIMIZER_TABLE` without an entry in
``STATE_BYTES`` and ``STEP_TEMPORARIES`` below fails ``test_every_row_has_its_expected_bytes``.

The shapes: one trainable 1000 x 1024 matrix (n = 1,024,000 elements: 4,000 blocks of 256,
8,000 blocks of 128, >= 4096 and >= 1e5) and 1,000 vector elements (< 4096).
"""

from __future__ import annotations

from typing import get_args

import pytest

from trainmem.analytic.model_states import optimizer_state_bytes
from trainmem.analytic.temporaries import optimizer_step_temporary_bytes
from trainmem.analytic.tensor_states import paged_state_bytes
from trainmem.errors import SpecError
from trainmem.estimate import trace_unsupported_settings
from trainmem.specs.optimizers import OPTIMIZER_TABLE, Optimizer
from trainmem.specs.training import OPTIMIZERS, PAGED_OPTIMIZERS, TrainingConfig

N = 1000 * 1024  # matrix elements
V = 1000  # vector elements
SHAPES = [(1000, 1024, 1)]

# (bf16-mixed: states fp32, 4 B; bf16-true: states in bf16, 2 B), no master copy (pytorch-amp)
STATE_BYTES: dict[str, tuple[int, int]] = {
    # torch/optim/sgd.py: no state without momentum
    "sgd": (0, 0),
    # one momentum_buffer / one exp_avg (lion-pytorch) per element
    "sgd-momentum": (4 * (N + V), 2 * (N + V)),
    "lion": (4 * (N + V), 2 * (N + V)),
    # exp_avg + exp_avg_sq per element
    "adam": (8 * (N + V), 4 * (N + V)),
    "adamw": (8 * (N + V), 4 * (N + V)),
    # row (1000) + column (1024) vectors of the matrix, a full exp_avg_sq of the vector
    "adafactor": (4 * (1000 + 1024 + V), 2 * (1000 + 1024 + V)),
    # bitsandbytes 8-bit: two uint8 codes per element + two fp32 absmax per 256-block; vectors
    # keep two fp32 states whatever the precision
    "adamw-8bit": (2 * N + 2 * 4 * 4000 + 8 * V,) * 2,
    "paged-adamw-8bit": (2 * N + 2 * 4 * 4000 + 8 * V,) * 2,
    # bitsandbytes 32-bit: two fp32 states whatever the precision
    "paged-adamw": (8 * (N + V),) * 2,
    # torchao 4-bit: two states of N / 2 packed bytes + an fp32 scale per 128; the vector
    # (< 4096) keeps two states in the parameter's dtype
    "adamw-4bit": (2 * (N // 2 + 4 * 8000) + 2 * 4 * V, 2 * (N // 2 + 4 * 8000) + 2 * 2 * V),
    # torchao FP8: two states of N float8 codes + an fp32 scale per 256
    "adamw-fp8": (2 * (N + 4 * 4000) + 2 * 4 * V, 2 * (N + 4 * 4000) + 2 * 2 * V),
    # torchao 8-bit: two states of N uint8 codes + an fp32 scale per 256; the vector (< 4096)
    # keeps two states in the parameter's dtype (bitsandbytes: fp32)
    "ao-adamw-8bit": (2 * (N + 4 * 4000) + 2 * 4 * V, 2 * (N + 4 * 4000) + 2 * 2 * V),
}

# bf16-mixed (states and weights fp32) step temporaries per implementation, trainable
# elements N + V, the largest tensor N (Note [Optimizer-step temporaries])
_NONE = {"foreach": 0, "fused": 0, "for-loop": 0}
STEP_TEMPORARIES: dict[str, dict[str, int]] = {
    "sgd": _NONE,
    "sgd-momentum": _NONE,
    # foreach: _foreach_sqrt of the whole group; for-loop: two tensors of the largest; the
    # course's AdamW: five of the largest
    "adam": {"foreach": 4 * (N + V), "fused": 0, "for-loop": 2 * 4 * N, "cs336": 5 * 4 * N},
    "adamw": {"foreach": 4 * (N + V), "fused": 0, "for-loop": 2 * 4 * N, "cs336": 5 * 4 * N},
    # torch.optim.Adafactor (torch >= 2.5): one var_estimate per parameter, all at once
    # with foreach
    "adafactor": {"foreach": 4 * (N + V), "fused": 4 * N, "for-loop": 4 * N},
    "lion": {"foreach": 2 * 4 * N, "fused": 2 * 4 * N, "for-loop": 2 * 4 * N},
    "adamw-8bit": _NONE,
    "paged-adamw-8bit": _NONE,
    "paged-adamw": _NONE,
    # torchao's compiled step (Note [torchao low-bit AdamW step], read from Inductor's wrapper):
    # 8-bit: new uint8 codes of both states (N B each) + their fp32 scales (4000 x 4 B each);
    # 4-bit: unpacked uint8 codes, fp32 scaled states and int64 codes of both states
    # (1 + 4 + 8 B per element each) + their fp32 scales (8000 x 4 B each); FP8: the two scales
    "ao-adamw-8bit": dict.fromkeys(_NONE, 2 * N + 2 * 4 * 4000),
    "adamw-4bit": dict.fromkeys(_NONE, 2 * (1 + 4 + 8) * N + 2 * 4 * 8000),
    "adamw-fp8": dict.fromkeys(_NONE, 2 * 4 * 4000),
}

# bytes per element in CUDA managed memory: the two fp32 states / the two uint8 codes
PAGED_PER_ELEMENT = {"paged-adamw": 8, "paged-adamw-8bit": 2}


def test_every_row_has_its_expected_bytes() -> None:
    assert set(STATE_BYTES) == set(OPTIMIZER_TABLE)
    assert set(STEP_TEMPORARIES) == set(OPTIMIZER_TABLE)


def test_the_names_are_the_table_keys() -> None:
    assert OPTIMIZERS == tuple(OPTIMIZER_TABLE) == get_args(Optimizer)
    assert set(PAGED_OPTIMIZERS) == set(PAGED_PER_ELEMENT)
    assert all(name == row.name for name, row in OPTIMIZER_TABLE.items())


@pytest.mark.parametrize("name", sorted(OPTIMIZER_TABLE))
def test_state_bytes(name: str) -> None:
    mixed, true16 = STATE_BYTES[name]
    for precision, expected in (("bf16-mixed", mixed), ("bf16-true", true16)):
        training = TrainingConfig(optimizer=name, precision=precision)  # type: ignore[arg-type]
        assert optimizer_state_bytes(training, SHAPES, V) == expected, precision


@pytest.mark.parametrize("name", sorted(OPTIMIZER_TABLE))
def test_step_temporaries(name: str) -> None:
    for implementation, expected in STEP_TEMPORARIES[name].items():
        training = TrainingConfig(
            optimizer=name,  # type: ignore[arg-type]
            precision="bf16-mixed",
            optimizer_implementation=implementation,  # type: ignore[arg-type]
        )
        got = optimizer_step_temporary_bytes(
            training, num_trainable_parameters=N + V, largest_parameter=N
        )
        assert got == expected, implementation


@pytest.mark.parametrize("name", sorted(OPTIMIZER_TABLE))
def test_paged_bytes(name: str) -> None:
    training = TrainingConfig(optimizer=name)  # type: ignore[arg-type]
    per = PAGED_PER_ELEMENT.get(name, 0)
    assert paged_state_bytes(training, N) == per * N
    assert paged_state_bytes(training, 99_999) == 0  # under bitsandbytes' 1e5 elements


@pytest.mark.parametrize("name", sorted(OPTIMIZER_TABLE))
def test_implementations_outside_the_row_are_refused(name: str) -> None:
    accepted = set(STEP_TEMPORARIES[name])
    for implementation in ("foreach", "fused", "for-loop", "cs336"):
        if implementation in accepted:
            continue
        with pytest.raises(SpecError, match="optimizer_implementation"):
            TrainingConfig(optimizer=name, optimizer_implementation=implementation)  # type: ignore[arg-type]


# torch 2.0.1 torch/optim/adam.py / adamw.py _multi_tensor_adam(w): ``exp_avg_sq_sqrt =
# _foreach_sqrt(exp_avg_sqs)`` and ``denom = _foreach_add(exp_avg_sq_sqrt, eps)`` are both alive
# at ``_foreach_addcdiv_``: two fp32 copies of the group; torch 2.1.0 adds eps in place (one).
# The for-loop and fused steps did not change.
OLDER_TORCH_STEP_TEMPORARIES: dict[tuple[str, str], dict[str, int]] = {
    ("adam", "2.0"): {"foreach": 2 * 4 * (N + V), "fused": 0, "for-loop": 2 * 4 * N},
    ("adamw", "1.13.1"): {"foreach": 2 * 4 * (N + V), "fused": 0, "for-loop": 2 * 4 * N},
    ("adamw", "2.1"): {"foreach": 4 * (N + V), "fused": 0, "for-loop": 2 * 4 * N},
    ("sgd-momentum", "2.0"): _NONE,
}


@pytest.mark.parametrize(("name", "version"), sorted(OLDER_TORCH_STEP_TEMPORARIES))
def test_step_temporaries_of_older_torch(name: str, version: str) -> None:
    for implementation, expected in OLDER_TORCH_STEP_TEMPORARIES[name, version].items():
        training = TrainingConfig(
            optimizer=name,  # type: ignore[arg-type]
            precision="bf16-mixed",
            optimizer_implementation=implementation,  # type: ignore[arg-type]
            torch_version=version,
        )
        got = optimizer_step_temporary_bytes(
            training, num_trainable_parameters=N + V, largest_parameter=N
        )
        assert got == expected, implementation


def test_the_traced_paths_run_an_older_torch_step() -> None:
    # the installed torch.optim holds one intermediate, 2.0's foreach two: the trace runs a
    # fused stand-in and the optimizer transform's temporaries for the release (refused before
    # session 27; tests/trace/test_older_torch_step.py has the bytes)
    for version, implementation in (("2.0", None), ("2.0", "fused"), ("2.1", None)):
        training = TrainingConfig(
            optimizer="adamw",
            torch_version=version,
            optimizer_implementation=implementation,  # type: ignore[arg-type]
        )
        assert not any(s.startswith("torch_version") for s in trace_unsupported_settings(training))
