"""Paths a user takes in a first hour with the CLI (helper useraudit, sessions 24 and 25): each
was a silently ignored setting, a contradictory line or an error naming the wrong field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.estimate import image_sequence
from trainmem.specs.training import TrainingConfig
from trainmem.web.compute import resolve_request
from trainmem.web.form import default_values

WHISPER = str(Path(__file__).parent / "models" / "whisper.json")
"""A tiny Whisper: max_target_positions 64, no max_position_embeddings."""


@pytest.mark.parametrize("model", ["gpt2", "timm:resnet50", "flux.1-dev-transformer"])
@pytest.mark.parametrize("limit", ["0", "-3"])
def test_fit_refuses_a_limit_below_one_on_every_path(
    invoke: Invoke, model: str, limit: str
) -> None:
    # `--limit 0` used to mean the default 10 (formulas) or 3 (generic path: `-3` gave no fix
    # at all, silently); refused before anything is traced
    r = invoke("fit", model, "--gpu", "T4", "-b", "64", "--limit", limit, exit_code=2)
    assert r.stderr.strip() == f"error: limit: must be a positive number of fixes, got {limit}"


def test_plan_names_seq_len_multiple_of_when_it_is_longer_than_the_context(
    invoke: Invoke,
) -> None:
    r = invoke("plan", "gpt2", "--gpu", "T4", "--seq-len-multiple-of", "2048", exit_code=2)
    assert r.stderr.strip() == (
        "error: seq_len_multiple_of: 2048 is longer than gpt2's context length "
        "(max_position_embeddings=1024); allowed: 1-1024"
    )


def test_plan_of_a_vision_encoder_says_there_is_no_seq_len_search(invoke: Invoke) -> None:
    # the "fixed:" line used to name "micro_batch_size=1 for the seq_len search", a search
    # that a vision encoder does not have; an explicit --seq-len-multiple-of had no effect
    r = invoke("plan", "vit-large-patch16-224", "--gpu", "T4", "--seq-len-multiple-of", "16")
    assert "for the seq_len search" not in r.stdout
    assert "no seq_len search" in r.stdout
    assert r.stderr.startswith("warning: --seq-len-multiple-of has no effect here")
    assert "warning" not in invoke("plan", "vit-large-patch16-224", "--gpu", "T4").stderr


def test_plan_gpus_warns_that_seq_len_multiple_of_has_no_effect(invoke: Invoke) -> None:
    import json

    r = invoke("plan", "gpt2", "--gpus", "--seq-len-multiple-of", "16", "--json")
    assert json.loads(r.stdout)["model"] == "gpt2"  # the warning stays off stdout
    assert r.stderr.startswith("warning: --seq-len-multiple-of has no effect here")


def test_sweep_csv_and_json_say_whether_the_allocator_was_replayed(invoke: Invoke) -> None:
    # gpt2 at micro-batch 9 on a T4: the closed form (reserved = allocated) leaves 0.28 GiB,
    # the simulated allocator runs out of memory, as `estimate` says; the sweep's table
    # caption said "closed form" but its CSV / JSON rows did not
    import csv
    import io
    import json

    args = ["sweep", "gpt2", "--gpu", "T4", "--over", "micro-batch-size=9"]
    closed = json.loads(invoke(*args, "--format", "json").stdout)["rows"][0]
    assert closed["allocator_simulated"] is False
    assert closed["reserved_bytes"] == closed["allocated_bytes"]
    replayed = json.loads(invoke(*args, "--simulate-allocator", "--format", "json").stdout)
    replayed = replayed["rows"][0]
    assert replayed["allocator_simulated"] is True
    assert replayed["verdict"] == "does not fit" and replayed["reserved_bytes"] is None
    est = json.loads(invoke("estimate", "gpt2", "--gpu", "T4", "-b", "9", "--json").stdout)
    assert est["verdict"] == replayed["verdict"]
    row = next(csv.DictReader(io.StringIO(invoke(*args, "--format", "csv").stdout)))
    assert row["allocator_simulated"] == "false"


def test_plan_and_fit_give_an_oom_step_no_device_total(invoke: Invoke) -> None:
    # gpt2 at 9 x 1024 on a T4: 13.99 GiB allocated + 0.49 GiB context < 14.75 GiB usable,
    # but the simulated allocator runs out of memory (fragmentation). `estimate` prints OOM and
    # gives no device total; plan's "next" and fit's "peak" gave allocated + context (14.47 GiB)
    # and plan / fit said "needs 14.47 GiB ... (usable 14.75 GiB)" / "does not fit"
    import json

    est = json.loads(invoke("estimate", "gpt2", "--gpu", "T4", "-b", "9", "--json").stdout)
    assert est["peak"]["oom"] and est["peak"]["device_total_bytes"] is None
    plan = json.loads(invoke("plan", "gpt2", "--gpu", "T4", "-s", "1024", "--json").stdout)
    mb = plan["results"][0]
    assert (mb["value"], mb["next"]["micro_batch_size"]) == (8, 9)
    assert {k: v for k, v in mb["next"].items() if k != "micro_batch_size"} == est["peak"]
    assert "micro_batch_size=9 runs out of memory in the backward" in mb["reason"]
    assert "fragmentation" in mb["reason"] and "needs" not in mb["reason"]
    fit = json.loads(invoke("fit", "gpt2", "--gpu", "T4", "-b", "9", "--json").stdout)
    assert fit["peak"] == est["peak"]
    head = invoke("fit", "gpt2", "--gpu", "T4", "-b", "9").stdout.splitlines()[0]
    assert head.startswith("gpt2 runs out of memory in the backward on T4") and "needs" not in head


def test_formulas_refuses_a_generic_model_naming_what_runs_it(invoke: Invoke) -> None:
    # `formulas timm:...` said "use --engine generic", an option `formulas` does not take
    err = invoke("formulas", "timm:test_resnet", exit_code=2).stderr.strip()
    assert err.startswith("error: 'test_resnet' is a timm model, not a formula family")
    assert "`trainmem formulas`" in err and "`trainmem estimate` runs the generic path" in err
    assert "--engine" not in err


def test_seq_len_on_a_diffusers_model_warns_that_it_has_no_effect(invoke: Invoke) -> None:
    # -s 500 was accepted and dropped: the same bytes as without it, nothing said
    import json

    pytest.importorskip("diffusers")
    from conftest import REPO_DIR

    config = str(REPO_DIR / "tests" / "models" / "diffusers" / "tiny-pixart.json")
    plain = json.loads(invoke("estimate", config, "--gpu", "T4", "--json").stdout)
    given = json.loads(invoke("estimate", config, "--gpu", "T4", "-s", "500", "--json").stdout)
    assert given["peak"] == plain["peak"]  # the batch is the image and the prompt
    assert not any(n.startswith("warning: seq_len") for n in plain["notes"])
    assert "warning: seq_len=500 has no effect on a diffusers model" in given["notes"][0]


def test_a_training_arguments_file_given_as_model_points_to_training_args(
    invoke: Invoke,
) -> None:
    from conftest import REPO_DIR

    sft = str(REPO_DIR / "examples" / "sft-config.json")
    err = invoke("estimate", sft, exit_code=2).stderr.strip()
    assert err.startswith("error: model_type: required field missing from the config")
    assert err.endswith(
        "this file has output_dir, per_device_train_batch_size: a TrainingArguments / "
        "SFTConfig file, which --training-args FILE reads beside MODEL"
    )


def test_whisper_refuses_a_decoder_longer_than_max_target_positions(invoke: Invoke) -> None:
    # transformers 5.24 modeling_whisper.py WhisperForConditionalGeneration.forward raises
    # ValueError for labels longer than max_target_positions (64 here); trainmem traced
    # min(s, 64) tokens and reported seq_len=1024, on the CLI and the page alike
    r = invoke("estimate", WHISPER, "--seq-len", "1024", "--gpu", "T4", exit_code=2)
    assert r.stderr.startswith("error: seq_len: 1024 for ")
    assert "at most 64 tokens (max_target_positions" in r.stderr
    assert "give --seq-len 64 or less" in r.stderr
    with pytest.raises(SpecError, match="seq_len: 65 .* at most 64 tokens"):
        resolve_request({**default_values(), "gpu": "T4", "seq_len": 65}, WHISPER)


def test_whisper_default_seq_len_is_the_decoder_length_traced() -> None:
    # no length given (the CLI's and the page's default is the config's context, 1024 for a
    # config without max_position_embeddings; a library TrainingConfig's own is 1024): the
    # decoder's 64 tokens, what the trace runs and the report then says
    assert image_sequence(WHISPER, TrainingConfig(), given=False).seq_len == 64
    assert resolve_request({**default_values(), "gpu": "T4"}, WHISPER).training.seq_len == 64
    # a length within the decoder's is the user's
    given = TrainingConfig(seq_len=48)
    assert image_sequence(WHISPER, given, given=True).seq_len == 48


@pytest.mark.parametrize("gpu", ["A100-80GB", "4GB"])  # a run that fits, one where nothing fits
def test_plan_and_fit_say_what_estimate_assumed(invoke: Invoke, gpu: str) -> None:
    # estimate's JSON carries details.assumed (framework, loop, versions) and its table an
    # "assumed:" line; plan's and fit's had neither, so their answers did not say which
    # framework's step (here torchtune's bf16-true default) or which releases they were for
    import json

    run = ["llama-3.2-1b", "--gpu", gpu, "--framework", "torchtune", "-s", "2048"]
    d = json.loads(invoke("estimate", *run, "--json").stdout)
    assumed = d["details"]["assumed"]
    assert assumed["framework"] == "torchtune" and "torch" in assumed  # the reference
    line = next(x for x in invoke("estimate", *run).stdout.splitlines() if x.startswith("assumed"))
    plan = json.loads(invoke("plan", *run, "--json").stdout)
    assert [r["assumed"] for r in plan["results"]] == [assumed, assumed]
    fit = json.loads(invoke("fit", *run, "--json").stdout)
    assert fit["assumed"] == assumed
    for command in ("plan", "fit"):
        text = invoke(command, *run).stdout.splitlines()
        assert line in text, command


def test_an_oom_rank_has_no_reserved_figure_in_the_json(invoke: Invoke) -> None:
    # the run's peak said reserved_bytes null (out of memory), its per_rank row gave the
    # reserved bytes at the failure (82,411,782,144 for llama-3.1-8b on an A100-80GB), a
    # figure under the capacity beside "oom": true; the table's cell says OOM
    import json

    d = json.loads(invoke("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", "--json").stdout)
    assert d["peak"]["reserved_bytes"] is None
    (rank,) = d["per_rank"]
    assert rank["oom"] is True and rank["reserved_bytes"] is None
    fits = json.loads(invoke("estimate", "gpt2", "--gpu", "T4", "--json").stdout)
    assert fits["per_rank"][0]["reserved_bytes"] == fits["peak"]["reserved_bytes"]


@pytest.mark.parametrize("model", ["gpt2", "vit-large-patch16-224"])
def test_target_seq_len_on_a_model_without_t5s_decoder_warns(invoke: Invoke, model: str) -> None:
    # TrainingConfig.target_seq_len is read only as a text encoder-decoder's decoder length
    # (analytic decoder_seq_len, the generic path's labels: T5, BART...); on GPT-2 or ViT it
    # was accepted and dropped without a word
    import json

    d = json.loads(invoke("estimate", model, "--target-seq-len", "64", "--json").stdout)
    warned = [n for n in d["notes"] if n.startswith("warning: target_seq_len=64 has no effect")]
    assert len(warned) == 1
    plain = json.loads(invoke("estimate", model, "--json").stdout)
    assert d["peak"] == plain["peak"]  # what the warning says: nothing changed
    t5 = json.loads(invoke("estimate", "t5-base", "--target-seq-len", "64", "--json").stdout)
    assert not any("target_seq_len" in n for n in t5["notes"])


def test_a_config_files_text_length_on_a_vision_encoder_warns_instead_of_refusing(
    invoke: Invoke,
) -> None:
    # examples/sft-config.json's max_length 2048 on ViT-L/16 was refused with "leave --seq-len
    # out", a flag the user had not given; the file's length is dropped with a warning and
    # the image's 197 tokens (14 x 14 patches + [CLS]) used, as without the file
    import json

    path = str(Path(__file__).parents[1] / "examples" / "sft-config.json")
    run = ["vit-large-patch16-224", "--gpu", "T4", "--training-args", path, "--json"]
    d = json.loads(invoke("estimate", *run).stdout)
    assert d["config"]["seq_len"] == 197 and d["config"]["micro_batch_size"] == 4  # the file's
    assert any(n.startswith("warning: seq_len=2048 from the config file") for n in d["notes"])
    r = invoke("estimate", *run, "--seq-len", "300", exit_code=2)  # a flag is still refused
    assert "leave --seq-len out" in r.stderr


def test_compare_prints_the_warnings_estimate_prints(invoke: Invoke) -> None:
    # `estimate gpt2 --zero-stage 3` warns that one rank shards nothing; the same set in
    # `compare` showed its number with no word (only --json's rows carried the note)
    warning = "warning: zero_stage=3 with data_parallel_size=1 shards nothing"
    assert warning in invoke("estimate", "gpt2", "--gpu", "T4", "--zero-stage", "3").stdout
    r = invoke(
        "compare", "gpt2", "--gpu", "T4", "--set", "activation-checkpointing=full",
        "--set", "zero-stage=3",
    )  # fmt: skip
    lines = [x for x in r.stdout.splitlines() if "warning:" in x]
    assert len(lines) == 1 and lines[0].startswith(f"#2: {warning}")


def test_chunked_cross_entropy_on_a_vision_encoder_is_refused(invoke: Invoke) -> None:
    # ViT-L/16's loss is one cross-entropy on [b, classes]: --chunked-cross-entropy 4 gave
    # the same 6,103,572,000 bytes as 0, silently (timm's ViT already refused it)
    from trainmem.estimate import estimate

    r = invoke("estimate", "vit-large-patch16-224", "--chunked-cross-entropy", "4", exit_code=2)
    assert r.stderr.startswith("error: chunked_cross_entropy: 4: a chunked cross-entropy")
    assert r.stderr.rstrip().endswith("leave it 0")
    with pytest.raises(SpecError, match="chunked_cross_entropy: 4: .* dinov2-large is a vision"):
        estimate("dinov2-large", TrainingConfig(chunked_cross_entropy=4))


def test_fit_names_a_default_it_changes_not_none(invoke: Invoke) -> None:
    # llama-3.1-8b on an A100-80GB: the Adafactor fixes switch to torch's for-loop step; the
    # settings column read "optimizer_implementation: None -> for-loop", None being the
    # framework's default, which the estimate resolves (foreach, its JSON config)
    r = invoke("fit", "llama-3.1-8b", "--gpu", "A100-80GB")
    text = " ".join(r.stdout.replace("│", " ").split())
    assert "None ->" not in text
    assert "optimizer_implementation: foreach (default) -> for-loop" in text


@pytest.mark.parametrize(
    "model",
    ["timm:test_resnet", str(Path(__file__).parent / "trace/diffusers_configs/tiny-sd3.json")],
)
def test_a_generic_only_model_is_refused_with_the_real_reason_first(
    invoke: Invoke, model: str
) -> None:
    # issue 26: under the default engine (auto) a timm / diffusers model's refusal began with
    # the formulas' "'X' is a ... model, not a formula family of the analytic engine" before
    # the generic path's reason, the only one that says what to change
    pytest.importorskip("torch")
    err = invoke("estimate", model, "--framework", "torchtune", exit_code=2).stderr.strip()
    last = err.splitlines()[-1]  # after the progress line
    assert last.startswith("error: framework=torchtune: torchtune's recipes train its own")
    assert "not a formula family" not in err and "analytic" not in err


def test_litgpt_refusal_names_commands_that_install_it_beside_transformers_5(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 26: the hint said `pip install 'trainmem[litgpt]'` with litgpt in the extra, which
    # cannot resolve beside transformers 5.24 (litgpt 0.5.13 pins huggingface-hub<1.4; 5.24
    # needs >=1.31). Checked in a fresh venv built as README's test command builds .venv (torch
    # 2.13.0+cpu, transformers 5.24.0): the extra (lightning) and litgpt without its pins
    # install what litgpt's config / model / lora modules import, and the trace runs. The test
    # install has litgpt: hide it, as a machine without it would
    pytest.importorskip("torch")
    for name in ("litgpt", "litgpt.config", "litgpt.model", "litgpt.lora"):
        monkeypatch.setitem(sys.modules, name, None)  # import litgpt raises ImportError
    args = ("estimate", "tiny-llama-test", "--framework", "litgpt", "--engine", "generic")
    err = " ".join(invoke(*args, "-s", "64", exit_code=2).stderr.split())
    assert "pip install 'trainmem[litgpt]' && pip install --no-deps litgpt==0.5.13" in err
    assert "huggingface-hub<1.4" in err and "Traceback" not in err
