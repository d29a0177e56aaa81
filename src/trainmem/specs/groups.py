"""The training settings grouped by concern, for the CLI help and the web form."""

from __future__ import annotations

FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "Batch and sequence": (
        "micro_batch_size",
        "seq_len",
        "target_seq_len",
        "gradient_accumulation_steps",
        "chunked_cross_entropy",
        "loss",
        "keep_logits",
        "loop",
    ),
    "Precision and optimizer": (
        "precision",
        "optimizer",
        "optimizer_implementation",
        "zero_grad_set_to_none",
        "zero_grad_before_backward",
        "optimizer_in_backward",
        "ema",
        "ema_dtype",
        "ema_device",
    ),
    "Checkpointing and attention": (
        "activation_checkpointing",
        "attention",
        "dropout",
        "activation_offloading",
        "compile",
        "padding_mask",
    ),
    "Parallelism and sharding": (
        "data_parallel_size",
        "zero_stage",
        "offload",
        "tensor_parallel_size",
        "sequence_parallel",
        "pipeline_parallel_size",
        "pipeline_schedule",
        "virtual_pipeline_stages",
        "context_parallel_size",
        "shard_group_size",
        "reshard_after_forward",
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "overlap_comm",
        "nccl_buffer_bytes",
    ),
    "LoRA / QLoRA": (
        "lora_rank",
        "lora_targets",
        "lora_dropout",
        "lora_variant",
        "quantize_base",
        "prepare_kbit_training",
    ),
    "Framework": (
        "framework",
        "torch_version",
        "transformers_version",
        "bitsandbytes_version",
        "torchao_version",
        "deepspeed_version",
        "load_phase",
        "grad_accum_dtype",
    ),
    "Diffusion models (diffusers configs)": (
        "resolution",
        "frames",
        "text_seq_len",
        "frozen_on_gpu",
    ),
}
"""Every TrainingConfig field by concern: the web page's option groups and the panels of the
CLI's ``--help`` (one source of both)."""
