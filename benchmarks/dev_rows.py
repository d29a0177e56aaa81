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
    base = {"seq_len": 512, "attention": "eager", "optimizer_implementation": "for-loop"}
    return {**BERT_SEQ_CLS, **LEGACY, "training": {**base, **training}}


def _gpt2(preset: str, **training: Any) -> dict[str, Any]:
    base = {"seq_len": 1024, "attention": "eager", "optimizer_implementation": "for-loop"}
    return {"preset": preset, **LEGACY, "training": {**base, **training}}


_NEEDS_PEFT = "needs LoRA / QLoRA / adapters (issue 8: parameter-efficient fine-tuning)"
_NEEDS_FSDP = "needs FSDP sharding with LoRA (issue 8)"

ROWS: dict[str, dict[str, Any] | str] = {
    "GT001": _bert(micro_batch_size=4, precision="32-true", optimizer="adamw"),
    "GT002": _bert(micro_batch_size=1, gradient_accumulation_steps=4, precision="32-true",
                   optimizer="adamw"),
    "GT003": _bert(micro_batch_size=1, gradient_accumulation_steps=4, precision="32-true",
                   optimizer="adamw", activation_checkpointing="full"),
    "GT004": _bert(micro_batch_size=4, precision="16-mixed", optimizer="adamw"),
    "GT005": _bert(micro_batch_size=1, gradient_accumulation_steps=4, precision="16-mixed",
                   optimizer="adamw", activation_checkpointing="full"),
    "GT006": _bert(micro_batch_size=4, precision="32-true", optimizer="adafactor"),
    "GT007": _bert(micro_batch_size=1, gradient_accumulation_steps=4, precision="16-mixed",
                   optimizer="adafactor", activation_checkpointing="full"),
    "GT008": _bert(micro_batch_size=4, precision="32-true", optimizer="adamw-8bit"),
    "GT009": _bert(micro_batch_size=1, gradient_accumulation_steps=4, precision="16-mixed",
                   optimizer="adamw-8bit", activation_checkpointing="full"),
    "GT071": _gpt2("gpt2", micro_batch_size=8, precision="32-true"),
    "GT072": _gpt2("gpt2", micro_batch_size=1, precision="32-true"),
    "GT073": _gpt2("gpt2-medium", micro_batch_size=1, precision="32-true"),
    "GT074": _gpt2("gpt2", micro_batch_size=1, precision="16-mixed"),
    "GT075": _gpt2("gpt2", micro_batch_size=8, precision="16-mixed"),
    **{f"GT0{i}": _NEEDS_PEFT for i in range(76, 92)},
    **{f"GT0{i}": _NEEDS_FSDP for i in range(92, 96)},
    "GT096": _NEEDS_PEFT,
}
