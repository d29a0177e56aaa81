"""The MLP's activations: the activation functions (fused kernels, the tanh and sigmoid formulas
written out as separate ops), gated MLPs, transformers' mixture-of-experts blocks, and the
sequential pre-norm block whose MLP input is freed first in backward. Symbols as in
:mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_shapes import (
    autocast_casts_layer_inputs,
    autocast_fp32_layer_norms,
    cast_copies,
    compute_and_residual_bytes,
)
from trainmem.analytic.params import adapter_targets
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

#: HF activation names implemented as one fused kernel that saves only its input.
FUSED_ACTIVATIONS = frozenset(
    {"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish", "gelu_python", "tanh"}
)


#: HF activation names written as ``x * sigmoid(1.702 * x)`` (transformers/activations.py
#: ``QuickGELUActivation``, CLIP's ``quick_gelu``): the multiplication saves x and the sigmoid's
#: output, the sigmoid its output, so three i-sized tensors with the down projection's input.
SIGMOID_FORMULA_ACTIVATIONS = frozenset({"quick_gelu"})


#: HF activation names written as separate tanh-formula ops (transformers/activations.py
#: ``NewGELUActivation``, ``FastGELUActivation``).
TANH_FORMULA_ACTIVATIONS = frozenset({"gelu_new", "gelu_fast"})


def activation_fn_saved_bytes(model: ModelSpec, training: TrainingConfig, width: int) -> int:
    """Bytes per token saved by the non-gated MLP activation and the down projection's input."""
    c, _ = compute_and_residual_bytes(training)
    # lit-gpt's own model code runs GELU as one kernel (``torch.nn.functional.gelu(x,
    # approximate=config.gelu_approximate)``, litgpt/model.py ``GptNeoxMLP``) even where the HF
    # model writes the tanh formula out.
    # torch.compile (inductor) fuses the formula into one kernel and its min-cut partitioner
    # saves only the input (torch/_functorch/partitioners.py ``min_cut_rematerialization``).
    fused = not training.conventions.hf_model_code or training.compile
    if model.hidden_act in TANH_FORMULA_ACTIVATIONS and not fused:
        if training.uses_autocast or training.autocast_over_16bit_weights:
            # (Note [Autocast over 16-bit weights]: pow runs in fp32 over 16-bit weights too)
            # pow's fp32 input copy, tanh out, 1+tanh (fp32), 0.5*x (c), output cast for down (c)
            return (4 + 4 + 4 + c + c) * width
        # x, tanh out, 0.5*x, 1+tanh, output (saved by down): five tensors of the compute dtype
        return 5 * c * width
    if model.hidden_act in SIGMOID_FORMULA_ACTIVATIONS and not fused:
        return 3 * c * width  # x, sigmoid(1.702 x), and the product saved by down
    return 2 * c * width  # input saved by the kernel, output saved by the down projection


def moe_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """Bytes a transformers 5 MoE block saves for backward, by term (the default
    ``experts_implementation="grouped_mm"``: transformers integrations/moe.py
    ``grouped_mm_experts_forward``; router: modeling_qwen3_moe.py ``Qwen3MoeTopKRouter``; shared
    expert: modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock``). Per token, k = top-k, w = bytes
    of the weights' dtype as computed with (the experts' grouped matmul runs in it: fp32 under
    plain autocast, the compute dtype under an FSDP mixed-precision policy):

    * router: its autocast input copy (c*h), the fp32 softmax (4E), top-k values and indices
      (12k);
    * expert inputs: the tokens gathered per expert and cast to w (w*h*k), the gather's and the
      sort's int64 indices (16k);
    * gated experts: the gate/up output (2 w*i*k), the activation's output and the product fed
      to the down projection (w*i*k each);
    * expert outputs: the down projection's output saved by the routing-weight product
      (w*h*k), the routing weights (c*k) and the un-permuting index (8k);
    * shared expert (Qwen2-MoE): a gated MLP (4 c*i_s; its autocast input copies are in
      ``mlp/input``) and the sigmoid gate's output with the expert output it scales (c*h + c),
      with, under autocast, the gate linear's own 16-bit copy of the block's input (c*h; a
      term of its own because the gate path's backward runs first and frees it early, Note
      [Qwen2-MoE's shared expert around the routed experts' backward] in
      trainmem/analytic/backward_transients.py; a frozen gate under LoRA saves no input).
    """
    c, _ = compute_and_residual_bytes(training)
    # the weights as the layer computes with them: an FSDP mixed-precision policy gathers them
    # in the compute dtype (TrainingConfig.gathered_weight_dtype)
    w = dtype_bytes(training.gathered_weight_dtype)
    h, i, e = model.hidden_size, model.intermediate_size, model.num_experts
    k = model.num_experts_per_tok
    mixed = training.uses_autocast
    router = (c * h * mixed + 4 * e + 12 * k) * t
    if model.sigmoid_router:
        # DeepseekV3TopkRouter: ``F.linear(x.float(), w.float())`` (autocast casts both back),
        # the sigmoid's output (E, compute dtype), the top-k indices (int64) and the
        # normalisation's operands (traced on a 2-layer DeepSeek-V3)
        router = (c * h * mixed + c * e + 8 * k + 8) * t
    terms = {
        "mlp/router": router,
        "mlp/expert_inputs": (w * h * k + 16 * k) * t,
        "mlp/gated": 4 * w * i * k * t,
        "mlp/expert_outputs": (w * h * k + c * k + 8 * k) * t,
    }
    if sequential_pre_norm_block(model):  # Note [Backward of a pre-norm block]
        terms["mlp/gated"] -= w * i * k * t
        terms["mlp/down_input"] = w * i * k * t
    si = model.shared_expert_intermediate_size
    if si:
        terms["mlp/shared_expert"] = 4 * c * si * t
        if model.shared_expert_gate:
            own_copy = c * h * (mixed and not training.frozen_base)
            terms["mlp/shared_expert_gate"] = (c * h + c + own_copy) * t
    return terms


EXPERT_LOOP_FAMILIES = ("mixtral",)
"""``model_type``s whose transformers 4 MoE block runs its experts one at a time (checked:
4.48.0 modeling_mixtral.py ``MixtralSparseMoeBlock.forward``)."""
EXPERT_LOOP_UNTIL = (5, 0)
"""transformers 5 holds the routed experts as two 3-D parameters run by one grouped matmul
(:func:`moe_terms`); before it, one ``nn.Linear`` triple per expert in a Python loop."""
BNB_4BIT = ("nf4", "fp4", "nf4-dq", "fp4-dq")


def expert_loop(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether the MoE block is transformers 4's per-expert loop over frozen experts (Note
    [transformers 4 expert loop]): a family of :data:`EXPERT_LOOP_FAMILIES` before
    :data:`EXPERT_LOOP_UNTIL`, LoRA with no adapter on the experts' linears, and a base whose
    matmuls save no input (bitsandbytes 4-bit from 0.43.2, or 16-bit). Trained experts keep
    :func:`moe_terms`."""
    return (
        model.num_experts > 1
        and training.conventions.hf_model_code
        and model.model_type in EXPERT_LOOP_FAMILIES
        and training.transformers_release < EXPERT_LOOP_UNTIL
        and training.frozen_base
        and not {"gate", "up", "down"} & set(adapter_targets(training))
        and not training.quantized_matmul_saves_input
    )


def expert_loop_output_bytes(training: TrainingConfig) -> int:
    """Bytes per value of a frozen expert linear's output in the loop: a bitsandbytes 4-bit
    ``Linear4bit`` casts it back to its input's dtype (bitsandbytes 0.43.3 nn/modules.py
    ``Linear4bit.forward``: ``out = out.to(inp_dtype)``), the block's input being the residual
    stream's (r); a 16-bit ``nn.Linear`` gives the compute dtype (c)."""
    c, r = compute_and_residual_bytes(training)
    return r if training.quantize_base in BNB_4BIT else c


def expert_loop_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """Bytes transformers 4's Mixtral MoE block saves for backward with frozen experts, by term,
    for t tokens (P = k t routed pairs, o = :func:`expert_loop_output_bytes`).

    Note [transformers 4 expert loop]
        transformers 4.48.0 modeling_mixtral.py ``MixtralSparseMoeBlock.forward``: the router
        (``F.softmax(router_logits, dim=1, dtype=torch.float)``, ``torch.topk``), then for each
        expert ``torch.where(expert_mask[expert_idx])``, ``current_state =
        hidden_states[None, top_x]``, ``expert_layer(current_state) * routing_weights[top_x,
        idx, None]`` and ``final_hidden_states.index_add_(0, top_x, ...)``; the expert is
        ``w2(act_fn(w1(x)) * w3(x))`` (``MixtralBlockSparseTop2MLP``). With frozen experts no
        linear saves its input (a frozen ``nn.Linear``; bitsandbytes ``MatMul4Bit`` from
        0.43.2 keeps ``(None, B)``), so per routed pair autograd keeps: w1's output (SiLU's
        input), SiLU's output and w3's output (the product's operands), 3 o i; w2's output,
        saved by the routing-weight product, o h; the routing weight (r) and the two int64
        indices ``torch.where`` made (16). The router keeps its fp32 softmax (4 E per token)
        and top-k values and indices (12 k). Nothing of the expert's input (r h per pair, a
        fresh gather per expert) outlives the loop. Its backward runs expert by expert
        (:func:`~trainmem.analytic.backward_transients.backward_layer_transients`).
    """
    _, r = compute_and_residual_bytes(training)
    o = expert_loop_output_bytes(training)
    h, i, e = model.hidden_size, model.intermediate_size, model.num_experts
    k = model.num_experts_per_tok
    pairs = k * t
    return {
        "mlp/router": (4 * e + 12 * k) * t,
        "mlp/gated": 3 * o * i * pairs,
        "mlp/expert_outputs": (o * h + r + 16) * pairs,
    }


def sequential_pre_norm_block(model: ModelSpec) -> bool:
    """A decoder block x + attn(norm(x)), then x + mlp(norm(x)), with a gated MLP or one
    fused activation (Llama, Mistral, Qwen, Phi-3, the MoE families, StarCoder2, GPT-BigCode),
    where Note [Backward of a pre-norm block] holds.

    Note [Backward of a pre-norm block]
        Traced on Llama, Phi-3, Qwen2-MoE, Qwen3-MoE and GPT-BigCode (2-layer configs, bf16
        autocast, full activation checkpointing, tests/analytic/test_formula_families.py): the
        layer's backward peaks in its MLP, after the down projection's backward has released
        its saved input (``act(gate) * up``, or the activation's output), with one
        residual-stream gradient alive (the one the layer's input gradient accumulates into
        comes later); the recomputation does not make the layer input again (the checkpoint
        keeps it). Blocks with output norms (Gemma-3, OLMo-2), parallel attention and MLP
        (Falcon, Phi, GPT-NeoX), or GPT-2's tanh-formula GELU keep the general schedule,
        except for the layer input: in every pre-norm decoder the first norm saves the very
        tensor the checkpoint keeps (LayerNorm its input; RMSNorm ``x.to(float32)``, a no-op
        on the fp32 residual stream), so it is not counted twice under full checkpointing
        (Gemma-2 / Gemma-3 against the generic path).
    """
    return (
        model.architecture == "decoder"
        and model.pre_norms
        and not model.output_norms
        and not model.parallel_attention
        and (model.mlp_kind == "gated" or model.hidden_act in FUSED_ACTIVATIONS)
    )


def experts_per_token(model: ModelSpec) -> int:
    """Experts each token runs through: the top-k of a MoE layer, 1 for a dense MLP."""
    return model.num_experts_per_tok if model.num_experts > 1 else 1


def mlp_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int, norm: int, output_norm: int
) -> dict[str, int]:
    """Bytes one layer's MLP block saves for backward, by term (``mlp/...``), for t tokens, with
    ``norm`` / ``output_norm`` the bytes per token of the block's pre-norm and output norm
    (:func:`~trainmem.analytic.norms.block_norm_bytes`): transformers' MoE experts
    (:func:`moe_terms`) or a dense (or lit-gpt / Megatron MoE) MLP. See Note [Activation terms]
    (trainmem/analytic/activations.py).

    Note [Compiled residual add]
        Under torch.compile and autocast a pre-norm block's MLP norm reads ``h = x +
        attn_out``, the fp32 residual sum of the layer input ``x`` (which the block keeps for
        its first norm) and the attention's 16-bit output. Eager saves ``h`` (4 B a value) for
        the norm's backward; the min-cut partition (torch/_functorch/partitioners.py
        ``min_cut_rematerialization_partition``) keeps the cheaper 16-bit ``attn_out`` (c B)
        and recomputes the add in the backward, so the MLP norm saves c h + 4 bytes a token,
        not r h + 4. Traced (the generic path's AOTAutograd, trainmem.trace.compile): a 6-layer
        1024-wide Qwen2, bf16-mixed, LoRA on q / v, 4 x 1,024 tokens: one fp32 and one more
        bf16 h-sized tensor per layer where the formulas had two fp32.
    """
    c, r = compute_and_residual_bytes(training)
    h = model.hidden_size
    terms: dict[str, int] = {}
    if output_norm:
        terms["mlp/output_norm"] = output_norm * t
    if model.pre_norms and not model.parallel_attention:
        terms["mlp/norm"] = norm * t
        if training.compile and r > c and sequential_pre_norm_block(model):
            # Note [Compiled residual add]: the min-cut keeps the attention's 16-bit output,
            # not the fp32 sum it makes with the kept layer input
            terms["mlp/norm"] -= (r - c) * h * t
    elif model.pre_norms and model.num_norms_per_layer >= 2:
        # GPT-NeoX: both norms read the block's input; the second reads the same saved input,
        # unless it saves its own fp32 cast (Note [Autocast over 16-bit weights])
        shared = 0 if autocast_fp32_layer_norms(model, training) else r * h
        terms["mlp/norm"] = (norm - shared) * t
    if expert_loop(model, training):
        terms.update(expert_loop_terms(model, training, t=t))
    elif model.num_experts > 1 and training.conventions.hf_model_code:
        terms.update(moe_terms(model, training, t=t))
        # autocast copies of the block's input for the shared expert's gate and up
        # projections (the sigmoid gate's is in ``mlp/shared_expert_gate``); in true
        # precisions the router saves the input
        copies = 2 if model.shared_expert_intermediate_size else 0
        terms["mlp/input"] = c * h * t * (copies if training.uses_autocast else 1)
    else:
        terms.update(_dense_mlp_terms(model, training, t=t))
    if training.dropout and model.hidden_dropout > 0:
        terms["mlp/dropout_mask"] = h * t
    return terms


def _dense_mlp_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """A dense MLP's saved tensors (or each of the top-k experts' outside transformers'
    grouped matmul), from its input copies to the down projection's input."""
    c, r = compute_and_residual_bytes(training)
    h, i = model.hidden_size, model.intermediate_size
    k_top = experts_per_token(model)
    mixed = training.uses_autocast
    terms: dict[str, int] = {}
    if model.num_experts > 1:
        terms["mlp/router"] = (4 * model.num_experts + c * model.num_experts) * t
        terms["mlp/expert_inputs"] = r * h * t * k_top
        terms["mlp/expert_outputs"] = c * h * t * k_top
    # autocast copies of the MLP input: one per projection reading it (gate and up), one for a
    # fused gate_up (modeling_phi3.py ``Phi3MLP.gate_up_proj``)
    n_in = 2 if model.mlp_kind == "gated" and not model.fused_gate_up else 1
    casts = autocast_casts_layer_inputs(training, model)
    copies = cast_copies(n_in, training) if casts else 1  # Note [Compiled casts are computed once]
    terms["mlp/input"] = c * h * t * k_top * copies
    own_casts = mixed or autocast_fp32_layer_norms(model, training)
    if model.parallel_attention and model.num_norms_per_layer == 1 and not own_casts:
        # Falcon / Phi: one norm feeds attention and MLP; without autocast's casts the MLP
        # saves the very tensor q/k/v saved (``attention/qkv_input``)
        terms["mlp/input"] = 0
    if model.mlp_kind == "gated":
        # gate and up outputs, the activation's output and the down projection's input;
        # under torch.compile the activation's output is recomputed from the saved gate
        # (traced: min-cut keeps gate, up and act(gate) * up)
        terms["mlp/gated"] = (3 if training.compile else 4) * c * i * t * k_top
        if model.activation_written_out and not training.compile:
            # silu(x) = x * torch.sigmoid(x) (cs336_basics/model.py ``silu``): sigmoid
            # saves its output and the product saves it too, one i-sized tensor beyond
            # F.silu's (derivatives.yaml ``sigmoid``: result; ``mul.Tensor``: self, other)
            terms["mlp/gated"] += c * i * t * k_top
    else:
        terms["mlp/activation"] = activation_fn_saved_bytes(model, training, i) * t * k_top
    if sequential_pre_norm_block(model):
        # the down projection's input (act(gate) * up or the activation's output), the last
        # tensor the MLP saves and the first its backward frees (Note [Backward of a pre-norm
        # block])
        key = "mlp/gated" if model.mlp_kind == "gated" else "mlp/activation"
        terms[key] -= c * i * t * k_top
        terms["mlp/down_input"] = c * i * t * k_top
    return terms
