"""Quantized bases (``--quantize-base``) on the traced paths: a stand-in per quantized linear
(trainmem.trace.quantized, Note [Traced quantized base]) with peft's LoRA running for real.

Expected numbers: by hand from bitsandbytes' formats (4-bit codes, one fp32 absmax per 64 values)
and its autograd rules for the stand-in itself; the analytic engine (its cited formulas and
schedule, an independent derivation) for the agreement within 1% on a formula family.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import MODELS_DIR, REPO_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
FLUX = str(Path(__file__).parent / "diffusers_configs" / "tiny-flux.json")


def _stand_in(quantize: str, version: str | None = None) -> tuple[torch.nn.Module, int]:
    """A frozen Linear(64 -> 32) behind a trainable Linear(16 -> 64), quantized: (model, the
    number of linears replaced)."""
    from trainmem.trace.quantized import quantize_base

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 32, bias=False))
    model[1].weight.requires_grad_(False)
    training = TrainingConfig(
        lora_rank=1, quantize_base=quantize, bitsandbytes_version=version, precision="32-true"
    )
    return model, quantize_base(model, training, diffusers=True)


def _saved_bytes(model: torch.nn.Module) -> list[int]:
    """Bytes of each tensor autograd saves in the quantized linear's forward."""
    saved: list[int] = []
    x = model[0](torch.ones(3, 16))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model[1](x)
    out.sum().backward()
    return saved


def test_the_stand_in_stores_the_packed_weight_and_saves_what_bitsandbytes_saves() -> None:
    model, n = _stand_in("nf4")
    assert n == 1  # the trainable Linear(16 -> 64) is left alone
    # 64 x 32 = 2048 values: 1024 bytes of 4-bit codes, 2048 / 64 = 32 fp32 absmax
    assert model[1].weight.dtype == torch.uint8 and model[1].weight.numel() == 1024 + 4 * 32
    assert not model[1].weight.requires_grad
    # bitsandbytes >= 0.43.2 MatMul4Bit keeps (None, B): nothing of the input
    assert _saved_bytes(model) == []
    assert model[0].weight.grad is not None and model[0].weight.grad.shape == (64, 16)
    # before 0.43.2 (and int8 always) the matmul keeps its input: 3 x 64 fp32 values
    assert _saved_bytes(_stand_in("nf4", "0.42.0")[0]) == [3 * 64 * 4]
    int8, _ = _stand_in("int8")
    assert int8[1].weight.numel() == 2048 + 4 * 32  # a byte per value, an fp32 scale per row
    assert _saved_bytes(int8) == [3 * 64 * 4]


def test_a_gptq_stand_in_saves_its_packed_weight_not_its_input() -> None:
    """GPTQ's triton v2 ``QuantLinearFunction.forward`` saves qweight / scales / qzeros /
    g_idx with ``save_for_backward`` (fms-acceleration gptqmodel triton_utils/dequant.py), no
    input: the stand-in saves its packed weight, the parameter itself, so checkpointing's hooks
    see one saved tensor of the packed bytes and no new storage."""
    model, _ = _stand_in("gptq-int4")
    packed = model[1].weight
    # 64 x 32 = 2048 values: 1024 B of codes, one group of 64 input rows: 2 x 32 fp16 scales,
    # 16 B of 4-bit zeros, 4 B of g_idx per input row (specs/quantization.py)
    assert packed.numel() == 1024 + 2 * 32 + 16 + 4 * 64
    assert _saved_bytes(model) == [packed.untyped_storage().nbytes()]


def _backward_order(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the quantized linear's backward does first: unpack a saved tensor (under
    non-reentrant checkpointing, run the recompute) or dequantize its weight."""
    import trainmem.trace.quantized as quantized

    order: list[str] = []
    dequantized = quantized._dequantized

    def logged(*args: object) -> torch.Tensor:
        order.append("dequantize")
        return dequantized(*args)  # type: ignore[arg-type]

    def unpack(t: torch.Tensor) -> torch.Tensor:
        order.append("unpack")
        return t

    x = model[0](torch.ones(3, 16))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        out = model[1](x)
    monkeypatch.setattr(quantized, "_dequantized", logged)
    out.sum().backward()
    return order


def test_a_gptq_backward_unpacks_its_saved_tensors_before_its_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPTQ's ``QuantLinearFunction.backward`` starts with ``qweight, scales, qzeros, g_idx =
    ctx.saved_tensors`` (AutoGPTQ nn_modules/triton_utils/kernels.py), so non-reentrant
    checkpointing recomputes the layer before its input gradient exists; bitsandbytes'
    ``MatMul4Bit.backward`` reads ``ctx.tensors`` and unpacks nothing."""
    assert _backward_order(_stand_in("gptq-int4")[0], monkeypatch) == ["unpack", "dequantize"]
    assert _backward_order(_stand_in("nf4")[0], monkeypatch) == ["dequantize"]


@pytest.mark.parametrize(
    ("quantize", "version"), [("nf4", None), ("int8", None), ("nf4-dq", "0.42.0")]
)
def test_qlora_on_the_generic_path_matches_the_analytic_engine(
    quantize: str, version: str | None
) -> None:
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=128,
        lora_rank=16,
        quantize_base=quantize,
        bitsandbytes_version=version,
    )
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    # the packed weights: the same bytes as the analytic layout (the traced rotary tables, 64
    # bytes of buffers, are the only difference)
    assert generic.breakdown.parameters - analytic.breakdown.parameters == 64
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_flux_with_an_nf4_base_on_the_traced_paths() -> None:
    """A diffusers model (no ModelSpec): every linear's weight packed, LoRA's adapters and the
    rest kept in the model's dtype (fp32 under bf16-mixed)."""
    diffusers = pytest.importorskip("diffusers")
    raw = json.loads(Path(FLUX).read_text())
    with torch.device("meta"):
        model = getattr(diffusers, raw["_class_name"]).from_config(raw)
    linear = [m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rest = sum(p.numel() for p in model.parameters()) - sum(linear)
    packed = sum(n // 2 + 4 * -(-n // 64) for n in linear)  # 4-bit codes + fp32 absmax / 64
    # rank 4 on q and v: A (4 x in) and B (out x 4) on each attention's to_q / to_v (and the
    # joint blocks' add_q_proj / add_v_proj), fp32
    adapters = sum(
        4 * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if name.rpartition(".")[2] in ("to_q", "to_v", "add_q_proj", "add_v_proj")
    )
    training = TrainingConfig(
        micro_batch_size=1, resolution=64, text_seq_len=16, lora_rank=4, lora_targets=("q", "v"),
        quantize_base="nf4",
    )  # fmt: skip
    nf4 = estimate(FLUX, training, engine="trace", simulate_allocator=False)
    assert nf4.breakdown.parameters == 4 * rest + packed + 4 * adapters
    assert nf4.num_trainable_parameters == adapters


@pytest.mark.parametrize("quantize", ["nf4", "fp4-dq", "int8"])
def test_float8_over_a_bitsandbytes_base_is_no_run_of_either_engine(quantize: str) -> None:
    # torchao swaps every nn.Linear subclass and bitsandbytes' Linear4bit / Linear8bitLt are
    # ones (Note [float8 training over a bitsandbytes base]): refused for both engines, with
    # what runs instead
    from trainmem.errors import SpecError

    with pytest.raises(SpecError, match=f"{quantize} with --precision fp8-mixed.*allowed: gptq"):
        TrainingConfig(lora_rank=8, quantize_base=quantize, precision="fp8-mixed")


def test_float8_over_a_gptq_base_converts_the_adapters_only() -> None:
    # GPTQ's QuantLinear is an nn.Module, which torchao's swap_linear_layers skips
    # (isinstance(module, nn.Linear)); peft's adapters beside it (16 x 64 and 64 x 16 on the
    # 2-layer Qwen2's q and v, every dimension a multiple of 16) become Float8Linear, the
    # output layer stays in high precision (torchtitan's filter)
    from torchao.float8.float8_linear import Float8Linear

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.float8 import apply_float8
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, lora_rank=16, quantize_base="gptq-int4",
        precision="fp8-mixed",
    )  # fmt: skip
    model = build_hf_training_model(load_hf_config(QWEN2), training, device="meta")
    apply_float8(model, training, fsdp=False)
    converted = sorted(n.split(".")[-2] for n, m in model.named_modules()
                       if isinstance(m, Float8Linear))  # fmt: skip
    assert converted == ["lora_A"] * 4 + ["lora_B"] * 4
    stand_ins = [m for m in model.modules() if hasattr(m, "dequantized_shape")]
    assert len(stand_ins) == 2 * 7 and not any(isinstance(m, Float8Linear) for m in stand_ins)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_a_base_peft_does_not_upcast_stays_16_bit() -> None:
    # GPTQ (peft's prepare_model_for_kbit_training skips the fp32 cast) under bf16-mixed: the
    # embedding, norms and head stay bf16 (TrainingConfig.kbit_16bit_dense), the adapters fp32:
    # the same bytes as the analytic layout (+ the 64 bytes of fp32 rotary buffers)
    training = TrainingConfig(micro_batch_size=2, seq_len=64, lora_rank=16,
                              quantize_base="gptq-int4")  # fmt: skip
    assert training.kbit_16bit_dense
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    assert generic.breakdown.parameters - analytic.breakdown.parameters == 64
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_axolotl_reentrant_qlora_on_a_16_bit_stream_matches_the_analytic_engine() -> None:
    # axolotl's default: reentrant checkpointing, nf4-dq, the norms / embeddings / head cast
    # back to bf16 (a 16-bit residual stream); the recompute runs on the checkpoint's saved
    # input itself (Note [The recompute's tensors held at the down projection]): the formulas
    # held it once more at layer 1's down projection, -1.15 % before (session 28, reent16)
    agreement = str(MODELS_DIR / "agreement" / "llama_h2048.json")
    training = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16,
                              quantize_base="nf4-dq", framework="axolotl",
                              activation_checkpointing="full", precision="bf16-true")  # fmt: skip
    assert training.layer_checkpoint_reentrant and not training.kbit_fp32_activations
    generic = estimate(agreement, training, engine="generic", simulate_allocator=False)
    analytic = estimate(agreement, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_the_stand_in_output_takes_an_in_place_add_under_grad() -> None:
    # Found by fuzzing (session 17): peft's AdaLoRA SVDLinear adds its update in place
    # (`result += ...`, peft tuners/adalora/layer.py) to the base's output; with a bias on a
    # 3-d input, F.linear returns a view of its addmm, which autograd refuses to modify in
    # place inside a custom Function ("A view was created in no_grad mode"): GPT-2 (Conv1D
    # with bias) + adalora + nf4 failed. The output is one fresh (3, 5, 32) tensor.
    from trainmem.trace.quantized import quantize_base

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 32, bias=True))
    model[1].requires_grad_(False)
    training = TrainingConfig(lora_rank=1, quantize_base="nf4", precision="32-true")
    assert quantize_base(model, training, diffusers=True) == 1
    out = model[1](model[0](torch.ones(3, 5, 16)))
    assert out._base is None and out.shape == (3, 5, 32)
    out += torch.ones(32, requires_grad=True)  # raised RuntimeError before
    out.sum().backward()
    assert model[0].weight.grad is not None


_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
}  # fmt: skip


@pytest.mark.parametrize("quantize", ["nf4", "fp4"])
def test_peft_upcast_in_bf16_true_saves_what_real_bitsandbytes_saves(quantize: str) -> None:
    # Expected bytes from a real CPU run (session 22, helper qbf16; bitsandbytes 0.50.2, peft
    # 0.21.2, transformers 5.24, torch 2.13 in a throwaway venv): this Llama built in bf16, its
    # linears but lm_head replaced by bitsandbytes Linear4bit (compute_dtype bf16), then
    # prepare_model_for_kbit_training(use_gradient_checkpointing=False) and LoRA r16 on
    # q_proj / v_proj, one forward of 2 x 32 tokens with loss: every Linear4bit took and
    # returned fp32, and saved_tensors_hooks saw 1,250,308 B of fp32 storages and 512 B of
    # int64, nothing in bf16. The stand-in, run on the same real CPU tensors, must match.
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(micro_batch_size=2, seq_len=32, lora_rank=16,
                              quantize_base=quantize, precision="bf16-true")  # fmt: skip
    assert training.kbit_fp32_upcast  # the default framework calls peft's preparation
    model = build_hf_training_model(_TINY_LLAMA, training, device="cpu")
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32, torch.uint8}  # packed weights, everything else fp32
    seen: dict[int, tuple[torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (t.dtype, storage.nbytes()))
        return t

    ids = torch.randint(0, 512, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    by_dtype: dict[torch.dtype, int] = {}
    for dtype, nbytes in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    assert by_dtype == {torch.float32: 1_250_308, torch.int64: 512}


def test_qlora_in_bf16_true_runs_on_a_model_only_the_generic_path_runs() -> None:
    # Whisper (no ModelSpec): peft's upcast makes every parameter but the packed weights fp32,
    # the same bytes as under bf16-mixed (loaded in fp32 for autocast); without peft's
    # preparation (--set prepare-kbit-training=false) the rest stays bf16: fewer bytes
    whisper = str(MODELS_DIR / "whisper.json")
    settings = {"micro_batch_size": 1, "seq_len": 16, "lora_rank": 4, "quantize_base": "nf4"}
    bf16 = TrainingConfig(**settings, precision="bf16-true")
    mixed = TrainingConfig(**settings, precision="bf16-mixed")
    kept = TrainingConfig(**settings, precision="bf16-true", prepare_kbit_training=False)
    runs = [estimate(whisper, t, engine="generic", simulate_allocator=False)
            for t in (bf16, mixed, kept)]  # fmt: skip
    assert runs[0].breakdown.parameters == runs[1].breakdown.parameters
    assert runs[2].breakdown.parameters < runs[0].breakdown.parameters
    assert runs[0].num_trainable_parameters == runs[1].num_trainable_parameters > 0


def test_trl_sfttrainer_casts_the_embeddings_and_head_back_to_bf16() -> None:
    # trl v0.13.0 SFTTrainer on an unsharded 4-bit base under bf16: peft's fp32 upcast, then
    # peft_module_casting_to_bf16 (trl/trainer/utils.py): "*norm*" fp32, lm_head / embed_tokens
    # bf16, the adapters fp32 (peft's default, a uint8 base weight). Seen on a real CPU run of
    # trl 0.13.0's SFTTrainer (transformers 4.48.1, peft 0.13.2; session 23, helper rows24).
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(framework="hf-trainer", micro_batch_size=2, seq_len=32,
                              lora_rank=16, quantize_base="nf4", precision="bf16-mixed",
                              trl_version="0.13.0")  # fmt: skip
    assert training.trl_bf16_embeddings
    model = build_hf_training_model(_TINY_LLAMA, training)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "embed_tokens" in n or "lm_head" in n} == {
        torch.bfloat16
    }
    assert {d for n, d in dtypes.items() if "norm" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}


def test_trl_sfttrainer_from_026_casts_the_adapters_to_bf16() -> None:
    # trl v0.26.0 trl/trainer/sft_trainer.py:703-718 (1.16.0 alike): get_peft_model without
    # peft's k-bit preparation, then every trainable parameter of an is_loaded_in_4bit model
    # to bf16: embeddings, norms and head stay as loaded (bf16), the adapters bf16. Seen on a
    # real CPU run of trl 1.16.0's SFTTrainer (transformers 5.24.0, peft 0.21.2; session 24,
    # helper trl26, benchmarks/trl_kbit_casting.py).
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(framework="trl", micro_batch_size=2, seq_len=32, lora_rank=16,
                              quantize_base="nf4", precision="bf16-mixed",
                              trl_version="1.16.0")  # fmt: skip
    assert training.trl_bf16_adapters and not training.kbit_fp32_upcast
    model = build_hf_training_model(_TINY_LLAMA, training)
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}


def test_an_fp16_rest_under_bf16_autocast_saves_what_real_bitsandbytes_saves() -> None:
    # Expected bytes from a real CPU run (session 29, helper quant29,
    # benchmarks/kbit_fp16_rest_cpu.py; bitsandbytes 0.50.2, peft 0.21.2, transformers 5.24,
    # torch 2.13): this Llama built in fp16, its linears but lm_head real bitsandbytes
    # Linear4bit (nf4, compute dtype bf16), peft's bnb LoRA r16 on q_proj / v_proj, no k-bit
    # preparation, one forward of 2 x 32 tokens with loss under bf16 autocast with CUDA's cast
    # lists, the attention run as transformers' flash path runs it (16-bit q / k / v as they
    # come, then a kernel on no autocast list): each Linear4bit took and returned fp16, every
    # layer's input and the head's was fp16, and saved_tensors_hooks saw these bytes per
    # dtype. The stand-in (the benchmark's stand_in_model: build_hf_training_model with
    # --load-dtype float16), run on the same real CPU tensors the same way, must match (before,
    # the trace loaded the rest in bf16, and the traced paths refused it).
    sys.path.insert(0, str(REPO_DIR / "benchmarks"))
    from kbit_fp16_rest_cpu import saved_by_dtype, stand_in_model

    by_dtype, streams = saved_by_dtype(torch, stand_in_model(torch))
    assert streams == ["torch.float16"] * 3
    assert by_dtype == {
        "torch.bfloat16": 225_280,
        "torch.float16": 300_032,
        "torch.float32": 265_220,
        "torch.int64": 512,
    }
