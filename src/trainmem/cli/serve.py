"""CLI command ``serve``: the web calculator (:mod:`trainmem.web`), added to trainmem's typer
app by :func:`register`.

No ``from __future__ import annotations``: typer reads the option annotations at registration.
"""

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app`` (trainmem's CLI app)."""
    from trainmem.cli.common import clean_errors
    from trainmem.errors import SpecError

    @app.command(name="serve")
    @clean_errors
    def serve_cmd(
        host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="TCP port.")] = 7860,
    ) -> None:
        """Start the web calculator in a browser page and print its URL (needs gradio: the
        web extra of trainmem)."""
        if not 1 <= port <= 65535:  # before the URL is printed and gradio tracebacks on it
            raise SpecError("port", f"{port} is not a TCP port; allowed: 1..65535")
        from trainmem.web import launch

        try:
            import gradio  # noqa: F401 - fail before printing a URL that will not answer
        except ImportError:
            raise ImportError(
                "the web calculator needs gradio: pip install 'trainmem[web]'"
            ) from None
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(f"trainmem web calculator: http://{shown}:{port}  (Ctrl+C to stop)", flush=True)
        try:
            launch(host=host, port=port, quiet=True)
        except OSError as exc:
            raise SpecError("port", f"cannot listen on {host}:{port}: {exc}") from exc
