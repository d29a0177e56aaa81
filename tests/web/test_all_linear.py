"""The page's ``all-linear`` LoRA choice reads as the CLI's ``--lora-targets all-linear``
(issue 26: the web page and the CLI accept the same options)."""

from __future__ import annotations

from conftest import MODELS_DIR, InvokeJson
from trainmem.web import handlers as h
from trainmem.web.compute import resolve_request
from trainmem.web.form import ALL_LINEAR, cli_command, default_values


def _values(**changes: object) -> dict[str, object]:
    values = default_values()
    values.update(lora_rank=8, micro_batch_size=1, seq_len=32, lora_targets=(ALL_LINEAR,))
    values.update(changes)
    return values


def test_all_linear_on_the_page_is_the_clis(invoke_json: InvokeJson) -> None:
    # a formula family: GPT-2 has no gate (its MLP is c_fc, c_proj), as the CLI resolves it
    values = _values(model="gpt2")
    req = resolve_request(values)
    cli = invoke_json("estimate", "gpt2", "--lora-rank", "8", "--lora-targets", "all-linear",
                      "-b", "1", "-s", "32")  # fmt: skip
    assert list(req.training.lora_targets) == cli["config"]["lora_targets"]
    assert req.training.lora_targets == ("q", "k", "v", "o", "up", "down")
    assert "--lora-targets all-linear" in cli_command(values)


def test_all_linear_on_an_uploaded_generic_only_config_renders() -> None:
    # Whisper (no formulas): its own linears, the decoder's cross-attention included; the
    # page rendered "lora target 'gate': ... has no such linear" for the seven names before
    path = str(MODELS_DIR / "whisper.json")
    values = _values(engine="generic")
    assert h.request_of(path, values).training.lora_targets == ("q", "k", "v", "o", "up", "down")
    out = dict(zip(h.ESTIMATE_OUTPUTS, h.update([], path, *h.widget_values(values)), strict=True))
    assert out["message"] == "", out["message"]
    assert "unexpected error" not in out["result"]
