"""Published per-GPU training memory from a source outside both development sets (issue 24's
held-out proxy, helper probe24): trainmem's prediction against each measurement, no constant
fitted to any of them.

Source: QwenLM/Qwen README.md @85cb093f20e1faa1d772d6abe8458661f3b09202 (Feb 2024), section
"Profiling of Memory and Speed" (https://github.com/QwenLM/Qwen#profiling-of-memory-and-speed).
Stated there: one A100-SXM4-80G per run unless told, CUDA 11.8, PyTorch 2.0, flash attention 2,
batch size 1, gradient accumulation 8, inputs of 256 ... 8192 tokens; "memory (GB)" with no tool
named. Multi-GPU cells are the sum over the GPUs (the 2 x 2 multinode LoRA cell, 74.7G, is 18.7
per GPU against 20.1 on one GPU): they are divided by the GPU count here.

Setup of each method, from the same commit's scripts (finetune.py, finetune/*.sh):
- the model's own remote code (Qwen/Qwen-7B modeling_qwen.py, ``model_type`` "qwen"), cast to
  bf16 in ``QWenLMHeadModel.__init__`` (config bf16/fp16/fp32 all false: auto-set to bf16 where
  supported; the Int4 checkpoints are fp16); ``--model_max_length`` pads every sample to the
  length (``preprocess``: ``input_id += [pad] * (max_len - len(input_id))``), so the sequence
  length is exact; ``--gradient_checkpointing``; transformers 4.32 (requirements.txt:
  ``>=4.32.0,<4.38.0``).
- LoRA (chat model, no ``modules_to_save``): ``finetune_lora_single_gpu.sh``, plain HF Trainer,
  ``--bf16 True``, peft LoRA r 64 / alpha 16 / dropout 0.05 on ``c_attn``, ``c_proj``, ``w1``,
  ``w2`` (every linear of the layers). Mapped as ``bf16-mixed --load-dtype bfloat16`` with
  ``hf-trainer``: the Trainer autocasts over weights the model already holds in bf16
  (``TrainingConfig.autocast_over_loaded_16bit``; ``bf16-true`` before, which has no
  autocast). Since session 26 (helper qwendtype) trainmem's default for a Qwen-1 config on an
  A100 is that bf16 load (``specs/load_dtype.py`` ``qwen_init_dtype``): without
  ``--load-dtype bfloat16`` every LoRA / LoRA (emb) cell here and every bf16 ms-swift cell
  gives the same figure; the flag stays as the mapping's record. Still approximate: peft of
  that time (0.5-0.7) made the adapters in the base weight's dtype (bf16); trainmem models
  current peft's fp32 adapters (``autocast_adapter_dtype=True``, peft 0.12).
- Q-LoRA: ``finetune_qlora_single_gpu.sh``, the GPTQ Int4 chat checkpoint (``GPTQConfig(bits=
  4)``), ``--fp16``, DeepSpeed ZeRO-2 (``finetune/ds_config_zero2.json``) on one GPU.
- Full-parameter: ``finetune_ds.sh``, ``--bf16``, DeepSpeed ZeRO-3 (``ds_config_zero3.json``);
  on one GPU DeepSpeed (0.12.x at the README's 2023-11-30 commit) gathers nothing from 0.9.0
  (Note [DeepSpeed ZeRO-3 parameter gathers]); its init's flat blocks are in the schedule
  (Note [DeepSpeed's flat buffers at init], session 26; session 25's replay of them,
  ``deepspeed_zero3_init_replay.py``, gave the same 38.86 / 43.81 GB and is gone).
- 72B LoRA: ``finetune_lora_ds.sh`` with ``ds_config_zero3.json`` on 4 GPUs, bf16.
- LoRA (emb): the base (not chat) model, where finetune.py adds ``modules_to_save=["wte",
  "lm_head"]`` to the same LoraConfig (``if lora_args.q_lora or is_chat_model: modules_to_save
  = None``): ``--lora-modules-to-save wte,lm_head`` (helper modsave, session 25: trained bf16
  copies of the embedding and head beside the frozen originals, Note [peft modules_to_save]).
Not mapped: the 2-GPU full-parameter 7B cells (162.0G at 1024 tokens is 81 GB per GPU, above the
A100's 80 GB: not a per-GPU sum) and the multinode cells.

Metric: the README names none. Its figures are compared with trainmem's device total
(``max_memory_reserved`` + CUDA context, what nvidia-smi shows), ``allocated`` shown beside it.
"G" is read as GB (1e9 B), as the development set reads a bare "GB"; the GiB reading (2**30 B,
+7.4 %) is the last column.

Second source (helper probe25): ms-swift's Qwen-1 benchmark, 35 cells, in
``published_probe_swift.py`` (its docstring maps them), run after these. Third source (helper
probecn, session 26): THUDM's ChatGLM3-6B and GLM-4-9B fine-tuning READMEs, 10 cells (8 run,
7 against a figure; the three P-Tuning v2 cells as prefix tuning since session 27), in
``published_probe_glm.py``. Fourth (helper probespeech, session 26):
mmsegmentation's SegFormer / UPerNet model-zoo memory, 24 cells, and two Whisper "fits a 16 GB
T4" bounds, in ``published_probe_vision.py``. Fifth (helper probediff, session 26):
finetrainers' and the FLUX QLoRA blog's measured diffusion cells and CogVideo's hardware
claims, in ``published_probe_diffusion.py``. Sixth (helper probe2, session 27): PEFT's
method comparison suite (a plain PyTorch loop on one L40S, Llama-3.2-3B, each peft method),
9 cells, in ``published_probe_peft.py``; seventh (probe2): Megatron-LM's CI memory tests (a 7B
GPT, TP 4 and PP 4 interleaved on 8 H100 / A100), 4 cells, in ``published_probe_megatron.py``;
eighth (helper probe3, session 28): axolotl's example READMEs ("This config uses about N GiB
VRAM", single-GPU QLoRA through ``--axolotl-config``), 9 cells, in
``published_probe_axolotl.py``, run last.

Run: ``PYTHONPATH=src python benchmarks/published_probe.py`` (a few seconds for these cells,
about 4 minutes of CPU for ms-swift's, each run 6 times, about 10 for the vision cells).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from statistics import median
from typing import Any

SOURCE = (
    "https://github.com/QwenLM/Qwen/blob/85cb093f20e1faa1d772d6abe8458661f3b09202/README.md"
    "#profiling-of-memory-and-speed"
)

_QWEN = {
    "architectures": ["QWenLMHeadModel"],
    "model_type": "qwen",
    "bf16": False,
    "fp16": False,
    "fp32": False,
    "kv_channels": 128,
    "layer_norm_epsilon": 1e-06,
    "max_position_embeddings": 32768,
    "no_bias": True,
    "rotary_emb_base": 10000,
    "rotary_pct": 1.0,
    "seq_length": 8192,
    "tie_word_embeddings": False,
    "use_flash_attn": "auto",
    "attn_dropout_prob": 0.0,
    "emb_dropout_prob": 0.0,
}
#: config.json of each size (Qwen/Qwen-1_8B, Qwen-7B, Qwen-14B, Qwen-72B on the Hub): width,
#: layers, heads, intermediate_size (the MLP's w1 / w2 are half of it), vocabulary.
CONFIGS: dict[str, dict[str, Any]] = {
    name: {
        **_QWEN,
        "hidden_size": h,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
    }
    for name, h, n_layers, heads, inter, vocab in (
        ("qwen-1.8b", 2048, 24, 16, 11008, 151936),
        ("qwen-7b", 4096, 32, 32, 22016, 151936),
        ("qwen-14b", 5120, 40, 40, 27392, 152064),
        ("qwen-72b", 8192, 80, 64, 49152, 152064),
    )
}

#: finetune/ds_config_zero2.json and ds_config_zero3.json at the same commit (the settings
#: that bear on memory; "auto" values are the Trainer's).
DS_ZERO2 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW"},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none"},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}
DS_ZERO3 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
    },
}

_COMMON = [
    "--micro-batch-size", "1",
    "--gradient-accumulation-steps", "8",
    "--activation-checkpointing", "full",
    "--attention", "flash",
    "--optimizer", "adamw",
    "--transformers-version", "4.32.0",
    "--torch-version", "2.0.1",
    "--gpu", "A100-80GB",
]  # fmt: skip
_LORA = [
    "--lora-rank", "64", "--lora-alpha", "16", "--lora-dropout", "0.05",
    "--lora-targets", "all-linear",
]  # fmt: skip
METHODS: dict[str, list[str]] = {
    "LoRA": [
        *_LORA,
        "--framework", "hf-trainer",
        "--precision", "bf16-mixed", "--load-dtype", "bfloat16",
    ],
    "LoRA (emb)": [
        *_LORA,
        "--lora-modules-to-save", "wte,lm_head",
        "--framework", "hf-trainer",
        "--precision", "bf16-mixed", "--load-dtype", "bfloat16",
    ],
    "Q-LoRA": [
        *_LORA,
        "--quantize-base", "gptq-int4",
        "--framework", "hf-trainer",
        "--deepspeed-config", "{ds_zero2}",
        "--precision", "16-mixed",
    ],
    "Full, ZeRO-3": [
        "--framework", "hf-trainer", "--deepspeed-config", "{ds_zero3}",
        "--precision", "bf16-mixed",
    ],
    "LoRA, ZeRO-3 x4": [
        *_LORA,
        "--framework", "hf-trainer", "--deepspeed-config", "{ds_zero3}",
        "--precision", "bf16-mixed", "--data-parallel-size", "4",
    ],
}  # fmt: skip

#: (method, model, sequence length, the README's cell in G, GPUs the cell sums over, trainmem's
#: device total in GB on main 4b5a074 before Qwen-1's 16-bit loss; None: out of memory there;
#: "unmapped": not modelled there, LoRA (emb) before session 25)
ROWS: list[tuple[str, str, int, float, int, float | str | None]] = [
    ("LoRA", "qwen-1.8b", 256, 6.7, 1, 6.09),
    ("LoRA", "qwen-1.8b", 2048, 11.0, 1, 11.08),
    ("LoRA", "qwen-1.8b", 8192, 21.8, 1, 24.83),
    ("LoRA", "qwen-7b", 256, 20.1, 1, 20.24),
    ("LoRA", "qwen-7b", 8192, 36.6, 1, 39.96),
    ("LoRA", "qwen-14b", 256, 34.6, 1, 34.71),
    ("LoRA", "qwen-14b", 8192, 55.2, 1, 55.37),
    ("LoRA (emb)", "qwen-1.8b", 256, 13.7, 1, "unmapped"),
    ("LoRA (emb)", "qwen-1.8b", 2048, 15.1, 1, "unmapped"),
    ("LoRA (emb)", "qwen-1.8b", 8192, 27.7, 1, "unmapped"),
    ("LoRA (emb)", "qwen-7b", 256, 33.7, 1, "unmapped"),
    ("LoRA (emb)", "qwen-7b", 8192, 48.5, 1, "unmapped"),
    ("LoRA (emb)", "qwen-14b", 256, 51.2, 1, "unmapped"),
    ("LoRA (emb)", "qwen-14b", 8192, 67.7, 1, "unmapped"),
    ("Q-LoRA", "qwen-1.8b", 256, 5.8, 1, 5.06),
    ("Q-LoRA", "qwen-1.8b", 8192, 15.8, 1, 22.22),
    ("Q-LoRA", "qwen-7b", 256, 11.5, 1, 10.68),
    ("Q-LoRA", "qwen-7b", 8192, 23.5, 1, 34.14),
    ("Q-LoRA", "qwen-14b", 256, 18.7, 1, 16.33),
    ("Q-LoRA", "qwen-14b", 8192, 27.9, 1, 40.46),
    ("Q-LoRA", "qwen-72b", 256, 61.4, 1, 62.07),
    ("Q-LoRA", "qwen-72b", 8192, 75.6, 1, None),
    ("Full, ZeRO-3", "qwen-1.8b", 256, 43.5, 1, 36.33),
    ("Full, ZeRO-3", "qwen-1.8b", 8192, 48.3, 1, 52.03),
    ("LoRA, ZeRO-3 x4", "qwen-72b", 256, 215.4, 4, 45.78),
    ("LoRA, ZeRO-3 x4", "qwen-72b", 8192, 289.2, 4, 76.79),
]


def write_json_files(folder: Path, files: dict[str, Any]) -> dict[str, str]:
    """Each of ``files`` as ``<name>.json`` in ``folder``; their paths by name (the probes'
    configs, written at run time from the dicts they ship)."""
    paths: dict[str, str] = {}
    for name, content in files.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(content))
        paths[name] = str(path)
    return paths


def write_inputs(folder: Path) -> dict[str, str]:
    """The config.json files and DeepSpeed configs in ``folder``; their paths by name."""
    return write_json_files(folder, {**CONFIGS, "ds_zero2": DS_ZERO2, "ds_zero3": DS_ZERO3})


def run_alone(label: str, run: Any) -> None:
    """Run one probe module's cells by themselves (its ``__main__``): ``run()`` prints the
    table and returns the |relative errors| summarised under ``label``."""
    warnings.filterwarnings("ignore")
    _summary(label, run())


def row_args(method: str, model: str, seq_len: int, paths: dict[str, str]) -> list[str]:
    """``trainmem estimate`` arguments of one row (without ``--json``)."""
    args = [a.format(**paths) for a in METHODS[method]]
    return [paths[model], "--seq-len", str(seq_len), *_COMMON, *args]


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from validate import _invoke_estimate, metric_of

    warnings.filterwarnings("ignore")
    print(f"source: {SOURCE}")
    print(
        "| method | model | seq | measured G/GPU | before (4b5a074) | device total GB "
        "| error (G = GB) | allocated GB | error (G = GiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    errors: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_inputs(Path(tmp))
        for method, model, seq_len, cell, gpus, before in ROWS:
            measured = cell / gpus
            answer, error = _invoke_estimate(row_args(method, model, seq_len, paths))
            if isinstance(before, str):
                was = before
            else:
                was = "OOM" if before is None else f"{before:.2f} ({_pct(before, measured)})"
            head = f"| {method} | {model} | {seq_len} | {measured:.2f} | {was} |"
            total = None if answer is None else metric_of(answer, "device_total")
            if answer is None or total is None:
                peak = {} if answer is None else answer["peak"]
                allocated = f"{peak['allocated_bytes'] / 1e9:.2f}" if peak else ""
                print(f"{head} {error or 'out of memory'} | | {allocated} | |")
                continue
            predicted = total / 1e9
            errors.append(abs(predicted - measured) / measured)
            allocated = answer["peak"]["allocated_bytes"] / 1e9
            print(
                f"{head} {predicted:.2f} | {_pct(predicted, measured)} | {allocated:.2f} "
                f"| {_pct(predicted, measured * 2**30 / 1e9)} |"
            )
        import published_probe_swift
        import published_probe_vision

        fixed, band = published_probe_swift.run(paths)
        import published_probe_glm

        models = Path(__file__).resolve().parents[1] / "tests" / "models" / "remote_code"
        glm = published_probe_glm.run(Path(tmp), models)
        vision, _ = published_probe_vision.run(published_probe_vision.write_configs(Path(tmp)))
    import published_probe_diffusion

    diffusion = published_probe_diffusion.run()
    import published_probe_peft

    peft_cells = published_probe_peft.run()
    import published_probe_megatron

    megatron = published_probe_megatron.run()
    import published_probe_axolotl

    with tempfile.TemporaryDirectory() as tmp:
        axolotl = published_probe_axolotl.run(published_probe_axolotl.write_inputs(Path(tmp)))
    _summary("Qwen README, device total (G = GB)", errors)
    _summary("ms-swift, every step at max_length", fixed)
    _summary("ms-swift, band median (earlier lengths drawn)", band)
    _summary("THUDM ChatGLM3 / GLM-4 READMEs, device total (MiB)", glm)
    print(f"mmsegmentation model zoo, allocated: {published_probe_vision.summary(vision)}")
    _summary("diffusion (finetrainers, flux-qlora blog), measured cells", diffusion)
    _summary("PEFT method comparison (L40S), reserved at 768 tokens", peft_cells)
    _summary("Megatron-LM CI memory tests, peak allocated of the logged rank", megatron)
    for metric, values in axolotl.items():
        print(f"axolotl example READMEs, {metric}: {published_probe_axolotl.summary(values)}")
    return 0


def _summary(label: str, errors: list[float]) -> None:
    if not errors:
        return
    ranked = sorted(errors)
    p90 = ranked[min(len(ranked) - 1, round(0.9 * (len(ranked) - 1)))]
    print(
        f"{label}: median |error| {100 * median(errors):.1f}%, p90 {100 * p90:.1f}%, "
        f"max {100 * ranked[-1]:.1f}% over {len(errors)} rows"
    )


if __name__ == "__main__":
    sys.exit(main())
