"""CUDA's autocast cast policy, run on CPU tensors.

The traced tensors live on the CPU, where ``torch.autocast("cpu")`` applies the *CPU* cast lists,
which differ from CUDA's: on CUDA ``layer_norm``, ``softmax``, ``log_softmax``, ``pow``,
``rsqrt``, ``exp``, ``sum``, ... run in fp32, and ``addmv``/``einsum``/``mv`` in 16 bits
(``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``; torch 2.13). Activation dtypes, and so
activation bytes, follow from those lists.

:func:`cuda_autocast_policy` re-registers the ``AutocastCPU`` dispatch key with CUDA's lists
through ``torch.library.Library("aten", "IMPL")``: each op of a CUDA list gets a Python kernel
doing what ``at::autocast::WrapFunction_`` does for its policy; every other op with a CPU
autocast kernel gets a fallthrough. The kernels run above autograd (the ``AutocastCPU`` key
precedes ``AutogradCPU``), so the casts are recorded in the graph exactly as on CUDA.
``torch.autocast("cpu", dtype)`` then turns the key on. The registrations are removed on exit
(``Library._destroy``), restoring CPU autocast.

The cast cache mirrors ``at::autocast::cached_cast`` (``aten/src/ATen/autocast_mode.cpp``):
lower-precision casts of fp32 leaf tensors that require grad (the weights) are cached until the
outermost autocast region exits (``torch.clear_autocast_cache``, which this module wraps), so each
weight's 16-bit copy lives through the forward pass.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = [
    "CUDA_FP32",
    "CUDA_FP32_SET_OPT_DTYPE",
    "CUDA_LOWER_PRECISION_FP",
    "CUDA_PROMOTE",
    "cast_for_autocast",
    "cuda_autocast_policy",
]

# aten/src/ATen/autocast_mode.h (torch 2.13), AT_FORALL_LOWER_PRECISION_FP.
CUDA_LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    # autocast_mode.cpp registers these two next to the list
    "cudnn_convolution", "cudnn_convolution_transpose",
)  # fmt: skip

# AT_FORALL_FP32
CUDA_FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)  # fmt: skip

# AT_FORALL_FP32_SET_OPT_DTYPE
CUDA_FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip

# AT_FORALL_PROMOTE
CUDA_PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip

_AUTOCAST_KEY = "AutocastCPU"

# id(source TensorImpl proxy) -> (weakref to source, casted); see Note in the module docstring.
_cast_cache: dict[int, tuple[weakref.ref[Any], Any]] = {}


def _eligible(t: Any) -> bool:
    """``at::autocast::is_eligible``: a defined floating tensor of the device, not fp64."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype != torch.float64
        and t.device.type == "cpu"
    )


def cast_for_autocast(t: Any, to: Any) -> Any:
    """``at::autocast::cached_cast``: cast an eligible tensor, caching lower-precision copies of
    fp32 leaf tensors that require grad until the autocast region exits.

    Args:
        t: anything; non-eligible values are returned unchanged.
        to: target dtype.

    Returns:
        ``t`` or its cast.
    """
    if not _eligible(t) or t.dtype == to:
        return t
    can_cache = (
        to == torch.get_autocast_dtype("cpu")
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
    )
    if not can_cache:
        return t.to(to)
    hit = _cast_cache.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    casted = t.to(to)
    _cast_cache[id(t)] = (weakref.ref(t), casted)
    return casted


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


def _flat_tensors(values: Any) -> Iterator[Any]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _flat_tensors(v)


def _make_kernel(op: Any, policy: str) -> Any:
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_index = next(
        (i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only),
        None,
    )

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lp = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy == "lower_precision_fp":
                args = _map(args, lambda t: cast_for_autocast(t, lp))
                kwargs = {k: _map(v, lambda t: cast_for_autocast(t, lp)) for k, v in kwargs.items()}
            elif policy == "fp32":
                args = _map(args, lambda t: cast_for_autocast(t, torch.float32))
                kwargs = {
                    k: _map(v, lambda t: cast_for_autocast(t, torch.float32))
                    for k, v in kwargs.items()
                }
            elif policy == "fp32_set_opt_dtype":
                # Only if the first argument is eligible; never override an explicit dtype.
                if args and _eligible(args[0]):
                    if dtype_index is not None and len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs["dtype"] = torch.float32
            elif policy == "promote":
                widest = lp
                for t in _flat_tensors((*args, *kwargs.values())):
                    if _eligible(t):
                        widest = torch.promote_types(widest, t.dtype)
                args = _map(args, lambda t: cast_for_autocast(t, widest))
                kwargs = {
                    k: _map(v, lambda t: cast_for_autocast(t, widest)) for k, v in kwargs.items()
                }
            return op(*args, **kwargs)

    return kernel


def _resolve(name: str) -> Any:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def _cpu_autocast_ops() -> list[str]:
    """Names (``op.overload``) of aten ops with an ``AutocastCPU`` kernel registered now."""
    out = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified, _AUTOCAST_KEY
        ):
            out.append(qualified[len("aten::") :])
    return out


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Within the block, ``torch.autocast("cpu", ...)`` applies CUDA's cast lists.

    Yields:
        None.

    Known limitations: ``norm`` (``fp32_append_dtype``, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE)
    keeps the CPU behaviour; it does not appear in the transformer models traced here.
    """
    policies: dict[str, str] = {}
    for names, policy in (
        (CUDA_LOWER_PRECISION_FP, "lower_precision_fp"),
        (CUDA_FP32, "fp32"),
        (CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
        (CUDA_PROMOTE, "promote"),
    ):
        for n in names:
            policies[n] = policy
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        _cast_cache.clear()
        original_clear()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name in _cpu_autocast_ops():
                if name not in policies:
                    lib.impl(name, torch.library.fallthrough_kernel, _AUTOCAST_KEY)
            for name, policy in policies.items():
                op = _resolve(name)
                if op is not None:
                    lib.impl(name, _make_kernel(op, policy), _AUTOCAST_KEY)
        torch.clear_autocast_cache = clear_autocast_cache  # type: ignore[attr-defined]
        yield
    finally:
        torch.clear_autocast_cache = original_clear  # type: ignore[attr-defined]
        _cast_cache.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib._destroy()
