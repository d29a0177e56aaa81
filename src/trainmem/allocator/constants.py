"""Constants of PyTorch's CUDA caching allocator (``backend:native``).

Every value below is unchanged from PyTorch 1.x through main (spec section 1.1). Until about 2.8
they live at the top of ``c10/cuda/CUDACachingAllocator.cpp``; in main they moved to
``c10/core/AllocatorConfig.h``.

Source: https://github.com/pytorch/pytorch/blob/eb42ad6eca0ce61e7c581212b4bf32f991425571/c10/cuda/CUDACachingAllocator.cpp
(``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``, ``kLargeBuffer``, ``kMinLargeAlloc``,
``kRoundLarge``) and ../shared/specs/cuda-caching-allocator.md sections 1.1, 1.4, 3.5, 4.1.
"""

from __future__ import annotations

#: Every block size is a multiple of this (bytes). ``kMinBlockSize`` in CUDACachingAllocator.cpp.
K_MIN_BLOCK_SIZE = 512

#: Largest *rounded* size served by the small pool, inclusive (bytes). ``kSmallSize``.
K_SMALL_SIZE = 1_048_576

#: Segment size for small requests; page size of small expandable segments (bytes).
#: ``kSmallBuffer``.
K_SMALL_BUFFER = 2_097_152

#: Segment size for large requests under ``K_MIN_LARGE_ALLOC``; page size of large expandable
#: segments; default of ``max_non_split_rounding_mb`` (bytes). ``kLargeBuffer``.
K_LARGE_BUFFER = 20_971_520

#: Large requests at or above this get a segment of their own (bytes). ``kMinLargeAlloc``.
K_MIN_LARGE_ALLOC = 10_485_760

#: Granularity of segments for requests of ``K_MIN_LARGE_ALLOC`` and more (bytes). ``kRoundLarge``.
K_ROUND_LARGE = 2_097_152

#: ``max_split_size`` when the option is unset: SIZE_MAX in C++ (no block is "oversize").
#: Snapshots and ``memory_stats()`` report it as -1 (SIZE_MAX cast to int64), spec section 6.2.
MAX_SPLIT_SIZE_UNLIMITED = 2**64 - 1

#: Number of ``roundup_power2_divisions`` buckets (spec section 1.2): bucket k covers
#: [2^k MiB, 2^(k+1) MiB), bucket 0 also everything below, bucket 15 everything above.
ROUNDUP_POWER2_BUCKETS = 16

#: Virtual range reserved per expandable segment, as a multiple of total device memory
#: (``totalGlobalMem + totalGlobalMem / 8`` in ExpandableSegment's constructor), spec 4.1.
EXPANDABLE_VIRTUAL_NUM = 9
EXPANDABLE_VIRTUAL_DEN = 8

#: Device total assumed for the expandable virtual range when no capacity is given (bytes).
#: Only changes invented addresses, never a byte count. NB: trainmem's own choice, not PyTorch's.
DEFAULT_VIRTUAL_DEVICE_BYTES = 2**40

#: Link printed at the end of PyTorch's out-of-memory message (2.2+ wording), spec section 3.5.
OOM_DOCS_URL = "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
