"""torchtune trains in its config's dtype, never under autocast: without --precision it trains
in bf16-true (its configs' ``dtype: bf16``), and a *-mixed precision (or 16-true: its recipes
refuse fp16) is refused on every path, naming the field, the framework and what it runs.

Source: torchtune recipes/full_finetune_single_device.py, lora_finetune_single_device.py,
*_distributed.py at v0.1.0 and v0.6.1: ``self._dtype = training.get_dtype(cfg.dtype)`` (0.1:
``utils.get_dtype``), the model built under ``set_default_dtype(self._dtype)``, no
``torch.autocast`` / GradScaler call, ``ValueError("full fp16 training is not supported ...")``.
"""

from __future__ import annotations

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.planner.fixes import CHANGES
from trainmem.specs.assumptions import assumptions, assumptions_line
from trainmem.specs.hardware import get_gpu
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig, derived, resolved_config
from trainmem.web import handlers as h
from trainmem.web.form import default_values

REFUSED = ("bf16-mixed", "16-mixed", "fp8-mixed", "16-true")
MESSAGE = "allowed: bf16-true, 32-true"


def test_torchtune_without_a_precision_trains_in_bf16_true() -> None:
    tune = TrainingConfig(framework="torchtune")
    # bf16-true: weights, gradients and compute all bfloat16 (no fp32 copy)
    assert (tune.precision, tune.weight_dtype, tune.compute_dtype) == (
        "bf16-true",
        "bfloat16",
        "bfloat16",
    )
    assert not tune.is_mixed
    assert TrainingConfig().precision == "bf16-mixed"  # other frameworks keep autocast
    assert TrainingConfig(framework="torchtune", precision="32-true").weight_dtype == "float32"
    assert derived(tune, precision=None).precision == "bf16-true"
    # what was computed is what the JSON config says
    assert resolved_config(tune)["precision"] == "bf16-true"


@pytest.mark.parametrize("precision", REFUSED)
def test_a_precision_torchtune_does_not_run_is_refused(precision: str) -> None:
    with pytest.raises(SpecError) as caught:
        TrainingConfig(framework="torchtune", precision=precision)
    assert caught.value.field == "precision"
    text = str(caught.value)
    assert f"{precision} with --framework torchtune" in text and text.endswith(MESSAGE)


def test_switching_a_default_config_to_torchtune_is_refused_not_mixed() -> None:
    # the resolved bf16-mixed of the default framework is a precision like any other
    with pytest.raises(SpecError, match="bf16-mixed with --framework torchtune"):
        derived(TrainingConfig(), framework="torchtune")


def test_the_assumption_names_torchtunes_default_precision() -> None:
    tune = resolved_config(TrainingConfig(framework="torchtune"))
    a = assumptions(tune)
    assert a["precision"].startswith("bf16-true (torchtune's default")
    assert "; precision: bf16-true (torchtune's default" in assumptions_line(a)
    fp32 = assumptions(resolved_config(TrainingConfig(framework="torchtune", precision="32-true")))
    assert "precision" not in fp32  # not the default: nothing assumed
    assert "precision" not in assumptions(resolved_config(TrainingConfig()))


def test_precision_fixes_stay_within_torchtunes_precisions() -> None:
    model = load_model_spec("gpt2")  # the precision rules read only the config and the GPU
    fp32 = TrainingConfig(framework="torchtune", precision="32-true")
    mixed, true16 = (c.propose for c in CHANGES if c.group == "precision")
    assert mixed(model, fp32, get_gpu("H100-80GB")) == []  # no bf16-mixed for torchtune
    assert [t.precision for t in true16(model, fp32, get_gpu("H100-80GB"))] == ["bf16-true"]
    assert true16(model, fp32, get_gpu("V100-32GB")) == []  # 16-true: torchtune refuses fp16
    plain = TrainingConfig(precision="32-true")
    assert [t.precision for t in mixed(model, plain, get_gpu("H100-80GB"))] == ["bf16-mixed"]


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_the_cli_refuses_mixed_torchtune_on_every_engine(invoke: Invoke, engine: str) -> None:
    r = invoke(
        "estimate", "gpt2", "-s", "64", "--framework", "torchtune", "-p", "bf16-mixed",
        "--engine", engine, exit_code=2,
    )  # fmt: skip
    assert "precision: bf16-mixed with --framework torchtune" in r.output
    assert MESSAGE in r.output and "Traceback" not in r.output


def test_the_page_shows_the_same_message() -> None:
    raw = h.widget_values(
        {**default_values(), "model": "gpt2", "framework": "torchtune", "precision": "16-mixed"}
    )
    out = dict(zip(h.ESTIMATE_OUTPUTS, h.update([], None, *raw), strict=True))
    assert "precision: 16-mixed with --framework torchtune" in out["message"]
    assert MESSAGE in out["message"] and "No estimate" in out["result"]


@pytest.mark.parametrize(
    ("precision", "words"),
    [
        ("bf16-true", "the whole model in bf16, no autocast"),
        ("32-true", "the whole model in fp32, no autocast"),
        ("bf16-mixed", "autocast on fp32 weights, fp32 gradients"),
    ],
)
def test_the_plain_loop_says_what_its_precision_means(precision: str, words: str) -> None:
    # *-true: the model is cast to the dtype (no torch.autocast); *-mixed: autocast over fp32
    # weights (torch.amp): the assumption line must not claim autocast under bf16-true
    config = resolved_config(TrainingConfig(precision=precision))  # type: ignore[arg-type]
    means = assumptions(config)["framework_means"]
    assert words in means
    assert ("autocast on" in means) is precision.endswith("-mixed")
