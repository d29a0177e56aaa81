"""The HF Trainer on the traced paths (issue 26): on one GPU it is a plain loop whose default
optimizer is ``adamw_torch_fused`` from torch 2.8 (transformers training_args.py
``OptimizerNames``; ``default_optim``), so its traced step is the plain loop's with fused AdamW,
and it agrees with the analytic engine's hf-trainer row."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.breakdown import MemoryCategory  # noqa: E402
from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")


def _peak(engine: str, **settings: object) -> int:
    training = TrainingConfig(micro_batch_size=4, seq_len=256, **settings)  # type: ignore[arg-type]
    est = estimate(QWEN2, training, engine=engine, simulate_allocator=False)
    return est.breakdown.allocated_bytes


def test_trainer_step_is_the_plain_loop_with_fused_adamw() -> None:
    trainer = _peak("generic", framework="hf-trainer", torch_version="2.8")
    plain_fused = _peak("generic", optimizer_implementation="fused")
    plain_foreach = _peak("generic", optimizer_implementation="foreach")
    assert trainer == plain_fused
    assert plain_fused != plain_foreach  # the test can tell the implementations apart


@pytest.mark.parametrize(
    "settings",
    [{}, {"gradient_accumulation_steps": 4, "activation_checkpointing": "full"}],
    ids=["plain", "accumulation-full-ac"],
)
def test_trainer_on_the_generic_path_agrees_with_the_formulas(settings: dict) -> None:
    generic = _peak("generic", framework="hf-trainer", **settings)
    analytic = _peak("analytic", framework="hf-trainer", **settings)
    assert abs(generic / analytic - 1) < 0.01


def test_trainer_with_parallelism_stays_refused() -> None:
    with pytest.raises(UnsupportedError, match="framework=hf-trainer"):
        _peak("generic", framework="hf-trainer", tensor_parallel_size=2)


def _states(engine: str, **settings: object) -> tuple[int, int]:
    training = TrainingConfig(  # type: ignore[arg-type]
        micro_batch_size=4, seq_len=256, optimizer="adafactor", precision="bf16-true", **settings
    )
    est = estimate(QWEN2, training, engine=engine, simulate_allocator=False)
    state = est.schedules[0].category_peak(MemoryCategory.OPTIMIZER_STATE)
    return state, est.breakdown.allocated_bytes


def test_trainer_adafactor_is_transformers_own_with_fp32_states() -> None:
    # transformers' Adafactor (the Trainer's optim="adafactor") runs as it is on the trace; it
    # upcasts a bf16 gradient and makes its states from it: fp32. Factored (row + column) for
    # each matrix of the 2-layer Qwen2 (h 64, i 128, k / v 32 x 64, V 512, untied head): per
    # layer q 128, k 96, v 96, o 128, gate / up / down 192 each = 1,024, plus its biases (128)
    # and norms (128) in full; embedding and head 576 each, final norm 64: 3,776 x 4 B. The
    # trace adds the per-tensor RMS (a 0-d fp32 tensor, 27 tensors: 108 B).
    analytic, a_total = _states("analytic", framework="hf-trainer")
    generic, g_total = _states("generic", framework="hf-trainer")
    assert analytic == 3_776 * 4
    assert 0 <= generic - analytic <= 27 * 4 + 8
    assert abs(g_total / a_total - 1) < 0.001


def test_adafactor_cannot_factor_fsdp1_flat_parameters() -> None:
    # Note [Factored states of flat parameters]: accelerate's FSDP1 steps 1-D flat shards, so
    # transformers' Adafactor keeps a full fp32 second moment: 139,840 trainable elements
    # x 4 B / 4 ranks
    fsdp1 = {"framework": "accelerate-fsdp", "zero_stage": 3, "data_parallel_size": 4}
    analytic, a_total = _states("analytic", **fsdp1)
    generic, g_total = _states("generic", **fsdp1)
    assert analytic == 139_840 * 4 // 4
    assert 0 <= generic - analytic <= 3 * 4 + 8  # one RMS per flat parameter (2 layers, root)
    assert abs(g_total / a_total - 1) < 0.01
