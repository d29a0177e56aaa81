"""Exceptions raised by trainmem.

Tree (httpx style)::

    TrainmemError
     +-- SpecError(ValueError)            bad field in a model / training / GPU spec
     +-- UnsupportedError(NotImplementedError)  not modelled (the message names a workaround)
     |    +-- NotApplicableError              an option with no meaning for this kind of model
     +-- TraceError(RuntimeError)         the trace engine could not run the model
     +-- CompositionError(ValueError)     a traced stream does not split into identical units
     +-- ScheduleError(ValueError)        a step schedule frees what it never allocated
     +-- TimelineError(ValueError)        an event stream the allocator cannot replay
     +-- SnapshotError(ValueError)        an unsafe or malformed memory snapshot file
     +-- OutOfMemoryError                 the simulated caching allocator cannot serve a request

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


class NotApplicableError(UnsupportedError):
    """The option has no meaning for this kind of model, not a gap in the modelling: a language
    model's option (a token loss, a padded token batch, a language-model framework) on a
    diffusion or vision model. The message names the option, why it does not apply and what to
    use instead."""


class TraceError(TrainmemError, RuntimeError):
    """The trace engine failed to run the model's training step on fake tensors."""


class ScheduleError(TrainmemError, ValueError):
    """A schedule cannot be expanded: a free whose key is not live, or a key allocated twice."""


class TimelineError(TrainmemError, ValueError):
    """A timeline cannot be replayed: a free without a live alloc, or an id allocated twice.

    Attributes:
        event_index: index of the offending event in ``Timeline.events``.
    """

    def __init__(self, message: str, *, event_index: int) -> None:
        super().__init__(message)
        self.event_index = event_index


class SnapshotError(TrainmemError, ValueError):
    """A snapshot file is unsafe (it asks to build objects) or is not a memory snapshot."""


class OutOfMemoryError(TrainmemError):
    """The simulated ``cudaMalloc`` failed after the cache was flushed (spec 3.5).

    ``str(err)`` is the message PyTorch prints.

    Attributes:
        size_bytes: the rounded request that failed.
        alloc_size_bytes: the segment size it tried to obtain (printed in the message).
    """

    def __init__(self, message: str, *, size_bytes: int, alloc_size_bytes: int) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes
        self.alloc_size_bytes = alloc_size_bytes


class CompositionError(TrainmemError, ValueError):
    """The traced stream does not split into identical units (the caller traces the whole
    model instead; :mod:`trainmem.trace.compose`)."""
