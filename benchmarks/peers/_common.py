"""Shared by the peer adapters: read the row requests, build a model on ``meta``, answer JSON.

Runs inside ``benchmarks/.peers-venv`` (made by ``setup_venv.sh``), never in trainmem's own
environment, and never imports trainmem. Protocol: a JSON list of requests on stdin, each
``{"id", "config": HF config.json dict, "training": TrainingConfig fields, "metric"}``; a JSON
object on stdout: ``{"tool", "version", "notes": [...], "results": {id: {"predicted_bytes": int}
| {"cannot_express": reason}}}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

Answer = dict[str, Any]


def method(training: dict[str, Any]) -> str:
    """``full``, ``lora`` or ``qlora`` from the TrainingConfig fields."""
    if training.get("quantize_base", "none") != "none":
        return "qlora"
    return "lora" if training.get("lora_rank", 0) else "full"


def common_limits(training: dict[str, Any], *, tool: str) -> str | None:
    """The reason a peer that knows only full fine-tuning with Adam cannot express a row."""
    m = method(training)
    if m != "full":
        label = {"lora": "LoRA", "qlora": "QLoRA"}[m]
        return f"{tool} has no {label} (it would count every parameter as trained)"
    opt = training.get("optimizer", "adamw")
    if opt not in ("adam", "adamw"):
        return f"{tool} assumes Adam; the row uses {opt}"
    return None


def build_meta_model(config: dict[str, Any], *, base_model: bool = False) -> Any:
    """The transformers model of a config.json dict on the meta device, in float32.

    ``base_model=True`` builds ``AutoModel`` (no task head), as accelerate's estimate-memory
    does; otherwise the class named in ``architectures``.
    """
    import torch
    import transformers
    from accelerate import init_empty_weights

    cfg = transformers.AutoConfig.for_model(**config)
    with init_empty_weights():
        if base_model:
            return transformers.AutoModel.from_config(cfg, dtype=torch.float32)
        arch = (config.get("architectures") or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        if cls is None:
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        return cls._from_config(cfg, dtype=torch.float32)


def serve(
    tool: str,
    package: str,
    answer: Callable[[dict[str, Any]], Answer],
    notes: list[str] | None = None,
) -> None:
    """Read requests from stdin, answer each (exceptions become ``error``), print JSON."""
    requests = json.load(sys.stdin)
    results: dict[str, Answer] = {}
    for req in requests:
        try:
            # Peers print tables and log lines; keep stdout for the JSON answer.
            with contextlib.redirect_stdout(io.StringIO()):
                results[req["id"]] = answer(req)
        except Exception as exc:  # noqa: BLE001 - report, do not crash the benchmark
            results[req["id"]] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out = {
        "tool": tool,
        "version": f"{package}=={version(package)}",
        "notes": notes or [],
        "results": results,
    }
    json.dump(out, sys.stdout)
