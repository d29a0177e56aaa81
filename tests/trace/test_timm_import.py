"""timm's import beside a torchvision whose C extension did not load (Note [torchvision without
its C ops]), without timm or torchvision installed: each case runs in its own interpreter with
stand-in ``torchvision`` / ``timm`` packages first on the path, since the op schemas it
defines live in torch's process-wide registry.

The stand-in torchvision does at import what torchvision 0.28.0 does when its ``_C.so`` did
not load: ``torch.library.register_fake("torchvision::nms")`` and ``("torchvision::qnms")``
unconditionally (torchvision/_meta_registrations.py:163, :177), which raises "operator
torchvision::nms does not exist". The expected schemas are the extension's own strings
(torchvision v0.28.0 torchvision/csrc/ops/nms.cpp, csrc/ops/quantized/cpu/qnms_kernel.cpp).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_DIR

pytest.importorskip("torch")

_FAKE_KERNELS = """
import torch

@torch.library.register_fake("torchvision::nms")
def _nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)

@torch.library.register_fake("torchvision::qnms")
def _qnms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)
"""

_EXTENSION_LOADED = """
import torch

_lib = torch.library.Library("torchvision", "FRAGMENT")
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""

_CHECK = """
import importlib.util
import json
import sys
import torch
from trainmem.errors import UnsupportedError
from trainmem.trace import _torch

_torch.require_torch()  # every traced path's first step: transformers imports torchvision too
out = {"torchvision": "torchvision" in sys.modules}
from trainmem.trace import timm_model

try:
    out["timm"] = timm_model.import_timm().__name__
except UnsupportedError as exc:
    out["error"] = str(exc)
out["defined"] = len(_torch._SCHEMA_LIBRARIES)
out["schemas"] = [
    str(getattr(torch.ops.torchvision, op).default._schema)
    for op in ("nms", "qnms")
    if hasattr(torch.ops.torchvision, op)
]
try:
    torch.ops.torchvision.nms(torch.zeros(2, 4), torch.zeros(2), 0.5)
    out["call"] = "ran"
except Exception as exc:
    out["call"] = type(exc).__name__
print(json.dumps(out))
"""


def _run(tmp_path: Path, torchvision_init: str) -> dict[str, object]:
    for name, text in {"torchvision": torchvision_init, "timm": "import torchvision\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_DIR / "src")])}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, check=True
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_missing_extension_gets_the_schemas_and_the_ops_still_fail(tmp_path: Path) -> None:
    out = _run(tmp_path, _FAKE_KERNELS)
    assert out["torchvision"] is True and out["timm"] == "timm"
    assert out["defined"] == 1
    assert out["schemas"] == [
        "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "torchvision::qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ]
    assert out["call"] == "NotImplementedError"  # a schema, no kernel


def test_nothing_is_defined_when_the_extension_loaded(tmp_path: Path) -> None:
    out = _run(tmp_path, _EXTENSION_LOADED + _FAKE_KERNELS)
    assert (out["timm"], out["defined"]) == ("timm", 0)


def test_another_torchvision_failure_is_a_one_line_error(tmp_path: Path) -> None:
    out = _run(tmp_path, "raise RuntimeError('torchvision broke otherwise')\n")
    assert out["torchvision"] is False
    assert out["defined"] == 0 and out["schemas"] == []
    assert "torchvision broke otherwise" in str(out["error"])
    assert "install the torchvision built for this torch" in str(out["error"])


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="needs an installed torchvision"
)
def test_transformers_models_import_beside_the_installed_torchvision() -> None:
    """With the installed torchvision (whatever its extension does), a transformers model's
    module imports after require_torch: transformers imports torchvision for every model."""
    code = (
        "from trainmem.trace._torch import require_torch\n"
        "require_torch()\n"
        "import transformers.models.qwen2.modeling_qwen2\n"
        "print('imported')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "imported", proc.stderr[-500:]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            {
                "context_parallel_size": 2,
                "tensor_parallel_size": 2,
                "sequence_parallel": True,
                "zero_stage": 3,
            },
            "context_parallel_size=2",
        ),
    ],
)
def test_timm_settings_train_py_does_not_run_are_refused(settings: dict, named: str) -> None:
    from trainmem.errors import UnsupportedError
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.timm_model import check_timm_settings

    with pytest.raises(UnsupportedError, match="traced: data parallelism") as info:
        check_timm_settings(TrainingConfig(**settings))
    assert named in str(info.value)
    check_timm_settings(TrainingConfig(activation_checkpointing="full"))  # timm's own: runs
    # pipeline stages are cut by torch's frontend (Note [Pipeline stages of a timm ViT])
    check_timm_settings(TrainingConfig(pipeline_parallel_size=2, gradient_accumulation_steps=4))
