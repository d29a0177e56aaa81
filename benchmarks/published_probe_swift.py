"""The published probe's second source (helper probe25): modelscope/ms-swift's benchmark of
Qwen-1 fine-tuning, run by ``published_probe.py`` after the Qwen README's cells.

Source: modelscope/ms-swift docs/source/LLM/Benchmark.md @4312aeb28776c8d2db32c64fc3f6bad590353f78
(4 Jan 2024; the tables are unchanged to cdb169b7, Jul 2024). Stated there: A100, CUDA 11.8,
torch 2.1.1, flash_attn 2.3.4, auto_gptq 0.5.1, bitsandbytes 0.41.3; every run ``swift sft`` on
``cls-fudan-news-zh`` (``--dataset_test_ratio 0 --save_strategy no``), defaults
``--max_length 2048 --batch_size 1 --gradient_checkpointing true --use_flash_attn true
--lora_rank 8 --lora_target_modules DEFAULT --gradient_accumulation_steps 16``; the dataset's
tokens (Qwen tokenizer) 3234.4 +- 2547.5, min 91, max 19548. "GPU Memory (GiB)".

Metric, from the same commit's code: swift/trainers/trainers.py ``Seq2SeqTrainer.train``
records ``torch.cuda.max_memory_reserved(i) / 1024**3`` after ``trainer.train()``: reserved,
GiB, no CUDA context. Compared here with trainmem's ``reserved`` in GiB.

Setup, from the same commit (swift/llm/sft.py, swift/llm/utils/argument.py, model.py,
template.py, scripts/benchmark/test_memory_time/run_single.py):
- the model's remote code (``get_model_tokenizer_qwen`` sets the config's ``bf16`` / ``fp16``
  flag, so ``QWenLMHeadModel.__init__`` casts the weights), ``--dtype AUTO`` -> bf16 (the
  GPTQ Int4 checkpoints: their ``torch_dtype`` fp16), and the HF Trainer's ``bf16`` / ``fp16``
  set from it (``select_dtype``): autocast over the 16-bit model, mapped as ``bf16-mixed
  --load-dtype bfloat16`` (``16-mixed`` for the GPTQ cells, whose base trainmem loads as it
  quantizes it); transformers ``>=4.33,<4.37`` (requirements/framework.txt): 4.36.2;
- LoRA: swift's own tuner (``tuner_backend='swift'``), r 8, alpha 32, dropout 0.05 on
  ``c_attn`` (``LoRATM.qwen``), Qwen-1's fused q / k / v linear: mapped as LoRA on ``q,k,v``
  (trainmem has no fused-qkv target; 3 adapters of r x h + h x r against one of
  r x h + 3h x r, 196,608 against 131,072 parameters a layer at h 4096, and three dropout
  copies of the layer input where swift keeps one);
- full: the same bf16 model and AdamW (``adamw_torch``): weights, gradients and moments in bf16;
- bnb int4: ``BitsAndBytesConfig`` nf4, double quantization, compute dtype bf16 (argument.py
  defaults), bitsandbytes 0.41.3; swift calls no ``prepare_model_for_kbit_training`` (not in
  swift/ at that commit; tuner.py ``prepare_model``), so the embedding, norms and head stay
  16-bit: ``--set prepare-kbit-training=false`` (the hf-trainer convention is peft's fp32
  upcast); in float16, not bf16 (helper bnbgap): ``get_model_tokenizer_qwen`` passes
  ``torch_dtype=None`` to ``from_pretrained`` (model.py), transformers 4.36.2 then forces
  float16 on a bitsandbytes model (modeling_utils.py: "We force the `dtype` to be float16,
  this is a requirement from `bitsandbytes`") and ``set_module_quantized_tensor_to_device``
  puts the unquantized weights on the GPU in it (the config's ``bf16`` flag casts only the
  meta weights in ``QWenLMHeadModel.__init__``): ``--load-dtype float16`` beside
  ``bf16-mixed`` (Note [A quantized base's other weights in another 16-bit dtype]); GPTQ
  int8 is not mapped (trainmem has no GPTQ int8).
- checkpointing: torch's non-reentrant checkpoint, ``--set checkpoint-reentrant=false``:
  ``get_model_tokenizer`` patches ``torch.utils.checkpoint.checkpoint`` to ``use_reentrant=False``
  by default (model.py ``fix_gradient_checkpointing_warning``) and Qwen-1's remote code calls
  it without the argument (modeling_qwen.py ``QWenModel.forward``), so bitsandbytes 0.41.3's
  ``MatMul4Bit`` keeps every layer's inputs through the backward in the bnb cells (Note
  [bitsandbytes' inputs under non-reentrant checkpointing]; helper bnbrest).
Not mapped: the 2-GPU cells (``device_map='auto'`` splits the layers over the GPUs with no
pipelining, which trainmem does not model), ``--use_flash_attn false`` (the remote code's own
attention), the other model families (no config.json offline here).

Lengths (the mapping's open part): batches are not padded to ``max_length``
(``data_collate_fn`` pads to the batch's longest sample) and ``--truncation_strategy delete``
drops the samples above it (template.py ``_encode``), so every micro-batch has its own
length, the longest a few tokens under ``max_length``. ``max_memory_reserved`` is the run's
peak, which depends on the lengths seen (Note [Steps of varying length],
``--earlier-seq-lens``). The probe prints two figures per cell: every step at ``max_length``
(what a user who enters only the length gets), and a band over 5 seeds where 63 steps (the
most ``--earlier-seq-lens`` takes) of lengths drawn from a gamma distribution with the
dataset's published mean and standard deviation, kept between 91 and ``max_length``, run
before the step at ``max_length``. The gamma shape is this probe's assumption (the dataset is
not read offline), not a value fitted to any cell; the real runs saw every sample of the
dataset (``max_length`` <= 2048) or 1000 of them, so 63 steps show fewer lengths than they did.
"""

from __future__ import annotations

import random
from statistics import median

SOURCE = (
    "https://github.com/modelscope/ms-swift/blob/4312aeb28776c8d2db32c64fc3f6bad590353f78/"
    "docs/source/LLM/Benchmark.md"
)

#: cls-fudan-news-zh's tokens per sample as Benchmark.md states them (mean, standard deviation,
#: shortest).
LENGTH_MEAN, LENGTH_SD, LENGTH_MIN = 3234.4, 2547.5, 91
SEEDS = range(1, 6)
EARLIER_STEPS = 63

_COMMON = [
    "--gradient-accumulation-steps", "16",
    "--optimizer", "adamw",
    "--framework", "hf-trainer",
    "--transformers-version", "4.36.2",
    "--torch-version", "2.1.1",
    "--gpu", "A100-80GB",
    "--set", "checkpoint-reentrant=false",
]  # fmt: skip
_CKPT_FA = ["--activation-checkpointing", "full", "--attention", "flash"]
_BF16 = ["--precision", "bf16-mixed", "--load-dtype", "bfloat16"]
_LORA = [
    "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05", "--lora-targets", "q,k,v",
]  # fmt: skip
METHODS: dict[str, list[str]] = {
    "LoRA": [*_LORA, *_BF16, *_CKPT_FA],
    "LoRA, all linear": [
        "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05",
        "--lora-targets", "all-linear",
        *_BF16, *_CKPT_FA,
    ],
    "LoRA, no checkpointing": [*_LORA, *_BF16, "--activation-checkpointing", "none",
                               "--attention", "flash"],
    "Full": [*_BF16, *_CKPT_FA],
    "LoRA, GPTQ int4": [*_LORA, "--quantize-base", "gptq-int4", "--precision", "16-mixed",
                        *_CKPT_FA],
    "LoRA, bnb nf4": [*_LORA, "--quantize-base", "nf4-dq", "--precision", "bf16-mixed",
                      "--load-dtype", "float16",
                      "--bitsandbytes-version", "0.41.3", "--set", "prepare-kbit-training=false",
                      *_CKPT_FA],
}  # fmt: skip

#: (table, method, model, max_length, batch size, Benchmark.md's cell in GiB)
ROWS: list[tuple[str, str, str, int, int, float]] = [
    ("Model Type & Max Length", "LoRA", "qwen-1.8b", 512, 1, 6.99),
    ("Model Type & Max Length", "LoRA", "qwen-1.8b", 1024, 1, 10.71),
    ("Model Type & Max Length", "LoRA", "qwen-1.8b", 2048, 1, 16.35),
    ("Model Type & Max Length", "LoRA", "qwen-1.8b", 4096, 1, 23.80),
    ("Model Type & Max Length", "LoRA", "qwen-1.8b", 8192, 1, 37.03),
    ("Model Type & Max Length", "LoRA", "qwen-7b", 512, 1, 18.01),
    ("Model Type & Max Length", "LoRA", "qwen-7b", 1024, 1, 21.73),
    ("Model Type & Max Length", "LoRA", "qwen-7b", 2048, 1, 27.74),
    ("Model Type & Max Length", "LoRA", "qwen-7b", 4096, 1, 35.31),
    ("Model Type & Max Length", "LoRA", "qwen-7b", 8192, 1, 48.41),
    ("Model Type & Max Length", "LoRA", "qwen-14b", 512, 1, 30.14),
    ("Model Type & Max Length", "LoRA", "qwen-14b", 1024, 1, 34.43),
    ("Model Type & Max Length", "LoRA", "qwen-14b", 2048, 1, 40.14),
    ("Model Type & Max Length", "LoRA", "qwen-14b", 4096, 1, 47.95),
    ("Model Type & Max Length", "LoRA", "qwen-14b", 8192, 1, 60.74),
    ("Model Type & Max Length", "Full", "qwen-1.8b", 512, 1, 18.16),
    ("Model Type & Max Length", "Full", "qwen-1.8b", 1024, 1, 18.62),
    ("Model Type & Max Length", "Full", "qwen-1.8b", 2048, 1, 35.11),
    ("Model Type & Max Length", "Full", "qwen-1.8b", 4096, 1, 31.62),
    ("Model Type & Max Length", "Full", "qwen-1.8b", 8192, 1, 38.93),
    ("Model Type & Max Length", "Full", "qwen-7b", 512, 1, 73.37),
    ("Model Type & Max Length", "Full", "qwen-7b", 1024, 1, 73.64),
    ("Model Type & Max Length", "Full", "qwen-7b", 2048, 1, 74.26),
    ("Model Type & Max Length", "Full", "qwen-7b", 4096, 1, 78.76),
    ("Quantization", "LoRA, GPTQ int4", "qwen-7b", 2048, 1, 19.21),
    ("Quantization", "LoRA, bnb nf4", "qwen-7b", 2048, 1, 23.85),
    ("Quantization", "LoRA, GPTQ int4", "qwen-14b", 2048, 1, 23.30),
    ("Quantization", "LoRA, bnb nf4", "qwen-14b", 2048, 1, 30.05),
    ("Quantization", "LoRA, GPTQ int4", "qwen-72b", 2048, 1, 54.86),
    ("Quantization", "LoRA, bnb nf4", "qwen-72b", 2048, 1, 74.87),
    ("Batch Size", "LoRA", "qwen-7b", 2048, 2, 43.11),
    ("Batch Size", "LoRA", "qwen-7b", 2048, 4, 63.81),
    ("Batch Size", "LoRA", "qwen-7b", 2048, 8, 76.14),
    ("Use Flash Attn & Gradient Checkpointing", "LoRA, no checkpointing", "qwen-7b", 2048, 1,
     37.70),
    ("LoRA Rank & LoRA Target Modules", "LoRA, all linear", "qwen-7b", 2048, 1, 27.87),
]  # fmt: skip


def earlier_lengths(max_length: int, seed: int) -> str:
    """``--earlier-seq-lens`` of one band run: :data:`EARLIER_STEPS` lengths drawn (seeded) from
    a gamma distribution with the dataset's published mean and standard deviation, those
    outside [``LENGTH_MIN``, ``max_length``] dropped as ``--truncation_strategy delete``
    drops them."""
    rng = random.Random(seed)
    shape = (LENGTH_MEAN / LENGTH_SD) ** 2
    scale = LENGTH_SD**2 / LENGTH_MEAN
    lengths: list[int] = []
    while len(lengths) < EARLIER_STEPS:
        n = int(rng.gammavariate(shape, scale))
        if LENGTH_MIN <= n <= max_length:
            lengths.append(n)
    return ",".join(str(n) for n in lengths)


def row_args(
    method: str, model: str, max_length: int, batch: int, paths: dict[str, str]
) -> list[str]:
    """``trainmem estimate`` arguments of one cell with every step at ``max_length``."""
    return [
        paths[model], "--seq-len", str(max_length), "--micro-batch-size", str(batch),
        *_COMMON, *METHODS[method],
    ]  # fmt: skip


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run(paths: dict[str, str]) -> tuple[list[float], list[float]]:
    """Print the cells' table; |relative error| of the fixed-length figures and of the band's
    medians (cells trainmem answers)."""
    from validate import _invoke_estimate, metric_of

    print(f"\nsource: {SOURCE}")
    print(
        "| table | method | model | max_length | batch | measured GiB (reserved) "
        "| every step at max_length GiB | error | band over 5 seeds GiB (median) | error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    fixed_errors: list[float] = []
    band_errors: list[float] = []
    for table, method, model, max_length, batch, cell in ROWS:
        args = row_args(method, model, max_length, batch, paths)
        head = f"| {table} | {method} | {model} | {max_length} | {batch} | {cell:.2f} |"
        answer, error = _invoke_estimate(args)
        fixed = None if answer is None else metric_of(answer, "reserved")
        if fixed is None:
            print(f"{head} {error or 'out of memory'} | | | |")
            continue
        band: list[float] = []
        for seed in SEEDS:
            earlier = earlier_lengths(max_length, seed)
            seeded, _ = _invoke_estimate([*args, "--earlier-seq-lens", earlier])
            reserved = None if seeded is None else metric_of(seeded, "reserved")
            if reserved is not None:
                band.append(reserved / 2**30)
        fixed_gib = fixed / 2**30
        fixed_errors.append(abs(fixed_gib - cell) / cell)
        if band:
            mid = median(band)
            band_errors.append(abs(mid - cell) / cell)
            shown = f"{min(band):.2f} .. {max(band):.2f} ({mid:.2f}) | {_pct(mid, cell)}"
        else:
            shown = "out of memory | "
        print(f"{head} {fixed_gib:.2f} | {_pct(fixed_gib, cell)} | {shown} |")
    return fixed_errors, band_errors
