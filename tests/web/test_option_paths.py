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
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR, TESTS_DIR, Invoke
from trainmem.web import handlers as h
from trainmem.web.form import default_values, from_query, to_query

pytest.importorskip("torch")
pytest.importorskip("peft")

CONFIGS = TESTS_DIR / "trace" / "diffusers_configs"

TINY = {"model": "tiny-llama-test", "gpu": "T4", "micro_batch_size": 2, "seq_len": 64}
GPT2 = {"model": "gpt2", "gpu": "T4"}
FLUX = {"model": str(CONFIGS / "tiny-flux.json"), "gpu": "T4", "resolution": 64}
SD3 = {"model": str(CONFIGS / "tiny-sd3.json"), "gpu": "T4", "resolution": 64}
SMALL_CONTROLNET = {
    "controlnet": True, "controlnet_double_layers": 1, "controlnet_single_layers": 0,
    "text_seq_len": 16,
}  # fmt: skip
TINY_CHATGLM = str(MODELS_DIR / "remote_code" / "tiny-chatglm-test.json")

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
    # session 28's options (helper useraudit4, session 29)
    "cut cross entropy under axolotl": {**TINY, "framework": "axolotl", "cut_cross_entropy": True},
    "accelerate 0.27 keeps the gradients": {
        **TINY, "framework": "accelerate-fsdp", "accelerate_version": "0.27.0"
    },
    "an accelerate release no loop reads": {**TINY, "accelerate_version": "0.27.0"},
    "prefix tuning under ZeRO-2": {
        **TINY, "num_virtual_tokens": 8, "data_parallel_size": 2, "zero_stage": 2
    },
    "prefix tuning with 8-bit Adam": {**TINY, "num_virtual_tokens": 8, "optimizer": "adamw-8bit"},
    "cut cross entropy on litgpt's code": {
        **GPT2, "framework": "litgpt", "cut_cross_entropy": True
    },
    "an accelerate release that is not one": {
        **TINY, "framework": "accelerate-fsdp", "accelerate_version": "x.y"
    },
    "chatglm's quantize on llama": {
        **TINY, "num_virtual_tokens": 8, "quantize_base": "chatglm-int8", "precision": "16-true"
    },
    "chatglm's quantize under LoRA": {**TINY, "lora_rank": 8, "quantize_base": "chatglm-int4"},
    "controlnet blocks without a controlnet": {**FLUX, "controlnet_double_layers": 2},
    "controlnet blocks on SD3": {**SD3, "controlnet": True, "controlnet_single_layers": 0},
    "a controlnet with LoRA": {**FLUX, "controlnet": True, "lora_rank": 8},
}  # fmt: skip

SLOW_PATHS: dict[str, dict[str, Any]] = {
    "FLUX controlnet": {**FLUX, **SMALL_CONTROLNET},
    "FLUX controlnet does not fit": {**FLUX, **SMALL_CONTROLNET, "gpu": "0.01GB"},
    "chatglm int4 p-tuning v2": {
        "model": TINY_CHATGLM, "gpu": "T4", "num_virtual_tokens": 8,
        "quantize_base": "chatglm-int4", "precision": "16-true",
    },
}  # fmt: skip
"""Traced paths of session 28's options (a FLUX ControlNet, ChatGLM's quantize): tens of seconds
each under load, twice (the page and its command)."""


ASSUMED: dict[str, dict[str, str]] = {
    # torch 1.13 torch/optim/optimizer.py: zero_grad(self, set_to_none: bool = False); 2.0
    # made True the default (Note [zero_grad's default by release])
    "torch 1.13 keeps gradients": {"torch": "1.13", "loop": "keeps the gradients allocated"},
    "gradients kept": {"loop": "keeps the gradients allocated"},
    "gradients freed on torch 1.13": {"torch": "1.13", "loop": "set_to_none=True"},
    "litgpt release": {"framework": "litgpt", "litgpt": "0.4.0"},
    "prefix tuning": {"framework": "pytorch-amp", "transformers": "(installed)"},
    # accelerate src/accelerate/optimizer.py v0.27.0 AcceleratedOptimizer.zero_grad:
    # ``if set_to_none is None: set_to_none = False`` (True from v0.28.0)
    "accelerate 0.27 keeps the gradients": {
        "accelerate": "0.27.0", "loop": "keeps the gradients allocated"
    },
    "cut cross entropy under axolotl": {"framework": "axolotl"},
    "FLUX controlnet": {"framework": "pytorch-amp"},
}  # fmt: skip
"""What ``details.assumed`` of the path's JSON must say."""


def _page(changes: dict[str, Any]) -> dict[str, str]:
    """The page's outputs; a model that is a file is uploaded, as the page takes one."""
    upload = changes["model"] if str(changes["model"]).endswith(".json") else None
    if upload:
        changes = {**changes, "model": default_values()["model"]}
    raw = h.widget_values({**default_values(), **changes})
    return dict(zip(h.ESTIMATE_OUTPUTS, h.update([], upload, *raw), strict=True))


def _command(out: dict[str, str], model: str) -> list[str]:
    """The words of the page's command, an uploaded config named by its path here (the page
    names it by its file name, as the user saved it)."""
    words = shlex.split(out["cli"])[1:]
    if model.endswith(".json"):
        assert words[1] == Path(model).name
        words[1] = model
    return words


NOT_ASSUMED: dict[str, tuple[str, ...]] = {
    # accelerate's release is read only by accelerate-fsdp's own loop
    "an accelerate release no loop reads": ("accelerate",),
    # ChatGLM's quantize is its remote code's quantization.py, no bitsandbytes
    "chatglm int4 p-tuning v2": ("bitsandbytes",),
}
"""What ``details.assumed`` of the path's JSON must not name."""

NOTES: dict[str, str] = {
    "an accelerate release no loop reads": "warning: accelerate_version=0.27.0 has no effect",
}
"""A note the path's JSON and page must both carry."""


@pytest.mark.parametrize(
    "path",
    [
        *PATHS,
        *(pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PATHS),
    ],
)
def test_the_page_and_its_command_give_one_answer(invoke: Invoke, path: str) -> None:
    changes = {**PATHS, **SLOW_PATHS}[path]
    out = _page(changes)
    assert "unexpected error" not in out["message"] + out["result"]
    assert out["cli"].startswith("trainmem estimate ")
    result = invoke(*_command(out, str(changes["model"])), "--json", exit_code=None)
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
    assert {"framework", "framework_means", "loop", "torch"} <= assumed.keys()
    library = "diffusers" if "flux" in str(changes["model"]) else "transformers"
    assert library in assumed, assumed
    for key, text in ASSUMED.get(path, {}).items():
        assert text in assumed[key], (key, assumed[key])
    assert not set(NOT_ASSUMED.get(path, ())) & assumed.keys(), assumed
    if path in NOTES:
        assert any(n.startswith(NOTES[path]) for n in d["notes"]), d["notes"]
        assert html.escape(NOTES[path], quote=False) in out["result"]
    if path.endswith("does not fit"):
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


def test_an_upload_is_estimated_from_its_path_as_the_cli_does() -> None:
    # `trainmem estimate config.json` hands the path on; the page handed a ModelSpec read from
    # the upload under `auto`, which the traced paths refuse ("this ModelSpec differs from the
    # config ... names"): prefix tuning on an uploaded ChatGLM / Llama config failed on the
    # page and ran in the CLI (session 29)
    values = {**default_values(), "num_virtual_tokens": 8, "precision": "16-true"}
    assert h.request_of(TINY_CHATGLM, values).model == TINY_CHATGLM
    analytic = h.request_of(TINY_CHATGLM, {**default_values(), "engine": "analytic"})
    assert not isinstance(analytic.model, str)
