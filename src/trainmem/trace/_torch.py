"""Lazy access to the ``trace`` extra (torch, transformers, peft).

``import trainmem`` and ``import trainmem.trace`` must not import torch; every module of the trace
engine that needs torch imports it inside functions, or is itself imported only from a function
that called :func:`require_torch` first.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

INSTALL_HINT = "pip install 'trainmem[trace]'"

QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Third-party loggers whose import-time chatter (torchao's "Failed to load <CUDA kernel
library>" on a CPU build, torch's pytree deprecation notes about torchao's enums) says nothing
about the user's run; their warnings are dropped so that trainmem's own one-line errors lead.
Errors still show."""


SILENT_LOGGERS = ("torch._subclasses.fake_tensor",)
"""Loggers whose errors trainmem reports itself: the fake-tensor mode logs the traceback of an
op that fails on fake tensors ("failed while attempting to run meta for aten.mul.Tensor", 50
lines for a GPT-J config whose ``rotary_dim`` does not fit its heads) and then raises it, and
the trace engine turns that into one ``error: the traced step failed: ...`` line."""


QUIET_LIBRARIES = ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY")
"""transformers' and diffusers' own verbosity variables (``utils/logging.py`` of each reads its
variable when the library first configures its logger): their import-time and fallback-kernel
warnings (``causal_conv1d_fn`` "falling back to its reference PyTorch implementation", which is
about speed on a GPU, not memory) are raised to errors, unless the user set the variable."""


def quiet_third_party_logs() -> None:
    """Raise :data:`QUIET_LOGGERS` to ERROR, :data:`SILENT_LOGGERS` above CRITICAL and
    :data:`QUIET_LIBRARIES` to ``error`` unless already set (called before torch and its
    extensions load)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in SILENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    for variable in QUIET_LIBRARIES:
        os.environ.setdefault(variable, "error")


def require_torch() -> ModuleType:
    """Import and return torch, or explain how to install it.

    Returns:
        The ``torch`` module.

    Raises:
        ImportError: torch is not installed; the message names the install command.
    """
    quiet_third_party_logs()
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the trace engine needs PyTorch, which is not installed: {INSTALL_HINT}"
        ) from exc
    return torch


def require_transformers() -> ModuleType:
    """Import and return transformers, or explain how to install it.

    Returns:
        The ``transformers`` module.

    Raises:
        ImportError: transformers is not installed; the message names the install command.
    """
    require_torch()
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"tracing a Hugging Face config needs transformers, which is not installed: "
            f"{INSTALL_HINT}"
        ) from exc
    return transformers
