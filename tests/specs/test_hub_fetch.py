"""A hub id against a misbehaving Hub (issue 29, item 1): one bounded wait, one line that says
what happened and how to pass a local config.json. The fake Hubs listen on 127.0.0.1 only and
stop with the test."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs import hub
from trainmem.specs.hf import load_hf_config

pytest.importorskip("huggingface_hub")


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """A socket that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(1)
    for conn in held:
        conn.close()
    server.close()


class _Answer500(BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # noqa: N802 - http.server's spelling
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def failing_hub() -> Iterator[str]:
    """An HTTP server that answers every request with 500."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer500)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(1)


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))


def test_a_silent_hub_is_one_bounded_wait(silent_hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", silent_hub)
    monkeypatch.setattr(hub, "HUB_FETCH_SECONDS", 0.5)  # 10 s in use; hung for ever before
    start = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_hf_config("some-org/some-model")
    assert time.monotonic() - start < 1.5
    text = str(info.value)
    assert "\n" not in text
    assert "no answer within 0.5 s" in text and "pass the path" in text


def test_an_http_500_is_one_line_that_names_it(
    invoke: Invoke, failing_hub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", failing_hub)
    start = time.monotonic()
    result = invoke("estimate", "some-org/some-model", exit_code=2)
    assert time.monotonic() - start < 1.5  # was 70 s of retries
    err = result.stderr.strip()
    assert "\n" not in err, err  # was 34 lines
    assert err.startswith("error: model: ") and "HTTP 500" in err and "pass the path" in err
    assert "does not exist" not in err
