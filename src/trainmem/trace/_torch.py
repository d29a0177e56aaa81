"""Lazy access to the ``trace`` extra (torch, transformers, peft).

``import trainmem`` and ``import trainmem.trace`` must not import torch; every module of the trace
engine that needs torch imports it inside functions, or is itself imported only from a function
that called :func:`require_torch` first.

Note [torchvision without its C ops]
    transformers imports torchvision whenever it is installed, for every model (5.24
    modeling_utils.py:84 -> loss/loss_utils.py -> ... -> image_utils.py:59 ``from
    torchvision.transforms import InterpolationMode``), and timm unconditionally (timm 1.0.31
    timm/layers/create_norm.py:29, ``from torchvision.ops.misc import FrozenBatchNorm2d``). A
    torchvision wheel built for another
    torch (PyPI's torchvision 0.28.0 is a CUDA build; beside the CPU torch 2.13.0 wheel its
    ``_C.so`` cannot load ``libc10_cuda.so``) still imports its Python code: the load failure
    is caught (torchvision/extension.py ``_load_library``, ``_has_ops()`` is then False) and
    every op wrapper checks ``_assert_has_ops()``. Only torchvision/_meta_registrations.py:163
    and :177 register fake kernels for ``torchvision::nms`` / ``qnms`` unconditionally, and
    ``torch.library.register_fake`` raises "operator torchvision::nms does not exist" when the
    extension, which defines their schemas, did not load. So when that import fails that way,
    trainmem defines the two schemas the extension would have defined (torchvision v0.28.0
    torchvision/csrc/ops/nms.cpp and csrc/ops/quantized/cpu/qnms_kernel.cpp, the same strings
    as in the wheel's ``_C.so``), with no kernel, and imports torchvision again. Calling either
    op still fails (``torchvision.ops.nms`` -> ``_assert_has_ops`` RuntimeError; the raw op ->
    NotImplementedError, no CPU kernel), and no image model timm builds calls them (they are
    detection ops, and no transformers or timm training forward calls them either). When the
    extension loaded, the import succeeds the first time and nothing is defined; without
    torchvision nothing is imported. Found with torch 2.13.0+cpu and torchvision 0.28.0+cu130:
    without this step every transformers modeling module fails to import there.

Source: torchvision v0.28.0 torchvision/_meta_registrations.py, torchvision/extension.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

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


TORCHVISION_OP_SCHEMAS: dict[str, str] = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
"""The ops torchvision's meta registrations need to exist, by name, with the schema its C
extension defines (Note [torchvision without its C ops])."""

_SCHEMA_LIBRARIES: list[Any] = []
"""The ``torch.library.Library`` holding those schemas: a Library removes its definitions when
it is garbage-collected, so it lives as long as the process."""


def import_torchvision(torch: Any) -> None:
    """Import torchvision if it is installed; if that fails only because its C extension did
    not load, define the schemas of the ops its meta registrations need and import it again
    (Note [torchvision without its C ops]). Any other failure is left to the import that needs
    torchvision (transformers', timm's) to report."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        missing = [op for op in TORCHVISION_OP_SCHEMAS if not hasattr(torch.ops.torchvision, op)]
        if "torchvision::" not in str(exc) or not missing:
            return
        library = torch.library.Library("torchvision", "FRAGMENT")
        for op in missing:
            library.define(TORCHVISION_OP_SCHEMAS[op])
        _SCHEMA_LIBRARIES.append(library)
        try:
            import torchvision  # noqa: F401, F811
        except RuntimeError:
            return


def require_torch() -> ModuleType:
    """Import and return torch, or explain how to install it; import torchvision too when it
    is installed (Note [torchvision without its C ops]).

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
    import_torchvision(torch)
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
