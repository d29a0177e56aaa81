"""Note [Plain options skip pydantic]: the plain runtime parameter coerces every option of
``estimate``, ``plan`` and ``fit`` as typer's pydantic adapter does, value or error message,
and the commands no longer import pydantic."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from trainmem.cli import app
from trainmem.cli.coercion import plain_runtime_param_class

VALUES: list[Any] = [
    None,
    "4096",
    "0",
    "-3",
    "007",
    "1_000",
    "2.0",
    " 5",
    "+5",
    "abc",
    "1e3",
    "0.05",
    "",
    "9" * 40,
    "bf16-true",
    3,
    2.5,
    True,
    False,
]


def _outcome(runtime: Any, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
    from typer._click.exceptions import BadParameter

    try:
        out = runtime.coerce(value, param=param, ctx=ctx)
    except BadParameter as err:
        return "error", err.format_message()
    return type(out).__name__, out


@pytest.mark.parametrize("command", ["estimate", "plan", "fit"])
def test_plain_coercion_is_typers(command: str) -> None:
    plain = plain_runtime_param_class()
    if plain is None:
        pytest.skip("this typer has no runtime coercion")
    from typer import _coercion
    from typer._click import Context
    from typer.main import get_command

    group = get_command(app)
    cmd = group.commands[command]  # type: ignore[attr-defined]
    ctx = Context(cmd)
    checked = 0
    for param in cmd.params:
        desc = getattr(param, "type_descriptor", None)
        if desc is None or desc.file_annotation is not None:
            continue
        for value in VALUES:
            ours = plain(annotation=desc.annotation, parameter_info=desc.parameter_info)
            typers = _coercion.build_runtime_param(desc)
            expected = _outcome(typers, value, param, ctx)
            assert _outcome(ours, value, param, ctx) == expected, (param.name, value)
            checked += 1
    assert checked > 30 * len(VALUES)


def test_commands_do_not_import_pydantic() -> None:
    code = (
        "import sys\n"
        "from trainmem.cli import main\n"
        "sys.argv = ['trainmem', 'estimate', 'gpt2', '-b', '2', '-s', '512',\n"
        "            '--lora-rank', '8', '--lora-alpha', '16.5']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('pydantic' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "gpt2", "-b", "2", "-s", "256", "--gpu", "T4"],
        ["estimate", "gpt2", "-b", "2", "-s", "256", "--json"],
        ["estimate"],  # missing argument: the usage and the error
        ["estimate", "gpt2", "--micro-batch-size", "1_000"],  # refused by the setting
        ["estimate", "gpt2", "--no-such-option"],
        ["plan", "--help"],
        ["gpus"],
        ["--version"],
        ["no-such-command"],
        [],
    ],
)
def test_the_console_script_answers_as_the_whole_app(args: list[str]) -> None:
    # Note [Only the invoked command is built]: main() runs a copy of the app with only the
    # command named; every answer (output, errors, exit status) is the whole app's.
    from typer.testing import CliRunner

    from trainmem.cli.app import only_invoked

    narrow = only_invoked(args)
    if args and not args[0].startswith("-") and args[0] != "no-such-command":
        assert narrow is not app and len(narrow.registered_commands) == 1
    runner = CliRunner()
    whole, ours = runner.invoke(app, args), runner.invoke(narrow, args)

    def stderr(result: Any) -> str:
        # the "still working" lines (cli/common.progress) depend on the machine's load, not on
        # the app: a run over 2 s on a busy machine prints one
        lines = str(result.stderr).splitlines(keepends=True)
        return "".join(x for x in lines if not x.startswith("trainmem: estimating"))

    assert (ours.exit_code, ours.stdout, stderr(ours)) == (
        whole.exit_code,
        whole.stdout,
        stderr(whole),
    )
