"""What a training loop that binds ``logits = model(...)`` and ``loss = ...`` in its own scope
(``TrainingConfig.training_loop == "previous"``) still holds of the previous micro-batch while
the next one runs: its model output, and the tensors its autograd graph keeps after its
backward. Symbols as in :mod:`trainmem.analytic.activations` (c the compute dtype's bytes, t
tokens of one micro-batch, h hidden size, i intermediate size, k experts per token).

Note [The previous micro-batch's graph]
    litgpt finetune/lora.py (Apr 2024, 43c44323, and unchanged to Sep 2024, 00af8b0d) runs,
    in ``fit``'s ``while`` loop::

        logits = model(input_ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, targets[..., 1:])
        fabric.backward(loss / train.gradient_accumulation_iters(devices))

    (finetune/full.py the same with ``logits = model(input_ids)``). Nothing deletes
    ``logits``: the previous micro-batch's output (the list of Fabric's fp32 chunks,
    lightning/fabric/wrappers.py ``_FabricModule.forward`` -> ``precision.convert_output``),
    whose ``grad_fn`` reaches every node of its graph, lives until ``model(...)`` returns
    again. (``loss`` reaches the graph too, but the logging after each iteration rebinds it,
    ``loss = running_loss.compute().item()``, at the config hub's ``log_interval: 1``; with a
    larger interval it would hold the graph to the next loss.) A backward without
    ``retain_graph`` releases each node's saved variables (torch/csrc/autograd/engine.cpp
    ``fn.release_variables()``) but not the nodes, so what a custom ``autograd.Function``
    stores as a plain ``ctx`` attribute lives as long as the graph does. bitsandbytes does so:
    ``MatMul4Bit.forward`` keeps ``ctx.tensors = (A, B)`` before 0.43.2 (the 16-bit input A
    when it or the weight needs a gradient; 0.42.0 bitsandbytes/autograd/_functions.py),
    ``MatMul8bitLt.forward`` ``ctx.tensors = (CAt, subA, A)`` when a gradient is needed (before
    0.45.0 A always, and the int8 copy CAt of A when a gradient is needed; Note [bitsandbytes'
    int8 inputs under non-reentrant checkpointing]). So through the next micro-batch's forward, the
    previous one's inputs of every quantized linear are alive beside its own
    (:func:`graph_held_input_bytes`), and so is its output (:func:`previous_output_bytes`).
    Lightning's bitsandbytes plugin replaces every ``nn.Linear``, the LM head's too
    (lightning/fabric/plugins/precision/bitsandbytes.py ``init_context``:
    ``_ClassReplacementContextManager({"torch.nn.Linear": ...})``).

    Which inputs need a gradient: LoRA's adapters are the only trainable weights, and the
    embedding and norms are frozen, so in the first layer the attention's input (the normed
    embedding) needs none, nor, in a parallel block, the MLP's input and, without MLP
    adapters, the MLP's down input; every input after the first layer's attention does.

Note [bitsandbytes' inputs under non-reentrant checkpointing]
    The same ``ctx`` attribute outlives activation checkpointing when the checkpoint is
    torch's non-reentrant one. bitsandbytes before 0.43.2 keeps each 4-bit linear's input as
    ``ctx.tensors = (A, B)`` whenever A or B needs a gradient (0.41.3 autograd/_functions.py
    ``MatMul4Bit.forward``), A being the linear's cast input (nn/modules.py
    ``Linear4bit.forward``: ``x = x.to(self.compute_dtype)``). torch's non-reentrant checkpoint
    (torch 2.1 utils/checkpoint.py ``_checkpoint_without_reentrant_generator``) runs the
    layer's forward with grad enabled inside ``saved_tensors_hooks``, which drop only what
    ``save_for_backward`` saves: the ``MatMul4Bit`` nodes are built as without checkpointing
    and hold A as a plain Python reference. The backward releases a node's saved variables,
    not the node (Note [The previous micro-batch's graph]), so every layer's inputs live from
    its forward until the graph is dropped with the loss (the HF Trainer's ``training_step``
    returns after the backward): all layers' at once at the start of the backward and through
    it. The recompute builds nodes of its own, dropped with the recompute. Under torch's
    reentrant checkpoint the first forward runs under ``no_grad`` (A needs no gradient:
    ``(None, None)``) and the recompute's graph dies when ``CheckpointFunction.backward``
    returns: nothing is kept (:attr:`~trainmem.specs.training.TrainingConfig.
    layer_checkpoint_reentrant`). Per layer (:func:`checkpoint_held_input_bytes`), c bytes a
    value (A is in the compute dtype): a copy per linear where the layer's normed input is in
    another dtype (q, k, v each theirs; gate, up each theirs: autocast over an fp32 stream,
    peft's fp32 upcast, or an fp16 stream under bf16 autocast), else one tensor per input the
    linears share (q / k / v one, gate / up one); o's and down's inputs one each. The first
    layer's attention input needs a gradient only where the input-embedding hook runs
    (``TrainingConfig.input_embeddings_require_grad``).

    Who runs it so: ms-swift @4312aeb (its benchmark's commit) patches
    ``torch.utils.checkpoint.checkpoint`` to ``use_reentrant=False`` by default in
    ``get_model_tokenizer`` (swift/llm/utils/model.py ``fix_gradient_checkpointing_warning``),
    and Qwen-1's remote code calls ``torch.utils.checkpoint.checkpoint(...)`` without the
    argument (modeling_qwen.py ``QWenModel.forward``, Qwen/Qwen-7B Dec 2023); Answer.AI's
    fsdp_qlora asks for ``--reentrant_checkpointing true`` with bitsandbytes "to avoid
    triggering a bug in bitsandbytes which results in high memory usage" (README.md). The
    ms-swift benchmark's nf4 cells measured 4.64 / 6.75 / 20.0 GiB over their GPTQ int4
    cells at 7B / 14B / 72B (2,048 tokens); less the head's bf16 copy (Note [A quantized
    base's other weights in another 16-bit dtype]) that is 3.48 / 5.30 / 17.69 GiB, against
    L x 2 B x 2,048 x (4 h + i) = 3.34 / 5.22 / 17.50 GiB here (Qwen-1's fused c_attn, o,
    w1, w2 reading its fp16 stream, each with its own bf16 copy, and the MLP's c_proj).
    Checked on the CPU (benchmarks/bnb_ctx_checkpoint.py: bitsandbytes 0.41.3's own
    ``MatMul4Bit`` under torch's checkpoint, its CUDA dequantization stubbed). Not modelled:
    blocks other than a dense decoder's, and the recompute's own copies, which the schedule
    keeps through the layer's backward as recomputed terms where the real recompute drops them
    with its graph.

Note [bitsandbytes' int8 inputs under non-reentrant checkpointing]
    ``MatMul8bitLt`` keeps ``ctx.tensors = (CAt, subA, A)`` at every release read (0.40.0 ..
    0.49.2 autograd/_functions.py) whenever its input or weight needs a gradient, so an int8
    base under torch's non-reentrant checkpoint keeps its inputs as a 4-bit one before
    0.43.2 does (Note [bitsandbytes' inputs under non-reentrant checkpointing]), with three
    differences. A is the input as given, not a cast (nn/modules.py ``Linear8bitLt.forward``
    passes ``x`` to ``bnb.matmul``, which reshapes a 3-d input to 2-d, a view): the linears
    that read one tensor keep it once (q / k / v the normed input, gate / up theirs), in its
    own dtype (the residual stream's, fp32 under peft's upcast); o's and down's inputs as the
    step has them. Before 0.45.0 (:data:`~trainmem.specs.frameworks.
    BNB_INT8_KEEPS_ONLY_GRADED_INPUT_SINCE`) ``F.double_quant`` always made ``CAt``, the int8
    transposed copy of the input (1 B a value, one per linear), kept with A, and a node whose
    inputs need no gradient kept A all the same (``[None, None, A]``: the first layer's
    attention input); from 0.45.0 a frozen weight's fast path makes no ``CAt`` and such a node
    keeps nothing. Not modelled: ``subA``, the input's outlier columns (``A[:, idx]``, those
    with a value over ``llm_int8_threshold``, 6.0 in transformers' ``BitsAndBytesConfig``),
    which depend on the data. Checked on the CPU: benchmarks/bnb_ctx_checkpoint.py's int8
    cell.
"""

from __future__ import annotations

from trainmem.analytic.activation_shapes import (
    autocast_casts_layer_inputs,
    compute_and_residual_bytes,
    tokens_per_sequence,
)
from trainmem.analytic.loss import (
    accelerate_output_bytes,
    shifted_positions,
    transposed_cross_entropy,
)
from trainmem.analytic.params import LinearShapes, linear_shapes
from trainmem.analytic.tensor_states import quantized_lm_head
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def previous_output_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the previous micro-batch's model output the loop holds until the next forward
    returns (Note [The previous micro-batch's graph]): the logits, b*s*V values, fp32 when the
    framework casts the output (``FrameworkConventions.fp32_model_output``: Lightning Fabric's
    ``convert_output``; accelerate's ``native_amp`` forward, Note [accelerate's fp32 outputs]
    in trainmem/analytic/loss.py), else in the compute dtype (transformers' causal LMs return the
    ``lm_head`` output and upcast only inside the loss, loss/loss_utils.py). 0 for another loop
    or a model without an LM head. The whole vocabulary: no framework with this loop shards
    the logits (it is refused with pipelining). torchtune's 2024 recipes rebind ``logits`` to
    the shifted fp32 copy: b*(s - 1)*V fp32 values (Note [torchtune's transposed
    cross-entropy]).
    """
    if training.training_loop != "previous" or model.head not in ("causal-lm", "masked-lm"):
        return 0
    if transposed_cross_entropy(model, training):
        return 4 * model.vocab_size * shifted_positions(model, training)
    return output_logits_bytes(model, training)


def output_logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the logits the model output holds for a loop that binds it, b*s*V values: fp32
    when the framework casts the output (``FrameworkConventions.fp32_model_output``: Lightning
    Fabric's ``convert_output``; accelerate's ``native_amp`` forward, Note [accelerate's fp32
    outputs]) or when transformers' model code returns them upcast
    (``ModelSpec.returns_fp32_logits``: Llama before 4.46, Mistral before 4.48, whose bf16
    ``lm_head`` output is then freed at the cast), else in the compute dtype (the ``lm_head``
    output; the loss upcasts inside, loss/loss_utils.py). The whole vocabulary."""
    c, _ = compute_and_residual_bytes(training)
    fp32 = (
        training.conventions.fp32_model_output
        or accelerate_output_bytes(model, training)
        or (
            training.conventions.hf_model_code
            and model.returns_fp32_logits(training.transformers_release)
        )
    )
    per_value = 4 if fp32 else c
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return per_value * model.vocab_size * t


def _layer_widths(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """Values per token of one layer's quantized-linear inputs: (all of them, those that need
    no gradient in the first layer). Distinct tensors only: q, k and v (or the fused qkv, MLA's
    q_a and kv_a) read one input, gate and up another; a parallel block with one shared norm
    feeds the attention's input to the MLP; an MoE layer's router reads the MLP input and each
    routed token's copy goes to its k experts."""
    shapes = linear_shapes(model)
    h = model.hidden_size
    k = model.num_experts_per_tok if model.num_experts > 1 else 1
    targets = set(training.lora_targets)
    attention = h + sum(shapes[n][0] for n in ("q_b", "kv_b") if n in shapes)
    shared = model.parallel_attention and model.num_norms_per_layer == 1
    mlp_in = (0 if shared else h) + (k * h if k > 1 else 0)
    down = shapes["down"][0] * k + (shapes["shared_down"][0] if "shared_down" in shapes else 0)
    total = attention + shapes["o"][0] + mlp_in + down
    no_grad = attention  # the normed embedding, and MLA's latents from frozen projections
    if model.parallel_attention:  # the MLP reads the block's input too
        no_grad += mlp_in + (0 if targets & {"gate", "up"} else down)
    return total, no_grad


def graph_held_input_bytes(
    model: ModelSpec, training: TrainingConfig, *, num_layers: int, has_head: bool
) -> int:
    """Bytes the previous micro-batch's graph keeps alive through the next forward under the
    ``previous`` loop: the inputs of its bitsandbytes linears, stored as ``ctx``
    attributes (Note [The previous micro-batch's graph]); 0 for another loop, a base whose
    matmul saves no input (``TrainingConfig.quantized_matmul_saves_input``: bitsandbytes
    4-bit from 0.43.2, torchao NF4) and GPTQ (not a bitsandbytes function).

    Per input tensor of T = b*s tokens and w values per token: 4-bit (``MatMul4Bit``) c*w*T
    when it needs a gradient, nothing otherwise; int8 (``MatMul8bitLt``) from bitsandbytes
    0.45.0 the same, before c*w*T always and w*T more (the int8 ``CAt``) when it needs one
    (``TrainingConfig.bnb_int8_transposed_copy``). ``num_layers`` layers (layer 0 counted as
    the first, its frozen inputs apart) and, when ``has_head`` and the LM head is quantized
    (:func:`~trainmem.analytic.tensor_states.quantized_lm_head`), the final norm's output
    (c*h*T; the chunks lit-gpt's head reads are views of it).
    """
    if (
        training.training_loop != "previous"
        or not training.quantized_matmul_saves_input
        or training.quantize_base == "gptq-int4"
        or num_layers == 0
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    # MatMul8bitLt before 0.45.0: the int8 CAt beside a graded input, and an ungraded input
    # kept too (Note [bitsandbytes' int8 inputs under non-reentrant checkpointing])
    copy = training.bnb_int8_transposed_copy
    total, no_grad = _layer_widths(model, training)
    graded = num_layers * total - no_grad
    values = graded * (c + 1 if copy else c) + (no_grad * c if copy else 0)
    if has_head and model.head == "causal-lm" and quantized_lm_head(training):
        values += model.hidden_size * (c + 1 if copy else c)
    return values * t


_DENSE_LINEARS = frozenset({"q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down"})


def checkpoint_held_input_bytes(
    model: ModelSpec, training: TrainingConfig, *, first_layer: bool = False
) -> int:
    """Bytes one checkpointed layer's bitsandbytes linears keep of their inputs from the
    layer's forward to the end of the backward under torch's non-reentrant checkpoint (Note
    [bitsandbytes' inputs under non-reentrant checkpointing]): 4-bit, c x t x the values per
    token of the inputs, a copy per linear where the normed input is cast, one per shared
    input otherwise; int8 (Note [bitsandbytes' int8 inputs under non-reentrant
    checkpointing]), the inputs as given, one per shared input (the normed ones in the residual
    stream's dtype, r), and before bitsandbytes 0.45.0 each linear's own int8 copy of its
    input (1 B a value); the stack's ``first_layer`` without its attention input unless the
    input-embedding hook makes it need a gradient (int8 before 0.45.0: its input kept all the
    same, no copy). 0 where ``TrainingConfig.checkpoint_keeps_bnb_inputs`` does not hold, and
    for a block other than a dense decoder's."""
    if not training.checkpoint_keeps_bnb_inputs or model.architecture != "decoder":
        return 0
    shapes = linear_shapes(model)
    if not set(shapes) <= _DENSE_LINEARS or not {"o", "down"} <= set(shapes):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    if training.quantize_base == "int8":
        return _int8_kept_bytes(model, training, shapes, first_layer=first_layer) * t
    cast = autocast_casts_layer_inputs(training, model) or (
        training.kbit_fp32_upcast and training.compute_dtype != "float32"
    )
    h = model.hidden_size
    attention = [n for n in ("q", "k", "v", "qkv") if n in shapes]
    mlp = [n for n in ("gate", "up", "gate_up") if n in shapes]
    shared = model.parallel_attention and model.num_norms_per_layer == 1
    values = shapes["o"][0] + shapes["down"][0]
    if not first_layer or training.input_embeddings_require_grad:
        values += h * (len(attention) if cast else 1)
    if not shared or cast:
        values += h * (len(mlp) if cast else 1)
    return dtype_bytes(training.compute_dtype) * values * t


def _int8_kept_bytes(
    model: ModelSpec,
    training: TrainingConfig,
    shapes: LinearShapes,
    *,
    first_layer: bool,
) -> int:
    """Bytes per token one layer's ``MatMul8bitLt`` nodes keep under non-reentrant
    checkpointing (Note [bitsandbytes' int8 inputs under non-reentrant checkpointing]): the
    normed inputs (r bytes, q / k / v one tensor, gate / up one; a parallel block's one
    norm one for both), o's and down's inputs (c bytes, as the step models them), and before
    0.45.0 (``TrainingConfig.bnb_int8_transposed_copy``) each graded linear's int8 ``CAt``."""
    c, r = compute_and_residual_bytes(training)
    h = model.hidden_size
    attention = [n for n in ("q", "k", "v", "qkv") if n in shapes]
    mlp = [n for n in ("gate", "up", "gate_up") if n in shapes]
    shared = model.parallel_attention and model.num_norms_per_layer == 1
    graded_attention = not first_layer or training.input_embeddings_require_grad
    copy = training.bnb_int8_transposed_copy
    total = c * (shapes["o"][0] + shapes["down"][0])
    if graded_attention or copy:  # before 0.45.0 kept with no gradient too
        total += r * h
    if not shared:
        total += r * h
    if copy:  # a parallel block's first MLP reads the embedding too: no gradient there
        mlp_graded = graded_attention or not model.parallel_attention
        graded = ["o", *(attention if graded_attention else []), *(mlp if mlp_graded else [])]
        total += sum(shapes[n][0] for n in (*graded, "down"))
    return total
