"""Issue 26: every option ``trainmem estimate`` takes is reachable on the web page and every
page setting from the CLI; what differs is listed here with the page's way to the same setting."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from trainmem.cli.options import TRAINING_OPTIONS
from trainmem.specs.training import TrainingConfig
from trainmem.web import uploads
from trainmem.web.form import CHOICES, DEFAULTS

PAGE_ROUTE: dict[str, Callable[[], bool]] = {
    # --fsdp STRATEGY is the framework accelerate-fsdp / fsdp2 with a ZeRO stage (full-shard
    # 3, shard-grad-op 3 + reshard_after_forward off, no-shard 0), all widgets of the page
    "fsdp": lambda: (
        {"accelerate-fsdp", "fsdp2"} <= set(CHOICES["framework"])
        and {"zero_stage", "reshard_after_forward", "shard_group_size"} <= set(DEFAULTS)
    ),
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


def test_every_cli_option_is_on_the_page() -> None:
    missing = [
        p.name for p in TRAINING_OPTIONS if p.name not in DEFAULTS and p.name not in PAGE_ROUTE
    ]
    assert missing == []
    for name, reachable in PAGE_ROUTE.items():
        assert name not in DEFAULTS, f"{name} has a widget now: drop it from PAGE_ROUTE"
        assert reachable(), name


def test_every_page_setting_is_a_cli_setting() -> None:
    cli = {p.name for p in TRAINING_OPTIONS} | {f.name for f in dataclasses.fields(TrainingConfig)}
    assert [k for k in DEFAULTS if k not in cli] == []


def test_the_presets_are_choices_on_the_page() -> None:
    assert {"llama-factory", "axolotl", "hf-trainer"} <= set(CHOICES["framework"])
