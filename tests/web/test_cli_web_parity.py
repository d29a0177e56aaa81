"""Issue 26: every option ``trainmem estimate`` takes is reachable on the web page and every
page setting from the CLI; what differs is listed here with the page's way to the same setting."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from trainmem.cli.app import estimate_cmd
from trainmem.cli.options import TRAINING_OPTIONS
from trainmem.specs.training import TrainingConfig
from trainmem.web import uploads
from trainmem.web.form import CHOICES, DEFAULTS, default_values

PAGE_ROUTE: dict[str, Callable[[], bool]] = {
    # LoRA's alpha scales the update; it changes no tensor's size (no memory effect)
    "lora_alpha": lambda: "lora_rank" in DEFAULTS,
    # the config files are the page's uploads
    "deepspeed_config": lambda: callable(uploads.deepspeed_from_upload),
    "accelerate_config": lambda: callable(uploads.accelerate_from_upload),
    "axolotl_config": lambda: callable(uploads.trainer_config_from_upload),
    "torchtune_config": lambda: callable(uploads.trainer_config_from_upload),
    "training_args": lambda: callable(uploads.trainer_config_from_upload),
    # --set FIELD=VALUE reaches any TrainingConfig field; the page has a widget for each
    "settings": lambda: {f.name for f in dataclasses.fields(TrainingConfig)} <= set(DEFAULTS),
}


PAGE_KEYS = set(default_values())
"""Every widget's setting: the TrainingConfig fields and the page's own (model, gpu, engine,
alloc_conf, fsdp)."""

ESTIMATE_ROUTE: dict[str, str] = {
    "as_json": "Downloads: the estimate as JSON",
    "snapshot": "Downloads: the memory snapshot",
    "html": "Downloads: the HTML report",
    "plot": "the Timeline picture tab",
    "uncertainty": "always shown: the band under the verdict",
    "modules": "the Per module tab (top rows)",
    # the page does not show the host RAM of an offloaded run (details.host_memory, in the
    # JSON download at the default of min(GPUs, 8) processes per node)
    "gpus_per_node": "not on the page: it shows no host RAM",
}
"""``trainmem estimate``'s own options (not training settings) and where the page has them."""


def test_every_cli_option_is_on_the_page() -> None:
    missing = [
        p.name for p in TRAINING_OPTIONS if p.name not in PAGE_KEYS and p.name not in PAGE_ROUTE
    ]
    assert missing == []
    for name, reachable in PAGE_ROUTE.items():
        assert name not in PAGE_KEYS, f"{name} has a widget now: drop it from PAGE_ROUTE"
        assert reachable(), name


def test_every_estimate_option_is_on_the_page() -> None:
    own = [
        name
        for name in inspect.signature(estimate_cmd).parameters
        if name not in {p.name for p in TRAINING_OPTIONS} and name != "typer_context"
    ]
    missing = [n for n in own if n not in PAGE_KEYS and n not in ESTIMATE_ROUTE]
    assert missing == []
    assert not set(ESTIMATE_ROUTE) & PAGE_KEYS


def test_every_page_setting_is_a_cli_setting() -> None:
    cli = {p.name for p in TRAINING_OPTIONS} | {f.name for f in dataclasses.fields(TrainingConfig)}
    assert [k for k in DEFAULTS if k not in cli] == []


def test_the_presets_are_choices_on_the_page() -> None:
    assert {"llama-factory", "axolotl", "hf-trainer"} <= set(CHOICES["framework"])
