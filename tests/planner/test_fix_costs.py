"""The cost of each fix in numbers (issue 27), derived by hand from Kaplan et al. 2020 Table 1
and Rajbhandari et al. 2020 sec. 7.2 on Llama-3.1-8B's config.json."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.planner.costs import cost_figures
from trainmem.planner.fixes import fixes
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

# Llama-3.1-8B config.json: hidden 4096, 32 layers, 32 heads of 128, 8 KV heads, MLP 14336
H, L, KV, FF = 4096, 32, 8 * 128, 14336
PER_LAYER = H * (H + 2 * KV + H) + 3 * H * FF + 2 * H  # q, k, v, o + gate, up, down + 2 norms
N = L * PER_LAYER + H  # + final norm; embeddings and head excluded (Kaplan's N)


@pytest.fixture(scope="module")
def llama() -> ModelSpec:
    return load_model_spec("llama-3.1-8b")


def test_full_checkpointing_recomputes_one_forward(llama: ModelSpec) -> None:
    base = TrainingConfig(micro_batch_size=1, seq_len=2048)
    tokens = 2048
    forward = 2 * N * tokens + 2 * L * 2048 * H * tokens  # C_forward = 2N + 2 n_layer n_ctx d
    figures = cost_figures(llama, base, replace(base, activation_checkpointing="full"))
    assert figures.recomputed_flops == forward
    assert figures.compute_ratio == pytest.approx(4 / 3)
    assert figures.extra_communication_bytes == 0 and figures.pcie_bytes == 0


def test_zero3_sends_one_and_a_half_times_data_parallel_traffic(llama: ModelSpec) -> None:
    # PyTorch AMP keeps fp32 weights and gradients (4 B): ring all-reduce of the gradients
    # 2 (n-1)/n x 4N, plus ZeRO-3's parameter all-gather in backward (n-1)/n x 4N
    base = TrainingConfig(micro_batch_size=1, seq_len=2048)
    after = replace(base, zero_stage=3, data_parallel_size=8)
    figures = cost_figures(llama, base, after)
    assert figures.extra_communication_bytes == 2 * 4 * N * 7 // 8 + 4 * N * 7 // 8
    assert figures.compute_ratio == 1.0


def test_every_fix_carries_its_figures() -> None:
    found = fixes("llama-3.1-8b", TrainingConfig(micro_batch_size=2, seq_len=2048), "A100-80GB")
    assert found
    for fix in found:
        d = fix.to_dict()
        assert set(d["cost_figures"]) == {
            "recomputed_flops",
            "compute_ratio",
            "extra_communication_bytes",
            "pcie_bytes",
        }
        assert fix.figures is not None and fix.figures.text()
