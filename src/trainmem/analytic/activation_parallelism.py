"""How activation terms split over tensor, sequence and context parallel ranks (Korthikanti et
al. 2022, arXiv:2205.05198, sec. 4.2): which terms each rank holds whole, which are split by
the tensor-parallel size, and the per-rank bytes of a term dictionary."""

from __future__ import annotations

from trainmem.specs.training import TrainingConfig

#: Terms of width h (the norm / residual / dropout region): replicated over tensor-parallel ranks
#: unless sequence parallelism splits them (Korthikanti et al. 2022, sec. 4.2.1-4.2.2).
HIDDEN_REGION_TERMS = frozenset(
    {
        "attention/norm",
        "mlp/norm",
        "attention/output_norm",
        "mlp/output_norm",
        "mlp/shared_expert_gate",
        "attention/qkv_input",
        "mlp/input",
        "attention/dropout_mask",
        "mlp/dropout_mask",
        "mlp/expert_inputs",
        "mlp/expert_outputs",
        "mlp/router",
        "layer_input",
        "final_norm",
        "lm_head_input",
        "mlm_transform",
        "pooled",
        "embedding_norm",
        "embedding_dropout_mask",
    }
)


GATHERED_INPUT_TERMS = frozenset({"attention/qkv_input", "mlp/input", "lm_head_input"})
"""The normed inputs of the column-parallel linears (q/k/v, gate/up, the output layer): under
DTensor sequence parallelism they are all-gathered to the full sequence before the linears,
which save them whole
(:attr:`~trainmem.specs.training.TrainingConfig.sequence_parallel_saves_gathered_input`)."""


ROW_PARALLEL_OUTPUT_TERMS = frozenset({"mm/o", "mm/down"})
"""The matmul outputs of the row-parallel linears (the attention's and the MLP's output
projections) that op-level selective checkpointing saves: each tensor-parallel rank multiplies
its [t, i / t_p] input slice by its [h, i / t_p] weight slice, so its output is a partial sum of
the whole [t, h], summed across the ranks only after the matmul (an all-reduce, or a
reduce-scatter over the sequence with sequence parallelism): the saved ``aten.mm`` output is
the full hidden size and the full sequence on every tensor-parallel rank (torch/distributed/
tensor/parallel/style.py ``RowwiseParallel``: ``Shard(1)`` weight, ``Partial`` output
redistributed to ``output_layouts``; Megatron megatron/core/tensor_parallel/layers.py
``RowParallelLinear.forward``: the matmul, then ``reduce_from`` / ``reduce_scatter_to``). Seen in
the trace of llama-3.1-8b FSDP 4 x TP 2 + SP, op-level SAC: down_proj's saved output 2 h t B."""


#: Inputs every tensor-parallel rank holds whole (token ids, rotary tables).
REPLICATED_INPUT_TERMS = frozenset(
    {
        "inputs/token_ids_and_labels",
        "inputs/attention_mask",
        "inputs/pixel_values",
        "rotary_cos_sin",
        "sliding_mask",
        "attention/sliding_mask_bias",
        "attention/mask_bias",
        "causal_mask",
        "attention_mask",
    }
)


def parallel_divisor(term: str, training: TrainingConfig) -> int:
    """Ranks one activation term is split over: tensor parallelism t for the attention / MLP
    internals and the vocabulary-parallel logits (Korthikanti et al. 2022 Eq. 2: sbh(10 + 24/t
    + 5as/ht)), also for the hidden-size region with sequence parallelism (Eq. 3: sbh(34/t +
    5as/ht)); context parallelism splits every term by sequence. Under DTensor sequence
    parallelism (torchtitan) the column-parallel linears save their all-gathered input whole
    (:data:`GATHERED_INPUT_TERMS`)."""
    tp, cp = training.tensor_parallel_size, training.context_parallel_size
    if term in REPLICATED_INPUT_TERMS or term in ROW_PARALLEL_OUTPUT_TERMS:
        return cp
    if term.startswith("lora/"):
        return cp
    if term in GATHERED_INPUT_TERMS and training.sequence_parallel_saves_gathered_input:
        return cp
    if term in HIDDEN_REGION_TERMS and not training.sequence_parallel:
        return cp
    return tp * cp


def split_for_parallelism(terms: dict[str, int], training: TrainingConfig) -> dict[str, int]:
    """Per-rank bytes of each term; see :func:`parallel_divisor`."""
    if training.tensor_parallel_size == 1 and training.context_parallel_size == 1:
        return terms
    return {k: -(-v // parallel_divisor(k, training)) for k, v in terms.items()}
