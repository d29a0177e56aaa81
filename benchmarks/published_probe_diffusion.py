"""The published probe's diffusion source (helper probediff, session 26; issue 26's diffusion
rows): published training memory of diffusers models, run by ``published_probe.py`` after
the language-model cells. No constant is fitted to any cell.

The configs are shipped beside this file (``benchmarks/diffusion_configs/``, nothing is
downloaded): LTX-Video 0.9 from diffusers' ``scripts/convert_ltx_to_diffusers.py`` (version
0.9.0), CogVideoX-2b / -5b from ``convert_cogvideox_to_diffusers.py`` (its comments: 30 / 42
layers, 30 / 48 heads, RoPE on the 5B), HunyuanVideo from ``HunyuanVideoTransformer3DModel``'s
defaults, FLUX.1-dev the preset. Each was checked against the parameter counts the sources print:
LTX 1,923,385,472 (full) and 117,440,512 (LoRA r 128), HunyuanVideo 163,577,856 (LoRA r 128),
CogVideoX-5b 5,570,283,072 (full) and 132,120,576 (LoRA r 128): diffusers 0.42.1 builds the
same counts on ``meta``.

Source 1: a-r-r-o-w/finetrainers ``docs/models/{ltx_video,hunyuan_video,cogvideox}.md`` as they
stood before 7285ccc (6 Mar 2025, which dropped the tables; written at eeb4dd7 / e5df80c, Jan
2025). "LoRA with rank 128, batch size 1, gradient checkpointing, optimizer adamw, 49x512x768
[CogVideoX: 49x480x720], with precomputation", ``torch.bfloat16``. The trainer (finetrainers
e5df80c finetrainers/trainer.py): ``self.transformer.to(dtype=weight_dtype)`` (bf16) before
``add_adapter`` (adapters bf16: Note [diffusers' adapters take the base dtype]; fp32 for fp16
only), full fine-tuning trains the bf16 weights (AdamW states bf16), accelerate's bf16 autocast
over it (``--precision bf16-mixed --load-dtype bfloat16``; for LoRA the load dtype is also
trainmem's default since this session: Note [diffusers' LoRA scripts cast the frozen model]),
``enable_gradient_checkpointing``,
``torch.optim.AdamW``, conditions and latents precomputed and the text encoders / VAE deleted
before training (``_delete_components``); the "without precomputation" cells keep them on the
GPU in bf16 (``--frozen-on-gpu all``; their figure is the row "before validation start", after
the training steps), encoding each batch inside the step (the VAE's encode traced since
session 26, helper vaeenc: Note [The frozen VAE encodes inside the step], untiled; the text
encoders' forwards are not). Prompt lengths: LTX's T5 128 tokens, HunyuanVideo's
Llama 256, CogVideoX's T5 226 (each model file's ``max_sequence_length``). Metric:
``get_memory_statistics`` (utils/memory_utils.py) ``torch.cuda.max_memory_reserved / 1024**3``
"after epoch 1". No ``reset_peak_memory_stats`` runs between "before training start" and it, so
it covers the transformer's load too (the docs' row "before training start"): where it equals
that row (CogVideoX-5b LoRA, 20.701 both) the training step stayed under it, a bound. The
reserved pool the load left (LTX LoRA: 10.010 GiB reserved, 3.809 allocated before training)
is reused by the step, which a fresh process does not have.

Source 1b: finetrainers ``README.md`` at d220aac ("(fake*) FP8 training support", 15 Jan 2025,
until v0.0.1), "Min. LoRA VRAM": LTX-Video 5, HunyuanVideo 32, CogVideoX-5b 18 "GB", "at
resolution 49x512x768, rank 128, with pre-computation, using FP8 weights & gradient
checkpointing", training only. The same commit's table had said 11 / 42 / 21 for bf16 weights,
the docs' ``max_memory_reserved`` GiB rounded (10.916, 42.387, 20.701): so GiB to +-0.5 (LTX's
+-10 %). The trainer at d220aac: ``--layerwise_upcasting_modules transformer`` (its
``apply_layerwise_upcasting``: float8_e4m3fn storage, bf16 compute, before ``add_adapter``,
peft's adapter cast to the base dtype patched out), then ``cast_training_params([transformer],
torch.float32)`` for every LoRA run (fp32 adapters; before d220aac fp16 only), accelerate's bf16
autocast (accelerate_configs ``mixed_precision: bf16``): ``--layerwise-casting float8_e4m3fn
--lora-adapter-dtype float32`` on the bf16 cells' arguments (session 27, helper diffpipe; Note
[diffusers' layerwise casting]: trainmem casts the layers diffusers' ``enable_layerwise_casting``
casts, which also casts LTX-Video's ``time_embed`` that finetrainers' patterns keep). The
CogVideoX-5b figure may be its precomputation's load peak, as the bf16 one was (T5-XXL beside the
transformer before training); kept as measured.

Source 2: the Hugging Face blog "(LoRA) Fine-Tuning FLUX.1-dev on Consumer Hardware"
(huggingface/blog flux-qlora.md @2ece681, 19 Jun 2025): RTX 4090, diffusers' research_projects/
flux_lora_quantization ``train_dreambooth_lora_flux_miniature.py``, 512 x 768 (height 768),
batch 1, gradient accumulation 4, bf16, 8-bit AdamW, gradient checkpointing, cached latents, T5
embeddings precomputed at 77 tokens, LoRA r 4 on ``to_q``, ``to_k``, ``to_v``, ``to_out.0``
(4,669,440 trainable, mapped as ``--lora-targets to_q,to_k,to_v,to_out.0`` since session 27;
trainmem's q,k,v,o adds the joint attention's ``add_*_proj``: 6,537,216). QLoRA: nf4 (no double
quantization), compute bf16, ``prepare_model_for_kbit_training`` (its fp32 upcast of the
unquantized weights): "Peak VRAM usage ... approximately 9GB"; the same run with the base in 16
bits: "26 GB" (not on the 24 GB RTX 4090 it names: the bf16 weights alone are 23.8 GB; run here
for an 80 GB card, the GPU only sets the verdict). No tool named: compared with trainmem's
device total in GB (1e9 B), as published_probe.py reads the Qwen README.

Bounds (hardware claims, not measurements; reported as whether trainmem says it fits):
THUDM/CogVideo ``finetune/README.md`` @e519ece (May 2025) "Hardware Requirements": LoRA r 128
(``to_q``, ``to_k``, ``to_v``, ``to_out.0``), 49x480x720, DDP on one GPU per rank, gradient
checkpointing on (schemas/args.py), latents and T5 embeddings cached and the VAE / T5
unloaded (``UNLOAD_LIST``), AdamW. Its trainer (finetune/trainer.py ``prepare_optimizer``)
calls ``cast_training_params(transformer, torch.float32)`` for every precision: fp32 adapters,
``--lora-adapter-dtype float32`` since session 27 (before: diffusers' bf16 adapters over a bf16
base, 8 B a trainable parameter less, 1.06 GB at 132M).

diffusers ``examples/controlnet/README_flux.md`` (v0.40.0) "gpu memory consumption for
reference, tested on a single A100 with 80G": "training ~58G", the README's command
(``train_controlnet_flux.py``, FLUX.1-dev, bf16 mixed precision, 512 px, batch 1, accumulation
16, ``--num_double_layers 4 --num_single_layers 0``, no gradient checkpointing, AdamW; the
prompt embeddings precomputed at 512 T5 tokens and the text encoders moved to the CPU, "offload
te to cpu ~30G"; the VAE kept in bf16 and encoding the pixels and the conditioning image each
step). No tool named; read as nvidia-smi's whole-device figure in GiB (``device_total``); read
in GB the cell is +8.8 %.

Not mapped (listed by ``UNMAPPED``): the blog's FP8 cell
(torchao float8 training of a LoRA run with the text encoders encoding each step), HiDream's
README figures (``memory_allocated`` after backward, not a peak, with four text encoders on the
GPU), the cogvideox-factory tables (their column matches neither a peak nor the current
allocation consistently), CogVideo's full fine-tuning cells (DeepSpeed with fp32 master copies
under ``cast_training_params``; not attempted in the time).

Findings (session 26, at the commit that added this file): 8 measured cells, median |error|
3.5 %, p90 11.6 %; 2 under by more than 10 %, neither the training step's own memory:
- LTX-Video LoRA with precomputation (-45.8 %): the run reserved 10.010 GiB with 3.809
  allocated before its first step (the LTX full run after the same precomputation: 4.025);
  the step added 0.906 GiB to that pool. trainmem's 5.92 GiB is the step in a fresh process.
- LTX-Video LoRA without precomputation (-11.6 %, 2.05 GiB): the VAE encodes each 49 x 512 x
  768 clip inside the step, a forward trainmem did not trace (``--frozen-on-gpu`` held the
  weights only). Its size, traced on meta tensors with the recorder (AutoencoderKLLTXVideo
  0.9.0, bf16, ``encode`` under no_grad, untiled): 2.12 GiB above its weights. Landed by
  helper vaeenc (session 26): 15.574 -> 17.756 GiB reserved (+0.8 %); the docs' command also
  passes ``--enable_tiling --enable_slicing`` (diffusers 0.42's tiling: 16.80 GiB, -4.7 %),
  which trainmem cannot express; HunyuanVideo with its encoders and VAE -3.4 -> -4.6 %
  (allocated +0.004 GiB, the allocator's pool packed differently).
- HunyuanVideo with precomputation (-6.3 %): the doc's command lists buckets 17 / 49 / 61 x
  512 x 768; at 61 frames trainmem gives 42.24 GiB (-0.4 %).
diffusers' LoRA adapters in the base dtype moved the LoRA cells (main before -> after):
LTX 7.04 -> 5.92 GiB, HunyuanVideo 39.76 -> 39.71, CogVideoX-5b bound 20.85 (over) -> 20.62
(under), FLUX 16-bit LoRA 25.61 -> 25.66 GB (r 4: 6.5M adapters; allocator rounding), the
bf16 CogVideo bound 22.92 -> 22.66 GB; the two cells without precomputation were refused on
main (no frozen components known for the video pipelines).

Session 27 (helper diffpipe): the three FP8 cells LTX-Video 4.906 GiB (-1.9 %), HunyuanVideo
31.486 (-1.6 %), CogVideoX-5b 16.234 (-9.8 %); the blog's cells with its own targets: QLoRA
9.309 GB (+3.7 -> +3.4 %), 16-bit LoRA 25.646 (-1.3 -> -1.4 %); CogVideo's bounds with fp32
adapters: 5b 22.66 -> 22.916 GB; the other cells unchanged.

Session 28 (helper pipes): FLUX ControlNet (``--controlnet`` on a FLUX transformer, mapped
from the unmapped list) 58.76 GiB device total against "~58G" (+1.3 %; allocated 54.26 GiB; in
GB 63.09 against 58, +8.8 %).

Run: ``PYTHONPATH=src python benchmarks/published_probe.py`` (this part: a few minutes of CPU).
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "diffusion_configs"

SOURCES = {
    "finetrainers": (
        "https://github.com/a-r-r-o-w/finetrainers/tree/9bb9aff/docs/models "
        "(tables removed in 7285ccc)"
    ),
    "flux-qlora blog": (
        "https://github.com/huggingface/blog/blob/2ece681fdf41928fbaf103d702ff7af1da4352fc/"
        "flux-qlora.md"
    ),
    "CogVideo": (
        "https://github.com/THUDM/CogVideo/blob/e519ece/finetune/README.md#hardware-requirements"
    ),
    "diffusers README_flux": (
        "https://github.com/huggingface/diffusers/blob/v0.40.0/examples/controlnet/README_flux.md"
    ),
}


def _model(name: str) -> str:
    path = CONFIGS / f"{name}.json"
    return str(path) if path.exists() else name


_FT_LORA = ["--lora-rank", "128", "--lora-alpha", "128", "--lora-targets", "q,k,v,o"]
_FT = [
    "--micro-batch-size", "1", "--activation-checkpointing", "full", "--optimizer", "adamw",
    "--precision", "bf16-mixed", "--load-dtype", "bfloat16",
]  # fmt: skip
_FP8 = ["--layerwise-casting", "float8_e4m3fn", "--lora-adapter-dtype", "float32"]
_LTX = ["--resolution", "512x768", "--frames", "49", "--text-seq-len", "128"]
_HUNYUAN = ["--resolution", "512x768", "--frames", "49", "--text-seq-len", "256"]
_COG = ["--resolution", "480x720", "--frames", "49", "--text-seq-len", "226"]
_BLOG = [
    "--resolution", "768x512", "--text-seq-len", "77", "--micro-batch-size", "1",
    "--gradient-accumulation-steps", "4", "--activation-checkpointing", "full",
    "--optimizer", "adamw-8bit", "--lora-rank", "4", "--lora-alpha", "4",
    "--lora-targets", "to_q,to_k,to_v,to_out.0", "--precision", "bf16-mixed",
]  # fmt: skip

#: (source, cell, model, arguments, published figure, unit "GiB" / "GB", metric compared:
#: "reserved" / "device_total", kind "measured" / "upper bound")
ROWS: list[tuple[str, str, str, list[str], float, str, str, str]] = [
    ("finetrainers", "LTX-Video LoRA r128", "ltx-video-0.9-transformer",
     [*_LTX, *_FT, *_FT_LORA, "--gpu", "A100-80GB"], 10.916, "GiB", "reserved", "measured"),
    ("finetrainers", "LTX-Video LoRA r128, T5 and VAE on the GPU", "ltx-video-0.9-transformer",
     [*_LTX, *_FT, *_FT_LORA, "--frozen-on-gpu", "all", "--gpu", "A100-80GB"], 17.623, "GiB",
     "reserved", "measured"),
    ("finetrainers", "HunyuanVideo LoRA r128, encoders and VAE on the GPU",
     "hunyuanvideo-transformer",
     [*_HUNYUAN, *_FT, *_FT_LORA, "--frozen-on-gpu", "all", "--gpu", "A100-80GB"], 56.266,
     "GiB", "reserved", "measured"),
    ("finetrainers", "LTX-Video full", "ltx-video-0.9-transformer",
     [*_LTX, *_FT, "--gpu", "A100-80GB"], 20.357, "GiB", "reserved", "measured"),
    ("finetrainers", "HunyuanVideo LoRA r128", "hunyuanvideo-transformer",
     [*_HUNYUAN, *_FT, *_FT_LORA, "--gpu", "A100-80GB"], 42.387, "GiB", "reserved",
     "measured"),
    ("finetrainers", "CogVideoX-5b LoRA r128", "cogvideox-5b-transformer",
     [*_COG, *_FT, *_FT_LORA, "--gpu", "A100-80GB"], 20.701, "GiB", "reserved",
     "upper bound"),
    ("finetrainers", "CogVideoX-5b full", "cogvideox-5b-transformer",
     [*_COG, *_FT, "--gpu", "A100-80GB"], 52.939, "GiB", "reserved", "measured"),
    ("finetrainers", "LTX-Video LoRA r128, FP8 layerwise upcasting", "ltx-video-0.9-transformer",
     [*_LTX, *_FT, *_FT_LORA, *_FP8, "--gpu", "A100-80GB"], 5.0, "GiB", "reserved",
     "measured"),
    ("finetrainers", "HunyuanVideo LoRA r128, FP8 layerwise upcasting",
     "hunyuanvideo-transformer",
     [*_HUNYUAN, *_FT, *_FT_LORA, *_FP8, "--gpu", "A100-80GB"], 32.0, "GiB", "reserved",
     "measured"),
    ("finetrainers", "CogVideoX-5b LoRA r128, FP8 layerwise upcasting",
     "cogvideox-5b-transformer",
     [*_COG, *_FT, *_FT_LORA, *_FP8, "--gpu", "A100-80GB"], 18.0, "GiB", "reserved",
     "measured"),
    ("flux-qlora blog", "FLUX.1-dev QLoRA nf4 r4", "flux.1-dev-transformer",
     [*_BLOG, "--quantize-base", "nf4", "--gpu", "RTX-4090"], 9.0, "GB", "device_total",
     "measured"),
    ("flux-qlora blog", "FLUX.1-dev LoRA r4, 16-bit base", "flux.1-dev-transformer",
     [*_BLOG, "--load-dtype", "bfloat16", "--gpu", "H100-80GB"], 26.0, "GB", "device_total",
     "measured"),
    ("diffusers README_flux", "FLUX.1-dev ControlNet 4 double / 0 single blocks, 512 px",
     "flux.1-dev-transformer",
     ["--resolution", "512", "--text-seq-len", "512", "--micro-batch-size", "1",
      "--gradient-accumulation-steps", "16", "--optimizer", "adamw", "--precision", "bf16-mixed",
      "--controlnet", "--controlnet-double-layers", "4", "--controlnet-single-layers", "0",
      "--frozen-on-gpu", "vae", "--gpu", "A100-80GB"], 58.0, "GiB", "device_total",
     "measured"),
    ("CogVideo", "CogVideoX-2b LoRA r128 fp16 (16 GB, RTX 4080)", "cogvideox-2b-transformer",
     [*_COG, "--micro-batch-size", "1", "--activation-checkpointing", "full",
      "--optimizer", "adamw", "--precision", "16-mixed", "--load-dtype", "float16",
      "--lora-rank", "128", "--lora-alpha", "64", "--lora-targets", "to_q,to_k,to_v,to_out.0",
      "--lora-adapter-dtype", "float32", "--gpu", "16GB"], 16.0, "GB", "device_total", "fits"),
    ("CogVideo", "CogVideoX-5b LoRA r128 bf16 (24 GB, RTX 4090)", "cogvideox-5b-transformer",
     [*_COG, *_FT, "--lora-rank", "128", "--lora-alpha", "64",
      "--lora-targets", "to_q,to_k,to_v,to_out.0", "--lora-adapter-dtype", "float32",
      "--gpu", "RTX-4090"], 24.0, "GB", "device_total", "fits"),
]  # fmt: skip

UNMAPPED: list[tuple[str, str]] = [
    ("flux-qlora blog: FP8 LoRA on H100, 'peak memory usage of 36.57 GB'",
     "torchao float8 LoRA with CLIP / T5 encoding each step (custom captions): not attempted"),
    ("diffusers examples/dreambooth/README_hidream.md: 36.9 / 59.9 GB 'after backward'",
     "memory_allocated after backward, not a peak; HiDream's four text encoders on the GPU"),
    ("finetrainers examples/_legacy/training/README.md (cogvideox-factory tables)",
     "the column equals the allocation before training in checkpointed rows: not a peak"),
    ("THUDM/CogVideo finetune/README.md SFT rows (ZeRO-2 / ZeRO-3, offload)",
     "cast_training_params makes fp32 master weights of a bf16 model; not attempted"),
]  # fmt: skip


def row_args(model: str, args: list[str]) -> list[str]:
    """``trainmem estimate`` arguments of one cell (without ``--json``)."""
    return [_model(model), *args]


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run() -> list[float]:
    """Print the cells' table, the bounds and the unmapped figures; |relative error| of the
    measured cells trainmem answers."""
    from validate import _invoke_estimate, metric_of

    print("\nsources: " + "; ".join(f"{k}: {v}" for k, v in SOURCES.items()))
    print(
        "| source | cell | kind | published | metric | trainmem | error | allocated GiB | verdict |"
    )
    print("|---|---|---|---:|---|---:|---:|---:|---|")
    errors: list[float] = []
    for source, cell, model, args, figure, unit, metric, kind in ROWS:
        answer, error = _invoke_estimate(row_args(model, args))
        head = f"| {source} | {cell} | {kind} | {figure:.3f} {unit} | {metric} |"
        value = None if answer is None else metric_of(answer, metric)
        if answer is None or value is None:
            print(f"{head} {error or 'out of memory'} | | | |")
            continue
        scale = 2**30 if unit == "GiB" else 1e9
        predicted = value / scale
        allocated = answer["peak"]["allocated_bytes"] / 2**30
        verdict = str(answer.get("verdict", ""))
        if kind == "measured":
            errors.append(abs(predicted - figure) / figure)
            shown = _pct(predicted, figure)
        elif kind == "upper bound":
            shown = "under (holds)" if predicted <= figure else f"over by {_pct(predicted, figure)}"
        else:
            shown = f"says {verdict}"
        print(f"{head} {predicted:.3f} {unit} | {shown} | {allocated:.2f} | {verdict} |")
    print("\nnot mapped:")
    for figure_text, reason in UNMAPPED:
        print(f"- {figure_text}: {reason}")
    return errors
