"""LoRA targets as a framework default (``FrameworkConventions.default_lora_targets``): peft's
q, v, or under ``--framework unsloth`` all seven linears (unsloth 2026.3.5, tag March-2026,
models/llama.py ``FastLlamaModel.get_peft_model(target_modules = ["q_proj", "k_proj",
"v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout = 0.0)``; cli/config.py
``LoraConfig``), resolved as precision / optimizer / checkpointing are: left unset, the
framework's; given, the user's, even when it equals another framework's default. The same
through the CLI and through the web page's handlers.

Trainable parameters by hand, ``tiny-llama-test`` (tests' preset: 2 layers, h 64, 4 heads and
2 key/value heads of 16, intermediate 176, no biases) at rank r = 4, r (in + out) per targeted
linear per layer: q 4 (64 + 64) = 512, k = v 4 (64 + 32) = 384, o 512, gate = up = down
4 (64 + 176) = 960; all seven 4,672 per layer, 9,344 in all; q, v 896 per layer, 1,792."""

from __future__ import annotations

import shlex

import pytest

from conftest import InvokeJson
from trainmem.specs.assumptions import assumptions, assumptions_line
from trainmem.specs.training import TrainingConfig
from trainmem.web import handlers as h
from trainmem.web.compute import run
from trainmem.web.form import default_values

MODEL = "tiny-llama-test"
SEVEN = ["q", "k", "v", "o", "gate", "up", "down"]
ALL_SEVEN_R4 = 2 * (512 + 384 + 384 + 512 + 3 * 960)  # 9,344
Q_V_R4 = 2 * (512 + 384)  # 1,792
BASE = ["--lora-rank", "4", "--seq-len", "64"]


def _page(**changes: object) -> tuple[dict[str, object], list[object]]:
    """The page's values for ``changes`` and the widget values the page would hold."""
    values = {**default_values(), "model": MODEL, "gpu": "(none)", "lora_rank": 4, "seq_len": 64}
    values.update(changes)
    return values, h.widget_values(values)


def test_cli_unsloth_defaults_to_its_seven_targets(invoke_json: InvokeJson) -> None:
    out = invoke_json("estimate", MODEL, "--framework", "unsloth", *BASE)
    assert out["config"]["lora_targets"] == SEVEN
    assert out["num_trainable_parameters"] == ALL_SEVEN_R4
    assert out["details"]["assumed"]["lora_targets"].startswith("q,k,v,o,gate,up,down")
    # another framework: peft's q, v, and nothing said about them
    plain = invoke_json("estimate", MODEL, "--framework", "hf-trainer", *BASE)
    assert plain["config"]["lora_targets"] == ["q", "v"]
    assert plain["num_trainable_parameters"] == Q_V_R4
    assert "lora_targets" not in plain["details"]["assumed"]


def test_cli_explicit_targets_win_under_unsloth(invoke_json: InvokeJson) -> None:
    # q,v is peft's (every other framework's) default: given, it is still the user's
    out = invoke_json("estimate", MODEL, "--framework", "unsloth", "--lora-targets", "q,v", *BASE)
    assert out["config"]["lora_targets"] == ["q", "v"]
    assert out["num_trainable_parameters"] == Q_V_R4
    assert "lora_targets" not in out["details"]["assumed"]
    # and through --set, as config files and scripts give it
    by_set = invoke_json("estimate", MODEL, "--framework", "unsloth", *BASE,
                         "--set", "lora-targets=q_proj+v_proj")  # fmt: skip
    assert by_set["config"]["lora_targets"] == ["q", "v"]


def test_web_page_resolves_the_same() -> None:
    values, raw = _page(framework="unsloth")
    assert raw[h.INPUT_NAMES.index("lora_targets")] == []  # no box ticked: the framework's
    collected = h.collect(raw)
    assert collected["lora_targets"] is None
    est = run(h.request_of(None, collected))
    assert est.config["lora_targets"] == tuple(SEVEN)
    assert est.num_trainable_parameters == ALL_SEVEN_R4
    _result, cli, query, message = h.update(None, None, *raw)
    assert message == "" and "lora-targets" not in cli and "lora-targets" not in query
    # the user ticks q and v under unsloth: theirs, on the page and in its CLI command
    values, raw = _page(framework="unsloth", lora_targets=("q", "v"))
    collected = h.collect(raw)
    est = run(h.request_of(None, collected))
    assert est.config["lora_targets"] == ("q", "v")
    assert est.num_trainable_parameters == Q_V_R4
    _result, cli, query, message = h.update(None, None, *raw)
    words = shlex.split(cli)
    assert message == "" and words[words.index("--lora-targets") + 1] == "q,v"
    assert "lora-targets=q%2Bv" in query


@pytest.mark.parametrize(
    ("framework", "given", "expected"),
    [
        ("unsloth", None, tuple(SEVEN)),
        ("unsloth", ("q", "v"), ("q", "v")),
        ("pytorch-amp", None, ("q", "v")),
        ("torchtune", ("q", "k", "v", "o", "gate", "up", "down"), tuple(SEVEN)),
    ],
)
def test_training_config_resolves_only_what_is_not_given(
    framework: str, given: tuple[str, ...] | None, expected: tuple[str, ...]
) -> None:
    made = TrainingConfig(framework=framework, lora_rank=4, lora_targets=given)  # type: ignore[arg-type]
    assert made.lora_targets == expected


def test_the_assumption_line_names_unsloths_targets() -> None:
    config = {"framework": "unsloth", "lora_rank": 16, "lora_targets": tuple(SEVEN)}
    line = assumptions_line(assumptions(config))
    assert "LoRA targets: q,k,v,o,gate,up,down (unsloth's default" in line
    # a full fine-tune has no targets to assume
    assert "lora_targets" not in assumptions({**config, "lora_rank": 0})


def test_a_model_without_one_of_them_says_whose_default_it_was() -> None:
    from trainmem.errors import SpecError
    from trainmem.specs.hf import load_model_spec
    from trainmem.specs.training import check_training_for_model

    gpt2 = load_model_spec("gpt2")  # no gated MLP: no gate linear
    with pytest.raises(SpecError, match="no 'gate' linear \\(--framework unsloth's default"):
        check_training_for_model(gpt2, TrainingConfig(framework="unsloth", lora_rank=4))
    given = TrainingConfig(framework="unsloth", lora_rank=4, lora_targets=("q", "v", "up"))
    check_training_for_model(gpt2, given)  # no error: the targets it has
