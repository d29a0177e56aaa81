"""Wall time of the generic path (``--engine generic``) on deep models, against the full trace.

The generic path traces five blocks per run of identical blocks and repeats the middle one
(``trainmem.trace.generic``), so its time should not grow with depth; the full trace runs every
block. Usage::

    PYTHONPATH=src python benchmarks/generic_speed.py [--full]

``--full`` also traces the whole model (minutes for 70B) and prints both peaks. Results are
recorded in benchmarks/RESULTS.md by hand (machine load varies).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

DEEPSEEK_V3_SHAPED = {
    # deepseek-ai/DeepSeek-V3 config.json (shapes only; 671B parameters)
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _time(model: str, training: TrainingConfig, engine: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    est = estimate(model, training, engine=engine, simulate_allocator=False)
    return time.perf_counter() - t0, est.breakdown.allocated_bytes, est.num_parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="also trace the whole model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    tmp = Path(tempfile.mkdtemp()) / "config.json"
    tmp.write_text(json.dumps(DEEPSEEK_V3_SHAPED))
    cases = [
        ("llama-3.1-70b", "llama-3.1-70b", TrainingConfig(micro_batch_size=1, seq_len=4096)),
        ("deepseek-v3-shaped", str(tmp), TrainingConfig(micro_batch_size=1, seq_len=4096)),
    ]
    t0 = time.perf_counter()  # imports torch / transformers once (not per model)
    estimate("tiny-llama-test", TrainingConfig(micro_batch_size=1, seq_len=32), engine="generic")
    print(f"first call (imports, tiny model): {time.perf_counter() - t0:.1f} s", flush=True)
    for label, model, training in cases:
        seconds, peak, params = _time(model, training, "generic")
        line = f"{label}: generic {seconds:.1f} s, peak {peak / 2**30:.2f} GiB, {params:,} params"
        if args.full:
            full_s, full_peak, _ = _time(model, training, "trace")
            line += f"; full trace {full_s:.1f} s, peak {full_peak / 2**30:.2f} GiB"
            line += f" ({(peak - full_peak) / full_peak * 100:+.3f}%)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
