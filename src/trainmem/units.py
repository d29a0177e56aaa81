"""Byte units. Binary units (KiB, MiB, GiB = 2**10, 2**20, 2**30) are used for every report;
decimal units (KB, MB, GB = 10**3, 10**6, 10**9) only echo a vendor's or a paper's number.
"""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
KB = 10**3
MB = 10**6
GB = 10**9

#: Bytes per element of each dtype, torch spellings. ``nf4``/``int4`` are 0.5 byte and never used
#: through this table (quantized storage has its own layout in the analytic engine).
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int64": 8,
    "int32": 4,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (torch spelling, e.g. ``"bfloat16"``).

    Raises:
        KeyError: for a dtype that is not in :data:`DTYPE_BYTES`.
    """
    return DTYPE_BYTES[dtype]


def format_bytes(n_bytes: int | float, unit: str = "GiB", digits: int = 2) -> str:
    """Format a byte count in a named unit, e.g. ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    factor = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "KB": KB, "MB": MB, "GB": GB}[
        unit
    ]
    return f"{n_bytes / factor:.{digits}f} {unit}"


def gib_text(n_bytes: int | float) -> str:
    """Bytes as GiB (2^30) with two decimals and thousands separators (``"12.34"``): the one
    formatter every table, the page and the notes use."""
    return f"{n_bytes / GiB:,.2f}"
