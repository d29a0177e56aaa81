"""Pictures of memory: the timeline and breakdown plots, opened and checked after writing.

The golden image ``golden/timeline_tiny_gpt2.png`` is the timeline of ``tiny-gpt2-test``
(analytic engine, micro-batch 2, seq_len 64, no GPU). When the analytic timeline or the plot
changes on purpose, regenerate it and look at it before committing:

    TRAINMEM_REGEN_GOLDEN=1 /work/venv/bin/pytest tests/report/test_report_plots.py -k golden
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402
from matplotlib.testing.compare import compare_images  # noqa: E402

from trainmem.breakdown import MemoryBreakdown, MemoryCategory, MemoryEstimate  # noqa: E402
from trainmem.errors import SpecError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.report.plots import (  # noqa: E402
    format_gib,
    plot_breakdown,
    plot_timeline,
    timeline_series,
    window_start,
)
from trainmem.specs.training import TrainingConfig  # noqa: E402
from trainmem.timeline import AllocEvent, Timeline  # noqa: E402
from trainmem.units import GiB, MiB  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "timeline_tiny_gpt2.png"
TINY = TrainingConfig(micro_batch_size=2, seq_len=64)


@pytest.fixture(scope="module")
def tiny() -> MemoryEstimate:
    return estimate("tiny-gpt2-test", TINY)


def toy_estimate(gpu_capacity_bytes: int | None = None) -> MemoryEstimate:
    """A hand-made step in units of 1 GiB: weights 2 carried in, activations 1 + 2 in the
    forward, a 3 GiB loss temporary at the start of the backward (the peak: 2 + 3 + 3 = 8)."""
    P, A, T, G = (
        MemoryCategory.PARAMETER,
        MemoryCategory.ACTIVATION,
        MemoryCategory.TEMPORARY,
        MemoryCategory.GRADIENT,
    )
    ev = [
        AllocEvent("alloc", 0, 2 * GiB, P, "init", "layers.0"),
        AllocEvent("alloc", 1, 1 * GiB, A, "forward", "layers.0"),
        AllocEvent("alloc", 2, 2 * GiB, A, "forward", "head"),
        AllocEvent("alloc", 3, 3 * GiB, T, "backward", "loss"),
        AllocEvent("free", 3, 3 * GiB, T, "backward", "loss"),
        AllocEvent("free", 2, 2 * GiB, A, "backward", "head"),
        AllocEvent("alloc", 4, 2 * GiB, G, "backward", "layers.0"),
        AllocEvent("free", 1, 1 * GiB, A, "backward", "layers.0"),
        AllocEvent("free", 4, 2 * GiB, G, "zero_grad", "layers.0"),
    ]
    return MemoryEstimate(
        model_name="toy",
        engine="analytic",
        num_parameters=1,
        num_trainable_parameters=1,
        breakdown=MemoryBreakdown(
            parameters=2 * GiB,
            gradients=0,
            optimizer_states=0,
            activations=3 * GiB,
            temporary=3 * GiB,
            cuda_context=512 * MiB,
        ),
        peak_phase="backward",
        peak_reason="loss",
        config={"micro_batch_size": 1},
        gpu_name="toy-GPU" if gpu_capacity_bytes else None,
        gpu_capacity_bytes=gpu_capacity_bytes,
        recorded_timeline=Timeline(events=ev),
    )


def test_series_of_toy_step_in_natural_units() -> None:
    data = timeline_series(toy_estimate().timeline)
    assert data.start == 1  # the init block is carried in (Note [Timeline window])
    assert [t // GiB for t in data.total_bytes] == [2, 3, 5, 8, 5, 3, 5, 4, 2]
    assert data.peak_bytes == 8 * GiB and data.peak_position == 3
    assert data.peak_event is not None and data.peak_event.module == "loss"
    assert [v // GiB for v in data.live_bytes["activations"]] == [0, 1, 3, 3, 3, 1, 1, 0, 0]
    assert data.reserved_bytes is not None
    assert all(r >= t for r, t in zip(data.reserved_bytes, data.total_bytes, strict=True))


def test_window_skips_trace_style_init_blocks_and_analytic_warmup() -> None:
    ev = [AllocEvent("alloc", i, 512, MemoryCategory.PARAMETER, "init") for i in range(3)]
    ev.append(AllocEvent("alloc", 9, 512, MemoryCategory.ACTIVATION, "forward"))
    assert window_start(Timeline(events=ev)) == 3  # trace: steady_state_start 0, init first
    assert window_start(Timeline(events=ev, steady_state_start=3)) == 3


def test_analytic_window_is_the_second_step(tiny: MemoryEstimate) -> None:
    tl = tiny.timeline
    data = timeline_series(tl, reserved=False)
    assert data.start == tl.steady_state_start > 0
    assert data.phases[0] == "forward" and data.phases[-1] == "zero_grad"
    # the carried-in state is what the first step left: weights + optimizer states (+ workspaces)
    assert data.live_bytes["optimizer_states"][0] > 0 and data.live_bytes["gradients"][0] == 0


def test_png_dimensions_and_svg_text(tmp_path: Path) -> None:
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    plot_timeline(toy_estimate(gpu_capacity_bytes=16 * GiB), png, dpi=100, figsize=(8, 4))
    assert imread(png).shape[:2] == (400, 800)
    plot_timeline(toy_estimate(gpu_capacity_bytes=16 * GiB), svg)
    text = svg.read_text()
    assert "live memory (GiB = 2^30 bytes)" in text
    assert "allocation events of one steady-state step" in text
    assert "peak 8.00 GiB" in text and "alloc of temporary buffers in loss (backward)" in text
    assert "toy-GPU: 16.0 GiB usable - 0.50 GiB CUDA context" in text
    for label in ("forward", "backward", "reserved (allocator simulator)", "activations"):
        assert label in text


def test_svg_is_reproducible(tmp_path: Path) -> None:
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    plot_timeline(toy_estimate(), a)
    plot_timeline(toy_estimate(), b)
    assert a.read_bytes() == b.read_bytes()


def test_tiny_model_svg_shows_its_peak(tiny: MemoryEstimate, tmp_path: Path) -> None:
    path = tmp_path / "tiny.svg"
    data = plot_timeline(tiny, path)
    assert f"peak {format_gib(data.peak_bytes)}" in path.read_text()
    assert re.search(r"peak 0\.0\d{3} GiB", path.read_text())


def test_golden_timeline_tiny_gpt2(tiny: MemoryEstimate, tmp_path: Path) -> None:
    actual = tmp_path / "timeline_tiny_gpt2.png"
    plot_timeline(tiny, actual)
    if os.environ.get("TRAINMEM_REGEN_GOLDEN"):
        GOLDEN.write_bytes(actual.read_bytes())
    # RMS pixel difference (0-255); small font-rendering differences pass, a moved curve fails
    assert compare_images(str(GOLDEN), str(actual), tol=3) is None


def test_breakdown_bars(tmp_path: Path) -> None:
    ests = [
        estimate(
            "tiny-gpt2-test",
            TrainingConfig(micro_batch_size=2, seq_len=64, activation_checkpointing=c),
            gpu="T4",
        )
        for c in ("none", "full")
    ]
    png, svg = tmp_path / "b.png", tmp_path / "b.svg"
    plot_breakdown(ests, ["none", "full"], png, dpi=100)
    height, width = imread(png).shape[:2]
    assert (height, width) == (550, 670)  # 5.5 x (1.6 per bar + 3.5) inches
    plot_breakdown(ests, ["activation-checkpointing=none", "full"], svg)
    text = svg.read_text()
    assert "memory at the peak (GiB = 2^30 bytes)" in text
    assert "T4 usable capacity" in text and "CUDA context" in text
    assert "checkpointing=" in text  # the long label is wrapped, not lost
    assert f"{ests[0].breakdown.device_total_bytes / GiB:.2f}" in text


def test_bad_inputs(tmp_path: Path) -> None:
    est = toy_estimate()
    with pytest.raises(SpecError, match="png or .svg"):
        plot_timeline(est, tmp_path / "t.jpg")
    est.timeline = None
    with pytest.raises(SpecError, match="no allocation timeline"):
        plot_timeline(est, tmp_path / "t.png")
    with pytest.raises(SpecError, match="labels"):
        plot_breakdown([toy_estimate()], [], tmp_path / "b.png")
    with pytest.raises(SpecError, match="cannot write"):
        plot_timeline(toy_estimate(), tmp_path / "missing" / "t.png")
