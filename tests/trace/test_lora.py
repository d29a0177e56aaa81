"""LoRA through peft in the trace engine: target inference, trainable counts, frozen base."""

from __future__ import annotations

import pytest
import torch

from trainmem.errors import UnsupportedError
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import estimate_trace
from trainmem.trace.hf_model import build_hf_model, build_hf_training_model
from trainmem.trace.lora import layer_linear_roles, layer_stack, lora_target_modules

ALL = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def _meta(preset: str):
    return build_hf_model(load_hf_config(preset))


def test_llama_roles_are_the_proj_modules() -> None:
    model = _meta("tiny-llama-test")
    roles = layer_linear_roles(model.model.layers[0])
    assert roles == {
        "q": ("self_attn.q_proj",),
        "k": ("self_attn.k_proj",),
        "v": ("self_attn.v_proj",),
        "o": ("self_attn.o_proj",),
        "gate": ("mlp.gate_proj",),
        "up": ("mlp.up_proj",),
        "down": ("mlp.down_proj",),
    }


def test_gpt2_fused_qkv_and_conv1d_roles() -> None:
    model = _meta("tiny-gpt2-test")
    roles = layer_linear_roles(model.transformer.h[0])
    assert roles == {
        "q": ("attn.c_attn",),
        "k": ("attn.c_attn",),
        "v": ("attn.c_attn",),
        "o": ("attn.c_proj",),
        "up": ("mlp.c_fc",),
        "down": ("mlp.c_proj",),
    }
    names = lora_target_modules(model, ("q", "v", "lm_head"))
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn", "lm_head"]
    with pytest.raises(UnsupportedError, match="gate"):
        lora_target_modules(model, ("gate",))


def test_moe_layers_take_attention_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by fuzzing (session 17): Mixtral's MoE block (transformers 5: experts fused into
    # one module's parameters beside a router) has no gate/up/down linears, which refused
    # every LoRA on the generic path, the default q,v too ("cannot tell gate/up/down apart").
    # Since session 18 gate / up / down name the experts as peft 0.21.2 adapts them: its
    # transformers 4 names w1 / w3 / w2, which peft turns into the fused parameters
    # (utils/transformers_weight_conversion.py _convert_peft_config_moe)
    from conftest import MODELS_DIR

    model = build_hf_model(load_hf_config(str(MODELS_DIR / "formula" / "mixtral.json")))
    names = lora_target_modules(model, ("q", "v"))  # 2 layers
    assert names == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]
    assert lora_target_modules(model, ("q", "gate", "up"))[-2:] == ["w1", "w3"]
    import trainmem.trace.lora as lora

    monkeypatch.setattr(lora, "_expert_target", lambda model, role: None)  # no peft pattern
    with pytest.raises(UnsupportedError, match="gate'.*MoE experts are not targeted"):
        lora_target_modules(model, ("q", "gate"))


@pytest.mark.parametrize(
    ("preset", "targets"),
    [
        ("tiny-llama-test", ("q", "v")),
        ("tiny-llama-test", ALL),
        ("tiny-gpt2-test", ("q", "k", "o", "up", "down", "lm_head")),
    ],
)
def test_trainable_parameters_equal_peft_and_only_adapters_have_states(preset, targets) -> None:
    training = TrainingConfig(
        micro_batch_size=1, seq_len=32, precision="bf16-true", lora_rank=4, lora_targets=targets
    )
    model = build_hf_training_model(load_hf_config(preset), training)
    trainable, total = model.get_nb_trainable_parameters()
    est = estimate_trace(preset, training)
    assert (est.num_trainable_parameters, est.num_parameters) == (trainable, total)
    # peft upcasts 16-bit adapters to fp32 (autocast_adapter_dtype); AdamW keeps two fp32 moments
    # per adapter element, nothing for the frozen base.
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    assert est.breakdown.optimizer_states == 2 * 4 * trainable
    base = total - trainable
    buffers = est.details["peak_by_category_bytes"]["buffers"]  # counted with the parameters
    assert est.breakdown.parameters == 2 * base + 4 * trainable + buffers


def test_trace_refuses_only_what_it_cannot_model() -> None:
    from trainmem.estimate import trace_unsupported_settings

    ok = [
        TrainingConfig(lora_rank=8, lora_dropout=0.1, chunked_cross_entropy=8),
        TrainingConfig(zero_grad_set_to_none=False, optimizer="adafactor"),
        TrainingConfig(data_parallel_size=8, zero_stage=3, framework="fsdp2"),
        TrainingConfig(tensor_parallel_size=2, sequence_parallel=True, compile=True),
        TrainingConfig(tensor_parallel_size=4, data_parallel_size=2, zero_stage=3),
        TrainingConfig(precision="fp8-mixed"),
        TrainingConfig(context_parallel_size=4, tensor_parallel_size=2, zero_stage=3),
        TrainingConfig(context_parallel_size=2, zero_stage=3, framework="fsdp2"),
        # torch.distributed.pipelining (trainmem.trace.pipeline), its own refusals there
        TrainingConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2),
    ]
    assert all(trace_unsupported_settings(t) == [] for t in ok)
    dp, stage = trace_unsupported_settings(TrainingConfig(data_parallel_size=8, zero_stage=2))
    assert dp.startswith("data_parallel_size=8 (") and "FSDP2 (zero_stage 3)" in dp
    assert stage == "zero_stage=2"
    (fsdp2,) = trace_unsupported_settings(TrainingConfig(framework="fsdp2"))
    assert fsdp2.startswith("framework=fsdp2 (") and "--engine analytic" in fsdp2
    # a quantized base runs as a stand-in (trainmem.trace.quantized), under autocast or, nf4
    # with a current bitsandbytes, a 16-bit model peft upcast to fp32; where the matmul saves
    # its input (int8) beside peft's upcast it is refused, naming what works
    assert trace_unsupported_settings(TrainingConfig(lora_rank=8, quantize_base="nf4")) == []
    bf16 = {"lora_rank": 8, "precision": "bf16-true"}
    assert trace_unsupported_settings(TrainingConfig(quantize_base="nf4", **bf16)) == []
    (refused,) = trace_unsupported_settings(TrainingConfig(quantize_base="int8", **bf16))
    assert refused.startswith("quantize_base=int8 with precision=bf16-true")
    assert "bf16-mixed" in refused


def test_item_outside_the_optimizer_step_still_fails_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace.host_scalars import host_scalars

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    with FakeTensorMode(), host_scalars(opt), pytest.raises(Exception, match="local_scalar"):
        torch.ones(2).sum().item()


def test_a_vision_language_model_adapts_its_language_model() -> None:
    # Found by fuzzing (session 17): tests/models/vlm/llava.json (2 vision and 2 text layers)
    # took the first longest stack, the CLIP vision tower, and its first two attention linears
    # by order (CLIP defines k_proj, v_proj, q_proj): "q,v" adapted the vision tower's k and q.
    # LLaVA's recipe leaves the vision tower without adapters (llava/train/train.py
    # find_all_linear_names); the language model is a Llama: q_proj, v_proj, gate_proj
    from conftest import MODELS_DIR

    model = build_hf_model(load_hf_config(str(MODELS_DIR / "vlm" / "llava.json")))
    names = lora_target_modules(model, ("q", "v", "gate"))
    layer = "model.language_model.layers.{}.{}"
    paths = ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj")
    assert names == [layer.format(i, p) for i in (0, 1) for p in paths]


def test_attention_projections_are_found_by_name() -> None:
    # CLIP's attention defines k_proj, v_proj, q_proj, out_proj (transformers modeling_clip.py
    # CLIPAttention.__init__): by definition order "q" was k_proj (session 17 fuzzing)
    from conftest import MODELS_DIR

    model = build_hf_model(load_hf_config(str(MODELS_DIR / "clip_vision_model.json")))
    roles = layer_linear_roles(layer_stack(model)[1][0])
    assert {r: roles[r] for r in "qkvo"} == {
        "q": ("self_attn.q_proj",),
        "k": ("self_attn.k_proj",),
        "v": ("self_attn.v_proj",),
        "o": ("self_attn.out_proj",),
    }


def test_an_encoder_decoder_adapts_both_stacks_and_the_cross_attention() -> None:
    # Found by fuzzing (session 17): T5 adapted its encoder blocks only (the first of two
    # equally long stacks), then both stacks' self-attention but not the decoder's
    # cross-attention, which peft's name matching (a module name ending with ".q") adapts
    # too: real peft (LoraConfig(r=4, target_modules=["q", "v"]) on this config, CPU) gives
    # 12 adapted linears and 6144 trainable. By hand: 2 + 2 blocks' self-attention q and v
    # plus 2 decoder blocks' EncDecAttention q and v = 12 linears (d_model 64 -> 4 heads x
    # d_kv 16), each A [4, 64] + B [64, 4] = 512 elements at rank 4
    from conftest import MODELS_DIR

    model = build_hf_model(load_hf_config(str(MODELS_DIR / "t5.json")))
    names = lora_target_modules(model, ("q", "v"))
    block = "{}.block.{}.layer.{}.{}.{}"
    self_attn = [block.format(s, i, 0, "SelfAttention", p) for s in ("encoder", "decoder")
                 for i in (0, 1) for p in "qv"]  # fmt: skip
    cross = [block.format("decoder", i, 1, "EncDecAttention", p) for i in (0, 1) for p in "qv"]
    assert names == self_attn + cross
    peft_model = build_hf_training_model(
        load_hf_config(str(MODELS_DIR / "t5.json")), TrainingConfig(lora_rank=4)
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == 12 * (4 * 64 + 64 * 4)


def test_adalora_on_biased_linears_under_selective_checkpointing_is_refused() -> None:
    # Found by fuzzing (session 17): GPT-2 (Conv1D: addmm with its bias) and Qwen2 (q/k/v
    # biases) with adalora and -c selective failed inside the trace with torch's "Tensor
    # cached during selective activation checkpoint has been mutated"
    from trainmem.errors import SpecError
    from trainmem.trace.lora import apply_lora

    training = TrainingConfig(
        lora_rank=4, lora_variant="adalora", activation_checkpointing="selective"
    )
    with pytest.raises(
        SpecError, match=r"activation_checkpointing: selective .*\(transformer\.h\.0"
    ):
        apply_lora(_meta("tiny-gpt2-test"), training)
    apply_lora(_meta("tiny-llama-test"), training)  # no bias on q_proj / v_proj: runs


def test_stages_of_blocks_adapt_every_block() -> None:
    # Found by fuzzing (session 17): SegFormer's encoder is a list of stages, each holding its
    # blocks; the stage was taken for a layer ("cannot tell q/k/v/o apart" among two blocks'
    # linears). 4 stages of 2 blocks, hidden 16 / 32 / 64 / 128: q and v at rank 4 are
    # 2 x (4 x h + h x 4) = 16 h per block, 2 blocks: 32 x (16 + 32 + 64 + 128) = 7,680
    from conftest import MODELS_DIR

    raw = load_hf_config(str(MODELS_DIR / "heads" / "segformer.json"))
    names = lora_target_modules(build_hf_model(raw), ("q", "v"))
    block = "segformer.stages.{}.blocks.{}.attention.{}_proj"
    assert names == [block.format(s, b, p) for s in range(4) for b in (0, 1) for p in "qv"]
    peft_model = build_hf_training_model(raw, TrainingConfig(lora_rank=4))
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == 7680


def test_an_output_projection_defined_first_is_still_o() -> None:
    # Found by fuzzing (session 17): Phi-3 defines o_proj before its fused qkv_proj
    # (transformers modeling_phi3.py Phi3Attention.__init__), so "q,v" adapted o_proj
    from conftest import MODELS_DIR

    model = build_hf_model(load_hf_config(str(MODELS_DIR / "phi3.json")))
    roles = layer_linear_roles(layer_stack(model)[1][0])
    assert {r: roles[r] for r in "qkvo"} == {
        "q": ("self_attn.qkv_proj",),
        "k": ("self_attn.qkv_proj",),
        "v": ("self_attn.qkv_proj",),
        "o": ("self_attn.o_proj",),
    }


def test_layer_stack_without_a_module_list_is_the_longest_sequential_of_one_block() -> None:
    """timm's ViT keeps its blocks in an ``nn.Sequential`` and has no ``nn.ModuleList``."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

    blocks = torch.nn.Sequential(Block(), Block(), Block())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), blocks)
    name, stack = layer_stack(model)
    assert (name, stack) == ("2", blocks)
    # a ModuleList, when there is one, still wins over a longer Sequential
    with_list = torch.nn.ModuleDict({"seq": blocks, "list": torch.nn.ModuleList([Block()])})
    assert layer_stack(with_list)[0] == "list"
