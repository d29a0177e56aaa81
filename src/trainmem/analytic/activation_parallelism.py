"""How activation terms split over tensor, sequence and context parallel ranks (Korthikanti et
al. 2022, arXiv:2205.05198, sec. 4.2): which terms each rank holds whole, which are split by
the tensor-parallel size, and the per-rank bytes of a term dictionary."""

from __future__ import annotations

from typing import NamedTuple

from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.float8 import float8_tensor_parallel
from trainmem.specs.model import ModelSpec
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


WEIGHT_TERMS = frozenset({"autocast_weight_copies"})
"""Saved copies of weights, not of tokens: autocast's 16-bit casts of the linear (and LM head)
weights that the matmuls save for the input gradient. A rank holds its tensor-parallel shard of
every weight whole over the sequence, so context parallelism does not split them (Note
[Weight terms under context parallelism])."""


def parallel_divisor(term: str, training: TrainingConfig) -> int:
    """Ranks one activation term is split over: tensor parallelism t for the attention / MLP
    internals and the vocabulary-parallel logits (Korthikanti et al. 2022 Eq. 2: sbh(10 + 24/t
    + 5as/ht)), also for the hidden-size region with sequence parallelism (Eq. 3: sbh(34/t +
    5as/ht)); context parallelism splits every term by sequence except the weight copies
    (:data:`WEIGHT_TERMS`). Under DTensor sequence parallelism (torchtitan) the column-parallel
    linears save their all-gathered input whole (:data:`GATHERED_INPUT_TERMS`).

    Note [Weight terms under context parallelism]
        torch's ``context_parallel`` (torch 2.13 distributed/tensor/experimental/
        _context_parallel/_attention.py ``context_parallel``: the listed buffers, "not ...
        any nn.Parameter", sharded along their sequence dimension in place, SDPA rerouted to
        ring attention) leaves the parameters alone, so a CP rank
        multiplies its s / cp tokens by the whole weight: autocast's 16-bit cast of it
        (aten/src/ATen/autocast_mode.cpp ``cached_cast``), which the matmul saves for the
        input gradient (``mm`` saves ``mat2``), is the whole weight's (its tensor-parallel
        shard under TP) on every CP rank. Traced (a 2-layer 2048-wide Llama, pytorch-amp
        FSDP 4 x CP 2, bf16-mixed, 2 x 256 tokens): q_proj's saved cast 8,388,608 B =
        2 x 2048 x 2048, as without CP; dividing it by cp put the formulas 1.3 % below the
        generic path there, once their FSDP shard group spanned the CP ranks too
        (``FrameworkConventions.fsdp_shards_over_context_parallel``, 2026-11-28)."""
    tp, cp = training.tensor_parallel_size, training.context_parallel_size
    if term in WEIGHT_TERMS:
        return tp
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


class SequenceParallelCopies(NamedTuple):
    """The transient copies DTensor sequence parallelism makes around one layer's linears, bytes
    on one rank (Note [Sequence-parallel collectives' copies]).

    Attributes:
        gathered: the all-gather's output before its chunk-and-cat, once per all-gathered
            input (q/k/v's, gate/up's, the LM head's); 0 where the cat is a view.
        partial: a row-parallel linear's full-sequence partial sum [T, h], made twice per
            reduce-scatter (the matmul's output and its chunk-and-cat copy).
        head_gathered: the LM head's all-gather output before its cat (in the compute dtype:
            the output layer is not a float8 linear); 0 where the cat is a view.
    """

    gathered: int
    partial: int
    head_gathered: int = 0


def sequence_parallel_copies(model: ModelSpec, training: TrainingConfig) -> SequenceParallelCopies:
    """The copies of :class:`SequenceParallelCopies` for one rank (zeros without DTensor
    sequence parallelism or for a layer other than a dense pre-norm decoder's).

    Note [Sequence-parallel collectives' copies]
        Under DTensor sequence parallelism (torchtitan's plan,
        ``FrameworkConventions.dtensor_sequence_parallel``) the hidden states between the
        linears are sharded over the sequence, ``Shard(1)`` of [b, s, h], and every collective
        works on dimension 1, not 0 (torch/distributed/tensor/placement_types.py
        ``Shard._to_replicate_tensor`` -> ``funcol.all_gather_single(gather_dim=self.dim)``,
        ``Shard._reduce_shard_tensor`` -> ``funcol.reduce_scatter_single(scatter_dim=
        self.dim)``). NCCL gathers and scatters along dimension 0 only, so
        (torch/distributed/_functional_collectives.py):

        * ``all_gather_single`` gathers into a new [tp*b, s/tp, h] tensor, then
          ``_maybe_view_chunk_cat`` (torch/_utils.py) re-concatenates it along dimension 1 with
          ``torch.cat``: a second full [b, s, h] tensor, the one the column-parallel linear
          reads; the first is freed after the cat. The cat is a view only when the gathered
          tensor's dimension 0 is the group size, i.e. b == 1 (torch 2.13; the Dec 2024 build
          torchtitan's benchmarks ran, 1963fc8, always cats: # NB older torch at b == 1 is
          not modelled). Under float8 tensor parallelism the gather runs on the float8 cast
          (Note [Float8 tensor-parallel inputs]): 1 byte a value;
        * ``reduce_scatter_single`` first makes its input contiguous along dimension 0,
          ``_chunk_or_narrow_cat(self, group_size, narrow_dim=scatter_dim, cat_dim=0)`` =
          ``torch.cat(torch.chunk(...))``, a copy of the row-parallel linear's whole
          [b, s, h] partial sum (o and down projections, ``RowwiseParallel`` with
          ``output_layouts=Shard(1)``), while the matmul's output is still alive: two
          c*h*T tensors, then the [b, s/tp, h] result.

        The LM head (``ColwiseParallel(input_layouts=Shard(1))`` on the output layer,
        torchtitan's ``apply_tp``) gathers the final norm's output the same way, in the compute
        dtype: torchtitan's float8 conversion leaves the output layer out.

        Per rank, T = b*s/cp tokens: gathered = g*h*T (g = 1 under float8 TP, else c),
        head_gathered = c*h*T and partial = c*h*T. Traced (the trace engine runs the same
        DTensor code): llama-3.1-70b FSDP 32 x TP 8 + SP, float8, b = 16, s = 8192, per layer
        two 1024 MiB float8 gathers each followed by its 1024 MiB cat, and two pairs of
        2048 MiB partial sums; at the head a 2048 MiB gather and its 2048 MiB cat.
    """
    if not (
        training.sequence_parallel_saves_gathered_input
        and training.tensor_parallel_size > 1
        and model.architecture == "decoder"
        and model.pre_norms
        and not model.parallel_attention
        and model.num_experts <= 1
    ):
        return SequenceParallelCopies(0, 0)
    c, _ = compute_and_residual_bytes(training)
    b, cp = training.micro_batch_size, training.context_parallel_size
    tokens = b * tokens_per_sequence(model, training) // cp
    g = 1 if float8_tensor_parallel(training) else c
    full = c * model.hidden_size * tokens
    if b == 1:  # the cat is a view
        return SequenceParallelCopies(0, full, 0)
    return SequenceParallelCopies(g * model.hidden_size * tokens, full, full)
