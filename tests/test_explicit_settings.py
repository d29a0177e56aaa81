"""Every explicit setting wins (issue 29): a flag given on the command line wins over a
config file (``--deepspeed-config``, ``--accelerate-config``, ``--axolotl-config``,
``--torchtune-config``, ``--training-args``) whatever its value, its default included,
and a flag and a ``--set`` of the same field with different values are refused, naming both.

Whether a flag was given is click's parameter source, never a comparison with its default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Invoke
from trainmem.cli.options import _NOT_FIELDS, TRAINING_OPTIONS
from trainmem.errors import SpecError

# field -> (flag arguments, the value the config shows, a --set that says otherwise). The flag's
# value is the option's default where the option has one a flag can spell.
FLAG_CASES: dict[str, tuple[list[str], Any, str]] = {
    "micro_batch_size": (["-b", "1"], 1, "micro-batch-size=4"),
    "seq_len": (["-s", "128"], 128, "seq-len=256"),
    "target_seq_len": (["--target-seq-len", "0"], 0, "target-seq-len=64"),
    "earlier_seq_lens": (["--earlier-seq-lens", "64,32"], "64,32", "earlier-seq-lens=16"),
    "sample_lengths": (
        ["--sample-lengths", "alpaca-cleaned"],
        "alpaca-cleaned",
        "sample-lengths=9:3",
    ),
    "long_samples": (["--long-samples", "truncate"], "truncate", "long-samples=delete"),
    "precision": (["-p", "bf16-mixed"], "bf16-mixed", "precision=32-true"),
    "load_dtype": (["--load-dtype", "float32"], "float32", "load-dtype=bfloat16"),
    "optimizer": (["-o", "adamw"], "adamw", "optimizer=sgd"),
    "optimizer_implementation": (
        ["--optimizer-implementation", "foreach"],
        "foreach",
        "optimizer-implementation=fused",
    ),
    "torch_version": (["--torch-version", "2.8"], "2.8", "torch-version=2.5"),
    "transformers_version": (
        ["--transformers-version", "5.24"],
        "5.24",
        "transformers-version=4.48",
    ),
    "bitsandbytes_version": (
        ["--bitsandbytes-version", "0.45.0"],
        "0.45.0",
        "bitsandbytes-version=0.41.1",
    ),
    "torchao_version": (["--torchao-version", "0.18.0"], "0.18.0", "torchao-version=0.1"),
    "torchtune_version": (["--torchtune-version", "0.6.1"], "0.6.1", "torchtune-version=0.1"),
    "litgpt_version": (["--litgpt-version", "0.5.13"], "0.5.13", "litgpt-version=0.4.0"),
    "torchtitan_version": (
        ["--torchtitan-version", "0.0.2"],
        "0.0.2",
        "torchtitan-version=0.1",
    ),
    "unsloth_version": (
        ["--unsloth-version", "2026.3.5"],
        "2026.3.5",
        "unsloth-version=2025.1.5",
    ),
    "deepspeed_version": (
        ["--deepspeed-version", "0.19.8"],
        "0.19.8",
        "deepspeed-version=0.16.9",
    ),
    "trl_version": (["--trl-version", "0.13.0"], "0.13.0", "trl-version=0.12.0"),
    "accelerate_version": (
        ["--accelerate-version", "0.27.2"],
        "0.27.2",
        "accelerate-version=0.28.0",
    ),
    "activation_checkpointing": (["-c", "none"], "none", "activation-checkpointing=full"),
    "attention": (["--attention", "sdpa"], "sdpa", "attention=eager"),
    "gradient_accumulation_steps": (
        ["--gradient-accumulation-steps", "1"],
        1,
        "gradient-accumulation-steps=4",
    ),
    "dropout": (["--dropout"], True, "dropout=false"),
    "data_parallel_size": (["--data-parallel-size", "1"], 1, "data-parallel-size=8"),
    "zero_stage": (["--zero-stage", "0"], 0, "zero-stage=2"),
    "shard_group_size": (
        ["--shard-group-size", "4", "--data-parallel-size", "32", "--zero-stage", "3"],
        4,
        "shard-group-size=8",
    ),
    "offload": (["--offload", "none"], "none", "offload=optimizer"),
    "lora_rank": (["--lora-rank", "0"], 0, "lora-rank=8"),
    "lora_targets": (["--lora-targets", "q,v"], ["q", "v"], "lora-targets=q+k+v"),
    "lora_dropout": (["--lora-dropout", "0.0"], 0.0, "lora-dropout=0.1"),
    "lora_variant": (["--lora-variant", "lora"], "lora", "lora-variant=dora"),
    "lora_modules_to_save": (
        ["--lora-modules-to-save", "embed_tokens"],
        ["embed_tokens"],
        "lora-modules-to-save=lm_head",
    ),
    "num_virtual_tokens": (["--num-virtual-tokens", "0"], 0, "num-virtual-tokens=8"),
    "prompt_learning": (
        ["--prompt-learning", "prefix-tuning", "--num-virtual-tokens", "8"],
        "prefix-tuning",
        "prompt-learning=p-tuning",
    ),
    "prefix_projection": (
        ["--prefix-projection", "--num-virtual-tokens", "8"],
        True,
        "prefix-projection=false",
    ),
    "quantize_base": (["--quantize-base", "none"], "none", "quantize-base=nf4"),
    "tensor_parallel_size": (["--tensor-parallel-size", "1"], 1, "tensor-parallel-size=2"),
    "sequence_parallel": (
        ["--sequence-parallel", "--tensor-parallel-size", "2"],
        True,
        "sequence-parallel=false",
    ),
    "pipeline_parallel_size": (["--pipeline-parallel-size", "1"], 1, "pipeline-parallel-size=2"),
    "pipeline_schedule": (["--pipeline-schedule", "1f1b"], "1f1b", "pipeline-schedule=gpipe"),
    "context_parallel_size": (["--context-parallel-size", "1"], 1, "context-parallel-size=2"),
    "framework": (["--framework", "pytorch-amp"], "pytorch-amp", "framework=deepspeed"),
    "chunked_cross_entropy": (["--chunked-cross-entropy", "0"], 0, "chunked-cross-entropy=8"),
    "optimizer_in_backward": (["--optimizer-in-backward"], True, "optimizer-in-backward=false"),
    "activation_offloading": (["--activation-offloading"], True, "activation-offloading=false"),
    "zero_grad_set_to_none": (["--zero-grad-set-to-none"], True, "zero-grad-set-to-none=false"),
    "zero_grad_before_backward": (
        ["--zero-grad-before-backward"],
        True,
        "zero-grad-before-backward=false",
    ),
    "loss": (["--loss", "cross-entropy"], "cross-entropy", "loss=logits-sum"),
    "keep_logits": (["--keep-logits"], True, "keep-logits=false"),
    "cut_cross_entropy": (["--cut-cross-entropy"], True, "cut-cross-entropy=false"),
    "loop": (["--loop", "drop"], "drop", "loop=previous"),
    "compile": (["--compile"], True, "compile=false"),
    "resolution": (["--resolution", "1024"], 1024, "resolution=512"),
    "frames": (["--frames", "81"], 81, "frames=33"),
    "text_seq_len": (["--text-seq-len", "512"], 512, "text-seq-len=77"),
    "ema": (["--ema"], True, "ema=false"),
    "ema_dtype": (["--ema", "--ema-dtype", "float32"], "float32", "ema-dtype=bfloat16"),
    "ema_device": (["--ema", "--ema-device", "cuda"], "cuda", "ema-device=cpu"),
    "frozen_on_gpu": (["--frozen-on-gpu", "none"], "none", "frozen-on-gpu=vae"),
    "layerwise_casting": (
        ["--layerwise-casting", "none"],
        "none",
        "layerwise-casting=float8_e5m2",
    ),
    "lora_adapter_dtype": (
        ["--lora-rank", "8", "--lora-adapter-dtype", "float32"],
        "float32",
        "lora-adapter-dtype=bfloat16",
    ),
    "controlnet": (["--controlnet"], True, "controlnet=false"),
    "controlnet_double_layers": (
        ["--controlnet-double-layers", "4"],
        4,
        "controlnet-double-layers=2",
    ),
    "controlnet_single_layers": (
        ["--controlnet-single-layers", "4"],
        4,
        "controlnet-single-layers=0",
    ),
    "train_text_encoder": (["--train-text-encoder"], True, "train-text-encoder=false"),
    "vae_tiling": (["--vae-tiling"], True, "vae-tiling=false"),
    "nccl_buffer_bytes": (
        ["--nccl-buffer-bytes", "600000000"],
        600000000,
        "nccl-buffer-bytes=700000000",
    ),
}


def test_the_cases_cover_every_option_that_sets_a_field() -> None:
    fields = {p.name for p in TRAINING_OPTIONS if p.name not in _NOT_FIELDS}
    assert set(FLAG_CASES) == fields


@pytest.mark.parametrize("field", sorted(FLAG_CASES))
def test_a_flag_and_a_set_of_the_same_field_are_refused_naming_both(
    invoke: Invoke, field: str
) -> None:
    flag_args, shown, other = FLAG_CASES[field]
    r = invoke("estimate", "gpt2", *flag_args, "--set", other, "--json", exit_code=2)
    key = other.split("=")[0]
    message = r.stderr.strip()
    assert message.count("\n") == 0  # one line
    flag = "--" + field.replace("_", "-")
    assert message.startswith(f"error: set: {field} is given twice: {flag} ")
    assert f"--set {key}={other.split('=')[1].replace('+', ',')}; give one" in message


def test_a_flag_and_a_set_that_agree_are_one_setting(invoke: Invoke) -> None:
    invoke("estimate", "gpt2", "-s", "128", "-b", "1", "--set", "micro-batch-size=1")
    r = invoke("estimate", "gpt2", "-s", "128", "--set", "micro-batch-size=3", "--json")
    assert json.loads(r.stdout)["config"]["micro_batch_size"] == 3  # --set alone applies


# field -> (config file name, its text): each file sets the field to something other than the
# flag's value in FLAG_CASES (checked below with the readers themselves)
FILE_CASES: dict[str, tuple[str, str]] = {
    "micro_batch_size": ("ds.json", '{"train_micro_batch_size_per_gpu": 4}'),
    "gradient_accumulation_steps": ("ds.json", '{"gradient_accumulation_steps": 4}'),
    "precision": ("ds.json", '{"fp16": {"enabled": true}}'),
    "zero_stage": ("ds.json", '{"zero_optimization": {"stage": 2}}'),
    "offload": (
        "ds.json",
        '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}',
    ),
    "activation_checkpointing": (
        "ds.json",
        '{"activation_checkpointing": {"partition_activations": true}}',
    ),
    "framework": ("ds.json", "{}"),
    "data_parallel_size": ("accelerate.yaml", "num_processes: 8\n"),
    "shard_group_size": (
        "accelerate.yaml",
        "distributed_type: FSDP\nnum_processes: 32\nnum_machines: 2\n"
        "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
    ),
}


@pytest.mark.parametrize("field", sorted(FILE_CASES))
def test_an_explicit_flag_wins_over_the_config_file(
    invoke: Invoke, tmp_path: Path, field: str
) -> None:
    from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config

    name, text = FILE_CASES[field]
    path = tmp_path / name
    path.write_text(text)
    flag_args, shown, _ = FLAG_CASES[field]
    read = read_deepspeed_config if name == "ds.json" else read_accelerate_config
    assert read(str(path))[field] != shown  # the file alone says otherwise
    option = "--deepspeed-config" if name == "ds.json" else "--accelerate-config"
    seq = [] if field == "seq_len" else ["-s", "128"]
    r = invoke("estimate", "gpt2", *seq, *flag_args, option, str(path), "--json")
    out = json.loads(r.stdout)
    assert out["config"][field] == shown
    flag = "--" + field.replace("_", "-")
    assert any(note.startswith(f"{flag} ") for note in out["notes"]), out["notes"]


# (option, field, file name, its text): a trainer's own config (axolotl, torchtune, HF
# TrainingArguments) setting the field to something other than the flag's value in FLAG_CASES
TRAINER_FILE_CASES: list[tuple[str, str, str, str]] = [
    ("--axolotl-config", "micro_batch_size", "ax.yml", "micro_batch_size: 4\n"),
    ("--axolotl-config", "seq_len", "ax.yml", "sequence_len: 256\n"),
    ("--axolotl-config", "precision", "ax.yml", "bf16: false\nfp16: true\n"),
    ("--axolotl-config", "optimizer", "ax.yml", "optimizer: sgd\n"),
    ("--axolotl-config", "lora_rank", "ax.yml", "adapter: lora\nlora_r: 8\n"),
    ("--axolotl-config", "framework", "ax.yml", "{}\n"),
    (
        "--axolotl-config",
        "cut_cross_entropy",
        "ax.yml",
        "plugins: [axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin]\n"
        "cut_cross_entropy: false\n",
    ),
    ("--torchtune-config", "framework", "tt.yaml", "batch_size: 2\n"),
    (
        "--torchtune-config",
        "gradient_accumulation_steps",
        "tt.yaml",
        "gradient_accumulation_steps: 4\n",
    ),
    (
        "--torchtune-config",
        "chunked_cross_entropy",
        "tt.yaml",
        "loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n",
    ),
    ("--torchtune-config", "precision", "tt.yaml", "dtype: fp32\n"),
    ("--training-args", "framework", "args.json", "{}"),
    ("--training-args", "micro_batch_size", "args.json", '{"per_device_train_batch_size": 4}'),
    (
        "--training-args",
        "activation_checkpointing",
        "args.json",
        '{"gradient_checkpointing": true}',
    ),
    ("--training-args", "optimizer", "args.json", '{"optim": "adafactor"}'),
]


TRAINER_FLAGS: dict[tuple[str, str], tuple[list[str], Any]] = {
    # torchtune trains in bf16-true or 32-true only: -p bf16-mixed is refused with it
    ("--torchtune-config", "precision"): (["-p", "bf16-true"], "bf16-true"),
}
"""The flag of a case where :data:`FLAG_CASES`' would be refused with that file's framework."""


@pytest.mark.parametrize(
    ("option", "field", "name", "text"),
    TRAINER_FILE_CASES,
    ids=[f"{c[0][2:]}-{c[1]}" for c in TRAINER_FILE_CASES],
)
def test_an_explicit_flag_wins_over_a_trainer_config(
    invoke: Invoke, tmp_path: Path, option: str, field: str, name: str, text: str
) -> None:
    from trainmem.specs.trainer_configs import (
        read_axolotl_config,
        read_torchtune_config,
        read_training_args,
    )

    path = tmp_path / name
    path.write_text(text)
    flag_args, shown = TRAINER_FLAGS.get((option, field), FLAG_CASES[field][:2])
    read = {
        "--axolotl-config": read_axolotl_config,
        "--torchtune-config": read_torchtune_config,
        "--training-args": read_training_args,
    }[option]
    assert read(str(path))[field] != shown  # the file alone says otherwise
    seq = [] if field == "seq_len" else ["-s", "128"]
    r = invoke("estimate", "gpt2", *seq, option, str(path), "--json")
    assert json.loads(r.stdout)["config"][field] != shown  # and the estimate reads it
    r = invoke("estimate", "gpt2", *seq, *flag_args, option, str(path), "--json")
    out = json.loads(r.stdout)
    assert out["config"][field] == shown
    flag = "--" + field.replace("_", "-")
    assert any(note.startswith(f"{flag} ") for note in out["notes"]), out["notes"]


def test_the_issue_example_micro_batch_one_over_the_files_four(
    invoke: Invoke, tmp_path: Path
) -> None:
    # `-b 1` with "train_micro_batch_size_per_gpu": 4 used 4 (issue 29): 1 is the default, so
    # a comparison with the default could not tell that it was given
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}}))
    r = invoke("estimate", "gpt2", "-s", "128", "--deepspeed-config", str(path), "--json")
    assert json.loads(r.stdout)["config"]["micro_batch_size"] == 4
    invoke("estimate", "gpt2", "-s", "128", "--deepspeed-config", str(path), "-b", "1")
    r = invoke(
        "estimate", "gpt2", "-s", "128", "--deepspeed-config", str(path), "-b", "1", "--json"
    )
    assert json.loads(r.stdout)["config"]["micro_batch_size"] == 1


COMMANDS: dict[str, list[str]] = {
    "estimate": ["estimate", "gpt2"],
    "formulas": ["formulas", "gpt2"],
    "plan": ["plan", "gpt2", "--gpu", "A100-80GB"],
    "fit": ["fit", "gpt2", "--gpu", "A100-80GB"],
    "sweep": ["sweep", "gpt2", "--over", "seq-len=128,256"],
    "compare": ["compare", "gpt2", "--set", "activation-checkpointing=full"],
    "compare-snapshot": ["compare-snapshot", "missing.pickle", "gpt2"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_explicit_flag(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    import trainmem.cli.options as options

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {}}))
    seen: list[Any] = []
    real = options.training_from_options

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        raise SpecError("stop", "the test has what it needs")

    monkeypatch.setattr(options, "training_from_options", spy)
    args = [*COMMANDS[command], "--deepspeed-config", str(path), "-p", "bf16-mixed", "-b", "1"]
    r = invoke(*args, exit_code=2)
    assert "error: stop:" in r.stderr, r.output
    assert (seen[0].micro_batch_size, seen[0].precision) == (1, "bf16-mixed")
