"""Dev set 2 (``shared/validation/dev_measurements_2*``): where the source says more than the
jsonl's reading, and the named cause of each row trainmem misses.

``AMENDMENTS``: flags added to a row's ``trainmem estimate`` arguments because the row's own
source says so (the validation README: "the arguments are a reading, not the truth: where the
source says something else, the source wins"). Each names the source it follows; a row is never
amended to move its error, and ``benchmarks/validate.py`` reports the as-read figures beside.

``CONFIG_AMENDMENTS``: likewise, config.json keys (a derived config is written for the run).

``CAUSES``: for rows with |error| > 5% or a predicted OOM for a run that completed, the
mechanism read from the row's notes and source ("likely" where it is inferred, not traced);
``validate.py`` prints "unexplained" for a row not named here. A cause names a mechanism, never
a fitted constant.
"""

from __future__ import annotations

_FSDP_QLORA = (
    ["--framework", "fsdp-qlora"],
    "Answer.AI fsdp_qlora train.py (e4968fd, Mar 2024), the rows' source: no "
    "prepare_model_for_kbit_training (16-bit embeddings, norms, residual stream), adapters in "
    "the base weight's dtype (peft 0.10 update_layer, bf16 quant_storage), FSDP1 "
    "use_orig_params=False; the reading had no --framework value for it",
)

_FSDP_QLORA_BNB = (
    [*_FSDP_QLORA[0], "--quantize-base", "nf4-dq", "--bitsandbytes-version", "0.43.0"],
    _FSDP_QLORA[1] + "; train.py (50efa1e .. 4cd6923, the benchmarks' span) builds "
    "Linear4bit(in, out, bias, compute_dtype=..., quant_type='nf4', quant_storage=...) "
    "without compress_statistics, and bitsandbytes 0.43.0 Linear4bit defaults to "
    "compress_statistics=True (double quantization); its README asks for bitsandbytes>=0.43.0 "
    "(released 2024-03-08; the 3090 runs are March 2024, benchmarks_03_2024.md; 0.43.2, "
    "whose MatMul4Bit no longer keeps its input, is of 2024-07-23); so --bitsandbytes-version "
    "0.43.0: the README's `pip install bitsandbytes>=0.43.0` (47c1722, 2024-03-07; before it, "
    "Answer.AI's cuda_fix_quant_storage_dtype branch of the same code), and benchmarks_03_2024.md "
    "says 'done in February and March 2024', before 0.43.1 (2024-04-11) and before the "
    "MatMul4Bit change (bitsandbytes 9e753741, PR #1270, 2024-07-16: ctx.tensors = (None, B); "
    "earlier (A, B), the 16-bit input kept)",
)

_PEFT_SFT_QLORA = (
    ["--quantize-base", "nf4-dq", "--lora-dropout", "0.1"],
    "peft examples/sft/run_peft_qlora_fsdp.sh and run_peft_qlora_deepspeed_stage3.sh, the "
    "rows' scripts: --use_nested_quant True (double quantization; the CSV's precision column: "
    "'NF4 double-quant') and --lora_dropout 0.1; the docs' memory sections come with peft "
    "PR #1550 (2024-03-13, 'Changes to support fsdp+qlora and dsz3+qlora'), which needs "
    "bitsandbytes 0.43.0's quant_storage (released 2024-03-08; 0.43.1 is of 2024-04-11, "
    "both before 0.43.2's MatMul4Bit change)",
)

_PEFT_SFT_QLORA_FSDP = (
    [*_PEFT_SFT_QLORA[0], "--set", "checkpoint-reentrant=true", "--transformers-version", "4.39"],
    _PEFT_SFT_QLORA[1] + "; run_peft_qlora_fsdp.sh passes --use_reentrant True and train.py "
    '(6008f272a) sets training_args.gradient_checkpointing_kwargs = {"use_reentrant": '
    "model_args.use_reentrant} (transformers' reentrant checkpoint); examples/sft/"
    "requirements.txt installs transformers from git main, which on the PR's date (2024-03-13) "
    "was 4.39.0.dev0, the release line whose trainer.py first has _fsdp_qlora_plugin_updates "
    "(4.39.0, 2024-03-21; 4.40.0 came 2024-04-18: no trainmem rule tells 4.39 from 4.40): a "
    "release whose LlamaModel.forward checkpoints the FSDP1-wrapped decoder layer, before "
    "4.52's GradientCheckpointingLayer",
)

_PEFT_SFT_LORA = (
    ["--lora-dropout", "0.1"],
    "peft examples/sft/run_peft_fsdp.sh (aa2ca83c, 2024-02-26) and run_peft_deepspeed.sh, the "
    "rows' scripts: --lora_dropout 0.1",
)
_PEFT_SFT_H100 = (
    [*_PEFT_SFT_LORA[0], "--gpu", "H100-80GB"],
    _PEFT_SFT_LORA[1] + "; the rows' GPU (the CSV's gpu column: H100 80GB; peft docs/source/"
    "accelerate/fsdp.md: '8X80GB GPUs with FSDP+LoRA'): the reading named none, so the replay "
    "ran without the card's capacity",
)

_PHILSCHMID_DQ = (
    [
        "--quantize-base",
        "nf4-dq",
        "--set",
        "checkpoint-reentrant=true",
        "--transformers-version",
        "4.40.0",
        "--torch-version",
        "2.2.2",
        "--bitsandbytes-version",
        "0.43.1",
    ],
    "philschmid training/scripts/run_fsdp_qlora.py, the row's script: BitsAndBytesConfig("
    "bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16); the CSV's "
    "precision column: 'NF4 double-quant'; its __main__ sets "
    'training_args.gradient_checkpointing_kwargs = {"use_reentrant": True} (4a0caadaf); '
    "the notebook training/fsdp-qlora-distributed-llama3.ipynb (4a0caad) installs "
    '"torch==2.2.2", transformers==4.40.0, bitsandbytes==0.43.1 (with accelerate==0.29.3, '
    "peft==0.10.0, trl==0.8.6): the versions the run had (GT114 -9.9 -> -6.9 %; 4.40's Llama "
    "returns logits.float() and shifts them for the loss)",
)

_TORCHAO_FUSED = (
    ["--optimizer-implementation", "fused"],
    "torchao benchmarks/benchmark_low_bit_adam.py, the rows' source: OPTIM_MAP "
    "AdamW=partial(torch.optim.AdamW, fused=True)",
)

_FMS_TRANSFORMERS = (
    ["--transformers-version", "4.48.1"],
    "fms-acceleration scripts/benchmarks/refs/a100_80gb.csv @24bdadb (Feb 2025), the rows' "
    "source: fms-hf-tuning 2.5.0 with transformers 4.48.1 (the CSV's source column); the "
    "reading had no --transformers-version",
)

_RASBT_TORCH = (
    "rasbt/pytorch-memory-optim @f6eddcd logs.md, the rows' source: torch "
    "2.1.0.dev20230623, a nightly from before pytorch PRs #104780 / #104898 (July 2023) made "
    "foreach Adam add eps in place, so its torch/optim is 2.0's (every other torch-version rule "
    "trainmem has changes at 2.5 or later)"
)
_RASBT_NIGHTLY = (["--torch-version", "2.0"], _RASBT_TORCH)
_RASBT_ZERO_GRAD = (
    ["--torch-version", "2.0", "--zero-grad-before-backward"],
    _RASBT_TORCH + "; 01_pytorch-vit.py .. 04_lower-batchsize.py call optimizer.zero_grad() "
    "between the loss and backward(), so last step's gradients live through the forward",
)

_TORCHTUNE_AO01 = (
    ["--torchao-version", "0.1"],
    "torchtune pyproject.toml pinned torchao==0.1 from f97bcdaa (2024-04-09) to c1c9f308 "
    "(2024-06-26); the rows' sources are torchtune at fef3ed1 (2024-04-16), ff594c23 "
    "(2024-04-15), 20747cd (2024-04-18) and 0217d44c (2024-05-09); the reading had no "
    "--torchao-version",
)
_TORCHTUNE_HELD_LOGITS = (
    ["--loop", "previous"],
    "torchtune's recipes bind the model output at loop scope (recipes/"
    "lora_finetune_single_device.py @fef3ed1 train(): ``logits = self._model(input_ids)``, "
    "then ``logits = logits[..., :-1, :].contiguous()``, ``logits = logits.transpose(1, 2)``) "
    "and delete it only from cb3ed29d (2024-06-04, 'del logits to save peak memory', LoRA "
    "recipes) and 8a98fbaa (2024-07-28, full recipes); at the rows' commits (fef3ed1, "
    "ff594c23, 20747cd, 0217d44c) the previous micro-batch's logits, whose grad_fn reaches "
    "its graph, live until the next forward returns; and the current one's through its own "
    "backward (Note [The current micro-batch's bound output]: the fp32 transposed copy the "
    "loss reads, bound until ``logits`` is rebound); the reading had no --loop",
)


def _torchtune(version: str, commit: str) -> tuple[list[str], str]:
    """The torchtune release of a row's commit (its version.txt), whose recipes' loss is the
    transposed cross-entropy before 0.3."""
    return (
        ["--torchtune-version", version],
        f"torchtune's version.txt @{commit}, the row's source, is {version}: its recipes' "
        "train() (recipes/lora_finetune_single_device.py, lora_finetune_distributed.py, "
        "full_finetune_single_device.py, full_finetune_distributed.py) pass the loss "
        "``logits[..., :-1, :].contiguous()`` transposed to (b, V, s - 1), the model's fp32 "
        "output (modules/transformer.py ``self.output(h).float()``), until 4fba6cd4 (Aug 2024, "
        "in 0.3.0); the reading had no --torchtune-version",
    )


_TT_FEF = _torchtune("0.1.0", "fef3ed1")
_TT_TUTORIAL = _torchtune("0.0.2", "ff594c23")
_TT_LLAMA3 = _torchtune("0.1.0", "20747cd")
_TT_MAY = _torchtune("0.2.0", "0217d44c")
_TORCHTUNE_LORA_DROPOUT = (
    ["--lora-dropout", "0.05"],
    "torchtune models/llama2/_model_builders.py @fef3ed1 and @0217d44c: lora_llama2_7b (and "
    "qlora_llama2_7b = partial(lora_llama2_7b, quantize_base=True)) and lora_llama2_70b build "
    "their LoRALinear with lora_dropout=0.05; models/llama3/_model_builders.py @20747cd "
    "lora_llama3_8b likewise; the configs set none (modules/peft/lora.py: "
    "``self.lora_a(self.dropout(x))``); the reading had no --lora-dropout",
)

_TORCHTUNE_FUSED = (
    ["--optimizer-implementation", "fused"],
    "the rows' configs set torch.optim.AdamW fused: True (recipes/configs/llama3_2/"
    "3B_lora_single_device.yaml and 3B_qlora_single_device.yaml @1814feb; llama3_1/"
    "8B_lora_single_device, 8B_qlora_single_device, 70B_full, 70B_lora and 405B_qlora.yaml "
    "@30b8519e); the reading had no --optimizer-implementation",
)

_TORCHTUNE_OWN_UNITS = (
    ["--set", "fsdp-embedding-head-units=true"],
    "recipes/configs/llama3_1/70B_full.yaml @30b8519e sets custom_sharded_layers: "
    "['tok_embeddings', 'output'], which recipes/full_finetune_distributed.py wraps as FSDP2 "
    "units of their own, resharded after forward (training/_distributed.py shard_model; Note "
    "[FSDP embedding and head units]); the reading had no flag for it",
)

_TORCHTUNE_BASELINE_ADAMW = (
    ["--optimizer-implementation", "fused"],
    "the README's Optimization flags table (1814feb) replaces 3B_full_single_device.yaml's "
    "PagedAdamW8bit with an AdamW it does not spell out; every torch.optim.AdamW config of "
    "that commit sets fused: True (llama3_2/3B_full.yaml, 1B_full.yaml, the LoRA configs), "
    "and GT014's measured 26.74 GB rules out foreach: at the step the bf16 parameters, "
    "gradients and two states (3.21B x 8 B = 25.7 GB) and foreach's sqrt copy of every "
    "parameter (6.4 GB) would be 32.1 GB",
)
_TORCHTUNE_405B_BATCH = (
    ["--micro-batch-size", "1"],
    "recipes/configs/llama3_1/405B_qlora.yaml @30b8519e sets batch_size: 1, and the README's "
    "'batch size 2' cannot be this row's: at 2 x 2048 packed tokens the step holds over 53 GB "
    "when the backward starts (the NF4 shard ~26 GB, the FSDP2 root's gathered bf16 embedding "
    "and output 8.4 GB, 126 checkpointed layer inputs 16.9 GB, the loss's saved fp32 logits "
    "2.1 GB) against the measured 48.1 GB",
)


def _joined(*parts: tuple[list[str], str]) -> tuple[list[str], str]:
    """Several amendments of one row: their flags in order, their sources joined."""
    return [a for args, _ in parts for a in args], "; ".join(why for _, why in parts)


_TT_MARCH_UNTRUNCATED = (
    ["--seq-len", "1585", "--gradient-accumulation-steps", "1"],
    "the README's 17.18 GB is a measurement of 2024-03-21 carried unchanged to the row's "
    "fef3ed1: it entered the table in a95c6b93 ('Update resource requirements' #551, for "
    "recipes/configs/lora_finetune_single_device.yaml; A100 under "
    "set_per_process_memory_fraction; the metric corrected to "
    "torch.cuda.max_memory_reserved() by 240cff85 the same day). At a95c6b93 the config has no "
    "gradient accumulation (the recipe steps the optimizer after every batch of 2) and "
    "alpaca_dataset(use_clean=True) builds InstructDataset with no max_seq_len "
    "(datasets/_instruct.py encodes the whole prompt and response; torchtune issue #558, "
    "RdoubleA, 2024-03-22: 'We still need to add support for truncating past the maximum "
    "sequence length'); the 512-token truncation the reading assumed came with 73647e26 "
    "(2024-03-30). The loop, the builder's _get_clones and the fp32 output are those of the "
    "other amendments (recipes/lora_finetune_single_device.py, modules/transformer.py "
    "@a95c6b93). Over the config's one epoch (epochs: 1, max_steps_per_epoch: null; the "
    "reserved level only rises in this loop and memory_stats_log's reset keeps it) the "
    "longest batch is padded (utils/collate.py padded_collate) to alpaca-cleaned's longest "
    "sample, 1585 tokens: the dataset's own README figure 'Distribution of prompt lengths' "
    "(gururise/AlpacaDataCleaned assets/prompt_length_distribution.png @c5f9df27, "
    "2023-04-09) spans its 100 bins from 46 to 1585 (x ticks 0-1600 at 29.3 px per 100 "
    "tokens, matplotlib's 5% margins inside the spines at 55 and 551 px; its tokenizer is "
    "unstated, the repository's fine-tunes are LLaMA's, whose tokenizer Llama 2 keeps: Touvron "
    "et al. 2023, section 2.1); the original "
    "alpaca's longest is 1305 LLaMA tokens (tloen/alpaca-lora lengths.ipynb: histogram "
    "edges 60 ... 1305): -4.6% at that length. Not in the source: which log line the README "
    "took (a shorter run's longest batch is shorter: at 1024 tokens -9.1%). Against: the "
    "same commit's 2 x RTX 4090 LoRA figure, 14.17 GB (AC off, the same data, later "
    "replaced by GT029's 20.95 GB), fits 512-token batches (GT029's config: 14.2 GB "
    "predicted at 512, 26.6 GB at 1585), so that run's longest batch was short. For: the "
    "table's QLoRA figure of 2024-03-22 (GT028, 9.29 GB, also untruncated) was re-measured "
    "after the truncation at 8.57 GB (README @20747cd), and the LoRA tutorial (GT033, "
    "committed 2024-04-15 with this config's successor, llama2/7B_lora_single_device.yaml) "
    "reports 15.57 GB, both lower by 8-10%",
)
_TT_APR_LORA = _joined(_TORCHTUNE_AO01, _TORCHTUNE_HELD_LOGITS, _TORCHTUNE_LORA_DROPOUT)
_TT_APR_FULL = _joined(_TORCHTUNE_AO01, _TORCHTUNE_HELD_LOGITS)
_TT_BF16_LORA = _joined(_TORCHTUNE_HELD_LOGITS, _TORCHTUNE_LORA_DROPOUT)

_TITAN_010 = (
    ["--torchtitan-version", "0.1"],
    "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md, the rows' "
    "source: torchtitan e7c0cae (version.txt 0.1.0, June 2025) run with --training.compile, "
    "whose loss is compiled too (torchtitan/components/loss.py build_cross_entropy_loss: "
    "torch.compile(loss_fn), since bbb1b616e / PR #1033); the reading had no torchtitan "
    "version and ran the Dec 2024 (0.0.2) eager loss",
)
_TORCHAO_DS_OFFLOAD = (
    ["--zero-stage", "2", "--set", "overlap_comm=true"],
    "torchao benchmarks/benchmark_low_bit_adam.py @1b1e94c5b (PR #584, Aug 2024), the row's "
    "source: deepspeed.initialize(config=dict(..., zero_optimization=dict(stage=2, "
    "overlap_comm=True, offload_optimizer=dict(device='cpu', pin_memory=True)))) ('requires "
    "ZeRO-2 to enable overlap_comm'); the reading had ZeRO stage 1",
)
_PEFT_DS_ZERO3_OFFLOAD = (
    ["--lora-dropout", "0.1"],
    "peft 73d7224b examples/causal_language_modeling/pet_lora_clm_accelerate_ds_zero3_offload.py, "
    "the row's script: LoRAConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, "
    "lora_alpha=32, lora_dropout=0.1); the reading had none",
)
_PEFT_DS_PR2653 = (
    ["--deepspeed-version", "0.8.0"],
    "peft 73d7224b README.md line 84 (2022-12-30): 'Currently DeepSpeed requires PR [ZeRO3 "
    "handling frozen weights](.../DeepSpeed/pull/2653)', merged 2023-01-17 into v0.8.0 "
    "(commit bf6b9802); the row ran DeepSpeed of that PR, before 0.9.0's one-rank path "
    "(partition_parameters.py _no_gather_coalesced, PR #2953): one GPU still gathers; the "
    "reading had the default release",
)
_PEFT_PLAIN_LOOP = (
    ["--loop", "previous"],
    "peft 5d602fdb examples/causal_language_modeling/peft_lora_clm_accelerate_ds_zero3_offload.py "
    "lines 250-257, the rows' loop: ``outputs = model(**batch); loss = outputs.loss; ... "
    "accelerator.backward(loss); optimizer.step(); ... optimizer.zero_grad()``: the binding "
    "holds each step's outputs through its backward and step and into the next forward (Note "
    "[The current micro-batch's bound output]); the reading had the Trainer's drop",
)
_FMS_LORA_DROPOUT = (
    [*_FMS_TRANSFORMERS[0], "--lora-dropout", "0.1"],
    _FMS_TRANSFORMERS[1] + "; scripts/benchmarks/scenarios.yaml @24bdadb gives every peft "
    "scenario (standard-peft, baseline-peft-bnb, accelerated-peft-bnb / -gptq) lora_dropout: "
    "0.1",
)
_FMS_BNB = (
    [*_FMS_LORA_DROPOUT[0], "--quantize-base", "nf4-dq", "--trl-version", "0.13.0"],
    _FMS_LORA_DROPOUT[1] + "; both bnb configurations load through the accelerated-peft "
    "plugin's model_loader (plugins/accelerated-peft/.../framework_plugin_bnb.py @24bdadb: "
    "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True, ...)), so the base "
    "is NF4 with double quantization; scripts/benchmarks/refs/requirements.txt @24bdadb pins "
    "trl==0.13.0, whose SFTTrainer gets fms-hf-tuning 2.5.0's peft_config (tuning/"
    "sft_trainer.py; baseline-peft-bnb's no_peft_model: true leaves the preparation to it): "
    "on one GPU (benchmark.py COMMAND_PYTHON) it runs peft's prepare_model_for_kbit_training "
    "and, under bf16, peft_module_casting_to_bf16 (embed_tokens and lm_head back to bf16); "
    "the FSDP rows' base is sharded (is_sharded_qlora), neither runs",
)

_HUB = (
    "litgpt config_hub/finetune/{}.yaml @{}, the row's config: global_batch_size {} / "
    "micro_batch_size {} = {} gradient accumulation iterations (litgpt/args.py "
    "TrainArgs.gradient_accumulation_iters); the reading had none"
)
_HUB_RELEASE = {"43c44323": "0.4.0", "5895df10": "0.4.0", "00af8b0d": "0.4.13"}
"""The litgpt each table commit measured: its pyproject.toml ``version`` (0.4.0.dev0 at
43c44323 and 5895df10, 0.4.13.dev1 at 00af8b0d)."""
_RELEASE = (
    "; litgpt {} (pyproject.toml at that commit: from 0.4.6 a trained RMSNorm saves its fp32 "
    "normalised tensor: specs/frameworks.py LITGPT_RMSNORM_FP32_WEIGHT_SINCE)"
)
_PAGED = (
    "; litgpt/finetune/lora.py @43c44323 (Apr 2024): under BitsandbytesPrecision the optimizer "
    "is bnb.optim.PagedAdamW (the reading: adamw)"
)
_HEAD = (
    "; the config's lora_head: true (LoRA on the output head too; the reading's all-linear "
    "leaves it out)"
)
_ALL_HEAD = "q,k,v,o,gate,up,down,lm_head"


_CHUNKS = (
    "; litgpt/finetune/lora.py @43c44323: logits = model(input_ids, lm_head_chunk_size=128) "
    "and chunked_cross_entropy(logits, ...) with its default chunk_size=128 (litgpt/utils.py): "
    "the head and the loss in 512 / 128 = 4 chunks of tokens"
)


def _hub(
    config: str, commit: str, batch: int, micro: int, *, paged: bool = False, head: str = ""
) -> tuple[list[str], str]:
    """The amendment a litgpt config-hub row's yaml and script make: its accumulation, the LoRA
    script's chunked head and loss (full.py's head is not chunked), PagedAdamW under
    bitsandbytes, LoRA on the head."""
    version = _HUB_RELEASE[commit]
    args = ["--gradient-accumulation-steps", str(batch // micro), "--litgpt-version", version]
    why = _HUB.format(config, commit, batch, micro, batch // micro) + _RELEASE.format(version)
    if "lora" in config:
        args += ["--chunked-cross-entropy", "4"]
        why += _CHUNKS
    if paged:
        args += ["--optimizer", "paged-adamw"]
        why += _PAGED
    if head:
        args += ["--lora-targets", head]
        why += _HEAD
    return args, why


_LITGPT_HUB: dict[str, tuple[list[str], str]] = {
    "GT097": _hub("llama-2-7b/lora", "43c44323", 8, 2),
    "GT098": _hub("llama-2-7b/qlora", "43c44323", 8, 2, paged=True),
    "GT099": _hub("llama-3-8b/lora", "5895df10", 8, 1),
    "GT100": _hub("llama-3-8b/qlora", "5895df10", 8, 2, paged=True),
    "GT101": _hub("mistral-7b/lora", "43c44323", 8, 2),
    "GT102": _hub("mistral-7b/qlora", "43c44323", 8, 2, paged=True),
    "GT103": _hub("falcon-7b/lora", "43c44323", 8, 1),
    "GT104": _hub("falcon-7b/qlora", "43c44323", 8, 1, paged=True),
    "GT105": _hub("stablelm-base-alpha-3b/lora", "43c44323", 8, 1),
    "GT106": _hub("stablelm-base-alpha-3b/qlora", "43c44323", 8, 1, paged=True),
    "GT107": _hub("phi-2/lora", "43c44323", 8, 4, head="q,k,v,o,up,down,lm_head"),
    "GT108": _hub("gemma-2b/lora", "43c44323", 6, 2, head=_ALL_HEAD),
    "GT109": _hub("gemma-7b/qlora", "43c44323", 6, 1, paged=True, head=_ALL_HEAD),
    "GT110": _hub("tiny-llama/lora", "43c44323", 8, 8, head=_ALL_HEAD),
    "GT111": _hub("tiny-llama/full", "43c44323", 32, 4),
    "GT112": _hub("llama-3.2-1B/lora", "00af8b0d", 8, 1),
    "GT113": _hub("llama-3.2-3B/lora", "00af8b0d", 8, 1),
}
"""The litgpt config-hub rows (README table @43c44323, 'Add automated benchmark table', Apr
2024; the Llama 3 rows @5895df10, the Llama 3.2 rows @00af8b0d): what each row's yaml says
beyond the reading."""

AMENDMENTS: dict[str, tuple[list[str], str]] = {
    # torchtune Apr-May 2024 (torchao 0.1 pin; logits held by the loop; llama2 / llama3 LoRA
    # builders' lora_dropout 0.05): the LoRA and QLoRA rows, then the full fine-tunes
    **{f"GT0{n}": _joined(_TT_APR_LORA, _TT_FEF) for n in (28, 29)},
    "GT030": _joined(_TT_APR_LORA, _TT_FEF, _TT_MARCH_UNTRUNCATED),
    **{f"GT0{n}": _joined(_TT_APR_FULL, _TT_FEF) for n in (31, 32)},
    **{f"GT0{n}": _joined(_TT_APR_LORA, _TT_TUTORIAL) for n in (33, 34, 35, 36)},
    **{f"GT0{n}": _joined(_TT_APR_LORA, _TT_MAY) for n in (37, 38)},
    **{f"GT0{n}": _joined(_TT_BF16_LORA, _TT_MAY) for n in (39, 42)},
    **{f"GT0{n}": _joined(_TORCHTUNE_HELD_LOGITS, _TT_MAY) for n in (40, 41, 43)},
    **{f"GT0{n}": _TORCHTUNE_BASELINE_ADAMW for n in range(11, 17)},
    **{f"GT0{n}": _TORCHTUNE_FUSED for n in (18, 19, 22, 24, 26)},
    "GT025": _joined(_TORCHTUNE_FUSED, _TORCHTUNE_OWN_UNITS),
    "GT027": _joined(_TORCHTUNE_FUSED, _TORCHTUNE_405B_BATCH),
    "GT172": _joined(_TT_BF16_LORA, _TT_LLAMA3),
    "GT173": _joined(_TT_APR_LORA, _TT_LLAMA3),
    **_LITGPT_HUB,
    **{f"GT{n}": _FSDP_QLORA for n in range(115, 132)},
    **{f"GT{n}": _FSDP_QLORA_BNB for n in (115, 116, 119, 120, 123, *range(126, 132))},
    "GT176": _PEFT_SFT_QLORA,
    **{f"GT{n}": _PEFT_SFT_QLORA_FSDP for n in (177, 178)},
    **{f"GT{n}": _PEFT_SFT_H100 for n in (174, 175)},
    "GT114": _PHILSCHMID_DQ,
    **{f"GT{n}": _FMS_TRANSFORMERS for n in range(132, 140)},
    **{f"GT{n}": _FMS_LORA_DROPOUT for n in range(140, 146)},
    **{f"GT{n}": _FMS_BNB for n in range(146, 155)},
    **{f"GT{n}": _FMS_LORA_DROPOUT for n in range(155, 161)},
    **{f"GT{n}": _TORCHAO_FUSED for n in range(167, 170)},
    **{f"GT{n}": _RASBT_ZERO_GRAD for n in range(179, 183)},
    **{f"GT{n}": _RASBT_NIGHTLY for n in range(183, 185)},
    "GT170": _TORCHAO_DS_OFFLOAD,
    "GT069": _joined(_PEFT_DS_ZERO3_OFFLOAD, _PEFT_PLAIN_LOOP),
    "GT070": _joined(_PEFT_DS_ZERO3_OFFLOAD, _PEFT_PLAIN_LOOP, _PEFT_DS_PR2653),
    "GT062": _TITAN_010,
    "GT063": _TITAN_010,
}

_TORCHAO_224 = (
    {"image_size": 224},
    "torchao benchmark_low_bit_adam.py trains on RandomResizedCrop(224) images (257 tokens); "
    "configs/dinov2-giant is the HF twin at 518 px, and --seq-len does not set a vision "
    "encoder's size",
)

_MISTRAL_V02 = (
    {"sliding_window": None},
    "the run's base is Mistral-7B-v0.2 (notes: the v0.1 preset's shapes, no sliding window; "
    "its config.json has sliding_window null)",
)

_LLAMA3_70B = (
    {"max_position_embeddings": 8192},
    "the row's base is meta-llama/Meta-Llama-3-70B (its config.json: max_position_embeddings "
    "8192, no rope_scaling; transformers 4.40.0 cannot load Llama 3.1's 'llama3' rope_scaling, "
    "added in 4.43); the reading named the llama-3.1-70b preset (131072 positions), which "
    "sizes transformers 4.40's per-layer rotary tables (ModelSpec.layer_rope_cache_values)",
)

_TORCHVISION_VIT = (
    {"model_type": "torchvision_vit", "num_labels": 10},
    "rasbt/pytorch-memory-optim @f6eddcd 01_pytorch-vit.py .. 06_sgd-with-scheduler.py, the "
    "rows' source: torchvision.models.vit_l_16(weights=ViT_L_16_Weights.IMAGENET1K_V1) with "
    "model.heads.head = torch.nn.Linear(1024, 10): torchvision's VisionTransformer, whose "
    "EncoderBlock attention is nn.MultiheadAttention (need_weights=False), not transformers' "
    "ViTLayer; the reading named the HF ViT-L twin (its 1000-class head)",
)

CONFIG_AMENDMENTS: dict[str, tuple[dict[str, object], str]] = {
    **{f"GT{n}": _TORCHVISION_VIT for n in range(179, 185)},
    **{f"GT{n}": _TORCHAO_224 for n in range(167, 171)},
    "GT114": _LLAMA3_70B,
    "GT130": _MISTRAL_V02,
    "GT131": _MISTRAL_V02,
}
"""config.json keys the source sets otherwise than the published config the row names."""

CAUSES: dict[str, str] = {}

_TT_HEAD = (
    "unexplained: the compiled chunked loss is modelled (torchtune 0.4.0 compile_loss: bf16 "
    "logits saved, no fp32 log-softmax; Note [Compiled chunked cross-entropy]); the predicted "
    "peak is now the loss backward / the head's weight-gradient sums. The trace engine, which "
    "runs CEWithChunkedOutputLoss's compiled chunks itself, agrees (GT024: 7.61 GiB allocated "
    "by both engines, above the measured 7.4 GiB whatever the metric). Read and not modelled: "
    "the README's commit 30b8519e is torchtune 0.3.0 (version.txt), whose training/_compile.py "
    "compile_model compiles each TransformerSelfAttentionLayer only on torch >= 2.5 and the "
    "whole model (model.compile) on older torch"
)
_TT_8BIT = (
    "unexplained: the compiled chunked loss is modelled (Note [Compiled chunked "
    "cross-entropy]) and the twin rows GT015/GT016 are within 1%; the under-estimate is the "
    "8-bit optimizer's (GT016 -> GT017 measured 4.5 GB saved, predicted 6.3 GB); -8.8 -> "
    "-10.0% with Note [Chunked head's first weight-gradient sum] (one chunk's logits "
    "gradient fewer at the head's first weight-gradient sum, traced). Read and ruled out "
    "(helper under2): bitsandbytes 0.44.1 (current in Nov 2024) optim/optimizer.py "
    "Optimizer2State.init_state allocates uint8 state1/state2 (n bytes each), fp32 "
    "absmax1/absmax2 per 256 values and fp32 states under min_8bit_size 4096, as modelled; "
    "update_step runs in place (optimizer_update_8bit_blockwise) and p.grad.contiguous() "
    "copies nothing (AccumulateGrad keeps the parameter's layout); optimizer_in_bwd's one "
    "optimizer per parameter (recipes/full_finetune_single_device.py @1814feb) adds a 2 KiB "
    "qmap pair each (0.5 MB). The config's PagedAdamW8bit would put state1/state2 in "
    "cudaMallocManaged memory (functional.py get_paged: a torch.frombuffer CPU tensor, outside "
    "the caching allocator), which would leave 12.4 GB of non-state memory at the measured "
    "peak against GT016's 4.1 GB: the row was not paged. The README's link names torchao's "
    "AdamW8bit beside bnb's (docs memory_optimizations.rst @1814feb); no source says which "
    "ran. Read (helper ao8): torchao's would not explain it either: same codes and absmax "
    "(bf16 instead of fp32 states of the 3072-element norms), and its compiled "
    "single-parameter step (Note [torchao low-bit AdamW step]: new uint8 codes and fp32 "
    "scales, 2.03 B per element) for the tied 128256 x 3072 embedding (0.80 GB) runs at the "
    "end of the backward, far below its peak: --optimizer ao-adamw-8bit predicts 17.014 GB, "
    "0.7 MB below bnb's"
)
_TT_NF4_INIT = (
    "the load is modelled (Note [torchao 0.1 NF4 at load]: bf16 linears built and quantized "
    "on the GPU, then again from the checkpoint; (value - nf4).abs() over (numel, 16): the "
    "replay's load reserves 8.0 GB, -41.1 -> -9.9% with torchao 0.1's factor views); the rest "
    "likely as the bf16 LoRA twins "
    "of the same recipes (GT033-GT036: reserved under by 6-7%, unexplained); the row's "
    "9.29 GB is of 2024-03-22 (412a4ecd, 'QLoRA' #478), before alpaca was truncated at 512 "
    "tokens (as GT030's 17.18 GB), yet the replay's reserved is the load's at any length; the "
    "same README table re-measured this row two days later at 8.57 GB (@20747cd, 'Llama3 "
    "changes' #793; between the two commits neither the recipe, its config, torchao's pin "
    "nor the llama2 model code changed, only the tokenizer class was refactored; the "
    "table's footnote @fef3ed1: 'averaged over multiple runs, but there might be some "
    "variance based on the setup'): predicted 8.37 GB is -2.3% from it"
)
_TT_NF4_LAYOUT = (
    "the load's cached blocks (Note [torchao 0.1 NF4 at load]) change where the step's "
    "tensors land: the replay reserves 12.19 GB with them (with the recipe's held logits and "
    "lora_dropout 0.05, amended; 11.65 GB without those); "
    "'Seq Length 2048' as stated (if alpaca with max_seq_len 2048, the real peak length is "
    "shorter)"
)
_TT_2024 = (
    "likely the caching allocator under varying shapes, not modelled: torchtune Apr 2024 "
    "single-device LoRA, reserved under by 6-16% (the loop's held logits and lora_dropout "
    "0.05 amended from the recipe and builder: 6.5-7.5 -> 6.1-6.7%, GT030 -15.4 -> -15.0%); "
    "alpaca batches are padded to the longest sample of each batch (utils/collate.py "
    "padded_collate), so every activation's size changes from one micro-batch to the next, "
    "and over a run's thousands of shapes the allocator's split and cached blocks exceed one "
    "fixed-shape step's, which the replay runs; the allocated twin of the same recipe and "
    "week, GT172 (Llama-3-8B LoRA @20747cd, allocated), is -2.9%; the tutorial reports "
    "15.57 GB and the README 17.18 GB for one config, the README's measured in March 2024 "
    "before alpaca was truncated at 512 tokens (GT030's amendment). The load is modelled (Note "
    "[torchtune's cloned layer at load], torchtune < 0.3 amended from version.txt): the "
    "builder makes one decoder layer on the GPU and deep-copies it num_layers times "
    "(modules/transformer.py @fef3ed1 ``_get_clones``), so the load peaks at the model and "
    "one layer, 13.89 GB for this config, against the init peak the QLoRA tutorial logs for "
    "it ('GPU peak memory allocation: 13.96 GB', reserved 13.98 GB; the rest is each "
    "layer's own RoPE cache, 33 x 2.1 MB); the built layer's blocks stay cached into "
    "training (no empty_cache in this recipe) and the step lands otherwise in them: "
    "-15.0 -> -15.9% here, the tutorial's rows within 1 point. Not the loss either: the "
    "recipe's transposed cross-entropy (modelled, torchtune < 0.3) moves no allocated peak. "
    "The mechanism has its option now (--earlier-seq-lens, Note [Steps of varying length]: "
    "steps of the listed lengths replayed before the measured one through one allocator), "
    "but no source here gives the lengths: the README, the config (alpaca_cleaned_dataset, "
    "max_seq_len 512) and the dataset card (51.8k rows) state none, so the row runs at one "
    "length; for the size of the effect only (not the row's data): GT030's config after "
    "steps rising from 100 to 500 tokens by 20 reserves 16.18 GB (-5.8%), after the same "
    "steps falling 14.75 GB (-14.1%); after 64 steps of random lengths in 60-512 (two "
    "draws) 14.65 / 14.84 GB (-14.7 / -13.6%). The data order is not what differs between "
    "the README's 17.18 GB and the tutorial's 15.57 GB for one config: both recipes "
    "(lora_finetune_single_device.py _setup_data @fef3ed1 and @ff594c23) build "
    "DistributedSampler(shuffle=True, seed=0), so every run sees alpaca_cleaned in one "
    "order (seed: null seeds only torch, numpy and random: the dropout masks); the two "
    "figures differ in their data: the README's is of 2024-03-21 (a95c6b93), when "
    "InstructDataset had no max_seq_len, so its longest batch is alpaca-cleaned's longest "
    "sample, not 512 tokens (GT030's amendment, -15.5 -> -1.6%)"
)
_TT_SEP_TOKENS = (
    "; the README's setting is likely not what was measured: GT022's 17.4 GB is below what "
    "batch 2 x 2048 packed tokens must hold when the backward starts (the bf16 model 16.06 GB, "
    "32 checkpointed layer inputs 32 x 2 x 2048 x 4096 x 2 B = 1.07 GB, the 8 chunks' bf16 "
    "logits 4096 x 128256 x 2 B = 1.05 GB: 18.18 GB), and the table's GT020 / GT022 / GT024 "
    "/ GT026 are within 6% at 2048 tokens a batch (+3.0 / +1.4 / -5.5 / -0.4%); not amended, "
    "the README states batch size 2"
)
_SEQ_OR_AC = (
    "the README's settings and the config disagree (torchtune PR #955, the table's: 'a BS of "
    "4 and Seq Length of 2048'; PR #961 reproduces its rows with inputs forced to 2048 "
    "tokens): at the stated 4 x 2048 tokens with "
    "7B_lora.yaml's enable_activation_checkpointing: False @0217d44c the step needs 53.7 GB "
    "(predicted) on a 24 GB card, so the completed run had either activation checkpointing "
    "on (then -0.7%; the README's other 7B rows at a literal 2048 tokens are within 7%) or "
    "shorter batches (alpaca_cleaned padded to the longest sample, whose length no source "
    "here gives); not amended, no source says which"
    "; the table's memory column is not a run at the stated setting: for this table "
    "(torchtune issue #925, kartikayk, 2024-05-06) the author 'was trying to clean the table "
    "up ... to capture lowest memory utilization AND peak tokens/sec for each model. "
    'Capturing the "best" for each column\', so the memory and the tokens/sec of a row may '
    "come from different runs"
)
_SEQ_70B = (
    "the stated 'Seq Length = 4096' (torchtune PR #955: 'a BS of 4 and Seq Length of 4096' "
    "for the 70B rows) cannot be the batch length: at 4 x 4096 tokens the "
    "checkpointed layer inputs alone (80 x 4 x 4096 x 8192 x 2 B = 21.5 GB) and the 17.3 GB "
    "parameter shard exceed the measured 26.4 GB; 70B_lora.yaml @0217d44c trains on "
    "alpaca_dataset padded to the longest sample of each batch (utils/collate.py "
    "padded_collate), so 4096 is its max_seq_len; the longest alpaca sample is not in any "
    "source here; the loop's bound logits (Note [The current micro-batch's bound output]) "
    "raise the over-count with the stated length: GT042 +133.2 -> +143.8%"
    "; the table's memory column is not a run at the stated setting: for this table "
    "(torchtune issue #925, kartikayk, 2024-05-06) the author 'was trying to clean the table "
    "up ... to capture lowest memory utilization AND peak tokens/sec for each model. "
    'Capturing the "best" for each column\', so the memory and the tokens/sec of a row may '
    "come from different runs"
)
_NEAR_CAPACITY = "allocator near capacity: the run filled the card (notes: at capacity)"
_TITAN_CP = (
    "allocator cache: reserved - allocated is ~16 GB measured, 8.7 predicted at 32k-262k "
    "tokens; torchtitan runs with expandable_segments (see the torchtitan section: -3/-4% with it)"
)
_TITAN_T4 = (
    "AsyncTP, which has no flag: the row is GT054's configuration with AsyncTP, measured 6% "
    "below it; GT054 is within 5% since DTensor sequence parallelism's collective copies "
    "(Note [Sequence-parallel collectives' copies]; before them the analytic block split "
    "reserved 80.9 GiB, the trace's replay 72.2, measured 71.9)"
)
_FLOAT8_AG = (
    "unexplained: amended with the source's torchtitan 0.1, whose --training.compile compiles "
    "the loss (Note [torchtitan's compiled cross-entropy]; as read, the eager loss: +28%); still "
    "under at the loss backward's peak (40.3 GiB allocated). Read and ruled out: float8 FSDP "
    "all-gather (already modelled), force_recompute_fp8_weight_in_bwd (a no-op in torchao "
    "0afa4c1, PR #2356), the SAC save list (aten.abs dropped since 9dec370: under compile its "
    "output is read by no backward op), precomputed scales (one fp32 amax per weight). The "
    "trace engine on GT062 keeps no matmul output of a float8 linear under compiled op-level "
    "SAC (21.2 GiB allocated, 30.1 reserved), against GT053's measurement (the analytic rule "
    "keeps them and is -3.4% there)"
)
_FSDP_QLORA_CACHE = (
    "the load is modelled (Note [FSDP1 sync_module_states init]: units moved, broadcast in "
    "250 MiB buckets, flattened, sharded; GT117 / GT118 at 512 / 2048 tokens measured 10.99 / "
    "10.97 GB reserved, now predicted 10.24 / 10.24: the load sets it); still under: the QLoRA "
    "rows' load_and_quantize before FSDP (each weight quantized on the GPU by "
    "n_loading_workers threads at once, a machine-dependent count) is not modelled"
)
_FSDP1_LAYOUT = (
    "the FSDP1 load's cached blocks (Note [FSDP1 sync_module_states init]) change where the "
    "step's tensors land; for QLoRA rows load_and_quantize before FSDP (n_loading_workers "
    "threads quantizing on the GPU at once) is not modelled"
)
_FSDP1_STREAMS = (
    "; FSDP1's unshard and post-backward streams are modelled (FrameworkConventions."
    "fsdp_collective_streams: GT115 -18.5 -> -16.4%, GT118 -6.7 -> -4.0%, GT130 / GT131 -3.2 "
    "-> -0.2%, GT129 -19.9 -> -22.9%), and under CPU offload the H2D copy of each shard on "
    "FSDP1's pre-unshard stream (Note [FSDP1 offloaded shard copy]: torch 2.2 _flat_param.py "
    "``pre_unshard``; GT129 -23.8 -> -20.5%, GT128 -8.1 -> -4.4%)"
    "; and every unit's gather on the unshard stream (Note [FSDP1 unshard stream pool]: the "
    "root's and two layer units' unsharded flat parameters, torch 2.2.2 _runtime_utils.py "
    "``_unshard`` with BACKWARD_PRE and limit_all_gathers; the order checked on torch's FSDP1 "
    "on the CPU): GT115 -16.4 -> -4.4%, GT117 -6.9 -> -2.1%, GT118 -4.3 -> -1.9%; the other "
    "fsdp_qlora rows moved down (GT119 +0.4 -> -4.9%, GT127 -6.8 -> -8.4%, GT128 -4.4 -> "
    "-12.2%, GT129 -20.5 -> -22.5%): the gathers no longer occupy the default stream's cache, "
    "whose blocks are the modelled load's (Note [FSDP1 sync_module_states init]), so the "
    "activations land in them; what the default stream holds beyond that is not found. "
    "Tried, not landed then: transformers 4.39's fp32 logits and train.py's ``output`` held to "
    "the step's end (no row moves but GT129, -22.5 -> -17.6%; since landed as fsdp-qlora's "
    "loop 'step' and ModelSpec.returns_fp32_logits, the latter effective with "
    "--transformers-version only). Landed: bitsandbytes 0.43.0 (the "
    "README's floor, March 2024; ``_FSDP_QLORA_BNB``), whose MatMul4Bit keeps its 16-bit "
    "input, with the replay's capacity of boards without peer access (Note [NCCL without peer "
    "access]): GT119 -4.1 -> -2.1%, GT120 -2.0 -> +1.5%, GT127 -7.7 -> -6.3%, GT128 -10.9 -> "
    "-8.2%, GT129 -20.0 -> -17.4%, GT130 / GT131 -2.7 -> +1.9%; GT126 -2.0 -> -8.9%"
)
_FSDP_QLORA_DQ = (
    "the base is double-quantized (amended from train.py: Linear4bit's compress_statistics "
    "default), its statistics whole on each rank (Note [bitsandbytes statistics under "
    "sharding]); the nf4 reading overstated the sharded weights; still under: the load's "
    "cached blocks (Note [FSDP1 sync_module_states init]; load_and_quantize's n_loading_workers "
    "threads quantizing on the GPU at once are not modelled, but train.py 50efa1e calls "
    "torch.cuda.empty_cache() after them: only segments holding live quant_state tensors stay, "
    "for Llama-2-7B all under 1 MiB, small-pool 2 MiB segments; replayed before the FSDP1 "
    "init, serial (benchmarks/fsdp_qlora_load_quantize.py, session 24): GT115 -9.3 -> -9.9%, "
    "GT127 -1.7 -> -2.3%, GT128 -6.4 -> -6.7%, GT129 -14.4 -> -14.0%, the others within 0.2 "
    "point; five interleaved workers GT128 down to -8.3%; not modelled)"
    + _FSDP1_STREAMS
    + "; the load's broadcast bucket of one tensor is that tensor, no block of its own "
    "(torch utils/tensor_flatten.h flatten_dense_tensors: a view; analytic/load.py "
    "_fsdp1_unit): GT115 -4.4 -> -9.3%, GT117 -2.1 -> -4.5%, GT119 -2.1 -> -0.7%, GT127 "
    "-6.3 -> -1.7%, GT128 -8.2 -> -6.4%, GT129 -15.6 -> -14.4%"
)
_FMS_FLAT_GRADS = (
    "unexplained: accelerate FSDP + LoRA under. Not FSDP1 flat gradients over the frozen "
    "weights: the end-of-train alloc, 7.37 GB, is the bf16 parameter shard alone (7.24e9 x 2 B "
    "/ 2 ranks + adapters), and transformers 4.48.0 Trainer._fsdp_qlora_plugin_updates sets "
    "peft's fsdp_auto_wrap_policy (each LoRA leaf its own FSDP unit), so no flat parameter "
    "mixes frozen and trainable tensors"
)
_FSDP1_REENTRANT = (
    "FSDP1 frozen units under transformers 4's reentrant checkpointing are modelled (Note "
    "[FSDP1 frozen units under reentrant checkpointing]: each layer's input and its gradient "
    "kept until FSDP's final callback, 2 b s h per layer; checked on the real FSDP1), and "
    "accelerate's MixedPrecision gathers the fp32 adapters in the compute dtype, so peft makes "
    "no fp32 copy of their input (trainmem.analytic.lora ``adapter_matmul_bytes``)"
)
_FSDP1_ADAPTER_PREFETCH = (
    "with each LoRA leaf an FSDP1 unit (the HF Trainer's peft fsdp_auto_wrap_policy), "
    "BACKWARD_PRE prefetches layer i from layer i + 1's first adapter unit, in its attention's "
    "backward, so the MLP's backward runs with one layer gathered, not two (Note [FSDP1 "
    "backward prefetch under adapter units]; the rows' fsdp_backward_prefetch_policy "
    "BACKWARD_PRE, fms-hf-tuning fixtures/accelerate_fsdp_defaults.yaml; traced on torch's "
    "FSDP1)"
)
_REENTRANT_OUTPUT = (
    "; transformers 4.48's default reentrant checkpoint (fms-acceleration scripts/benchmarks "
    "set no gradient_checkpointing_kwargs) holds each recomputed layer's output, b s h, "
    "through the layer's backward (Note [Reentrant checkpoint's recomputed output]; torch "
    "utils/checkpoint.py CheckpointFunction.backward; measured on torch's checkpoint on the "
    "CPU): GT141 +3.1 -> +3.6%, GT143 +4.3 -> +4.9%, GT144 +1.9 -> +2.0%, GT145 +0.6 -> "
    "+0.8%, GT147 +2.1 -> +2.9%, GT149 +2.5 -> +3.4%, GT150 -0.1 -> +0.5%, GT151 -0.9 -> "
    "-0.6%, GT152 -0.4 -> +0.5%, GT153 -0.9 -> -0.4%, GT154 +0.0 -> +0.3%, GT156 +2.2 -> "
    "+2.9%, GT158 +2.5 -> +3.4%, GT159 +2.3 -> +2.7%, GT160 +2.6 -> +2.9%"
)
_FMS_FSDP_4BIT_OVER = (
    _FSDP1_REENTRANT + "; the peak is now the end of the layers' backward (before: under, "
    "GT147 -3.4%, GT149 -5.5%, GT156 -4.0%, GT158 -5.9%, GT154 -19.9%, GT160 -17.3%); the "
    "rest over, not explained: the last layer's recomputation and transients as modelled "
    "(measured peak - end-of-train alloc - the kept inputs leaves 3.0 GB for GT156, predicted "
    "3.6; 0.2 GB of it the sliding-window mask flash-attn 2 never gets, below); GT160's "
    "TheBloke/Llama-2-70B-GPTQ main branch has no group size (its 35.33 GB "
    "checkpoint; the end-of-train alloc on 1 GPU, 36.12 GB, is that plus the adapters and "
    "their AdamW states), gptq-int4 assumes group 128 (+0.7 GB per rank of scales and zeros); "
    + _FSDP1_ADAPTER_PREFETCH
    + ": GT147 +6.1 -> +4.9%, GT149 +4.9 -> +4.2%, GT154 +2.1 -> +1.1%, GT156 +7.0 -> +5.8%, "
    "GT158 +6.2 -> +5.5%, GT160 +4.2 -> +3.2%" + _REENTRANT_OUTPUT
)
_FLASH_NO_SLIDING_MASK = (
    "; flash-attn 2 gets no sliding-window mask (analytic/attention.py sliding_mask_applies: "
    "transformers 4.48 modeling_mistral.py MistralModel._update_causal_mask returns None under "
    "flash_attention_2 when the attention_mask holds no 0, the window goes to the kernel; the "
    "modelled SDPA bias and expanded k / v of the last recomputed layer, 168 MB, and the "
    "checkpoint's boolean mask, 34 MB, at s = 4096 = Mistral-7B-v0.1's window): GT141 +3.6 -> "
    "+2.2%, GT143 +4.9 -> +3.1%, GT146 +4.8 -> +4.5%, GT147 +2.9 -> +0.7%, GT148 +3.2 -> +2.8%, "
    "GT149 +3.4 -> +0.8%, GT156 +2.9 -> +0.7%, GT158 +3.4 -> +0.8%; GT140 / GT142 / GT155 / "
    "GT157 0.3-0.5 point lower"
)
_FMS_MIXTRAL_OVER = (
    _FSDP1_REENTRANT + "; the backward's peak (the end of the layers' backward) held the "
    "dequantized weight of all 8 experts' gate and up projections (1.88 GB), where "
    "transformers 4.48's Linear4bit experts dequantize one 14336 x 4096 linear at a time "
    "(Note [Dequantized expert weights]): GT151 +11.1 -> +3.5%, GT153 +6.9 -> +2.2%; then "
    + _FSDP1_ADAPTER_PREFETCH
    + ": GT144 +5.4 -> +1.9%, GT145 +5.1 -> +0.6%, GT151 +3.8 -> +0.4%, GT153 +2.7 -> +0.1%"
    + _REENTRANT_OUTPUT
)
_FMS_LORA_FSDP = (
    _FSDP1_REENTRANT
    + "; before: under (GT141 -5.6%, GT143 -7.7%), then GT141 +4.0%, GT143 +3.5%; "
    + _FSDP1_ADAPTER_PREFETCH
    + ": GT141 +6.0 -> +3.1%, GT143 +6.3 -> +4.3% (from +4.0 / +3.5% the frozen down "
    "projection's input rules had grown them)" + _REENTRANT_OUTPUT
)
_PEFT_QLORA_FSDP = (
    _FSDP1_REENTRANT + " (amended from the script's --use_reentrant True; transformers' "
    "Trainer sets FSDP's param_dtype to the bf16 quant storage under bf16-true too)"
)

_FMS_1GPU_4BIT = (
    "fms-acceleration baseline-peft-bnb on 1 GPU: trl 0.13.0's SFTTrainer runs peft's fp32 "
    "upcast, then casts embed_tokens and lm_head back to bf16 under bf16 "
    "(peft_module_casting_to_bf16; TrainingConfig.trl_bf16_embeddings, amended --trl-version "
    "0.13.0 from refs/requirements.txt): GT146 +4.5 -> +0.7%, GT148 +2.8 -> +0.7%, GT150 +0.5 "
    "-> -0.7%, GT152 +0.5 -> -0.4% (the Mixtral rows with Note [transformers 4 expert loop]); "
    "the GPTQ rows of the same table (accelerated-peft-autogptq, GT155/157/159) are within 2% "
    "since peft's prepare_model_for_kbit_training skips the fp32 cast for GPTQ"
)
_GPTQ_TRITON = (
    "; GPTQ's triton v2 kernel (the plugin's kernel: configs/autogptq.yaml) saves only the "
    "packed tensors, not its input (gptqmodel triton_utils/dequant.py QuantLinearFunction; "
    "TrainingConfig.quantized_matmul_saves_input): GT156 +3.6 -> +2.2%, GT158 +4.2 -> +2.5%, "
    "GT159 +3.1 -> +2.3%, GT160 +3.2 -> +2.6%"
)
_VISION_TOKENS = (
    "vision encoder tokens come from config.json image_size 518 (1370 tokens); the run is "
    "224 px (257 tokens) and --seq-len is ignored for vision encoders (no flag sets the size)"
)

CAUSES.update(
    {
        "GT015": _TT_HEAD,
        "GT016": _TT_HEAD,
        "GT017": _TT_8BIT,
        "GT018": _TT_HEAD,
        "GT019": _TT_HEAD,
        "GT020": _TT_HEAD + "; README metric kind not stated (reserved taken)" + _TT_SEP_TOKENS,
        "GT022": _TT_HEAD + "; README metric kind not stated (reserved taken)" + _TT_SEP_TOKENS,
        "GT024": _TT_HEAD + "; README metric kind not stated (reserved taken)" + _TT_SEP_TOKENS,
        "GT025": (
            "over: the figure is below what the stated step must hold. 70B_full.yaml's "
            "custom_sharded_layers modelled (amended; Note [FSDP embedding and head units]): "
            "the root no longer holds the gathered embedding (2.1 GB) through the step, but the "
            "output unit's gradient is unsharded until its post-backward: at the chunked "
            "loss's weight-gradient peak (the second chunk, whose sum with the first is made "
            "out of place, the later ones in place: torch/csrc/autograd/input_buffer.cpp "
            "``accumulate``; seen on the CPU, the chunks' gradients arriving as transposed "
            "views of the mm outputs: one aten::add, then aten::add_) the head's gathered "
            "weight, the sum so "
            "far, the new chunk's gradient and their sum (4 x 128256 x 8192 x 2 B = 8.4 GB), "
            "with the 80 checkpointed layer inputs (5.4 GB), the chunks' loss gradients "
            "(0.9 GB) and the prefetched layer (1.7 GB): 16.42 GB allocated against the "
            "README's 14.93 GB (its metric kind not stated; reserved taken by the reading, "
            "+36.6%); before the units: +36.7%, the root's unsharded head gradient not "
            "modelled either"
        ),
        "GT026": _TT_HEAD
        + "; README metric kind not stated (predicted allocated +8%; the FSDP side streams' "
        "pools +12.1 -> +13.8%); at the stated 2 x 2048 tokens the step cannot hold less than "
        "the bf16 base's shard (70.6B x 2 B / 8 = 17.6 GB), the root's gathered embedding and "
        "output (FSDP2 keeps the root gathered: 4.2 GB), the 80 checkpointed layer inputs "
        "(5.4 GB) and one gathered layer (1.7 GB), 28.9 GB before any recomputation, against "
        "the figure's 29.6 GB (the 70B full fine-tune of the same table, GT025, is below its "
        "floor)" + _TT_SEP_TOKENS,
        "GT027": (
            "405B QLoRA FSDP2, standard CE; README '44.8 GB' unit read as GiB (notes; as GB the "
            "error grows). The measured value is below what batch 2 x 2048 packed tokens must "
            "hold when the backward starts: the NF4 shard (~26 GB), the root's gathered bf16 "
            "embedding and output (torch _fully_shard/_fsdp_state.py _lazy_init: 'For the "
            "root, do not reshard after forward'; 2 x 128256 x 16384 x 2 B = 8.4 GB), 126 "
            "checkpointed layer inputs (126 x 4096 x 16384 x 2 B = 16.9 GB) and the fp32 logits "
            "the loss saves (4096 x 128256 x 4 B = 2.1 GB): over 53 GB; the config's own "
            "batch_size is 1 (405B_qlora.yaml @30b8519e), amended: +37.7 -> +10.9%; the rest "
            "over as the table's other rows (GT020-GT026); the forward's dequantized weight "
            "also at each layer's down projection (Note [Forward tensors held at the down "
            "projection]): the replay reserves 0.36 GB less, +10.6 -> +9.9%"
        ),
        "GT028": _TT_NF4_INIT,
        "GT037": (
            _TT_NF4_LAYOUT.replace("reserves 12.19 GB", "reserved 12.19 GB")
            + "; since Note [Frozen down projection's input] (the MLP's three i-sized tensors "
            "alive through its backward transients, traced) the replay reserves 11.03 GB "
            "(-1.8 -> -10.4%) with the allocated peak unchanged (9.63 GB, at the forward's "
            "head): the step's blocks land elsewhere in the load's cache; reserved only, and "
            "the caching allocator under alpaca's varying shapes is not modelled (as GT033-GT036). "
            "Replays compared (helper gt037, snapshots at 4b34459^ / 4b34459): the whole "
            "difference is one 1,048,576,000 B segment. At the loss three "
            "(tokens x vocab) fp32 blocks (1,048,064,000 B) are placed: before, the third found "
            "the load's third 1.44 GB segment holding a 64 MiB (tokens x h, bf16) forward block "
            "and the final norm's 128 MiB fp32 block and opened a new segment; after (256 fewer "
            "events, 8 a layer, from the commit's two rules) best-fit put "
            "those two elsewhere and the loss block reuses the cached segment (the MLP's six "
            "180 MB segments also become three 360 MB: same bytes). No block is missing or "
            "mis-sized (the new order is the trace's): the row is sensitive to which "
            "cached hole two small blocks take, nothing to fix; with the loop's bound logits "
            "through the backward (Note [The current micro-batch's bound output]) the step's "
            "blocks land in the load's segments again: -10.4 -> +2.4%"
        ),
        "GT029": (
            "unexplained: torchtune Apr 2024 FSDP1 LoRA recipe, AC off; not FSDP1's unshard "
            "stream pool (Note [FSDP1 unshard stream pool]: the root's and two layer units' "
            "gathers moved to the unshard stream, modelled: -32.4% unchanged, the peak is the "
            "forward's activations); not the FSDP1 "
            "sync_module_states init (the same rule as fsdp_qlora's, tried: -36.4 -> -36.7%), "
            "nor the recipe's held logits and lora_dropout 0.05 (amended: -36.4 -> -33.8%) or "
            "FSDP1's side streams (-33.8 -> -32.1%); "
            "not the NCCL recordStream pile-up torchtune PR #843 fixed (TORCH_NCCL_AVOID_"
            "RECORD_STREAMS=1 from bec7babe, 2024-04-23) in rank 0's logged figure: it is in the "
            "non-zero ranks' init, and train() calls cleanup_before_training (empty_cache, "
            "reset_peak_memory_stats). A candidate for the table's figure, measured, not landed "
            "(helper rows1, benchmarks/fsdp1_init_record_stream.py: torch 2.2.2 FSDP1's init "
            "replayed per rank on trainmem's allocator): each unit's broadcast buckets (c10d "
            "comm.cpp broadcast_coalesced: 250 MiB, a new cat, or for one tensor the tensor "
            "itself) are NCCL-recorded, so their blocks wait for the NCCL stream; rank 0's host "
            "waits for its stream at each unit (the blocking copy from the CPU model), the other "
            "ranks' never before the barrier (to_empty, no copy). Rank 1's init then reserves "
            "8.53 GB if its GPU keeps up and 21.62 GB at the most lag the code allows (rank 0: "
            "8.53-8.73 GB); the README calls its column the 'minimum memory requirements', "
            "'Peak Memory per GPU', which rank 1's init would set if the column is the most any "
            "GPU of the run held (read off the device, not rank 0's reset log). Not landed, and "
            "the upper bound is not the code's consequence (second look, helper rows029): rank "
            "1's host does never wait (BroadcastWork::finish -> ProcessGroupNCCL "
            "WorkNCCL::wait makes the current stream wait for the NCCL stream, the host only "
            "under TORCH_NCCL_BLOCKING_WAIT=1), but a recorded block needs no host wait to be "
            "reused: the caching allocator's process_events, at every malloc, returns it once "
            "its NCCL-stream event has completed (c10/cuda/CUDACachingAllocator.cpp; spec "
            "2.8). Rank 1's broadcast of a unit completes once rank 0 has issued it, after rank "
            "0's blocking copy of that unit, so the pile-up is what rank 1's host has enqueued "
            "less what rank 0's has issued: rank 1 is ahead (per unit it allocates with "
            "to_empty where rank 0 copies from host memory) by the ratio of the two hosts' "
            "speeds, in no source. With rank 0 "
            "having issued a share p of the bytes rank 1 has enqueued (the benchmark's pace), "
            "rank 1 reserves 8.73 / 15.25 / 18.50 / 20.39 / 21.62 GB at p = 1 / 0.5 / 0.25 / "
            "0.1 / 0; the measured 20.95 GB needs p < 0.1; no figure the recipe logs holds it "
            "(cleanup_before_training on every rank, only rank 0 logs); and at p <= 0.5 the May "
            "table's GT043 (the full recipe, never given the variable, 8 x A100 80GB, 70.4 GB) "
            "would reach the allocator's capacity (84.5 GB; GT032: at most 18.1 GB, under its "
            "step). "
            "The same commit's docs/source/tutorials/lora_finetune.rst (fef3ed1, line 252) "
            "runs this config 'with two GPUs (each having VRAM of at least 16GB)', which the "
            "prediction (14.2 GB reserved) fits and the README's 20.95 GB does not. Read and "
            "ruled out in torch 2.2.2's FSDP1 (the release of the rows' week): the frozen "
            "decoder-layer units are resharded in backward by the multi-grad hook on their "
            "inputs (fsdp/_runtime_utils.py ``_register_post_backward_reshard_only_hook``; only "
            "layer 0, whose input needs no gradient, waits for the final callback's "
            "``_catch_all_reshard``, 0.4 GB), the root keeps its 0.5 GB unsharded through the "
            "step (``_post_forward_reshard``: not for the root), all-gathers are rate-limited "
            "(``limit_all_gathers``: two in flight), the LoRA leaves are units of their own "
            "(utils/_distributed.py ``lora_fsdp_wrap_policy``), so no flat gradient spans a frozen "
            "weight; none of these is GBs. The gap (6.8 GB) is about one bf16 parameter shard "
            "(6.74 GB). The May table's row for this recipe and config (GT039, @0217d44c, after "
            "bec7babe) reports 16.2 GB at a larger batch; the one log line that precedes "
            "cleanup_before_training is rank 0's 'Memory Stats after model init' "
            "(memory_stats_log: max_memory_reserved since the process started, through FSDP's "
            "sync_module_states broadcasts, whose buckets NCCL record_streams), so a README "
            "figure taken from it would carry the init's pile-up; which line the README took is "
            "in no source here. Read and ruled out (helper under1): the configuration as run: "
            "7B_lora.yaml has dtype bf16, batch_size 2 and enable_activation_checkpointing "
            "False at every commit from e7e310a2 (Apr 2) to fef3ed1, the recipe casts rank 0's "
            "CPU model with model.to(torch.bfloat16) before FSDP, and alpaca_dataset's "
            "max_seq_len 512 is enforced (modules/tokenizer.py tokenize_messages truncates), so "
            "no fp32 model, larger batch or longer sample; how the figure was logged: train() "
            "calls memory_stats_log (reset_stats=True) after every micro-batch while "
            "total_training_steps % 100 == 0 (the 31 micro-batches before the first optimizer "
            "step, then 32 of every 100th step) into the DiskLogger only, so each figure is the "
            "reserved level of rank 0 at that point of one run (no empty_cache in the loop); "
            "alpaca's varying lengths are too small an effect here: 64 earlier steps of random "
            "lengths in 60-512 (--earlier-seq-lens, three draws, for size only) reserve 14.61-"
            "15.29 GB (-30.3 to -27.0%). What the figure fits instead, for size only and "
            "against the table's '2 x RTX 4090': the same recipe on one rank (is_distributed() "
            "accepts WORLD_SIZE 1, and FSDP1 then switches to NO_SHARD: torch "
            "distributed/fsdp/_init_utils.py ``_init_core_state``, so the whole bf16 model "
            "stays on the GPU) is predicted at 19.48 GB (-7.0%; --fsdp no-shard or full-shard "
            "alike); not amended, no source says so"
        ),
        "GT032": (
            "torchtune Apr 2024 FSDP1 full fine-tune recipe: FSDP1's unshard stream pool (Note "
            "[FSDP1 unshard stream pool]: torch 2.2.2 FSDP1's defaults, BACKWARD_PRE and "
            "limit_all_gathers, with trainable layer units hold the root's and three layers' "
            "unsharded flat parameters on the unshard stream, one freed and pending on the "
            "compute stream; checked on torch's FSDP1 on the CPU): -11.5 -> -9.7%; then FSDP1's "
            "flat blocks (Note [FSDP1 flat blocks of a layer unit]: one sharded parameter, "
            "gradient and Adam state block per layer unit, 101 MB each, where per-tensor "
            "8.4 MB shards of q / k / v / o had left 20 MiB segments part empty; traced on "
            "torch's FSDP1): -9.7 -> -11.2%; then the root unit's flat gradient (Note [FSDP1 "
            "flat gradient of the root]: the head's 262 MB unsharded bf16 gradient, a view's "
            "of the root's flat parameter, alive through the layers' backward until the "
            "root's post-backward; traced on torch's FSDP1): -10.6 -> -6.8%; before them, "
            "FSDP1's side streams (sharded "
            "gradients in the post-backward stream's pool, which cannot take the forward's "
            "freed blocks) -20.2 -> -11.6%; the rest unexplained: not the FSDP1 "
            "sync_module_states init (tried: -20.2% unchanged), nor the loop's held logits "
            "(amended: under 0.1 point), nor the recipe's transposed loss (amended: -11.6 -> "
            "-11.3%); a candidate not modelled: each layer's 404 MB "
            "unsharded gradient is record_stream'ed to the post-backward stream "
            "(_post_backward_hook) and, without TORCH_NCCL_AVOID_RECORD_STREAMS (set only in "
            "the LoRA recipe, bec7babe), to NCCL's, so its block is reusable only once those "
            "streams pass it: how many pile up depends on how far the CPU runs ahead of the GPU. "
            "Read (helper nccl): NCCL's record adds no later point than FSDP1's own, as FSDP1's "
            "collectives are synchronous (async_op=False: the issuing stream waits on the NCCL "
            "work, and FSDP1 frees after issuing, so the NCCL stream's event at the free is the "
            "same collective's end); the replay completes such frees at the next malloc (Note "
            "[Cross-stream frees]), the least lag. The most lag FSDP1's host synchronisation "
            "allows (_runtime_utils.py, read at torch 2.13, the rules of Note [FSDP1 unshard "
            "stream pool]): the limiter (_limiter_utils.py, two in flight) syncs on "
            "compute-stream free events only, and the compute stream passes layer j's "
            "reduce-scatter only by waiting on layer j - 2's all-gather, issued after it on "
            "the same NCCL stream (_pre_backward_hook -> wait_stream(unshard_stream)), so up "
            "to about three layers' gradients may be pending. Tried, not landed: one or two "
            "more 404 MB gradients held on the compute stream over the backward stack move "
            "GT032 -11.2 -> -9.4 / -7.6%, GT041 +8.6% unchanged (its peak is elsewhere), GT043 "
            "+15.9% / +20.8% (the same recipe, already over; three held: -5.9%, +23.2%); "
            "the count between 0 and 3 is timing, in no source, so choosing one would fit the "
            "row. Not the non-zero ranks' init either (the record_stream pile-up of FSDP1's "
            "sync_module_states broadcasts, benchmarks/fsdp1_init_record_stream.py): on 4 ranks "
            "at most 18.12 GB, under the step"
        ),
        "GT033": _TT_2024,
        "GT034": _TT_2024,
        "GT035": _TT_2024,
        "GT036": _TT_2024,
        "GT039": _SEQ_OR_AC,
        "GT040": (
            _NEAR_CAPACITY + "; paged optimizer state; the maintainers did not reproduce the "
            "README's 24.1 GB: torchtune PR #961 (2024-05-10, closed) measured 20.2 GB "
            "allocated ('and similar for reserved') with every input forced to 2048 tokens, "
            "batch_size=4, 7B_full_low_memory, and its reviewer 22.3 GB on an A100; predicted "
            "22.4 GB"
        ),
        "GT042": _SEQ_70B,
        "GT043": (
            "over since FSDP1's side streams (and their unshard stream pool, Note [FSDP1 unshard "
            "stream pool]: a third layer's gathered parameters in the backward, +12.9 -> "
            "+15.3%; FSDP1's flat blocks per layer unit, Note [FSDP1 flat blocks of a layer "
            "unit]: +15.7 -> +15.9%) (the sharded gradients' 17 GB in the post-backward "
            "stream's pool, apart from the forward's activation blocks: -11.8 -> +14.4%): the "
            "README's 'Seq Length = 4096' as for GT042, which cannot be the batch length there "
            "(the length of alpaca's longest batches is in no source here); PagedAdamW state "
            "pages to host (notes); AC/GA only the CSV's reading; the loop's held logits "
            "amended (-13.3 -> -11.8%); the table's memory column is the lowest memory of any "
            "run, not necessarily at the stated setting (torchtune issue #925: 'capture lowest "
            "memory utilization AND peak tokens/sec for each model'); the loop's bound logits "
            "through the backward at that length (Note [The current micro-batch's bound "
            "output]): +15.9 -> +19.9%"
        ),
        "GT047": _TITAN_CP,
        "GT048": _TITAN_CP,
        "GT049": _TITAN_CP,
        "GT050": _TITAN_CP,
        "GT055": _TITAN_T4,
        "GT056": (
            "unexplained: 405B 3D parallel, 1F1B (-5.3 -> -7.9% with DTensor sequence "
            "parallelism's collective copies, which moved GT054 from +12.6 to -0.9%)"
        ),
        "GT057": (
            "unexplained: 405B 3D parallel, interleaved 1F1B (+10.2 -> +7.2% with DTensor "
            "sequence parallelism's collective copies)"
        ),
        "GT061": "unexplained: 405B TP x PP x CP 8 at 262k tokens",
        "GT062": _FLOAT8_AG,
        "GT063": _FLOAT8_AG,
        "GT070": (
            "explained (-65.7 -> +3.3%): DeepSpeed v0.8.0 ZeRO-3 (the README @73d7224b asks for PR "
            "#2653, merged as v0.8.0) with accelerate 0.15's config (zero3_init_flag, offload "
            "of parameters and optimizer, no bucket sizes: DeepSpeed's defaults). Note "
            "[DeepSpeed ZeRO-3 parameter gathers]: one GPU gathers too; the prefetcher runs "
            "ahead to stage3_max_live_parameters (1e9 fp32 elements, 4.0 GB) while the layers "
            "run, and fetches the tied 250880 x 4096 output weight (4.1 GB) as the last layers "
            "run, beside the host partition's copy on the GPU (4.1 GB); "
            "TrainingConfig.zero3_linear_saves_input: zero.Init's persistent F.linear "
            "replacement saves every frozen linear's input (+59 MB a layer); lora_dropout 0.1 "
            "amended from the script. The script prints MiB (b2mb), so '18.1GB' may be 18.1e3 "
            "MiB (19.0e9 B, then -1.5%)"
        ),
        # the litgpt config-hub rows GT097-GT113 are within 5% with litgpt's loop (Note [The
        # previous micro-batch's graph]), its untied output head (FrameworkConventions.
        # untied_output_head) and their yamls' amendments (_LITGPT_HUB)
        "GT114": (
            "approximate source value ('22 GB/GPU', method not stated); "
            + _FSDP1_REENTRANT
            + " (amended from the script's use_reentrant=True; with the adapters' input cast "
            "dropped: -5.8 -> -10.4%; still under, not explained). Re-read (training/"
            "fsdp-qlora-distributed-llama3.ipynb and scripts/run_fsdp_qlora.py @57cab54 / "
            "4a0caad, Apr 2024): the config is the row's (max_seq_len 3072, batch 1, GA 2, "
            "adamw_torch, 'full_shard auto_wrap offload', backward_pre, use_orig_params false; "
            "LoraConfig r 16, alpha 8, lora_dropout 0.05, all-linear: the dropout's p does not "
            "change its tensors), and the notebook itself says that at the end of the "
            "training GPU memory rises by about 10% while the model is saved "
            "(FULL_STATE_DICT; its REF is peft v0.10.0's FSDP guide, an 8 x H100 LoRA run, not "
            "this one). Save read at the notebook's pins (transformers 4.40.0, accelerate "
            "0.29.3, torch 2.2.2): the script's trainer.save_model() under FULL_STATE_DICT and "
            "each epoch's checkpoint (save_strategy epoch: Trainer._save_checkpoint) both gather "
            "with offload_to_cpu=True and rank0_only=True (accelerator.py get_state_dict: "
            "FullStateDictConfig(offload_to_cpu=True, rank0_only=True); utils/fsdp_utils.py "
            "save_fsdp_model sets both for num_processes > 1), and torch's FULL_STATE_DICT "
            "hooks unshard one FSDP unit at a time (fsdp/_unshard_param_utils.py "
            "_unshard_fsdp_state_params: off rank 0 the gathered flat parameter is freed at "
            "once; on rank 0 _flat_param.py to_cpu copies it to the host and frees it before "
            "the children are visited, re-gathering it only to reshard). So the save holds at "
            "most one unit's gathered flat parameter and its shard's H2D copy (the root: "
            "embedding, head and norm, 4,202,708,992 + 1,050,677,248 B), no activation, "
            "gradient or logits: it cannot raise the step's allocated peak (15.2 GiB "
            "predicted); replayed after the step its blocks come from the step's cache "
            "(reserved unchanged, 18.57 GB), so no save phase is modelled and nothing fitted. "
            "Left: real FSDP1 gathers the step's units on its unshard stream (Note [FSDP1 "
            "unshard stream pool], not yet applied to accelerate-fsdp / hf-trainer) while the "
            "save gathers on the computation stream (_unshard(state, handle, computation_stream, "
            "computation_stream)), so with that convention the root's 4.2 GB block could need "
            "a new default-stream segment: the only way the save could raise reserved. "
            "The notebook's pinned versions (transformers 4.40.0, torch 2.2.2, bitsandbytes "
            "0.43.1; amended, _PHILSCHMID_DQ): -9.9 -> -6.9 % (4.40's Llama upcasts and shifts "
            "its 128,256-wide logits in the model: +0.47 GB of cached blocks, allocated peak "
            "unchanged; torch 2.2.2's and bitsandbytes < 0.43.2's rules +0.09 / +0.28 GB of "
            "activations). accelerate's fp32 outputs do not apply: the logits leave 4.40's "
            "Llama in fp32 (Note [accelerate's fp32 outputs]). transformers 4.40's LlamaAttention "
            "keeps its own rotary cos / sin tables (ModelSpec.layer_rope_cache_values; 2 x 8192 x "
            "128 bf16 values a layer of Meta-Llama-3-70B, amended from the llama-3.1 preset's "
            "131072 positions: _LLAMA3_70B): -6.9 -> -5.4 %"
        ),
        "GT115": _FSDP_QLORA_DQ,
        "GT116": _FSDP_QLORA_DQ,
        "GT117": _FSDP_QLORA_CACHE + _FSDP1_STREAMS,
        "GT125": _FSDP_QLORA_CACHE,
        "GT118": _FSDP_QLORA_CACHE + _FSDP1_STREAMS,
        "GT119": _FSDP1_LAYOUT,
        "GT127": _FSDP_QLORA_DQ,
        "GT128": (
            "22.98 GiB reserved on a 24 GiB RTX 3090, above the 22.67 GiB the replay's capacity "
            "was with the A100's 544 MiB pair communicator; without peer access NCCL's buffers "
            "are host memory (Note [NCCL without peer access]): 23.20 GiB now, which the replay "
            "does not reach (no free-and-retry), so the row's error is not the capacity's; "
            + _FSDP_QLORA_DQ
        ),
        "GT041": (
            "over by the unshard stream pool's third layer (Note [FSDP1 unshard stream pool]: "
            "+3.0 -> +8.9%; FSDP1's flat blocks per layer unit, Note [FSDP1 flat blocks of a "
            "layer unit]: +8.9 -> +8.6%), at the card's capacity: the README's 24.1 GB on a "
            "24 GB RTX 4090 "
            "(the CSV's gpu column and notes: near capacity); the reading has no --gpu, so the "
            "replay runs without the card's capacity (with it: -2.0%, the allocator freeing its "
            "cache and retrying)"
        ),
        "GT126": (
            "near the card's capacity (22.38 GiB measured on a 4090, 23.16 GiB of capacity): the "
            "replay meets it when a (tokens x vocab) fp32 block of the loss, 2.93 GiB, does not "
            "fit above 20.39 GiB reserved; it frees its cache (one retry) and never rises again. "
            "The allocated peak is 15.87 GiB with bitsandbytes 0.43.0 or >= 0.43.2 (the saved "
            "inputs are the recomputed layer's only); the version changes the order of the "
            "blocks before that request (-2.0% with >= 0.43.2's); unlimited, the replay "
            "reserves 26.2 GiB, 25.2 of it the default stream's large pool (20 segments of "
            "516 MiB, the MLP's b s I bf16 blocks; three of 3000 MiB, the loss's): its reuse "
            "of those blocks across checkpointed layers and recomputations is worse than the "
            "real run's. " + _FSDP_QLORA_DQ
        ),
        "GT129": (
            "FSDP1 CPU offload of a 70B QLoRA: the double-quantized statistics stay on the GPU "
            "(1.07 GB, Note [bitsandbytes statistics under sharding]; -26.0 -> -19.9%); "
            "train.py's loop binds ``output`` until after the optimizer step (FrameworkConventions"
            ".loop 'step', e4968fd / 50efa1e: ``output = None`` only then), so the bf16 logits "
            "(2 x 2048 x 32000 x 2 B = 262 MB) live through the backward: -17.4 -> -15.6%; not "
            "NCCL's record_stream (helper nccl): frozen layer units make no flat gradient, and "
            "the offloaded shard's H2D copy, the all-gather's input, is freed after the "
            "synchronous all-gather its stream waited on, so a pending copy is one layer's "
            "shard, not GBs; still "
            "under by ~2.3 GB, unexplained: not the FSDP1 load (modelled) nor load_and_quantize "
            "(measured, helper gt129, session 24, benchmarks/fsdp_qlora_load_quantize.py: "
            "train.py 50efa1e empties the cache after it, so only segments holding a live "
            "quant_state tensor stay reserved; a 70B MLP's 3.5 MiB uint8 absmax is the one kept "
            "block in the large pool, 240 of them; bitsandbytes 0.43.0's order replayed before "
            "the FSDP1 init with the row's timeline adopting the kept blocks: serial, the load "
            "leaves 0.13 GB beyond its 1.09 GB kept (0.27 with a shard boundary inside a layer) "
            "and the run moves +0.07 GB, -14.4 -> -14.0% (+0.13 GB, -13.6%, shifted); 2-5 "
            "workers interleaved op by op, round-robin and 10 random orders each: 0.10-1.09 GB "
            "left beyond the kept blocks, the run moves -0.24 .. +0.14 GB (-15.9 .. -13.6%), "
            "the step reusing the pinned segments' free space on the default stream; even "
            "unreused, the most any tried order left is 1.09 GB, under half the gap; FSDP1's "
            "lazy init (_flat_param.py init_flat_param_attributes: each unit's padded "
            "unsharded flat parameter allocated and freed on the default stream, the root's "
            "1000 MiB first) moves nothing, the load's cached blocks hold it. The one direct "
            "reading of the load, "
            "benchmarks_03_2024.md's 'about 3.72GiB (see reserved_after_model_wrap)' for "
            "GT115's command, is 3.33 GiB in trainmem's load (3.43 with "
            "--transformers-version 4.40.0's rotary tables), load_and_quantize adding 6 MB: "
            "the FSDP1 init's reserved is short by 0.39 GiB at 7B. Holding each "
            "sync_module_states broadcast bucket to its unit's end (ProcessGroupNCCL "
            "collective() records the NCCL stream on its input, TORCH_NCCL_AVOID_RECORD_STREAMS "
            "off by default; BroadcastWork::finish's wait() does not block the host, so the "
            "unit's flat parameter, allocated next, finds the bucket's block pending) gives "
            "3.67 GiB there, but GT129 -14.4 -> -14.6% and the 17 fsdp_qlora rows go both ways "
            "(GT115 -9.3 -> -2.5%, GT117 -4.5 -> -2.1%, GT124 +2.1 -> -2.1%, GT116 -4.0 -> "
            "-6.8%, GT127 -1.7 -> -6.2%, GT123 +2.2 -> +3.9%; sum of |error| 71.3 -> 73.5 "
            "points): not landed)"
            + _FSDP1_STREAMS
            + "; the versions of the runs (helper under1): benchmarks_03_2024.md quotes "
            "``reserved_after_model_wrap`` and 'peak reserved memory', wandb keys train.py "
            "first logs at 50efa1e (2024-03-26; before it 'memory_peak' was "
            "max_memory_allocated), so the runs are late March: torch 2.2 (the README's '>= "
            "2.2', 2.3 came out on Apr 24) and transformers 4.39 (unpinned through "
            "llama-recipes until 467933f excluded 4.38 / 4.39 on Apr 18), whose "
            "LlamaForCausalLM upcasts the logits (``logits.float()``) and whose ``output`` "
            "train.py holds until after the backward. Tried, not landed: --torch-version "
            "2.2.2 for the fsdp_qlora rows moves GT129 -17.4 -> -15.9%, GT128 -8.2 -> -5.4%, "
            "GT127 -6.3 -> -5.7%, but GT130 / GT131 +1.9 -> -9.4%; with --transformers-version "
            "4.39.3 as well GT126 -8.9 -> -13.3% and GT130 -> -15.5%: the near-capacity rows "
            "(4090 / 3090, 22.4-22.5 GiB reserved measured) meet the replay's flush-and-retry "
            "earlier, whose reserved then stays below what the real runs reached. "
            "Helper rows2 (session 16): the window of the runs is transformers 4.39-4.40 either "
            "way (50efa1e, 2024-03-26, to benchmarks_03_2024.md, 2024-05-03; the README "
            "excluded 4.38 / 4.39 from Apr 18, 4.41 came out May 17), and the two releases run "
            "the same code for every rule here. Landed from them, effective with "
            "--transformers-version: each attention layer's own fp32 rotary tables "
            "(ModelSpec.layer_rope_cache_values: from_config builds them in the fp32 default "
            "dtype, 2 x 4096 x 128 x 4 B = 4 MiB a layer, 320 MiB here), the fp32 logits the "
            "model returns and train.py's loop holds (ModelSpec.returns_fp32_logits, 262 MB "
            "here) and the loss's shifted copy as its own block (loss.py shifted_copy_bytes: "
            "the single (upcast + shifted) block of 6.29 GB at GT126's 12 x 2048 tokens found no "
            "cached hole and set off the replay's flush; two 3.1 GB blocks reuse the previous "
            "step's loss blocks). --transformers-version 4.40.0 on every fsdp_qlora row then "
            "moves GT129 -15.6 -> -12.9%, GT126 -8.9 -> +0.9%, GT127 -6.3 -> -1.3%, GT128 -8.2 "
            "-> -6.6%, GT115 -4.4 -> -2.4%, GT117 / GT118 -2.1 / -1.9 -> +0.6 / +0.8%, GT130 / "
            "GT131 +1.9 -> +2.5 / +2.6%, but GT119 -2.1 -> +7.0%, GT121 -2.0 -> +5.7%, GT123 "
            "+2.2 -> +10.8%, GT124 +2.1 -> +5.3% (the bs 4-8 rows without offload, whose "
            "replays reach the 3090's capacity: GT123 17.9 GB allocated, 24.9 GB reserved "
            "against 22.5 GB measured): sum of |error| over the 17 rows 73.6 -> 72.8 points; "
            "not amended (four rows' records would loosen). Measured, not landed: rank 0's "
            "load_and_quantize before FSDP (train.py 50efa1e: every Params4bit quantized on the "
            "GPU, bf16 weight 2n, fp32 absmax, packed n / 2, then the double quantization's "
            "uint8 absmax, its fp32 absmax, the nf4 code and the offset kept, the rest freed or "
            "moved to the CPU; then empty_cache) emulated with 1-5 interleaved workers leaves "
            "1.21-1.57 GB reserved (the kept statistics 1.09-1.12 GB) and replayed before the "
            "FSDP1 init moves GT129 +0.1 to +0.34 GB (-15.6 -> -14.9 .. -13.4%); "
            "n_loading_workers = min(cpu_count / 2, 8 x total_memory / 40e9 x 70e9 / params) "
            "= min(?, 5) on a 3090 depends on the CPU count, which no source gives. "
            "Helper rows129 (session 17), the recomputed layer 79 (the peak, its MLP's "
            "backward): torch's reentrant CheckpointFunction.backward (torch 2.2.2 "
            "utils/checkpoint.py: outputs = ctx.run_function(*detached_inputs), then "
            "torch.autograd.backward(outputs_with_grad, args_with_grad), only grads returned) "
            "holds the recomputed output, b s h bf16 = 64 MiB; modelled (Note [Reentrant "
            "checkpoint's recomputed output], helper reent2: measured on torch's own "
            "checkpoint on the CPU, no other rule holds it): GT129's allocated grows 67 MB "
            "and its reserved not at all (the block lands in cached segments). The same "
            "binding keeps the recomputed graph, and with it bitsandbytes 0.43.0's "
            "MatMul4Bit ctx.tensors inputs, until the checkpoint returns, and peft 0.10's "
            "LoRA branch (dropout, lora_A, lora_B, the scaling: made after the base's "
            "MatMul4Bit and clone, so higher sequence numbers) runs its backward first: by "
            "hand, at down's MatMul4Bit.backward the LoRA input gradient (c t i = 224 MiB), "
            "the dequantized weight (448 MiB) and grad_A (224 MiB) are alive with down's "
            "input (224 MiB) kept and its adapter's mask, dropout output and lora_A output "
            "(336.5 MiB) released: the layer holds 3,028 MiB beyond the rest against the "
            "formulas' 2,872 (+156 MiB, about one point if reserved followed), not modelled. "
            "Nothing else on the GPU at the peak is missing: the statistics (1.01 GiB, 1,843 "
            "blocks), the root unit's gathered embedding and head (1000 MiB, kept to the "
            "final callback: frozen, and its inputs need no grad, so torch 2.2.2 "
            "_register_post_backward_reshard_only_hook hooks no tensor), the two layers' "
            "gathers and H2D shard copies on their streams are modelled. At the runs' "
            "versions (--torch-version 2.2.2 --transformers-version 4.40.0 or 4.39.3) GT129 "
            "is -8.5 % (allocated 11.96 GB, reserved 14.66 GB), its rest as above; the "
            "blocker is the other fsdp_qlora rows at those versions (GT119 +8.4, GT121 +5.0, "
            "GT122 +4.6, GT123 +10.8, GT124 +5.3 %), and benchmarks_03_2024.md's own peak "
            "allocated figures say the versions over-count there too: GT117 / GT118 "
            "(LoRA 7B, 512 / 2048 tokens) 8.28 / 9.16 GiB measured, trainmem +0.7 / +0.8 % "
            "at its defaults and +1.8 / +2.8 % at the runs' versions (fp32 logits held, "
            "per-layer rotary tables) while it held two gathered layers at the MLP's backward; "
            "with one (Note [FSDP1 backward prefetch under adapter units], now under train.py's "
            "reentrant checkpointing inside the units too, checked on torch's FSDP1) -0.1 / "
            "-1.8 % at the defaults and +1.0 / +0.3 % at the runs' versions, no reserved "
            "figure moving (the unshard stream's pool keeps the block). Helper rows129 (session "
            "18): no file of fsdp_qlora ever pinned a version (no requirements file; the README of "
            "8a89266, 2024-03-26: llama-recipes and fastcore from pip, bitsandbytes>=0.43.0, "
            "'PyTorch >= 2.2 is recommended'); the runs (after 50efa1e, 'February and March 2024') "
            "had transformers 4.39.x (4.40.0 is of Apr 18), whose LlamaSdpaAttention always gets "
            "the materialised causal mask (no _ignore_causal_mask_sdpa before 4.40.0) and so the "
            "memory-efficient kernel after q / k / v ``.contiguous()``, not flash: not modelled, "
            "--transformers-version 4.39.3 answers as 4.40.0. One by one, --torch-version 2.2.2 "
            "moves these rows only through SDPA's expanded GQA keys and values (GT127-GT131), "
            "which transformers before 4.54 makes on any torch (``repeat_kv``; "
            "TRANSFORMERS_SDPA_GQA_SINCE, landed: --transformers-version 4.40.0 alone now gives "
            "GT129 -8.5 %, was -11.7 %); --transformers-version moves all the rows (fp32 logits "
            "held, the loss's shifted copy, rotary tables). GT119 / GT121 / GT122 at the versions "
            "(reserved 13.05 / 18.19 / 23.98 GB) do not reach the 3090's 24.91 GB of capacity; "
            "GT123 / GT124 want 25.2 / 25.3 GB and the replay's flush-and-retry ends at the "
            "capacity, while the runs' 22.48 / 23.66 GB are 2.4 / 1.2 GB below it: the replay "
            "reserves more before reaching the capacity, not at it. Where the split is known, it "
            "is the replay's: GT118 at the versions allocated +0.3 %, reserved +3.2 % (reserved "
            "beyond allocated 1.46 GB against the run's 1.14 GB; 1.10 GB at the defaults; at the "
            "versions two more 250 MiB segments for the loss's fp32 blocks beside the held fp32 "
            "logits). The formulas' checkpointed forward makes a layer's dropped blocks all live "
            "at once, the real no-grad forward holds a few (the generic path's trace of GT119's "
            "layer); freeing each at once instead (a bound, not a model) moves GT123 at the "
            "versions +10.8 -> -11.2 % but GT129 -8.5 -> -12.5 % and, over dev set 2 at the "
            "defaults, the median 2.4 -> 3.1 %, p90 9.9 -> 13.1 %, rows under by more than 10 % 3 "
            "-> 18: the simultaneous blocks stand in for reserved memory the runs hold for other "
            "reasons; not changed"
        ),
        "GT131": (
            "Mistral-7B-v0.2 has no sliding window; the v0.1 preset's 4096 window at 24576 "
            "tokens (notes)"
        ),
        # GT134 / GT135 are within 2% with transformers 4.48 GPTBigCode's returned presents
        # under checkpointing (attention.py returned_presents_bytes: each layer's fused c_attn
        # output kept until the loss; -11.8 / -10.4 -> +0.1 / +1.1%) on top of its loss on the
        # bf16 logits (ModelSpec.causal_lm_loss_in_logits_dtype)
        "GT141": _FMS_LORA_FSDP + _FLASH_NO_SLIDING_MASK,
        "GT142": "unexplained: fms-hf-tuning LoRA on 1 GPU",
        "GT143": _FMS_LORA_FSDP + _FLASH_NO_SLIDING_MASK,
        "GT144": _FMS_MIXTRAL_OVER,
        "GT145": _FMS_MIXTRAL_OVER,
        "GT146": _FMS_1GPU_4BIT + _FLASH_NO_SLIDING_MASK,
        "GT147": _FMS_FSDP_4BIT_OVER + _FLASH_NO_SLIDING_MASK,
        "GT149": _FMS_FSDP_4BIT_OVER + _FLASH_NO_SLIDING_MASK,
        "GT151": _FMS_MIXTRAL_OVER,
        "GT153": _FMS_MIXTRAL_OVER,
        "GT154": _FMS_FSDP_4BIT_OVER,
        "GT155": _FMS_1GPU_4BIT,
        "GT156": _FMS_FSDP_4BIT_OVER + _GPTQ_TRITON + _FLASH_NO_SLIDING_MASK,
        "GT157": _FMS_1GPU_4BIT,
        "GT158": _FMS_FSDP_4BIT_OVER + _GPTQ_TRITON + _FLASH_NO_SLIDING_MASK,
        "GT159": _FMS_1GPU_4BIT + _GPTQ_TRITON + _REENTRANT_OUTPUT,
        "GT160": _FMS_FSDP_4BIT_OVER + _GPTQ_TRITON,
        "GT167": _VISION_TOKENS,
        "GT168": _VISION_TOKENS,
        "GT169": _VISION_TOKENS,
        "GT170": (
            "unexplained: amended with the source's ZeRO-2 + overlap_comm (as read, stage 1: "
            "-8.9%), whose second 5e8-element ipg bucket (stage_1_and_2.py backward: 'Use "
            "double buffers ... when overlap_comm is enabled') is modelled; not modelled: under "
            "offload ZeRO-2 copies each reduced bucket's gradients to the CPU fp32 buffer and "
            "sets param.grad = None (async_inplace_copy_grad_to_fp32_buffer_from_gpu), so the "
            "full bf16 gradients predicted at the backward's end overstate the GPU's"
        ),
        "GT173": (
            "approximate source value ('~9GB'): the same README gives '~19GB' for the LoRA run "
            "its tutorial measures at 18.5 GB (GT172, -2.9%), so its '~' rounds to the nearest "
            "GB and the QLoRA peak lies in 8.5-9.5 GB (the tutorial, llama3.rst @20747cd: "
            "'below 10 GB'); predicted 7.96 GB, -6.4% from 8.5. Read and modelled, not at the "
            "peak: torchao's NF4 dequantization in eager mode (get_original_weight's int64 "
            "nibbles, 14 n bytes for the 14336 x 4096 linear, 0.82 GB, in each layer's forward "
            "and backward; tests/analytic/test_torchao_dequantize.py); the peak is the head's "
            "(the loop's previous fp32 logits beside this micro-batch's, and this micro-batch's "
            "bound through its backward, Note [The current micro-batch's bound output]: "
            "-11.5 -> -5.7%, 8.49 GB, -0.1% from 8.5). Ruled out (helper "
            "under2): the load's peak (predicted 9.28 GiB, bf16 linears quantized on the GPU) "
            "is not in the training logs, as recipes/lora_finetune_single_device.py @20747cd "
            "logs 'Memory Stats after model init' through utils.memory_stats_log, whose "
            "reset_stats=True calls torch.cuda.reset_peak_memory_stats (utils/memory.py)"
        ),
        "GT175": (
            "over, the measurement's reading: '72-80 GB (90-98%)' per GPU read off a "
            "screenshot, the upper end taken, which fsdp.md attributes to the end of the run "
            "('The slight increase in GPU memory at the end is when saving the model using "
            "FULL_STATE_DICT'); 98% of the H100's 81,559 MiB is 83.8e9 B (then +0.7%), so the "
            "monitor's 'GB' is likely 1000 MiB. The row's H100 amended from the CSV (+14.1 -> "
            "+5.5%): the allocator frees its cached blocks and retries near the card's capacity "
            "(the replay without a capacity held 7.4e9 B more); accelerate's MixedPrecision "
            "gathers the fp32 adapters in bf16, so peft makes no fp32 copy of their input "
            "(trainmem.analytic.lora ``adapter_matmul_bytes``); FSDP1's unshard stream pool "
            "applied to accelerate's FSDP1 (Note [FSDP1 unshard stream pool]: accelerate's "
            "plugin keeps limit_all_gathers=True, peft examples/sft/configs/fsdp_config.yaml "
            "BACKWARD_PRE; the root's and the layers' gathers in that stream's pool, the "
            "sharded gradients in the post-backward stream's): reserved +6.1 -> +3.7%, the "
            "replay near the card's capacity; the units' bf16 shards cast on FSDP1's "
            "pre-unshard stream (Note [FSDP1 16-bit shard on the pre-unshard stream], fp32 "
            "weights under bf16-mixed, as trainmem reads *-mixed): +3.7 -> +4.1%; a script "
            "loading the base in bf16 would cast none"
        ),
        "GT176": (
            "unexplained: DeepSpeed ZeRO-3 QLoRA; the double-quantized statistics are whole on "
            "each rank (Note [bitsandbytes statistics under sharding]) and the script's "
            "nested quant and lora_dropout 0.1 amended: -5.6 -> -7.8%; DeepSpeed ZeRO-3's "
            "prefetch pool up to stage3_max_live_parameters, counted in the packed 4-bit "
            "storage's elements (Note [DeepSpeed ZeRO-3 parameter gathers]): -7.8 -> -6.2%; "
            "DeepSpeed's flat buffers at init (Note [DeepSpeed's flat buffers at init]: its "
            "LoRA tensors' partitions, gradients and states in flat blocks, the same bytes, "
            "0.56 GB less reserved): -5.7 -> -7.4%"
        ),
        "GT174": (
            "unexplained, over by 3.5 GB: '64 GB (80%)' read off a system-monitor screenshot "
            "(the H100 amended from the CSV: +4.8 -> +5.4%, its CUDA context); "
            "DeepSpeed ZeRO-3's prefetch pool modelled at its stage3_max_live_parameters "
            "ceiling, 1e9 bf16 elements (Note [DeepSpeed ZeRO-3 parameter gathers]; before: "
            "one 70B layer and the 0.9 h^2 bucket): +4.5 -> +5.7%"
        ),
        "GT177": (
            "accelerate FSDP CPU offload of a 70B QLoRA: the double-quantized statistics stay on "
            "the GPU (Note [bitsandbytes statistics under sharding]; -26.8 -> -15.7%); "
            + _PEFT_QLORA_FSDP
            + ": -16.4 -> +10.6%; dated to transformers 4.39 (the FSDP1 kept inputs, Note "
            "[FSDP1 frozen units under reentrant checkpointing], hold before 4.52 only): +8.6 "
            "-> +9.4%; over, not explained: the last layer's recomputation and "
            "transients as modelled, and the reading of a system-monitor screenshot"
        ),
        "GT178": (
            "accelerate FSDP QLoRA of a 70B; "
            + _PEFT_QLORA_FSDP
            + ": -0.8 -> +14.1%; dated to transformers 4.39 (as GT177): +13.0 -> +13.4%; "
            "over, not explained: the last layer's recomputation and "
            "transients as modelled, and the reading of a system-monitor screenshot (GT175, "
            "the same docs' monitor, reads as 1000-MiB 'GB' by its percentage: 35.6 such "
            "units are 37.3e9 B, +8.8%; not amended, this row's figure has no percentage to "
            "check the unit by); the allocator replay reserves 4.8 GB above the allocated peak "
            "(34.7 GB allocated), not analysed further"
        ),
    }
)
