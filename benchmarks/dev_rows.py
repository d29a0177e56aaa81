"""How each row of ``shared/validation/dev_measurements.csv`` is expressed as a trainmem run.

One entry per row id: either the settings (model, TrainingConfig fields, the metric to compare,
the CUDA context of the row's era) or the reason it cannot be expressed yet. Settings come from
the row's own columns and notes, never from tuning.

Era facts used (cited in ``trainmem.specs.hardware``): torch < 1.13 had no CUDA lazy loading,
so the context is the measured 1343 MiB (LEGACY_CUDA_CONTEXT_BYTES) for the 2022 HF Trainer
and GPT-2 blog rows; the HF Trainer's default ``adamw_hf`` and 2022 torch optimizers are
per-parameter loops (``for-loop``); transformers' Adafactor is factored.
"""

from __future__ import annotations

from typing import Any

from trainmem.specs.hardware import LEGACY_CUDA_CONTEXT_BYTES

BERT_SEQ_CLS = {
    "preset": "bert-large-uncased",
    # BertForSequenceClassification with 2 labels (the row's model column)
    "config_overrides": {"architectures": ["BertForSequenceClassification"], "num_labels": 2},
}
LEGACY = {"cuda_context_bytes": LEGACY_CUDA_CONTEXT_BYTES, "metric": "device_total"}


def _bert(**training: Any) -> dict[str, Any]:
    # torch ~1.10 (the row's framework column): per-parameter loop optimizers, no
    # torch.optim.Adafactor (transformers' runs), and the HF Trainer 4.21's
    # ``model.zero_grad()`` after each step zeroes the gradients but keeps them allocated
    # (set_to_none=False before 2.0: the default for the release, Note [zero_grad's default
    # by release] in trainmem/specs/frameworks.py).
    base = {"seq_len": 512, "attention": "eager", "torch_version": "1.10"}
    return {**BERT_SEQ_CLS, **LEGACY, "training": {**base, **training}}


def _gpt2(preset: str, **training: Any) -> dict[str, Any]:
    base = {"seq_len": 1024, "attention": "eager", "optimizer_implementation": "for-loop"}
    return {"preset": preset, **LEGACY, "training": {**base, **training}}


def _litgpt(preset: str, b: int, s: int, **kw: Any) -> dict[str, Any]:
    """lit-gpt finetune/lora.py @8641822: LoRA r=8 on query and value, dropout 0.05,
    bf16-true unless told, SDPA, torch AdamW with per-parameter loops (``foreach`` default on
    CUDA in torch 2.1; the LoRA parameters are tiny either way), max_memory_allocated.
    The row's framework column is lit-gpt: its own model code and Fabric's output cast
    (``framework="litgpt"``) and its LM head / loss in chunks of 128 tokens
    (``lm_head_chunk_size=128``, ``chunked_cross_entropy``). The rows' source names
    bitsandbytes 0.41.1, whose ``MatMul4Bit`` still saved its input. Its loop keeps ``logits``
    and ``loss`` from one iteration to the next (loop ``previous``), but the measured peak is
    the first iteration, where nothing is held yet: ``get_batch(fabric, train_data,
    longest_seq_ix if iter_num == 0 else None)`` puts the longest sample (the row's length)
    first ("so potential OOMs happen right away") and later batches are shorter, so the loop at
    the peak is ``drop``."""
    training = {
        "loop": "drop",
        "micro_batch_size": b,
        "seq_len": s,
        "precision": "bf16-true",
        "bitsandbytes_version": "0.41.1",
        "attention": "sdpa",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "lora_dropout": 0.05,
        "framework": "litgpt",
        "chunked_cross_entropy": -(-s // 128),
        # lit-gpt @8641822's setup.py says 0.1.0: its multi-GPU lora.py wraps each Block as an
        # FSDP1 unit (frozen weights in the adapters' flat parameter), which litgpt 0.5.8+ does
        # not (LITGPT_LORA_LINEAR_UNITS_SINCE)
        "litgpt_version": "0.1.0",
        **kw,
    }
    return {"preset": preset, "metric": "allocated", "training": training}


_ADAPTER = "LLaMA-Adapter (prefix adapters) is not modelled; only LoRA / QLoRA"


def _litgpt_fsdp(n_gpus: int, b: int) -> dict[str, Any]:
    """lit-gpt finetune/lora.py on n GPUs: FSDPStrategy(auto_wrap_policy={Block},
    activation_checkpointing_policy={Block}, full shard), ``batch_size = 128``,
    ``gradient_accumulation_iters = batch_size // micro_batch_size``, the accumulating
    micro-batches under ``fabric.no_backward_sync`` (FSDP ``no_sync()``)."""
    return {
        "data_parallel_size": n_gpus,
        "zero_stage": 3,
        "activation_checkpointing": "full",
        "gradient_accumulation_steps": 128 // b,
    }


ROWS: dict[str, dict[str, Any] | str] = {
    "GT001": _bert(micro_batch_size=4, precision="32-true", optimizer="adamw"),
    "GT002": _bert(
        micro_batch_size=1, gradient_accumulation_steps=4, precision="32-true", optimizer="adamw"
    ),
    "GT003": _bert(
        micro_batch_size=1,
        gradient_accumulation_steps=4,
        precision="32-true",
        optimizer="adamw",
        activation_checkpointing="full",
    ),
    "GT004": _bert(micro_batch_size=4, precision="16-mixed", optimizer="adamw"),
    "GT005": _bert(
        micro_batch_size=1,
        gradient_accumulation_steps=4,
        precision="16-mixed",
        optimizer="adamw",
        activation_checkpointing="full",
    ),
    "GT006": _bert(micro_batch_size=4, precision="32-true", optimizer="adafactor"),
    "GT007": _bert(
        micro_batch_size=1,
        gradient_accumulation_steps=4,
        precision="16-mixed",
        optimizer="adafactor",
        activation_checkpointing="full",
    ),
    "GT008": _bert(micro_batch_size=4, precision="32-true", optimizer="adamw-8bit"),
    "GT009": _bert(
        micro_batch_size=1,
        gradient_accumulation_steps=4,
        precision="16-mixed",
        optimizer="adamw-8bit",
        activation_checkpointing="full",
    ),
    "GT071": _gpt2("gpt2", micro_batch_size=8, precision="32-true"),
    "GT072": _gpt2("gpt2", micro_batch_size=1, precision="32-true"),
    "GT073": _gpt2("gpt2-medium", micro_batch_size=1, precision="32-true"),
    "GT074": _gpt2("gpt2", micro_batch_size=1, precision="16-mixed"),
    "GT075": _gpt2("gpt2", micro_batch_size=8, precision="16-mixed"),
    "GT076": _litgpt("phi-1.5", 1, 1044),
    "GT077": _litgpt("phi-1.5", 1, 1044, quantize_base="nf4"),
    "GT078": _litgpt("phi-1.5", 2, 1044),
    "GT079": _litgpt("phi-1.5", 4, 1044),
    "GT080": _litgpt("stablelm-base-alpha-3b", 1, 1034),
    "GT081": _litgpt("stablelm-base-alpha-3b", 1, 1034, quantize_base="nf4"),
    "GT082": _litgpt("stablelm-base-alpha-3b", 2, 1034),
    "GT083": _litgpt("stablelm-base-alpha-3b", 4, 1034),
    "GT084": _litgpt("llama-2-7b", 1, 1304),
    "GT085": _litgpt("llama-2-7b", 1, 1304, quantize_base="nf4"),
    "GT086": _litgpt("llama-2-7b", 1, 1304, quantize_base="nf4-dq"),
    "GT087": _litgpt("llama-2-7b", 2, 1304),
    "GT088": _litgpt("llama-2-13b", 1, 1304),
    "GT089": _litgpt("llama-2-13b", 1, 1304, quantize_base="nf4"),
    "GT090": _ADAPTER,
    "GT091": _ADAPTER,
    # GT092-GT095: lit-gpt LoRA with FSDP (full shard, Block wrapping and checkpointing), scored
    # as the sharded step. The measured peak grows with the micro-batch (GT092 b=1 22.18 GB ->
    # GT093 b=4 23.39 GB), so the step sets it; the copy of the layers each rank holds is FSDP1's
    # flat-parameter gradient (frozen base weights included, use_orig_params=True) kept
    # unsharded under no_sync while lit-gpt accumulates 128 // b micro-batches (issue 17; Note
    # [FSDP gradient accumulation under no_sync] in src/trainmem/analytic/schedule.py).
    "GT092": _litgpt("llama-2-7b", 1, 1304, **_litgpt_fsdp(2, 1)),
    "GT093": _litgpt("llama-2-7b", 4, 1304, **_litgpt_fsdp(2, 4)),
    "GT094": _litgpt("llama-2-13b", 1, 1304, **_litgpt_fsdp(4, 1)),
    "GT095": _litgpt("phi-1.5", 4, 1044, **_litgpt_fsdp(2, 4)),
    "GT096": _litgpt("stablelm-base-alpha-3b", 1, 1034, precision="bf16-mixed"),
}
