"""Op-level selective activation checkpointing as torchtitan does it: the tensors one layer's
policy keeps (the outputs of every other matmul, the attention kernel's) and what the recompute
does with each cached matmul output. Symbols as in :mod:`trainmem.analytic.activations`.

Note [The adapters' matmuls under op-level selective checkpointing]
    torchtitan's policy (``_get_custom_policy``, trainmem/trace/sac.py ``selective_policy``)
    counts every ``aten.mm`` the layer runs and caches the output of the 1st, 3rd, ...: peft's
    adapters are ``nn.Linear`` modules run inside the layer, so their matmuls are counted and
    cached as the base linears' are (:func:`~trainmem.analytic.lora.peft_adapter_matmuls`:
    LoRA's A and B on the input; DoRA's A and B on ``torch.eye(in)`` first, whose [in, out]
    product ``get_lora_weight`` returns, peft 0.21.2 tuners/lora/dora.py). torch's
    ``_CachingTorchDispatchMode`` keeps a cached output from the forward to the recompute,
    where ``_CachedTorchDispatchMode`` pops it and hands it to the replayed op's consumer
    (torch/utils/checkpoint.py): from there it lives as long as the recompute needs it. So
    each cached output of a targeted linear is either

    * a layer term the recompute would otherwise make again, saved by the consumer's node
      (:func:`op_selective_cache_uses`): A's [t, r] output, saved by B's matmul (``lora/
      <linear>``); under DoRA the base output and B's output, saved by
      ``(mag_norm_scale - 1) * base_result`` and ``mag_norm_scale * lora_result`` (the
      ``base_result`` / ``lora_result`` of ``dora/<linear>``; with dropout the base result
      is DoRA's own re-linear, ``mm/dora_base``);
    * or read by no saving op, freed where the recompute replays it: the eye products (the
      product is cast to x's dtype, ``.to`` saves nothing, then detached), and under LoRA the
      base output and B's output (``result + lora_B(...) * scaling``: an add and a product
      with a number save neither).

    A targeted gate's output is then the add, not its base matmul: the gate share of
    ``mlp/gated`` is recomputed, the base output is one of the above. Traced on the
    2-layer 2048-wide agreement Llama (2 x 256 tokens, r 16, DoRA on q / v): layer 0's
    forward caches q's base output, its [2048, 2048] eye product and B's output (2,097,152 +
    8,388,608 + 2,097,152 B) and v's (524,288 + 2,097,152 + 524,288 B), 13,107,200 B beyond
    the base linears' outputs; at the peak (layer 1's recompute at the down projection) the
    products of layer 1 are gone, its base and B outputs held as DoRA's saved tensors.
    Not modelled: a quantized base (bitsandbytes' matmul runs inside its own autograd
    function), Unsloth's kernels, experts, a fused gate / up module, tensor or context
    parallelism: their adapters' matmuls are not counted (the previous rule).

Source: torchtitan ``apply_ac`` / ``_get_custom_policy`` (``_save_list`` and the mm counter),
torch/utils/checkpoint.py ``create_selective_checkpoint_contexts``; peft 0.21.2
tuners/lora/layer.py, variants.py, dora.py.
"""

from __future__ import annotations

from trainmem.analytic.activation_parallelism import split_for_parallelism
from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    mean_terms,
    tokens_per_sequence,
)
from trainmem.analytic.attention import kv_saved_repeated
from trainmem.analytic.lora import peft_adapter_matmuls
from trainmem.analytic.mlp import experts_per_token
from trainmem.analytic.params import linear_shapes
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

EYE_PRODUCTS = ("mm/dora_eye_A/", "mm/dora_eye_B/")
"""Prefixes of the cached outputs of DoRA's matmuls on ``torch.eye(in)`` (Note [The adapters'
matmuls under op-level selective checkpointing])."""


def op_selective_saved_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes one layer keeps under op-level selective checkpointing: the sum of
    :func:`op_selective_saved_terms`."""
    return sum(op_selective_saved_terms(model, training).values())


def op_selective_saved_terms(model: ModelSpec, training: TrainingConfig) -> dict[str, int]:
    """Tensors one layer keeps under op-level selective checkpointing as torchtitan does it
    (``selective_ac_option="op"``): the layer input, the SDPA output + logsumexp, and the output
    of every other matmul in execution order (the 1st, 3rd, ...; torchtitan's policy saves
    ``aten.mm`` "except every second mm"), peft's adapters' among them (Note [The adapters'
    matmuls under op-level selective checkpointing]); everything else is recomputed in
    backward.

    Under ``torch.compile`` the checkpoint is a tagged region of the compiled graph and the
    min-cut partitioner keeps a ``MUST_SAVE`` output only if the backward reads it
    (``torch/_functorch/partitioners.py``: tags ban recomputation, they do not add outputs); the
    outputs of the attention and MLP output projections (``o``, ``down``) only enter the
    residual add, whose backward reads no input, so they are not kept (eager SAC's cache keeps
    every ``MUST_SAVE`` output for the replay). Seen in the trace of llama-3.2-1b (one
    ``(tokens, h)`` tensor per layer less with compile, Note [Tracing torch.compile] in
    trainmem/trace/compile.py).

    Source: torchtitan ``apply_ac`` / ``_get_custom_policy`` (``_save_list`` and the mm counter),
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. See Note [Activation
    checkpointing] (trainmem/analytic/activations.py).
    """
    mean = mean_terms(model, lambda block: op_selective_saved_terms(block, training))
    if mean is not None:
        return mean
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    c, r = compute_and_residual_bytes(training)
    k_top = experts_per_token(model)
    # a linear with a bias runs as ``addmm`` (always saved); without one as ``mm`` (counted)
    biased = {
        "qkv": model.attention_bias,
        "q": model.attention_bias,
        "k": model.attention_bias,
        "v": model.attention_bias,
        "o": model.attention_out_bias,
        "gate": model.mlp_bias,
        "up": model.mlp_bias,
        "down": model.mlp_bias,
    }
    # matmul outputs in execution order (experts: k_top of each), each linear's adapters after it
    outputs: list[tuple[str, int, bool]] = []
    for name, (fan_in, fan_out, _n) in linear_shapes(model).items():
        if name == "router":
            continue
        active = k_top if name in ("gate", "up", "down") else 1
        outputs.append((f"mm/{name}", c * fan_out * t * active, biased.get(name, False)))
        adapters = (
            ()
            if training.compile
            else peft_adapter_matmuls(model, training, name, fan_in=fan_in, fan_out=fan_out, t=t)
        )
        outputs += [(key, size, False) for key, size in adapters]
    kept: dict[str, int] = {}
    mm_count = 0
    for key, size, addmm in outputs:
        if addmm:
            kept[key] = size
            continue
        mm_count += 1
        if mm_count % 2 == 1:
            kept[key] = size
    if training.compile:  # read by no backward op: the min-cut does not keep them
        kept.pop("mm/o", None)
        kept.pop("mm/down", None)
    split = {
        "layer_input": r * model.hidden_size * t,
        "attention/sdpa_output": c * model.num_heads * model.head_dim * t,
        "attention/logsumexp": 4 * model.num_heads * t,
        **kept,
    }
    return split_for_parallelism(split, training)


def op_selective_cache_uses(
    model: ModelSpec, training: TrainingConfig, kept: dict[str, int]
) -> dict[str, str]:
    """What the recompute does with each cached matmul output of ``kept``
    (:func:`op_selective_saved_terms`) that belongs to an adapted linear or holds a layer
    term: the layer term it stands for (its bytes not made again), or ``""`` where no op of
    the recompute saves it, so it is freed where the recompute replays it (Note [The adapters'
    matmuls under op-level selective checkpointing]; an unadapted q / k / v: Note [The cached
    q and v outputs in the recompute]). The other linears' outputs, which the terms do not
    hold (o / down before the residual adds; q / k without RoPE or a q / k norm), are not
    listed: they stay kept to the layer's backward (Note [Op-level selective recompute per
    tensor]).

    Note [The cached q and v outputs in the recompute]
        An unadapted q / k / v projection's cached output (the 1st and 3rd ``aten.mm`` of a
        Llama layer without adapters on them) is popped from the cache where the recompute
        replays the projection, as the adapters' outputs are, and lives as long as an op of
        the recompute saves it. q's (and k's) goes through RoPE, whose products by cos / sin
        save cos / sin, not it (transformers 5.24 modeling_llama.py ``apply_rotary_pos_emb``;
        torch 2.13 derivatives.yaml ``mul.Tensor``: ``self`` is saved only for ``other``'s
        gradient, and cos / sin need none), or through a q / k RMSNorm that saves its fp32
        copy: nothing saves it, so it is freed there, before the layer's backward. v's is
        viewed into heads and handed to SDPA, which saves that view (``attention/v``: the
        same bytes where SDPA takes v at its own heads, :func:`~trainmem.analytic.attention.
        kv_saved_repeated`), so it stands for that term, which the recompute does not make
        again; expanded to every query head (``repeat_kv``), the expansion is the saved
        tensor and the cached one is freed. The formulas kept both to the layer's backward
        and recomputed ``attention/v`` besides: on the 1024-wide agreement Llama (2 x 256
        tokens, DoRA r 16 on gate / up, selective) the trace's layer-1 recompute frees q's
        cached output at its attention (its ``q_proj`` block, 1,048,576 B) and holds v's as
        SDPA's saved value, 2,097,152 B less than the formulas held at the up projection's
        DoRA moment.

    Note [An unadapted up's cached output in the recompute]
        Which of a gated MLP's matmuls the policy caches depends on how many ``aten.mm`` ran
        before them in the layer: gate (the 5th) in a bare Llama layer, and with adapters
        that run an even number (LoRA's A and B; DoRA's two eye products and A and B), but
        up where an odd number ran: DoRA with ``lora_dropout`` adds a fifth, its re-linear
        ``F.linear(dropout(x), weight)`` (peft 0.21.2 tuners/lora/variants.py
        ``DoraLinearVariant.forward``), so DoRA on o alone (or on any odd count of linears
        before the MLP) with dropout caches up's output, not gate's. The recompute pops it
        where it replays up (torch 2.13 utils/checkpoint.py ``_CachedTorchDispatchMode``) and
        hands it to ``act_fn(gate_proj(x)) * up_proj(x)`` (transformers 5.24
        modeling_llama.py ``LlamaMLP.forward``), whose ``MulBackward0`` saves both factors
        (derivatives.yaml ``mul.Tensor``): it is up's share of ``mlp/gated``, not made again,
        as the gate's cached output is. The formulas kept it to the layer's backward and
        recomputed all of ``mlp/gated`` besides, one c t i too many from the recompute's
        MLP on: a real CPU execution (transformers' Llama of tests/conftest.py
        ``PEFT_LLAMA``, 2 x 128 tokens, peft's DoRA r 16 on o with ``lora_dropout`` 0.1,
        torchtitan's policy, a dispatch-mode storage counter) peaks at 7,723,016 B made in
        the step at layer 1's recomputed down projection, the formulas at 8,250,368 B
        (+6.83 %: c t i = 524,288 B and the 3,064 B of the same cell without dropout); the
        generic path's trace of the 1024 / 2048-wide agreement Llamas was -1.29 / -0.93 %
        under them. A non-gated MLP's up (its output read by the activation) is not
        modelled here: no such cell has been traced.
    """
    dora = training.lora_variant == "dora"
    # Note [The cached q and v outputs in the recompute]
    rotated = model.position_kind == "rotary" or model.qk_norm
    v_saved = not kv_saved_repeated(model, training)
    # the linears whose adapters' matmuls were counted (each runs 3 or more: one is cached)
    adapted = {key.rsplit("/", 1)[-1] for key in kept if key.count("/") == 2}
    uses: dict[str, str] = {}
    for key in kept:
        parts = key.split("/")
        if parts[0] != "mm":
            continue
        linear = parts[-1]
        if len(parts) == 2 and linear not in adapted:
            if linear == "gate" or (linear == "up" and model.mlp_kind == "gated"):
                # the gate's output, read by the activation; up's, saved by the product
                # (Note [An unadapted up's cached output in the recompute])
                uses[key] = "mlp/gated"
            elif linear in ("q", "k") and rotated:
                uses[key] = ""  # read by RoPE's products, which save cos / sin
            elif linear == "v":
                uses[key] = "attention/v" if v_saved else ""
        elif len(parts) == 2:  # an adapted linear's base output
            uses[key] = f"dora/{linear}" if dora and training.lora_dropout == 0 else ""
        elif key.startswith("mm/lora_A/"):
            uses[key] = f"lora/{linear}"  # saved by B's matmul
        elif key.startswith(("mm/lora_B/", "mm/dora_base/")):
            uses[key] = f"dora/{linear}" if dora else ""
        else:  # DoRA's eye products
            uses[key] = ""
    return uses
