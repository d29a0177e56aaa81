"""Test model: the CS336 course transformer (``BasicsTransformerLM``), its AdamW and its
cross-entropy, for ``benchmarks/snapshot_traced_step.py`` (the real snapshots
../shared/validation/snapshots S001-S049 profile it). The code lives in the trace engine, which
builds it for ``model_type: "cs336_basics"`` configs: :mod:`trainmem.trace.course_model`.
Requires torch.
"""

from __future__ import annotations

from trainmem.trace.course_model import (
    BasicsLM,
    CourseAdamW,
    course_cross_entropy,
    course_log_softmax,
)

__all__ = ["BasicsLM", "CourseAdamW", "course_cross_entropy", "course_log_softmax"]
