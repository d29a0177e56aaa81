"""The published probe's third source (helper probecn, session 26): THUDM's own fine-tuning
memory figures for ChatGLM3-6B and GLM-4-9B (remote code, ``model_type`` "chatglm"), run by
``published_probe.py`` after the Qwen README's and ms-swift's cells.

Sources (the README beside the code that ran, both read at the commit that added the figures):

- THUDM/ChatGLM3 finetune_demo/README.md @9484f8204f1536e338a5557138a65e31d2a3984d (27 Jan 2024,
  unchanged to c6fe1af, May 2024), "测试硬件标准": "本仓库中的默认配置文件中，我们记录了显存的
  占用情况: SFT 全量微调: 4张显卡平均分配，每张显卡占用 48346MiB; P-TuningV2 微调: 1张显卡，
  占用 18426MiB; LORA 微调: 1张显卡，占用 14082MiB" (A100 / H100 named as the cards
  tested). The same commit's finetune_hf.py and configs/{lora,ptuning_v2,sft}.yaml;
  requirements transformers>=4.37.1, torch>=2.1.0, peft>=0.7.1, deepspeed>=0.13.1 (4.37.1,
  2.1.2, 0.13.1 were current).
- THUDM/ChatGLM3 finetune_demo/README.md @7559fe2 (2 Nov 2023), "参考显存用量": P-Tuning V2 at
  PRE_SEQ_LEN 128 / batch 1 / 2048 tokens "约需要 21GB"; 8-bit and 4-bit at 1024 tokens 12 / 7.6
  GB; full fine-tuning with scripts/finetune_ds_multiturn.sh (2048 tokens, batch 16, 4 GPUs)
  "恰好用满 4 * 80GB" (just fills the four 80 GB cards): a qualitative cell, printed against 80
  GiB and kept out of the summary (declared before it was run). transformers==4.30.2.
- THUDM/GLM-4 finetune_demo/README.md @c0a6d1e (5 Jun 2024, unchanged to b5683f2, Jul 2024),
  table "微调方案 | 显存占用": lora 21531MiB, p-tuning v2 21381MiB, SFT (Zero3) 80935MiB each of 8
  GPUs; A100-SXM4-80GB, CUDA 12.3; finetune_demo/finetune.py and configs at that commit,
  basic_demo/requirements.txt transformers==4.40.0, torch>=2.3.0; peft>=0.11.0,
  deepspeed>=0.13.3 (0.14.2 current).

Metric: "显存占用" in MiB, no tool named (nvidia-smi's unit): compared with trainmem's device total
(``max_memory_reserved`` + CUDA context + NCCL), in GiB (MiB / 1024).

Setup, from the code at those commits:
- the model: ChatGLM's remote code builds every module in ``config.torch_dtype``
  (modeling_chatglm.py ``_config_to_kwargs``: ``{"dtype": args.torch_dtype}`` on every Linear,
  Embedding and norm), so ``from_pretrained`` without a dtype still gives ChatGLM3-6B in fp16
  (its config.json: float16); GLM-4's finetune.py passes ``torch_dtype=torch.bfloat16``.
- no ``bf16`` / ``fp16`` in any of the yaml files: the Trainer runs no autocast and no
  GradScaler, so LoRA trains over the 16-bit model as it is: ``16-true`` (ChatGLM3) /
  ``bf16-true`` (GLM-4). ChatGLM3's ``_prepare_model_for_training`` casts the trainable
  parameters (the adapters, 1.9 M) to fp32; trainmem keeps them in fp16 (a few MB).
- LoRA: peft's default target for chatglm, ``query_key_value`` (the fused q / k / v linear;
  trainmem's ``q,k,v`` on a fused family is the one adapter), r 8, alpha 32, dropout 0.1.
- checkpointing: none in ChatGLM3's finetune_hf.py at 9484f82; GLM-4's finetune.py calls
  ``model.gradient_checkpointing_enable()`` (the remote code's own per-layer checkpoint): full.
- SFT: ``deepspeed: ds_zero_3.json`` whose ``bf16.enabled`` is "auto" and with no fp16
  section; the Trainer fills "auto" from ``bf16=False``, so DeepSpeed runs fp32, and
  ``zero.Init`` (entered by ``from_pretrained`` because the TrainingArguments were built first)
  creates every float tensor in fp32 (DeepSpeed partition_parameters.py ``_set_dtype``: neither
  fp16 nor bf16 -> ``torch.float``). Mapped as ``32-true`` with the ds_config.
- ChatGLM3 Nov 2023 full fine-tune: ``model.float()`` then ``--fp16`` with DeepSpeed ZeRO-2
  (configs/deepspeed.json), ``gradient_checkpointing_enable()``; every sample padded to
  ``max_seq_length`` (preprocess_utils.py ``MultiTurnDataset``), so the length is exact.
- lengths: batches padded to their longest sample (``DataCollatorForSeq2Seq(padding='longest')``)
  and each sample cut at ``max_input_length + max_output_length + 1`` (``process_batch``); the
  cells are run at that cap, the longest a step can be. AdvertiseGen's samples are shorter (its
  lengths are not read offline), so the cap is an upper bound on the length-dependent part.
- P-Tuning v2 (helper ptuning, session 27): ChatGLM3's finetune_hf.py @9484f82 sets
  ``config.pre_seq_len = num_virtual_tokens`` (64, configs/ptuning_v2.yaml) and builds the
  remote code's own ``PrefixEncoder`` (``_prepare_model_for_training`` casts it to fp32);
  GLM-4's finetune.py @c0a6d1e runs peft's ``PrefixTuningConfig`` (num_virtual_tokens 512,
  token_dim 256 = 2 groups x 128) on the bf16 model with ``gradient_checkpointing_enable()``;
  ChatGLM3 @7559fe2's finetune.py: ``model.half()``, the prefix encoder ``.float()``,
  ``gradient_checkpointing_enable()``, PRE_SEQ_LEN 128. All three as ``--num-virtual-tokens``
  on the generic path (Note [Prefix tuning] in trainmem/trace/prefix.py: the shapes of peft's
  prefix; ChatGLM's prefix dropout not reproduced), with the installed transformers and torch
  (:data:`_TRACED`).
- ChatGLM's own ``quantize(bits)`` (quantization.py ``QuantizedLinear`` / ``W8A16Linear``, the
  encoder's four linears per layer; helper chatglmq, session 28): ``--quantize-base
  chatglm-int8`` / ``chatglm-int4`` (Note [ChatGLM's quantize] in
  trainmem/trace/chatglm_quantized.py: an int8 ``weight`` of [out, in * bits / 8] and an fp16
  ``weight_scale`` of [out]; the forward and the backward each rebuild the fp16 weight, every
  quantized linear saves its input and its backward makes a full fp16 ``grad_weight`` of the
  frozen weight). ChatGLM3 @7559fe2's finetune.py and ChatGLM2-6B's ptuning/main.py: ``model.
  quantize(quantization_bit)``, ``model.half()``, the prefix encoder ``.float()``,
  ``gradient_checkpointing_enable()`` (the remote code's per-layer checkpoint), no ``--fp16``.
- ChatGLM2-6B ptuning/README.md @3be48aa (THUDM/ChatGLM2-6B): "在默认配置
  ``quantization_bit=4``、``per_device_train_batch_size=1``、``gradient_accumulation_steps=16``
  下 ... 最低只需 6.7G 显存" with ptuning/train.sh @623e48d (PRE_SEQ_LEN 128, max_source_length
  64, max_target_length 128) and main.py @3be48aa: every sample padded to
  ``max_source_length + max_target_length`` = 192 tokens (``preprocess_function_train``; a
  sample of 64 + 128 + eos is 193, not cut), ``model.quantize(4)`` then ``model.half()``.
  ChatGLM2-6B's config.json is ChatGLM3-6B's but for ``seq_length`` (32,768; the rotary table
  length, no tensor of the step) and its name.
Not modelled: the evaluation every 500 steps (``predict_with_generate`` with
``per_device_eval_batch_size`` 16 / 4, ``max_new_tokens`` 256 / 512): its KV cache and logits
are outside the training step.

Run: ``PYTHONPATH=src python benchmarks/published_probe.py`` (these cells last).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATGLM3_JAN24 = (
    "https://github.com/THUDM/ChatGLM3/blob/9484f8204f1536e338a5557138a65e31d2a3984d/"
    "finetune_demo/README.md"
)
CHATGLM3_NOV23 = "https://github.com/THUDM/ChatGLM3/blob/7559fe2/finetune_demo/README.md"
CHATGLM2_PTUNING = "https://github.com/THUDM/ChatGLM2-6B/blob/3be48aa/ptuning/README.md"
GLM4_JUN24 = "https://github.com/THUDM/GLM-4/blob/c0a6d1e/finetune_demo/README.md"

#: THUDM/chatglm3-6b config.json (tests/models/remote_code/chatglm3-6b.json) and
#: THUDM/glm-4-9b-chat config.json (as published on the Hub, torch_dtype bfloat16).
_GLM4_9B = {
    "model_type": "chatglm",
    "architectures": ["ChatGLMModel"],
    "add_bias_linear": False,
    "add_qkv_bias": True,
    "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False,
    "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True,
    "ffn_hidden_size": 13696,
    "fp32_residual_connection": False,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "kv_channels": 128,
    "layernorm_epsilon": 1.5625e-07,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
    "num_attention_heads": 32,
    "num_layers": 40,
    "original_rope": True,
    "padded_vocab_size": 151552,
    "post_layer_norm": True,
    "rmsnorm": True,
    "rope_ratio": 500,
    "seq_length": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

#: finetune_demo/configs/ds_zero_3.json, identical at ChatGLM3 9484f82 and GLM-4 c0a6d1e.
DS_ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
#: finetune_demo/configs/deepspeed.json at ChatGLM3 7559fe2.
DS_ZERO2_FP16 = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    },
}

_CHATGLM3_JAN24 = [
    "--framework", "hf-trainer", "--transformers-version", "4.37.1",
    "--torch-version", "2.1.2", "--gpu", "A100-80GB",
]  # fmt: skip
_GLM4 = [
    "--framework", "hf-trainer", "--transformers-version", "4.40.0",
    "--torch-version", "2.3.0", "--gpu", "A100-80GB",
]  # fmt: skip
_TRACED = ["--framework", "hf-trainer", "--gpu", "A100-80GB", "--engine", "generic"]
"""The P-Tuning v2 cells: traced (prefix tuning is not in the formulas) with the installed
transformers and torch, as the generic path runs only those; ChatGLM's modeling is its remote
code's whatever the transformers release, and the HF Trainer's plain step on one GPU is the
same in 4.30 to 4.40."""
_PTUNING_QUANTIZED = [
    "--num-virtual-tokens", "128", "--precision", "16-true", "--activation-checkpointing", "full",
    *_TRACED, "--quantize-base",
]  # fmt: skip
"""THUDM's P-Tuning v2 over ChatGLM's own quantize (PRE_SEQ_LEN 128, ``model.half()``, the
remote code's checkpointing); the base's ``--quantize-base`` value follows."""
_LORA = [
    "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.1", "--lora-targets", "q,k,v",
]  # fmt: skip

#: (source, method, model, GPUs, max tokens, batch, the README's figure in MiB (None: only a
#: qualitative statement), trainmem arguments (None: not mapped, the reason in ``UNMAPPED``)).
ROWS: list[tuple[str, str, str, int, int, int, float | None, list[str] | None]] = [
    ("ChatGLM3 Jan 2024", "LoRA", "chatglm3-6b", 1, 385, 1, 14082,
     [*_LORA, "--precision", "16-true", *_CHATGLM3_JAN24]),
    ("ChatGLM3 Jan 2024", "P-Tuning v2 (pre_seq_len 64)", "chatglm3-6b", 1, 769, 4, 18426,
     ["--num-virtual-tokens", "64", "--precision", "16-true", *_TRACED]),
    ("ChatGLM3 Jan 2024", "SFT, ZeRO-3 x4", "chatglm3-6b", 4, 385, 1, 48346,
     ["--precision", "32-true", "--deepspeed-config", "{ds_zero3}", "--data-parallel-size", "4",
      "--deepspeed-version", "0.13.1", *_CHATGLM3_JAN24]),
    ("GLM-4 Jun 2024", "LoRA", "glm-4-9b-chat", 1, 1025, 1, 21531,
     [*_LORA, "--precision", "bf16-true", "--activation-checkpointing", "full", *_GLM4]),
    ("GLM-4 Jun 2024", "p-tuning v2 (peft prefix, 512 tokens)", "glm-4-9b-chat", 1, 257, 4,
     21381,
     ["--num-virtual-tokens", "512", "--precision", "bf16-true", "--activation-checkpointing",
      "full", *_TRACED]),
    ("GLM-4 Jun 2024", "SFT, ZeRO-3 x8", "glm-4-9b-chat", 8, 769, 1, 80935,
     ["--precision", "32-true", "--deepspeed-config", "{ds_zero3}", "--data-parallel-size", "8",
      "--deepspeed-version", "0.14.2", "--activation-checkpointing", "full", *_GLM4]),
    ("ChatGLM3 Nov 2023", "P-Tuning v2 (pre_seq_len 128)", "chatglm3-6b", 1, 2048, 1,
     21 * 1000**3 / 2**20,
     ["--num-virtual-tokens", "128", "--precision", "16-true", "--activation-checkpointing",
      "full", *_TRACED]),
    ("ChatGLM3 Nov 2023", "P-Tuning v2, int8 base", "chatglm3-6b", 1, 1024, 1,
     12 * 1000**3 / 2**20, [*_PTUNING_QUANTIZED, "chatglm-int8"]),
    ("ChatGLM3 Nov 2023", "P-Tuning v2, int4 base", "chatglm3-6b", 1, 1024, 1,
     7.6 * 1000**3 / 2**20, [*_PTUNING_QUANTIZED, "chatglm-int4"]),
    ("ChatGLM2-6B ptuning", "P-Tuning v2 (pre_seq_len 128), int4 base", "chatglm2-6b", 1, 192,
     1, 6.7 * 1000**3 / 2**20, [*_PTUNING_QUANTIZED, "chatglm-int4"]),
    ("ChatGLM3 Nov 2023", "Full, ZeRO-2 fp16 x4 ('just fills 4 x 80GB')", "chatglm3-6b", 4, 2048,
     16, None,
     ["--precision", "16-mixed", "--deepspeed-config", "{ds_zero2_fp16}",
      "--data-parallel-size", "4", "--activation-checkpointing", "full", "--framework",
      "hf-trainer", "--transformers-version", "4.30.2", "--torch-version", "2.1.0",
      "--gpu", "A100-80GB"]),
]  # fmt: skip

UNMAPPED: dict[str, str] = {}
"""Why a row is not mapped, by method (every row is mapped since session 28)."""

#: Stated elsewhere, not run: the first generation's P-Tuning v2 figures (THUDM/ChatGLM-6B
#: ptuning/README.md: quantization_bit 4, batch 1; ChatGLM-6B README: 14 / 9 / 7 GB "最低 GPU
#: 显存（高效参数微调）" at FP16 / INT8 / INT4): ChatGLM-6B's GLM architecture (2D positions, a
#: GELU MLP, 130,528 tokens) is not modelled (hf_table.py ``_chatglm_first_generation``).


def write_inputs(folder: Path, repo_models: Path) -> dict[str, str]:
    """The config.json and ds_config files of these cells in ``folder``; paths by name."""
    chatglm3: dict[str, Any] = json.loads((repo_models / "chatglm3-6b.json").read_text())
    files: dict[str, dict[str, Any]] = {
        "chatglm3-6b": chatglm3,
        "chatglm2-6b": {**chatglm3, "_name_or_path": "THUDM/chatglm2-6b", "seq_length": 32768},
        "glm-4-9b-chat": _GLM4_9B,
        "ds_zero3": DS_ZERO3,
        "ds_zero2_fp16": DS_ZERO2_FP16,
    }
    paths: dict[str, str] = {}
    for name, content in files.items():
        path = folder / f"glm-{name}.json"
        path.write_text(json.dumps(content))
        paths[name] = str(path)
    return paths


def row_args(
    model: str, max_tokens: int, batch: int, args: list[str], paths: dict[str, str]
) -> list[str]:
    """``trainmem estimate`` arguments of one cell (without ``--json``)."""
    return [
        paths[model], "--seq-len", str(max_tokens), "--micro-batch-size", str(batch),
        *(a.format(**paths) for a in args),
    ]  # fmt: skip


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run(folder: Path, repo_models: Path) -> list[float]:
    """Print the cells' table; |relative error| of the device total on the cells with a figure
    that trainmem answers."""
    from validate import _invoke_estimate, metric_of

    paths = write_inputs(folder, repo_models)
    print(f"\nsources: {CHATGLM3_JAN24}\n         {CHATGLM3_NOV23}\n         {GLM4_JUN24}")
    print(f"         {CHATGLM2_PTUNING}")
    print(
        "| source | method | model | GPUs | tokens (cap) | batch | measured GiB/GPU "
        "| device total GiB | error | reserved GiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    errors: list[float] = []
    for source, method, model, gpus, tokens, batch, mib, args in ROWS:
        measured = None if mib is None else mib / 1024
        shown = "~80 (fills the card)" if measured is None else f"{measured:.2f}"
        head = f"| {source} | {method} | {model} | {gpus} | {tokens} | {batch} | {shown} |"
        if args is None:
            print(f"{head} not mapped: {UNMAPPED[method]} | | |")
            continue
        answer, error = _invoke_estimate(row_args(model, tokens, batch, args, paths))
        total = None if answer is None else metric_of(answer, "device_total")
        if answer is None or total is None:
            print(f"{head} {error or 'out of memory'} | | |")
            continue
        predicted = total / 2**30
        reserved = answer["peak"]["reserved_bytes"] / 2**30
        against = 80.0 if measured is None else measured
        print(f"{head} {predicted:.2f} | {_pct(predicted, against)} | {reserved:.2f} |")
        if measured is not None:
            errors.append(abs(predicted - measured) / measured)
    return errors
