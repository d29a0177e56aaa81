"""Every bad input is one line (issue 29): the fuzz campaign's reproducers that tracebacked,
hung or wrote a file before refusing. Each must end in ``error: <field>: ...`` on stderr with
exit code 2, quickly."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainmem.cli import app

runner = CliRunner()


def one_line_error(args: list[str], field: str) -> str:
    result = runner.invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in result.output, err
    assert err.startswith(f"error: {field}: "), err
    return err


@pytest.mark.parametrize("port", ["70000", "-1", "0"])
def test_serve_refuses_a_port_before_printing_a_url(port: str) -> None:
    err = one_line_error(["serve", "--port", port], "port")
    assert "allowed: 1..65535" in err
    assert "http://" not in runner.invoke(app, ["serve", "--port", port]).stdout
