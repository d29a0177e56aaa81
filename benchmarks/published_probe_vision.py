"""The published probe's vision and speech source (helper probespeech, session 26, issues 26
and 24): open-mmlab/mmsegmentation's model-zoo "Mem (GB)" cells for the SegFormer, UperNet-Swin
and UperNet-ConvNeXt configs whose networks transformers builds the same, run by
``published_probe.py`` after ms-swift's cells; and two "fits in 16 GB" Whisper claims, bounds,
reported apart.

Sources (mmsegmentation, the tables unchanged since the runs):
- configs/segformer/README.md @02e04cc213fa7fe5313258e27fcca6c8d4ef8e23: ADE20K 512x512 (logs
  2021-07/08) and Cityscapes 1024x1024 (logs 2021-12) for MIT-B0..B5;
- configs/swin/README.md @0e7cafef0ecc3ad6da7553b8fe96c2a6c1adac0c: UPerNet Swin-T/S/B/L 512x512
  ADE20K (logs 2021-05, Swin-L 2022-03; the two 22K rows give no memory);
- configs/convnext/README.md @104429be008d84cd4ca7f162e2fd04f93c77e8ad: UperNet ConvNeXt-T/S/B
  512x512 and B/L 640x640 ADE20K, fp16 (logs 2022-02; XL is marked as measured with
  ``cudnn_benchmark=True`` unlike the others, and left out).

Metric: mmcv 1.x's TextLoggerHook logs ``torch.cuda.max_memory_allocated() // 2**20`` (MiB,
max over ranks, never reset) and .dev/gather_models.py copies the ``memory`` of the last
training iteration; the README shows it / 1024: GiB of ``max_memory_allocated``. Compared here
with trainmem's ``allocated``.

Setup from the configs (``_base_/models/segformer_mit-b0.py``, ``upernet_swin.py``,
``upernet_convnext.py``; each README's config file):
- 8 GPUs, DDP (mmcv ``MMDistributedDataParallel``, torch DDP: ``--data-parallel-size 8``),
  2 images a GPU (SegFormer Cityscapes 1), crops padded to the crop size (``Pad``), so every
  batch has the crop's shape; AdamW (mmcv builds ``torch.optim.AdamW``); fp32, except the
  ConvNeXt configs' ``Fp16OptimizerHook``, which on torch >= 1.6 is autocast + a dynamic
  GradScaler (mmcv ``auto_fp16``; the losses under ``force_fp32``): ``16-mixed``;
- the heads: SegFormer's all-MLP head with 256 channels for B0..B5 alike (mmseg keeps
  ``channels=256``; transformers' B2..B5 Hub configs say 768, so ``decoder_hidden_size`` is
  256 here); UPerHead 512 channels, pool scales 1, 2, 3, 6, and an auxiliary FCN head (256
  channels, one conv, loss weight 0.4) on stage 3, which is transformers' UperNet (its
  ``auxiliary_*`` fields); logits upsampled to the crop for the cross-entropy
  (``ignore_index`` 255) in both;
- attention: torch's ``nn.MultiheadAttention`` (SegFormer, through mmcv) or explicit matmul /
  softmax (Swin): ``--attention eager``;
- mmcv 1.x's ``OptimizerHook`` calls ``optimizer.zero_grad()``, ``set_to_none=False`` on torch
  1.x, the default for ``--torch-version`` 1.8.1 (Note [zero_grad's default by release];
  passed as ``--zero-grad-keep`` before session 27): the gradients live through the next
  forward;
- torch: the logs of that time ran torch 1.x before 1.11 (read as 1.8.1, the release the
  OpenMMLab model zoo lists; not read from the logs, which are not stored offline). Before
  1.11 softmax and log-softmax keep their input for the backward (Note [Softmax saving its
  input before torch 1.11], trainmem/trace/older_softmax.py): the attention scores of every
  layer and the logits of the loss.
Not modelled: mmseg's SyncBN / BN head layers where transformers' SegFormer head uses a linear
per stage, the ``acc_seg`` top-1 of the logits, and cuDNN's benchmark workspaces
(``cudnn_benchmark = True`` in default_runtime.py: a workspace up to the largest free cached
block is allocated while algorithms are timed, part of ``max_memory_allocated``).

Bounds (a claim that the run fits a 16 GB T4, no figure): the prediction must be at most the
T4's usable capacity.
- huggingface.co/learn/audio-course/chapter5/fine-tuning: whisper-small, Common Voice 13
  Dhivehi, "on any 16GB+ GPU ... such as the 16GB T4 GPU provided in the Google Colab free
  tier"; its Seq2SeqTrainingArguments: batch 16, ``fp16=True``, ``gradient_checkpointing=True``
  (transformers 4.3x with eager Whisper attention, torch 2.0, whose foreach AdamW step the
  traced paths refused in session 26, which ran the installed torch's step: 12.02 GiB; since
  session 27 they run it, ``--torch-version 2.0``: its two fp32 lists of the parameters at the
  step, 13.07 GiB device total, allocated unchanged at 9.43 GiB); labels padded to the
  batch's longest, at most 448 tokens (``max_target_positions``): every step at 448 here, the
  most;
- huggingface/peft examples/int8_training/peft_bnb_whisper_large_v2_training.ipynb (the README's
  "fine tune whisper-large ... in a Google Colab"; "train the whisper-large-v2 seamlessly on a
  colab with T4 GPU (16 GB VRAM)"; added ca7b462, 2023-02-16, Colab's torch 1.13.1 then):
  8-bit base (``load_in_8bit``), ``prepare_model_for_kbit_training`` (its gradient
  checkpointing), LoRA r 32 alpha 64 dropout 0.05 on q_proj, v_proj, batch 8, ``fp16=True``;
  Common Voice Marathi labels, at most 448 tokens as above.

Results (session 26, 2026-11-29, on the commit that added this file): the 24 cells all
under, median |error| 3.8 %, p90 6.8 %, max 7.7 % (ConvNeXt-B 640), none under by more than
10 %: SegFormer ADE20K -2.3 .. -4.3 %, Cityscapes -3.4 .. -6.8 %, UPerNet-Swin -0.9 .. -2.0 %,
UperNet-ConvNeXt -4.9 .. -7.7 %. Before: the UPerNet rows refused ``--resolution`` (this model
takes tokens), ``--torch-version`` before 1.11 with eager attention refused on the generic
path, and with the defaults (SDPA, gradients freed, the installed torch) SegFormer was -20 ..
-36 % (ADE20K) and -52 .. -61 % (Cityscapes); with eager attention and ``--zero-grad-keep``
but the installed torch's softmax, SegFormer -15 .. -30 %, Swin -15 % (T). Both bounds hold:
whisper-small 12.02 GiB device total and whisper-large-v2 int8 + LoRA 9.55 GiB, of the T4's
14.75 usable. Session 27 (zero_grad's default and the foreach step by ``--torch-version``):
whisper-small on torch 2.0 13.07 GiB, whisper-large-v2 on 1.13.1 (its LoRA gradients kept by
``zero_grad()``) 9.57 GiB; both still fit; the 24 cells' configurations are unchanged.

Run: ``PYTHONPATH=src python benchmarks/published_probe_vision.py`` (about 10 minutes of CPU),
or through ``published_probe.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median
from typing import Any

SOURCES = {
    "segformer": "https://github.com/open-mmlab/mmsegmentation/blob/"
    "02e04cc213fa7fe5313258e27fcca6c8d4ef8e23/configs/segformer/README.md",
    "swin": "https://github.com/open-mmlab/mmsegmentation/blob/"
    "0e7cafef0ecc3ad6da7553b8fe96c2a6c1adac0c/configs/swin/README.md",
    "convnext": "https://github.com/open-mmlab/mmsegmentation/blob/"
    "104429be008d84cd4ca7f162e2fd04f93c77e8ad/configs/convnext/README.md",
    "whisper-small": "https://huggingface.co/learn/audio-course/chapter5/fine-tuning",
    "whisper-large-v2": "https://github.com/huggingface/peft/blob/"
    "766a9776bb8eb2a73e66d7303958e8a92e5f364d/examples/int8_training/"
    "peft_bnb_whisper_large_v2_training.ipynb",
}


def _labels(n: int) -> dict[str, Any]:
    id2label = {str(i): f"LABEL_{i}" for i in range(n)}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}


def segformer(hidden: list[int], depths: list[int], classes: int) -> dict[str, Any]:
    """transformers' SegFormer config of mmseg's ``MixVisionTransformer`` + ``SegformerHead``."""
    return {
        "model_type": "segformer",
        "architectures": ["SegformerForSemanticSegmentation"],
        "hidden_sizes": hidden, "depths": depths, "num_attention_heads": [1, 2, 5, 8],
        "sr_ratios": [8, 4, 2, 1], "patch_sizes": [7, 3, 3, 3], "strides": [4, 2, 2, 2],
        "mlp_ratios": [4, 4, 4, 4], "decoder_hidden_size": 256, "drop_path_rate": 0.1,
        "classifier_dropout_prob": 0.1, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "num_encoder_blocks": 4, "num_channels": 3,
        "layer_norm_eps": 1e-6, "semantic_loss_ignore_index": 255,
        **_labels(classes),
    }  # fmt: skip


def upernet(backbone: dict[str, Any], aux_in: int) -> dict[str, Any]:
    """transformers' UperNet config of mmseg's UPerHead + FCNHead on ``backbone`` (150 classes)."""
    return {
        "model_type": "upernet",
        "architectures": ["UperNetForSemanticSegmentation"],
        "backbone_config": {**backbone, "out_features": ["stage1", "stage2", "stage3", "stage4"]},
        "hidden_size": 512, "pool_scales": [1, 2, 3, 6], "use_auxiliary_head": True,
        "auxiliary_in_channels": aux_in, "auxiliary_channels": 256, "auxiliary_num_convs": 1,
        "auxiliary_concat_input": False, "auxiliary_loss_weight": 0.4, "loss_ignore_index": 255,
        **_labels(150),
    }  # fmt: skip


def swin(embed: int, depths: list[int], heads: list[int], window: int) -> dict[str, Any]:
    return {
        "model_type": "swin", "embed_dim": embed, "depths": depths, "num_heads": heads,
        "window_size": window, "drop_path_rate": 0.3, "image_size": 224, "patch_size": 4,
        "num_channels": 3, "mlp_ratio": 4.0, "qkv_bias": True, "hidden_act": "gelu",
        "use_absolute_embeddings": False,
    }  # fmt: skip


def convnext(hidden: list[int], depths: list[int]) -> dict[str, Any]:
    return {
        "model_type": "convnext", "hidden_sizes": hidden, "depths": depths, "num_channels": 3,
        "drop_path_rate": 0.4, "layer_scale_init_value": 1.0,
    }  # fmt: skip


def whisper(d_model: int, layers: int, heads: int) -> dict[str, Any]:
    """openai/whisper-* config.json (80 mel bins, 51,865 tokens, 448 decoder positions)."""
    return {
        "model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
        "d_model": d_model, "encoder_layers": layers, "decoder_layers": layers,
        "encoder_attention_heads": heads, "decoder_attention_heads": heads,
        "encoder_ffn_dim": 4 * d_model, "decoder_ffn_dim": 4 * d_model, "num_mel_bins": 80,
        "max_source_positions": 1500, "max_target_positions": 448, "vocab_size": 51865,
        "decoder_start_token_id": 50258, "pad_token_id": 50257, "bos_token_id": 50257,
        "eos_token_id": 50257, "activation_function": "gelu", "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0, "scale_embedding": False,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }  # fmt: skip


#: mit-b0..b5 (mmseg's configs/segformer/segformer_mit-b*.py: embed_dims 32 / 64, num_layers)
_MIT = {
    "b0": ([32, 64, 160, 256], [2, 2, 2, 2]),
    "b1": ([64, 128, 320, 512], [2, 2, 2, 2]),
    "b2": ([64, 128, 320, 512], [3, 4, 6, 3]),
    "b3": ([64, 128, 320, 512], [3, 4, 18, 3]),
    "b4": ([64, 128, 320, 512], [3, 8, 27, 3]),
    "b5": ([64, 128, 320, 512], [3, 6, 40, 3]),
}
CONFIGS: dict[str, dict[str, Any]] = {
    **{f"segformer-{n}-ade": segformer(*arch, 150) for n, arch in _MIT.items()},
    **{f"segformer-{n}-city": segformer(*arch, 19) for n, arch in _MIT.items()},
    **{
        f"upernet-{n}": upernet(swin(embed, depths, heads, window), 4 * embed)
        for n, embed, depths, heads, window in (
            ("swin-t", 96, [2, 2, 6, 2], [3, 6, 12, 24], 7),
            ("swin-s", 96, [2, 2, 18, 2], [3, 6, 12, 24], 7),
            ("swin-b", 128, [2, 2, 18, 2], [4, 8, 16, 32], 7),
            ("swin-b-w12", 128, [2, 2, 18, 2], [4, 8, 16, 32], 12),
            ("swin-l", 192, [2, 2, 18, 2], [6, 12, 24, 48], 7),
            ("swin-l-w12", 192, [2, 2, 18, 2], [6, 12, 24, 48], 12),
        )
    },
    **{
        f"upernet-{n}": upernet(convnext(hidden, depths), hidden[2])
        for n, hidden, depths in (
            ("convnext-t", [96, 192, 384, 768], [3, 3, 9, 3]),
            ("convnext-s", [96, 192, 384, 768], [3, 3, 27, 3]),
            ("convnext-b", [128, 256, 512, 1024], [3, 3, 27, 3]),
            ("convnext-l", [192, 384, 768, 1536], [3, 3, 27, 3]),
        )
    },
    "whisper-small": whisper(768, 12, 12),
    "whisper-large-v2": whisper(1280, 32, 20),
}

_MMSEG = [
    "--optimizer", "adamw", "--data-parallel-size", "8", "--gpu", "V100-32GB",
    "--attention", "eager", "--torch-version", "1.8.1",
]  # fmt: skip
METHODS: dict[str, list[str]] = {
    "fp32": [*_MMSEG, "--precision", "32-true"],
    "fp16": [*_MMSEG, "--precision", "16-mixed"],
}

#: (table, method, model, crop side in pixels, images a GPU, the README's "Mem (GB)" in GiB)
ROWS: list[tuple[str, str, str, int, int, float]] = [
    ("SegFormer ADE20K", "fp32", "segformer-b0-ade", 512, 2, 2.1),
    ("SegFormer ADE20K", "fp32", "segformer-b1-ade", 512, 2, 2.6),
    ("SegFormer ADE20K", "fp32", "segformer-b2-ade", 512, 2, 3.6),
    ("SegFormer ADE20K", "fp32", "segformer-b3-ade", 512, 2, 4.8),
    ("SegFormer ADE20K", "fp32", "segformer-b4-ade", 512, 2, 6.1),
    ("SegFormer ADE20K", "fp32", "segformer-b5-ade", 512, 2, 7.2),
    ("SegFormer ADE20K", "fp32", "segformer-b5-ade", 640, 2, 11.5),
    ("SegFormer Cityscapes", "fp32", "segformer-b0-city", 1024, 1, 3.64),
    ("SegFormer Cityscapes", "fp32", "segformer-b1-city", 1024, 1, 4.49),
    ("SegFormer Cityscapes", "fp32", "segformer-b2-city", 1024, 1, 7.42),
    ("SegFormer Cityscapes", "fp32", "segformer-b3-city", 1024, 1, 10.86),
    ("SegFormer Cityscapes", "fp32", "segformer-b4-city", 1024, 1, 15.07),
    ("SegFormer Cityscapes", "fp32", "segformer-b5-city", 1024, 1, 18.00),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-t", 512, 2, 5.02),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-s", 512, 2, 6.17),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-b", 512, 2, 7.61),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-b-w12", 512, 2, 8.52),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-l", 512, 2, 10.98),
    ("UPerNet Swin ADE20K", "fp32", "upernet-swin-l-w12", 512, 2, 12.42),
    ("UperNet ConvNeXt ADE20K", "fp16", "upernet-convnext-t", 512, 2, 4.23),
    ("UperNet ConvNeXt ADE20K", "fp16", "upernet-convnext-s", 512, 2, 5.16),
    ("UperNet ConvNeXt ADE20K", "fp16", "upernet-convnext-b", 512, 2, 6.33),
    ("UperNet ConvNeXt ADE20K", "fp16", "upernet-convnext-b", 640, 2, 8.53),
    ("UperNet ConvNeXt ADE20K", "fp16", "upernet-convnext-l", 640, 2, 12.08),
]

_WHISPER = [
    "--seq-len", "448", "--framework", "hf-trainer", "--optimizer", "adamw",
    "--precision", "16-mixed", "--activation-checkpointing", "full", "--attention", "eager",
    "--gpu", "T4",
]  # fmt: skip
#: (model, what the source claims, ``trainmem estimate`` arguments after the config)
BOUNDS: list[tuple[str, str, list[str]]] = [
    ("whisper-small", "full fine-tune, batch 16, fits a 16 GB T4",
     ["--micro-batch-size", "16", *_WHISPER, "--torch-version", "2.0"]),
    ("whisper-large-v2", "int8 base + LoRA r 32 on q,v, batch 8, fits a 16 GB T4",
     ["--micro-batch-size", "8", *_WHISPER, "--torch-version", "1.13.1",
      "--quantize-base", "int8", "--lora-rank", "32", "--lora-alpha", "64",
      "--lora-dropout", "0.05", "--lora-targets", "q,v"]),
]  # fmt: skip


def write_configs(folder: Path) -> dict[str, str]:
    """The config.json of every model in ``folder``; their paths by name."""
    from published_probe import write_json_files

    return write_json_files(folder, CONFIGS)


def row_args(method: str, model: str, side: int, images: int, paths: dict[str, str]) -> list[str]:
    """``trainmem estimate`` arguments of one cell (without ``--json``)."""
    return [
        paths[model], "--resolution", str(side), "--micro-batch-size", str(images),
        *METHODS[method],
    ]  # fmt: skip


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run(paths: dict[str, str]) -> tuple[list[float], list[float]]:
    """Print the cells' table and the bounds' verdicts; the signed relative errors of the cells
    trainmem answers, and each answered bound's margin in GiB (usable capacity - device
    total)."""
    from validate import _invoke_estimate, metric_of

    print("\nsources: " + ", ".join(SOURCES.values()))
    print(
        "| table | model | crop | images/GPU | measured GiB (max_memory_allocated) "
        "| predicted allocated GiB | error |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    errors: list[float] = []
    for table, method, model, side, images, cell in ROWS:
        answer, error = _invoke_estimate(row_args(method, model, side, images, paths))
        head = f"| {table} | {model} | {side} | {images} | {cell:.2f} |"
        allocated = None if answer is None else metric_of(answer, "allocated")
        if allocated is None:
            print(f"{head} {error or 'out of memory'} | |", flush=True)
            continue
        predicted = allocated / 2**30
        errors.append((predicted - cell) / cell)
        print(f"{head} {predicted:.2f} | {_pct(predicted, cell)} |", flush=True)
    print("\n| bound | claim | predicted device total GiB | T4 usable GiB | verdict |")
    print("|---|---|---:|---:|---|")
    margins: list[float] = []
    for model, claim, args in BOUNDS:
        answer, error = _invoke_estimate([paths[model], *args])
        if answer is None:
            print(f"| {model} | {claim} | {error} | | refused |", flush=True)
            continue
        total = answer["peak"].get("device_total_bytes") or 0
        usable = answer["gpu"]["capacity_bytes"]
        verdict = "fits" if answer.get("fits") else "does not fit"
        margins.append((usable - total) / 2**30)
        print(
            f"| {model} | {claim} | {total / 2**30:.2f} | {usable / 2**30:.2f} | {verdict} |",
            flush=True,
        )
    return errors, margins


def summary(errors: list[float]) -> str:
    """Median and p90 of |error|, and the cells more than 10 % under."""
    if not errors:
        return "no cell answered"
    ranked = sorted(abs(e) for e in errors)
    p90 = ranked[min(len(ranked) - 1, round(0.9 * (len(ranked) - 1)))]
    under = sum(1 for e in errors if e < -0.10)
    return (
        f"median |error| {100 * median(ranked):.1f}%, p90 {100 * p90:.1f}%, "
        f"max {100 * ranked[-1]:.1f}%, {under} under by more than 10% over {len(errors)} cells"
    )


def main() -> int:
    import tempfile
    import warnings

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        errors, _ = run(write_configs(Path(tmp)))
    print(f"\nmmsegmentation model zoo, allocated: {summary(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
