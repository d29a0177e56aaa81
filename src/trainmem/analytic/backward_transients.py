"""What one layer's backward holds at once besides what the layer saved: the MLP's and the
attention's gradients and the residual-stream gradient. Symbols as in
:mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from typing import NamedTuple

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.attention import fp32_softmax
from trainmem.analytic.checkpointing import layer_checkpoint_reentrant, layer_is_checkpointed
from trainmem.analytic.float8 import float8_eager_casts, float8_frozen_weight_gradient
from trainmem.analytic.lora import unsloth_fast_lora, unsloth_lora_product_tensor
from trainmem.analytic.mlp import (
    SIGMOID_FORMULA_ACTIVATIONS,
    expert_loop,
    expert_loop_output_bytes,
    experts_per_token,
    sequential_pre_norm_block,
)
from trainmem.analytic.params import adapter_targets
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS = 5
"""fp32 score-sized tensors alive at once in the backward of a written-out softmax's division
(Note [Backward of a written-out softmax])."""


def backward_layer_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """The larger of :func:`backward_layer_transients`' MLP and attention parts, plus the
    residual gradient: the most one layer's backward holds at once besides what it saved."""
    mlp, attention, residual = backward_layer_transients(model, training)
    return max(mlp, attention) + residual


class MlpBackwardParts(NamedTuple):
    """A plain (dense or top-k routed, transformers-free or not) MLP's backward transients as
    the tensors autograd makes them, bytes (Note [An MLP's backward, linear by linear]).

    Attributes:
        down_input: the down projection's input gradient, c t i.
        down_weight: its 16-bit weight gradient before the cast into the fp32 ``.grad``, c h i
            (under autocast; a frozen float8 linear's, discarded; 0 otherwise).
        activation: the activation's (and a gated MLP's product's) backward outputs made
            beside ``down_input`` once the weight gradient is gone, (n - 1) c t i.
    """

    down_input: int
    down_weight: int
    activation: int


def mlp_backward_parts(model: ModelSpec, training: TrainingConfig) -> MlpBackwardParts | None:
    """The MLP's backward transients split as :class:`MlpBackwardParts`, or None where they
    stay the one block of :func:`backward_layer_transients` (vision encoders, whose parts are
    fitted to their traces; layer scale; expert loops; Unsloth's kernels; transformers'
    grouped experts; a model with blocks of several kinds; frozen linears under LoRA).

    Note [An MLP's backward, linear by linear]
        The down projection's backward (``MmBackward0``: ``mm_mat1_backward`` and
        ``mm_mat2_backward``, derivatives.yaml) makes its input's gradient (c t i) and, for a
        trainable weight, the weight's gradient in the compute dtype (c h i under autocast),
        which the autocast cast's backward (``ToCopyBackward0``) turns into the fp32
        ``.grad`` before the product's backward runs. Only then the product's
        (``MulBackward0``: two c t i) and the activation's backward run, the down
        projection's input gradient freed after them, so n c t i are alive there (n = 3
        gated, 2 otherwise) but not beside the weight gradient. Seen on the trace of the
        agreement model (2048-wide Llama, 2 x 256 tokens, bf16 autocast, pipeline stage 0
        of 2, accumulation 4): c h i + c t i + the fp32 cast at the down projection, where
        the one block held c h i + 3 c t i (formulas -1.3 % -> +0.3 % above the trace).
        Frozen linears (LoRA's base, a quantized base) make no weight gradient (the node's
        output mask), so their parts have none; a quantized base's dequantized weight is
        alive beside the input gradient instead and freed before the product's backward
        (bitsandbytes 0.45.0 autograd/_functions.py ``MatMul4Bit.backward``:
        ``torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(...).t())``; GPTQ's
        triton kernel, fms-acceleration gptqmodel/nn_modules/triton_utils/dequant.py @c70ffe0
        and AutoGPTQ tritonv2 ``QuantLinearFunction.backward``: ``quant_matmul_248(
        grad_output, ..., transpose=True)``, which dequantizes into a new fp16 weight), placed
        by the quantized-base transform at ``layer.mlp.pre_backward`` until
        ``layer.mlp.post_backward``. GPTQ base on the agreement model: -2.3 -> +0.06 %. A
        recomputed layer (full checkpointing) keeps the one block, c h i included: splitting
        it there moved the QLoRA rows GT129 -17.4 -> -21.8 %, GT176 -5.8 -> -7.7 %, and the
        agreement model under full checkpointing (generic / formulas - 1, session 17) LoRA
        -0.9 -> +2.1 %, nf4 -2.4 -> +3.0 %, GPTQ -0.8 -> +5.7 %: the recompute's own tensors
        are not modelled (the trace, non-reentrant with early stop, holds the incoming
        gradient of down's output in fp32 and its cast beside the recomputed blocks and
        down's autocast weight copy), and the block's c h i stands in for them. Where they
        are modelled (:func:`recompute_holds_down_copy`: a full-precision LoRA base under
        autocast, Note [The recompute's tensors held at an autocast down projection]) the
        parts are split: LoRA on q / v and on all seven linears, reentrant or not, -0.87 /
        -1.56 / +2.54 / +1.85 % -> within 0.05 % of the trace.
    """
    if len(model.layer_kinds()) > 1 or model.architecture == "vision-encoder":
        return None
    if model.layer_scale or expert_loop(model, training) or unsloth_fast_lora(model, training):
        return None
    if model.num_experts > 1 and training.conventions.hf_model_code:
        return None
    recomputed = training.frozen_base and layer_is_checkpointed(training)
    split = down_backward_before_recompute(training) or recompute_holds_down_copy(model, training)
    split = split or reentrant_recompute_runs_down(training)
    if recomputed and not split:  # the Note's last paragraph
        return None
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c = compute_and_residual_bytes(training)[0]
    i, h = model.intermediate_size, model.hidden_size
    k_top = experts_per_token(model)
    n = 3 if model.mlp_kind == "gated" else 2
    divisor = parallel_divisor("mlp/gated", training)
    down_input = c * i * t * k_top // divisor
    weight = c * h * i // training.tensor_parallel_size
    # a frozen down projection (LoRA's base) makes no weight gradient (the node's output mask),
    # except torchao's float8 linear, which computes it anyway (Note [Float8 casts of a base
    # weight]: ``matmul_with_hp_or_float8_args.backward`` never reads ``needs_input_grad``)
    trained = training.uses_autocast and not training.frozen_base
    weight = weight if trained or float8_frozen_weight_gradient(training) else 0
    return MlpBackwardParts(down_input, weight, (n - 1) * down_input)


def down_backward_before_recompute(training: TrainingConfig) -> bool:
    """Whether a recomputed layer's down projection runs its backward before the layer's
    recompute: a frozen bitsandbytes 4-bit base that saves no input, no LoRA adapter on the
    down projection, full non-reentrant checkpointing of transformers' layers (not fsdp_qlora's
    reentrant wrapper).

    Note [A frozen 4-bit down projection before the recompute]
        bitsandbytes keeps ``MatMul4Bit``'s state as an attribute, ``ctx.tensors = (None, B)``
        (0.45.0 autograd/_functions.py), not through ``save_for_backward``, so torch's
        non-reentrant checkpoint (utils/checkpoint.py: the saved-tensor hooks' unpack runs the
        recompute) never sees it: the node's backward runs as soon as its gradient arrives,
        before anything of the layer is recomputed. Without an adapter on the down projection
        (peft's LoRA branch would save its input through the hooks, and its higher sequence
        numbers run it first) the layer's backward therefore starts with down's dequantized
        weight and its input gradient (c t i); that gradient stays while the recompute runs
        (up to the up projection, early stop), and the recompute dequantizes its linears
        beside it. transformers checkpoints non-reentrantly from 5.0
        (``TrainingConfig.hf_checkpoint_reentrant``); fsdp_qlora's train.py reentrantly unless
        ``--reentrant_checkpointing False`` (:func:`~trainmem.analytic.checkpointing.
        layer_checkpoint_reentrant`): torch's reentrant ``CheckpointFunction.backward``
        recomputes the whole layer before any of its backward runs. Seen on the generic path's
        trace of the agreement model (nf4, LoRA on q / v, full checkpointing: the input
        gradient made at down's backward, then the recompute, peak at the recomputed up
        projection's dequantization, Note [The recompute's tensors held at the up projection]);
        GPTQ's triton kernel saves its packed tensors through the hooks, so the recompute runs
        first there.
    """
    return (
        training.frozen_base
        and training.activation_checkpointing == "full"
        and training.conventions.hf_model_code
        and not layer_checkpoint_reentrant(training)
        and training.quantize_base in ("nf4", "nf4-dq", "fp4", "fp4-dq")
        and not training.quantized_matmul_saves_input
        and "down" not in adapter_targets(training)
    )


def reentrant_recompute_runs_down(training: TrainingConfig) -> bool:
    """Whether torch's reentrant checkpoint recomputes a layer through its frozen 4-bit down
    projection before any of the layer's backward (Note [The recompute's tensors held at the
    down projection]): a bitsandbytes 4-bit base that saves no input, no LoRA adapter on the
    down projection, full reentrant checkpointing of transformers' layers (fsdp_qlora's
    ``CheckpointImpl.REENTRANT``)."""
    return (
        training.frozen_base
        and training.activation_checkpointing == "full"
        and training.conventions.hf_model_code
        and layer_checkpoint_reentrant(training)
        and training.quantize_base in ("nf4", "nf4-dq", "fp4", "fp4-dq")
        and not training.quantized_matmul_saves_input
        and "down" not in adapter_targets(training)
    )


def recompute_holds_down_copy(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether a recomputed layer's backward first holds its recompute's tensors at the down
    projection beside autocast's copies of its full-precision frozen base weights (Note [The
    recompute's tensors held at an autocast down projection] in
    trainmem/analytic/forward_transients.py): peft's plain LoRA (with ``lora_dropout`` too:
    the dropout's output held at down's lora_A, session 24: agreement model h2048, all seven,
    selective / full +3.08 / +3.38 -> -0.01 / -0.01 %) on transformers' model code, full
    checkpointing (reentrant or not), autocast, no quantized base, no float8 casts, not
    Unsloth's kernels. DoRA too where down has no adapter: peft
    0.21.2 tuners/lora/dora.py ``DoraLinearLayer.forward`` runs inside q / v ... and its saved
    tensors are recomputed blocks freed nowhere before down, so the recompute's moment at
    down's frozen matmul holds the same tensors as LoRA's (generic trace of the agreement
    model, q / v, full checkpointing: DoRA - LoRA equal on both engines, -1.20 -> +0.00 %).
    DoRA on down keeps Note [DoRA's moments in the recompute]. Op-level selective
    checkpointing too: its recompute is the same non-reentrant replay of the whole layer
    (torch 2.13 utils/checkpoint.py ``create_selective_checkpoint_contexts`` inside
    ``checkpoint(use_reentrant=False)``, trainmem/trace/engine.py), the policy's saved outputs
    served from its cache, so it holds the same tensors at down's frozen matmul (agreement
    model h2048, LoRA r 16, selective: q,v -1.17 -> +0.00 %, all seven +5.06 -> +1.21 %, down
    +3.09 -> -0.08 %, o -2.12 -> -0.43 %, h1024)."""
    return (
        training.frozen_base
        and training.activation_checkpointing in ("full", "selective")
        and training.conventions.hf_model_code
        and training.uses_autocast
        and training.quantize_base == "none"
        and (training.lora_variant == "lora" or no_dora_on_down(training))
        and not float8_eager_casts(model, training)
        and not unsloth_fast_lora(model, training)
    )


def no_dora_on_down(training: TrainingConfig) -> bool:
    """DoRA whose targets leave the down projection without an adapter."""
    return training.lora_variant == "dora" and "down" not in adapter_targets(training)


def recompute_runs_down_forward(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether a recomputed layer's recompute runs through its frozen down projection's
    forward, where it peaks: a GPTQ base (its ``QuantLinearFunction`` saves its packed tensors
    through ``save_for_backward``, the last tensors the layer saves), no LoRA adapter on the
    down projection, full non-reentrant checkpointing of transformers' layers.

    Note [The recompute's tensors held at the down projection]
        GPTQ's ``QuantLinearFunction.backward`` starts with ``qweight, scales, qzeros, g_idx
        = ctx.saved_tensors`` (AutoGPTQ nn_modules/triton_utils/kernels.py), so under torch's
        non-reentrant checkpoint (utils/checkpoint.py: the unpack runs the recompute, which
        stops once the last saved tensor it needs is packed) the down projection's backward
        first recomputes the layer up to and including down's forward, whose packed tensors
        are the last the layer saves. The recompute's largest moment is down's matmul: its
        dequantized weight beside every recomputed block and what the recomputed code still
        references unsaved, the forward's set at the down projection (Note [Forward tensors
        held at the down projection], as in a checkpointed layer's forward: down's output
        and its input ``act(gate) * up``, the MLP's input, the residual where the second
        norm does not save it; the layer's input is the checkpoint's). Seen on the generic
        path's trace of the agreement model (GPTQ LoRA on q / v, accelerate FSDP 4, full
        checkpointing): the peak at the recomputed down projection's dequantization.
        torchao's float8 linears (Note [Float8 casts of a base weight]) likewise: the
        custom function's saved tensors are packed when its forward returns, after its casts,
        and down's are the last the layer saves (LoRA's adapters on down, also float8
        linears, run after the base), so the recompute runs down's casts; with float8 it
        also holds for full fine-tuning.

        torch's reentrant checkpoint (fsdp_qlora's ``CheckpointImpl.REENTRANT``:
        :func:`reentrant_recompute_runs_down`) recomputes the whole layer first (torch 2.13
        utils/checkpoint.py ``CheckpointFunction.backward``: ``outputs =
        ctx.run_function(*detached_inputs)`` under ``enable_grad``, then
        ``torch.autograd.backward``), so with a frozen 4-bit down projection its recompute
        also peaks at down's dequantization, but it saves what a plain forward saves: the
        second norm's input is the residual itself on an fp32 stream, and down's output, its
        input and the MLP's input are what the code holds besides (the forward's list without
        checkpointing, the layer's input being the checkpoint's); the layer's output, which
        the checkpoint then holds (Note [Reentrant checkpoint's recomputed output]), is made
        after them, and the backward runs linear by linear (Note [An MLP's backward, linear by
        linear]). The generic path runs torch's own reentrant checkpoint on the stand-in:
        agreement model, 'fsdp-qlora 4' + full checkpointing, generic / formulas - 1 -4.31 ->
        -0.12 %, on one GPU -3.66 -> +0.00 % (the formulas held one c h i + 3 c t i block for
        the MLP's backward and the recompute's moment not at all). The layer's input is the
        checkpoint's on a 16-bit residual stream too (axolotl's k-bit cast back, Note
        [axolotl casts a k-bit base's embeddings and norms back]): ``detach_variable`` (torch 2.13
        utils/checkpoint.py) hands the recompute ``inp.detach()``, a view of the tensor
        ``ctx.save_for_backward`` kept, not a copy, and the first norm saves its own fp32
        copy beside it; the formulas counted it once more there (session 28, helper reent16:
        agreement model, axolotl nf4-dq r 16, full reentrant, 2 x 256: generic / formulas -
        1 -1.15 -> +0.00 %, one c t h = 2,097,152 B at layer 1's down projection).
    """
    if reentrant_recompute_runs_down(training):
        return True
    if not (
        training.activation_checkpointing == "full"
        and training.conventions.hf_model_code
        and not layer_checkpoint_reentrant(training)
    ):
        return False
    if float8_eager_casts(model, training):  # Note [Float8 casts of a base weight]
        return True
    return (
        training.frozen_base
        and training.quantize_base == "gptq-int4"
        and "down" not in adapter_targets(training)
    )


def shared_expert_pending_gradients(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of a Qwen2-MoE block's shared-expert path gradients held through its routed
    experts' backward: the block input's gradient from the sigmoid gate (r*h per token, in
    the dtype of the block's input) and the shared expert output's gradient (c*h); 0 for a
    block without a sigmoid-gated shared expert.

    Note [Qwen2-MoE's shared expert around the routed experts' backward]
        transformers 5.24 modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock.forward`` (l. 340-351)
        runs ``self.shared_expert``, then the router and ``self.experts``, and only then
        ``F.sigmoid(self.shared_expert_gate(x)) * shared_expert_output`` and the sum. torch's
        autograd engine (torch 2.13 torch/csrc/autograd/engine.h, ``ReadyQueue``'s
        ``CompareNodeTaskTime``: of the ready nodes, the highest ``sequence_nr``, i.e. the
        latest made, runs first) therefore runs, after the sum's ``AddBackward0``: the
        product's ``MulBackward0`` (the shared output's gradient, c*h per token, and the
        sigmoid's), the sigmoid and the gate linear, whose input gradient (cast by autocast's
        ``ToCopyBackward0`` to the block input's dtype, r*h) waits in the input buffer of the
        block input's node; then the routed experts (the sum's other input, made before the
        gate); the shared expert last (made first). So through the routed experts' backward
        both gradients are alive, while what the gate path saved is freed already: the
        product's operands (the shared output, c*h, the sigmoid's output, c) and the gate
        linear's autocast input copy (c*h): ``mlp/shared_expert_gate``, released before the
        MLP's transients (trainmem/analytic/schedule.py ``_release_groups``). Seen on the
        trace of the 2-layer tiny-qwen2-moe (tests/analytic/configs, 8 x 1024 tokens,
        bf16-mixed, full checkpointing): at its peak, in layer 1's routed experts' backward,
        an fp32 (t, h) under ``mlp.shared_expert_gate`` and a bf16 (t, h) under ``mlp``, the
        gate path's saved tensors gone; formulas -1.17 % -> +0.27 %. DeepSeek-V3 (shared
        experts made after the routed ones) and Qwen3-MoE (none) are not this block.
    """
    if not (model.shared_expert_intermediate_size and model.shared_expert_gate):
        return 0
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c, r = compute_and_residual_bytes(training)
    return (r + c) * model.hidden_size * t // parallel_divisor("mlp/shared_expert_gate", training)


def backward_layer_transients(model: ModelSpec, training: TrainingConfig) -> tuple[int, int, int]:
    """(MLP part, attention part, residual gradient) of what one layer's backward holds besides
    what it saved. MLP: the gradients of its intermediate (2 i-sized tensors, 3 for gated
    MLPs; transformers' MoE experts: see the code) and under autocast the 16-bit weight
    gradient of its largest linear before it is cast into the fp32 ``.grad``. Attention (eager
    only): two score-sized gradients, five fp32 ones for a written-out softmax (Note [Backward
    of a written-out softmax]). The MLP's backward runs first, and by the attention's
    backward the MLP's saved tensors are freed. A model with blocks of several kinds takes the
    largest of each part over its kinds.

    Note [Backward of a written-out softmax]
        cs336_basics/nn_utils.py ``softmax`` ends in ``e / torch.sum(e, ...)``. Its backward
        node (PyTorch's generated ``DivBackward0::apply``) computes the divisor's gradient
        first, ``div_tensor_other_backward``: ``-grad * ((self / other) / other)``
        (FunctionsManual.cpp), whose three temporaries live to the end of that expression, so
        the incoming fp32 gradient, ``-grad``, ``e / S``, ``(e / S) / S`` and their product are
        alive together: five fp32 (b, a, s, s) tensors (the product is then summed to S's
        shape and the temporaries freed before ``grad / S``, the dividend's gradient). Under
        autocast the incoming gradient is fp32 too (the backward of the value einsum's cast).
    """
    kinds = model.layer_kinds()
    if len(kinds) > 1:
        parts = [backward_layer_transients(block, training) for _, block in kinds]
        return (
            max(p[0] for p in parts),
            max(p[1] for p in parts),
            max(p[2] for p in parts),
        )
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c, r = compute_and_residual_bytes(training)
    i, h = model.intermediate_size, model.hidden_size
    k_top = experts_per_token(model)
    n = 3 if model.mlp_kind == "gated" else 2
    if model.architecture == "vision-encoder":
        # A vision encoder's step peaks inside its last block's backward (no vocabulary-sized
        # loss), where the trace shows the down projection's saved input already freed when
        # the activation's backward runs: net of it, a fused GELU holds one more i-sized
        # tensor, CLIP's quick_gelu (three saved) and a gated MLP two.
        n = 2 if model.mlp_kind == "gated" or model.hidden_act in SIGMOID_FORMULA_ACTIVATIONS else 1
    mlp = n * c * i * t * k_top // parallel_divisor("mlp/gated", training)
    if training.uses_autocast:
        mlp += c * h * i // training.tensor_parallel_size
        if model.architecture == "vision-encoder" and n == 1 and not model.layer_scale:
            # a fused GELU's block peaks at the down projection's input gradient, while the
            # incoming fp32 residual gradient's cast to the 16-bit fc2 output (the residual
            # add's backward, ``residual + hidden_states`` in modeling_siglip.py
            # ``SiglipEncoderLayer.forward``) is still alive (traced on a 2-layer SigLIP tower,
            # full checkpointing: aten.mm in ``mlp.fc2`` with that cast alive). DINOv2's layer
            # scale makes the same cast, in place of the MLP output its ``hidden * lambda1``
            # saved and its backward has freed by then (traced on a 2-layer DINOv2), which
            # the saved terms already count
            mlp += c * h * t // parallel_divisor("mlp/input", training)
    if model.layer_scale and model.mlp_kind == "gated":
        # a gated MLP's block peaks later, at the gate * up product's backward: by then the
        # layer scale's backward (modeling_dinov2.py ``Dinov2LayerScale``, ``hidden * lambda1``)
        # has freed the MLP output it saved (a saved term here), and the down projection's
        # backward the 16-bit gradient cast that took its place (traced on a 2-layer
        # DINOv2-SwiGLU, full checkpointing: peak in ``mlp.down_proj``'s backward)
        mlp -= c * h * t // parallel_divisor("mlp/input", training)
    if model.layer_scale and training.activation_checkpointing == "none":
        # DINOv2's ``hidden * lambda1`` backward opens the block's backward, with all it saved
        # still alive: the gradient times lambda1 (fp32: lambda1 is an fp32 weight under AMP),
        # its cast to the MLP output's dtype, and the gradient times the input for lambda1's
        # own gradient (traced on a 2-layer DINOv2; under full checkpointing the trace's peak
        # is later, in the recomputed MLP's backward)
        mlp = max(mlp, (2 * r + c) * h * t // parallel_divisor("mlp/input", training))
    if expert_loop(model, training):
        # Note [transformers 4 expert loop]: autograd runs the experts' backward one at a time,
        # so one expert's share of the routed pairs (P / E, the router's balance) holds the
        # gradients of its output, its w2 input and product operands (h, 3i) and of its
        # gathered input (h), in the linears' output dtype; the block input's gradient
        # accumulates over the experts (``index`` backward: a (t, h) tensor per expert)
        o = expert_loop_output_bytes(training)
        pairs = -(-k_top * t // model.num_experts)
        mlp = o * (2 * h + 3 * i) * pairs + r * h * t
    elif unsloth_fast_lora(model, training):
        # Note [Unsloth's fast LoRA]: LoRA_MLP.backward makes one (t, i) tensor, down's input
        # gradient DW, and runs the SwiGLU backward in place into DW, e and g
        # (``swiglu_DWf_DW_dfg_kernel``); the input gradient goes into the saved X
        # (``torch.matmul(df, upW.t(), out = X)``). Before 2025.3.1 DW's ``matmul_lora``
        # adds ``(dY @ B) @ (s * A)`` out of place: a second (t, i) tensor beside it (Note
        # [Unsloth before 2025.3] in trainmem/analytic/transforms/unsloth.py)
        mlp = c * i * t * (2 if unsloth_lora_product_tensor(training) else 1)
    elif model.num_experts > 1 and training.conventions.hf_model_code:
        # transformers' grouped_mm experts run in the weights' dtype w
        # (:func:`~trainmem.analytic.mlp.moe_terms`); at
        # the gate/up grouped matmul's backward the gradients of its output (2i), of the
        # activation and product path (i), of the gathered inputs and of the un-permuted
        # outputs (h each) are alive, per routed token (found by the trace engine)
        w = dtype_bytes(training.weight_dtype)
        mlp = w * k_top * (2 * h + 3 * i) * t // parallel_divisor("mlp/gated", training)
        mlp += shared_expert_pending_gradients(model, training)
    attention = 0
    if training.attention == "eager" and model.attention_written_out:
        # Note [Backward of a written-out softmax]
        s, b = tokens_per_sequence(model, training), training.micro_batch_size
        attention = WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS * 4 * model.num_heads * s * s * b
        attention //= parallel_divisor("scores/x", training)
    elif training.attention == "eager":
        # eager attention's backward holds two (b, a, s, s) tensors in the softmax dtype at its
        # peak: the probabilities' gradient (upcast when the softmax runs in fp32) and the
        # softmax input's gradient (``_softmax_backward_data``; found by the trace engine)
        s, b = tokens_per_sequence(model, training), training.micro_batch_size
        sm = 4 if fp32_softmax(model, training) else c
        attention = 2 * sm * model.num_heads * s * s * b // parallel_divisor("scores/x", training)
    # the residual-stream gradient: the incoming one, and the one the layer's input gradient
    # accumulates into; only the incoming one at the MLP's peak in a sequential pre-norm block
    # (Note [Backward of a pre-norm block], trainmem/analytic/mlp.py)
    residual = (1 if sequential_pre_norm_block(model) else 2) * r * h * t
    if model.architecture == "vision-encoder":
        # one (b, s, h) gradient reaches the block (LayerNorm's fused backward; the select of
        # the pooled [CLS] row): traced on CLIP, SigLIP, DINOv2 and ViT towers
        residual = r * h * t
    if model.cross_attention:
        # a T5 decoder block's backward also holds the gradients its stack accumulates over
        # all its blocks: the encoder output's (fp32 under autocast, from every
        # cross-attention's k and v), the fp32 relative position bias's, and under
        # checkpointing the cross-attention bias's, which then requires grad
        # (modeling_t5.py ``T5Attention.forward``; traced on a 2-layer Flan-T5)
        b, s = training.micro_batch_size, tokens_per_sequence(model, training)
        a, s_source = model.num_heads, training.seq_len
        residual += r * h * b * s_source + 4 * a * s * s
        if training.activation_checkpointing == "full":
            residual += c * a * s * s_source
    return mlp, attention, residual // parallel_divisor("mlp/input", training)
