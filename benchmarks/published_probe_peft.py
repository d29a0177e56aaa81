"""The published probe's sixth source (helper probe2, session 27): PEFT's method comparison
suite, a plain PyTorch loop measured on one L40S for each peft method on Llama-3.2-3B, run by
``published_probe.py`` after the diffusion cells.

Source: huggingface/peft method_comparison/MetaMathQA @51c2ff666b142d004c12609c9686cf17ca055751
(20 Jul 2026, "Update MetaMAthQA results (#3445)"): results/<method>--<experiment>.json, each
recording its run's train_config, peft_config, package versions (transformers 5.13.1, peft
0.19.2.dev0, torch 2.13.0+cu130, bitsandbytes 0.49.2) and GPU (NVIDIA L40S), all run on 14-16 Jul
2026; run.py, utils.py, data.py and default_training_params.json at the same commit.

The figure: ``train_info.accelerator_memory_max`` = ``max_memory_reserved()`` at the end of the
run minus ``max_memory_reserved()`` after ``reset_peak_memory_stats()`` at the start, before the
model loads (utils.py ``init_accelerator``, refused above 500 MiB; 0 on an idle GPU), in bytes:
compared with trainmem's peak reserved (no CUDA context), GB = 1e9 B.

Setup, from run.py / utils.py at that commit:
- ``AutoModelForCausalLM.from_pretrained(meta-llama/Llama-3.2-3B, dtype=bfloat16)`` (trainmem's
  preset llama-3.2-3b: 3,212,749,824 parameters, the run's own num_total_params of the full
  fine-tune), ``attn_implementation`` None: SDPA; ``use_amp`` false: no autocast, no GradScaler
  (``DummyGradScaler``): ``--precision bf16-true``; peft's adapters in fp32
  (``autocast_adapter_dtype`` true, trainmem's default for LoRA over a 16-bit base).
- ``use_gc`` false: no checkpointing; ``compile`` false; batch 4; torch AdamW (states in the
  parameters' dtype: bf16 for the full fine-tune, fp32 for the adapters), foreach (torch's
  default on CUDA); ``clip_grad_norm_(model.parameters(), 1.0)`` every step; the model's own
  loss (``num_items_in_batch`` passed).
- the loop (``train``): ``optimizer.zero_grad()`` at the top of the step (set_to_none, the same
  as trainmem's zero_grad after the step), ``outputs = model(**batch)`` rebound only by the next
  step's forward: the previous step's outputs (its bf16 logits) live through the next forward:
  ``--loop previous``.
- lengths: samples of MetaMathQA's query + response up to 1,300 characters (data.py
  ``CHAR_LIMIT``, "a token limit of 768 for query + response"), tokenized and cut at
  ``max_seq_length`` 768; ``BucketIterator`` sorts each bucket of 4 x 20 samples longest first
  and ``tokenizer.pad`` pads a batch to its longest sample; 20,000 samples, 4,198,051 tokens
  (210 a sample on average). The longest sample drawn is not read offline (the dataset is not
  shipped): the cells run at the cap, 768, the longest a step can be (an upper bound on the
  length-dependent part, as the GLM cells); at 512 they are shown beside it.
Not modelled: the evaluations every 250 steps and at the end (``model.generate`` on 50 prompts
at a time, ``max_length`` 800: weights + KV cache, 50 x 800 x 114,688 B = 4.6 GB at most, below
every training step here); ``empty_cache()`` every 10 steps (it lowers reserved between steps,
not the peak); AdaLoRA's rank allocator (``update_and_allocate``: fp32 importance scores per
adapter parameter, 18.4 M x 4 B x 3 at most, 0.2 GB).

Methods: the full fine-tune and the peft methods trainmem has an option for (LoRA, rsLoRA,
DoRA, AdaLoRA, LoKr, and LoHa from this session); the others are listed in ``UNMAPPED`` with
their figures (issue 26: peft methods with no trainmem option). AdaLoRA, LoKr and LoHa run on
the generic path, which traces the installed transformers (5.24) and refuses another release:
they run without ``--transformers-version``.

Found (session 27): at the cap every cell is over, the full fine-tune by 0.0 %, the others by
2.9 - 9.4 %; at 512 every cell is under (-6 to -22 %): the longest batch of the run lies
between. Allocated at 768 is 0.0 - 6.9 % below the measured reserved. The LoRA cells
differ among themselves by a simulated segment: from rank 48 on q,v (allocated +0.03 GB) the
replay's measured step finds one of the three cached 1,504 MiB segments of the fp32
(tokens x vocab) loss blocks split by a bf16 logits-sized temporary (751.5 MiB) and maps a
fourth, +1.52 GB reserved; the run's own r 32 -> r 64 difference is +0.26 GB (the same data
and seed). The run calls ``empty_cache()`` every 10 steps on batches of varying length; the
replay warms up on one step of the same length and calls none.

Run: ``PYTHONPATH=src python benchmarks/published_probe.py`` (these cells after the diffusion
cells), or this file alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCE = (
    "https://github.com/huggingface/peft/tree/51c2ff666b142d004c12609c9686cf17ca055751/"
    "method_comparison/MetaMathQA/results"
)

#: Every cell's shared settings (train_config of default_training_params.json; the L40S).
_COMMON = [
    "llama-3.2-3b", "--micro-batch-size", "4", "--precision", "bf16-true",
    "--optimizer", "adamw", "--activation-checkpointing", "none", "--attention", "sdpa",
    "--framework", "pytorch-amp", "--loop", "previous",
    "--torch-version", "2.13.0", "--gpu", "L40S",
]  # fmt: skip
#: The run's transformers, given to the formula cells; the traced ones (AdaLoRA, LoKr: no
#: formulas) run the installed transformers, as the generic path refuses another release.
_TRANSFORMERS = ["--transformers-version", "5.13.1"]
_TRACED = (
    "adalora--llama-3.2-3B-rank32",
    "lokr--llama-3.2-3B-rank32",
    "loha--llama-3.2-3B-rank32",
)

#: (results file stem, train_info.accelerator_memory_max in bytes, num_trainable_params,
#: trainmem arguments beside ``_COMMON``) of the cells trainmem has options for.
ROWS: list[tuple[str, int, int, list[str]]] = [
    ("full-finetuning--llama-3.2-3B-lr_0.00001", 38868615168, 3212749824, []),
    ("lora--llama-3.2-3B-rank32", 22292725760, 9175040,
     ["--lora-rank", "32", "--lora-targets", "q,v"]),
    ("lora--llama-3.2-3B-rank64", 22552772608, 18350080,
     ["--lora-rank", "64", "--lora-targets", "q,v"]),
    ("lora--llama-3.2-3B-rank64-rslora", 22561161216, 18350080,
     ["--lora-rank", "64", "--lora-targets", "q,v"]),
    ("lora--llama-3.2-3B-rank10-target-mlp", 24698159104, 9461760,
     ["--lora-rank", "10", "--lora-targets", "gate,up,down"]),
    ("lora--llama-3.2-3B-rank32-dora", 24532484096, 9289728,
     ["--lora-rank", "32", "--lora-targets", "q,v", "--lora-variant", "dora"]),
    ("adalora--llama-3.2-3B-rank32", 22781362176, 18353664,
     ["--lora-rank", "64", "--lora-targets", "q,v", "--lora-variant", "adalora"]),
    ("lokr--llama-3.2-3B-rank32", 23571988480, 279552,
     ["--lora-rank", "32", "--lora-targets", "q,v", "--lora-variant", "lokr"]),
    ("loha--llama-3.2-3B-rank32", 23907532800, 18350080,
     ["--lora-rank", "32", "--lora-targets", "q,v", "--lora-variant", "loha"]),
]  # fmt: skip

#: The lengths the cells run at: the cap, and a shorter padded batch beside it.
LENGTHS = (768, 512)

#: Measured cells with no trainmem option (peft method: what it trains), figure in GB.
UNMAPPED: list[tuple[str, float, str]] = [
    ("ia3--llama-3.2-3B-default", 23.234, "IA3: learned scaling vectors on k, v, down"),
    ("vera--llama-3.2-3B-default", 21.622, "VeRA: shared frozen random A / B, trained vectors"),
    ("oft--llama-3.2-3B-rank32", 22.333, "OFT: block-diagonal orthogonal rotation"),
    ("boft--llama-3.2-3B-default", 24.692, "BOFT: butterfly-factorized orthogonal rotation"),
    ("prompt_tuning--llama-3.2-3B-default", 24.394, "prompt tuning: virtual input tokens"),
    ("prefixtuning--llama-3.2-3B-lr_0.001", 21.953, "prefix tuning: per-layer key / value prefix"),
    ("ptuning--llama-3.2-3B-default", 20.921, "P-tuning: prompt encoder (MLP)"),
    ("ln_tuning--llama-3.2-3B-default", 21.181, "LN tuning: the norms' weights trained"),
    ("fourierft--llama-3.2-3B-default", 23.658, "FourierFT: sparse spectral coefficients"),
    ("vblora--llama-3.2-3B-default", 22.186, "VB-LoRA: vector bank"),
    ("lora--llama-3.2-3B-rank32-lorafa", 22.240, "LoRA-FA: A frozen (lora_ga / lorafa optimizer)"),
    ("trainable_tokens--llama-3.2-3B-sos+eos", 20.938, "trainable tokens: embedding rows"),
]


def row_args(stem: str, args: list[str], seq_len: int) -> list[str]:
    """``trainmem estimate`` arguments of one cell (without ``--json``)."""
    version = [] if stem in _TRACED else _TRANSFORMERS
    return [*_COMMON, *version, "--seq-len", str(seq_len), *args]


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run() -> list[float]:
    """Print the cells' table; |relative error| of the peak reserved at the cap (768) on the
    cells trainmem answers."""
    from validate import _invoke_estimate, metric_of

    print(f"\nsource: {SOURCE}")
    heads = " | ".join(f"reserved GB at {n} | error" for n in LENGTHS)
    print(f"| results file | trainable | measured GB | {heads} | allocated GB at {LENGTHS[0]} |")
    print("|---|---:|---:|" + "---:|---:|" * len(LENGTHS) + "---:|")
    errors: list[float] = []
    for stem, measured_bytes, trainable, args in ROWS:
        measured = measured_bytes / 1e9
        cells: list[str] = []
        allocated = ""
        for n, seq_len in enumerate(LENGTHS):
            answer, error = _invoke_estimate(row_args(stem, args, seq_len))
            reserved = None if answer is None else metric_of(answer, "reserved")
            if answer is None or reserved is None:
                cells += [error or "out of memory", ""]
                continue
            predicted = reserved / 1e9
            cells += [f"{predicted:.2f}", _pct(predicted, measured)]
            if n == 0:
                errors.append(abs(predicted - measured) / measured)
                allocated = f"{answer['peak']['allocated_bytes'] / 1e9:.2f}"
        print(f"| {stem} | {trainable:,} | {measured:.2f} | {' | '.join(cells)} | {allocated} |")
    print("\nnot mapped (no trainmem option for the peft method):")
    for stem, gb, what in UNMAPPED:
        print(f"- {stem}: {gb:.2f} GB ({what})")
    return errors


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from published_probe import run_alone

    run_alone("PEFT method comparison (L40S), reserved at 768", run)
