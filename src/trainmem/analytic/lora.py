"""LoRA's effect on the activations one layer saves: frozen linears that save no input, the
adapters' own saved tensors, peft's casts and dropout, quantized bases whose matmul keeps its
input, and the adapters' dtype and size (Hu et al. 2021, arXiv:2106.09685; peft
tuners/lora/layer.py). Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.lora_variants import check_lora_variant, dora_terms
from trainmem.analytic.mlp import expert_loop
from trainmem.analytic.params import linear_shapes
from trainmem.specs.model import ModelSpec
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
    check_lora_variant(training)
    if not training.quantized_matmul_saves_input:
        _frozen_base_inputs(terms, model, training, t=t, k_top=k_top)
    terms.update(_adapter_terms(model, training, t=t, k_top=k_top))
    adapter_bytes = dtype_bytes(lora_adapter_dtype(training))
    terms.update(dora_terms(model, training, t=t, k_top=k_top, adapter_bytes=adapter_bytes))


def _frozen_base_inputs(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """The inputs a frozen base's linears still save, in place: only the copies the targeted
    linears' adapters read (Note [LoRA activations])."""
    c, _ = compute_and_residual_bytes(training)
    targets = set(training.lora_targets)
    h = model.hidden_size
    qkv_targets = len({"q", "k", "v"} & targets)
    adapter_bytes = dtype_bytes(lora_adapter_dtype(training))
    # With lora_dropout the adapters read the dropout output (counted below), not x: a frozen
    # base saves no input at all.
    via_dropout = training.lora_dropout > 0
    # Without autocast, peft casts a 16-bit input to its fp32 adapters (``_cast_input_dtype``:
    # ``x.to(lora_A.weight.dtype)``) and A saves that copy (``lora/*_input_cast``), not x.
    via_cast = not training.uses_autocast and adapter_bytes > c
    skip_inputs = via_dropout or via_cast
    if skip_inputs or qkv_targets == 0:
        terms["attention/qkv_input"] = 0
    elif training.uses_autocast and "qkv" not in linear_shapes(model):
        terms["attention/qkv_input"] = c * h * t * qkv_targets
    if "o" not in targets or skip_inputs:
        terms["attention/out_proj_input"] = 0
    elif training.uses_autocast and adapter_bytes > c:
        # the 16-bit attention output goes to peft's fp32 cast, then autocast's 16-bit cast
        # for A's matmul: a copy of its own, which A saves (tuners/lora/layer.py
        # ``Linear.forward``: ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``)
        terms["attention/out_proj_input"] = c * model.num_heads * model.head_dim * t
    n_up = len({"gate", "up"} & targets) if model.mlp_kind == "gated" else int("up" in targets)
    if n_up == 0 or skip_inputs:
        terms["mlp/input"] = 0
    elif training.uses_autocast:
        terms["mlp/input"] = c * h * t * k_top * n_up
    if ("down" not in targets or skip_inputs) and not expert_loop(model, training):
        # (transformers 4's expert loop counts no input of a frozen down projection)
        key = "mlp/gated" if model.mlp_kind == "gated" else "mlp/activation"
        terms[key] -= c * model.intermediate_size * t * k_top


def _adapter_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> dict[str, int]:
    """What each targeted linear's adapters save: A's output (saved by B), peft's dropout
    output and mask, and the input's cast to the fp32 adapters (Note [LoRA activations])."""
    c, _ = compute_and_residual_bytes(training)
    targets = set(training.lora_targets)
    # autocast runs the adapters' matmuls in 16-bit
    a_bytes = c if training.uses_autocast else dtype_bytes(lora_adapter_dtype(training))
    # lit-gpt's fused ``attn`` applies one dropout to x for q, k and v together
    # (lit_gpt/lora.py ``LoRAQKVLinear``: ``F.linear(self.lora_dropout(x), self.lora_A)``)
    first_qkv = next((n for n in ("q", "k", "v") if n in targets), None)
    terms: dict[str, int] = {}
    for name, (fan_in, _out, _n) in linear_shapes(model).items():
        targeted = bool({"q", "k", "v"} & targets) if name == "qkv" else name in targets
        if name == "router" or not targeted:
            continue
        active = k_top if name in ("gate", "up", "down") else 1
        terms[f"lora/{name}"] = a_bytes * training.lora_rank * t * active
        shared = (
            training.conventions.own_model_code and name in ("q", "k", "v") and name != first_qkv
        )
        if training.lora_dropout > 0 and not shared:
            terms[f"lora/{name}_dropout"] = (c + 1) * fan_in * t * active
        if a_bytes > c:
            # peft casts the input to the fp32 adapter's dtype; A saves that copy
            terms[f"lora/{name}_input_cast"] = a_bytes * fan_in * t * active
    return terms


def lora_adapter_dtype(training: TrainingConfig) -> str:
    """Dtype of the LoRA A and B matrices: peft upcasts adapters on a 16-bit base to fp32
    (``autocast_adapter_dtype=True``, peft tuners/tuners_utils.py); lit-gpt and torchtune keep
    them in the model's dtype."""
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
    for name, (fan_in, fan_out, n) in linear_shapes(model).items():
        targeted = (
            any(t in training.lora_targets for t in ("q", "k", "v"))
            if name == "qkv"
            else name in training.lora_targets
        )
        if targeted and name != "router":
            adapters += n * r * (fan_in + fan_out)
    return adapters
