"""The options x model-kind matrix of the generic path (issue 26: "every option of `trainmem
estimate --help` works on the generic path (a test matrix of options x {a formula family, a
diffusers model, a timm model, a remote-code config})"), over benchmarks/generic_options.py's
option sets.

Fast: no option set is refused by the generic path's settings check (what it refuses before
building a model, ``trace_unsupported_settings``). Slow: every set on every model kind runs end
to end, or, on a model the option means nothing for (a language model's option on the diffusers
or timm model), is refused with ``NotApplicableError`` naming what to use instead; the timm model
runs when timm is installed (the optional extra), litgpt's own GPT with the litgpt extra.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

from conftest import MODELS_DIR, REPO_DIR
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.estimate import estimate, image_sequence, trace_unsupported_settings
from trainmem.specs.training import TrainingConfig

sys.path.insert(0, str(REPO_DIR / "benchmarks"))

from generic_options import OPTION_SETS  # noqa: E402

KINDS = {
    "formula": str(MODELS_DIR / "formula" / "qwen2.json"),
    "remote-code": str(MODELS_DIR / "remote_code" / "qwen-7b.json"),
    "diffusers": str(MODELS_DIR / "diffusers" / "tiny-pixart.json"),
    "timm": "timm:test_vit",
}
_STILL_REFUSED: set[tuple[str, str]] = set()
"""Cells refused on purpose, for options the formulas do not support on that model kind (none
since session 25: timm's pipeline sets run, Note [Pipeline stages of a timm ViT])."""
_EXTRA = {"litgpt": "litgpt", "timm": "timm"}
"""Optional extras: an option set or model kind that needs one is skipped without it."""


def _training(settings: dict[str, Any]) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=64, **settings)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_no_option_set_is_refused_by_the_settings_check(name: str) -> None:
    assert trace_unsupported_settings(_training(OPTION_SETS[name]), "generic") == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_every_option_set_runs_on_every_model_kind(name: str, kind: str) -> None:
    for needed in {_EXTRA.get(kind), _EXTRA.get(name)} - {None}:
        # find_spec, not importorskip: timm's import raises RuntimeError beside a torchvision
        # whose C extension did not load, which trainmem's own import handles (import_timm)
        if importlib.util.find_spec(str(needed)) is None:
            pytest.skip(f"{needed} is an optional extra")
    if kind == "diffusers":
        pytest.importorskip("diffusers")
    # an image model (timm) takes no seq_len: the default, as if none were given
    training = image_sequence(str(KINDS[kind]), _training(OPTION_SETS[name]), given=False)
    try:
        est = estimate(KINDS[kind], training, engine="generic", simulate_allocator=False)
    except NotApplicableError:  # a language model's option on a diffusers / timm model
        assert kind in ("diffusers", "timm"), name
        return
    except UnsupportedError as exc:
        assert (name, kind) in _STILL_REFUSED, f"{name} on the {kind} model: {exc}"
        assert "traced:" in str(exc)
        return
    assert (name, kind) not in _STILL_REFUSED
    assert est.breakdown.allocated_bytes > 0
