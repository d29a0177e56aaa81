"""Trace lit-gpt's own LoRA model (not HF transformers) with trainmem and compare with the
measured lit-gpt ``finetune/lora.py`` rows (GT076-GT089) and the analytic engine.

Needs a separate environment with lit-gpt's model code (not a trainmem dependency)::

    python3 -m venv /work/litgpt-venv
    /work/litgpt-venv/bin/pip install torch==2.13.0
    /work/litgpt-venv/bin/pip install litgpt               # dependencies (lightning, ...)
    /work/litgpt-venv/bin/pip install --no-deps litgpt==0.2.0
    /work/litgpt-venv/bin/pip install -e .
    /work/litgpt-venv/bin/python benchmarks/litgpt_trace.py [--rows GT076,GT078] [--detail]

litgpt 0.2.0 (Mar 2024) is the earliest PyPI release; its ``litgpt/model.py``, ``litgpt/lora.py``
and ``litgpt/utils.py::chunked_cross_entropy`` carry the Oct 2023 lit-gpt code paths the rows were
measured with (commit 8641822): interleaved QKV ``view/permute/reshape``, ``apply_rope`` on
``q[..., :rope_n_elem]`` + ``torch.cat``, ``LoRAQKVLinear`` with dropout -> ``lora_A`` ->
grouped ``conv1d`` (``lora_B``) -> ``zero_pad`` (``index_copy``), ``GPT.forward(...,
lm_head_chunk_size=128)`` returning a list of logits chunks, chunked cross-entropy without an
fp32 upcast. Later litgpt releases changed the QKV layout and ``LoRAQKVLinear``.

What finetune/lora.py (Oct 2023) does, and this script emulates:
- ``fabric.init_module()`` under ``bf16-true``: the model is built in bf16;
  ``fabric.setup_module`` -> ``HalfPrecision.convert_module``: ``model.to(bfloat16)``;
- ``model.max_seq_length = longest_seq_length`` after setup: ``GPT.max_seq_length`` setter
  rebuilds the rope cache (``build_rope_cache``: fp32 cos/sin, default dtype is fp32 again);
- ``mark_only_lora_as_trainable(model)``; ``torch.optim.AdamW(trainable_params, lr, weight_decay)``
  (foreach on CUDA);
- the loop: ``logits = model(input_ids, lm_head_chunk_size=128)``;
  ``logits[-1] = logits[-1][..., :-1, :]``; ``loss = chunked_cross_entropy(logits,
  targets[..., 1:])``; ``fabric.backward(loss / gradient_accumulation_iters)``; the local
  ``logits`` list stays bound through backward and the optimizer step and is only rebound when
  the *next* ``model(...)`` returns. The peak is iteration 1 (``get_batch(..., longest_seq_ix if
  iter_num == 1 else None)`` puts the longest sample there, later batches are shorter), where no
  previous logits exist, so the default ``--keep-logits backward`` keeps them through this
  step's backward only (``next_forward`` also through the next forward; ``none`` drops them after
  the loss as trainmem's step does);
- ``model`` is Fabric's ``_FabricModule``: its ``forward`` ends with
  ``precision.convert_output(output)``, and ``HalfPrecision.convert_output`` casts every floating
  tensor of the output to ``torch.get_default_dtype()`` = fp32
  (lightning/fabric/plugins/precision/half.py, lightning/fabric/wrappers.py). So the logits
  chunks the loss reads, and the log-softmax it saves, are fp32 (``--no-fabric-upcast`` keeps
  them bf16).

Result (torch 2.13 CPU fake tensors, litgpt 0.2.0 model code; GB = 1e9 B, max_memory_allocated):

    row    model                   b     s  measured  traced  analytic(litgpt)
    GT076  phi-1.5                 1  1044      4.82    4.82    4.32
    GT078  phi-1.5                 2  1044      6.76    6.77    5.78
    GT079  phi-1.5                 4  1044     10.68   10.68    8.70
    GT080  stablelm-base-alpha-3b  1  1034      9.69    9.71    8.96
    GT082  stablelm-base-alpha-3b  2  1034     12.10   12.11   10.61
    GT083  stablelm-base-alpha-3b  4  1034     16.92   16.91   13.92
    GT084  llama-2-7b              1  1304     21.30   21.26   20.24
    GT087  llama-2-7b              2  1304     29.07   29.00   26.96
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainmem.estimate import estimate
from trainmem.specs.hardware import DEFAULT_CUBLAS_WORKSPACE_BYTES
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import run_trace

ROOT = Path(__file__).resolve().parents[1]
DEV_CSV = ROOT.parent / "shared" / "validation" / "dev_measurements.csv"

#: row -> (litgpt config name, trainmem preset, micro-batch, seq_len)
ROWS: dict[str, tuple[str, str, int, int]] = {
    "GT076": ("phi-1_5", "phi-1.5", 1, 1044),
    "GT078": ("phi-1_5", "phi-1.5", 2, 1044),
    "GT079": ("phi-1_5", "phi-1.5", 4, 1044),
    "GT080": ("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", 1, 1034),
    "GT082": ("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", 2, 1034),
    "GT083": ("stablelm-base-alpha-3b", "stablelm-base-alpha-3b", 4, 1034),
    "GT084": ("Llama-2-7b-hf", "llama-2-7b", 1, 1304),
    "GT087": ("Llama-2-7b-hf", "llama-2-7b", 2, 1304),
}
DEFAULT_ROWS = ("GT076", "GT078", "GT080", "GT082", "GT084", "GT087")
LM_HEAD_CHUNK = 128


def measured_gb() -> dict[str, float]:
    """Measured ``max_memory_allocated`` (GB, 1e9) per row id."""
    with DEV_CSV.open() as f:
        return {r["id"]: float(r["measured_gb"]) for r in csv.DictReader(f)}


def chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """lit-gpt ``lit_gpt/utils.py::chunked_cross_entropy`` as of Oct 2023, list-of-chunks branch
    (``chunk_size=128``): per-chunk ``cross_entropy(..., ignore_index=-1, reduction="none")``,
    then ``torch.cat(...).mean()``. litgpt 0.2.0's version divides by ``max(1, (targets !=
    ignore_index).sum())``, a host sync the fake tensors cannot run; the memory is the same."""
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    target_chunks = [c.reshape(-1) for c in targets.split(logits[0].size(1), dim=1)]
    losses = [
        nn.functional.cross_entropy(lc, tc, ignore_index=-1, reduction="none")
        for lc, tc in zip(logit_chunks, target_chunks, strict=True)
    ]
    return torch.cat(losses).mean()


class LitGPTLoRAStep(nn.Module):
    """One ``finetune/lora.py`` micro-step as a module: forward + chunked loss.

    ``keep_logits``: where the training loop's ``logits`` list dies (module docstring). The
    kept logits are held as (non-persistent) buffers so that trainmem registers the previous
    step's ones as live storage when the recorded step starts.
    """

    def __init__(self, gpt: nn.Module, keep_logits: str, fabric_upcast: bool = True) -> None:
        super().__init__()
        self.gpt = gpt
        self.keep_logits = keep_logits
        self.fabric_upcast = fabric_upcast
        self._n_kept = 0

    def _drop_kept(self) -> None:
        for i in range(self._n_kept):
            setattr(self, f"kept_logits_{i}", None)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.keep_logits == "backward":
            self._drop_kept()  # freed before this forward
        logits = self.gpt(input_ids, lm_head_chunk_size=LM_HEAD_CHUNK)
        if self.fabric_upcast:
            # ``_FabricModule.forward`` -> ``HalfPrecision.convert_output``: every floating
            # output tensor is cast to ``torch.get_default_dtype()`` (fp32) after the forward
            logits = [t.to(torch.get_default_dtype()) for t in logits]
        if self.keep_logits == "next_forward":
            self._drop_kept()  # the loop's ``logits = model(...)`` rebinds only now
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, targets[..., 1:])
        if self.keep_logits != "none":
            for i, t in enumerate(logits):
                self.register_buffer(f"kept_logits_{i}", t, persistent=False)
            self._n_kept = len(logits)
        return loss


def build_litgpt_lora(
    name: str, seq_len: int, keep_logits: str, fabric_upcast: bool = True
) -> nn.Module:
    """lit-gpt's LoRA GPT as finetune/lora.py (Oct 2023) builds it (module docstring)."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    config = Config.from_name(
        name, lora_r=8, lora_alpha=16, lora_dropout=0.05, lora_query=True, lora_key=False,
        lora_value=True, lora_projection=False, lora_mlp=False, lora_head=False,
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # fabric.init_module() under bf16-true
    try:
        gpt = GPT(config)
    finally:
        torch.set_default_dtype(previous)
    gpt = gpt.to(torch.bfloat16)  # fabric.setup_module -> HalfPrecision.convert_module
    gpt.max_seq_length = seq_len  # rebuilds fp32 cos/sin of seq_len rows
    mark_only_lora_as_trainable(gpt)
    return LitGPTLoRAStep(gpt, keep_logits, fabric_upcast)


def training_config(b: int, s: int) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=b, seq_len=s, precision="bf16-true", lora_rank=8,
        lora_targets=("q", "v"), lora_dropout=0.05, framework="litgpt",
        chunked_cross_entropy=math.ceil(s / LM_HEAD_CHUNK),
    )  # fmt: skip


def run_row(row: str, keep_logits: str, fabric_upcast: bool = True) -> dict[str, Any]:
    """Trace one row and estimate it analytically."""
    name, preset, b, s = ROWS[row]
    training = training_config(b, s)
    vocab_holder: dict[str, int] = {}

    def build() -> nn.Module:
        model = build_litgpt_lora(name, s, keep_logits, fabric_upcast)
        vocab_holder["V"] = model.gpt.config.padded_vocab_size
        return model

    def make_batch() -> dict[str, torch.Tensor]:
        v = vocab_holder["V"]
        return {"input_ids": torch.randint(0, v, (b, s)), "targets": torch.randint(0, v, (b, s))}

    def optimizer(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, foreach=True)

    capture, report = run_trace(
        build, make_batch, training, optimizer=optimizer,
        loss_fn=lambda out, _batch: out, workspace_bytes=DEFAULT_CUBLAS_WORKSPACE_BYTES,
    )  # fmt: skip
    analytic = estimate(preset, training)
    return {
        "row": row, "preset": preset, "b": b, "s": s, "capture": capture, "report": report,
        "analytic": analytic, "training": training,
    }  # fmt: skip


def traced_allocated(report: Any) -> int:
    """Peak allocated as ``max_memory_allocated`` would see it (no CUDA context)."""
    return report.peak_bytes


def layer_saved_tensors(result: dict[str, Any], layer: int = 1) -> list[tuple[str, str, int]]:
    """Activation storages allocated under ``gpt.transformer.h.<layer>`` in the recorded step and
    live at the end of its forward: (module suffix, op, bytes), one entry per storage."""
    prefix = f"gpt.transformer.h.{layer}"
    out = []
    for blk in result["capture"].recorder.blocks:
        if blk.category is not None and blk.category.name == "ACTIVATION" and blk.phase != "init":
            if blk.module == prefix or blk.module.startswith(prefix + "."):
                out.append((blk.module[len(prefix) :] or "<block>", blk.op, blk.size_bytes))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    parser.add_argument(
        "--no-fabric-upcast",
        action="store_true",
        help="keep the logits bf16 (skip Fabric's convert_output upcast)",
    )
    parser.add_argument("--keep-logits", default="backward",
                        choices=("none", "backward", "next_forward"))  # fmt: skip
    parser.add_argument("--detail", action="store_true", help="per-layer saved tensors")
    args = parser.parse_args(argv)
    meas = measured_gb()
    print(f"{'row':6} {'model':24} {'b':>2} {'s':>5} {'measured':>9} {'traced':>8} "
          f"{'dT%':>6} {'analytic':>9} {'dA%':>6}  trace peak")  # fmt: skip
    for row in args.rows.split(","):
        res = run_row(row, args.keep_logits, not args.no_fabric_upcast)
        rep, an = res["report"], res["analytic"]
        traced = traced_allocated(rep) / 1e9
        ana = an.breakdown.allocated_bytes / 1e9
        m = meas[row]
        print(
            f"{row:6} {res['preset']:24} {res['b']:>2} {res['s']:>5} {m:9.2f} {traced:8.2f} "
            f"{100 * (traced / m - 1):+6.1f} {ana:9.2f} {100 * (ana / m - 1):+6.1f}  "
            f"{rep.peak_phase}:{rep.peak_op}@{rep.peak_module}",
            flush=True,
        )
        if args.detail:
            print_detail(res)
    return 0


def print_detail(res: dict[str, Any]) -> None:
    rep, an = res["report"], res["analytic"]
    b, s = res["b"], res["s"]
    t = b * s
    print("  trace by category at peak:", {k: v for k, v in rep.by_category_bytes.items() if v})
    print("  analytic breakdown:", an.breakdown.as_dict())
    by_mod: dict[str, int] = defaultdict(int)
    for mod, n in rep.activation_bytes_by_module.items():
        by_mod[mod] += n
    print("  activations by module at end of forward (top 12):")
    for mod, n in sorted(by_mod.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {mod:44} {n:>14,} B  {n / t:10.1f} B/token")
    from trainmem.analytic.activations import embedding_activation_bytes, layer_activation_terms
    from trainmem.analytic.head import head_activation_bytes
    from trainmem.estimate import resolve_model

    spec = resolve_model(res["preset"])
    terms = layer_activation_terms(spec, res["training"])
    total = sum(terms.values())
    print(f"  analytic layer terms: {total:,} B = {total / t:.1f} B/token")
    for k, v in terms.items():
        print(f"    {k:32} {v:>14,} B  {v / t:9.1f} B/token")
    outside = {**embedding_activation_bytes(spec, res["training"]),
               **head_activation_bytes(spec, res["training"])}  # fmt: skip
    per_token = {k: f"{v / t:.1f} B/token" for k, v in outside.items()}
    print("  analytic embedding/head terms:", per_token)
    saved = layer_saved_tensors(res)
    if saved:
        agg: dict[tuple[str, str, int], int] = defaultdict(int)
        for key in saved:
            agg[key] += 1
        total = sum(n for _, _, n in saved)
        print(f"  layer h.1 saved storages: {total:,} B = {total / t:.1f} B/token")
        for (mod, op, n), k in sorted(agg.items(), key=lambda kv: -kv[0][2] * kv[1]):
            print(f"    {mod:28} {op:48} {k} x {n:>12,} B  {k * n / t:9.1f} B/token")


if __name__ == "__main__":
    sys.exit(main())
