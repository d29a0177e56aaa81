"""The analytic engine's step against a real GPU's snapshot of the CS336 course transformer
(issue 13), and the course-code terms that explain the difference.

Expected values: the real GPU's (S001's 512-byte-rounded requested peak and exact peak reserved,
read from the snapshot), and for the per-layer terms a real execution on CPU: the bytes of the
distinct storages autograd saves in one course layer (``saved_tensors_hooks`` on
``benchmarks/cs336_lm.py``'s block), which must equal the analytic engine's layer terms plus the
course terms computed from the course code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import snapshot_analytic_step as bench  # noqa: E402

from trainmem.analytic.activations import activation_profile  # noqa: E402
from trainmem.estimate import resolve_model  # noqa: E402


def _case(case_id: str) -> bench.Case:
    (case,) = [c for c in bench.CASES if c.id == case_id]
    return case


def test_course_layer_terms_match_a_cpu_execution(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from cs336_lm import BasicsLM

    b, s, h, a, i, v = 2, 8, 16, 2, 32, 50
    config = json.loads((bench.CONFIGS / "cs336-small.json").read_text())
    config.update(
        hidden_size=h, intermediate_size=i, num_attention_heads=a, num_key_value_heads=a,
        head_dim=h // a, num_hidden_layers=1, vocab_size=v,
    )  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    case = bench.Case("tiny", v, h, 1, a, i, b, s, "none", False, "32-true", "tiny")
    training = bench.training_of(case)
    model = resolve_model(str(path))
    terms = {t.name: t.bytes for t in bench.course_terms(case, model, training)}
    predicted = (
        sum(activation_profile(model, training).terms.values())
        + terms["softmax_saved"]
        + terms["silu_saved"]
        + terms["softmax_stats"]
    )

    lm = BasicsLM(v, s, h, 1, a, i)
    owned = {p.untyped_storage().data_ptr() for p in [*lm.parameters(), *lm.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(b, s, h, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm.layers[0](x)
    assert predicted == sum(saved.values())
    # the course terms are what makes the difference: the analytic terms alone are short
    assert sum(activation_profile(model, training).terms.values()) < sum(saved.values())


def test_analytic_step_and_course_terms_against_the_real_gpu() -> None:
    if not (bench.DEFAULT_CORPUS / "S001.pickle").is_file():
        pytest.skip("snapshot corpus not available")
    row = bench.run_case(_case("S001"), bench.DEFAULT_CORPUS)
    real, analytic, explained = row["real"], row["analytic"], row["explained"]
    # the analytic engine alone misses the course code's own tensors (a fifth of the peak) ...
    assert analytic["allocated"] < 0.85 * real["allocated"]
    # ... and with them added where the course allocates them it meets issue 13's bar
    assert abs(explained["allocated"] - real["allocated"]) <= 0.02 * real["allocated"]
    assert abs(explained["reserved"] - real["reserved"]) <= 0.03 * real["reserved"]
    for phase in ("forward", "backward"):
        value = real["phases"][phase]
        assert abs(explained["phases"][phase] - value) <= 0.02 * value


@pytest.mark.parametrize(
    ("precision", "optimizer", "phases"),
    [
        ("32-true", "course-adamw", ("forward", "backward")),
        ("32-true", "none", ("forward", "backward")),
        ("bf16-mixed", "course-adamw", ("forward",)),
    ],
)
def test_course_terms_match_the_traced_course_model(
    tmp_path: Path, precision: str, optimizer: str, phases: tuple[str, ...]
) -> None:
    """The analytic schedule plus the course terms against the course model traced on fake
    tensors (``trainmem.trace`` runs benchmarks/cs336_lm.py's code under autograd): every term
    at once, on a configuration small enough to trace in a second. Compared where the trace
    harness runs the step as the scripts do (it drops the logits before the optimizer step,
    where the scripts keep them, and its emulated autocast backward of the written-out softmax
    holds one fp32 score tensor more than S003's real GPU trace shows)."""
    torch = pytest.importorskip("torch")
    from cs336_lm import BasicsLM, CourseAdamW, course_cross_entropy

    import trainmem

    v, h, L, a, i, b, s = 2000, 128, 2, 4, 256, 2, 256
    config = json.loads((bench.CONFIGS / "cs336-small.json").read_text())
    config.update(
        hidden_size=h, intermediate_size=i, num_attention_heads=a, num_key_value_heads=a,
        head_dim=h // a, num_hidden_layers=L, vocab_size=v,
    )  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    kept = optimizer == "none"
    case = bench.Case("tiny", v, h, L, a, i, b, s, optimizer, kept, precision, "tiny")
    predicted = bench.predict(case, path)
    traced = trainmem.trace(
        lambda: BasicsLM(v, s, h, L, a, i),
        lambda *_: torch.randint(0, v, (b, s)),
        training=bench.training_of(case),
        optimizer=CourseAdamW if optimizer == "course-adamw" else None,
        loss_fn=course_cross_entropy,
        name="tiny",
    ).details["phase_peaks_bytes"]
    for phase in phases:
        # the analytic engine alone is short by the course terms (8 % to 21 % here) ...
        assert traced[phase] - predicted["analytic"]["phases"][phase] > 0.05 * traced[phase]
        # ... which account for all of it
        assert abs(predicted["explained"]["phases"][phase] - traced[phase]) <= 0.002 * traced[phase]
