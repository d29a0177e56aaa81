"""Start the web calculator: ``trainmem serve`` locally, or ``app.py`` on a Hugging Face Space."""

from __future__ import annotations

from typing import Any

from trainmem.web.layout import CSS, build_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
MAX_UPLOAD = "1mb"
"""Gradio's upload limit; :mod:`trainmem.web.uploads` checks the same 1 MiB again."""


def _theme(gr: Any) -> Any:
    # System fonts: the default theme fetches Google Fonts, which an offline machine cannot.
    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=["ui-monospace", "Consolas", "monospace"],
    )


def launch(
    host: str | None = DEFAULT_HOST,
    port: int | None = DEFAULT_PORT,
    *,
    app: Any = None,
    **kwargs: Any,
) -> Any:
    """Build the page and serve it (blocks until interrupted unless
    ``prevent_thread_lock=True``).

    Args:
        host: interface to listen on; None lets gradio choose (``GRADIO_SERVER_NAME``, which
            a Hugging Face Space sets to 0.0.0.0).
        port: TCP port; None lets gradio choose (``GRADIO_SERVER_PORT``, else 7860).
        app: a page made by :func:`~trainmem.web.layout.build_app`; default a new one.
        **kwargs: passed to ``gradio.Blocks.launch``.

    Returns:
        What ``Blocks.launch`` returns.

    Raises:
        ImportError: gradio is not installed (``pip install 'trainmem[web]'``).
    """
    import gradio as gr

    demo = app if app is not None else build_app()
    demo.queue(default_concurrency_limit=4)
    options: dict[str, Any] = {
        "server_name": host,
        "server_port": port,
        "theme": _theme(gr),
        "css": CSS,
        "ssr_mode": False,
        "max_file_size": MAX_UPLOAD,
        "show_error": False,
        "footer_links": [],
    }
    options.update(kwargs)
    return demo.launch(**options)
