"""The analytic engine's step against a real GPU's snapshot of the CS336 course transformer
(issue 13), with the course model as the ``cs336_basics`` family.

Expected values: the real GPU's (S001's 512-byte-rounded requested peak and exact peak reserved,
read from the snapshot), a real execution on CPU (the bytes of the distinct storages autograd
saves in one course layer, ``saved_tensors_hooks`` on ``benchmarks/cs336_lm.py``'s block), and
the course model traced on fake tensors (``trainmem.trace`` runs the course code under
autograd).
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_DIR

BENCH = REPO_DIR / "benchmarks"
sys.path.insert(0, str(BENCH))

import snapshot_analytic_step as bench  # noqa: E402

from trainmem.analytic.activations import activation_profile  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs.hf import model_spec_from_hf  # noqa: E402


def _case(case_id: str) -> bench.Case:
    (case,) = [c for c in bench.CASES if c.id == case_id]
    return case


def test_course_layer_terms_match_a_cpu_execution() -> None:
    torch = pytest.importorskip("torch")
    from cs336_lm import BasicsLM

    b, s, h, a, i, v = 2, 8, 16, 2, 32, 50
    case = bench.Case("tiny", v, h, 1, a, i, b, s, "none", False, "32-true", "tiny")
    model, training = bench.course_model(case), bench.training_of(case)
    predicted = sum(activation_profile(model, training).terms.values())

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
    # the course's own code is what makes the difference: as a Llama config it is short
    config = json.loads((bench.CONFIGS / "cs336-small.json").read_text())
    config.update(
        hidden_size=h, intermediate_size=i, num_attention_heads=a, num_key_value_heads=a,
        head_dim=h // a, num_hidden_layers=1, vocab_size=v,
    )  # fmt: skip
    llama = model_spec_from_hf(config, name="llama-shaped")
    assert sum(activation_profile(llama, training).terms.values()) < sum(saved.values())


def test_analytic_step_against_the_real_gpu() -> None:
    if not (bench.DEFAULT_CORPUS / "S001.pickle").is_file():
        pytest.skip("snapshot corpus not available")
    row = bench.run_case(_case("S001"), bench.DEFAULT_CORPUS)
    real, analytic, llama = row["real"], row["analytic"], row["llama"]
    # given as a Llama config the course code's own tensors are missing (a fifth of the peak)
    assert llama["allocated"] < 0.85 * real["allocated"]
    # as the cs336_basics family with the script's loop settings it meets issue 13's bar
    assert abs(analytic["allocated"] - real["allocated"]) <= 0.02 * real["allocated"]
    assert abs(analytic["reserved"] - real["reserved"]) <= 0.03 * real["reserved"]
    for phase in ("forward", "backward"):
        value = real["phases"][phase]
        assert abs(analytic["phases"][phase] - value) <= 0.02 * value


@pytest.mark.parametrize(
    ("precision", "optimizer", "phases"),
    [
        ("32-true", "course-adamw", ("forward", "backward", "optimizer")),
        ("32-true", "none", ("forward", "backward")),
        ("bf16-mixed", "course-adamw", ("forward", "backward", "optimizer")),
    ],
)
def test_family_matches_the_traced_course_model(
    precision: str, optimizer: str, phases: tuple[str, ...]
) -> None:
    """The ``cs336_basics`` family against the course model traced on fake tensors (the trace
    engine builds it from the same config, trainmem.trace.course_model, and runs the course
    code under autograd), on a configuration small enough to trace in a second, with the
    scripts' loop settings."""
    pytest.importorskip("torch")
    v, h, L, a, i, b, s = 2000, 128, 2, 4, 256, 2, 256
    kept = optimizer == "none"
    case = bench.Case("tiny", v, h, L, a, i, b, s, optimizer, kept, precision, "tiny")
    training = bench.training_of(case)
    path = tmp_config(bench.course_config(case))
    analytic = estimate(path, training, engine="analytic").schedules[0].phase_peaks()
    traced = estimate(path, training, engine="trace").details["phase_peaks_bytes"]
    for phase in phases:
        assert abs(analytic[phase] - traced[phase]) <= 0.002 * traced[phase], phase


def tmp_config(config: dict[str, object]) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    return f.name
