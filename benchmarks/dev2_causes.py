"""Named causes of the dev-2 rows trainmem misses (|error| > 5% or a predicted OOM for a run
that completed), read from each row's notes and source; ``benchmarks/validate.py`` prints
"unexplained" for a row not named here. A cause names a mechanism, never a fitted constant."""

from __future__ import annotations

CAUSES: dict[str, str] = {}
