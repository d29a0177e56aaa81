"""LoRA's effect on the activations one layer saves: frozen linears that save no input, the
adapters' own saved tensors, peft's casts and dropout, quantized bases whose matmul keeps its
input, and the adapters' dtype and size (Hu et al. 2021, arXiv:2106.09685; peft
tuners/lora/layer.py). Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from typing import NamedTuple

from trainmem.analytic.activation_parallelism import split_for_parallelism
from trainmem.analytic.activation_shapes import (
    cast_copies,
    compute_and_residual_bytes,
    tokens_per_sequence,
)
from trainmem.analytic.float8 import float8_linears_save_input
from trainmem.analytic.lora_variants import (
    check_lora_variant,
    dora_first_layer_unsaved,
    dora_terms,
)
from trainmem.analytic.mlp import expert_loop
from trainmem.analytic.params import (
    adapted_linears,
    adapter_targets,
    linear_shapes,
    lora_targeted,
)
from trainmem.analytic.t5 import source_tokens
from trainmem.specs.frameworks import UNSLOTH_SMART_CHECKPOINT_SINCE
from trainmem.specs.model import ModelSpec
from trainmem.specs.ranks import fsdp1_no_shard
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def apply_lora(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """Adjust one layer's terms for LoRA, in place. See Note [LoRA activations].

    Note [LoRA activations]
        A frozen linear needs no weight gradient, so autograd does not save its input
        (``mm`` saves ``self`` only when ``mat2`` requires grad: torch
        tools/autograd/derivatives.yaml); the input stays saved only if a LoRA ``A`` of a targeted
        linear reads it. Each targeted linear adds ``A``'s output (r values per token, saved by
        ``B``) and, with ``lora_dropout > 0``, peft's dropout output and mask on the input (peft
        ``lora.Linear.forward``: ``lora_B(lora_A(dropout(x)))``). Under autocast each linear
        casts its own input, so the number of saved 16-bit input copies is the number of
        targeted linears reading it. Source: Hu et al. 2021 (arXiv:2106.09685); peft
        ``tuners/lora/layer.py``.
    """
    # bitsandbytes' int8 matmul (``MatMul8bitLt``) and its 4-bit matmul before 0.43.2
    # (``MatMul4Bit``: ``ctx.tensors = (A, B)``) save their input whenever it requires grad,
    # frozen weight or not, so such a base keeps every linear input like full fine-tuning does;
    # ``MatMul4Bit`` since 0.43.2 keeps ``(None, B)``, and torchtune's torchao ``NF4Tensor``
    # (``linear_nf4``) saves only the weight: then a quantized base is like a frozen 16-bit one.
    # See TrainingConfig.quantized_matmul_saves_input.
    # DeepSpeed ZeRO-3's persistent F.linear replacement saves every linear's input too
    # (TrainingConfig.zero3_linear_saves_input)
    # torchao's eager float8 linears save their input too (Note [Frozen float8 linears save
    # their input] in analytic/float8.py)
    check_lora_variant(training)
    keeps_inputs = (
        training.quantized_matmul_saves_input
        or training.zero3_linear_saves_input
        or float8_linears_save_input(model, training)
    )
    if not keeps_inputs:
        _frozen_base_inputs(terms, model, training, t=t, k_top=k_top)
    terms.update(_adapter_terms(model, training, t=t, k_top=k_top))
    adapter_bytes = dtype_bytes(lora_adapter_dtype(training))
    terms.update(dora_terms(model, training, t=t, k_top=k_top, adapter_bytes=adapter_bytes))
    if training.quantized_matmul_saves_input:
        terms.update(_adapter_input_copies(model, training, t=t, k_top=k_top))
    if unsloth_fast_lora(model, training):
        _unsloth_kernel_saves(terms, model, training, t=t)


def _unsloth_kernel_saves(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int
) -> None:
    """What Unsloth's LoRA kernels save instead of peft's modules, in place (Note [Unsloth's
    fast LoRA]): no adapter output (``LoRA_W`` / ``LoRA_QKV`` / ``LoRA_MLP`` save A, B and
    the input, and remake ``X @ A`` in backward); a dense gated MLP's ``LoRA_MLP`` saves X,
    ``e`` (gate's output) and ``g`` (up's), 2 c i per token beside X, not the activation's
    output nor the product, which ``swiglu_DWf_DW_dfg_kernel`` remakes in backward."""
    for key in [k for k in terms if k.startswith("lora/") and "_" not in k[5:]]:
        terms[key] = 0
    if "mlp/gated" in terms:  # a dense gated MLP (unsloth_fast_lora)
        c, _ = compute_and_residual_bytes(training)
        terms["mlp/gated"] = 2 * c * model.intermediate_size * t
        terms["mlp/down_input"] = 0


def _adapter_input_copies(
    model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> dict[str, int]:
    """Under autocast, beside a quantized base matmul that saves its own 16-bit copy of the
    input (the layer's input terms, as full fine-tuning counts them), each targeted linear's
    ``A`` casts the same input again and saves that copy for its weight gradient: c * fan_in
    per token a targeted linear (autocast casts a non-leaf tensor at every op: aten/src/ATen/
    autocast_mode.cpp ``cached_cast`` caches only leaves that require grad). None without
    autocast, nor with ``lora_dropout`` (A reads the dropout output, ``lora/*_dropout``).
    Checked against the generic path's traced peft layer over the stand-in quantized linear
    (trace/quantized.py Note [Traced quantized base]): 8-layer Qwen2 of width 256, int8 base,
    b4 s256: +4.0 % -> 0.0 %."""
    if not training.uses_autocast or training.lora_dropout > 0:
        return {}
    c, _ = compute_and_residual_bytes(training)
    targets = set(adapter_targets(training))
    out: dict[str, int] = {}
    for name, (fan_in, _out, _n) in adapted_linears(model).items():
        targeted = lora_targeted(name, targets)
        if targeted and name != "router":
            active = k_top if name in ("gate_up", "gate", "up", "down") else 1
            out[f"lora/{name}_input_copy"] = c * fan_in * t * active
    return out


def _frozen_base_inputs(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """The inputs a frozen base's linears still save, in place: only the copies the targeted
    linears' adapters read (Note [LoRA activations]).

    Note [Frozen down projection's input]
        A gated MLP ``down(act(gate(x)) * up(x))`` saves gate's output (for the activation's
        backward), act's output and up's output (for the product's: ``mul.Tensor`` saves
        ``self`` and ``other``, tools/autograd/derivatives.yaml) and, when down's weight
        needs a gradient, the product (``mm`` saves ``self`` for ``mat2``'s gradient).
        With down frozen the product is saved by nothing: the term that goes is
        ``mlp/down_input``, the first one the backward would free, not one of the three the
        activation's and the product's backward still read after down's backward has made
        its input gradient. So the MLP's backward peak (its transients, Note [Backward of a
        pre-norm block] in analytic/mlp.py) has all three alive, as the generic path's
        trace of peft's model shows (a 6-layer 1024-wide Qwen2, LoRA on q / v, 4 x 1,024
        tokens, bf16-true: the step's peak in layer 5's down_proj backward, 1,152,165,272 B
        traced, 1,152,369,664 B from the formulas; 1,129,300,992 B before).
    """
    c, _ = compute_and_residual_bytes(training)
    targets = set(adapter_targets(training))
    h = model.hidden_size
    qkv_targets = len({"q", "k", "v"} & targets)
    adapter_bytes = adapter_matmul_bytes(training, model)
    # With lora_dropout the adapters read the dropout output (counted below), not x: a frozen
    # base saves no input at all.
    via_dropout = training.lora_dropout > 0
    # Without autocast, peft casts a 16-bit input to its fp32 adapters (``_cast_input_dtype``:
    # ``x.to(lora_A.weight.dtype)``) and A saves that copy (``lora/*_input_cast``), not x.
    via_cast = not training.uses_autocast and adapter_bytes > c
    skip_inputs = via_dropout or via_cast
    shapes = linear_shapes(model)
    # the linears that read the attention norm's output: q, k, v; under multi-head latent
    # attention q_a (or q) and kv_a only (Note [MLA under LoRA])
    readers = (
        sum(lora_targeted(n, targets) for n in MLA_FIRST_LINEARS if n in shapes)
        if model.mla
        else qkv_targets
    )
    if skip_inputs or readers == 0:
        terms["attention/qkv_input"] = 0
    elif training.uses_autocast and "qkv" not in shapes:
        terms["attention/qkv_input"] = c * h * t * cast_copies(readers, training)
    for latent, reader in (("q", "q_b"), ("kv", "kv_b")):
        # a frozen q_b / kv_b saves no input; a targeted one's A saves its own copy, the size of
        # the full fine-tuning's cast (none when A reads peft's dropout output or fp32 cast)
        key = f"attention/{latent}_latent_input"
        if key in terms and (skip_inputs or not lora_targeted(reader, targets)):
            terms[key] = 0
    if "cross/kv_input" in terms:  # a T5 decoder block's cross-attention (analytic/t5.py)
        # q reads the decoder's t tokens, k and v the encoder output's: each targeted one's
        # adapter keeps its own cast copy (as qkv_input above), a frozen one saves nothing
        kv_targets = 0 if skip_inputs else len({"k", "v"} & targets)
        if skip_inputs or "q" not in targets:
            terms["cross/q_input"] = 0
        if training.uses_autocast:
            t_source = source_tokens(training)
            terms["cross/kv_input"] = c * h * t_source * cast_copies(kv_targets, training)
    if "o" not in targets or skip_inputs:
        terms["attention/out_proj_input"] = 0
    elif training.uses_autocast and adapter_bytes > c:
        # the 16-bit attention output goes to peft's fp32 cast, then autocast's 16-bit cast
        # for A's matmul: a copy of its own, which A saves (tuners/lora/layer.py
        # ``Linear.forward``: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``)
        # (the attention output's width: a * v_head_dim under multi-head latent attention)
        terms["attention/out_proj_input"] = c * shapes["o"][0] * t
    n_up = len({"gate", "up"} & targets) if model.mlp_kind == "gated" else int("up" in targets)
    if model.fused_gate_up:  # one fused linear reads the input (adapted_linears)
        n_up = min(n_up, 1)
    if n_up == 0 or skip_inputs:
        terms["mlp/input"] = 0
    elif training.uses_autocast:
        terms["mlp/input"] = c * h * t * k_top * cast_copies(n_up, training)
    if (
        "mlp/expert_inputs" in terms
        and training.conventions.hf_model_code
        and not expert_loop(model, training)
    ):
        _frozen_grouped_experts(terms, model, training, t=t)
    if ("down" not in targets or skip_inputs) and not expert_loop(model, training):
        # (transformers 4's expert loop counts no input of a frozen down projection)
        if "mlp/down_input" in terms:
            # the frozen down projection's input is the tensor it no longer saves: the MLP's
            # other i-sized tensors (the activation's and the product's saved operands) stay
            # to the activation's backward, after the MLP's backward transients are made
            # (Note [Frozen down projection's input])
            terms["mlp/down_input"] = 0
        else:
            key = "mlp/gated" if model.mlp_kind == "gated" else "mlp/activation"
            terms[key] -= c * model.intermediate_size * t * k_top


def _frozen_grouped_experts(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int
) -> None:
    """What a transformers 5 MoE block (:func:`~trainmem.analytic.mlp.moe_terms`) does not
    save under LoRA, in place: its frozen weights' matmuls keep no input.

    * the router (never adapted) keeps no autocast copy of the block's input (c h t);
    * the routed experts' grouped matmul keeps the weight only for the input's gradient
      (torch's ``GroupedMmBackward0``, Note [Traced grouped matmul of frozen experts] in
      trainmem/trace/grouped_mm.py): without gate / up adapters not the gathered tokens
      (w h k t; their int64 indices stay), the down projection's input as ``mlp/down_input``
      (below, in the caller);
    * the shared expert's frozen down projection keeps no input (c s_i t): its gate's and
      up's outputs and the activation's stay, as in a dense MLP (Note [Frozen down
      projection's input]).

    Checked against the generic path's trace (peft 0.21.2 on transformers 5.24; r8 q,v, 2 x
    256 tokens): see docs/formulas.md "LoRA on a transformers 5 MoE block"."""
    c, _ = compute_and_residual_bytes(training)
    targets = set(adapter_targets(training))
    h, k = model.hidden_size, model.num_experts_per_tok
    if training.uses_autocast and "mlp/router" in terms:
        terms["mlp/router"] -= c * h * t
    if not {"gate", "up"} & targets:
        w = dtype_bytes(training.gathered_weight_dtype)
        terms["mlp/expert_inputs"] -= w * h * k * t
    if "mlp/shared_expert" in terms and "down" not in targets:
        terms["mlp/shared_expert"] -= c * model.shared_expert_intermediate_size * t


def _adapter_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> dict[str, int]:
    """What each targeted linear's adapters save: A's output (saved by B), peft's dropout
    output and mask, and the input's cast to the fp32 adapters (Note [LoRA activations])."""
    c, _ = compute_and_residual_bytes(training)
    targets = set(adapter_targets(training))
    # autocast runs the adapters' matmuls in 16-bit
    a_bytes = c if training.uses_autocast else adapter_matmul_bytes(training, model)
    # lit-gpt's fused ``attn`` applies one dropout to x for q, k and v together
    # (lit_gpt/lora.py ``LoRAQKVLinear``: ``F.linear(self.lora_dropout(x), self.lora_A)``)
    first_qkv = next((n for n in ("q", "k", "v") if n in targets), None)
    terms: dict[str, int] = {}
    cast_shared: set[str] = set()  # linears whose input a targeted linear already cast
    for name, (fan_in, _out, _n) in adapted_linears(model).items():
        targeted = lora_targeted(name, targets)
        if name == "router" or not targeted:
            continue
        active = k_top if name in ("gate_up", "gate", "up", "down") else 1
        # T5's cross-attention k and v read the encoder output (source tokens), q the decoder's
        tokens = source_tokens(training) if name in ("cross_k", "cross_v") else t
        terms[f"lora/{name}"] = a_bytes * training.lora_rank * tokens * active
        shared = (
            training.conventions.own_model_code and name in ("q", "k", "v") and name != first_qkv
        )
        if training.lora_dropout > 0 and not shared:
            terms[f"lora/{name}_dropout"] = (c + 1) * fan_in * tokens * active
        if a_bytes > c and not (training.compile and name in cast_shared):
            # peft casts the input to the fp32 adapter's dtype; A saves that copy (one copy per
            # input under torch.compile: Note [Compiled casts are computed once])
            terms[f"lora/{name}_input_cast"] = a_bytes * fan_in * tokens * active
            if active == 1:  # (routed experts read their own tokens)
                cast_shared |= _SAME_INPUT.get(name, set())
    return terms


_SAME_INPUT = {
    "q": {"q", "k", "v"}, "k": {"q", "k", "v"}, "v": {"q", "k", "v"},
    "gate": {"gate", "up"}, "up": {"gate", "up"},
}  # fmt: skip
"""Linears of a layer that read the same tensor (the attention norm's output; the MLP norm's)."""

BNB_4BIT = ("nf4", "nf4-dq", "fp4", "fp4-dq")
"""bitsandbytes 4-bit bases (``Linear4bit`` / ``Params4bit``)."""


UNSLOTH_FAST_LORA_TARGETS = frozenset(("q", "k", "v", "o", "gate", "up", "down"))
"""The linears whose adapters Unsloth's kernels take together (``LoRA_QKV``: q, k, v;
``LoRA_MLP``: gate, up, down; ``LoRA_W``: o), all of them: ``FastLanguageModel.
get_peft_model``'s default ``target_modules``."""


UNSLOTH_KERNEL_FAMILIES = frozenset(
    ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite")
)
"""``model_type`` values whose ``FastLanguageModel`` class installs the LoRA kernels with the
in-place MLP backward (unsloth 2026.3.5 models/llama.py ``patch_peft_model``: its
``apply_lora_mlp`` table; cohere's MLP runs ``inplace = False``, falcon_h1's MLP is not
patched, qwen3moe's experts are not ``LoRA_MLP``: left to peft's rules here; other families
load through ``FastModel`` without them)."""


def unsloth_fast_lora(model: ModelSpec, training: TrainingConfig) -> bool:
    """Every adapter runs through Unsloth's kernels (``FrameworkConventions.
    unsloth_fast_lora``): a family of :data:`UNSLOTH_KERNEL_FAMILIES`, dense, with no bias on
    q / k / v, o or the MLP (``patch_peft_model`` patches a group only without biases: Qwen2's
    q / k / v biases keep peft's forward there), adapters on all seven linears and no
    dropout. Otherwise peft's rules (a part of the layer on the kernels is not modelled).

    Note [Unsloth's fast LoRA]
        unsloth 2026.3.5 models/llama.py ``FastLlamaModel.patch_peft_model`` replaces the
        MLP's forward by ``apply_lora_mlp_swiglu`` (``LoRA_MLP``) when gate, up and down all
        have adapters and no bias, the attention's ``apply_qkv`` by ``LoRA_QKV`` when q, k and
        v do, ``apply_o`` by ``LoRA_W`` for o; only with ``lora_dropout == 0`` and ``bias ==
        "none"`` (peft's forward otherwise). kernels/fast_lora.py ``matmul_lora``: ``out =
        X @ fast_dequantize(W, W_quant, use_global_buffer = True).t()``, then ``XA =
        X @ A.to(dtype)`` and ``out.addmm_(XA, B.to(dtype))``: the fp32 adapters are cast to
        the input's dtype (a copy of r (fan_in + fan_out) values), never the input, so no
        ``lora/*_input_cast`` copy exists. kernels/utils.py ``fast_dequantize`` with
        ``use_global_buffer`` writes every 4-bit weight into ``WEIGHT_BUFFERS[device]``
        (``torch_empty(size, dtype)``, grown by ``resize_`` to the largest weight, kept) and its
        double-quantized statistics into ``ABSMAX_BUFFERS[device]`` (fp32, one per 64
        values): one buffer of the layer's largest weight from the first forward on, not a
        dequantized weight made and freed per matmul. The backward's input-gradient matmuls
        call ``fast_dequantize(W.t(), W_quant)`` without it (``LoRA_MLP.backward``: up, gate;
        ``LoRA_QKV.backward``: q, k, v; ``LoRA_W.backward``): a fresh tensor each, freed after
        (``del upW``), as bitsandbytes' ``MatMul4Bit`` does. What the kernels save
        (``ctx.save_for_backward``): ``LoRA_QKV`` X and the adapters, ``LoRA_W`` X and the
        adapters, ``LoRA_MLP`` the adapters, X, ``e = gate(X)`` and ``g = up(X)``; the
        SwiGLU output ``h`` (kernels/swiglu.py ``swiglu_fg_kernel``) is freed after the down
        matmul and remade in backward in place (``swiglu_DWf_DW_dfg_kernel(DW, e, g)``), and
        no ``X @ A`` is kept (remade for the B gradient). Modelled when all seven linears
        carry adapters (Unsloth's default targets) with no dropout; otherwise peft's rules.
        DoRA (``get_peft_model(use_dora=True)``, passed through ``**kwargs`` to peft's
        ``LoraConfig``) keeps peft's forward everywhere: each of the three patches also requires
        ``len(proj.lora_magnitude_vector) == 0`` (models/llama.py ``patch_peft_model``, unsloth
        2026.3.5), so peft's DoRA rules hold (Note [DoRA] in ``analytic/lora_variants.py``).
    """
    return (
        training.conventions.unsloth_fast_lora
        and training.is_lora
        and training.lora_variant != "dora"
        and training.lora_dropout == 0
        and UNSLOTH_FAST_LORA_TARGETS <= set(training.lora_targets)
        and model.model_type in UNSLOTH_KERNEL_FAMILIES
        and model.num_experts == 1
        and model.mlp_kind == "gated"
        and not (model.attention_bias or model.attention_out_bias or model.mlp_bias)
    )


def unsloth_lora_product_tensor(training: TrainingConfig) -> bool:
    """Unsloth's ``matmul_lora`` adds the adapters' product out of place, a new (tokens,
    fan_out) tensor beside the base matmul's output: ``out += (X @ A.to(dtype)) @ (s *
    B.to(dtype))`` before 2025.3.1, ``out.addmm_(XA, B.to(dtype), alpha = s)`` from it
    (unsloth/kernels/utils.py; :data:`~trainmem.specs.frameworks.
    UNSLOTH_SMART_CHECKPOINT_SINCE`)."""
    return training.unsloth_release < UNSLOTH_SMART_CHECKPOINT_SINCE


def adapter_matmul_bytes(training: TrainingConfig, model: ModelSpec | None = None) -> int:
    """Bytes per element of the adapters as LoRA's forward reads them: their dtype
    (:func:`lora_adapter_dtype`), or the compute dtype where FSDP gathers them in it.

    Under an FSDP mixed-precision policy (``TrainingConfig.gathered_weight_dtype``: accelerate's
    ``MixedPrecision(param_dtype=dtype)``) a unit's forward runs on views of its 16-bit
    unsharded flat parameter (torch distributed/fsdp/_flat_param.py ``_use_unsharded_views``
    over the low-precision ``_mp_shard`` all-gathered), the fp32 adapters' included (accelerate
    upcasts only the sharded trainable flat parameter, ``prepare_model``: ``param.data =
    param.data.to(torch.float32)``), so peft's ``x.to(lora_A.weight.dtype)`` (tuners/lora/
    layer.py ``Linear.forward``, 0.13) is a no-op: no fp32 copy of the input, and A saves the
    16-bit dropout output. For a bitsandbytes 4-bit base under accelerate's FSDP the policy is
    the 16-bit quant storage's whatever the precision (transformers 4.48 trainer.py
    ``_fsdp_qlora_plugin_updates``: ``fsdp_plugin.set_mixed_precision(...bnb_4bit_quant_storage,
    override=True)`` when it is a floating dtype; the model's dtype here). Under Unsloth's
    kernels (``model`` given, :func:`unsloth_fast_lora`) the compute dtype: they cast the
    adapters to the input's dtype (Note [Unsloth's fast LoRA])."""
    if training.is_mixed and training.gathered_weight_dtype == training.compute_dtype:
        return dtype_bytes(training.compute_dtype)
    if model is not None and unsloth_fast_lora(model, training):  # ``A.to(X.dtype)``
        return dtype_bytes(training.compute_dtype)
    # FSDP1's NO_SHARD casts its flat parameters under the policy too (Note [FSDP1 NO_SHARD's
    # 16-bit copy] in analytic/transforms/sharding.py)
    fsdp = training.zero_stage == 3 and training.data_parallel_size > 1
    fsdp = fsdp or fsdp1_no_shard(training)
    storage = dtype_bytes(training.weight_dtype)
    if (
        fsdp
        and training.conventions.fsdp_param_dtype_follows_precision
        and training.quantize_base in BNB_4BIT
        and storage == 2
    ):
        return storage
    return dtype_bytes(lora_adapter_dtype(training))


def lora_adapter_dtype(training: TrainingConfig) -> str:
    """Dtype of the LoRA A and B matrices: peft upcasts adapters on a 16-bit base to fp32
    (``autocast_adapter_dtype=True``, peft tuners/tuners_utils.py); lit-gpt and torchtune keep
    them in the model's dtype; TRL's SFTTrainer from 0.26 casts them to bf16 on a
    bitsandbytes base (``TrainingConfig.trl_bf16_adapters``). An explicit
    ``TrainingConfig.lora_adapter_dtype`` wins (diffusers' ``cast_training_params``)."""
    if training.lora_adapter_dtype is not None:
        return training.lora_adapter_dtype
    if training.trl_bf16_adapters:
        return "bfloat16"
    if training.conventions.adapter_dtype_follows_weights:
        return training.weight_dtype
    return "float32"


def lora_adapter_elements(model: ModelSpec, training: TrainingConfig) -> int:
    """Elements of one layer's LoRA adapters: r * (fan_in + fan_out) per targeted linear (A is
    r x fan_in, B fan_out x r; Hu et al. 2021), 0 without LoRA."""
    if not training.is_lora:
        return 0
    r = training.lora_rank
    adapters = 0
    for name, (fan_in, fan_out, n) in adapted_linears(model).items():
        if lora_targeted(name, training.lora_targets) and name != "router":
            adapters += n * r * (fan_in + fan_out)
    return adapters


FIRST_LINEARS = ("qkv", "q", "k", "v")
"""The linears that read a pre-norm block's first norm output (:func:`linear_shapes` names: one
fused ``qkv`` or ``q``, ``k``, ``v``); in a parallel block the MLP's read the layer input too."""

MLA_FIRST_LINEARS = ("q", "q_a", "kv_a")
"""Multi-head latent attention's linears that read the attention norm's output (:func:`linear_
shapes` names): ``q_a_proj`` (or ``q_proj`` without ``q_lora_rank``) and
``kv_a_proj_with_mqa``; ``q_b_proj`` / ``kv_b_proj`` read the latents."""

MLP_LINEARS = ("gate_up", "gate", "up", "down")

LATER_FIRST_LINEARS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        ("o",),
        (
            "attention/q_k", "attention/v", "attention/sdpa_output", "attention/logsumexp",
            "attention/qkv_input", "attention/qk_norm", "attention/qkv_view_kept",
            "attention/dropout_mask", "scores/",
        ),
    ),
    (
        ("gate_up", "gate", "up"),
        (
            "attention/out_proj_input", "attention/out_proj_input_float",
            "attention/output_norm", "attention/layer_scale_input", "mlp/norm",
        ),
    ),
    (("down",), ("mlp/input", "mlp/gated", "mlp/activation", "mlp/inner_dropout_mask")),
)  # fmt: skip
"""A dense sequential pre-norm block's linears after q / k / v in the order they run, each
group with the terms its predecessors make (Note [LoRA's first layer], its adapters on later
linears only): where a group holds the first adapters, the stack's first layer saves none of
the terms of that group and of the groups before it."""


def _first_adapted_linears(
    model: ModelSpec, targets: set[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The linears of the stack's first layer up to its first adapted one (q / k / v's group
    when they hold one, or no later group does) and the terms made before that one's group
    that the layer saves none of beyond ``attention/norm`` (Note [LoRA's first layer])."""
    names = set(adapted_linears(model))
    early = any(lora_targeted(n, targets) for n in FIRST_LINEARS if n in names)
    if model.num_experts != 1 or early:
        return FIRST_LINEARS, ()
    first: tuple[str, ...] = FIRST_LINEARS
    whole: tuple[str, ...] = ()
    for linears, terms in LATER_FIRST_LINEARS:
        first += linears
        whole += terms
        if any(lora_targeted(n, targets) for n in linears if n in names):
            return first, whole
    return FIRST_LINEARS, ()


def _mla_first_layer(
    model: ModelSpec, training: TrainingConfig
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Multi-head latent attention's part of Note [LoRA's first layer]: the linears whose input
    needs no gradient in the stack's first layer, and the terms that layer does not save at
    all beside ``attention/norm``.

    Note [MLA under LoRA]
        transformers 5.24 modeling_deepseek_v3.py ``DeepseekV3Attention.forward``:
        ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, ``kv_a_proj_with_mqa(x)`` split into the
        latent (``kv_a_layernorm``, then ``kv_b_proj`` inside ``expand_kv``) and the rotary
        key, SDPA, ``o_proj`` on the (b, s, a * v_head_dim) output. ``--lora-targets`` q is
        q_a_proj + q_b_proj, k or v kv_a_proj_with_mqa + kv_b_proj, o o_proj (the generic
        path's ``_mla_roles``; peft's own names would match o_proj only). Under LoRA:

        * two linears read the attention norm's output (q_a_proj or q_proj, and
          kv_a_proj_with_mqa), not one per q / k / v name: under autocast each targeted one's
          fp32 A casts its own 16-bit copy and saves it (``attention/qkv_input``: c h t per
          targeted one, 0, 1 or 2);
        * a frozen q_b_proj / kv_b_proj saves no input (``mm`` keeps ``self`` only for the
          weight's gradient, torch derivatives.yaml); a targeted one's A saves its own copy
          of the latent, c r t as full fine-tuning's cast (``attention/*_latent_input``);
        * o's A reads the attention output, a * v_head_dim wide (not a * (qk_nope + qk_rope)).

        In the stack's first layer (Note [LoRA's first layer]) the input needs no gradient, so
        q_a_proj and kv_a_proj_with_mqa keep no weight copy, nor their A's theirs; an
        untargeted path (q, or kv) stays without a gradient up to the attention kernel: its
        latent norm records nothing and its up projection keeps no weight copy; with neither
        path targeted the kernel is not recorded (its saved q, k, v, output and logsumexp)
        and o_proj's input needs no gradient either. Checked against the generic path (peft
        0.21.2 on the transformers model): tiny-deepseek-v3 r8, 2 x 256 tokens, q,k,v,o -1.21
        -> +0.13 %, o -3.74 -> +0.14 % (the rest is the MoE block's, its own mechanism);
        tests/analytic/test_mla_lora.py by hand.
    """
    targets = set(adapter_targets(training))
    shapes = linear_shapes(model)
    q_first = "q_a" if "q_a" in shapes else "q"
    q_chain = lora_targeted(q_first, targets)  # q_a's output needs a gradient
    kv_chain = lora_targeted("kv_a", targets)
    first: tuple[str, ...] = (q_first, "kv_a")
    whole: tuple[str, ...] = ()
    if not q_chain and "q_b" in shapes:
        first += ("q_b",)
        whole += ("attention/q_latent_norm", "attention/q_latent_input")
    if not kv_chain:
        first += ("kv_b",)
        whole += ("attention/kv_latent_norm", "attention/kv_latent_input")
    if not q_chain and not kv_chain:
        # no input of the attention kernel needs a gradient: it is not recorded, and o_proj's
        # input needs none either
        first += ("o",)
        whole += (
            "attention/q_k",
            "attention/v",
            "attention/sdpa_output",
            "attention/logsumexp",
            "scores/",
        )
    return first, whole


class FirstLayerUnsaved(NamedTuple):
    """What the stack's first layer does not save, against every other layer.

    Attributes:
        whole: terms it does not save at all (a name ending in ``/``: every term under it).
        less: bytes by term it saves less of, on one rank.
    """

    whole: tuple[str, ...]
    less: dict[str, int]


def first_layer_unsaved(model: ModelSpec, training: TrainingConfig) -> FirstLayerUnsaved | None:
    """What the stack's first layer does not save under LoRA without activation checkpointing
    (terms of :func:`~trainmem.analytic.activations.layer_activation_terms`); None where the
    rule does not apply. See Note [LoRA's first layer].

    Note [LoRA's first layer]
        Autograd records an op, and keeps what its backward reads, only if one of its inputs
        requires grad; and a recorded op keeps a tensor only for the inputs that need a
        gradient (torch 2.13 torchgen/packaged/autograd/gen_variable_type.py ``guard_for``:
        ``if (grad_fn->should_compute_output(k))`` around each ``SavedVariable``; mm keeps
        ``mat2`` for ``self``'s gradient, ``self`` for ``mat2``'s). Under LoRA the embedding
        and the norms are frozen, so without checkpointing (no ``enable_input_require_grads``
        hook, :attr:`~trainmem.specs.training.TrainingConfig.input_embeddings_require_grad`)
        nothing in the first layer requires grad before its first adapters: its input norm
        records nothing (the ``attention/norm`` term: the residual input and its statistics),
        the frozen q / k / v (or fused qkv) keep no 16-bit weight copy under autocast (their
        input needs no gradient), and each adapter's ``A`` on them keeps its input (for its
        own weight gradient) but not its weight copy, nor peft's dropout its mask; a quantized
        base matmul that saves its input (bitsandbytes int8, 4-bit before 0.43.2: a custom
        ``Function`` whose node is dropped when no input requires grad) saves none there,
        where the adapters read their own copy of the input. From the
        adapters' outputs on, every tensor requires grad, as in every other layer. In a
        parallel block (GPT-NeoX, Phi, Falcon) the MLP reads the layer input too: without
        adapters on it, it records nothing at all (every ``mlp/`` term and its weights'
        copies). Checked against the generic path (peft on transformers Qwen2, Gemma, Llama,
        Phi and GPT-NeoX; tests/analytic/test_lora_first_layer.py).

        With no adapter on q / k / v (a dense sequential block, :data:`LATER_FIRST_LINEARS`)
        nothing requires grad before the first adapted linear: from o on, the attention core
        records nothing either and o's frozen copy is not kept; from gate / up on, neither o's
        input nor the second norm's input, nor the gate / up copies; on down only, none of the
        MLP's tensors but down's adapters' input (generic path, 1024-wide agreement Llama, LoRA
        r 16: layer 0 keeps 31,246,336 B of layer 1's 43,880,472 B on o, 18,825,216 B on
        gate / up, 5,029,888 B on down; the formulas -1.93 / -6.84 / -12.06 % before,
        +0.41 / +0.44 / +0.47 % after; tests/analytic/test_dora_moments.py).

        DoRA's adapters on these linears also keep no ``mag_norm_scale - 1`` and, with dropout,
        no re-linear weight (Note [DoRA]). Multi-head latent attention: Note [MLA under LoRA].
        Blocks of several kinds (DeepSeek-V3's dense then MoE blocks): the first block's
        attention terms are every kind's. Not modelled (None): AdaLoRA and LoKr, and a
        parallel block with MLP adapters.
    """
    if training.prefix_tokens:
        return _prefix_first_layer(model, training)
    targets = set(adapter_targets(training))
    parallel = model.parallel_attention
    if (
        not training.is_lora
        or training.trains_embedding  # Note [peft modules_to_save]: its output needs grad
        or training.lora_variant not in ("lora", "dora")
        or training.activation_checkpointing != "none"
        or training.input_embeddings_require_grad
        or model.architecture != "decoder"
        or not model.pre_norms
        or (parallel and targets & set(MLP_LINEARS))
    ):
        return None
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    adapters = _adapter_terms(model, training, t=t, k_top=1)
    first = FIRST_LINEARS + (MLP_LINEARS if parallel else ())
    mla_whole: tuple[str, ...] = ()
    if model.mla:
        first, mla_whole = _mla_first_layer(model, training)
    elif not parallel:  # adapters on later linears only: LATER_FIRST_LINEARS
        first, mla_whole = _first_adapted_linears(model, targets)
    adapter_bytes = dtype_bytes(lora_adapter_dtype(training))
    less: dict[str, int] = {}
    copies = 0
    for name, (fan_in, fan_out, n) in adapted_linears(model).items():
        if name not in first:
            continue
        targeted = lora_targeted(name, targets)
        if training.uses_autocast and training.quantize_base == "none":
            copies += c * fan_in * fan_out * n  # the frozen weight's copy
        if training.uses_autocast and targeted:
            copies += c * training.lora_rank * fan_in * n  # A's copy (r x fan_in)
        if f"lora/{name}_dropout" in adapters:
            less[f"lora/{name}_dropout"] = fan_in * t * n  # peft's dropout mask, 1 byte a value
        if targeted and training.lora_variant == "dora":  # Note [DoRA]
            less[f"dora/{name}"] = dora_first_layer_unsaved(
                training, fan_in=fan_in, fan_out=fan_out, n=n, adapter_bytes=adapter_bytes
            )
    if copies:
        less["autocast_weight_copies"] = copies
    whole: tuple[str, ...] = ("attention/norm",)
    own_copy = training.uses_autocast or dtype_bytes(lora_adapter_dtype(training)) > c
    saves_input = training.quantized_matmul_saves_input or training.zero3_linear_saves_input
    if saves_input and (own_copy or training.lora_dropout > 0):
        # the quantized q / k / v matmuls' saved inputs (adapters read their own copy)
        whole += ("attention/qkv_input",)
        if "o" in first:  # (MLA without adapters before o: its quantized matmul's input)
            whole += ("attention/out_proj_input",)
    whole += mla_whole
    if parallel:
        whole += ("mlp/",)
    return FirstLayerUnsaved(whole, split_for_parallelism(less, training))


def _prefix_first_layer(model: ModelSpec, training: TrainingConfig) -> FirstLayerUnsaved | None:
    """:func:`first_layer_unsaved` under prefix tuning (Note [Prompt learning in the formulas]
    in trainmem/analytic/prompt_encoder.py): the first layer's input needs no gradient up to
    the concatenation of the prefix's keys and values with its own, so its input norm records
    nothing and its frozen q / k / v (and a parallel block's MLP, which reads the same input)
    keep no autocast weight copy; from attention's kernel on (its keys and values need a
    gradient) it saves what every layer saves. None where the rule is not modelled
    (checkpointing, a block that is not a pre-norm decoder's)."""
    if (
        training.activation_checkpointing != "none"
        or training.input_embeddings_require_grad
        or model.architecture != "decoder"
        or not model.pre_norms
        or model.mla
    ):
        return None
    parallel = model.parallel_attention
    first = FIRST_LINEARS + (MLP_LINEARS if parallel else ())
    c, _ = compute_and_residual_bytes(training)
    less: dict[str, int] = {}
    if training.uses_autocast and training.quantize_base == "none":
        less["autocast_weight_copies"] = sum(
            c * fan_in * fan_out * n
            for name, (fan_in, fan_out, n) in adapted_linears(model).items()
            if name in first
        )
    whole: tuple[str, ...] = ("attention/norm", "mlp/") if parallel else ("attention/norm",)
    return FirstLayerUnsaved(whole, split_for_parallelism(less, training))


def peft_adapter_matmuls(
    model: ModelSpec, training: TrainingConfig, name: str, *, fan_in: int, fan_out: int, t: int
) -> list[tuple[str, int]]:
    """The ``aten.mm`` outputs peft's adapters on the linear ``name`` run after its base
    matmul, in execution order, as (key, bytes) (Note [The adapters' matmuls under op-level
    selective checkpointing] in trainmem/analytic/op_selective.py); [] where the linear has no
    adapter or the sequence is not peft's on a dense unquantized linear of one rank.

    LoRA (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``: ``result =
    self.base_layer(x)``, then ``lora_B(lora_A(dropout(x)))``): A's [t, r] output
    (``mm/lora_A/<linear>``) and B's [t, out] (``mm/lora_B/<linear>``). DoRA
    (tuners/lora/variants.py ``DoraLinearVariant.forward`` -> tuners/lora/dora.py
    ``DoraLinearLayer.forward``): first ``get_lora_weight``, the adapters on ``torch.eye(in)``
    ([in, r] then the [in, out] product: ``mm/dora_eye_A`` / ``mm/dora_eye_B``), then
    ``lora_B(lora_A(x))`` as LoRA's, then with dropout ``F.linear(x, weight)``, DoRA's own
    base result (``mm/dora_base``). Each in the adapters' matmul dtype (the compute dtype
    under autocast; :func:`adapter_matmul_bytes`)."""
    t_ = training
    if not (
        t_.is_lora
        and t_.lora_variant in ("lora", "dora")
        and t_.conventions.hf_model_code
        and t_.quantize_base == "none"
        and t_.tensor_parallel_size == 1
        and t_.context_parallel_size == 1
        and model.num_experts == 1
        and not model.fused_gate_up
        and name in adapted_linears(model)
        and lora_targeted(name, t_.lora_targets)
        and not unsloth_fast_lora(model, t_)
    ):
        return []
    c, _ = compute_and_residual_bytes(t_)
    a = c if t_.uses_autocast else adapter_matmul_bytes(t_, model)
    r = t_.lora_rank
    adapters = [(f"mm/lora_A/{name}", a * r * t), (f"mm/lora_B/{name}", a * fan_out * t)]
    if t_.lora_variant == "lora":
        return adapters
    eye = [
        (f"mm/dora_eye_A/{name}", a * fan_in * r),
        (f"mm/dora_eye_B/{name}", a * fan_in * fan_out),
    ]
    base = [(f"mm/dora_base/{name}", a * fan_out * t)] if t_.lora_dropout > 0 else []
    return eye + adapters + base
