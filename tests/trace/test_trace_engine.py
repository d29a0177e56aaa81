"""The trace engine's CUDA emulation, categories, steady state, API and cross-engine agreement.

Legend: b = micro_batch_size, s = seq_len, h = hidden_size, a = num_heads.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import Invoke
from trainmem.breakdown import MemoryCategory
from trainmem.errors import TraceError
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import estimate_trace

TINY_GPT2 = dict(h=64, a=4, layers=2, vocab=512)


def _trace(preset: str, **cfg):
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.engine import run_trace
    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    training = TrainingConfig(**cfg)
    raw = load_hf_config(preset)
    holder = {}
    dtype = None if training.weight_dtype == "float32" else getattr(torch, training.weight_dtype)

    def build():
        holder["m"] = build_hf_model(
            raw, dropout=training.dropout, attention=training.attention, dtype=dtype
        )
        return holder["m"]

    def batch():
        return make_hf_batch(holder["m"], training.micro_batch_size, training.seq_len)

    capture, report = run_trace(build, batch, training)
    return capture, report


def _blocks_by_op(capture, op: str) -> list[int]:
    return [b.size_bytes for b in capture.recorder.blocks if b.op == op]


def test_import_trainmem_trace_does_not_import_torch() -> None:
    code = (
        "import sys, trainmem, trainmem.trace\n"
        "assert callable(trainmem.trace) and callable(trainmem.trace.trace)\n"
        "assert callable(trainmem.trace.estimate_trace)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp32_sdpa_uses_memory_efficient_kernel_with_padded_logsumexp() -> None:
    b, s = 2, 40
    capture, _ = _trace("tiny-gpt2-test", micro_batch_size=b, seq_len=s, precision="32-true")
    sizes = _blocks_by_op(capture, "aten._scaled_dot_product_efficient_attention.default")
    h, a = TINY_GPT2["h"], TINY_GPT2["a"]
    lse = b * a * math.ceil(s / 32) * 32 * 4  # [b, a, ceil(s/32)*32] fp32 (kAlignLSE = 32)
    out = b * s * h * 4  # [b, a, s, d] fp32
    assert sorted(set(sizes)) == sorted({out, lse, 8})  # + philox seed/offset int64 scalars
    assert not _blocks_by_op(capture, "aten._scaled_dot_product_flash_attention_for_cpu.default")


def test_bf16_mixed_sdpa_uses_flash_kernel_and_cuda_autocast_lists() -> None:
    b, s = 2, 40
    h, a = TINY_GPT2["h"], TINY_GPT2["a"]
    capture, _ = _trace("tiny-gpt2-test", micro_batch_size=b, seq_len=s, precision="bf16-mixed")
    flash = _blocks_by_op(capture, "aten._scaled_dot_product_flash_attention.default")
    assert b * s * h * 2 in flash  # out [b, a, s, d] bf16
    assert b * a * s * 4 in flash  # logsumexp [b, a, s] fp32, unpadded
    # CUDA autocast: layer_norm runs in fp32 (AT_FORALL_FP32); CPU autocast would not cast it.
    ln = _blocks_by_op(capture, "aten.native_layer_norm.default")
    assert b * s * h * 4 in ln and b * s * h * 2 not in ln
    # Linear layers (addmm) produce bf16: the MLP up-projection output is [b, s, 4h] bf16.
    assert b * s * 4 * h * 2 in _blocks_by_op(capture, "aten.addmm.default")


def test_model_states_equal_analytic_exactly() -> None:
    from trainmem.estimate import estimate as estimate_analytic
    from trainmem.specs.hf import load_model_spec

    for preset in ("tiny-gpt2-test", "tiny-llama-test"):
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            training = TrainingConfig(micro_batch_size=1, seq_len=32, precision=precision)
            tr = estimate_trace(preset, training)
            an = estimate_analytic(load_model_spec(preset), training)
            assert tr.num_parameters == an.num_parameters
            # Buffers (RoPE inv_freq, original_inv_freq) are folded into the trace's parameters
            # but not counted by the analytic engine: compare the parameter category alone.
            by_cat = tr.details["peak_by_category_bytes"]
            assert by_cat[MemoryCategory.PARAMETER.value] == an.breakdown.parameters
            assert tr.breakdown.optimizer_states == an.breakdown.optimizer_states


def test_steady_state_and_phases() -> None:
    est = estimate_trace("tiny-llama-test", TrainingConfig(micro_batch_size=1, seq_len=32))
    p = est.details["peak_by_category_bytes"][MemoryCategory.PARAMETER.value]
    assert est.breakdown.optimizer_states == 2 * p  # fp32 Adam moments exist before the step
    phases = est.details["phase_peaks_bytes"]
    # The optimizer phase holds weights + gradients + states (+ foreach temporaries).
    assert phases["optimizer"] >= 4 * p
    tl = est.timeline
    peak, at = tl.peak()
    assert peak == est.details["peak_allocated_bytes"] == est.breakdown.allocated_bytes
    assert tl.live_bytes()[-1] == sum(
        e.size_bytes for e in tl if e.phase == "init" and e.action == "alloc"
    ) - sum(e.size_bytes for e in tl if e.phase == "init" and e.action == "free")
    allocated = {e.block_id for e in tl if e.action == "alloc"}
    assert all(e.block_id in allocated for e in tl if e.action == "free")


def test_gradient_accumulation_keeps_gradients_through_the_second_micro_batch() -> None:
    one = estimate_trace("tiny-gpt2-test", TrainingConfig(micro_batch_size=2, seq_len=64))
    two = estimate_trace(
        "tiny-gpt2-test",
        TrainingConfig(micro_batch_size=2, seq_len=64, gradient_accumulation_steps=4),
    )
    assert one.breakdown.gradients == 0  # the peak is at backward start, no gradient yet
    assert two.breakdown.gradients == two.breakdown.parameters  # fp32 grads from micro-batch 1
    assert two.details["traced_micro_batches"] == 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_lowers_activations(mode: str) -> None:
    cfg = dict(micro_batch_size=4, seq_len=128, precision="32-true", dropout=False)
    base = estimate_trace("tiny-gpt2-test", TrainingConfig(**cfg))
    ckpt = estimate_trace("tiny-gpt2-test", TrainingConfig(**cfg, activation_checkpointing=mode))
    base_acts = sum(base.details["activation_bytes_by_module"].values())
    ckpt_acts = sum(ckpt.details["activation_bytes_by_module"].values())
    assert ckpt_acts < base_acts


def test_dropout_off_saves_no_masks() -> None:
    cfg = dict(micro_batch_size=2, seq_len=64, precision="32-true")
    on = estimate_trace("tiny-gpt2-test", TrainingConfig(**cfg, dropout=True))
    off = estimate_trace("tiny-gpt2-test", TrainingConfig(**cfg, dropout=False))
    assert sum(off.details["activation_bytes_by_module"].values()) < sum(
        on.details["activation_bytes_by_module"].values()
    )


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_trace_api_on_a_custom_module() -> None:
    import trainmem.trace

    training = TrainingConfig(micro_batch_size=4, precision="32-true")
    est = trainmem.trace(
        _MLP,
        lambda t: torch.randn(t.micro_batch_size, 16),
        training=training,
        loss_fn=lambda out, batch: out.square().mean(),
    )
    params = 2 * (16 * 16 + 16) * 4
    assert est.engine == "trace"
    assert est.num_parameters == 2 * (16 * 16 + 16)
    assert est.breakdown.parameters == params
    assert est.breakdown.optimizer_states == 2 * params
    assert est.timeline is not None and len(est.timeline) > 0
    assert est.to_dict()["engine"] == "trace"
    # At the end of forward: the input [4, 16] fp32, the two relu outputs [4, 16] fp32 (saved
    # by relu's backward; the Linear outputs are freed), and the fp32 loss scalar. torch.relu is
    # called in _MLP.forward itself, so all of it belongs to the root module.
    assert est.details["activation_bytes_by_module"] == {"(model)": 3 * 4 * 16 * 4 + 4}


def test_trace_api_without_a_loss_raises() -> None:
    import trainmem.trace

    with pytest.raises(TraceError, match="loss_fn"):
        trainmem.trace(_MLP, lambda: torch.randn(2, 16), training=TrainingConfig())


def test_example_script_runs(examples_dir: Path) -> None:
    example = examples_dir / "trace_custom_module.py"
    out = subprocess.run(
        [sys.executable, str(example)], check=True, capture_output=True, text=True
    ).stdout
    assert "peak allocated" in out


def test_trace_snapshot_is_the_traced_step(invoke: Invoke, tmp_path: Path) -> None:
    # issue 11: --engine trace --snapshot writes the traced step, not the analytic one
    from trainmem.allocator.snapshot import read_snapshot
    from trainmem.estimate import estimate

    path = tmp_path / "step.pickle"
    args = ["estimate", "tiny-gpt2-test", "-b", "2", "-s", "32", "--engine", "trace"]
    invoke(*args, "--snapshot", str(path))
    actions = [e["action"] for e in read_snapshot(path)["device_traces"][0]]
    traced = estimate(
        "tiny-gpt2-test", TrainingConfig(micro_batch_size=2, seq_len=32), engine="trace"
    )
    analytic = estimate("tiny-gpt2-test", TrainingConfig(micro_batch_size=2, seq_len=32))
    n_traced = sum(e.action == "alloc" and e.size_bytes > 0 for e in traced.timeline.events)
    n_analytic = sum(e.action == "alloc" and e.size_bytes > 0 for e in analytic.timeline.events)
    assert actions.count("alloc") == n_traced != n_analytic
