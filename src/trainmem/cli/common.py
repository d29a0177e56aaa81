"""What every command shares: the console tables print to, and :func:`clean_errors`, which
turns trainmem's own errors into one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer
from rich.console import Console

from trainmem.errors import TrainmemError

_stdout_probe = Console()
# Piped output (CI logs, files) gets room for the tables instead of rich's 80-column default.
console = _stdout_probe if _stdout_probe.is_terminal else Console(width=160)

F = TypeVar("F", bound=Callable[..., Any])


def clean_errors(func: F) -> F:
    """Turn trainmem's own errors into one line on stderr and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (TrainmemError, ImportError) as exc:
            # plain print: one line whatever the terminal width (rich would wrap it)
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]
