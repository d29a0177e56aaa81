"""Every path a user's configuration can take renders in the page's handlers, the default
page included: fits, tight, does not fit (out of memory in the caching allocator), no GPU, and
a refusal with its one line. The headline is checked against ``trainmem estimate --json`` for
the same settings, never against the page's own arithmetic."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import InvokeJson
from trainmem.web import handlers as h
from trainmem.web.compute import numbers, resolve_request, run
from trainmem.web.form import default_values
from trainmem.web.views import compare_html

GiB = 2**30

#: (widget changes, the same run as CLI arguments, the verdict the JSON must give)
PATHS: dict[str, tuple[dict[str, Any], list[str], str | None]] = {
    "default page (8B full fine-tune, OOM)": ({}, ["llama-3.1-8b", "--gpu", "H100-80GB"], None),
    "fits": (
        {"model": "gpt2", "micro_batch_size": 2, "seq_len": 512},
        ["gpt2", "--gpu", "H100-80GB", "-b", "2", "-s", "512"],
        "fits",
    ),
    "tight (QLoRA on a 24 GB card)": (
        {
            "gpu": "RTX-4090",
            "seq_len": 2048,
            "lora_rank": 16,
            "quantize_base": "nf4",
        },
        ["llama-3.1-8b", "--gpu", "RTX-4090", "-s", "2048", "--lora-rank", "16"]
        + ["--quantize-base", "nf4"],
        "tight",
    ),
    "no GPU": ({"gpu": "(none)", "model": "gpt2"}, ["gpt2"], None),
}


def _update(**changes: Any) -> dict[str, Any]:
    values = default_values()
    values.update(changes)
    out = h.update([], None, *h.widget_values(values))
    return dict(zip(h.ESTIMATE_OUTPUTS, out, strict=True))


@pytest.mark.parametrize("path", list(PATHS))
def test_every_verdict_path_renders(invoke_json: InvokeJson, path: str) -> None:
    changes, args, expected_verdict = PATHS[path]
    cli = invoke_json("estimate", *args)
    if expected_verdict is not None:
        assert cli["verdict"] == expected_verdict
    out = _update(**changes)
    assert out["message"] == "", out["message"]
    result = out["result"]
    assert "unexpected error" not in result
    assert f'data-verdict="{cli["verdict"]}"' in result
    gpu = cli["gpu"]["name"]
    if cli["verdict"] is None:
        assert "no GPU chosen: no verdict" in result
    elif cli["peak"]["oom"]:
        assert f"Does not fit on {gpu}: out of memory in the caching allocator" in result
        assert cli["peak"]["device_total_bytes"] is None and cli["margin_bytes"] is None
        assert "<td>OOM</td><td>out of memory</td>" in result
    else:
        margin = cli["gpu"]["capacity_bytes"] - cli["peak"]["device_total_bytes"]
        assert cli["margin_bytes"] == margin
        word = {"fits": "Fits", "tight": "Tight"}[cli["verdict"]]
        assert f"{word} on {gpu}: {margin / GiB:,.2f} GiB to spare" in result


def test_the_default_page_is_an_oom_and_says_so(invoke_json: InvokeJson) -> None:
    # The page's own default (llama-3.1-8b full fine-tune, AdamW, bf16-mixed, H100-80GB) needs
    # 16 bytes per parameter for weights, gradients and AdamW states alone (Rajbhandari et al.
    # 2020, sec. 3.1: 2 + 2 + 12 for mixed precision; PyTorch AMP keeps fp32 weights and
    # gradients, 4 + 4 + 8): 16 * 8.03e9 = 128.5 GB > 80 GB, so it cannot fit.
    assert 16 * 8_030_261_248 > 80 * 10**9
    cli = invoke_json("estimate", "llama-3.1-8b", "--gpu", "H100-80GB")
    assert cli["fits"] is False and cli["verdict"] == "does not fit"
    out = _update()
    assert 'data-verdict="does not fit"' in out["result"]


def test_a_refusal_is_one_line_in_the_message_box() -> None:
    out = _update(model="bloomz-7b1", attention="sdpa")
    assert out["message"].startswith('<div class="tm-error"')
    assert "unexpected error" not in out["message"]
    assert "attention" in out["message"]
    assert "No estimate" in out["result"]


def test_fit_and_plan_render_for_a_run_that_does_not_fit() -> None:
    values = default_values()
    fixes, plan = h.fit_and_plan(h.FIT_TAB, None, *h.widget_values(values))
    assert "unexpected error" not in fixes + plan
    assert '<table class="tm" id="fixes">' in fixes


def test_compare_shows_the_verdict_of_each_column() -> None:
    values = default_values()
    small = dict(values, model="gpt2")
    columns = [numbers(run(resolve_request(v))) for v in (values, small)]
    html = compare_html(["8b", "gpt2"], columns)
    assert "<td>does not fit</td>" in html and "<td>fits</td>" in html


def test_the_page_says_what_it_assumed_and_when_the_framework_matters() -> None:
    out = _update(
        model="mistral-7b-v0.1",
        zero_stage=3,
        data_parallel_size=8,
        micro_batch_size=4,
        seq_len=2048,
    )
    assert 'id="assumed"' in out["result"]
    assert "--framework pytorch-amp" in out["result"]
    assert "the framework matters here" in out["result"]


@pytest.mark.slow  # about 30 s: each candidate is a traced step
def test_fit_and_plan_of_an_uploaded_model_only_the_generic_path_runs(
    invoke_json: InvokeJson,
) -> None:
    """An uploaded Whisper config that does not fit: the Fit tab traces the changes and the
    micro-batch search (as ``trainmem fit`` / ``plan`` do), where it showed a refusal."""
    from conftest import MODELS_DIR

    whisper = str(MODELS_DIR / "whisper.json")
    values = dict(default_values(), gpu="0.53GiB", micro_batch_size=32, seq_len=64)
    fixes, plan = h.fit_and_plan(h.FIT_TAB, whisper, *h.widget_values(values))
    assert "unexpected error" not in fixes + plan
    assert '<table class="tm" id="fixes">' in fixes, fixes
    cli = invoke_json("plan", whisper, "--gpu", "0.53GiB", "-s", "64", "-b", "32")
    largest = cli["results"][0]["value"]
    assert f">{largest}<" in plan, plan
