"""peft's LoRA variants on the analytic path: what DoRA's forward saves beyond LoRA's (Liu et
al. 2024, arXiv:2402.09353; peft tuners/lora/dora.py, tuners/lora/variants.py). Symbols as in
:mod:`trainmem.analytic.activations` (t tokens, c the compute dtype's bytes).

Note [DoRA]
    peft's ``DoraLinearVariant.forward`` (tuners/lora/variants.py) adds to the base output
    ``result`` the term ``DoraLinearLayer.forward`` (tuners/lora/dora.py) returns::

        lora_weight = lora_B(lora_A(eye(in))).T.to(x.dtype)     # [out, in], freed on return
        weight = base_layer.weight.to(x.dtype)                   # [out, in], freed on return
        weight_norm = linalg.norm(weight + scaling * lora_weight.detach(), dim=1).detach()
        mag_norm_scale = (magnitude / weight_norm).view(1, -1)   # [1, out]
        lora_result = lora_B(lora_A(x))                          # [t, out]
        result_dora = (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * s

    where ``x`` is already cast to the adapters' dtype (``_cast_input_dtype``) and
    ``base_result`` is the base layer's output ``result`` (without ``lora_dropout``) or, with
    dropout, ``F.linear(dropout(x), weight)`` computed again on the dropped input. Saved for
    backward (tools/autograd/derivatives.yaml: ``div`` saves the divisor, ``mul`` saves each
    factor the other one's gradient needs), per targeted linear beyond LoRA's own terms:

    * ``base_result`` [t, out] (c bytes: the base matmul's output; with dropout under
      autocast the 16-bit re-linear's, without autocast the adapters' dtype);
    * ``lora_result`` [t, out] (c bytes under autocast, the adapters' dtype otherwise);
    * ``weight_norm``, ``mag_norm_scale`` and ``mag_norm_scale - 1``, [out] each in the
      adapters' dtype (the last one only where the layer input requires grad: not in the first
      layer, whose input comes from a frozen embedding; the trace shows 2 of them there);
    * with dropout, the re-linear's weight, ``weight`` cast for the matmul (c bytes under
      autocast, the adapters' dtype otherwise; [out, in]), saved because its input requires
      grad (again not in the first layer).

    The magnitude itself is a trainable [out] parameter in the adapters' dtype
    (``DoraLinearLayer.update_layer``: ``nn.Parameter(weight_norm)``), counted with the
    adapters (``lora_magnitude.<name>`` in :mod:`trainmem.analytic.tensor_states`). The
    forward's weight-sized temporaries (``weight``, ``lora_weight``, the scaled sum) are freed
    before the layer returns; the step's peak is in the backward for the runs checked
    (tests/analytic/test_dora.py against the traced peft code). Not modelled here: DoRA on
    ``lm_head`` (vocabulary-sized ``base_result`` and ``lora_result`` in the head; the
    generic path traces it). Over a bitsandbytes base (QDoRA): Note [QDoRA].
"""

from __future__ import annotations

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.checkpointing import layer_checkpoint_reentrant, layer_is_checkpointed
from trainmem.analytic.float8 import float8_linears_save_input
from trainmem.analytic.params import adapted_linears, lora_targeted
from trainmem.errors import UnsupportedError
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes

__all__ = [
    "INPUT_PROJECTIONS",
    "UP_OWN_TERMS",
    "check_lora_variant",
    "dora_embeddings_held_bytes",
    "dora_down_after_moment",
    "dora_down_dropout_output_bytes",
    "dora_down_moment_in_forward",
    "dora_first_layer_unsaved",
    "dora_forward_transient_bytes",
    "dora_layer_start_held_bytes",
    "dora_moments_per_linear",
    "dora_recompute_down_held_bytes",
    "dora_recompute_gradient_bytes",
    "dora_recomputed_down_splits",
    "dora_terms",
    "dora_up_combination_bytes",
    "qdora_dequantized_bytes",
]

DORA_VECTORS = 3
"""[out]-sized tensors DoRA saves per targeted linear: ``weight_norm``, ``mag_norm_scale``,
``mag_norm_scale - 1`` (Note [DoRA])."""


def check_lora_variant(training: TrainingConfig) -> None:
    """Refuse the variant settings the analytic formulas do not model.

    Raises:
        UnsupportedError: AdaLoRA, LoKr or LoHa (traced only), DoRA on ``lm_head`` or under tensor
            parallelism (Note [DoRA]).
    """
    if training.lora_variant in ("adalora", "lokr", "loha"):
        raise UnsupportedError(
            f"lora_variant {training.lora_variant} is not modelled by the formulas; use "
            "--engine generic, which runs peft's own code"
        )
    if training.lora_variant != "dora":
        return
    refused = [
        what
        for what, on in (
            ("on lm_head (its vocabulary-sized saved outputs)", "lm_head" in training.lora_targets),
            ("under tensor parallelism", training.tensor_parallel_size > 1),
        )
        if on
    ]
    if refused:
        raise UnsupportedError(
            f"DoRA {refused[0]} is not modelled by the formulas; use --engine generic, which "
            "runs peft's DoRA code"
        )


def dora_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int, adapter_bytes: int
) -> dict[str, int]:
    """Bytes DoRA saves per targeted linear of one layer beyond LoRA (Note [DoRA]).

    Args:
        model: the layer's shapes (:func:`~trainmem.analytic.params.adapted_linears`).
        training: ``lora_targets``, ``lora_dropout``, precision.
        t: tokens of the micro-batch on this rank.
        k_top: experts per token (the MLP linears of a mixture of experts run k_top times).
        adapter_bytes: bytes per element of the adapters' dtype
            (:func:`~trainmem.analytic.lora.lora_adapter_dtype`).

    Returns:
        ``{"dora/<linear>": bytes}``; empty unless ``lora_variant`` is ``dora``.
    """
    if training.lora_variant != "dora":
        return {}
    c, _ = compute_and_residual_bytes(training)
    lora_out = c if training.uses_autocast else adapter_bytes
    base_out = c if training.uses_autocast or training.lora_dropout == 0 else adapter_bytes
    targets = set(training.lora_targets)
    terms: dict[str, int] = {}
    for name, (fan_in, fan_out, n) in adapted_linears(model).items():
        targeted = lora_targeted(name, targets)
        if name == "router" or not targeted:
            continue
        active = k_top if name in ("gate_up", "gate", "up", "down") else 1
        size = (base_out + lora_out) * t * fan_out * active
        size += DORA_VECTORS * adapter_bytes * fan_out * n
        if training.lora_dropout > 0:  # the re-linear's weight (Note [DoRA])
            size += (c if training.uses_autocast else adapter_bytes) * fan_in * fan_out * n
        terms[f"dora/{name}"] = size
    return terms


def dora_first_layer_unsaved(
    training: TrainingConfig, *, fan_in: int, fan_out: int, n: int, adapter_bytes: int
) -> int:
    """Bytes of :func:`dora_terms`' term that a linear reading the first layer's input does not
    save there (its input needs no grad: Note [LoRA's first layer] in ``analytic/lora.py``):
    ``mag_norm_scale - 1`` [out] and, with dropout, the re-linear's weight (Note [DoRA])."""
    c, _ = compute_and_residual_bytes(training)
    size = adapter_bytes * fan_out * n
    if training.lora_dropout > 0:
        size += (c if training.uses_autocast else adapter_bytes) * fan_in * fan_out * n
    return size


def qdora_dequantized_bytes(training: TrainingConfig) -> tuple[int, int] | None:
    """Bytes per weight element of peft's dequantization of a bitsandbytes base for DoRA's
    norm (Note [QDoRA]): (the most alive while it runs, the result); None on an unquantized
    base.

    Note [QDoRA]
        DoRA over a bitsandbytes base (``LoraConfig(use_dora=True)`` on ``Linear4bit`` /
        ``Linear8bitLt``; GPTQ is refused by peft and by ``TrainingConfig``) runs the forward of
        Note [DoRA] with one change: ``weight = dequantize_module_weight(base_layer)`` (peft
        0.21.2 tuners/lora/dora.py ``DoraLinearLayer.forward``) returns a new tensor, not the
        parameter. peft utils/integrations.py ``dequantize_bnb_weight``: a 4-bit weight goes
        through bitsandbytes' ``dequantize_4bit`` (0.45.0 functional.py: ``out =
        torch.empty(quant_state.shape, dtype=quant_state.dtype)``; ``QuantState.dtype`` is the
        dtype the weight was quantized from, the compute dtype here as in ``MatMul4Bit``'s
        dequantization, fp16 for a Lightning weight), q = 2 bytes per element; an int8 weight
        through ``int8_vectorwise_dequant`` (``A * stats.view(-1, 1) * 7.874e-3``: an fp32
        product and its fp32 product with the constant, the first freed), 8 bytes while it runs
        and q = 4 after. ``weight.to(x.dtype)`` then casts it to the adapters' dtype a when
        q differs (the dequantized tensor freed on rebinding). Per targeted [out, in] linear of
        n elements, beside what the linear holds (Note [DoRA forward transients]) and the
        adapters' product cast to a (a n), the moments are: the dequantization (a n + its
        peak), the cast (2 a n + q n) and the norm, where ``lora_weight``, the weight in a
        (always a new tensor), ``scaling * lora_weight`` and their sum are alive (4 a n: one
        a n more than DoRA on a base stored in a, whose ``weight`` is the parameter itself).
        With ``lora_dropout`` the re-linear's saved weight is this new tensor (or autocast's
        16-bit cast of it), the bytes Note [DoRA] counts. The backward dequantizes nothing
        more (``weight_norm`` is detached; the base's own ``MatMul4Bit`` backward is Note
        [Traced quantized base]'s); under activation checkpointing the recompute repeats the
        forward's moments (:class:`~trainmem.analytic.transforms.dora.DoraWeightNorm`). Not
        modelled (none reaches the 4 a n moment): bitsandbytes' fp32 absmax of a
        double-quantized weight (n / 16 bytes beside the dequantization), peft's bnb wrapper's
        ``result.clone()`` (tuners/lora/bnb.py ``Linear4bit.forward``, as for LoRA) and
        ``update_layer``'s deep copy of the ``Linear4bit`` at peft's wrapping (before the
        step). Under autocast peft's bnb wrapper passes x uncast (``requires_conversion = not
        torch.is_autocast_enabled()``), where ``lora.Linear`` casts it to a: the same tensor
        when peft's k-bit preparation made the residual stream fp32 (the defaults); over a
        16-bit stream under autocast (``TrainingConfig.kbit_16bit_dense``) both engines keep
        ``lora.Linear``'s cast, as they do for LoRA over this base. Frameworks whose DoRA is
        not peft's (fsdp_qlora's ``BNBDORA``, torchtune's ``DoRALinear``, litgpt's none) are
        refused over any base by ``TrainingConfig`` (``_check_dora_framework``). Checked
        against the generic path, which runs peft's DoRA on the stand-in's dequantized weight
        (tests/analytic/test_qdora.py).
    """
    if training.lora_variant != "dora" or training.quantize_base == "none":
        return None
    if training.quantize_base == "int8":
        return 8, 4
    q = 2 if training.dequantizes_through_fp16 else dtype_bytes(training.compute_dtype)
    return q, q


NORM_READERS = frozenset({"qkv", "q", "k", "v", "q_a", "kv_a", "gate_up", "gate", "up"})
"""The linears of :func:`~trainmem.analytic.params.adapted_linears` whose input is a pre-norm
block's norm output (Note [DoRA's input at a norm's reader]).

Note [DoRA's input at a norm's reader]
    A linear that reads a norm's output (q / k / v, the MLP's gate / up) takes it in the
    residual stream's dtype r: transformers 5.24 modeling_llama.py ``LlamaRMSNorm.forward``
    returns ``self.weight * hidden_states.to(input_dtype)``, an fp32 product on an fp32 stream
    under autocast (``mul`` is on no autocast list). Autocast's 16-bit cast of it for the
    frozen base's matmul (c t in) is freed when that matmul returns (``mm`` saves ``self`` only
    for the weight's gradient: torch 2.13 derivatives.yaml), before peft's DoRA branch; peft's
    ``_cast_input_dtype(x, lora_A.weight.dtype)`` (peft 0.21.2 tuners/lora/layer.py
    ``Linear.forward``) returns x itself when the dtypes match (``Tensor.to``). So DoRA's
    moment holds the input as r t in, plus a t in only where a differs, not the c t in + a t in
    of a 16-bit input (o's, down's). Traced on the 1024-wide agreement Llama (2 x 256 tokens,
    DoRA r 16 on gate / up, selective checkpointing): at layer 1's recomputed up moment the
    trace holds the fp32 norm output (2,097,152 B) and no cast of it; the formulas held
    1,048,576 + 2,097,152 B (Note [The cached q and v outputs in the recompute] for the rest
    of that cell).
"""

INPUT_PROJECTIONS = frozenset({"qkv", "q", "k", "v", "q_a", "q_b", "kv_a", "kv_b"})
"""The linears of :func:`~trainmem.analytic.params.adapted_linears` that read the layer's
normed input before any of the attention's saved blocks exist (Note [Where DoRA's transients
sit])."""


O_LINEARS = frozenset({"o"})
"""The linear whose DoRA moment is at ``layer.o.forward`` / ``layer.o.recompute`` (Note [DoRA's
moment at each linear])."""
UP_LINEARS = frozenset({"gate", "up"})
"""The linears whose DoRA moment is at ``layer.mlp.up.forward`` / ``layer.mlp.up.recompute``:
the gate's moment comes first with fewer blocks made, the up's is the larger of the two (the
same shape, Note [DoRA's moment at each linear])."""


UP_OWN_TERMS = frozenset(
    {"lora/up", "dora/up", "lora/up_dropout", "lora/up_input_copy", "op_selective/mm/lora_A/up",
     "op_selective/mm/lora_B/up", "op_selective/mm/dora_base/up"}
)  # fmt: skip
"""The terms of up's own blocks, made between its DoRA norm and its output combination (Note
[DoRA's output combination])."""


def dora_up_combination_bytes(
    model: ModelSpec, training: TrainingConfig, *, adapter_bytes: int
) -> int:
    """What up's DoRA forward holds at its output combination beyond the layer's blocks made
    so far, up's own included (Note [DoRA's output combination]); 0 where up has no DoRA or
    the schedule keeps no moment at up (:func:`dora_moments_per_linear`).

    Note [DoRA's output combination]
        After the weight norm peft 0.21.2 tuners/lora/dora.py ``DoraLinearLayer.forward``
        runs ``lora_result = lora_B(lora_A(x))`` (with ``lora_dropout``, on ``x =
        dropout(x)``: tuners/lora/variants.py ``DoraLinearVariant.forward``), with dropout
        ``base_result = F.linear(x, weight)``, then ``result_dora = (mag_norm_scale - 1) *
        base_result + mag_norm_scale * lora_result * scaling``: ``mul`` and ``add`` are on no
        autocast list, so each product takes the magnitude's dtype a (torch type promotion
        over the 16-bit ``lora_result`` / ``base_result``), and at ``mag_norm_scale *
        lora_result * scaling`` the first product, the scaled one and ``(mag_norm_scale - 1)
        * base_result`` are alive, three a t out tensors (the first is saved by nothing:
        ``MulBackward0`` saves ``mag_norm_scale`` and ``lora_result``; ``MulBackward1`` with
        a number nothing), and at the sum its output replaces the first. Alive beside them:
        the linear's input and peft's casts (x, ``_cast_input_dtype``'s, the dropout output
        a t in), ``lora_weight`` (a in out, a local until the return: its graph keeps the
        eye's 16-bit cast, saved by ``lora_A``'s matmul, and ``lora_A(eye)``, saved by
        ``lora_B``'s), ``weight`` where it is a new tensor (a 16-bit base cast to a, or a
        dequantized one: a in out), the base output ``result`` where DoRA does not save it
        (with dropout; without, it is ``base_result``, a saved block), and every block made
        after the norm (``lora_A``'s input copy and output, ``lora_result``, the vectors, with
        dropout the re-linear's weight cast and output: :data:`UP_OWN_TERMS`). So the
        combination exceeds the norm's 4 a in out where t out is large beside in out, or
        with dropout. Traced on the 1024-wide agreement Llama (2 x 256 tokens, DoRA r 16 on
        gate / up with ``lora_dropout`` 0.1, full checkpointing): the step peaks at layer 1's
        recomputed up combination, 11,062,816 B above the formulas with the norm the only
        moment (+4.43 %; helper dora25's grid, session 25); now +0.001 %, each category
        too. With dropout the norm itself holds peft's dropout output (a t in, ``x =
        dropout(x)`` before DoRA's forward: :func:`dora_forward_transient_bytes` ``at_start``)
        beside the dropout's mask, made before o's / up's moment (``dropout_blocks``): on the
        2048-wide agreement Llama gate / up + dropout, none / full / selective, +1.18 / +1.12
        / +1.01 % before session 26, +0.14 / +0.00 / +0.00 % after. Modelled at up only (the gate's
        comes first with fewer blocks made, the same shape; o's, down's and q / k / v's
        combinations are not modelled: their norms set the peaks traced so far).
    """
    if training.lora_variant != "dora" or not dora_moments_per_linear(model, training):
        return 0
    if "up" not in training.lora_targets:
        return 0
    c, r_in = compute_and_residual_bytes(training)
    a = adapter_bytes
    autocast = training.uses_autocast
    e = c if autocast else a
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    fan_in, fan_out, _n = adapted_linears(model)["up"]
    n = fan_in * fan_out
    x_cast = a * t * fan_in if autocast and a > r_in else 0
    held = r_in * t * fan_in + x_cast + e * fan_in * fan_in + e * fan_in * training.lora_rank
    if training.lora_dropout > 0:
        held += a * t * fan_in + c * t * fan_out  # the dropout output; result, not saved
    weight_new = dtype_bytes(training.weight_dtype) != a or training.quantize_base != "none"
    held += a * n * (2 if weight_new else 1)  # lora_weight, and weight where new
    return held + 3 * a * t * fan_out


def dora_moments_per_linear(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether the schedule orders a layer's blocks by the linear that makes them, so each
    targeted linear's DoRA moment sits where it runs (Note [DoRA's moment at each linear]): DoRA
    on a dense gated MLP with separate gate / up / down linears and one o projection.

    Note [DoRA's moment at each linear]
        peft's DoRA builds its weight-sized temporaries (Note [DoRA forward transients]) inside
        each targeted linear's forward (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``:
        ``result = self.base_layer(x)``, then ``DoraLinearVariant.forward`` ->
        tuners/lora/dora.py ``DoraLinearLayer.forward``: ``get_lora_weight``, ``weight.to``,
        ``get_weight_norm``), so they sit beside what the layer has made up to that linear,
        in the forward and again in a checkpointed layer's recompute. The formulas put the
        moment of every linear but q / k / v at the layer's end (``layer.post_forward``,
        ``layer.backward``), beside every saved or recomputed block of the layer and, in the
        recompute, the frozen weights' 16-bit copies of the MLP: on the 1024-wide agreement
        Llama (2 x 256 tokens, r 16, full checkpointing) the trace's o moment in layer 1's
        recompute is 198.6 MB, its down moment (LoRA's) 210.7 MB, the formulas' o moment
        222.5 MB (-5.3 %). Here o's moment comes after the attention's blocks and the frozen
        q / k / v / o copies, o's base output held (``at_start``), before o's own saved
        blocks (``lora/o``, ``dora/o``) and the MLP's; gate's and up's after the MLP's input
        blocks, gate's own blocks, the gate's and the activation's outputs and the frozen
        gate / up copies, up's base output held, before up's own blocks, the MLP's last block
        (up's output, saved by the product) and down's copy. Down keeps its moments (Note
        [DoRA's moments in the recompute]). Other layouts (fused gate / up, experts, a
        non-gated MLP) keep every moment at the layer's end.
    """
    if training.lora_variant != "dora" or model.mlp_kind != "gated" or model.num_experts != 1:
        return False
    return {"o", "gate", "up", "down"} <= set(adapted_linears(model))


def dora_layer_start_held_bytes(
    model: ModelSpec, training: TrainingConfig, *, first_layer: bool, has_embedding: bool
) -> list[int]:
    """The tensors (bytes each) the forward holds at an input projection's DoRA moment that
    the layer's saved blocks, made after it, do not yet count (Note [Where DoRA's transients
    sit]): the layer's input and, in transformers' model code from the second layer on, the
    embeddings' output.

    Note [Where DoRA's transients sit]
        Each targeted linear builds DoRA's weight-sized tensors inside its own forward (Note
        [DoRA forward transients]), so they sit beside what exists at that linear, not at the
        layer's end. The input projections (:data:`INPUT_PROJECTIONS`: q / k / v and their
        fused or latent forms) run first: there the layer's saved blocks do not exist yet,
        only the previous layers', and the forward holds the layer's input (r t h: bound in
        the caller's loop; saved later by the first norm or the checkpoint, as a block the
        schedule makes after this point), the linear's base output (``result``, c t out,
        made before DoRA's branch: :func:`dora_forward_transient_bytes` ``at_start``) and,
        in transformers' model code, ``inputs_embeds`` (r t h, bound in ``LlamaModel.forward``
        for the whole loop, Note [Forward tensors held at the down projection]) from the
        second layer on, where LoRA's first layer does not save it (its input needs no grad,
        Note [LoRA's first layer]) and no checkpoint does. The other linears (o, the MLP's)
        keep the layer's end (``layer.post_forward``), where the largest, the down
        projection, runs with every saved block made. Traced on the agreement model
        (2-layer 2048-wide Llama, 2 x 256 tokens, DoRA on q / v): the generic path peaks at
        layer 1's q_proj norm, beside layer 0's blocks, layer 1's input, ``inputs_embeds``
        and q's base output; generic vs formulas with every DoRA moment at the layer's end,
        as before: -2.2 % unquantized, -10.4 % QDoRA nf4; now +0.02 % and -0.29 %
        (benchmarks/generic_options.py, set "qdora nf4").
    """
    if training.lora_variant != "dora":
        return []
    _, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    size = r * t * model.hidden_size // parallel_divisor("attention/norm", training)
    embeds = dora_embeddings_held_bytes(
        model, training, first_layer=first_layer, has_embedding=has_embedding
    )
    return [size, *embeds]


def dora_embeddings_held_bytes(
    model: ModelSpec, training: TrainingConfig, *, first_layer: bool, has_embedding: bool
) -> list[int]:
    """transformers' ``inputs_embeds`` (r t h), held by ``LlamaModel.forward`` through the
    layer loop and saved by no block from the second layer on without checkpointing (Note
    [Where DoRA's transients sit]), at each DoRA moment of that layer's forward: q / k / v's
    (:func:`dora_layer_start_held_bytes`), o's and gate / up's (Note [DoRA's moment at each
    linear]); [] where it is a saved block or not bound."""
    if training.lora_variant != "dora" or layer_is_checkpointed(training):
        return []
    if not (training.conventions.hf_model_code and has_embedding and not first_layer):
        return []
    _, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return [r * t * model.hidden_size // parallel_divisor("attention/norm", training)]


def dora_recompute_down_held_bytes(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    adapter_bytes: int,
    base_output_cached: bool = False,
) -> list[int]:
    """The tensors (bytes each) a full non-reentrant recompute holds beside DoRA's moment at
    the down projection, besides its recomputed blocks and what
    :func:`dora_forward_transient_bytes` counts (Note [DoRA's moments in the recompute]):
    down's base output (unless ``base_output_cached``: op-level selective checkpointing's
    cache holds it as a saved block of the layer, Note [The adapters' matmuls under op-level
    selective checkpointing] in analytic/op_selective.py) and, where the residual stream's
    dtype is not the compute dtype, the MLP's input. Empty where the moment is not down's or
    the recompute does not run there.

    Note [DoRA's moments in the recompute]
        Under full checkpointing the recompute runs each targeted linear's forward again, so
        DoRA's weight-sized tensors (Note [DoRA forward transients]) are made there once more,
        beside what the recompute holds at that linear, not beside the whole recomputed layer:
        q / k / v's at the recompute's start (``layer.pre_backward``, before any recomputed
        block: only the checkpoint's input and the incoming gradient), o's and gate / up's
        where they run (Note [DoRA's moment at each linear]), down's and any other linear's at
        ``layer.backward``. torch's non-reentrant checkpoint (torch/utils/checkpoint.py,
        ``_checkpoint_hook.unpack_hook``) recomputes up to the last tensor the layer saves, and
        DoRA on down saves after down's base matmul (peft 0.21.2 tuners/lora/dora.py
        ``DoraLinearLayer.forward``: ``mag_norm_scale``, ``lora_result``, ``base_result``), so
        down's DoRA moment runs with every recomputed block made and what the layer's code
        still references unsaved there: down's base output ``result`` (c t h, made before
        peft's ``DoraLinearVariant.forward`` adds the DoRA term; peft tuners/lora/variants.py)
        and the MLP's input (r t h, the second norm's output: gate / up save its 16-bit cast
        under autocast, not it). Traced on a 2-layer 1024-wide Llama (DoRA on all seven
        linears, 2 x 256 tokens, full checkpointing): the generic path peaks at layer 1's
        recomputed ``down_proj`` DoRA norm, 3,381,792 B above the formulas with the moment
        beside the recomputed blocks only (+1.12 %; nf4 +1.71 %); with these two tensors
        236,064 B (-0.08 %). With DoRA on q / v only the formulas put the q moment after the
        whole recomputed layer: -5.66 % (h1024) / -8.42 % (h2048) against the trace, the
        gap LoRA alone has once it sits at the recompute's start. Op-level selective
        checkpointing replays the layer the same way (its policy's saved outputs served
        from the cache: :func:`~trainmem.analytic.backward_transients.
        recompute_holds_down_copy`).
    """
    if not _dora_down_recomputed(training):
        return []
    c, r = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    h = model.hidden_size * t // parallel_divisor("mlp/input", training)
    out = ([] if base_output_cached else [c * h]) + ([r * h] if r != c else [])
    return out + dora_down_dropout_output_bytes(model, training, adapter_bytes=adapter_bytes)


def dora_down_dropout_output_bytes(
    model: ModelSpec, training: TrainingConfig, *, adapter_bytes: int
) -> list[int]:
    """peft's dropout output on down's input, alive at down's DoRA moment (``x = dropout(x)``
    in tuners/lora/variants.py ``DoraLinearVariant.forward``, before the norm: Note [What
    down's DoRA moment precedes]): [a t i] with ``lora_dropout``, [] without."""
    if training.lora_dropout == 0:
        return []
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    return [adapter_bytes * model.intermediate_size * t // parallel_divisor("mlp/gated", training)]


def dora_down_moment_in_forward(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether the forward's DoRA moment at the down projection sits at its base matmul,
    before down's own saved blocks (Note [DoRA's down moment in the forward]): DoRA on down
    under :func:`dora_moments_per_linear`, without checkpointing and without
    ``lora_dropout``.

    Note [DoRA's down moment in the forward]
        peft 0.21.2 tuners/lora/layer.py ``Linear.forward`` runs ``result =
        self.base_layer(x)``, casts x to the adapters' dtype (``_cast_input_dtype``), then
        tuners/lora/variants.py ``DoraLinearVariant.forward`` passes ``base_result=result``
        (no dropout) to tuners/lora/dora.py ``DoraLinearLayer.forward``, whose weight norm
        (``get_lora_weight``, ``weight.to``, ``get_weight_norm``) runs before ``lora_result =
        lora_B(lora_A(x))``. So at down's norm in the forward the layer holds every block made
        before down, down's base output (``base_result``, saved later by ``(mag_norm_scale -
        1) * base_result``: a saved block, made first) and what the decoder layer's code
        still references (the MLP's input; transformers' ``inputs_embeds`` from the second
        layer on: Note [Forward tensors held at the down projection]); ``lora_A``'s 16-bit
        copy of its input, its output (``lora/down``) and DoRA's other saved tensors
        (``lora_result``, ``mag_norm_scale``, ``mag_norm_scale - 1``) come after, as in the
        recompute (Note [What down's DoRA moment precedes]). Where the base matmul saves its
        input (bitsandbytes' int8 ``MatMul8bitLt``, the stand-in's ``ctx.save_for_backward(
        cast)``: the input itself when already in the compute dtype), ``mlp/down_input`` is
        that saved input, made before the moment and not counted again among the moment's
        transients (``lora/down_input_copy`` is ``lora_A``'s copy, after). Traced on the
        1024-wide Llama of tests/models/lora_variants (2 x 256 tokens, DoRA r 16 on all seven
        linears, no checkpointing; the step peaks at layer 1's down norm in the forward):
        with the moment at the layer's end the formulas held these blocks as activations
        (3,960,832 B over the trace) and the MLP's input and ``inputs_embeds`` not at all
        (4,194,304 B under), and over an int8 base counted down's saved input twice
        (2,883,584 B): generic / formulas - 1 +0.15 % (nf4, none), -1.01 % (int8); by
        category activations -3.97 MB, temporaries +4.29 / +1.41 MB. Now within 0.1 MB
        each (tests/analytic/test_dora_forward_down_moment.py). With ``lora_dropout`` the
        base result is DoRA's re-linear on the dropout output, made after the norm; that
        case keeps the layer's end, as do a run without autocast (``lora_A`` then saves peft's
        cast itself, made before the norm) and the other linears that save their input
        (DeepSpeed ZeRO-3's, float8's), not checked against a trace.
    """
    return (
        dora_moments_per_linear(model, training)
        and "down" in training.lora_targets
        and training.activation_checkpointing == "none"
        and training.uses_autocast
        and not training.zero3_linear_saves_input
        and not float8_linears_save_input(model, training)
    )


def dora_down_after_moment(training: TrainingConfig) -> frozenset[str]:
    """The terms of a layer with DoRA on its down projection made after down's DoRA moment
    (Note [What down's DoRA moment precedes]): ``lora_A``'s 16-bit copy of down's input is
    ``mlp/down_input`` where the base matmul saves no input, ``lora/down_input_copy`` where
    it saves its own (then ``mlp/down_input``, made before: Note [DoRA's down moment in the
    forward])."""
    if training.quantized_matmul_saves_input:
        return frozenset({"lora/down", "dora/down", "lora/down_input_copy"})
    return frozenset({"lora/down", "dora/down", "mlp/down_input"})


def dora_recomputed_down_splits(model: ModelSpec, training: TrainingConfig) -> bool:
    """Whether the recompute's down DoRA moment sits between down's base output and DoRA's
    other saved tensors (Note [DoRA's base output in the recompute]): DoRA on down recomputed
    under :func:`dora_moments_per_linear`, without ``lora_dropout``.

    Note [DoRA's base output in the recompute]
        Without ``lora_dropout`` DoRA's ``base_result`` is down's base output ``result``
        (peft 0.21.2 tuners/lora/variants.py ``DoraLinearVariant.forward``), made before the
        weight norm and saved after it by ``(mag_norm_scale - 1) * base_result``
        (tuners/lora/dora.py ``DoraLinearLayer.forward``): at down's moment in a
        non-reentrant recompute it is alive, and it is the ``base_result`` share of
        ``dora/down``, the block the recompute makes (Note [What down's DoRA moment
        precedes]). The formulas held it at the moment as one more temporary (c t h,
        :func:`dora_recompute_down_held_bytes`) and made the whole ``dora/down`` after; the
        trace's block is the one saved tensor, an activation from its making: the same bytes,
        c t h more activations and less temporaries in the trace (1,048,576 B on the 1024-wide
        agreement Llama, DoRA r 16 on down or all seven linears, full checkpointing). Now
        ``dora/down`` is split as in the forward (Note [DoRA's down moment in the forward]):
        its base output a recomputed block made before the moment, the rest after, and the
        held list leaves it out. Where op-level selective checkpointing caches down's base
        output the cached block is that tensor already (``base_output_cached``).
    """
    return (
        _dora_down_recomputed(training)
        and dora_moments_per_linear(model, training)
        and training.lora_dropout == 0
    )


def _dora_down_recomputed(training: TrainingConfig) -> bool:
    """DoRA on the down projection of a layer whose backward runs a non-reentrant recompute in
    transformers' model code (Note [DoRA's moments in the recompute])."""
    return (
        training.lora_variant == "dora"
        and "down" in training.lora_targets
        and training.activation_checkpointing in ("full", "selective")
        and training.conventions.hf_model_code
        and not layer_checkpoint_reentrant(training)
    )


def dora_recompute_gradient_bytes(
    model: ModelSpec, training: TrainingConfig, *, adapter_bytes: int
) -> list[int]:
    """The tensors (bytes each) the layer's backward makes from its output gradient before a
    non-reentrant recompute of a layer with DoRA on its down projection, alive through the
    whole recompute (Note [DoRA's output gradient before the recompute]); [] where
    :func:`dora_recompute_down_held_bytes` is.

    Note [DoRA's output gradient before the recompute]
        peft's DoRA on a linear returns ``(result + result_dora).to(torch_result_dtype)``
        (peft 0.21.2 tuners/lora/variants.py ``DoraLinearVariant.forward``: ``result =
        result + module.lora_magnitude_vector[active_adapter](...)``; tuners/lora/layer.py
        ``Linear.forward``: ``result = result.to(torch_result_dtype)``), with
        ``result_dora = (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result *
        scaling`` (tuners/lora/dora.py ``DoraLinearLayer.forward``) in the magnitude's dtype,
        the adapters' a. Down's output gradient (c t h) therefore goes, before any node that
        reads a saved tensor, through ``ToCopyBackward0`` (its cast to a: a t h), the sum's
        ``AddBackward0`` (the gradient of ``result`` cast back to c: c t h; DoRA's share is
        the a tensor itself) and the product with the number ``scaling`` (``MulBackward1``,
        which saves nothing: a t h); the next node, ``mag_norm_scale * lora_result``'s
        ``MulBackward0``, unpacks its saved tensors, and that unpack runs torch's
        non-reentrant recompute (torch 2.13 utils/checkpoint.py ``_checkpoint_hook``). So the
        three are alive at every DoRA moment of the recompute, down's included; with a = c
        the casts return their input and only the product is new. Traced on the 1024-wide
        agreement Llama (2 x 256 tokens, DoRA r 16 on down, selective and full
        checkpointing): 2,097,152 + 1,048,576 + 2,097,152 B made in layer 1's backward
        before its recompute replays the first norm, alive at down's DoRA moment (the step's
        peak). Reentrant, the recompute runs before the layer's backward: none.
    """
    if not _dora_down_recomputed(training):
        return []
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    h = model.hidden_size * t // parallel_divisor("mlp/input", training)
    a = adapter_bytes
    return [a * h, c * h, a * h] if a != c else [c * h]


def dora_forward_transient_bytes(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    adapter_bytes: int,
    linears: frozenset[str] | None = None,
    exclude: frozenset[str] = frozenset(),
    at_start: bool = False,
    input_held: bool = False,
) -> int:
    """The most one targeted linear's DoRA forward holds at once beyond what it saves (Note
    [DoRA forward transients]), bytes; 0 without DoRA. ``linears``: only those (all by
    default); ``exclude``: not those; ``at_start``: before the layer's saved blocks exist, so
    with the linear's base output (c t out), a block of the layer's saved set after (Note
    [Where DoRA's transients sit]); ``input_held``: the linear's input is counted where the
    moment sits (a saved block, or what the schedule holds there: Note [DoRA's down moment in
    the forward]), so not here.

    Note [DoRA forward transients]
        ``DoraLinearLayer.get_lora_weight`` (peft tuners/lora/dora.py) builds the adapters'
        product by running them on ``torch.eye(in)`` (the adapters' dtype a): under autocast
        the eye's 16-bit cast is saved by ``lora_A``'s matmul while ``lora_weight`` lives, and
        at ``lora_B``'s matmul the fp32 eye, its cast, ``lora_A``'s [in, r] output and the
        [in, out] product are alive together; ``forward`` then casts the product to x's dtype
        (a), casts the base weight to it when its dtype differs, and ``get_weight_norm`` makes
        ``scaling * lora_weight`` and the sum: three (four with the weight's cast) a-byte
        [out, in] tensors beside the eye's cast. All the while the linear's input (c x t x in
        where it is a 16-bit tensor: the frozen base saves none of it; a norm's output in the
        residual dtype, Note [DoRA's input at a norm's reader]) and peft's cast of it to the
        adapters' dtype (``_cast_input_dtype``, a x t x in; saved, so not counted here, when no
        autocast follows; none where the input has that dtype) are alive. The larger of the
        two moments, over the targeted linears. Checked
        against the live tensors of peft 0.21's forward on CPU under autocast (a 2816 -> 1024
        linear, r 16, 512 tokens: eye fp32 31.7 MB, its cast 15.9 MB, the product 5.8 MB, the
        input cast 5.8 MB, the input 2.9 MB at ``lora_B``'s mm) and the generic path's peak in
        ``down_proj.lora_B`` (tests/analytic/test_dora.py).
    """
    if training.lora_variant != "dora":
        return 0
    c, r_in = compute_and_residual_bytes(training)
    a = adapter_bytes
    autocast = training.uses_autocast
    e = c if autocast else a  # the eye as lora_A's matmul saves it
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    r = training.lora_rank
    weight_cast = dtype_bytes(training.weight_dtype) != a
    dequantized = qdora_dequantized_bytes(training)
    targets = set(training.lora_targets)
    most = 0
    for name, (fan_in, fan_out, _n) in adapted_linears(model).items():
        targeted = lora_targeted(name, targets)
        if name == "router" or not targeted or name in exclude:
            continue
        if linears is not None and name not in linears:
            continue
        # Note [DoRA's input at a norm's reader]: the input in its own dtype
        x = r_in if name in NORM_READERS else c
        own = 0 if input_held else x  # Note [DoRA's down moment in the forward]
        # at the start also the saved cast without autocast: a block made after this point
        x_cast = a * t * fan_in if (autocast or at_start) and a > x else 0
        # the linear's own input (a frozen base saves none of it; the adapters read the cast)
        held = own * t * fan_in + x_cast + e * fan_in * fan_in + e * fan_in * r
        if at_start:
            held += c * t * fan_out
            if training.lora_dropout > 0:  # x = dropout(x) before DoRA's forward (a t in)
                held += a * t * fan_in
        at_product = held + (a * fan_in * fan_in if autocast else 0) + e * fan_in * fan_out
        if dequantized is None:
            at_norm = held + (3 + int(weight_cast)) * a * fan_in * fan_out
        else:  # Note [QDoRA]: the weight is always a new tensor
            made, kept = dequantized
            at_dequant = held + (a + made) * fan_in * fan_out
            at_cast = held + (2 * a + kept) * fan_in * fan_out if kept != a else 0
            at_norm = max(at_dequant, at_cast, held + 4 * a * fan_in * fan_out)
        most = max(most, at_product, at_norm)
    return most
