"""Analytic vs trace engine, category by category, over presets that trace quickly.

Run:  python benchmarks/analytic_vs_trace.py [--presets gpt2,bert-base-uncased] [--quick]

For each (preset, config) it prints the peak breakdown of both engines (bytes) and compares
activations where both engines measure the same thing: the activations alive at the end of the
forward pass, per transformer layer and outside the layers (embeddings, final norm, logits,
loss). ``analytic`` = ``details["activations_per_layer_bytes"]`` and
``details["activation_terms_outside_layers_bytes"]``; ``trace`` = the trace's
``details["activation_bytes_by_module"]`` grouped by layer (inputs included). Rows where the
analytic per-layer figure is off by more than 5% are flagged with ``<<``.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

from trainmem.breakdown import BREAKDOWN_KEYS
from trainmem.errors import TrainmemError
from trainmem.estimate import estimate as estimate_analytic
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig
from trainmem.trace.engine import estimate_trace

PRESETS = ("tiny-gpt2-test", "tiny-llama-test", "gpt2", "bert-base-uncased", "llama-3.2-1b")
CONFIGS: dict[str, dict[str, object]] = {
    "fp32 b4 s512": dict(micro_batch_size=4, seq_len=512, precision="32-true"),
    "fp32 b4 s512 nodrop": dict(
        micro_batch_size=4, seq_len=512, precision="32-true", dropout=False
    ),
    "bf16-mixed b4 s512": dict(micro_batch_size=4, seq_len=512, precision="bf16-mixed"),
    "bf16-mixed b4 s512 full-ckpt": dict(
        micro_batch_size=4, seq_len=512, precision="bf16-mixed", activation_checkpointing="full"
    ),
    "bf16-true b2 s1024 eager": dict(
        micro_batch_size=2, seq_len=1024, precision="bf16-true", attention="eager"
    ),
    "bf16-mixed b4 s512 selective": dict(
        micro_batch_size=4,
        seq_len=512,
        precision="bf16-mixed",
        activation_checkpointing="selective",
    ),
    "bf16-mixed b2 s512 lora r16 qv": dict(
        micro_batch_size=2, seq_len=512, precision="bf16-mixed", lora_rank=16
    ),
    "bf16-mixed b2 s512 lora r16 all dropout": dict(
        micro_batch_size=2,
        seq_len=512,
        precision="bf16-mixed",
        lora_rank=16,
        lora_targets=("q", "k", "v", "o", "gate", "up", "down"),
        lora_dropout=0.05,
    ),
    "fsdp2 x4 bf16-mixed b2 s512": dict(
        micro_batch_size=2,
        seq_len=512,
        precision="bf16-mixed",
        framework="fsdp2",
        data_parallel_size=4,
        zero_stage=3,
    ),
}
TOLERANCE = 0.05
_LAYER = re.compile(r"^(.*?(?:\.h|\.layers|\.layer)\.(\d+))(\.|$)")


def per_layer_trace(acts: dict[str, int]) -> tuple[dict[int, int], int]:
    """(activation bytes per layer index, bytes outside layers) from the trace's module table."""
    layers: dict[int, int] = defaultdict(int)
    outside = 0
    for module, n in acts.items():
        m = _LAYER.match(module)
        if m:
            layers[int(m.group(2))] += n
        else:
            outside += n
    return dict(layers), outside


def pct(a: int, t: int) -> str:
    return "   n/a" if t == 0 else f"{100.0 * (a - t) / t:+6.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    flagged: list[str] = []
    for preset in args.presets.split(","):
        spec = load_model_spec(preset)
        for cname in args.configs.split(","):
            training = TrainingConfig(**CONFIGS[cname])  # type: ignore[arg-type]
            an = estimate_analytic(spec, training)
            t0 = time.perf_counter()
            try:
                tr = estimate_trace(preset, training)
            except TrainmemError as exc:  # e.g. seq_len beyond BERT's 512 positions
                print(f"\n== {preset} | {cname} | skipped: {exc}"[:160])
                continue
            secs = time.perf_counter() - t0
            print(f"\n== {preset} | {cname} | trace {secs:.1f}s")
            print(f"   {'category':18s} {'analytic':>16s} {'trace':>16s}   diff")
            a_d, t_d = an.breakdown.as_dict(), tr.breakdown.as_dict()
            for key in BREAKDOWN_KEYS[:5]:
                print(f"   {key:18s} {a_d[key]:>16,} {t_d[key]:>16,}  {pct(a_d[key], t_d[key])}")
            print(
                f"   {'peak allocated':18s} {an.breakdown.allocated_bytes:>16,} "
                f"{tr.breakdown.allocated_bytes:>16,}  "
                f"{pct(an.breakdown.allocated_bytes, tr.breakdown.allocated_bytes)}"
                f"   phase {an.peak_phase} / {tr.peak_phase}"
            )
            layers, outside = per_layer_trace(tr.details["activation_bytes_by_module"])
            a_layer = int(an.details["activations_per_layer_bytes"])
            t_layer = max(layers.values()) if layers else 0
            # With full checkpointing the trace keeps only each layer's input, attributed to the
            # previous module; compare totals then.
            a_out = int(sum(an.details["activation_terms_outside_layers_bytes"].values()))
            flag = " <<" if t_layer and abs(a_layer - t_layer) > TOLERANCE * t_layer else ""
            diff = pct(a_layer, t_layer)
            print(f"   acts/layer (end fwd) {a_layer:>14,} {t_layer:>16,}  {diff}{flag}")
            print(f"   acts outside layers  {a_out:>14,} {outside:>16,}  {pct(a_out, outside)}")
            if flag:
                flagged.append(f"{preset} | {cname}: per-layer {pct(a_layer, t_layer)}")
            terms = an.details["activation_terms_per_layer_bytes"]
            top = sorted(
                (
                    (k, v)
                    for k, v in tr.details["activation_bytes_by_module"].items()
                    if _LAYER.match(k) and _LAYER.match(k).group(2) == "0"
                ),
                key=lambda kv: -kv[1],
            )
            print("   analytic terms/layer:", {k: v for k, v in terms.items() if v})
            print("   trace layer 0 by module:", dict(top))
    print("\nflagged (analytic per-layer activations off by > 5%):")
    for line in flagged:
        print("  ", line)


if __name__ == "__main__":
    main()
