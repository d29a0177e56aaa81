"""What every command shares: the console tables print to, and :func:`clean_errors`, which
turns trainmem's own errors into one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import typer
from rich.console import Console

from trainmem.errors import TrainmemError

_stdout_probe = Console()
# Piped output (CI logs, files) gets room for the tables instead of rich's 80-column default.
console = _stdout_probe if _stdout_probe.is_terminal else Console(width=160)

F = TypeVar("F", bound=Callable[..., Any])


#: errno values of a write to stdout that cannot succeed (a full device, a closed pipe, a
#: broken terminal); the command's result is lost, so the exit code must say so.
_OUTPUT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EPIPE", "EIO", "EFBIG", "EDQUOT", "EBADF")
    if hasattr(errno, name)
)


def clean_errors(func: F) -> F:
    """Turn trainmem's own errors into one line on stderr and exit code 2; so too a failed
    write of the result to stdout (``--json > /dev/full``), which must not pass for success."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = func(*args, **kwargs)
            sys.stdout.flush()
            return result
        except (TrainmemError, ImportError) as exc:
            # plain print: one line whatever the terminal width (rich would wrap it)
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        except OSError as exc:
            if exc.errno not in _OUTPUT_ERRNOS:
                raise
            _drop_stdout()
            print(f"error: output: cannot write the result: {exc.strerror}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush at exit does not fail
    again (the recipe of the Python docs for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file behind stdout (tests)
        pass


PROGRESS_AFTER_SECONDS = 2.0
"""A command still working after this long says so on stderr (then every
:data:`PROGRESS_EVERY_SECONDS`), so a trace of minutes is never silent."""
PROGRESS_EVERY_SECONDS = 10.0


@contextmanager
def progress(what: str) -> Iterator[None]:
    """Lines on stderr while the block runs longer than :data:`PROGRESS_AFTER_SECONDS`:
    ``trainmem: tracing ... (12 s)``; nothing for a quick block. stdout (the result, the JSON)
    is untouched."""
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        wait = PROGRESS_AFTER_SECONDS
        while not done.wait(wait):
            elapsed = time.monotonic() - start
            print(f"trainmem: {what} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
            wait = PROGRESS_EVERY_SECONDS

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
