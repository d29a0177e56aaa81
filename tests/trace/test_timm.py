"""timm models on the generic path (issue 26): ``timm:<name>`` and a timm ``config.json``, built
by timm itself and trained as timm's train.py trains them (Note [timm training step]).

The expected parameter counts are timm's own (the model it builds from the same name); the
expected input is the model's ``pretrained_cfg["input_size"]``, read from timm, or the
resolution given.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("timm") is None:  # not importorskip: see import_timm below
    pytest.skip("timm is the optional extra trainmem[vision]", allow_module_level=True)

from trainmem.trace.timm_model import import_timm  # noqa: E402

# timm imported as trainmem imports it: beside a torchvision whose C extension does not load
# under this torch (PyPI's CUDA build of 0.28.0 beside the CPU torch 2.13.0 wheel), after
# defining the op schemas its import needs (Note [torchvision without its C ops])
timm = import_timm()


def _timm_counts(name: str, **kwargs: object) -> tuple[int, int]:
    import torch

    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@pytest.mark.parametrize("name", ["test_vit", "test_resnet", "test_convnext"])
def test_timm_name_runs_on_the_generic_path(name: str, invoke_json) -> None:
    out = invoke_json("estimate", f"timm:{name}", "-b", "4", "--gpu", "RTX-4090")
    assert out["engine"] == "generic"
    assert (out["num_parameters"], out["num_trainable_parameters"]) == _timm_counts(name)
    assert out["verdict"] == "fits"


def test_timm_config_file_with_classes(tmp_path: Path, invoke_json) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architecture": "test_vit", "num_classes": 10})
    )
    out = invoke_json("estimate", tmp_path, "--engine", "generic", "-b", "2")
    assert out["num_parameters"] == _timm_counts("test_vit", num_classes=10)[0]


def test_resolution_sets_the_input_size() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.timm_model import build_timm_model, make_timm_batch

    with torch.device("meta"):
        model = build_timm_model({"architecture": "test_resnet"}, TrainingConfig())
    own = tuple(model.pretrained_cfg["input_size"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = make_timm_batch(model, TrainingConfig(micro_batch_size=3))
        bigger = make_timm_batch(model, TrainingConfig(micro_batch_size=3, resolution=320))
    assert tuple(default["input"].shape) == (3, *own)
    assert tuple(bigger["input"].shape) == (3, own[0], 320, 320)
    assert tuple(default["target"].shape) == (3,)


def test_analytic_engine_refuses_a_timm_model_and_says_what_works(invoke) -> None:
    result = invoke("estimate", "timm:test_vit", "--engine", "analytic", exit_code=None)
    assert result.exit_code != 0
    assert "timm model" in result.output + result.stderr
    assert "--engine generic" in result.output + result.stderr


@pytest.mark.parametrize("name", ["timm:", "timm:../etc", "timm:no_such_model_xyz"])
def test_bad_timm_names_are_one_line_errors(name: str, invoke) -> None:
    result = invoke("estimate", name, "--engine", "generic", exit_code=None)
    text = result.output + result.stderr
    assert result.exit_code != 0 and "Traceback" not in text
    assert "timm" in text


def test_trace_engine_takes_the_generic_path_for_timm(invoke_json) -> None:
    out = invoke_json("estimate", "timm:test_vit", "--engine", "trace", "-b", "2")
    assert out["num_parameters"] == _timm_counts("test_vit")[0]


def test_the_page_takes_a_timm_name_as_the_cli_does(invoke_json) -> None:
    """The page and the CLI accept the same models (issue 26): the page's request of
    ``timm:test_vit`` gives the CLI's numbers."""
    import shlex

    from trainmem.web.compute import numbers, resolve_request, run
    from trainmem.web.form import cli_command, default_values

    values = {**default_values(), "model": "timm:test_vit", "micro_batch_size": 2}
    page = numbers(run(resolve_request(values)))
    cli = invoke_json(*shlex.split(cli_command(values))[1:])
    assert page.breakdown_bytes == cli["breakdown_bytes"]


def test_full_checkpointing_is_timms_own_and_keeps_fewer_activations() -> None:
    """timm's train.py ``--grad-checkpointing`` calls ``model.set_grad_checkpointing(True)``;
    the traced step does the same, so the blocks' activations are no longer kept."""
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.engine import apply_activation_checkpointing

    model = timm.create_model("test_vit", pretrained=False)
    apply_activation_checkpointing(model, "full")
    assert model.grad_checkpointing is True

    def peak(mode: str) -> int:
        training = TrainingConfig(micro_batch_size=8, activation_checkpointing=mode)
        est = estimate("timm:test_vit", training, engine="generic", simulate_allocator=False)
        return int(est.breakdown.allocated_bytes)

    assert peak("full") < peak("none")


def test_cli_resolution_reaches_a_timm_vit_and_is_reported(invoke_json) -> None:
    # `--resolution` was refused on the CLI ("this model takes tokens") and, through the
    # library, raised AttributeError (timm has `model_entrypoint`, not `get_model_entrypoint`);
    # a ViT built at 320 px has the position table of (320 / 16)^2 + 1 tokens, as timm builds it
    out = invoke_json("estimate", "timm:test_vit", "-b", "2", "--resolution", "320")
    assert out["num_parameters"] == _timm_counts("test_vit", img_size=320)[0]
    assert out["num_parameters"] != _timm_counts("test_vit")[0]
    assert (out["config"]["resolution"], out["config"]["seq_len"]) == (320, None)


def test_cli_timm_cnn_takes_resolution_and_no_seq_len(invoke, invoke_json) -> None:
    default = invoke_json("estimate", "timm:test_resnet", "-b", "8")
    # the image timm's pretrained config names (test_resnet: 3 x 160 x 160), not a seq_len
    assert (default["config"]["resolution"], default["config"]["seq_len"]) == (160, None)
    small = invoke_json("estimate", "timm:test_resnet", "-b", "8", "--resolution", "64x96")
    assert small["config"]["resolution"] == "64x96"
    assert small["peak"]["allocated_bytes"] < default["peak"]["allocated_bytes"]
    # a sequence length was accepted and ignored
    err = invoke("estimate", "timm:test_resnet", "-s", "77", exit_code=2).stderr
    assert err.startswith("error: seq_len: 77 for timm:test_resnet, a model whose input is an")
    err = invoke("estimate", "timm:test_resnet", "--frames", "5", exit_code=2).stderr
    assert err.startswith("error: frames: ") and "use --resolution" in err


def test_batchnorm_on_pooled_features_at_micro_batch_1_names_the_field(invoke) -> None:
    """LeViT's head batch-normalises the pooled features (timm/models/levit.py ``NormLinear``):
    at one image PyTorch refuses that in training, on a real CPU forward of the model too, so
    the estimate refuses with the field and what is allowed, not a traced failure."""
    import torch

    real = timm.create_model("levit_128s", pretrained=False).train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        real(torch.zeros(1, 3, 224, 224))
    result = invoke("estimate", "timm:levit_128s", "-b", "1", exit_code=2)
    assert "error: micro_batch_size: 1: LevitDistilled batch-normalises" in result.output
    assert "allowed: --micro-batch-size 2 or more" in result.output


EVA = "eva02_tiny_patch14_224"
"""EVA-02 Ti/14: 12 EvaBlocks of width 192, fused qkv with q / v biases, SwiGLU MLP fc1 192 ->
1024 (gate and up), fc2 512 -> 192."""


def test_lora_on_evas_fused_qkv_never_runs_its_adapter_on_cpu() -> None:
    # the premise, by a real CPU step with real peft: EvaAttention with its q / v biases calls
    # F.linear(x, self.qkv.weight, bias) (timm eva.py), so the adapter put on qkv is bypassed
    # and nothing in the loss's graph is trainable
    import peft
    import torch

    model = timm.create_model(EVA, pretrained=False, num_classes=10, img_size=56)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv"]))
    loss = model(torch.randn(1, 3, 56, 56)).sum()
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()


def test_eva_lora_on_qkv_is_refused_with_the_reason_and_what_runs(invoke, invoke_json) -> None:
    # issue 26: the refusal was "the traced step failed: RuntimeError: element 0 of tensors
    # does not require grad", which says nothing of why or what to target instead
    r = invoke("estimate", f"timm:{EVA}", "-b", "2", "--lora-rank", "8", exit_code=2)
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: lora_targets: q,v adapt only EvaAttention's fused qkv")
    assert "F.linear(x, self.qkv.weight, bias)" in err and "--lora-targets o,up,down" in err
    out = invoke_json(
        "estimate", f"timm:{EVA}", "-b", "2", "--lora-rank", "8", "--lora-targets", "o,up,down"
    )
    # rank 8 per block: proj 8 x (192 + 192) + fc1 8 x (192 + 1024) + fc2 8 x (512 + 192)
    assert out["num_trainable_parameters"] == 12 * 8 * ((192 + 192) + (192 + 1024) + (512 + 192))


def test_eva_context_parallelism_is_refused_for_its_real_reason(invoke) -> None:
    # issue 26: the refusal said "Eva's stages change the token count between them"; EVA has
    # no stages: one list of blocks at one token count, called in a loop with the rotary
    # table of the whole sequence (timm eva.py Eva.forward_features: blk(x, rope=...))
    import inspect

    import torch

    with torch.device("meta"):
        model = timm.create_model(EVA, pretrained=False)
    assert isinstance(model.blocks, torch.nn.ModuleList)  # iterated, not one Sequential call
    assert "rope" in inspect.signature(type(model.blocks[0]).forward).parameters
    args = ["--context-parallel-size", "2", "--zero-stage", "3", "--data-parallel-size", "2"]
    r = invoke("estimate", f"timm:{EVA}", "-b", "2", *args, exit_code=2)
    err = " ".join(r.stderr.split())
    assert "error: context_parallel_size:" in err and "stages" not in err
    assert "Eva's forward calls its blocks in a loop with tables of the whole token" in err
    assert "(--zero-stage 3)" in err


def test_eva_quantized_base_is_refused_with_the_reason(invoke) -> None:
    # a quantized qkv weight goes into EvaAttention's F.linear(x, self.qkv.weight, bias) packed:
    # it failed as "the traced step failed: RuntimeError: b must be 2D"
    args = ["--quantize-base", "nf4", "--lora-rank", "8", "--lora-targets", "o,up,down"]
    r = invoke("estimate", f"timm:{EVA}", "-b", "2", *args, exit_code=2)
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: quantize_base: nf4 quantizes EvaAttention's fused qkv linear")
    assert "traced step failed" not in err
