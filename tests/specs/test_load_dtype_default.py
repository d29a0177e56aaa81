"""The dtype a framework loads the model in when ``--load-dtype`` is not given (issue 24;
trainmem/specs/load_dtype.py).

Expected values from the sources, read at their releases:

* transformers ``from_pretrained`` without a dtype: 4.57.6 modeling_utils.py ``_get_dtype``
  (``dtype`` None -> ``torch.get_default_dtype()``, float32); 5.0.0 ``from_pretrained`` (``if
  dtype is None: dtype = "auto"``) and ``_get_dtype`` (``"auto"`` -> ``config.dtype``). The
  installed release is also run for real on CPU below (a tiny Llama saved in bf16 / fp16).
* TRL ``create_model_from_path`` (trl/trainer/utils.py): v0.25.1 ``kwargs.get("dtype")`` and
  v0.26.0-v0.26.2 ``kwargs.get("dtype", "auto")`` only read the dtype (none given: none reaches
  ``from_pretrained``, transformers' default; a real run of 0.26.2 on transformers 4.57.6
  loads float32, benchmarks/load_dtype_by_release.py), v0.27.0 .. v1.9.0
  ``kwargs.get("dtype", "float32")`` then ``kwargs["dtype"] = torch.float32``.
* LLaMA-Factory v0.9.5: model/loader.py:155 ``init_kwargs["torch_dtype"] = "auto"``, then
  model/adapter.py:313-325 upcasts every trainable parameter to float32 (not ``pure_bf16``):
  LoRA keeps the frozen base in the checkpoint's dtype, full fine-tuning trains fp32 weights.
* axolotl v0.18.0: utils/config/__init__.py ``resolve_dtype`` (``torch_dtype`` bfloat16 under
  ``bf16``, float16 under ``fp16``, else float32, whatever the checkpoint), loaders/model.py
  ``_configure_embedding_dtypes`` (norms and embeddings to float32, then back to
  ``torch_dtype`` when an adapter sets ``needs_fa2_dtype``): LoRA over a base in the compute
  dtype; a full fine-tune mixes the two (modelled as float32).
* Qwen-1's remote code (Qwen/Qwen-7B modeling_qwen.py ``QWenLMHeadModel.__init__``, the Hub
  repo's copy zhangningboo/Qwen-7B @ffe04dd5): with no ``bf16`` / ``fp16`` / ``fp32`` in the
  config, ``config.bf16 = True`` where ``torch.cuda.is_bf16_supported()`` (capability >= 8.0;
  any CUDA device from torch 2.3, pytorch PR #115924), else ``fp16`` from capability 7.0, else
  ``fp32``; then ``self.transformer.bfloat16()`` / ``.half()``.

Bytes by hand, Llama-3.2-1B (h 2048, i 8192, 16 layers, 32 heads of 64, 8 KV heads, vocabulary
128,256, tied head): embedding 128,256 x 2,048 = 262,668,288; a layer q 4,194,304 + k 1,048,576 +
v 1,048,576 + o 4,194,304 + gate / up / down 3 x 16,777,216 + two norms 4,096 = 60,821,504,
16 times 973,144,064; final norm 2,048: N = 1,235,814,400. Loaded in bf16: weights 2 N =
2,471,628,800 B, AdamW's two states in the weights' dtype 4 N = 4,943,257,600 B; loaded in
fp32: 4 N = 4,943,257,600 B and 8 N = 9,886,515,200 B.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from trainmem import estimate
from trainmem.errors import SpecError
from trainmem.specs.frameworks import installed_transformers_version
from trainmem.specs.hardware import GPUSpec, get_gpu
from trainmem.specs.hf import checkpoint_dtype, load_model_spec
from trainmem.specs.load_dtype import framework_load_dtype, resolve_load_dtype
from trainmem.specs.training import TrainingConfig

N = 1_235_814_400


def _t(**fields: object) -> TrainingConfig:
    settings: dict[str, object] = {"framework": "hf-trainer", "precision": "bf16-mixed", **fields}
    return TrainingConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "checkpoint", "loads"),
    [
        ({"transformers_version": "4.57.6"}, "bfloat16", "float32"),
        ({"transformers_version": "5.0.0"}, "bfloat16", "bfloat16"),
        ({"transformers_version": "5.0.0"}, "float16", "float16"),
        ({"transformers_version": "5.0.0"}, None, "float32"),
        (
            {"framework": "trl", "trl_version": "0.25.1", "transformers_version": "4.57"},
            "bfloat16",
            "float32",
        ),
        (
            {"framework": "trl", "trl_version": "0.25.1", "transformers_version": "5.0"},
            "bfloat16",
            "bfloat16",
        ),
        (
            {"framework": "trl", "trl_version": "0.26.2", "transformers_version": "4.57"},
            "bfloat16",
            "float32",
        ),
        (
            {"framework": "trl", "trl_version": "0.26.2", "transformers_version": "5.0"},
            "bfloat16",
            "bfloat16",
        ),
        (
            {"framework": "trl", "trl_version": "0.27.0", "transformers_version": "5.0"},
            "bfloat16",
            "float32",
        ),
        ({"framework": "trl", "trl_version": "1.16.0"}, "bfloat16", "float32"),
        ({"framework": "llama-factory", "lora_rank": 8}, "bfloat16", "bfloat16"),
        ({"framework": "llama-factory", "lora_rank": 8}, None, "float32"),
        ({"framework": "llama-factory"}, "bfloat16", "float32"),
        ({"framework": "axolotl", "lora_rank": 8}, "float32", "bfloat16"),
        ({"framework": "axolotl", "lora_rank": 8, "precision": "16-mixed"}, None, "float16"),
        ({"framework": "axolotl"}, "bfloat16", "float32"),
        ({"framework": "axolotl", "lora_rank": 8, "precision": "32-true"}, "bfloat16", "float32"),
    ],
)
def test_each_framework_and_release(
    fields: dict[str, object], checkpoint: str | None, loads: str
) -> None:
    default = framework_load_dtype(_t(**fields), checkpoint)
    assert default is not None
    assert default.dtype == loads


@pytest.mark.parametrize("framework", ["pytorch-amp", "unsloth", "deepspeed", "torchtune"])
def test_frameworks_whose_load_is_not_read(framework: str) -> None:
    assert framework_load_dtype(_t(framework=framework, precision="bf16-true"), "bfloat16") is None


def test_a_given_load_dtype_wins() -> None:
    t = _t(transformers_version="5.0", load_dtype="float32")
    assert resolve_load_dtype(t, "bfloat16") == (t, None)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"precision": "32-true"}, "--precision bf16-true models"),
        ({"zero_stage": 3, "data_parallel_size": 2}, "DeepSpeed casts the weights"),
        ({"quantize_base": "nf4", "lora_rank": 8}, "quantized base"),
        ({"precision": "16-mixed"}, "autocast to float16 over bfloat16 weights"),
    ],
)
def test_a_16bit_load_the_step_does_not_model_stays_float32_and_says_why(
    fields: dict[str, object], says: str
) -> None:
    t = _t(transformers_version="5.0", **fields)
    resolved, why = resolve_load_dtype(t, "bfloat16")
    assert resolved.load_dtype is None and not resolved.autocast_over_loaded_16bit
    assert why is not None and why.startswith("float32 modelled; the load is bfloat16")
    assert says in why


def test_config_dtype_spellings() -> None:
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"dtype": "torch.float16"}) == "float16"
    assert checkpoint_dtype({"torch_dtype": "auto"}) is None
    assert checkpoint_dtype({"torch_dtype": "float64"}) is None
    assert checkpoint_dtype({}) is None
    # the shipped config.json of meta-llama/Llama-3.2-1B says "torch_dtype": "bfloat16"
    assert load_model_spec("llama-3.2-1b").checkpoint_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("transformers", "parameters", "optimizer_states", "assumed"),
    [
        (
            "5.0",
            2 * N,
            4 * N,
            "bfloat16 (transformers 5.0 from_pretrained defaults to dtype='auto'",
        ),
        ("4.57", 4 * N, 8 * N, "float32 (transformers 4.57 from_pretrained loads in torch's"),
    ],
)
def test_hf_trainer_bytes_follow_the_release(
    transformers: str, parameters: int, optimizer_states: int, assumed: str
) -> None:
    t = _t(transformers_version=transformers, micro_batch_size=1, seq_len=256)
    est = estimate("llama-3.2-1b", t, engine="analytic", simulate_allocator=False)
    assert est.breakdown.parameters == parameters
    assert est.breakdown.optimizer_states == optimizer_states
    assert est.details["assumed"]["load_dtype"].startswith(assumed)
    assert est.config["load_dtype"] == ("bfloat16" if transformers == "5.0" else None)


@pytest.mark.parametrize("saved", ["bfloat16", "float16"])
def test_installed_from_pretrained_loads_what_the_rule_says(tmp_path: Path, saved: str) -> None:
    """A real CPU run of the installed transformers' ``from_pretrained`` without a dtype on a
    tiny Llama saved in ``saved``: the parameters come out in the dtype the rule gives for the
    installed release."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, saved))
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    dtypes = {str(p.dtype).removeprefix("torch.") for p in loaded.parameters()}
    release = installed_transformers_version()
    assert release is not None
    t = _t(transformers_version=".".join(map(str, release)))
    # trainmem reads the config.json save_pretrained wrote, as a user's path
    default = framework_load_dtype(t, load_model_spec(str(tmp_path)).checkpoint_dtype)
    assert default is not None
    assert dtypes == {default.dtype}


# ChatGLM3-6B (tests/models/remote_code/chatglm3-6b.json, torch_dtype float16) by hand: embedding
# and output_layer 65,024 x 4,096 = 266,338,304 each; a layer query_key_value 4,096 x (32 + 2 x 2)
# x 128 = 18,874,368 + bias 4,608, dense 4,096^2 = 16,777,216, dense_h_to_4h 4,096 x 27,392 =
# 112,197,632, dense_4h_to_h 56,098,816, two RMSNorms 8,192: 203,960,832, 28 times
# 5,710,903,296; final norm 4,096: N = 6,243,584,000. LoRA r 8 on query_key_value: 8 x 4,096 +
# 4,608 x 8 = 69,632 a layer, 1,949,696 in all.
CHATGLM3 = str(Path(__file__).parents[1] / "models" / "remote_code" / "chatglm3-6b.json")
N_CHATGLM3, N_LORA = 6_243_584_000, 1_949_696


@pytest.mark.parametrize(
    ("model_type", "checkpoint", "transformers", "loads"),
    [("chatglm", "float16", "4.37.1", "float16"), ("chatglm", "bfloat16", "4.48.1", "bfloat16"),
     ("chatglm", "float16", "4.49.0", "float32"), ("chatglm", "float16", "4.57.6", "float32"),
     ("chatglm", "float16", "5.0.0", "float16"), ("chatglm", None, "4.37.1", "float32"),
     ("llama", "float16", "4.37.1", "float32"), (None, "float16", "4.37.1", "float32")],
)  # fmt: skip
def test_chatglm_remote_code_builds_in_the_config_dtype(
    model_type: str | None, checkpoint: str | None, transformers: str, loads: str
) -> None:
    # modeling_chatglm.py _config_to_kwargs: every module made with dtype=config.torch_dtype,
    # which from_pretrained without a dtype leaves as the config.json says before 4.49 and
    # overwrites with torch's default from 4.49 (4.49.0 modeling_utils.py
    # ``config.torch_dtype = default_dtype``); 5.0's dtype="auto" reads the config again
    t = _t(transformers_version=transformers)
    default = framework_load_dtype(t, checkpoint, model_type)
    assert default is not None
    assert default.dtype == loads


def test_chatglm3_lora_loads_fp16_under_transformers_4() -> None:
    t = _t(
        transformers_version="4.37.1",
        precision="16-mixed",
        lora_rank=8,
        lora_targets=("q", "k", "v"),
        micro_batch_size=1,
        seq_len=256,
    )
    est = estimate(CHATGLM3, t, engine="analytic", simulate_allocator=False)
    # the fp16 base and peft's fp32 adapters (autocast_adapter_dtype); AdamW's two fp32 moments
    assert est.breakdown.parameters == 2 * N_CHATGLM3 + 4 * N_LORA == 12_494_966_784
    assert est.breakdown.optimizer_states == 8 * N_LORA
    assert est.details["assumed"]["load_dtype"].startswith("float16 (transformers 4.37.1")
    # no autocast: the model trains in its loaded dtype, and the note says so (not "float32")
    true16 = estimate(
        CHATGLM3, replace(t, precision="16-true"), engine="analytic", simulate_allocator=False
    )
    assert true16.details["assumed"]["load_dtype"].startswith("float16 (")
    assert true16.details["assumed"]["load_dtype"].endswith("as --precision 16-true trains")


# Qwen-7B (tests/models/remote_code/qwen-7b.json; bf16 / fp16 / fp32 false) by hand: wte and
# lm_head 151,936 x 4,096 = 622,329,856 each; a layer c_attn 4,096 x 12,288 = 50,331,648 + bias
# 12,288, attn c_proj 4,096^2 = 16,777,216, w1 and w2 4,096 x 11,008 = 45,088,768 each, mlp
# c_proj 45,088,768, ln_1 / ln_2 8,192: 202,395,648, 32 times 6,476,660,736; ln_f 4,096:
# N = 7,721,324,544. LoRA r 8 on the fused c_attn: 8 x 4,096 + 12,288 x 8 = 131,072 a layer,
# 4,194,304 in all.
QWEN_7B = str(Path(__file__).parents[1] / "models" / "remote_code" / "qwen-7b.json")
N_QWEN_7B, N_QWEN_LORA = 7_721_324_544, 4_194_304


def _gpu(name: str, cc: str) -> GPUSpec:
    return replace(get_gpu(name), compute_capability=cc)


@pytest.mark.parametrize(
    ("gpu", "torch", "flags", "loads"),
    [
        # modeling_qwen.py: autoset_precision -> bf16 where torch.cuda.is_bf16_supported()
        (get_gpu("A100-80GB"), "2.0.1", {}, "bfloat16"),
        (get_gpu("H100-80GB"), None, {}, "bfloat16"),
        (get_gpu("MI300X"), "2.1.1", {}, "bfloat16"),  # ROCm: torch.version.hip -> True
        # no bf16 below 8.0 before torch 2.3 -> fp16 from capability 7.0
        (get_gpu("V100-32GB"), "2.2.2", {}, "float16"),
        (get_gpu("T4"), "2.1.1", {}, "float16"),
        # from torch 2.3 a bf16 tensor on the device is enough (pytorch PR #115924)
        (get_gpu("V100-32GB"), "2.3.0", {}, "bfloat16"),
        (_gpu("V100-32GB", "6.0"), "2.1.1", {}, "float32"),  # neither: config.fp32 = True
        # a flag in the config wins over the GPU
        (get_gpu("A100-80GB"), "2.0.1", {"fp32": True}, "float32"),
        (get_gpu("A100-80GB"), "2.0.1", {"fp16": True, "bf16": False}, "float16"),
        (get_gpu("T4"), "2.1.1", {"bf16": True}, "bfloat16"),
    ],
)
def test_qwen1_casts_itself_at_init(
    gpu: GPUSpec, torch: str | None, flags: dict[str, bool], loads: str
) -> None:
    t = _t(transformers_version="4.32.0", torch_version=torch)
    config = {"model_type": "qwen", "bf16": False, "fp16": False, "fp32": False, **flags}
    default = framework_load_dtype(t, None, "qwen", config=config, gpu=gpu)
    assert default is not None
    assert default.dtype == loads
    assert "modeling_qwen.py" in default.why


def test_qwen1_refuses_two_precision_flags() -> None:
    config = {"bf16": True, "fp16": True}
    with pytest.raises(SpecError, match="bf16 and fp16"):
        framework_load_dtype(_t(), None, "qwen", config=config, gpu=get_gpu("A100-80GB"))


def test_qwen1_lora_loads_bf16_on_an_a100() -> None:
    t = _t(
        transformers_version="4.32.0",
        torch_version="2.0.1",
        lora_rank=8,
        lora_targets=("q", "k", "v"),
        micro_batch_size=1,
        seq_len=256,
    )
    est = estimate(QWEN_7B, t, gpu="A100-80GB", engine="analytic", simulate_allocator=False)
    # the bf16 base and peft's fp32 adapters; AdamW's two fp32 moments of the adapters
    assert est.breakdown.parameters == 2 * N_QWEN_7B + 4 * N_QWEN_LORA == 15_459_426_304
    assert est.breakdown.optimizer_states == 8 * N_QWEN_LORA
    assert est.details["assumed"]["load_dtype"].startswith("bfloat16 (")
    # an explicit --load-dtype wins: the fp32 base
    fp32 = estimate(
        QWEN_7B,
        replace(t, load_dtype="float32"),
        gpu="A100-80GB",
        engine="analytic",
        simulate_allocator=False,
    )
    assert fp32.breakdown.parameters == 4 * N_QWEN_7B + 4 * N_QWEN_LORA
    # on a V100 under torch 2.2 it casts to fp16, which bf16 autocast over is not modelled:
    # the fp32 step, and the note says why
    v100 = estimate(
        QWEN_7B,
        replace(t, torch_version="2.2.2"),
        gpu="V100-32GB",
        engine="analytic",
        simulate_allocator=False,
    )
    assert v100.breakdown.parameters == 4 * N_QWEN_7B + 4 * N_QWEN_LORA
    assert "the load is float16" in v100.details["assumed"]["load_dtype"]
    # no GPU: the cast is not known; transformers' float32 and a word on --gpu
    bare = estimate(QWEN_7B, t, engine="analytic", simulate_allocator=False)
    assert bare.breakdown.parameters == 4 * N_QWEN_7B + 4 * N_QWEN_LORA
    assert bare.details["assumed"]["load_dtype"].endswith("give --gpu)")


# Note [transformers 4 loads a quantized base in float16]: transformers 4.30.2 / 4.36.2
# modeling_utils.py ``from_pretrained`` ("We force the `dtype` to be float16", bitsandbytes;
# ``if torch_dtype is None: torch_dtype = torch.float16``, GPTQ) and 4.40.0 .. 4.57.6
# quantizers/quantizer_bnb_4bit.py, quantizer_bnb_8bit.py, quantizer_gptq.py
# ``update_torch_dtype``; 5.0.0's bitsandbytes quantizers set none and ``dtype="auto"`` gives
# the config's.
@pytest.mark.parametrize(
    ("fields", "loads"),
    [
        ({"quantize_base": "nf4", "transformers_version": "4.36.2"}, "float16"),
        ({"quantize_base": "int8", "transformers_version": "4.57.6"}, "float16"),
        ({"quantize_base": "gptq-int4", "transformers_version": "4.40"}, "float16"),
        ({"quantize_base": "nf4", "transformers_version": "5.0.0"}, "bfloat16"),
        (
            {
                "framework": "trl",
                "trl_version": "0.25.1",
                "quantize_base": "nf4",
                "transformers_version": "4.57",
            },
            "float16",
        ),
        # TRL from 0.27 passes dtype float32 itself, which transformers keeps
        (
            {
                "framework": "trl",
                "trl_version": "0.27.0",
                "quantize_base": "nf4",
                "transformers_version": "4.57",
            },
            "float32",
        ),
    ],
)
def test_transformers_4_loads_a_quantized_base_in_float16(
    fields: dict[str, object], loads: str
) -> None:
    default = framework_load_dtype(_t(lora_rank=8, **fields), "bfloat16")
    assert default is not None
    assert default.dtype == loads


def test_the_float16_load_of_a_quantized_base_where_it_stays_as_loaded() -> None:
    kept = {"quantize_base": "nf4", "lora_rank": 8, "prepare_kbit_training": False}
    flash = _t(transformers_version="4.36.2", attention="flash", **kept)
    resolved, why = resolve_load_dtype(flash, "bfloat16")
    assert resolved.load_dtype == "float16" and resolved.kbit_dense_cast
    assert why is not None and why.startswith("float16 (transformers 4.36.2 forces float16")
    assert why.endswith("--load-dtype bfloat16 overrides it")
    # under 16-mixed the load is the compute dtype: nothing to override
    fp16 = _t(transformers_version="4.36.2", precision="16-mixed", **kept)
    resolved, why = resolve_load_dtype(fp16, "bfloat16")
    assert resolved.load_dtype == "float16" and not resolved.kbit_dense_cast
    assert why is not None and "overrides" not in why
    # SDPA over an fp16 stream under bf16 autocast is not modelled: the compute dtype stays
    sdpa = _t(transformers_version="4.36.2", **kept)
    resolved, why = resolve_load_dtype(sdpa, "bfloat16")
    assert resolved.load_dtype is None and resolved.kbit_dense_dtype == "bfloat16"
    assert why is not None and why.startswith("bfloat16 modelled; the load is float16")
    assert "--attention flash keeps float16" in why
    # peft's preparation casts the rest to fp32 (the HF Trainer's default)
    prepared = _t(transformers_version="4.36.2", quantize_base="nf4", lora_rank=8)
    resolved, why = resolve_load_dtype(prepared, "bfloat16")
    assert resolved.load_dtype is None and resolved.kbit_fp32_upcast
    assert why is not None and why.startswith("float32 modelled; the load is float16")
    assert "prepare_model_for_kbit_training casts its other weights to float32" in why
    # a given load dtype wins
    given = replace(flash, load_dtype="bfloat16")
    assert resolve_load_dtype(given, "bfloat16") == (given, None)


def test_the_float16_load_of_a_quantized_base_moves_the_head_cast() -> None:
    """Llama-3.2-1B (V 128,256, h 2,048, tied head kept in 16 bits as loaded) under bf16
    autocast: the fp16 head weight is cast to bf16 at the forward and the matmul saves the cast
    for the input gradient (aten autocast ``cached_cast``; derivatives.yaml mm saves ``mat2``),
    2 x 128,256 x 2,048 = 525,336,576 B of activations more than a bf16 load, which has no
    cast (Note [A quantized base's other weights in another 16-bit dtype])."""
    t = _t(
        transformers_version="4.36.2",
        quantize_base="nf4",
        lora_rank=8,
        prepare_kbit_training=False,
        attention="flash",
        micro_batch_size=1,
        seq_len=512,
    )
    run = estimate("llama-3.2-1b", t, engine="analytic", simulate_allocator=False)
    bf16 = estimate(
        "llama-3.2-1b",
        replace(t, load_dtype="bfloat16"),
        engine="analytic",
        simulate_allocator=False,
    )
    assert run.config["load_dtype"] == "float16"
    assert run.details["assumed"]["load_dtype"].startswith("float16 (transformers 4.36.2")
    assert run.breakdown.activations - bf16.breakdown.activations == 2 * 128_256 * 2_048
