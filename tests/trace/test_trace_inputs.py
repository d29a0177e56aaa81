"""The trace engine on configs transformers refuses: one UnsupportedError line, not
transformers' ValueError / AttributeError; and its JSON is the same on every run (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke
from trainmem.errors import UnsupportedError

pytest.importorskip("transformers")


def _config(tmp_path: Path, **fields: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_family_without_sdpa_is_unsupported_with_a_hint(invoke: Invoke, tmp_path: Path) -> None:
    from trainmem.trace.hf_model import build_hf_model

    raw = {
        "model_type": "gpt_neo",
        "hidden_size": 64,
        "num_heads": 4,
        "num_layers": 2,
        "attention_types": [[["global", "local"], 1]],
        "vocab_size": 128,
        "max_position_embeddings": 128,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    # transformers raises ValueError: GPT-Neo has no SDPA attention implementation
    # (GPTNeoPreTrainedModel._supports_sdpa is False; GPT-J, used here before, gained SDPA in 5.24)
    with pytest.raises(UnsupportedError, match="try --attention eager"):
        build_hf_model(raw, attention="sdpa")
    build_hf_model(raw, attention="eager")  # the hint works
    result = invoke("estimate", _config(tmp_path, **raw), "--engine", "trace", exit_code=2)
    assert result.stderr.strip().splitlines()[-1].startswith("error: transformers ")


def test_architectures_naming_a_non_model_class(invoke: Invoke, tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        model_type="gpt2",
        architectures=["GPT2Config"],
        n_embd=64,
        n_head=4,
        n_layer=2,
        vocab_size=128,
        bos_token_id=0,
        eos_token_id=0,
    )  # was AttributeError: type object 'GPT2Config' has no attribute 'from_config'
    result = invoke("estimate", path, "--engine", "trace", exit_code=2)
    assert "'GPT2Config' is not a transformers model class" in result.stderr


def test_trace_json_is_byte_identical_and_has_no_wall_times(invoke: Invoke) -> None:
    args = ["estimate", "tiny-gpt2-test", "--engine", "trace", "-s", "32", "--json"]
    first, second = invoke(*args), invoke(*args)
    assert "trace_seconds" not in first.stdout and "warmup_seconds" not in first.stdout
    assert first.stdout == second.stdout


TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    ("architecture", "label_shape"),
    [("BertForSequenceClassification", (3,)), ("BertForTokenClassification", (3, 16))],
)
def test_classification_heads_get_class_labels(
    invoke: Invoke, tmp_path: Path, architecture: str, label_shape: tuple[int, ...]
) -> None:
    """BertForSequenceClassification.forward computes ``CrossEntropyLoss()(logits.view(-1,
    num_labels), labels.view(-1))`` (modeling_bert.py): one class id in range(num_labels) per
    sequence ([b]); the token-classification head one per token ([b, s]). Token ids as labels
    (the language-model batch) made transformers raise a batch-size mismatch, a traceback."""
    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    raw = {**TINY_BERT, "architectures": [architecture], "num_labels": 5}
    model = build_hf_model(raw, attention="eager")
    batch = make_hf_batch(model, 3, 16)
    assert tuple(batch["labels"].shape) == label_shape
    assert int(batch["labels"].max()) < 5
    path = _config(tmp_path, **raw)
    invoke("estimate", path, "-e", "trace", "-b", "3", "-s", "16")


def test_imagegpt_classifier_gets_one_class_per_image(invoke: Invoke, tmp_path: Path) -> None:
    """ImageGPTForImageClassification reads colour-cluster tokens (``input_ids``) and takes
    ``labels`` of shape ``(batch_size,)`` (modeling_imagegpt.py docstring; it averages the
    hidden states over the sequence before its ``score`` layer). The token-id labels of the
    language-model batch made transformers raise "Expected input batch_size (1) to match
    target batch_size (64)", refused as a failed trace (coverage run of session 23)."""
    from trainmem.trace.hf_model import build_hf_model, make_hf_batch

    raw = {
        "model_type": "imagegpt",
        "architectures": ["ImageGPTForImageClassification"],
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 64,
        "num_labels": 3,
    }
    model = build_hf_model(raw, attention="eager")
    batch = make_hf_batch(model, 2, 16)
    assert tuple(batch["input_ids"].shape) == (2, 16)
    assert tuple(batch["labels"].shape) == (2,)
    assert int(batch["labels"].max()) < 3
    path = _config(tmp_path, **raw)
    invoke("estimate", path, "-e", "trace", "-b", "2", "-s", "16", "--attention", "eager")


def test_a_changed_model_spec_is_not_traced_as_its_preset() -> None:
    """The traced paths build the model from the config a ModelSpec names; a spec changed after
    loading would be traced as the unchanged config (a silently different model)."""
    import dataclasses

    from trainmem.estimate import estimate, resolve_model
    from trainmem.specs.training import TrainingConfig

    spec = dataclasses.replace(resolve_model("tiny-gpt2-test"), num_layers=7)
    with pytest.raises(UnsupportedError, match="config.json"):
        estimate(spec, TrainingConfig(seq_len=16), engine="trace")


def _linear_sum() -> tuple[object, object]:
    import torch

    def build() -> torch.nn.Module:
        return torch.nn.Linear(16, 16)

    def batch() -> torch.Tensor:
        return torch.randn(4, 16)

    return build, batch


def test_trace_takes_a_gpu_name_as_estimate_does() -> None:
    # trainmem.trace(..., gpu="RTX-4090") raised AttributeError ('str' object has no attribute
    # 'cublas_workspace_bytes'): the name is looked up in the catalog, as estimate does
    import trainmem
    from trainmem.specs.hardware import get_gpu

    build, batch = _linear_sum()
    est = trainmem.trace(build, batch, gpu="RTX-4090", loss_fn=lambda out, _: out.sum())
    assert est.gpu_name == "RTX-4090"
    assert est.gpu_capacity_bytes == get_gpu("RTX-4090").memory_bytes


@pytest.mark.parametrize(
    ("kwargs", "field", "match"),
    [
        ({"gpu": "RTX-9999"}, "gpu", "unknown GPU"),
        ({"gpu": 80}, "gpu", "must be a GPU name .* or a GPUSpec, got 80"),
        ({"training": {"micro_batch_size": 2}}, "training", "must be a trainmem.TrainingConfig"),
    ],
)
def test_trace_refuses_a_bad_gpu_or_training_in_one_line(
    kwargs: dict[str, object], field: str, match: str
) -> None:
    import trainmem
    from trainmem.errors import SpecError

    build, batch = _linear_sum()
    with pytest.raises(SpecError, match=match) as info:
        trainmem.trace(build, batch, loss_fn=lambda out, _: out.sum(), **kwargs)
    assert info.value.field == field and "\n" not in str(info.value)
    with pytest.raises(SpecError, match=match):
        trainmem.trace.estimate_trace(
            "tiny-gpt2-test",
            kwargs.get("training"),
            **{k: v for k, v in kwargs.items() if k == "gpu"},
        )


_PERCEIVER = {
    "model_type": "perceiver",
    "d_model": 64,
    "d_latents": 64,
    "num_latents": 16,
    "num_blocks": 1,
    "num_self_attends_per_block": 2,
    "num_self_attention_heads": 4,
    "num_cross_attention_heads": 4,
    "max_position_embeddings": 128,
    "vocab_size": 262,
}


def test_perceiver_masked_lm_trains_at_its_decoder_length(invoke: Invoke, tmp_path: Path) -> None:
    """PerceiverForMaskedLM's decoder emits max_position_embeddings positions whatever the
    input length (modeling_perceiver.py ``output_index_dims=config.max_position_embeddings``):
    the real model on CPU fails on 64 byte ids with their labels and trains on 128. The
    estimate refuses 64 naming seq_len and 128, and runs at 128; before, the batch builder
    raised AttributeError ('PerceiverForMaskedLM' object has no attribute 'encoder')."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**_PERCEIVER)
    real = transformers.PerceiverForMaskedLM(config).train()
    ids = torch.randint(0, 262, (2, 64))
    with pytest.raises(ValueError, match="batch_size"):
        real(inputs=ids, labels=ids)
    ids = torch.randint(0, 262, (2, 128))
    real(inputs=ids, labels=ids).loss.backward()
    path = _config(tmp_path, **_PERCEIVER)
    err = invoke("estimate", path, "-e", "generic", "-b", "2", "-s", "64", exit_code=2).stderr
    assert err.strip().splitlines()[-1].startswith("error: seq_len: 64: PerceiverForMaskedLM")
    assert "allowed: --seq-len 128" in err
    invoke("estimate", path, "-e", "generic", "-b", "2", "-s", "128")


def test_canine_reads_unicode_code_points(invoke: Invoke, tmp_path: Path) -> None:
    """CANINE's config names no vocab_size: its tokenizer gives each character's code point
    (tokenization_canine.py), any of Unicode's 1,114,112; the model hashes them into buckets.
    Before, the batch builder refused "its config names no vocab_size"."""
    import transformers

    from trainmem.trace.hf_model import CODE_POINT_VOCABULARY, build_hf_model, make_hf_batch

    ids = transformers.CanineTokenizer()("a\U0001f600", add_special_tokens=False).input_ids
    assert ids == [ord("a"), 0x1F600] and CODE_POINT_VOCABULARY == 0x10FFFF + 1
    raw = {
        "model_type": "canine",
        "architectures": ["CanineForSequenceClassification"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_hash_buckets": 256,
        "num_labels": 3,
    }
    batch = make_hf_batch(build_hf_model(raw, attention="eager"), 2, 32)
    assert int(batch["input_ids"].max()) < CODE_POINT_VOCABULARY
    assert int(batch["input_ids"].max()) > 256  # code points, not hash buckets
    invoke("estimate", _config(tmp_path, **raw), "-e", "generic", "-b", "2", "-s", "32")
