"""Exceptions raised by trainmem.

Tree (httpx style)::

    TrainmemError
     +-- SpecError(ValueError)            bad field in a model / training / GPU spec
     +-- UnsupportedError(NotImplementedError)  not modelled (the message names a workaround)
     +-- TraceError(RuntimeError)         the trace engine could not run the model

The CLI catches ``TrainmemError`` and prints one line ``error: <field>: <message>``, exit code 2.
"""

from __future__ import annotations


class TrainmemError(Exception):
    """Base class of every error trainmem raises on purpose."""


class SpecError(TrainmemError, ValueError):
    """A spec field has a value outside its allowed set or range.

    Args:
        field: the name of the offending field, as the user spelled it (e.g. ``"precision"``).
        message: what is wrong and what is allowed.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class UnsupportedError(TrainmemError, NotImplementedError):
    """The input is valid but trainmem does not model it (yet); the message says what to do."""


class TraceError(TrainmemError, RuntimeError):
    """The trace engine failed to run the model's training step on fake tensors."""
