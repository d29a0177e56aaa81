"""Every bad input is one line (issue 29): the fuzz campaign's reproducers that tracebacked,
hung or wrote a file before refusing. Each must end in ``error: <field>: ...`` on stderr with
exit code 2, quickly."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Invoke


def one_line_error(invoke: Invoke, args: list[str], field: str) -> str:
    # an uncaught exception exits 1: invoke fails with its traceback
    result = invoke(*args, exit_code=2)
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in result.output, err
    assert err.startswith(f"error: {field}: "), err
    return err


@pytest.mark.parametrize("port", ["70000", "-1", "0"])
def test_serve_refuses_a_port_before_printing_a_url(invoke: Invoke, port: str) -> None:
    err = one_line_error(invoke, ["serve", "--port", port], "port")
    assert "allowed: 1..65535" in err
    assert "http://" not in invoke("serve", "--port", port, exit_code=2).stdout


@pytest.mark.parametrize(
    ("outputs", "field"),
    [
        (["--plot", "bad.bmp"], "plot"),
        (["--html", "no-such-folder/report.html"], "html"),
        (["--html", "."], "html"),
    ],
)
def test_every_output_path_is_checked_before_any_is_written(
    invoke: Invoke, outputs: list[str], field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    one_line_error(invoke, ["estimate", "gpt2", "--snapshot", "out.pickle", *outputs], field)
    assert not (tmp_path / "out.pickle").exists()  # was written before the plot was refused


def test_compare_checks_the_html_path_before_the_plot_is_written(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["compare", "gpt2", "--set", "micro_batch_size=1", "--plot", "a.png"]
    one_line_error(invoke, [*args, "--html", "missing/b.html"], "html")
    assert not (tmp_path / "a.png").exists()


def test_an_output_name_too_long_is_one_line(invoke: Invoke) -> None:
    one_line_error(invoke, ["estimate", "gpt2", "--html", "x" * 5000 + ".html"], "html")


@pytest.mark.parametrize("m", ["4097", "10000", "2147483647"])
def test_pipeline_micro_batches_are_capped_with_a_reason(invoke: Invoke, m: str) -> None:
    """10,000 micro-batches took 113 s, 2^31 - 1 hung (issue 29, item 2)."""
    args = ["estimate", "gpt2", "--pipeline-parallel-size", "2"]
    err = one_line_error(
        invoke, [*args, "--gradient-accumulation-steps", m], "gradient_accumulation_steps"
    )
    assert "allowed: 1..4,096" in err


@pytest.mark.parametrize("engine", ["trace", "generic"])
def test_a_micro_batch_no_device_holds_is_refused_before_tracing(
    invoke: Invoke, engine: str
) -> None:
    """torch's "Storage size calculation overflowed" traceback before (issue 29, item 6)."""
    big = ["-b", "2147483647", "-s", "2147483647"]
    err = one_line_error(
        invoke, ["estimate", "tiny-llama-test", "--engine", engine, *big], "seq_len"
    )
    assert "allowed: at most 2^50 bytes" in err


@pytest.mark.parametrize(
    ("flag", "field", "framework"),
    [
        ("--torchtune-version", "torchtune_version", "torchtune"),
        ("--litgpt-version", "litgpt_version", "litgpt"),
        ("--unsloth-version", "unsloth_version", "unsloth"),
    ],
)
def test_a_frameworks_release_without_that_framework_is_refused(
    invoke: Invoke, flag: str, field: str, framework: str
) -> None:
    # an explicit setting that would change nothing beside another framework says so instead
    # of being silently ignored (the default framework here is pytorch-amp)
    err = one_line_error(invoke, ["estimate", "gpt2", flag, "0.1.0"], field)
    assert f"--framework {framework}" in err and "framework=pytorch-amp" in err
