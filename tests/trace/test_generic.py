"""The generic path (``trainmem.trace.generic``) against the full trace and the analytic engine,
and the engine choice (``auto``).

Expected numbers come from independent executions: the full trace of the whole model (every
block run on fake tensors) for the composed schedule, the analytic engine's cited formulas for
the families it models, transformers' meta-built ``numel`` for parameter counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR, Invoke
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.schedule import Op, Repeat, StepSchedule
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

NEW_FAMILIES = sorted(p.stem for p in MODELS_DIR.glob("*.json"))
FORMULA_FAMILIES = sorted(p.stem for p in (MODELS_DIR / "formula").glob("*.json"))
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
NO_SDPA = {"bloom", "mamba"}  # transformers has no SDPA path for them: eager attention
WHOLE_TRACE: set[str] = set()  # families whose blocks do not split into identical units
# 5-17 s each for the generic path and the full trace: slow. The fast set keeps a family of
# each composition kind (deepseek_v3 and t5: a first block apart, t5 encoder-decoder too;
# gemma3_text: sliding + global units; the rest: one repeated block).
SLOW_FAMILIES = {"mamba", "whisper", "starcoder2", "siglip_vision_model"}
IMAGE_FAMILIES = {"clip_vision_model", "dinov2", "siglip_vision_model", "vit"}
"""Families whose input is an image: their sequence is the image's (the config's image_size),
and a seq_len is refused (Note [Vision encoders at another resolution])."""


def _tokens(family: str, seq_len: int) -> dict[str, int]:
    """``seq_len`` for a family that reads tokens, none for an image model."""
    return {} if family in IMAGE_FAMILIES else {"seq_len": seq_len}


def _deeper(path: Path, layers: int, tmp_path: Path) -> str:
    """The config with every block list ``layers`` deep (a copy in ``tmp_path``)."""
    raw: dict[str, Any] = json.loads(path.read_text())
    for key in LAYER_KEYS:
        if key in raw:
            raw[key] = layers
    if "layer_types" in raw:
        raw["layer_types"] = (raw["layer_types"] * layers)[:layers]
    out = tmp_path / f"{path.stem}-{layers}" / "config.json"
    out.parent.mkdir()
    out.write_text(json.dumps(raw))
    return str(out)


def _peaks(model: str, training: TrainingConfig) -> tuple[Any, int, int]:
    generic = estimate(model, training, engine="generic", simulate_allocator=False)
    full = estimate(model, training, engine="trace", simulate_allocator=False)
    return generic, generic.breakdown.allocated_bytes, full.breakdown.allocated_bytes


# --- composed step vs the full trace -------------------------------------------------------


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=[pytest.mark.slow] if f in SLOW_FAMILIES else []) for f in NEW_FAMILIES],
)
def test_generic_matches_full_trace_on_families_without_formulas(
    family: str, tmp_path: Path
) -> None:
    # 7 blocks per list: 5 traced, the middle one repeated 3 times (2 after T5's first block
    # and DeepSeek's dense one; Gemma 3's sliding + global pairs: 3 traced, the middle 4 times)
    layers = 12 if family == "gemma3_text" else 7
    model = _deeper(MODELS_DIR / f"{family}.json", layers, tmp_path)
    attention = "eager" if family in NO_SDPA else "sdpa"
    training = TrainingConfig(micro_batch_size=2, attention=attention, **_tokens(family, 32))
    est, generic, full = _peaks(model, training)
    assert est.engine == "generic"
    assert abs(generic - full) <= 0.01 * full, (family, generic, full)
    whole = any("whole model was traced" in n for n in est.notes)
    assert whole == (family in WHOLE_TRACE), est.notes
    if not whole:
        counts = {x["units"] - x["units_traced"] + 1 for x in est.details["generic"]["block_lists"]}
        expected = {"deepseek_v3": {1, 2}, "t5": {1, 2}, "gemma3_text": {4}}.get(family, {3})
        assert counts == expected, est.details["generic"]
        repeats = {item.count for item in est.schedules[0].step if isinstance(item, Repeat)}
        assert repeats == expected - {1}, "the middle blocks are not a Repeat"


@pytest.mark.parametrize(
    ("preset", "layers", "settings", "phase"),
    [
        ("tiny-gpt2-test", 6, {}, "backward"),
        ("tiny-llama-test", 6, {"activation_checkpointing": "full"}, None),
        ("tiny-llama-test", 6, {"lora_rank": 4}, None),
        ("tiny-llama-test", 6, {"gradient_accumulation_steps": 2, "precision": "32-true"}, None),
        ("tiny-llama-test", 6, {"zero_stage": 3, "data_parallel_size": 2}, None),  # FSDP2
        ("tiny-llama-test", 6, {"optimizer": "adafactor"}, None),  # factored lists
    ],
)
def test_generic_matches_full_trace_with_settings(
    preset: str, layers: int, settings: dict[str, Any], phase: str | None, tmp_path: Path
) -> None:
    from trainmem.specs.hf import load_hf_config

    src = tmp_path / "src.json"
    src.write_text(json.dumps(dict(load_hf_config(preset))))
    model = _deeper(src, layers, tmp_path)
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **settings)
    est, generic, full = _peaks(model, training)
    assert generic == full  # the same ops, stored once: byte-exact
    if phase is not None:
        assert est.peak_phase == phase
    # 6 blocks: 5 traced, the middle one stands for 2
    assert any(isinstance(item, Repeat) and item.count == 2 for item in est.schedules[0].step)


def test_cut_model_keeps_one_block_of_each_kind() -> None:
    from trainmem.trace.blocks import find_runs

    dense, moe, sliding, full = "d", "m", "s", "f"
    # DeepSeek-V3: 3 dense layers then MoE layers
    assert find_runs([dense] * 3 + [moe] * 58) == [(0, 1, 3), (3, 1, 58)]
    # Gemma 3: five sliding + one global, 26 layers: 4 units then a partial one
    kinds = ([sliding] * 5 + [full]) * 4 + [sliding, sliding]
    assert find_runs(kinds) == [(0, 6, 4), (24, 1, 2)]
    # Gemma 2: alternating
    assert find_runs([sliding, full] * 13) == [(0, 2, 13)]


def test_schedule_keys_two_blocks_away() -> None:
    # layer i frees the tensor layer i-2 allocated: live = own + the two previous ones
    body = (
        Op("alloc", 100, MemoryCategory.ACTIVATION, "forward", "x{i}"),
        Op("free", 100, MemoryCategory.ACTIVATION, "forward", "x{i_prev2}"),
    )
    head = tuple(Op("alloc", 100, MemoryCategory.ACTIVATION, "forward", f"x{k}") for k in (0, 1))
    tail = tuple(Op("free", 100, MemoryCategory.ACTIVATION, "forward", f"x{k}") for k in (8, 9))
    sched = StepSchedule((), head + (Repeat(body, 8, start=2),) + tail)
    assert sched.peak().peak_bytes == 300
    assert max(sched.expand().live_bytes()) == 300


def test_parameter_count_is_the_full_models(tmp_path: Path) -> None:
    import torch
    import transformers

    raw = json.loads((MODELS_DIR / "deepseek_v3.json").read_text())
    raw["num_hidden_layers"] = 9
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    est = estimate(str(path), TrainingConfig(micro_batch_size=1, seq_len=16), engine="generic")
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", **{k: v for k, v in raw.items() if k != "model_type"}
    )
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    assert est.num_parameters == sum(p.numel() for p in model.parameters())
    lists = est.details["generic"]["block_lists"]
    assert [(x["units"], x["units_traced"]) for x in lists] == [(1, 1), (8, 5)]


# --- generic vs the analytic formulas ------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(2, 64), (4, 256)])
@pytest.mark.parametrize("model", ["tiny-llama-test", "tiny-gpt2-test", *FORMULA_FAMILIES])
def test_generic_agrees_with_analytic_on_formula_families(model: str, batch: int, seq: int) -> None:
    if model == "tiny-gpt2-test" and seq > 128:
        seq = 128  # its learned positions
    tokens = _tokens(model, seq)  # ViT: the patches of its config's image_size
    if model in FORMULA_FAMILIES:
        # Gemma-2 has no SDPA attention in transformers (``_supports_sdpa = False``)
        attention = "eager" if model == "gemma2" else "sdpa"
        model = str(MODELS_DIR / "formula" / f"{model}.json")
    else:
        attention = "sdpa"
    training = TrainingConfig(micro_batch_size=batch, attention=attention, **tokens)
    a = estimate(model, training, engine="analytic", simulate_allocator=False)
    g = estimate(model, training, engine="generic", simulate_allocator=False)
    assert a.num_parameters == g.num_parameters
    x, y = a.breakdown.allocated_bytes, g.breakdown.allocated_bytes
    assert abs(x - y) <= 0.01 * x, (x, y)


# --- engine choice --------------------------------------------------------------------------


def test_auto_runs_formulas_for_known_families_and_generic_otherwise() -> None:
    training = TrainingConfig(micro_batch_size=1, seq_len=32)
    assert estimate("tiny-llama-test", training).engine == "analytic"
    # 8 tokens are enough to see the engine
    est = estimate(str(MODELS_DIR / "mamba.json"), TrainingConfig(micro_batch_size=1, seq_len=8))
    assert est.engine == "generic"
    assert est.notes[0].startswith("auto: model_type 'mamba' is not supported")
    # an explicit engine wins
    assert estimate("tiny-llama-test", training, engine="generic").engine == "generic"
    assert estimate("tiny-llama-test", training, engine="trace").engine == "trace"


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_cli_estimates_every_family_without_an_engine_flag(invoke: Invoke, family: str) -> None:
    # the default engine (auto) takes the formulas where the family has them, else the
    # generic path; BLOOM's transformers attention is eager only

    from trainmem.specs.hf import SUPPORTED_MODEL_TYPES

    extra = ["--attention", "eager"] if family == "bloom" else []
    seq = "8" if family == "mamba" else "32"
    # an image model's sequence is its image's patches (--resolution), not a --seq-len
    tokens = [] if family in IMAGE_FAMILIES else ["-s", seq]
    r = invoke("estimate", str(MODELS_DIR / f"{family}.json"), "-b", "1", *tokens, "--json", *extra)
    d = json.loads(r.stdout)
    # tests/models/dinov2.json is Dinov2ForImageClassification: the formulas model the bare
    # tower only, so auto falls back to the generic path
    formulas = family in SUPPORTED_MODEL_TYPES and family != "dinov2"
    assert d["engine"] == ("analytic" if formulas else "generic")
    assert d["peak"]["allocated_bytes"] > d["breakdown_bytes"]["parameters"] > 0


def test_auto_without_torch_says_what_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from trainmem.estimate import estimate\n"
        "from trainmem.errors import UnsupportedError\n"
        f"try:\n    estimate({str(MODELS_DIR / 'mamba.json')!r})\n"
        "except UnsupportedError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'trainmem[trace]'" in out.stdout
    assert "model_type 'mamba'" in out.stdout


# --- model builders that plug in (diffusers) -----------------------------------------------


class _ToyDiT:
    """A FLUX-shaped toy: double blocks then single blocks, each a residual MLP + attention."""

    @staticmethod
    def build(depth: int = 7) -> Any:
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.qkv = nn.Linear(width, 3 * width)
                self.mlp = nn.Sequential(
                    nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
                )

            def forward(self, x: Any) -> Any:
                b, s, w = x.shape
                qkv = self.qkv(self.norm(x)).view(b, s, 3, 4, w // 4).permute(2, 0, 3, 1, 4)
                att = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
                x = x + att.transpose(1, 2).reshape(b, s, w)
                return x + self.mlp(x)

        class DiT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.proj_in = nn.Linear(16, 64)
                self.transformer_blocks = nn.ModuleList(Block(64) for _ in range(depth))
                self.single_transformer_blocks = nn.ModuleList(Block(64) for _ in range(depth))
                self.proj_out = nn.Linear(64, 16)

            def forward(self, latents: Any) -> Any:
                x = self.proj_in(latents)
                for block in [*self.transformer_blocks, *self.single_transformer_blocks]:
                    x = block(x)
                return self.proj_out(x)

        return DiT()

    @staticmethod
    def batch(model: Any) -> Any:
        import torch

        return (torch.randn(2, 64, 16),)

    @staticmethod
    def loss(output: Any, batch: Any) -> Any:
        return (output.float() - batch[0]).pow(2).mean()


def test_a_plugged_in_builder_composes_like_its_full_trace() -> None:
    from trainmem.trace import trace
    from trainmem.trace.generic import Recipe, trace_generic

    training = TrainingConfig(micro_batch_size=2, seq_len=64)
    recipe = Recipe(
        "toy-dit", _ToyDiT.build, _ToyDiT.batch, loss_fn=_ToyDiT.loss, library="diffusers"
    )
    est = trace_generic(recipe, training)
    lists = [
        (x["list"], x["units"], x["units_traced"]) for x in est.details["generic"]["block_lists"]
    ]
    assert lists == [("transformer_blocks", 7, 5), ("single_transformer_blocks", 7, 5)]
    composed = est.schedules[0].peak().peak_bytes
    full = trace(
        _ToyDiT.build, lambda: _ToyDiT.batch(None), training=training, loss_fn=_ToyDiT.loss
    )
    assert composed == full.details["peak_allocated_bytes"]
    assert est.num_parameters == full.num_parameters


DIFFUSERS = Path(__file__).resolve().parent / "diffusers_configs"


@pytest.mark.parametrize(
    "name",
    # tiny-flux: ~10 s; its two block lists' composition is also _ToyDiT's, in the fast set
    [pytest.param("tiny-flux", marks=pytest.mark.slow), "tiny-sdxl-unet"],
)
def test_a_diffusers_config_runs_the_generic_path_by_default(name: str, tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    raw = json.loads((DIFFUSERS / f"{name}.json").read_text())
    if name == "tiny-flux":  # 7 double and 7 single blocks: 5 of each traced
        raw["num_layers"] = raw["num_single_layers"] = 7
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = TrainingConfig(micro_batch_size=1, resolution=64, text_seq_len=16)
    est = estimate(str(path), training, simulate_allocator=False)
    assert est.engine == "generic"
    assert est.details["diffusers"]["height"] == 64
    # the release that matters is diffusers', not transformers' (whose setting does not apply)
    import importlib.metadata
    import re

    assumed = est.details["assumed"]
    assert "transformers" not in assumed
    # the release's numeric part ("0.43.0.dev0" -> "0.43.0"), as the JSON reports it
    release = re.match(r"[0-9]+(\.[0-9]+)*", importlib.metadata.version("diffusers"))
    assert release is not None
    assert assumed["diffusers"] == release.group(0) + " (installed)"
    full = estimate(str(path), training, engine="trace", simulate_allocator=False)
    x, y = est.breakdown.allocated_bytes, full.breakdown.allocated_bytes
    assert abs(x - y) <= 0.01 * y, (x, y)
    if name == "tiny-flux":
        lists = [
            (x["list"], x["units"], x["units_traced"])
            for x in est.details["generic"]["block_lists"]
        ]
        assert lists == [("transformer_blocks", 7, 5), ("single_transformer_blocks", 7, 5)]


def test_lists_inside_a_list_with_nothing_to_cut_are_cut() -> None:
    import torch
    from torch import nn

    from trainmem.trace import trace
    from trainmem.trace.generic import Recipe, trace_generic

    def build() -> Any:
        class Down(nn.Module):  # a UNet level: a resampler and a stack of transformer blocks
            def __init__(self, width: int, depth: int) -> None:
                super().__init__()
                self.resample = nn.Linear(width, width)
                self.transformer_blocks = nn.ModuleList(
                    nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                    for _ in range(depth)
                )

            def forward(self, x: Any) -> Any:
                x = self.resample(x)
                for block in self.transformer_blocks:
                    x = x + block(x)
                return x

        class UNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.down_blocks = nn.ModuleList([Down(32, 2), Down(32, 8)])

            def forward(self, x: Any) -> Any:
                for down in self.down_blocks:
                    x = down(x)
                return x

        return UNet()

    def batch(_model: Any) -> Any:
        return (torch.randn(4, 16, 32),)

    def loss(out: Any, _batch: Any) -> Any:
        return out.float().pow(2).mean()

    training = TrainingConfig(micro_batch_size=4, seq_len=16)
    est = trace_generic(Recipe("unet", build, batch, loss_fn=loss), training)
    lists = [
        (x["list"], x["units"], x["units_traced"]) for x in est.details["generic"]["block_lists"]
    ]
    assert lists == [("down_blocks.1.transformer_blocks", 8, 5)]
    full = trace(build, lambda: batch(None), training=training, loss_fn=loss)
    assert est.schedules[0].peak().peak_bytes == full.details["peak_allocated_bytes"]


def test_a_forward_that_needs_every_block_falls_back_to_the_whole_trace() -> None:
    import torch
    from torch import nn

    from trainmem.trace import trace
    from trainmem.trace.generic import Recipe, trace_generic

    def build() -> Any:
        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.depth = 8
                self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(self.depth))

            def forward(self, x: Any) -> Any:
                for k in range(self.depth):  # indexes the list by its own count
                    x = torch.relu(self.layers[k](x))
                return x

        return Net()

    def batch(_model: Any) -> Any:
        return (torch.randn(8, 32),)

    def loss(out: Any, _batch: Any) -> Any:
        return out.float().pow(2).mean()

    training = TrainingConfig(micro_batch_size=8, seq_len=1)
    est = trace_generic(Recipe("net", build, batch, loss_fn=loss), training)
    assert any("whole model was traced" in n and "IndexError" in n for n in est.notes)
    full = trace(build, lambda: batch(None), training=training, loss_fn=loss)
    assert est.schedules[0].peak().peak_bytes == full.details["peak_allocated_bytes"]
