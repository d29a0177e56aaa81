"""Reading the small text files users hand trainmem (``config.json``, ``ds_config.json``,
accelerate YAML) without letting a hostile or mistaken path hang or exhaust the process.

A path must name a regular file (a FIFO blocks ``open`` until a writer appears; ``/dev/zero``
and ``/dev/urandom`` never end), no larger than a limit, holding UTF-8 text. Every failure is a
:class:`~trainmem.errors.SpecError` naming the option the path came from.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainmem.errors import SpecError
from trainmem.units import MiB

MAX_CONFIG_BYTES = 16 * MiB
"""Largest config file read. Real ones are far smaller: a HF ``config.json`` is a few KiB
(ImageNet-21k ``id2label`` maps make the largest, about 1 MiB); DeepSpeed and accelerate
configs are under 10 KiB."""


def resolve_path(text: str, field: str) -> Path:
    """``text`` as a path with ``~`` expanded.

    Raises:
        SpecError: not a non-empty string, a NUL byte in it, or an unknown ``~user``.
    """
    if not isinstance(text, str) or not text:
        raise SpecError(field, f"must be a non-empty path, got {text!r:.80}")
    if "\0" in text:
        raise SpecError(field, "a path cannot contain a NUL byte")
    try:
        return Path(text).expanduser()
    except RuntimeError as exc:  # "Could not determine home directory"
        raise SpecError(field, f"cannot expand {text!r:.80}: {exc}") from exc


def path_kind(path: Path) -> str | None:
    """``"dir"``, ``"file"`` (anything else that exists) or None when nothing is there or the
    name cannot name a file (too long, bad characters)."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file"


def read_text_file(path: Path, field: str, *, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` bytes.

    Args:
        path: the file.
        field: the option the path came from, for the error message (``"model"``,
            ``"deepspeed_config"``).
        max_bytes: size limit in bytes.

    Returns:
        The decoded text (a UTF-8 byte-order mark is dropped).

    Raises:
        SpecError: the path cannot be read, is not a regular file (folder, FIFO, device),
            is larger than ``max_bytes``, or is not UTF-8.
    """
    name = str(path)[:200]
    try:
        info = path.stat()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError(field, f"cannot read {name}: {reason}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(
            field, f"{name} is not a regular file (a folder, FIFO or device); give a file path"
        )
    if info.st_size > max_bytes:
        raise SpecError(
            field, f"{name} is {info.st_size:,} bytes, more than the {max_bytes:,} a config may be"
        )
    try:
        # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, open must
        # not wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise SpecError(field, f"cannot read {name}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise SpecError(field, f"{name} is more than the {max_bytes:,} bytes a config may be")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(
            field,
            f"{name} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "save it as UTF-8",
        ) from exc


def parse_json(text: str, name: str, field: str) -> object:
    """``json.loads`` whose every failure is one SpecError line.

    Raises:
        SpecError: invalid JSON, nesting deeper than the parser's recursion limit, or an integer
            of more than 4300 digits (Python's ``int`` conversion limit).
    """
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            field, f"{name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from exc
    except RecursionError as exc:
        raise SpecError(field, f"{name} is nested too deeply to be a config") from exc
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise SpecError(field, f"{name} is not valid JSON ({str(exc)[:120]})") from exc
