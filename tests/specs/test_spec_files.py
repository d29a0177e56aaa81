"""Config files that cannot break trainmem: HF config.json, ds_config.json and accelerate YAML
that are malformed, hostile or not files at all end in one SpecError line, fast (issue 17)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from trainmem.errors import SpecError
from trainmem.specs.files import MAX_CONFIG_BYTES
from trainmem.specs.framework_configs import read_accelerate_config, read_deepspeed_config
from trainmem.specs.hf import load_hf_config, load_model_spec, model_spec_from_hf

GPT2_TINY = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}


def _write(tmp_path: Path, name: str, data: bytes | str) -> str:
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(p)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 400, text
    return text


# ---------------------------------------------------------------------------------------
# HF config.json
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x80\x81binary", "not UTF-8 text"),  # was UnicodeDecodeError
        ('{"model_type": "gpt2"}'.encode("utf-16"), "not UTF-8 text"),
        ('{"model_type": "gpt2", "n_embd": "é"}'.encode("latin-1"), "not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # was RecursionError
        (b'{"n_embd": ' + b"9" * 5000 + b"}", "not valid JSON"),  # int beyond 4300 digits
        (b"[1, 2]", "holds a JSON list"),
        (b"{", "not valid JSON"),
    ],
)
def test_unreadable_config_json(tmp_path: Path, data: bytes, match: str) -> None:
    path = _write(tmp_path, "config.json", data)
    with pytest.raises(SpecError, match=match) as info:
        load_hf_config(path)
    _one_line(info.value)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_embd": 2**70 * 4}, "n_embd: must be at most 2,147,483,647"),  # was OverflowError
        ({"n_layer": 10**12}, "n_layer: must be at most"),  # was a hang
        ({"n_layer": 10**7}, "num_layers: 10,000,000 layers is beyond any real model"),
        ({"n_embd": 0}, "n_embd: must be a positive integer, got 0"),
        ({"n_layer": -3}, "n_layer: must be a positive integer"),
        ({"n_embd": 66}, "4 attention heads do not divide n_embd=66"),
        ({"vocab_size": [1, 2]}, "vocab_size: must be a positive integer, got a list"),
        ({"n_head": {"a": 1}}, "n_head: must be a positive integer, got a dict"),
        ({"architectures": "GPT2LMHeadModel"}, "architectures: must be a list"),
        ({"resid_pdrop": float("nan")}, "resid_pdrop: must be a probability"),
    ],
)
def test_malformed_hf_fields(changes: dict[str, object], match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        model_spec_from_hf({**GPT2_TINY, **changes}, name="x")
    _one_line(info.value)


def test_config_that_is_not_a_mapping() -> None:
    with pytest.raises(SpecError, match="a config must be a mapping"):
        model_spec_from_hf([1, 2], name="x")  # type: ignore[arg-type]


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # open() would wait for a writer forever
    start = time.monotonic()
    with pytest.raises(SpecError, match="not a regular file"):
        load_hf_config(str(fifo))
    with pytest.raises(SpecError, match="not a regular file"):
        read_deepspeed_config(str(fifo))
    assert time.monotonic() - start < 2


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_endless_device_is_refused() -> None:
    for read in (read_deepspeed_config, read_accelerate_config):
        with pytest.raises(SpecError, match="not a regular file"):
            read("/dev/zero")  # was read until MemoryError


def test_huge_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with path.open("wb") as f:  # sparse: no disk used
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(SpecError, match="more than the 16,777,216 a config may be"):
        load_hf_config(str(path))


@pytest.mark.parametrize("name", ["a" * 300, "a" * 300 + ".json", "x/" * 3000, "bad\0name"])
def test_impossible_names_are_unknown_models(name: str) -> None:
    with pytest.raises(SpecError) as info:  # was OSError: File name too long
        load_model_spec(name)
    assert info.value.field == "model"
    _one_line(info.value)


@pytest.mark.parametrize("value", [None, "", 3, ["gpt2"]])
def test_model_name_of_the_wrong_type(value: object) -> None:
    with pytest.raises(SpecError, match="model"):
        load_hf_config(value)  # type: ignore[arg-type]


def test_hub_id_offline_fails_fast_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")

    def no_dns(*args: object, **kwargs: object) -> object:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    start = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_hf_config("some-org/some-model")
    assert time.monotonic() - start < 2  # huggingface_hub's own retries took 23.5 s
    text = _one_line(info.value)
    assert "unreachable" in text and "pass the path" in text


def test_hub_id_with_hf_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> object:
        raise AssertionError("HF_HUB_OFFLINE must not touch the network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(SpecError, match="HF_HUB_OFFLINE is set"):
        load_hf_config("some-org/some-model")


# ---------------------------------------------------------------------------------------
# ds_config.json and accelerate YAML
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ds", "match"),
    [  # the six AttributeError cases of the fuzzing report, and kin
        ({"zero_optimization": "stage3"}, "zero_optimization must be a mapping, got str"),
        ({"zero_optimization": [3]}, "zero_optimization must be a mapping, got list"),
        ({"bf16": 1}, "bf16 must be a mapping, got int"),
        ({"fp16": [True]}, "fp16 must be a mapping, got list"),
        ({"zero_optimization": {"offload_optimizer": "cpu"}}, "offload_optimizer must be a"),
        ({"zero_optimization": {"offload_param": 5}}, "offload_param must be a mapping"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing must be a mapping"),
        ({"zero_optimization": {"stage": 2.0}}, "stage must be 0, 1, 2 or 3, got 2.0"),
        ({"train_micro_batch_size_per_gpu": "4"}, "must be an integer or \"auto\", got '4'"),
        ({"bf16": {"enabled": "yes"}}, "enabled must be true, false"),
    ],
)
def test_malformed_deepspeed_config(tmp_path: Path, ds: object, match: str) -> None:
    path = _write(tmp_path, "ds.json", json.dumps(ds))
    with pytest.raises(SpecError, match=match) as info:
        read_deepspeed_config(path)
    assert info.value.field == "deepspeed_config"
    _one_line(info.value)


def test_deepspeed_auto_values_are_still_skipped(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "ds.json",
        json.dumps({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}),
    )
    assert read_deepspeed_config(path) == {"framework": "deepspeed"}


@pytest.mark.parametrize(
    ("yaml_text", "match"),
    [
        ("distributed_type: FSDP\nfsdp_config: hello\n", "fsdp_config must be a mapping"),
        ("distributed_type: DEEPSPEED\ndeepspeed_config: [1, 2]\n", "deepspeed_config must be"),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: 5\n",
            "deepspeed_config_file must be a path, got 5",
        ),
        ("mixed_precision: [bf16]\n", "mixed_precision must be a single value"),
        ("num_processes: 8.5\n", "num_processes must be a positive integer"),
        ("a: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("a: &x [*x]\n", "not valid YAML"),  # a recursive alias
    ],
)
def test_malformed_accelerate_config(tmp_path: Path, yaml_text: str, match: str) -> None:
    path = _write(tmp_path, "accelerate.yaml", yaml_text)
    with pytest.raises(SpecError, match=match) as info:
        read_accelerate_config(path)
    _one_line(info.value)


def test_yaml_billion_laughs_is_refused_quickly(tmp_path: Path) -> None:
    # 9 levels of 9 aliases: 9^9 = 387,420,489 leaves from 10 lines
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("mixed_precision: *a9")  # str() of this would exhaust memory
    path = _write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(SpecError, match="expands to more than 10,000 nodes"):
        read_accelerate_config(path)
    assert time.monotonic() - start < 2


def test_a_few_aliases_are_fine(tmp_path: Path) -> None:
    text = (
        "base: &base {fsdp_sharding_strategy: SHARD_GRAD_OP}\n"
        "distributed_type: FSDP\nfsdp_config: *base\n"
    )
    written_out = "distributed_type: FSDP\nfsdp_config: {fsdp_sharding_strategy: SHARD_GRAD_OP}\n"
    expected = read_accelerate_config(_write(tmp_path, "b.yaml", written_out))
    assert read_accelerate_config(_write(tmp_path, "a.yaml", text)) == expected
    assert expected["reshard_after_forward"] is False  # the alias was followed


def test_yaml_bare_no_is_no_mixed_precision(tmp_path: Path) -> None:
    # YAML 1.1 reads an unquoted `no` as false; accelerate means "no mixed precision": fp32
    out = read_accelerate_config(_write(tmp_path, "a.yaml", "mixed_precision: no\n"))
    assert out["precision"] == "32-true"


def _lay_out_hub_cache(root: Path, repo_id: str, files: dict[str, dict]) -> None:
    """The huggingface_hub cache layout, by hand: models--org--name/refs/main holds the commit,
    snapshots/<commit>/<file> the files (huggingface_hub file_download.py,
    ``try_to_load_from_cache``)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, content in files.items():
        path = repo / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


def test_hub_id_read_from_the_cache_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("huggingface_hub")

    def no_network(*args: object, **kwargs: object) -> object:
        raise AssertionError("a cached config must not touch the network")

    gpt2 = load_hf_config("gpt2")
    flux = load_hf_config("flux.1-dev-transformer")
    _lay_out_hub_cache(tmp_path, "some-org/some-lm", {"config.json": gpt2})
    _lay_out_hub_cache(tmp_path, "some-org/some-pipeline", {"transformer/config.json": flux})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    assert load_hf_config("some-org/some-lm") == gpt2
    assert load_hf_config("some-org/some-pipeline") == flux  # diffusers: transformer/ subfolder
    start = time.monotonic()
    with pytest.raises(SpecError, match="HF_HUB_OFFLINE is set") as info:
        load_hf_config("some-org/not-cached")
    assert time.monotonic() - start < 2
    assert "pass the path" in _one_line(info.value)


def test_presets_ignore_case() -> None:
    from trainmem.specs.hf import load_model_spec

    typed = load_model_spec("Llama-3.1-8B")
    assert typed.num_layers == 32 and typed.hidden_size == 4096  # Llama 3.1 8B's config.json
    assert typed == load_model_spec("llama-3.1-8b")
