"""The coverage benchmark's configs and settings (benchmarks/coverage.py, issue 26): the
released fields a default config that transformers' own forward cannot run takes, and an image
model run as the CLI runs it without ``--seq-len``."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

from conftest import MODELS_DIR, REPO_DIR

_spec = importlib.util.spec_from_file_location(
    "coverage_bench", REPO_DIR / "benchmarks/coverage.py"
)
assert _spec is not None and _spec.loader is not None
coverage_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage_bench)


def _rotary_split(model_type: str, fix: dict[str, Any]) -> tuple[int, int]:
    """(frequencies the text rotary embedding makes, frequencies its mrope_section splits) for
    transformers' default config of ``model_type`` with ``fix``'s fields, by hand from
    modeling_glm4v.py ``compute_default_rope_parameters`` (``arange(0, dim, 2)`` over
    ``dim = int(head_dim * partial_rotary_factor)``) and ``recomposition_frequencies``."""
    import transformers

    raw = coverage_bench._merged(transformers.AutoConfig.for_model(model_type).to_dict(), fix)
    text = raw["text_config"]
    rope = text.get("rope_parameters") or {}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return (dim + 1) // 2, sum(rope.get("mrope_section", [8, 12, 12]))


def test_the_glm4v_fixes_give_the_rotary_embedding_the_frequencies_its_sections_split() -> None:
    """The default GLM-4V text configs make 64 (GLM-4.1V, 4.6V, Glmga: 128 dims) or 11 (GLM-4.5V:
    4096 // 96 = 42 wide heads, half rotated) frequencies for an mrope_section of 32, which
    transformers' own forward cannot split; the released layout (head_dim 128, half rotated)
    makes 32."""
    fixes = coverage_bench.CONFIG_FIXES
    assert {"glm4v", "glm46v", "glmga", "glm4v_moe"} <= set(fixes)
    assert _rotary_split("glm4v", {}) == (64, 32)
    assert _rotary_split("glm4v_moe", {}) == (11, 32)
    for model_type in ("glm4v", "glm46v", "glmga", "glm4v_moe"):
        assert _rotary_split(model_type, fixes[model_type]) == (32, 32)


def test_an_image_model_runs_without_the_token_length_it_does_not_take() -> None:
    """SegFormer (pixels in, no sequence) and DINOv2 (a vision encoder: its sequence is its
    patches, (56 / 14)^2 + 1 = 17) refuse the benchmark's 64 tokens when given (estimate.py
    image_sequence, since 48c6e37); the benchmark leaves them out, as the CLI run without
    --seq-len does, and both estimate."""
    from trainmem.errors import SpecError
    from trainmem.estimate import estimate

    for name in ("heads/segformer.json", "dinov2.json"):
        raw = json.loads((MODELS_DIR / name).read_text())
        try:
            estimate(str(MODELS_DIR / name), coverage_bench.TRAINING, engine="generic")
        except SpecError as exc:
            assert exc.field == "seq_len"
        else:
            raise AssertionError(f"{name}: 64 tokens given to an image model were not refused")
        assert coverage_bench._estimate(raw) > 0


def test_the_step3p7_fix_gives_the_sliding_mask_its_window_and_no_layer_slides() -> None:
    """Step3p7's text model builds a sliding-window mask on every forward; transformers' own
    create_sliding_window_causal_mask raises on the default text config (no sliding_window) and
    builds one on the config with the fix, whose layers all stay full attention."""
    import pytest

    from trainmem.trace._torch import require_torch

    torch = require_torch()
    import transformers
    from transformers.masking_utils import create_sliding_window_causal_mask

    def mask_of(fix: dict[str, Any]) -> Any:
        raw = coverage_bench._merged(transformers.AutoConfig.for_model("step3p7").to_dict(), fix)
        raw.pop("model_type")
        text = transformers.AutoConfig.for_model("step3p7", **raw).text_config
        assert set(text.layer_types) == {"full_attention"}
        text._attn_implementation = "sdpa"  # (None: the mask functions return early)
        return create_sliding_window_causal_mask(
            config=text, inputs_embeds=torch.zeros(1, 4, 8), attention_mask=None, cache=None
        )

    with pytest.raises(ValueError, match="sliding_window"):
        mask_of({})
    mask_of(coverage_bench.CONFIG_FIXES["step3p7"])
