"""Inputs that cannot break trainmem (issue 17): property-based fuzzing of the CLI and the
Python API, plus the fuzzing report's findings as fixed cases.

Every input must end either in a correct-looking answer (exit 0, every byte figure a
non-negative int, every pipeline stage with at least one layer) or in one clear line
``error: <field>: <message>`` with exit code 2 (a ``trainmem.errors`` error; typer's own usage
errors also exit 2) -- never a traceback or a hang. Hypothesis runs derandomized, so CI sees
the same examples every time, within a fixed budget (about 30 s on one core).

Known limits of the generators (the analytic engine's step replay is being rewritten, issue
11): accepted values that are merely slow today (``gradient_accumulation_steps`` in the
thousands, ``seq_len`` 1 on an 8B model, tens of thousands of layers) are not drawn; refused
ones (above 2^31 - 1, malformed) are.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Invoke
from trainmem import TrainingConfig, estimate
from trainmem.errors import TrainmemError
from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config
from trainmem.specs.hardware import GPUS, get_gpu
from trainmem.specs.hf import model_spec_from_hf

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

#: Small models of every kind (decoder with learned / rotary positions, MoE-free encoder, ViT).
MODELS = ["tiny-gpt2-test", "tiny-llama-test", "gpt2", "bert-base-uncased", "llama-3.2-1b"]


def check_result(result: Any) -> None:
    """The CLI contract: exit 0 with a sane answer, or exit 2 with one clear line."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code in (0, 2), (result.exit_code, result.output)
    if result.exit_code == 2:
        err = result.stderr.strip()
        if err.startswith("error:"):
            assert "\n" not in err, err
            assert "Traceback" not in result.output
        else:  # typer's usage error (unknown option, a value click refuses)
            assert "Usage:" in err, err
        return
    if result.stdout.lstrip().startswith("{"):
        check_estimate_json(json.loads(result.stdout))


def check_estimate_json(d: dict[str, Any]) -> None:
    """No negative byte figure, no stage without layers, no more trainable than total."""
    for key, value in d["breakdown_bytes"].items():
        assert isinstance(value, int) and value >= 0, (key, value)
    assert d["breakdown_bytes"]["parameters"] > 0
    assert 0 <= d["num_trainable_parameters"] <= d["num_parameters"]
    for rank in d.get("per_rank") or []:
        assert rank["num_layers"] >= 1, rank
        assert rank["allocated_bytes"] >= 0, rank


# ---------------------------------------------------------------------------------------
# The fuzzing report's findings, one by one
# ---------------------------------------------------------------------------------------

REPORTED: list[tuple[list[str], str]] = [
    (["estimate", "gpt2", "--zero-stage", "2.0"], "zero_stage: unknown value '2.0'"),
    (["estimate", "gpt2", "-b", "1_000"], "micro_batch_size: must be a positive integer"),
    (["estimate", "gpt2", "--set", "micro-batch-size=1_000"], "micro_batch_size: must be an"),
    (["estimate", "gpt2", "-b", "1e12"], "micro_batch_size: must be a positive integer"),
    (["formulas", "gpt2", "-b", "1" + "0" * 70], "micro_batch_size: must be a positive integer"),
    (["estimate", "gpt2", "-b", "9" * 4000], "micro_batch_size: must be a positive integer"),
    (["estimate", "gpt2", "--lora-rank", "1000000000000"], "lora_rank: must be at most"),
    (["estimate", "gpt2", "--lora-rank", "1" + "0" * 400], "lora_rank: must be a"),
    (["estimate", "gpt2", "--lora-dropout", "nan", "--lora-rank", "8"], "lora_dropout: must be"),
    # L = 16, ceil split: p = 5 leaves 16 - 4 * 4 = 0, p = 7 leaves 16 - 6 * 3 < 0, p = 12 leaves
    # 16 - 11 * 2 < 0; p = 6 (3, 3, 3, 3, 3, 1) and p = 8 (2 each) work
    (["estimate", "llama-3.2-1b", "--pipeline-parallel-size", "12"], "allowed: 1-4, 6, 8, 16"),
    (["estimate", "gpt2", "--context-parallel-size", "4096", "-s", "1024"], "context_parallel"),
    (["estimate", "gpt2", "--fsdp", "full-shard", "--zero-stage", "1"], "fsdp: full-shard"),
    (
        ["estimate", "gpt2", "--optimizer-in-backward", "--gradient-accumulation-steps", "4"],
        "optimizer_in_backward: cannot be combined",
    ),
    (["estimate", "gpt2", "--seq-len", "4096"], "seq_len: 4096 is longer than gpt2's 1024"),
    (["estimate", "gpt2", "--precision", "fp8-mixed", "--gpu", "V100-16GB"], "float8"),
    (["fit", "gpt2", "--precision", "fp8-mixed", "--gpu", "V100-32GB"], "float8"),
    (["estimate", "gpt2", "--gpu", "A100"], "ambiguous: it could be A100-80GB, A100-40GB"),
    (
        ["estimate", "vit-large-patch16-224", "--lora-rank", "8", "--lora-targets", "lm_head"],
        "has no 'lm_head' linear",
    ),
    (["estimate", "gpt2", "--alloc-conf", "per_process_memory_fraction:1e-300"], "--gpu"),
    (["estimate", "a" * 300], "model: unknown model preset"),
    (["estimate", "a" * 300 + ".json"], "model: file or folder not found"),
    (["estimate", "gpt2", "--deepspeed-config", "/dev/zero"], "not a regular file"),
    (["estimate", "gpt2", "--accelerate-config", "/dev/zero"], "not a regular file"),
    # session 17: was "error: key 'grad/head/0' allocated while live" (a schedule's internal
    # check): torchao's CPUOffloadOptimizer(offload_gradients=True) frees every gradient it
    # offloads and its zero_grad asserts set_to_none (torchao optim/cpu_offload.py)
    (
        ["estimate", "tiny-gpt2-test", "--zero-grad-keep", "--offload", "optimizer+gradients"],
        "zero_grad_set_to_none: False (gradients kept between steps) cannot be combined",
    ),
    # session 17: FSDP1 (use_orig_params=False) cannot flatten LoKr / AdaLoRA beside their
    # frozen base: was torch's ValueError traceback on the generic path
    (
        "estimate tiny-llama-test --lora-rank 4 --lora-variant lokr --framework fsdp-qlora".split(),
        "lora_variant: lokr with --framework fsdp-qlora: FSDP1",
    ),
    # session 17: was "error: free of key 'view_grad/head/0', which is not live" (FSDP1) and
    # the same number as without the option (Megatron-LM: silently ignored)
    (
        "estimate tiny-gpt2-test --framework accelerate-fsdp --optimizer-in-backward".split(),
        "optimizer_in_backward: not available under --framework accelerate-fsdp",
    ),
    (
        "estimate tiny-gpt2-test --framework megatron --optimizer-in-backward".split(),
        "optimizer_in_backward: not available under --framework megatron",
    ),
]


@pytest.mark.parametrize(("args", "message"), REPORTED, ids=lambda v: str(v)[:60])
def test_reported_inputs_end_in_one_line(invoke: Invoke, args: list[str], message: str) -> None:
    result = invoke(*args, exit_code=None)
    check_result(result)
    assert result.exit_code == 2, result.output
    assert message in result.stderr, result.stderr


def test_pipeline_stages_that_hold_layers_still_work(invoke: Invoke) -> None:
    # llama-3.2-1b has 16 layers: p = 16 gives one layer per stage (ceil(16 / 16) = 1)
    result = invoke(
        "estimate", "llama-3.2-1b", "--pipeline-parallel-size", "16", "--json", exit_code=None
    )
    check_result(result)
    assert result.exit_code == 0, result.output
    assert [r["num_layers"] for r in json.loads(result.stdout)["per_rank"]] == [1, 1]


def test_output_paths_that_cannot_be_written(invoke: Invoke, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for option, name in (("--plot", "x.png"), ("--html", "x.html"), ("--snapshot", "x.pickle")):
        result = invoke("estimate", "tiny-gpt2-test", option, str(blocker / name), exit_code=None)
        check_result(result)
        assert result.exit_code == 2 and "cannot write" in result.stderr, result.output
        assert not (tmp_path / name).exists()


def test_model_path_with_tex_markup_plots(invoke: Invoke, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    config = tmp_path / "a$^$b.json"  # "$^$" is invalid TeX: matplotlib raised ValueError
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 99}
        )
    )
    out = tmp_path / "t.png"
    result = invoke("estimate", str(config), "--plot", str(out), exit_code=None)
    check_result(result)
    assert result.exit_code == 0 and out.stat().st_size > 0, result.output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_to_a_full_device_is_an_error() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "trainmem", "estimate", "tiny-gpt2-test", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    assert proc.returncode == 2  # was a traceback (exit 1) after printing nothing
    assert proc.stderr.strip() == "error: output: cannot write the result: No space left on device"


def test_same_command_gives_byte_identical_json(invoke: Invoke) -> None:
    args = ["estimate", "gpt2", "-b", "2", "--gpu", "T4", "--json"]
    first, second = invoke(*args), invoke(*args)
    assert first.stdout == second.stdout


# ---------------------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: estimate(None), "model"),  # type: ignore[arg-type]
        (lambda: estimate(["gpt2"]), "model"),  # type: ignore[arg-type]
        (lambda: estimate("gpt2", {"micro_batch_size": 2}), "training"),  # type: ignore[arg-type]
        (lambda: estimate("gpt2", engine=None), "engine"),  # type: ignore[arg-type]
        (lambda: estimate("gpt2", cuda_context_bytes=-(10**12)), "cuda_context_bytes"),
        (lambda: estimate("gpt2", cuda_context_bytes=1.5), "cuda_context_bytes"),  # type: ignore[arg-type]
        (lambda: estimate("gpt2", alloc_conf=None), "alloc_conf"),  # type: ignore[arg-type]
        (lambda: estimate("gpt2", gpu=None or 7), "gpu"),  # type: ignore[arg-type]
        (lambda: TrainingConfig(lora_dropout="0.1"), "lora_dropout"),  # type: ignore[arg-type]
        (lambda: TrainingConfig(dropout="no"), "dropout"),  # type: ignore[arg-type]
        (lambda: get_gpu(None), "gpu"),  # type: ignore[arg-type]
        (lambda: model_spec_from_hf(None, name="x"), "model"),  # type: ignore[arg-type]
    ],
)
def test_api_misuse_raises_typed_errors(call: Any, field: str) -> None:
    with pytest.raises(TrainmemError) as info:
        call()
    assert getattr(info.value, "field", None) == field, info.value


_INT_TEXT = st.one_of(
    st.integers(min_value=-3, max_value=9).map(str),
    st.sampled_from(["0", "-1", "2147483648", "1e12", "2.0", "1_000", "0x10", "", " ", "nan"]),
    st.integers(min_value=30, max_value=500).map(lambda n: "9" * n),
)
_CHOICE_TEXT = st.sampled_from(["none", "full", "adamw", "bf16-mixed", "fp8-mixed", "x", ""])

#: (option, value strategy) pairs the CLI fuzzer draws from.
_OPTIONS: list[tuple[str, st.SearchStrategy[str]]] = [
    ("--micro-batch-size", _INT_TEXT),
    ("--seq-len", st.one_of(_INT_TEXT, st.sampled_from(["64", "128", "1024", "4096"]))),
    ("--gradient-accumulation-steps", st.sampled_from(["1", "2", "0", "-1", "2.0", "9" * 40])),
    ("--data-parallel-size", _INT_TEXT),
    ("--zero-stage", _INT_TEXT),
    ("--tensor-parallel-size", _INT_TEXT),
    ("--pipeline-parallel-size", _INT_TEXT),
    ("--context-parallel-size", _INT_TEXT),
    ("--lora-rank", _INT_TEXT),
    ("--chunked-cross-entropy", _INT_TEXT),
    ("--lora-dropout", st.sampled_from(["0.1", "1", "-0.5", "nan", "inf", "1e400", "0.1.2"])),
    ("--lora-targets", st.sampled_from(["q,v", "all-linear", "lm_head", "gate", ",", "zz"])),
    ("--precision", _CHOICE_TEXT),
    ("--optimizer", _CHOICE_TEXT),
    ("--activation-checkpointing", _CHOICE_TEXT),
    ("--offload", st.sampled_from(["none", "optimizer", "optimizer+params", "gpu"])),
    ("--fsdp", st.sampled_from(["full-shard", "shard-grad-op", "no-shard", "all"])),
    ("--quantize-base", st.sampled_from(["none", "nf4", "int8", "int3"])),
    ("--framework", st.sampled_from(["deepspeed", "megatron", "litgpt", "jax"])),
    ("--pipeline-schedule", st.sampled_from(["1f1b", "interleaved-1f1b", "gpipe", "zb"])),
    ("--gpu", st.sampled_from([*GPUS, "A100", "h100", "", "Z80"])),
    (
        "--alloc-conf",
        st.sampled_from(["", "expandable_segments:True", "x:y", "max_split_size_mb:1"]),
    ),
    ("--set", st.sampled_from(["compile=true", "dropout=no", "seq-len=1e3", "nope=1", "="])),
]
_FLAGS = ["--sequence-parallel", "--optimizer-in-backward", "--activation-offloading", "--compile"]


@st.composite
def cli_args(draw: st.DrawFn) -> list[str]:
    args = [draw(st.sampled_from(["estimate", "formulas"])), draw(st.sampled_from(MODELS))]
    for option, values in draw(st.lists(st.sampled_from(_OPTIONS), max_size=5, unique=True)):
        args += [option, draw(values)]
    args += draw(st.lists(st.sampled_from(_FLAGS), max_size=2, unique=True))
    if args[0] == "estimate" or draw(st.booleans()):
        args.append("--json")
    return args


_INT_OPTIONS = {option for option, values in _OPTIONS if values is _INT_TEXT} | {
    "--gradient-accumulation-steps"
}


@settings(FUZZ, max_examples=250)
@given(args=cli_args())
def test_fuzz_cli_options(invoke: Invoke, args: list[str]) -> None:
    result = invoke(*args, exit_code=None)
    check_result(result)
    malformed = [
        (option, value)
        for option, value in zip(args, args[1:], strict=False)
        if option in _INT_OPTIONS and not value.lstrip("-").isdigit()
    ]
    if malformed:  # 1_000, 2.0, 1e12, "": never silently read as a number
        assert result.exit_code == 2, (malformed, result.output)


@settings(FUZZ, max_examples=60)
@given(
    option=st.sampled_from(sorted(_INT_OPTIONS)),
    value=st.one_of(
        st.sampled_from(["1_000", "2.0", "1e12", "1e3", "0x10", "", "nan", "four", "\u0663"]),
        st.integers(min_value=31, max_value=5000).map(lambda n: "1" + "0" * n),
    ),
)
def test_fuzz_malformed_numbers(invoke: Invoke, option: str, value: str) -> None:
    # int() reads "1_000" and the Arabic-Indic digit three (U+0663); 31 digits are beyond any
    # size
    result = invoke("estimate", "tiny-gpt2-test", option, value, exit_code=None)
    check_result(result)
    assert result.exit_code == 2, result.output


@settings(FUZZ, max_examples=60)
@given(model=st.sampled_from(["gpt2", "llama-3.2-1b", "bert-base-uncased"]), p=st.integers(1, 40))
def test_fuzz_pipeline_sizes(invoke: Invoke, model: str, p: int) -> None:
    # the fuzzer's 135 configurations with a stage of negative layers: every accepted size
    # leaves each stage at least one layer, and the refused ones name the allowed sizes
    result = invoke(
        "estimate", model, "--pipeline-parallel-size", str(p), "-s", "128", "--json", exit_code=None
    )
    check_result(result)
    if result.exit_code == 2:
        assert "pipeline_parallel_size" in result.stderr and "allowed:" in result.stderr


_ODD = st.sampled_from(
    [0, -1, 1, 3, 2**31, 2**70, 1.5, math.nan, math.inf, True, None, "12", [], [4], {}, {"a": 1}]
)
_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}
_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "architectures": ["LlamaForCausalLM"],
}


@st.composite
def hf_configs(draw: st.DrawFn) -> dict[str, Any]:
    config = dict(draw(st.sampled_from([_GPT2, _LLAMA])))
    keys = [*config, "head_dim", "n_inner", "tie_word_embeddings", "max_position_embeddings"]
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()) and key in config:
            del config[key]
        else:
            config[key] = draw(_ODD)
    return config


@settings(FUZZ, max_examples=200)
@given(config=hf_configs())
def test_fuzz_hf_configs(tmp_path: Path, config: dict[str, Any]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))  # NaN / Infinity are written as JSON extensions
    try:
        est = estimate(str(path), TrainingConfig(seq_len=32))
    except TrainmemError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 400, exc
        return
    check_estimate_json(est.to_dict())


_JSONISH = st.recursive(
    st.one_of(_ODD, st.sampled_from(["auto", "cpu", "nvme", "FULL_SHARD", "true", "2"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "stage"]), inner)
    ),
    max_leaves=6,
)
_DS_KEYS = [
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "zero_optimization",
    "activation_checkpointing",
]
_ZERO_KEYS = ["stage", "offload_optimizer", "offload_param"]
_ACCELERATE_KEYS = [
    "mixed_precision",
    "num_processes",
    "distributed_type",
    "fsdp_config",
    "deepspeed_config",
]


@settings(FUZZ, max_examples=200)
@given(
    ds=st.dictionaries(st.sampled_from(_DS_KEYS), _JSONISH, max_size=4),
    zero=st.dictionaries(st.sampled_from(_ZERO_KEYS), _JSONISH, max_size=3),
    accelerate=st.dictionaries(st.sampled_from(_ACCELERATE_KEYS), _JSONISH, max_size=4),
)
def test_fuzz_framework_configs(
    tmp_path: Path, ds: dict[str, Any], zero: dict[str, Any], accelerate: dict[str, Any]
) -> None:
    if zero:
        ds["zero_optimization"] = zero
    ds_path, yaml_path = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    ds_path.write_text(json.dumps(ds))
    yaml_path.write_text(json.dumps(accelerate))  # JSON is YAML
    for read, path in ((read_deepspeed_config, ds_path), (read_accelerate_config, yaml_path)):
        try:
            TrainingConfig(**read(str(path)))
        except TrainmemError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 400, exc


_FIELD_VALUES = st.one_of(
    _ODD, st.sampled_from(["none", "full", "adamw", "q", ("q", "v"), ("lm_head",), "fp8-mixed"])
)


@settings(FUZZ, max_examples=300)
@given(
    kwargs=st.dictionaries(
        st.sampled_from([f for f in TrainingConfig.__dataclass_fields__]), _FIELD_VALUES, max_size=4
    )
)
def test_fuzz_training_config_fields(kwargs: dict[str, Any]) -> None:
    try:
        training = TrainingConfig(**kwargs)
    except TrainmemError as exc:
        assert "\n" not in str(exc), exc
        return
    if training.gradient_accumulation_steps > 8 or training.micro_batch_size > 2**20:
        return  # accepted but slow in today's step replay (issue 11); not this test's business
    try:
        est = estimate("tiny-llama-test", training)
    except TrainmemError as exc:
        assert "\n" not in str(exc), exc
        return
    check_estimate_json(est.to_dict())
