"""Fetch a model's ``config.json`` from the Hugging Face Hub, bounded in time.

Only for an ``org/name`` hub id that is neither a preset nor a local path, and only when
``huggingface_hub`` is installed (``pip install trainmem[hub]``). Every way this can fail ends
in one :class:`~trainmem.errors.SpecError` line within :data:`HUB_FETCH_SECONDS` (plus the
:data:`HUB_PROBE_SECONDS` reachability probe): offline, a server that accepts and never
answers, an HTTP error status. ``huggingface_hub`` on its own retries a failed request with a
60 s timeout and backoff (``hf_hub_download``, ``_ETAG_RETRY_TIMEOUT``), which took 70 s and
34 log lines for an HTTP 500, and never returned for a silent server.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError

__all__ = ["HUB_CONFIG_FILES", "HUB_FETCH_SECONDS", "HUB_PROBE_SECONDS", "hub_config_path"]

HUB_PROBE_SECONDS = 1.5
"""How long to wait for the Hub's address and a TCP connection before calling it offline."""

HUB_FETCH_SECONDS = 10.0
"""The whole fetch (every request, every candidate file) ends within this many seconds."""

HUB_CONFIG_FILES: tuple[str, ...] = ("config.json", "transformer/config.json", "unet/config.json")
"""Where a Hub repository keeps the model's config: transformers at the root, diffusers
pipelines in the ``transformer`` (DiT) or ``unet`` subfolder (``model_index.json`` names them)."""

_HOW = (
    "download its config.json (e.g. on a machine with network access) and pass the path, "
    "or use a preset (`trainmem models`)"
)


def hub_config_path(repo_id: str) -> Path:
    """The local path of ``repo_id``'s model config: huggingface_hub's cache first (so a
    second run works offline), else one bounded download.

    Raises:
        SpecError: the hub extra is missing, ``HF_HUB_OFFLINE`` is set, the Hub is unreachable
            or does not answer in time, answers an HTTP error, or the repository has none of
            :data:`HUB_CONFIG_FILES`. The message says what happened and how to pass a file.
    """
    hub: Any
    try:
        import huggingface_hub as hub  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        hub = None
    if hub is not None:
        cached = _from_cache(hub, repo_id)
        if cached is not None:
            return cached
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise SpecError(
            "model",
            f"{repo_id!r} is not a preset, a local path or in the Hugging Face cache and "
            f"HF_HUB_OFFLINE is set; {_HOW}",
        )
    if hub is None:
        raise SpecError(
            "model",
            f"{repo_id!r} is not a preset or a local path; to read it from the Hugging Face "
            "Hub install the hub extra (pip install 'trainmem[hub]'), or download its "
            "config.json and pass the path. List presets with `trainmem models`.",
        )
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    reason = _unreachable(endpoint)
    if reason is not None:
        raise SpecError(
            "model",
            f"{repo_id!r} is not a preset or a local path and the Hugging Face Hub is "
            f"unreachable ({reason}); {_HOW}",
        )
    found: list[Path | BaseException | None] = []
    thread = threading.Thread(target=_download, args=(hub, repo_id, endpoint, found), daemon=True)
    thread.start()
    thread.join(HUB_FETCH_SECONDS)
    if not found:  # the thread ends by itself: every request it makes has this timeout
        problem = f"no answer within {HUB_FETCH_SECONDS:g} s"
    elif isinstance(found[0], Path):
        return found[0]
    elif found[0] is None:
        raise SpecError(
            "model",
            f"{repo_id!r} on the Hugging Face Hub has none of {', '.join(HUB_CONFIG_FILES)}; "
            "pass a local path to the model's config.json instead",
        )
    else:
        problem = _describe(found[0])
    raise SpecError(
        "model",
        f"could not fetch the config.json of {repo_id!r} from {endpoint} ({problem}); {_HOW}",
    )


def _download(hub: Any, repo_id: str, endpoint: str, found: list[Any]) -> None:
    """Append the path of the first of :data:`HUB_CONFIG_FILES` the repository has (None if
    none), or the exception that stopped the fetch. One HEAD without retries first, so a
    failing server is reported at once instead of after huggingface_hub's retry schedule."""
    from huggingface_hub.errors import (  # type: ignore[import-not-found,unused-ignore]
        EntryNotFoundError,
    )

    no_retries = (
        {"retry_on_errors": False}
        if "retry_on_errors" in inspect.signature(hub.get_hf_file_metadata).parameters
        else {}
    )
    try:
        for filename in HUB_CONFIG_FILES:
            url = hub.hf_hub_url(repo_id, filename, endpoint=endpoint)
            try:
                hub.get_hf_file_metadata(url, timeout=HUB_FETCH_SECONDS, **no_retries)
            except EntryNotFoundError:
                continue  # a diffusers pipeline: its model config is in a subfolder
            path = hub.hf_hub_download(
                repo_id=repo_id,
                filename=filename,
                cache_dir=_cache_dir(),
                endpoint=endpoint,
                etag_timeout=HUB_FETCH_SECONDS,
            )
            found.append(Path(path))
            return
        found.append(None)
    except BaseException as exc:  # noqa: BLE001 - reported by the caller as one line
        found.append(exc)


def _describe(exc: BaseException) -> str:
    """What went wrong, in a few words: the HTTP status, a timeout, or the error's class."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        name = (
            "repository not found or gated"
            if type(exc).__name__.startswith(("RepositoryNotFound", "GatedRepo"))
            else getattr(response, "reason_phrase", "") or ""
        )
        return f"HTTP {status}{' ' + name if name else ''}"
    if "timeout" in type(exc).__name__.lower() or isinstance(exc, TimeoutError):
        return f"no answer within {HUB_FETCH_SECONDS:g} s"
    detail = " ".join(str(exc).split())[:120]
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE`` as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_CACHE") or None


def _from_cache(hub: Any, repo_id: str) -> Path | None:
    """The config of ``repo_id`` if an earlier run cached it (no network):
    ``huggingface_hub.try_to_load_from_cache`` for each of :data:`HUB_CONFIG_FILES`."""
    for filename in HUB_CONFIG_FILES:
        try:
            path = hub.try_to_load_from_cache(repo_id, filename, cache_dir=_cache_dir())
        except ValueError:  # not a valid repo id for the hub library
            return None
        if isinstance(path, str):
            return Path(path)
    return None


def _unreachable(endpoint: str) -> str | None:
    """None if a TCP connection to the Hub's host opens within :data:`HUB_PROBE_SECONDS`, else
    why not. ``huggingface_hub`` itself retries a dead network for about 25 s; this answers in
    under 2. Name resolution runs in a daemon thread because ``getaddrinfo`` has no timeout."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (80 if parts.scheme == "http" else 443)
    found: list[Any] = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS)
    if not found:
        return f"no answer resolving {host} within {HUB_PROBE_SECONDS} s"
    if isinstance(found[0], OSError):
        return f"cannot resolve {host}: {found[0]}"
    family, kind, proto, _, address = found[0][0]
    left = max(HUB_PROBE_SECONDS - (time.monotonic() - start), 0.1)
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(left)
            sock.connect(address)
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"
    return None
