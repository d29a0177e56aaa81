"""Which training options run on the generic path, per kind of model (issue 26: "every option
of `trainmem estimate --help` works on the generic path ... the generic path agrees with the
formulas within 1% where both run").

For each option set below (one option away from the defaults, plus what it needs: ZeRO with
data parallelism, QLoRA with a LoRA rank, torchtune with its recipes' dtype, bf16-true, as it
runs no autocast), each model runs ``estimate(..., engine="generic")``
at micro-batch 2, 64 tokens, allocator replay off. Where the formula family runs, the
agreement model (AGREEMENT: a 2-layer 2048-wide Llama, vocabulary 4096, at 2 x 256 tokens,
whose layers' backward and activations, not the cuBLAS workspaces, set the peak; the tiny
Qwen2's peak is ~85 % workspace and cannot show a gradient's timing) runs both engines, and
the table shows generic vs analytic on it where both ran. A refusal prints its reason;
a language model's option on the diffusers model (a token loss, a padded token batch, a
language-model framework) is counted apart as not applicable (``NotApplicableError``: the
option has no meaning there, and the message says what to use instead).

    PYTHONPATH=src python benchmarks/generic_options.py [--json out.json]
        [--sets REGEX] [--models REGEX]   # a subset: option sets / models whose name matches
    PYTHONPATH=src python benchmarks/generic_options.py --summary a.json b.json  # runs' table

Models: a formula family (tests/models/formula/qwen2.json), a remote-code config
(tests/models/remote_code/qwen-7b.json: Qwen-1 mapped onto the modelled shapes), and a diffusers
model (tests/models/diffusers/tiny-pixart.json). timm models need the optional timm extra; the
"litgpt" set runs litgpt's own GPT (trainmem/trace/litgpt_model.py) on the formula and
remote-code models only with litgpt installed (``pip install 'trainmem[litgpt]' && pip install
--no-deps litgpt==0.5.13``, as README's test command installs it), and is refused naming that
without (not applicable on the diffusers and timm models: litgpt trains language models). With
litgpt 0.5.13 (2026-11-28 04:50 UTC): +0.012 % vs analytic on the agreement model (-0.10 % on
the tiny Qwen2 at 2 x 64 tokens, 01:30 UTC); the same +0.012 % on 2026-11-29 14:43 UTC (31b4cca).

"transformers 4.40" / "litgpt 0.4.0" (session 27, helper tfversion; trainmem/traced_releases.py):
refused on all four models (the release differences are known for Llama / Mistral only; litgpt
0.4.0 crossed RMSNorm's fp32 weight rule: since session 28 (helper prompt2) traced with 0.4.0's
RMSNorm, run on the formula and remote-code models; n/a on the diffusers and timm models), and
the GQA agreement model is refused for repeat_kv; on tests/models/agreement/llama_h1024.json the
generic path at 4.40 is within 0.02 % of the formulas (tests/trace/test_traced_releases.py).
Session 28 (helper tfrel): Qwen2's releases read (4.40-4.46) and 4.40's repeat_kv copies a
transform (with the training KV cache), so "transformers 4.40" runs on the formula model (a
real 4.40.0 trace of it at 4 x 128: generic +0.05 %, formulas +0.01 %) and on the GQA agreement
model (+0.000 % vs analytic; 18:43 UTC, 244d029); the other three kinds refused as before.
Session 29 (helper tfrel3): the diffusers and timm models run it (their step runs no
transformers model code: traced as installed, the note says the version does not apply; the
same bytes as without it); the remote-code model is still refused.
Against a real 4.40.0 trace (benchmarks/transformers_release_trace.py): llama_h1024 4 x 512
+3.9 -> +0.01 %, LoRA r8 +7.1 -> +0.02 % (the 16-bit logits freed at the model's upcast, the
cache's 16-bit keys); a tiny Qwen2 without grouped kv heads within 0.13 %.

Agreement figures moved in session 16 (2026-11-28, 07:17 UTC; generic / analytic - 1): "fsdp2 4"
-3.5 -> +0.000 % and "zero-3 + optimizer offload" -2.3 -> +0.000 %, "zero-3 +
optimizer+params offload" +3.1 -> +0.5 % (Note [FSDP2 post-backward]: the layer's unsharded
gradients, its backward copy-out); "offload optimizer+gradients" -12.9 -> +0.8 % (Note
[torchao gradient offload]: each gradient freed in its hook, on both engines). FSDP1 (07:25
UTC): "accelerate-fsdp 4" -9.3 -> +0.000 % (Note [FSDP1 flat gradient of the root]: the root
unit's view gradients until its post-backward; the unshard pool's pending block after the first
backward layer's reduce-scatter); "accelerate-fsdp no-shard 4" and "1 gpu" -3.9 -> -0.007 %
(Note [FSDP1 NO_SHARD's 16-bit copy]: flat gradients, each unit's copy freed at its reshard);
"fsdp-qlora 4" -7.9 -> -0.16 %, with CPU offload -8.8 -> -0.18 % (Note [FSDP1 backward
prefetch under adapter units]); "accelerate-fsdp qlora 4" +5.1 -> -0.14 % (session 17): the
trace peaks in layer 1's forward at the down projection, bitsandbytes' dequantized weight beside
the layer's MLP tensors and the forward's unsaved temporaries (the residual stream, the norm's
output, the MLP's product, the projection's output, the layer's input, ``inputs_embeds``), which
the formulas now hold there too (Note [Forward tensors held at the down projection]);
"gptq-int4 base + lora" -2.3 -> +0.06 % (session 17): the formulas counted a 16-bit weight
gradient for the frozen down projection and dequantized at the layer's start (Note [An MLP's
backward, linear by linear]).
Full checkpointing over nf4 (session 17, cdc3cd4; sets "qlora nf4 + checkpointing full",
"accelerate-fsdp qlora 4 + checkpointing full"): -2.36 -> +0.00 % and +5.97 -> -0.16 %: a
frozen bitsandbytes 4-bit down projection runs its backward before transformers 5's
non-reentrant recompute, which peaks at the up projection (Note [A frozen 4-bit down projection
before the recompute], Note [The recompute's tensors held at the up projection]). fsdp_qlora's
train.py checkpoints reentrantly (now a set, session 21).
GPTQ under accelerate FSDP 4 with full checkpointing (session 17; sets "accelerate-fsdp gptq 4
+ checkpointing full", its bf16-true twin): +11.2 / +10.7 -> -0.04 / -0.07 %: the trace's GPTQ
backward now unpacks its packed tensors first, as ``QuantLinearFunction.backward`` does, so
the recompute runs before its input gradient exists; the formulas hold the forward's tensors
at the recomputed down projection (Note [The recompute's tensors held at the down projection]).
Unsloth (session 18; sets "unsloth lora", "unsloth qlora nf4"): refused -> +0.003 / +0.005 % on
the agreement model, run on the remote-code model, not applicable on the diffusers model (Note
[Unsloth on a traced step]: the traced state and optimizer step, the formulas' micro-batches).
QDoRA (session 19, helper qdora; sets "qdora nf4", "qdora int8"; refused by both engines
before): -0.29 % / +0.04 % vs analytic on the agreement model (its peak at layer 1's q_proj
weight norm, Note [Where DoRA's transients sit]); with DoRA on all seven linears (not a set:
the diffusers model has no gate) +0.47 %.
LoRA with fp8-mixed (session 19; set "lora fp8-mixed"): +17.3 -> +0.58 % (with full
checkpointing +19.5 -> +0.02 %): torchao's eager casts of each frozen fp32 base weight, two fp32
copies and the float8 weight beside the other operand's float8 copy, peak at the down
projection (Note [Float8 casts of a base weight]). Session 20 (helper fp8fsdp): +0.58 -> +0.33 %
(Note [Frozen float8 linears save their input], Note [Float8Linear under the traced autocast]);
outside the sets, under FSDP2 4 +4.35 -> -0.06 %.
Megatron (session 18, helper megatron; refused on the generic path before): "megatron" +0.198 %,
"megatron distributed optimizer 4" +0.371 % vs analytic (Note [Megatron on a traced step]);
not applicable on the diffusers model (Megatron's GPTModel is a decoder-only language model).
Session 19 (helper cells): "offload optimizer+gradients" +0.795 -> -0.001 % (Note [The LM head's
matmul backward]: the head's 16-bit weight gradient beside its fp32 cast, the fp32 loss gradient
freed first); no other set moved. Cells outside the sets, in tests/trace/test_generic_formula_
cells.py: a tied head under accumulation with autocast / HF Trainer +2.09 -> +0.00 %, DeepSpeed
ZeRO-2 +4.37 -> -0.01 % (Note [A tied gradient under DeepSpeed ZeRO-2/3]), DeepSpeed ZeRO-3
tied +4.35 -> +0.00 % and untied -4.96 -> +0.00 % (with Note [Traced ZeRO-3]'s gathers at the
traced modules).
Megatron with tensor parallelism (session 19, helper megatp; refused before): "megatron tensor
parallel 2" +0.98 %, "+ sp" +0.69 % (Note [Megatron's tensor parallelism on a traced step]);
"megatron pipeline 2" +0.31 % (Note [Megatron's last pipeline stage]).
Session 20 (helper hfreent): "llama-factory lora" +1.85 -> +0.000 %, "axolotl lora
checkpointed" -1.56 -> +0.000 % (Note [The recompute's tensors held at an autocast down
projection]: under autocast a recomputed LoRA layer peaks inside its recompute at the down
projection, reentrant or not; checked against a real CPU execution); no other set moved.
Megatron's fused RMSNorm (session 20, helper meganorm): the stand-in's norms run as a fused
kernel saving the input and the fp32 rstd, as the formulas now have it (Note [Megatron's fused
RMSNorm]): "megatron" +0.198 -> -0.006 %, "megatron distributed optimizer 4" +0.371 -> -0.012 %,
"megatron tensor parallel 2" +0.98 -> +0.089 %, "+ sp" +0.69 -> +0.598 %, "megatron pipeline 2"
+0.314 % (unchanged); "megatron tensor parallel 2 x dp 2" +0.128 % (refused before, +1.4 %).
Megatron's column-parallel linears under sequence parallelism (session 22, helper megsp2): they
save the sequence shard and gather it again in backward, as megatron-core's (Note [Megatron's
column-parallel linears save the shard]): "megatron tensor parallel 2 + sp" +0.598 -> +0.191 %
(2 x 1,024 tokens, outside the sets: +1.77 -> -0.04 %).
"fsdp-qlora 4 + checkpointing full" (new set; the trace already ran torch's reentrant
checkpoint): -4.31 -> -0.12 % (the formulas' reentrant recompute now peaks at down's
dequantization and the MLP's backward runs linear by linear; Note [The recompute's tensors held
at the down projection]).
QLoRA bf16-true under peft's fp32 upcast (session 22, helper qbf16; set "qlora nf4 bf16-true";
refused on the generic path before): the trace upcasts and casts each quantized linear's output
back to its fp32 input (checked against real bitsandbytes 0.50.2 on the CPU), the formulas'
activations fp32 (TrainingConfig.kbit_fp32_activations): nf4 +2.72 % vs analytic on the
agreement model (formulas 247.5 -> 308.3 MB). What is left is the formulas' gap at 32-true
QLoRA too (+2.56 %): the training KV cache's k / v copies at r = c under a repeated-kv SDPA, and
``inputs_embeds`` at the down projection, neither counted (see session notes). int8 and 4-bit
before bitsandbytes 0.43.2 (a saved 16-bit input cast per linear) stay refused.
Session 23 (helper kvcopy): "qlora nf4 bf16-true" +2.72 -> +0.001 % (32-true QLoRA, not a set,
+2.56 -> +0.001 %): the training KV cache's k / v copies counted where SDPA takes them repeated
at r = c too and made layer by layer at each attention (Note [The training KV cache's copies]),
``inputs_embeds`` held at the down projection under frozen embeddings.
Session 22 (helper misc22): the four fsdp-qlora sets are not applicable on the diffusers model
(Answer.AI's train.py loads AutoModelForCausalLM; the message names accelerate-fsdp); three had
run as if it applied, the checkpointed one failed inside torch's reentrant checkpoint.
Session 24 (helper diffpar): the diffusers model's last four refusals run ("pipeline 2", "lora
r16 + pipeline 2": torch's pipeline frontend cuts the denoiser at its blocks, Note [Tracing
pipeline parallelism of a denoiser]; "hsdp 4 / 2 + context parallel 2": torch's context
parallelism over the latents' rows, Note [Context parallelism of a denoiser]; "lora r16 +
tensor parallel 2": peft's adapters beside the block plan); the language models' rows of these
sets did not move.
Session 24 (helper timmpar): on timm:test_vit "checkpointing selective", "tensor parallel 2 +
sp" and "lora r16 + tensor parallel 2" run (Note [timm's transformer blocks]); "hsdp 4 / 2 +
context parallel 2" is refused at its 101 tokens, which 2 ranks do not divide (it runs at
--resolution 176; Note [Context parallelism of a ViT's tokens]); the pipeline sets stay refused.
Session 25 (helper timmcp): "hsdp 4 / 2 + context parallel 2" runs on timm:test_vit: its 101
tokens are padded to 102 (51 per rank) for the ring attention's equal chunks and trimmed after the
blocks (Note [Context parallelism of a ViT's tokens]); the estimate's notes say so.
Session 25 (helper timmpp): on timm:test_vit "pipeline 2" and "lora r16 + pipeline 2" run
(torch's pipeline frontend cuts the ViT before each stage's first block, as the denoiser's; Note
[Pipeline stages of a timm ViT]); 26.64 / 23.20 MB peak.
Session 27 (helper megapipe): Megatron's stage frees each sent output and receives per message
in both engines (Note [Megatron's pipeline stage buffers], Note [Megatron's stage buffers in the
trace]): "megatron pipeline 2" +0.314 -> +0.317 % (each engine -10.5 MB on stage 0).
Session 29 (helper pipes2): "attention eager" runs on the diffusers model (diffusers' own
eager AttnProcessor, Note [diffusers' eager attention]) and "loop keeps previous outputs" on
the diffusers and timm models (the previous prediction / logits as the traced step holds them,
Note [The previous output of a model without a ModelSpec]); an SD 1.x UNet
(tests/models/diffusers/tiny-sd1-unet.json) is a model of the table, with the pipeline's sets
"controlnet", "train text encoder", "frozen on gpu all", "vae tiling" (refused on the other
models by a SpecError naming the field).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from trainmem.errors import NotApplicableError
from trainmem.estimate import estimate, image_sequence
from trainmem.specs.training import TrainingConfig

MODELS = Path(__file__).resolve().parents[1] / "tests" / "models"
TARGETS: dict[str, Path | str] = {
    "formula (qwen2)": MODELS / "formula" / "qwen2.json",
    "remote code (qwen-7b)": MODELS / "remote_code" / "qwen-7b.json",
    "diffusers (pixart)": MODELS / "diffusers" / "tiny-pixart.json",
    "diffusers unet (sd1)": MODELS / "diffusers" / "tiny-sd1-unet.json",
}
if importlib.util.find_spec("timm") is not None:  # the optional extra (trainmem[vision])
    TARGETS["timm (test_vit)"] = "timm:test_vit"
AGREEMENT = MODELS / "agreement" / "llama_h2048.json"
AGREEMENT_SEQ_LEN = 256
_DP: dict[str, Any] = {"data_parallel_size": 4}
_QLORA: dict[str, Any] = {"lora_rank": 16, "quantize_base": "nf4"}
OPTION_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "precision bf16-true": {"precision": "bf16-true"},
    "precision 16-mixed": {"precision": "16-mixed"},
    "precision 32-true": {"precision": "32-true"},
    "optimizer sgd": {"optimizer": "sgd"},
    "optimizer adafactor": {"optimizer": "adafactor"},
    "optimizer lion": {"optimizer": "lion"},
    "optimizer adamw-8bit": {"optimizer": "adamw-8bit"},
    "optimizer paged-adamw-8bit": {"optimizer": "paged-adamw-8bit"},
    "optimizer fused": {"optimizer_implementation": "fused"},
    "checkpointing full": {"activation_checkpointing": "full"},
    "checkpointing selective": {"activation_checkpointing": "selective"},
    "gradient accumulation 4": {"gradient_accumulation_steps": 4},
    "earlier lengths 32,48": {"earlier_seq_lens": "32,48"},  # a step traced per length
    "lora r16": {"lora_rank": 16},
    "lora fp8-mixed": {"lora_rank": 16, "precision": "fp8-mixed"},
    "qlora nf4": {"lora_rank": 16, "quantize_base": "nf4"},
    "int8 base + lora": {"lora_rank": 16, "quantize_base": "int8"},
    "gptq-int4 base + lora": {"lora_rank": 16, "quantize_base": "gptq-int4"},
    # peft's prepare_model_for_kbit_training upcasts the rest of the bf16 model to fp32 and
    # bitsandbytes returns its fp32 input's dtype: fp32 layers (TrainingConfig.
    # kbit_fp32_activations; session 22, helper qbf16)
    "qlora nf4 bf16-true": {**_QLORA, "precision": "bf16-true"},
    # the rest of the base kept fp16 (transformers 4's load of a quantized base given no dtype)
    # under bf16 autocast, flash-attn keeping the fp16 stream (session 29, helper quant29)
    "qlora nf4 fp16 rest flash": {
        **_QLORA,
        "prepare_kbit_training": False,
        "load_dtype": "float16",
        "attention": "flash",
    },
    "qdora nf4": {**_QLORA, "lora_variant": "dora"},
    "qdora int8": {"lora_rank": 16, "quantize_base": "int8", "lora_variant": "dora"},
    # torchao converts the adapters, not GPTQ's QuantLinear (Note [Tracing float8])
    "gptq-int4 base + lora fp8-mixed": {
        "lora_rank": 16,
        "quantize_base": "gptq-int4",
        "precision": "fp8-mixed",
    },
    "qlora nf4-dq bitsandbytes 0.42": {
        "lora_rank": 16,
        "quantize_base": "nf4-dq",
        "bitsandbytes_version": "0.42.0",
    },
    "optimizer paged-adamw": {"optimizer": "paged-adamw"},
    "ddp 4": {**_DP},
    "ddp 4 hf-trainer": {**_DP, "framework": "hf-trainer"},
    "offload optimizer": {"offload": "optimizer"},
    "offload optimizer+gradients": {"offload": "optimizer+gradients"},
    "zero-1 deepspeed": {**_DP, "zero_stage": 1, "framework": "deepspeed"},
    "zero-2 deepspeed": {**_DP, "zero_stage": 2, "framework": "deepspeed"},
    "zero-3 deepspeed": {**_DP, "zero_stage": 3, "framework": "deepspeed"},
    "lora + zero-2 deepspeed": {**_DP, "zero_stage": 2, "framework": "deepspeed", "lora_rank": 16},
    "qlora nf4 + zero-2 deepspeed": {
        **_DP,
        "zero_stage": 2,
        "framework": "deepspeed",
        "lora_rank": 16,
        "quantize_base": "nf4",
    },
    "fsdp2 4": {**_DP, "zero_stage": 3, "framework": "fsdp2"},
    "accelerate-fsdp 4": {**_DP, "zero_stage": 3, "framework": "accelerate-fsdp"},
    "accelerate-fsdp no-shard 4": {**_DP, "framework": "accelerate-fsdp"},  # --fsdp no-shard
    "accelerate-fsdp 1 gpu": {"zero_stage": 3, "framework": "accelerate-fsdp"},
    "fsdp-qlora 4": {**_DP, "zero_stage": 3, "framework": "fsdp-qlora", **_QLORA},
    "fsdp-qlora 1 gpu": {"zero_stage": 3, "framework": "fsdp-qlora", **_QLORA},
    # train.py's reentrant checkpointing (--reentrant_checkpointing true), on both engines:
    # Note [The recompute's tensors held at the down projection]
    "fsdp-qlora 4 + checkpointing full": {
        **_DP,
        "zero_stage": 3,
        "framework": "fsdp-qlora",
        **_QLORA,
        "activation_checkpointing": "full",
    },
    # fsdp_qlora's default --use_cpu_offload (FSDP1 CPUOffload(offload_params=True))
    "fsdp-qlora 4 + cpu offload": {
        **_DP,
        "zero_stage": 3,
        "framework": "fsdp-qlora",
        **_QLORA,
        "offload": "optimizer+params",
    },
    # transformers' FSDP-QLoRA: the model and bnb_4bit_quant_storage in bf16
    "accelerate-fsdp qlora 4": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        **_QLORA,
        "precision": "bf16-true",
    },
    # fms-acceleration's runs: the model loaded in bf16 (--bf16) / fp16 (GPTQ) under autocast,
    # the 4-bit codes stored in it; GPTQ's qweight / qzeros viewed as fp16 Parameters
    "accelerate-fsdp qlora 4 bf16-mixed": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        **_QLORA,
    },
    "accelerate-fsdp gptq 4": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        "lora_rank": 16,
        "quantize_base": "gptq-int4",
        "precision": "16-mixed",
    },
    # full checkpointing over a frozen 4-bit down projection (transformers 5: non-reentrant):
    # its backward runs before the recompute (Note [A frozen 4-bit down projection before the
    # recompute], Note [The recompute's tensors held at the up projection])
    "qlora nf4 + checkpointing full": {**_QLORA, "activation_checkpointing": "full"},
    "accelerate-fsdp qlora 4 + checkpointing full": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        **_QLORA,
        "precision": "bf16-true",
        "activation_checkpointing": "full",
    },
    # GPTQ under full checkpointing: its backward unpacks its packed tensors first, so the
    # recompute runs through down's forward (Note [The recompute's tensors held at the down
    # projection])
    "accelerate-fsdp gptq 4 + checkpointing full": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        "lora_rank": 16,
        "quantize_base": "gptq-int4",
        "precision": "16-mixed",
        "activation_checkpointing": "full",
    },
    "accelerate-fsdp gptq 4 bf16-true + checkpointing full": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        "lora_rank": 16,
        "quantize_base": "gptq-int4",
        "precision": "bf16-true",
        "activation_checkpointing": "full",
    },
    "zero-3 + optimizer offload": {**_DP, "zero_stage": 3, "offload": "optimizer"},
    "zero-3 + optimizer+params offload": {**_DP, "zero_stage": 3, "offload": "optimizer+params"},
    "zero-2 deepspeed + offload": {
        **_DP,
        "zero_stage": 2,
        "framework": "deepspeed",
        "offload": "optimizer",
    },
    # Megatron-LM: the transformers layers stand in for its GPTModel; its loss, fp32 gradient
    # buffer and (distributed) optimizer applied (Note [Megatron on a traced step])
    "megatron": {"framework": "megatron"},
    "megatron distributed optimizer 4": {**_DP, "zero_stage": 1, "framework": "megatron"},
    "megatron tensor parallel 2": {"tensor_parallel_size": 2, "framework": "megatron"},
    "megatron tensor parallel 2 + sp": {
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "framework": "megatron",
    },
    "megatron tensor parallel 2 x dp 2": {
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "zero_stage": 1,
        "framework": "megatron",
    },
    "megatron pipeline 2": {
        "pipeline_parallel_size": 2,
        "gradient_accumulation_steps": 4,
        "framework": "megatron",
    },
    "hf-trainer": {"framework": "hf-trainer"},
    # LLaMA-Factory's defaults: reentrant full checkpointing, LoRA on every linear; axolotl's:
    # adamw_torch_fused, reentrant checkpointing when on (FRAMEWORK_CONVENTIONS rows). Session
    # 19: +1.85 % / -1.56 %, exactly hf-trainer's given the same settings; session 20: +0.000 %
    # both (Note [The recompute's tensors held at an autocast down projection])
    "llama-factory lora": {"framework": "llama-factory", "lora_rank": 16},
    "axolotl lora checkpointed": {
        "framework": "axolotl",
        "lora_rank": 16,
        "activation_checkpointing": "full",
    },
    "torchtune": {"framework": "torchtune", "precision": "bf16-true"},  # no autocast in torchtune
    # session 24: TRL's SFTTrainer (helper trl26) and a model loaded in 16 bits under the
    # loop's autocast (helper autocast16)
    "trl": {"framework": "trl"},
    "load-dtype bfloat16": {"load_dtype": "bfloat16"},
    "lora r16 + load-dtype bfloat16": {"lora_rank": 16, "load_dtype": "bfloat16"},
    # session 25: peft's modules_to_save, the embedding and head trained beside LoRA (helper
    # modsave)
    "lora r16 + modules to save": {
        "lora_rank": 16,
        "lora_modules_to_save": ("embed_tokens", "lm_head"),
    },
    "litgpt": {"framework": "litgpt"},
    # Unsloth's defaults: bf16, fp32 adapters on all seven linears, adamw-8bit, its offloaded
    # checkpoint (plain full checkpointing below 512 tokens); Note [Unsloth on a traced step]
    "unsloth lora": {"framework": "unsloth", "lora_rank": 16},
    "unsloth qlora nf4": {"framework": "unsloth", "lora_rank": 16, "quantize_base": "nf4"},
    "tensor parallel 2 + sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    # HSDP beside CP: a shard group of 2 = the 2 context ranks, 4 replicas (torchtitan's mesh)
    "hsdp 4 / 2 + context parallel 2": {
        **_DP,
        "zero_stage": 3,
        "shard_group_size": 2,
        "context_parallel_size": 2,
    },
    "pipeline 2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4},
    # peft's adapters sharded as under transformers' TP plan (no sequence parallelism)
    "lora r16 + tensor parallel 2": {"lora_rank": 16, "tensor_parallel_size": 2},
    "lora r16 + pipeline 2": {
        "lora_rank": 16,
        "pipeline_parallel_size": 2,
        "gradient_accumulation_steps": 4,
    },
    "compile": {"compile": True},
    "optimizer in backward": {"optimizer_in_backward": True},
    "activation offloading": {"activation_offloading": True, "activation_checkpointing": "full"},
    "chunked cross-entropy 8": {"chunked_cross_entropy": 8},
    # axolotl's CutCrossEntropyPlugin (trainmem/trace/cut_loss.py)
    "cut cross-entropy": {"cut_cross_entropy": True},
    "keep logits": {"keep_logits": True},
    "keep logits + chunked cross-entropy 8": {"keep_logits": True, "chunked_cross_entropy": 8},
    "zero_grad keeps gradients": {"zero_grad_set_to_none": False},
    "ema": {"ema": True},
    "loss logits-sum": {"loss": "logits-sum"},
    "padding mask": {"padding_mask": True},
    # another transformers / litgpt release than the installed one (issue 26, session 27):
    # the installed code traced and the release's differences applied (traced_releases.py)
    "transformers 4.40": {"transformers_version": "4.40.0"},
    "litgpt 0.4.0": {"framework": "litgpt", "litgpt_version": "0.4.0"},
    # session 27 (helper matrix): one set per option of `trainmem estimate --help` no set used
    # (tests/benchmarks/test_generic_options_matrix.py checks every option has one)
    "lora loha": {"lora_rank": 16, "lora_variant": "loha"},
    "lora dropout 0.1": {"lora_rank": 16, "lora_dropout": 0.1},
    "lora r16 on q,v": {"lora_rank": 16, "lora_targets": ("q", "v")},
    "lora adapter dtype bfloat16": {"lora_rank": 16, "lora_adapter_dtype": "bfloat16"},
    "prefix tuning": {"num_virtual_tokens": 8},
    "prefix tuning + projection": {"num_virtual_tokens": 8, "prefix_projection": True},
    "p-tuning": {"num_virtual_tokens": 8, "prompt_learning": "p-tuning"},
    "prompt tuning": {"num_virtual_tokens": 8, "prompt_learning": "prompt-tuning"},
    # session 28 (helper prompt2): prompt learning under DDP / ZeRO / FSDP (the prompt encoder
    # in the state layout, trainmem/analytic/prompt_encoder.py)
    "prefix tuning + ddp": {**_DP, "num_virtual_tokens": 8},
    "prefix tuning + zero-3 deepspeed": {
        **_DP,
        "zero_stage": 3,
        "framework": "deepspeed",
        "num_virtual_tokens": 8,
    },
    "p-tuning + fsdp2": {
        **_DP,
        "zero_stage": 3,
        "framework": "fsdp2",
        "num_virtual_tokens": 8,
        "prompt_learning": "p-tuning",
    },
    # session 29 (helper prompt3): and with CPU offload (peft under DeepSpeed's offload)
    "prefix tuning + zero-2 offload": {
        **_DP,
        "zero_stage": 2,
        "framework": "deepspeed",
        "offload": "optimizer",
        "num_virtual_tokens": 8,
    },
    # diffusers' layerwise casting needs LoRA (the cast weights are frozen)
    "layerwise casting fp8 e4m3": {"lora_rank": 16, "layerwise_casting": "float8_e4m3fn"},
    # session 29 (helper pipes2): a diffusers pipeline's options, for the SD UNet kind
    "controlnet": {"controlnet": True},
    "train text encoder": {"train_text_encoder": True},
    "frozen on gpu all": {"frozen_on_gpu": "all"},
    "vae tiling": {"frozen_on_gpu": "vae", "vae_tiling": True},
    "attention eager": {"attention": "eager"},
    "dropout off": {"dropout": False},
    "zero_grad before backward": {"zero_grad_before_backward": True},
    "loop keeps previous outputs": {"loop": "previous"},
    "ema bfloat16": {"ema": True, "ema_dtype": "bfloat16"},
    "ema on cpu": {"ema": True, "ema_device": "cpu"},
    "pipeline 2 gpipe": {
        "pipeline_parallel_size": 2,
        "gradient_accumulation_steps": 4,
        "pipeline_schedule": "gpipe",
    },
    "ddp 4 + nccl buffer 64 MiB": {**_DP, "nccl_buffer_bytes": 64 << 20},
    "sample lengths alpaca-cleaned": {"sample_lengths": "alpaca-cleaned"},
    "sample lengths, long samples deleted": {
        "sample_lengths": "alpaca-cleaned",
        "long_samples": "delete",
    },
    "torch 2.4.0": {"torch_version": "2.4.0"},
    "torchao 0.5.0 + lora fp8-mixed": {
        "lora_rank": 16,
        "precision": "fp8-mixed",
        "torchao_version": "0.5.0",
    },
    "torchtune 0.3.0": {
        "framework": "torchtune",
        "precision": "bf16-true",
        "torchtune_version": "0.3.0",
    },
    "fsdp2 4 torchtitan 0.1.0": {
        **_DP,
        "zero_stage": 3,
        "framework": "fsdp2",
        "torchtitan_version": "0.1.0",
    },
    "unsloth 2024.8 lora": {"framework": "unsloth", "lora_rank": 16, "unsloth_version": "2024.8"},
    "zero-2 deepspeed 0.14.0": {
        **_DP,
        "zero_stage": 2,
        "framework": "deepspeed",
        "deepspeed_version": "0.14.0",
    },
    "trl 0.9.0": {"framework": "trl", "trl_version": "0.9.0"},
    "fsdp 4 accelerate 0.27.0": {
        **_DP,
        "zero_stage": 3,
        "framework": "accelerate-fsdp",
        "accelerate_version": "0.27.0",
    },
}


def _run(
    target: Path | str, settings: dict[str, Any], engine: str, seq_len: int = 64
) -> tuple[str, int]:
    try:
        training = TrainingConfig(micro_batch_size=2, seq_len=seq_len, **settings)
        # an image model (timm) takes no seq_len: the default, as if none were given
        training = image_sequence(str(target), training, given=False)
        est = estimate(str(target), training, engine=engine, simulate_allocator=False)
    except NotApplicableError as exc:  # not a gap: the option means nothing for this model
        return " ".join(f"n/a: {exc}".split())[:110], 0
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:110], 0
    return "ok", est.breakdown.allocated_bytes


def agreement(settings: dict[str, Any]) -> float | None:
    """Generic path vs formulas on the agreement model, peak allocated (generic / analytic - 1),
    or None where either engine refuses the option set there."""
    outcomes = [_run(AGREEMENT, settings, e, AGREEMENT_SEQ_LEN) for e in ("generic", "analytic")]
    (g_outcome, generic), (a_outcome, analytic) = outcomes
    if g_outcome != "ok" or a_outcome != "ok":
        return None
    return generic / analytic - 1


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The table's lines from the rows of one or more runs: per model, the sets run end to end,
    not applicable and refused; then generic vs analytic on the agreement model where both ran
    (its range and any set outside 1 %), and every refusal."""
    lines = []
    for label in dict.fromkeys(row["model"] for row in rows):
        outcomes = [row["outcome"] for row in rows if row["model"] == label]
        n, na = outcomes.count("ok"), sum(o.startswith("n/a:") for o in outcomes)
        lines.append(
            f"== {label}: {n} of {len(outcomes)} option sets run on the generic path, {na} not "
            f"applicable, {len(outcomes) - n - na} refused"
        )
    gaps = {
        row["options"]: row["generic_vs_analytic_pct"]
        for row in rows
        if "generic_vs_analytic_pct" in row
    }
    if gaps:
        low, high = min(gaps, key=gaps.__getitem__), max(gaps, key=gaps.__getitem__)
        lines.append(
            f"== generic vs analytic on the agreement model: {len(gaps)} sets, from "
            f"{gaps[low]:+.3f} % ({low}) to {gaps[high]:+.3f} % ({high}); outside 1 %: "
            + (", ".join(f"{k} {v:+.3f} %" for k, v in gaps.items() if abs(v) > 1) or "none")
        )
    for row in rows:
        if row["outcome"] != "ok" and not row["outcome"].startswith("n/a:"):
            lines.append(f"== refused: {row['options']} on {row['model']}: {row['outcome']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="rows, written after each cell")
    parser.add_argument("--sets", default="", help="only the option sets matching this regex")
    parser.add_argument("--models", default="", help="only the models matching this regex")
    parser.add_argument(
        "--summary", type=Path, nargs="+", default=None, help="print the table of --json files"
    )
    args = parser.parse_args(argv)
    if args.summary:  # the runs of one table split across processes (by --sets / --models)
        print("\n".join(summary([row for f in args.summary for row in json.loads(f.read_text())])))
        return 0
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    rows: list[dict[str, Any]] = []
    sets = {k: v for k, v in OPTION_SETS.items() if re.search(args.sets, k)}
    targets = {k: v for k, v in TARGETS.items() if re.search(args.models, k)}
    for name, settings in sets.items():
        for label, target in targets.items():
            outcome, _ = _run(target, settings, "generic")
            row: dict[str, Any] = {"options": name, "model": label, "outcome": outcome}
            if outcome == "ok" and label.startswith("formula"):
                gap = agreement(settings)
                if gap is not None:
                    row["generic_vs_analytic_pct"] = round(100 * gap, 3)
            rows.append(row)
            if args.json:  # a run stopped early keeps the rows it has
                args.json.write_text(json.dumps(rows, indent=1))
            extra = (
                f" ({row['generic_vs_analytic_pct']:+.3f}% vs analytic)"
                if "generic_vs_analytic_pct" in row
                else ""
            )
            print(f"{name:28} {label:22} {outcome}{extra}", flush=True)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
