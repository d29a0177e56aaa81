"""The web page's estimate handler on the LLaMA-Factory / axolotl presets: a configuration that
does not fit renders its verdict, a bad value names the field and the allowed values, and a
preset sharded through DeepSpeed keeps its LoRA targets (the CLI's trainer_sharding)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from trainmem.web import handlers as h
from trainmem.web.form import default_values


def _update(**values: Any) -> tuple[str, str]:
    out = h.update([], None, *h.widget_values({**default_values(), **values}))
    return re.sub("<[^>]+>", " ", str(out[0])), re.sub("<[^>]+>", " ", str(out[3]))


@pytest.mark.parametrize("framework", ["llama-factory", "axolotl"])
def test_a_configuration_that_does_not_fit_renders(framework: str) -> None:
    # 8B parameters in bf16 alone are 16 GB, beyond a T4's 15 GiB usable
    verdict, message = _update(
        model="llama-3.1-8b", gpu="t4", framework=framework, engine="analytic", seq_len=512
    )
    assert "Does not fit on T4" in verdict and message.strip() == ""


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("zero_stage", 9, "0, 1, 2, 3"), ("lora_rank", -1, "non-negative integer")],
)
def test_a_bad_value_names_the_field(field: str, value: int, allowed: str) -> None:
    verdict, message = _update(model="tiny-llama-test", framework="axolotl", **{field: value})
    assert "No estimate" in verdict
    assert field in message and allowed in message and "Traceback" not in message


def test_llama_factory_under_deepspeed_keeps_its_seven_targets() -> None:
    # tiny-llama-test at rank 4: all seven linears 9,344 trainable parameters, peft's q, v 1,792
    # (tests/analytic/test_hf_trainer_presets.py has the hand count)
    verdict, _ = _update(
        model="tiny-llama-test",
        framework="llama-factory",
        zero_stage=3,
        lora_rank=4,
        data_parallel_size=2,
        engine="analytic",
    )
    assert "9,344 trainable" in verdict
