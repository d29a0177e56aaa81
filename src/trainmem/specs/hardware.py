"""GPUSpec and the GPU catalog.

``memory_bytes`` is the usable capacity, the ``total_memory`` that
``torch.cuda.get_device_properties(0)`` reports (what ``cudaMemGetInfo`` calls total), which is
what PyTorch's out-of-memory message calls "total capacity". It is less than the marketing figure
(decimal GB on the datasheet) because the driver and ECC keep some memory. The figures are the
"GPU 0 has a total capacity of X GiB" values of PyTorch OOM messages as they appear in public bug
reports (2 decimals, so +-0.005 GiB); each entry also cites its vendor datasheet for the nominal
size. A user with a different board passes ``--gpu-memory`` instead.

``cuda_context_bytes`` is the memory a CUDA process holds outside the caching allocator once a
training step has run (driver context + lazily loaded kernels + cuBLAS/cuDNN handles). See
Note [CUDA context] below.

Note [CUDA context]
    PyTorch sets ``CUDA_MODULE_LOADING=LAZY`` since 1.13 (CUDA >= 11.7). PyTorch PR #86509 measured
    287,047,680 B total used after a first 6.4 MB tensor with lazy loading, against 666,632,192 B
    eager (each including one 20 MiB segment); unsloth-zoo PR #1053 measured 426 MiB on an RTX 6000
    Ada with PyTorch 2.10 + CUDA 13.0. After a training step more kernels have been loaded
    (autograd, optimizer, attention). We default to 500 MiB for current stacks
    (``DEFAULT_CUDA_CONTEXT_BYTES``) and use the measured 1343 MiB for the V100 + torch 1.10 era
    (HF ``perf_train_gpu_one`` docs, 2022) through ``LEGACY_CUDA_CONTEXT_BYTES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainmem.errors import SpecError
from trainmem.units import GiB, MiB

DEFAULT_CUDA_CONTEXT_BYTES = 500 * MiB
"""Context + kernels of a PyTorch 2.x process after a training step (lazy loading). See
Note [CUDA context]."""

LEGACY_CUDA_CONTEXT_BYTES = 1343 * MiB
"""Measured CUDA context of torch ~1.10 on a V100 without lazy loading (HF transformers docs,
``perf_train_gpu_one.mdx`` @0016acf7, "CUDA context alone 1343 MB" where MB means MiB)."""

LAZY_LOADING_SINCE_TORCH = (1, 13)
"""The torch release that sets ``CUDA_MODULE_LOADING=LAZY`` by default (PyTorch PR #86509,
torch/__init__.py / torch/cuda/__init__.py, released in 1.13 with CUDA 11.7)."""


def default_cuda_context_bytes(torch_version: tuple[int, ...] | None) -> int:
    """The CUDA context of a run on ``torch_version`` when the user gives none:
    :data:`DEFAULT_CUDA_CONTEXT_BYTES` with lazy module loading (torch >= 1.13, or None: a
    current release), else the eager-loading :data:`LEGACY_CUDA_CONTEXT_BYTES`. Note [CUDA
    context]."""
    if torch_version is not None and torch_version < LAZY_LOADING_SINCE_TORCH:
        return LEGACY_CUDA_CONTEXT_BYTES
    return DEFAULT_CUDA_CONTEXT_BYTES


DEFAULT_CUBLAS_WORKSPACE_BYTES = 8_519_680
"""cuBLAS workspace per (handle, stream) below compute capability 9.0: ``:4096:2:16:8`` =
4096 KiB x 2 + 16 KiB x 8 (aten/src/ATen/cuda/CublasHandlePool.cpp ``getChosenWorkspaceSize``);
32 MiB from 9.0 (PyTorch PR #89027)."""

HIPBLASLT_WORKSPACE_BYTES = 76 * MiB
"""hipBLASLt workspace per (handle, stream) on ROCm, separate from rocBLAS's
(aten/src/ATen/cuda/CublasHandlePool.cpp ``parseCUDABlasLtWorkspaceSize``: ``76*1024`` KiB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """A GPU model as the memory estimate sees it."""

    name: str
    """Catalog key, e.g. ``"A100-80GB"``."""
    memory_bytes: int
    """Usable capacity in bytes (``total_memory``), see module docstring."""
    nominal: str
    """Vendor's marketing capacity, e.g. ``"80 GB HBM2e"``."""
    compute_capability: str
    """CUDA compute capability (``"8.0"``) or the ROCm gfx target."""
    vendor: str
    """``nvidia`` or ``amd``."""
    datasheet: str
    """URL of the vendor datasheet."""
    cublas_workspace_bytes: int = DEFAULT_CUBLAS_WORKSPACE_BYTES
    """BLAS workspaces per (handle, stream), held through the caching allocator. NVIDIA: the
    cuBLAS workspace, 4096 KiB*2 + 16 KiB*8 = 8,519,680 B by default, 32 MiB on compute
    capability 9.x-12.x (PyTorch PR #89027); cuBLASLt shares it (unified workspace, the default).
    ROCm: the rocBLAS / hipBLAS workspace, 128 MiB on gfx942 / gfx950 (MI300X, MI355X), 32 MiB
    on other targets, plus hipBLASLt's own 76 MiB (not unified on ROCm). Source:
    aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize`` ("32MiB default, 128MiB
    for gfx94x/gfx95x") and ``parseCUDABlasLtWorkspaceSize`` (``workspace_size = 76*1024`` KiB
    "for hipBLASLt"; ``unified_cublas_and_lt_workspaces`` only ``#ifndef USE_ROCM``)."""
    peer_access: bool = True
    """Two boards of this model in one machine can map each other's memory
    (``cudaDeviceCanAccessPeer``) with NVIDIA's driver. False for the GeForce boards (RTX 3090,
    4090, 5090) over PCIe: the driver refuses it (the CUDA sample p2pBandwidthLatencyTest prints
    "CANNOT Access Peer" on 8 x RTX 3090, NVIDIA/nccl issue #1127; 2 x RTX 5090 "GNS = GPU not
    supported", noonghunna/club-3090 issue #1130; only patched open kernel modules enable it,
    tinygrad/ aikitoria open-gpu-kernel-modules), so NCCL connects them through host shared
    memory (Note [NCCL without peer access] in trainmem.analytic.buffers). An RTX 3090 pair
    with an NVLink bridge has peer access: pass ``--nccl-buffer-bytes`` for it."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise SpecError("memory_bytes", f"must be positive, got {self.memory_bytes}")


def _gpu(
    name: str,
    total_gib: float,
    nominal: str,
    cc: str,
    url: str,
    vendor: str = "nvidia",
    *,
    peer_access: bool = True,
) -> GPUSpec:
    major = int(cc.split(".")[0]) if vendor == "nvidia" else 0
    ws = 32 * MiB if major >= 9 else DEFAULT_CUBLAS_WORKSPACE_BYTES
    if vendor == "amd":  # rocBLAS (128 MiB on gfx942 / gfx950) + hipBLASLt's 76 MiB
        ws = (128 * MiB if cc in ("gfx942", "gfx950") else 32 * MiB) + HIPBLASLT_WORKSPACE_BYTES
    return GPUSpec(
        name=name,
        memory_bytes=round(total_gib * GiB),
        nominal=nominal,
        compute_capability=cc,
        vendor=vendor,
        datasheet=url,
        cublas_workspace_bytes=ws,
        peer_access=peer_access,
    )


_NV = "https://www.nvidia.com/"
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        _gpu("H100-80GB", 79.11, "80 GB HBM3", "9.0", _NV + "en-us/data-center/h100/"),
        _gpu("H100-94GB", 93.10, "94 GB HBM3 (H100 NVL)", "9.0", _NV + "en-us/data-center/h100/"),
        _gpu("H200", 139.72, "141 GB HBM3e", "9.0", _NV + "en-us/data-center/h200/"),
        _gpu("B200", 178.35, "180 GB HBM3e", "10.0", _NV + "en-us/data-center/dgx-b200/"),
        # no public OOM message found: HGX B100 boards carry the B200's 180 GB HBM3e
        _gpu(
            "B100",
            178.35,
            "180 GB HBM3e (inferred total_memory; pass --gpu <GiB>GiB for yours)",
            "10.0",
            _NV + "en-us/data-center/hgx/",
        ),
        _gpu("A100-80GB", 79.15, "80 GB HBM2e", "8.0", _NV + "en-us/data-center/a100/"),
        _gpu("A100-40GB", 39.39, "40 GB HBM2", "8.0", _NV + "en-us/data-center/a100/"),
        _gpu("A10G", 22.19, "24 GB GDDR6", "8.6", "https://aws.amazon.com/ec2/instance-types/g5/"),
        _gpu("A10", 22.06, "24 GB GDDR6", "8.6", _NV + "en-us/data-center/products/a10-gpu/"),
        _gpu("L4", 22.05, "24 GB GDDR6", "8.9", _NV + "en-us/data-center/l4/"),
        _gpu("L40S", 44.39, "48 GB GDDR6", "8.9", _NV + "en-us/data-center/l40s/"),
        _gpu(
            "RTX-4090",
            23.65,
            "24 GB GDDR6X",
            "8.9",
            _NV + "en-us/geforce/graphics-cards/40-series/rtx-4090/",
            peer_access=False,
        ),
        _gpu(
            "RTX-3090",
            23.69,
            "24 GB GDDR6X",
            "8.6",
            _NV + "en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/",
            peer_access=False,
        ),
        _gpu(
            "RTX-A6000", 47.54, "48 GB GDDR6", "8.6", _NV + "en-us/design-visualization/rtx-a6000/"
        ),
        # total_memory 31.37 GiB: the OOM message in Wan-Video/Wan2.1 issue 465 (2025-07)
        _gpu(
            "RTX-5090",
            31.37,
            "32 GB GDDR7",
            "12.0",
            _NV + "en-us/geforce/graphics-cards/50-series/rtx-5090/",
            peer_access=False,
        ),
        # 44.43 GiB with ECC on (as shipped): DINGYANB/MTVCrafter issue 21 (2025-07)
        _gpu(
            "RTX-6000-Ada",
            44.43,
            "48 GB GDDR6 ECC",
            "8.9",
            _NV + "en-us/design-visualization/rtx-6000/",
        ),
        # the L40S's board memory (48 GB GDDR6 with ECC): the L40S figure
        _gpu("L40", 44.39, "48 GB GDDR6 ECC", "8.9", _NV + "en-us/data-center/l40/"),
        # 95.00 GiB: modelscope/DiffSynth-Studio issue 1238 (2026-01)
        _gpu("H20", 95.00, "96 GB HBM3", "9.0", _NV + "en-us/data-center/h20/"),
        # no public OOM message found: inferred from the H20's same 96 GB HBM3 stacks
        _gpu(
            "GH200",
            95.00,
            "96 GB HBM3 (inferred total_memory; pass --gpu <GiB>GiB for yours)",
            "9.0",
            _NV + "en-us/data-center/grace-hopper-superchip/",
        ),
        _gpu("V100-16GB", 15.77, "16 GB HBM2", "7.0", _NV + "en-us/data-center/v100/"),
        _gpu("V100-32GB", 31.74, "32 GB HBM2", "7.0", _NV + "en-us/data-center/v100/"),
        _gpu("T4", 14.75, "16 GB GDDR6", "7.5", _NV + "en-us/data-center/tesla-t4/"),
        _gpu(
            "MI250",
            63.98,
            "128 GB HBM2e (2 GCDs x 64 GB; one GCD is one torch device)",
            "gfx90a",
            "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250.html",
            vendor="amd",
        ),
        _gpu(
            "MI300X",
            191.98,
            "192 GB HBM3",
            "gfx942",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
            vendor="amd",
        ),
        # no public OOM message found: 256 GiB less the MI300X's 20 MiB, inferred
        _gpu(
            "MI325X",
            255.98,
            "256 GB HBM3E (inferred total_memory; pass --gpu <GiB>GiB for yours)",
            "gfx942",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html",
            vendor="amd",
        ),
    )
}

_ALIASES = {
    "4090": "RTX-4090",
    "3090": "RTX-3090",
    "5090": "RTX-5090",
    "a6000": "RTX-A6000",
    "6000ada": "RTX-6000-Ada",
    "rtx6000ada": "RTX-6000-Ada",
}
"""Short names that name one catalog entry. ``A100``, ``H100`` and ``V100`` are not aliases:
each names two boards of different capacity, so they are refused with the choices."""


_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb)\s*$", re.IGNORECASE)
MAX_CUSTOM_CAPACITY_BYTES = 4 * 2**40
"""The largest capacity ``--gpu <N>GiB`` accepts (4 TiB: no single device comes close)."""


def _fold(name: str) -> str:
    """Case, spaces, hyphens, underscores and vendor prefixes ignored (``RTX4090`` ==
    ``rtx-4090`` == ``NVIDIA GeForce RTX 4090``)."""
    key = re.sub(r"[\s_-]+", "", name.strip().lower())
    for prefix in ("nvidia", "tesla", "geforce", "amd", "instinct"):
        key = key.removeprefix(prefix)
    return key


def custom_gpu(text: str) -> GPUSpec | None:
    """A GPU of any capacity: ``"32GB"`` (10^9 bytes) or ``"24GiB"`` / ``"23.65 GiB"`` (2^30)
    is the usable capacity, as ``torch.cuda.get_device_properties(0).total_memory`` reports it
    (give what your card reports: it is below the datasheet's figure). The cuBLAS workspace of
    an Ampere-class card is assumed (:data:`DEFAULT_CUBLAS_WORKSPACE_BYTES`). None if ``text``
    is not a capacity.

    Raises:
        SpecError: a capacity of 0 or above :data:`MAX_CUSTOM_CAPACITY_BYTES`.
    """
    m = _CAPACITY.match(text)
    if m is None:
        return None
    value, unit = float(m.group(1)), m.group(2).lower()
    n_bytes = round(value * (GiB if unit == "gib" else 10**9))
    if not 0 < n_bytes <= MAX_CUSTOM_CAPACITY_BYTES:
        raise SpecError("gpu", f"capacity {text.strip()!r} must be above 0 and at most 4096GiB")
    shown = f"{m.group(1)}{'GiB' if unit == 'gib' else 'GB'}"
    return GPUSpec(
        name=shown,
        memory_bytes=n_bytes,
        nominal=f"{shown} usable (given by the user)",
        compute_capability="8.0",
        vendor="nvidia",
        datasheet="",
    )


def resolve_gpu(gpu: str | GPUSpec | None) -> GPUSpec | None:
    """A GPU from its name (:func:`get_gpu`: ``"A100-80GB"``, ``"rtx-4090"``, ``"24GB"``), a
    GPUSpec, or None.

    Raises:
        SpecError: an unknown name, or neither a name nor a GPUSpec.
    """
    if gpu is None or isinstance(gpu, GPUSpec):
        return gpu
    return get_gpu(gpu)


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by catalog name, ignoring case, spaces and hyphens (``"a100-80gb"``,
    ``"RTX4090"``, ``"NVIDIA GeForce RTX 4090"``), by a prefix that names one entry
    (``"b200"``, ``"mi300"``), or give any usable capacity (``"32GB"``, ``"24GiB"``: see
    :func:`custom_gpu`).

    Raises:
        SpecError: not a string, an unknown GPU (the message lists close names and the
            catalog), or a name several entries share (``"A100"``: the message lists them).
    """
    if not isinstance(name, str) or not name.strip():
        raise SpecError(
            "gpu", f"must be a GPU name (see `trainmem gpus`) or a GPUSpec, got {name!r:.80}"
        )
    custom = custom_gpu(name[:100])
    if custom is not None:
        return custom
    folded = {_fold(k): k for k in GPUS}
    key = _fold(name)
    if key in folded:
        return GPUS[folded[key]]
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    matches = [
        k
        for k in folded
        if len(key) >= 3 and (k.startswith(key) or k.removeprefix("rtx").startswith(key))
    ]
    if len(matches) == 1:
        return GPUS[folded[matches[0]]]
    if len(matches) > 1:
        choices = ", ".join(folded[m] for m in matches)
        raise SpecError("gpu", f"{name!r:.80} is ambiguous: it could be {choices}; name one")
    import difflib  # NB: here: only an unknown name needs it

    close = difflib.get_close_matches(key[:100], list(folded), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(folded[c] for c in close)}?" if close else ""
    raise SpecError(
        "gpu",
        f"unknown GPU {name!r:.80}.{hint} Known: {', '.join(GPUS)}; or give the usable "
        "capacity, e.g. --gpu 32GB or --gpu 23.65GiB",
    )


def supports_fp8(gpu: GPUSpec) -> bool:
    """Whether the GPU has float8 tensor cores, which ``fp8-mixed`` (torchao float8 training)
    needs: NVIDIA compute capability 8.9 or later (Ada, Hopper, Blackwell; torchao refuses
    older devices), AMD CDNA3 (gfx942, gfx950)."""
    if gpu.vendor == "amd":
        return gpu.compute_capability in ("gfx942", "gfx950")
    major, _, minor = gpu.compute_capability.partition(".")
    return (int(major), int(minor or 0)) >= (8, 9)


def check_precision_on_gpu(precision: str, gpu: GPUSpec) -> None:
    """Refuse a precision the GPU cannot run.

    Raises:
        SpecError: ``fp8-mixed`` on a GPU without float8 tensor cores (V100, T4, A100, ...).
    """
    if precision == "fp8-mixed" and not supports_fp8(gpu):
        able = ", ".join(g.name for g in GPUS.values() if supports_fp8(g))
        raise SpecError(
            "precision",
            f"fp8-mixed needs float8 tensor cores, which {gpu.name} (compute capability "
            f"{gpu.compute_capability}) does not have; use bf16-mixed, or one of: {able}",
        )
