"""The published probe's seventh source (helper probe2, session 27): Megatron-LM's own CI
memory tests, a 7B GPT trained by ``pretrain_gpt.py`` on one node of 8 GPUs, run by
``published_probe.py`` after PEFT's cells.

Source: NVIDIA/Megatron-LM tests/functional_tests/test_cases/gpt/gpt3_7b_tp4_pp1_memory_speed
and gpt3_7b_tp1_pp4_memory_speed @7e6a045a2a99659ddd2919fc19013a164c508825 (25 Jul 2026,
"stabilize Transformer Engine 2.18 upgrade"): model_config.yaml (the run's arguments; unchanged
to d98e8a6 but for the launcher) and golden_values_dev_dgx_{h100,a100,gb200}.json, the values
the CI run recorded per iteration; tests/test_utils/recipes/h100/gpt.yaml at the same commit:
``nodes: 1``, ``gpus: 8``, scope ``mr`` on dgx_h100 (the lts runs are off: "OOM: #434").

The figure: ``mem-max-allocated-bytes``, ``torch.cuda.memory_stats()["allocated_bytes.all.
peak"]`` on the rank holding the TensorBoard writer (megatron/training/global_vars.py:
``args.rank == (args.world_size - 1)``; training.py ``training_log`` with
``--log-memory-to-tensorboard``), never reset: the run's peak allocated on rank 7, read at
iteration 25 (iterations 2-25 agree; iteration 1 is lower, before the optimizer states exist).
Rank 7 in megatron-core's default order ``tp-cp-ep-dp-pp`` (parallel_state.py
``initialize_model_parallel``) is the last pipeline stage of the TP 1 x PP 4 run. Compared with
trainmem's peak allocated of that rank, GB = 1e9 B.

The run (model_config.yaml; megatron-core's TransformerConfig defaults for what it does not
set): 32 layers, hidden 4096, 32 heads with 8 query groups, ffn 4 x hidden = 16384 (no
``--swiglu``: GELU), LayerNorm, biases on the linears, learned absolute positions (8192),
hidden and attention dropout 0.1, untied output layer, NullTokenizer vocabulary 131073 padded to
a multiple of 128 x TP (vocab_utils.py ``calculate_padded_vocab_size``: 131584 at TP 4, 131200
at TP 1); ``--bf16``, Transformer Engine layers, the distributed optimizer over DP 2
(8 GPUs / (TP x PP)), overlapped grad reduce / param gather, no gradient-accumulation fusion,
no recompute, ``--clip-grad 1.0``; 8192 tokens, micro-batch 2 (TP 4) / 1 (PP 4), global batch
8: 2 / 4 micro-batches per rank; PP 4 interleaved with one layer per virtual stage
(``--num-layers-per-virtual-pipeline-stage 1``: 8 chunks per rank).

Mapping: a starcoder2 config.json (GQA, LayerNorm, a GELU MLP with biases: the same layer
shapes) with the padded vocabulary and the dropouts, ``--framework megatron``, ``bf16-mixed``,
``--zero-stage 1`` over ``--data-parallel-size 2``, flash attention (TE's fused attention).
Not modelled: the learned position table (8192 x 4096, on the first stage only: 0.40 GB of
states on the TP 4 ranks: 67 MB bf16, 134 MB fp32 main grad, 201 MB of the distributed
optimizer's 12 B / 2; absent on the PP 4 last stage); rope's cos / sin caches are traced
instead (a few MB).

Found (session 27): TP 4 -1.0 % (H100) / -2.8 % (A100); the model states between steps 20.16
GB against the logged 20.66 (the position table's 0.40 GB). PP 4 interleaved, the last stage:
+5.4 / +5.7 % while trainmem put torch.distributed.pipelining's stage buffers on a Megatron
stage (25.4 stage outputs kept in ``fwd_cache`` and 31 persistent receive buffers, 56.4 x 67.1
MB = 3.78 GB); Megatron keeps neither (megatron-core ``deallocate_output_tensor`` under
``deallocate_pipeline_outputs=True``, p2p_communication.py ``_communicate``'s ``torch.empty``
per message: Note [Megatron's pipeline stage buffers] in trainmem/analytic/pipeline.py, helper
megapipe): 64.00 -> 60.28 GB against 60.72 (-0.7 %, H100) and 60.49 (-0.4 %, A100). The
logged PP rank holds 24.81 GB between steps against trainmem's 23.36 GB of model states: 1.45
GB not read.

Run: ``PYTHONPATH=src python benchmarks/published_probe.py`` (these cells last), or this file.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

SOURCE = (
    "https://github.com/NVIDIA/Megatron-LM/tree/7e6a045a2a99659ddd2919fc19013a164c508825/"
    "tests/functional_tests/test_cases/gpt"
)

_GPT_7B: dict[str, Any] = {
    "model_type": "starcoder2",
    "architectures": ["Starcoder2ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "hidden_act": "gelu",
    "norm_epsilon": 1e-05,
    "use_bias": True,
    "tie_word_embeddings": False,
    "attention_dropout": 0.1,
    "residual_dropout": 0.1,
    "embedding_dropout": 0.1,
    "sliding_window": None,
}
#: The model at each tensor-parallel size (the padded vocabulary follows TP).
CONFIGS = {
    "gpt-7b-tp4": {**_GPT_7B, "vocab_size": 131584},
    "gpt-7b-tp1": {**_GPT_7B, "vocab_size": 131200},
}

_COMMON = [
    "--framework", "megatron", "--precision", "bf16-mixed", "--seq-len", "8192",
    "--data-parallel-size", "2", "--zero-stage", "1", "--attention", "flash",
    "--activation-checkpointing", "none", "--optimizer", "adamw",
]  # fmt: skip

#: test case -> (config, trainmem arguments beside ``_COMMON``).
CASES: dict[str, tuple[str, list[str]]] = {
    "gpt3_7b_tp4_pp1_memory_speed": (
        "gpt-7b-tp4",
        ["--micro-batch-size", "2", "--gradient-accumulation-steps", "2",
         "--tensor-parallel-size", "4"],
    ),
    "gpt3_7b_tp1_pp4_memory_speed": (
        "gpt-7b-tp1",
        ["--micro-batch-size", "1", "--gradient-accumulation-steps", "4",
         "--pipeline-parallel-size", "4", "--pipeline-schedule", "interleaved-1f1b",
         "--set", "virtual-pipeline-stages=8"],
    ),
}  # fmt: skip

#: (test case, GPU, mem-max-allocated-bytes at iteration 25, mem-allocated-bytes there: the
#: model states between steps).
ROWS: list[tuple[str, str, int, int]] = [
    ("gpt3_7b_tp4_pp1_memory_speed", "H100-80GB", 57143791616, 20663519232),
    ("gpt3_7b_tp4_pp1_memory_speed", "A100-80GB", 58188115968, 20634103808),
    ("gpt3_7b_tp1_pp4_memory_speed", "H100-80GB", 60720852992, 24808996864),
    ("gpt3_7b_tp1_pp4_memory_speed", "A100-80GB", 60489064448, 24510808064),
]
#: The GB200 goldens of the same runs (no GB200 in trainmem's GPU table; trainmem's allocated
#: does not depend on the GPU here): TP 4 58,217,476,096 B, PP 4 60,519,342,080 B.


def row_args(case: str, gpu: str, paths: dict[str, str]) -> list[str]:
    """``trainmem estimate`` arguments of one cell (without ``--json``)."""
    config, args = CASES[case]
    return [paths[config], *_COMMON, *args, "--gpu", gpu]


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def run() -> list[float]:
    """Print the cells' table; |relative error| of the logged rank's peak allocated."""
    from published_probe import write_json_files
    from validate import _invoke_estimate, metric_of

    print(f"\nsource: {SOURCE}")
    print(
        "| test case | GPU | measured max allocated GB (rank 7) | allocated GB | error "
        "| measured between steps GB | model states GB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    errors: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_json_files(Path(tmp), CONFIGS)
        for case, gpu, peak, between in ROWS:
            answer, error = _invoke_estimate(row_args(case, gpu, paths))
            head = f"| {case} | {gpu} | {peak / 1e9:.2f} |"
            tail = f"{between / 1e9:.2f} |"
            if answer is None:
                print(f"{head} {error} | | {tail} |")
                continue
            rank = "last_stage" if "pp4" in case else None
            allocated = metric_of(answer, "allocated", rank=rank)
            assert allocated is not None  # allocated is always answered
            predicted = allocated / 1e9
            states = sum(answer["model_states_bytes"].values()) / 1e9
            errors.append(abs(predicted - peak / 1e9) / (peak / 1e9))
            print(f"{head} {predicted:.2f} | {_pct(predicted, peak / 1e9)} | {tail} {states:.2f} |")
    return errors


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from published_probe import run_alone

    run_alone("Megatron-LM CI memory tests, peak allocated", run)
