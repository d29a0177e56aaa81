"""Bytes an autograd node keeps: the kernel stand-in tests (test_mamba_kernels.py,
test_fla_kernels.py) compare them with hand derivations from the kernels' code."""

from __future__ import annotations

from typing import Any


def saved_activation_bytes(node: Any, module: Any) -> int:
    """Bytes of the tensors the autograd ``node`` keeps, the parameters of ``module`` and
    repeated storages left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    total = 0
    for t in node.saved_tensors:
        if t is None:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in params or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total
