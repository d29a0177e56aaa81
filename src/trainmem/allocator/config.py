"""``PYTORCH_CUDA_ALLOC_CONF`` parsing: the options that change the caching allocator's numbers.

Syntax (spec section 1.5): a comma-separated list of ``key:value``, whitespace ignored, e.g.
``"max_split_size_mb:100,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True"``.
Unspecified options take their defaults (a parse resets them, as PyTorch's does).

Source: ../shared/specs/cuda-caching-allocator.md sections 1.2 and 1.5, which summarise
``c10/core/AllocatorConfig.h``/``.cpp`` and ``c10/cuda/CUDAAllocatorConfig.h``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.allocator.constants import (
    K_LARGE_BUFFER,
    MAX_SPLIT_SIZE_UNLIMITED,
    ROUNDUP_POWER2_BUCKETS,
)
from trainmem.errors import SpecError, UnsupportedError
from trainmem.units import MiB

#: Options accepted by PyTorch that change no byte count of a single-device, non-graph trace
#: (spec section 1.5). They are accepted and ignored.
NO_EFFECT_OPTIONS: frozenset[str] = frozenset(
    {
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
    }
)

#: Options that change the numbers, all modelled.
MODELLED_OPTIONS: tuple[str, ...] = (
    "backend",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "large_segment_size_mb",
    "per_process_memory_fraction",
)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConfig:
    """Allocator options, in bytes, as the caching allocator reads them.

    Source: spec section 1.5 (table of options, defaults and validation).
    """

    max_split_size_bytes: int = MAX_SPLIT_SIZE_UNLIMITED
    """Blocks this size or larger are never split (``max_split_size_mb``); unlimited by default."""

    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    """An oversize request reuses a cached oversize block only if the block is less than this
    much bigger (``max_non_split_rounding_mb``, 2.6+; the fixed kLargeBuffer before)."""

    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_POWER2_BUCKETS
    """Divisions per size bucket (16 buckets, section 1.2); 0 means plain 512-byte rounding."""

    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory above which the GC frees old cached blocks; 0 is off."""

    expandable_segments: bool = False
    """Map pages into one growing virtual range per stream and pool (section 4)."""

    large_segment_size_bytes: int = K_LARGE_BUFFER
    """Segment size of 1-10 MiB requests and large expandable page size (2.10+)."""

    per_process_memory_fraction: float = 1.0
    """Cap on reserved memory as a fraction of device memory; 1.0 is no cap (2.9+ semantics)."""

    alloc_conf: str = ""
    """The raw string this config was parsed from."""

    ignored_options: tuple[str, ...] = field(default=())
    """Options that were given but change no byte count (see ``NO_EFFECT_OPTIONS``)."""

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_POWER2_BUCKETS:
            raise SpecError(
                "roundup_power2_divisions",
                f"needs {ROUNDUP_POWER2_BUCKETS} buckets, got {len(self.roundup_power2_divisions)}",
            )
        if self.max_split_size_bytes != MAX_SPLIT_SIZE_UNLIMITED and (
            self.max_split_size_bytes < K_LARGE_BUFFER
        ):
            raise SpecError("max_split_size_mb", "must be >= 20 (MiB)")
        if self.max_non_split_rounding_bytes < K_LARGE_BUFFER:
            raise SpecError("max_non_split_rounding_mb", "must be >= 20 (MiB)")
        if self.large_segment_size_bytes <= 10 * MiB:
            raise SpecError("large_segment_size_mb", "must be > 10 (MiB)")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise SpecError("garbage_collection_threshold", "must be strictly between 0 and 1")
        if not 0.0 < self.per_process_memory_fraction <= 1.0:
            raise SpecError("per_process_memory_fraction", "must be in (0, 1]")

    @property
    def max_split_size_is_set(self) -> bool:
        """True when ``max_split_size_mb`` was given (the oversize rules of section 2.4 apply)."""
        return self.max_split_size_bytes != MAX_SPLIT_SIZE_UNLIMITED

    def roundup_power2_divisions_dict(self) -> dict[str, int]:
        """Buckets keyed by their starting size in MiB, as snapshots store them (section 6.2)."""
        return {str(2**k): d for k, d in enumerate(self.roundup_power2_divisions)}

    @classmethod
    def from_string(
        cls, alloc_conf: str, *, torch_version: tuple[int, int] = (2, 9)
    ) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) string.

        Args:
            alloc_conf: e.g. ``"max_split_size_mb:100,expandable_segments:True"``; ``""`` gives the
                defaults.
            torch_version: (major, minor) of the PyTorch being modelled. It only changes the
                ``>`` key of a ``roundup_power2_divisions`` list: up to 2.8 it starts at the last
                named bucket and overwrites it, from 2.9 at the next one (spec section 1.2).

        Returns:
            The parsed config.

        Raises:
            SpecError: an unknown option or a value outside its allowed set; the message names
                the option and the allowed values.
            UnsupportedError: ``backend:cudaMallocAsync``, which is a different allocator.

        Source: spec section 1.5 and 1.2 (list syntax and bucket semantics).
        """
        kwargs: dict[str, object] = {}
        ignored: list[str] = []
        for key, value in _split_options(alloc_conf):
            if key == "max_split_size_mb":
                kwargs["max_split_size_bytes"] = _parse_mb(key, value, minimum=20) * MiB
            elif key == "max_non_split_rounding_mb":
                kwargs["max_non_split_rounding_bytes"] = _parse_mb(key, value, minimum=20) * MiB
            elif key == "large_segment_size_mb":
                kwargs["large_segment_size_bytes"] = _parse_mb(key, value, minimum=11) * MiB
            elif key == "roundup_power2_divisions":
                kwargs["roundup_power2_divisions"] = _parse_roundup(
                    value, legacy_gt=torch_version < (2, 9)
                )
            elif key == "garbage_collection_threshold":
                kwargs["garbage_collection_threshold"] = _parse_fraction(
                    key, value, "a number strictly between 0 and 1", allow_one=False
                )
            elif key == "per_process_memory_fraction":
                kwargs["per_process_memory_fraction"] = _parse_fraction(
                    key, value, "a number in (0, 1]", allow_one=True
                )
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise SpecError(key, f"expected True or False, got {value!r}")
                kwargs["expandable_segments"] = value == "True"
            elif key == "backend":
                if value == "cudaMallocAsync":
                    raise UnsupportedError(
                        "backend:cudaMallocAsync is CUDA's own pool allocator, which trainmem does "
                        "not simulate; remove it to model the default backend:native"
                    )
                if value != "native":
                    raise SpecError(key, f"expected native or cudaMallocAsync, got {value!r}")
            elif key in NO_EFFECT_OPTIONS:
                ignored.append(key)
            else:
                known = ", ".join(sorted((*MODELLED_OPTIONS, *NO_EFFECT_OPTIONS)))
                raise SpecError(
                    "PYTORCH_CUDA_ALLOC_CONF",
                    f"unrecognized option {key!r}; known options: {known}",
                )
        return cls(alloc_conf=alloc_conf, ignored_options=tuple(ignored), **kwargs)  # type: ignore[arg-type]


def _split_options(alloc_conf: str) -> list[tuple[str, str]]:
    """Split ``a:1,b:[x:1,y:2]`` into ``[("a", "1"), ("b", "[x:1,y:2]")]`` (whitespace dropped)."""
    text = "".join(alloc_conf.split())
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SpecError("PYTORCH_CUDA_ALLOC_CONF", f"unbalanced ']' in {alloc_conf!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SpecError("PYTORCH_CUDA_ALLOC_CONF", f"unbalanced '[' in {alloc_conf!r}")
    items.append(text[start:])
    out: list[tuple[str, str]] = []
    for item in items:
        if not item:
            continue
        key, sep, value = item.partition(":")
        if not sep or not value:
            raise SpecError(
                "PYTORCH_CUDA_ALLOC_CONF", f"expected key:value, got {item!r} in {alloc_conf!r}"
            )
        out.append((key, value))
    return out


def _parse_int(option: str, value: str, allowed: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecError(option, f"expected {allowed}, got {value!r}") from None


def _parse_mb(option: str, value: str, *, minimum: int) -> int:
    mb = _parse_int(option, value, f"an integer number of MiB >= {minimum}")
    if mb < minimum:
        raise SpecError(option, f"expected an integer number of MiB >= {minimum}, got {mb}")
    return mb


def _parse_fraction(option: str, value: str, allowed: str, *, allow_one: bool) -> float:
    try:
        x = float(value)
    except ValueError:
        raise SpecError(option, f"expected {allowed}, got {value!r}") from None
    if not (0.0 < x < 1.0 or (allow_one and x == 1.0)):
        raise SpecError(option, f"expected {allowed}, got {value!r}")
    return x


def _parse_roundup(value: str, *, legacy_gt: bool) -> tuple[int, ...]:
    """Parse ``4`` or ``[256:1,512:2,>:8]`` into 16 per-bucket division counts (section 1.2)."""
    option = "roundup_power2_divisions"
    allowed_single = "a power of two, or a list like [256:1,512:2,>:4]"
    if not value.startswith("["):
        d = _parse_int(option, value, allowed_single)
        if not _is_power_of_two(d):
            raise SpecError(option, f"expected {allowed_single}, got {value!r}")
        return (d,) * ROUNDUP_POWER2_BUCKETS
    if not value.endswith("]"):
        raise SpecError(option, f"expected a list like [256:1,512:2,>:4], got {value!r}")
    buckets = [0] * ROUNDUP_POWER2_BUCKETS
    last_index: int | None = None
    first = True
    for entry in value[1:-1].split(","):
        key, sep, val = entry.partition(":")
        if not sep:
            raise SpecError(option, f"expected size_mb:divisions entries, got {entry!r}")
        d = _parse_int(option, val, "0 or a power of two")
        if d != 0 and not _is_power_of_two(d):
            raise SpecError(option, f"divisions must be 0 or a power of two, got {d}")
        if key == ">":
            if last_index is None:
                raise SpecError(option, "'>' must follow at least one size_mb:divisions entry")
            # Deviation between versions: see the torch_version argument of from_string.
            start = last_index if legacy_gt else last_index + 1
            for k in range(start, ROUNDUP_POWER2_BUCKETS):
                buckets[k] = d
            continue
        size_mb = _parse_int(option, key, "a power-of-two size in MiB (1 to 32768) or '>'")
        if not _is_power_of_two(size_mb) or size_mb > 2 ** (ROUNDUP_POWER2_BUCKETS - 1):
            raise SpecError(
                option, f"sizes must be powers of two from 1 to 32768 (MiB), got {size_mb}"
            )
        index = size_mb.bit_length() - 1
        if first:
            for k in range(index):
                buckets[k] = d
            first = False
        buckets[index] = d
        last_index = index
    return tuple(buckets)
