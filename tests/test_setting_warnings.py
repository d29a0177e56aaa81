"""Nothing a user sets is dropped silently: a setting that is ignored or out of range for the
model gets a one-line warning in the notes (issue 27)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO_DIR, Invoke


def _notes(invoke: Invoke, *args: str) -> list[str]:
    result = invoke("estimate", *args, "--json")
    notes: list[str] = json.loads(result.stdout)["notes"]
    return notes


def test_zero_stage_without_data_parallelism_is_a_warning(invoke: Invoke) -> None:
    notes = _notes(invoke, "llama-3.2-1b", "--zero-stage", "3", "-s", "512")
    assert any(n.startswith("warning: zero_stage=3 with data_parallel_size=1") for n in notes)
    sharded = _notes(
        invoke, "llama-3.2-1b", "--zero-stage", "3", "--data-parallel-size", "8", "-s", "512"
    )
    assert not any(n.startswith("warning: zero_stage") for n in sharded)


def test_a_sequence_beyond_the_context_is_a_warning(invoke: Invoke) -> None:
    # llama-3.2-1b's config.json: "max_position_embeddings": 131072
    notes = _notes(invoke, "llama-3.2-1b", "-s", "200000", "--activation-checkpointing", "full")
    assert any("seq_len=200,000 is beyond the model's context (131,072 tokens" in n for n in notes)
    inside = _notes(invoke, "llama-3.2-1b", "-s", "131072", "--activation-checkpointing", "full")
    assert not any("beyond the model's context" in n for n in inside)


def test_the_text_output_prints_a_warning_as_one(invoke: Invoke) -> None:
    args = ["estimate", "llama-3.2-1b", "-s", "200000", "--activation-checkpointing", "full"]
    result = invoke(*args)
    assert "\nwarning: seq_len=200,000 is beyond" in result.output


def test_estimate_never_suggests_a_command_that_refuses(invoke: Invoke, models_dir: Path) -> None:
    # Whisper has no formulas: `fit` traces its candidates, and `estimate` sends the user there.
    import subprocess
    import sys

    whisper = models_dir / "whisper.json"
    args = ["estimate", str(whisper), "--gpu", "0.5GB", "--json"]
    run = subprocess.run(
        [sys.executable, "-m", "trainmem", *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    # third-party import chatter (torchao's CUDA kernel libraries, torch's pytree notes) is
    # kept out of the output
    assert "Failed to load" not in run.stderr and "_pytree" not in run.stderr, run.stderr
    d = json.loads(run.stdout)
    assert d["engine"] == "generic" and d["verdict"] == "does not fit"
    assert any(f"`trainmem fit {whisper} --gpu 0.5GB" in n for n in d["notes"])
    fit = invoke("fit", str(whisper), "--gpu", "0.5GB")
    # 0.5 GB is 0.466 GiB, less than the generic path's CUDA context (about 0.49 GiB)
    assert "no change can make it fit: the CUDA context alone" in fit.output
    assert any("re-run `trainmem estimate` with" in n for n in d["notes"])


def test_version_is_the_packages(invoke: Invoke) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = REPO_DIR / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
    result = invoke("--version")
    assert result.stdout.strip() == f"trainmem {declared}"


def test_a_long_run_says_it_is_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from trainmem.cli import common

    monkeypatch.setattr(common, "PROGRESS_AFTER_SECONDS", 0.05)
    with common.progress("tracing a model"):
        time.sleep(0.3)
    with common.progress("a quick one"):
        pass
    err = capsys.readouterr().err
    assert "trainmem: tracing a model (" in err
    assert "a quick one" not in err


def test_suggestions_leave_out_what_the_run_already_does() -> None:
    from trainmem.cli.app import untried_fixes
    from trainmem.specs.training import TrainingConfig

    done = TrainingConfig(activation_checkpointing="full", lora_rank=16)
    tips = " ".join(untried_fixes(done))
    assert "--quantize-base nf4" in tips
    assert "--activation-checkpointing" not in tips and "--lora-rank" not in tips


def test_suggestions_leave_out_what_the_configuration_refuses() -> None:
    # prefix tuning trains one adapter type: TrainingConfig refuses LoRA beside it (peft trains
    # a PrefixTuningConfig or a LoraConfig; specs/training.py _check_prefix_tuning_run); the OOM
    # note suggested it (session 28). Data parallelism / ZeRO and 8-bit optimizers are accepted
    # beside a prefix since session 28 (helper prompt2: the prompt encoder in the state layout),
    # so those stay suggested.
    from trainmem.cli.app import untried_fixes
    from trainmem.specs.training import TrainingConfig

    tips = " ".join(untried_fixes(TrainingConfig(num_virtual_tokens=20)))
    assert "--lora-rank" not in tips
    assert "more GPUs" in tips and "--optimizer adamw-8bit" in tips
    assert "--activation-checkpointing full" in tips  # ChatGLM's prefix reads under it
    plain = " ".join(untried_fixes(TrainingConfig()))
    assert "--lora-rank 16" in plain and "more GPUs" in plain


def test_suggestions_for_a_controlnet_leave_out_lora() -> None:
    # diffusers v0.40 examples/controlnet/train_controlnet_flux.py trains the whole ControlNet
    # (all its parameters to the optimizer, no adapters): `estimate --controlnet --lora-rank
    # 16` is refused, yet a FLUX ControlNet's OOM note suggested it (session 29, useraudit4)
    from trainmem.cli.app import untried_fixes
    from trainmem.errors import SpecError
    from trainmem.specs.training import TrainingConfig

    controlnet = TrainingConfig(controlnet=True, resolution=64)
    tips = " ".join(untried_fixes(controlnet))
    assert "--lora-rank" not in tips
    assert "--activation-checkpointing full" in tips and "--optimizer adamw-8bit" in tips
    with pytest.raises(SpecError, match="controlnet: train_controlnet.py trains the whole"):
        TrainingConfig(controlnet=True, lora_rank=16)


def test_the_console_script_drops_library_deprecations(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers 5.24's FutureWarnings on peft's prefix tuning (`past_key_values` is
    # deprecated ...) reached stderr after every traced prompt-learning estimate (Note
    # [Library deprecations kept off the CLI's output]); a program's own filters are kept
    import warnings

    from trainmem.cli.app import quiet_library_deprecations

    monkeypatch.setattr("sys.warnoptions", [])  # no -W / PYTHONWARNINGS of the user's
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_deprecations()
        warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("a user's warning", UserWarning, stacklevel=1)
    assert [type(w.message) for w in seen] == [UserWarning]
