"""Run ``F.dropout`` as CUDA does: the fused ``native_dropout`` with a bool mask.

On CPU, ``at::native::dropout`` (``aten/src/ATen/native/Dropout.cpp``, ``_dropout_impl``) draws
a noise tensor *in the input dtype* (``empty_like(input).bernoulli_``) and multiplies by it, so
autograd saves a 4-byte (fp32) noise element per activation. On CUDA ``is_fused_kernel_acceptable``
holds (CUDA tensor, 0 < p < 1) and ``at::native_dropout`` runs instead, whose saved mask is
``bool`` (1 byte per element; ``aten/src/ATen/native/cuda/Dropout.cu``, ``dropout_cuda``). For
GPT-2 fp32 that is 3 bytes per element of every dropout, and for eager attention 3 bytes per
element of the [b, a, s, s] probabilities.

The patch replaces the attribute ``torch.nn.functional.dropout``, which ``nn.Dropout`` and
transformers call at run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch

torch = require_torch()
F = torch.nn.functional

__all__ = ["cuda_dropout"]


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """Within the block, ``F.dropout`` in training with 0 < p < 1 calls ``torch.native_dropout``.

    Yields:
        None.
    """
    original = F.dropout

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:  # noqa: A002
        if not training or p <= 0.0 or p >= 1.0 or inplace or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, training)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
