"""Issue 26 for session 27's options (helper useraudit3, session 28): each is set on the page
and in the CLI, and the two give the same answer: the page's verdict is the verdict of the
``trainmem estimate`` command the page shows for it, and a refusal is the CLI's own error line
(the field named, the allowed values), never a traceback. Before session 28 the page ran a
litgpt release beside another framework, which the CLI refuses, and named other allowed LoRA
targets than the CLI for a diffusers module name on a transformer."""

from __future__ import annotations

import html
import json
import re
import shlex
from typing import Any

import pytest

from conftest import Invoke
from trainmem.web import handlers as h
from trainmem.web.form import default_values, from_query, to_query

pytest.importorskip("torch")
pytest.importorskip("peft")

TINY = {"model": "tiny-llama-test", "gpu": "T4", "micro_batch_size": 2, "seq_len": 64}
GPT2 = {"model": "gpt2", "gpu": "T4"}

#: widget changes of each path (the model and GPU included)
PATHS: dict[str, dict[str, Any]] = {
    "prefix tuning": {**TINY, "num_virtual_tokens": 8},
    "p-tuning": {**TINY, "num_virtual_tokens": 8, "prompt_learning": "p-tuning"},
    "loha": {**TINY, "lora_rank": 8, "lora_variant": "loha"},
    "fp32 adapters": {**GPT2, "lora_rank": 8, "lora_adapter_dtype": "float32"},
    "litgpt release": {**GPT2, "framework": "litgpt", "litgpt_version": "0.4.0"},
    "torch 1.13 keeps gradients": {**GPT2, "torch_version": "1.13"},
    "gradients kept": {**GPT2, "zero_grad_set_to_none": False},
    "gradients freed on torch 1.13": {
        **GPT2, "torch_version": "1.13", "zero_grad_set_to_none": True
    },
    "prefix tuning does not fit": {
        **TINY, "gpu": "0.6GB", "micro_batch_size": 16, "seq_len": 512, "num_virtual_tokens": 8
    },
    # refused: the CLI's error line on the page
    "projection without a prefix": {**TINY, "prefix_projection": True},
    "negative virtual tokens": {**TINY, "num_virtual_tokens": -1},
    "loha without a rank": {**TINY, "lora_variant": "loha"},
    "layerwise casting of a transformer": {**TINY, "layerwise_casting": "float8_e4m3fn"},
    "diffusers targets on a transformer": {**GPT2, "lora_rank": 8, "lora_targets": ("to_q",)},
    "litgpt release beside another framework": {**GPT2, "litgpt_version": "0.4.0"},
    "a version that is not one": {**GPT2, "transformers_version": "abc"},
    "an old transformers traced": {**TINY, "engine": "generic", "transformers_version": "4.45"},
}  # fmt: skip


ASSUMED: dict[str, dict[str, str]] = {
    # torch 1.13 torch/optim/optimizer.py: zero_grad(self, set_to_none: bool = False); 2.0
    # made True the default (Note [zero_grad's default by release])
    "torch 1.13 keeps gradients": {"torch": "1.13", "loop": "keeps the gradients allocated"},
    "gradients kept": {"loop": "keeps the gradients allocated"},
    "gradients freed on torch 1.13": {"torch": "1.13", "loop": "set_to_none=True"},
    "litgpt release": {"framework": "litgpt", "litgpt": "0.4.0"},
    "prefix tuning": {"framework": "pytorch-amp", "transformers": "(installed)"},
}
"""What ``details.assumed`` of the path's JSON must say."""


def _page(changes: dict[str, Any]) -> dict[str, str]:
    raw = h.widget_values({**default_values(), **changes})
    return dict(zip(h.ESTIMATE_OUTPUTS, h.update([], None, *raw), strict=True))


@pytest.mark.parametrize("path", list(PATHS))
def test_the_page_and_its_command_give_one_answer(invoke: Invoke, path: str) -> None:
    out = _page(PATHS[path])
    assert "unexpected error" not in out["message"] + out["result"]
    assert out["cli"].startswith("trainmem estimate ")
    result = invoke(*shlex.split(out["cli"])[1:], "--json", exit_code=None)
    if result.exit_code:
        assert result.exit_code == 2 and "Traceback" not in result.stderr
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith("error: ")
        assert html.unescape(re.sub(r"<[^>]+>", "", out["message"])).strip() == error
        return
    assert out["message"] == "", out["message"]
    d = json.loads(result.stdout)
    assert f'data-verdict="{d["verdict"]}"' in out["result"]
    verdict = d["verdict"]
    # the JSON says whose code it assumed: the framework, the loop, the library releases
    assumed = d["details"]["assumed"]
    assert {"framework", "framework_means", "loop", "torch", "transformers"} <= assumed.keys()
    for key, text in ASSUMED.get(path, {}).items():
        assert text in assumed[key], (key, assumed[key])
    if path == "prefix tuning does not fit":
        assert verdict == "does not fit"


def test_a_three_valued_flag_survives_the_link_and_the_command() -> None:
    for value, flag in ((False, "--zero-grad-keep"), (True, "--zero-grad-set-to-none")):
        values = {**default_values(), "model": "gpt2", "zero_grad_set_to_none": value}
        read, _, problems = from_query(to_query(values))
        assert problems == [] and read["zero_grad_set_to_none"] is value
        raw = h.widget_values(read)
        assert raw[h.INPUT_NAMES.index("zero_grad_set_to_none")] == str(value).lower()
        assert flag in _page({"model": "gpt2", "zero_grad_set_to_none": value})["cli"].split()
    raw = h.widget_values({**default_values(), "model": "gpt2"})
    assert raw[h.INPUT_NAMES.index("zero_grad_set_to_none")] == "default"
    assert h.collect(raw)["zero_grad_set_to_none"] is None
