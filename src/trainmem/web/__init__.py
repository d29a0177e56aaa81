"""The web calculator: the whole estimate in a browser page (``trainmem serve``; the ``web``
extra, gradio).

Stage: after ``report`` (it imports ``estimate``, ``planner`` and ``report``, never the CLI).

- :mod:`trainmem.web.form`: the inputs as data, URL query string and CLI command (no gradio);
- :mod:`trainmem.web.uploads`: uploaded files, parsed as data only, size-limited;
- :mod:`trainmem.web.compute`: the estimate of a page state, and ``numbers()``, the one reader
  of ``MemoryEstimate.to_dict()``;
- :mod:`trainmem.web.views`: HTML fragments (verdict, tables);
- :mod:`trainmem.web.handlers`: the event handlers (no gradio);
- :mod:`trainmem.web.layout`: the gradio page; :mod:`trainmem.web.server`: :func:`launch`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "launch"]


def build_app() -> Any:
    """The page as a ``gradio.Blocks``, see :func:`trainmem.web.layout.build_app`."""
    from trainmem.web.layout import build_app as build

    return build()


def launch(*args: Any, **kwargs: Any) -> Any:
    """Serve the page, see :func:`trainmem.web.server.launch`."""
    from trainmem.web.server import launch as serve

    return serve(*args, **kwargs)
