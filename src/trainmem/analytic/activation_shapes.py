"""The sizes every activation rule starts from: the bytes of the compute dtype and of the
residual stream (c, r), the tokens per sequence the layers and the head see, and the mean block
of a model with blocks of several kinds. Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from collections.abc import Callable

from trainmem.memo import cached_on
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


# what compute_dtype, uses_autocast, kbit_fp32_upcast, kbit_16bit_dense, kbit_fp32_activations read
@cached_on(
    "precision",
    "framework",
    "quantize_base",
    "prepare_kbit_training",
    "bitsandbytes_version",
    "load_dtype",
)
def compute_and_residual_bytes(training: TrainingConfig) -> tuple[int, int]:
    """(c, r): bytes of the compute dtype and of the residual stream (cached on the fields they
    follow from: every activation term asks, about twenty times a configuration).

    See Note [Activation terms] (trainmem/analytic/activations.py)."""
    # peft's upcast without autocast: the quantized linears return fp32, every activation too
    c = 4 if training.kbit_fp32_activations else dtype_bytes(training.compute_dtype)
    # the residual stream is fp32 under autocast (fp32 embedding and norms), and after peft's
    # prepare_model_for_kbit_training; a quantized base kept in 16 bits under autocast
    # (TrainingConfig.kbit_16bit_dense) has a 16-bit embedding and norms: c
    # (TrainingConfig.kbit_16bit_dense), as does a model loaded in 16 bits
    # (TrainingConfig.autocast_over_loaded_16bit)
    fp32 = (training.uses_autocast and not _dense_16bit(training)) or training.kbit_fp32_upcast
    r = 4 if fp32 else c
    return c, r


def autocast_fp32_layer_norms(model: ModelSpec, training: TrainingConfig) -> bool:
    """The LayerNorms run in fp32 under autocast over 16-bit weights.

    Note [Autocast over 16-bit weights]
        ``--framework accelerate-fsdp`` under ``*-mixed`` runs the forward under accelerate's
        ``native_amp`` autocast (accelerator.py ``prepare_model``, before the FSDP1 wrap) over
        weights FSDP1's ``MixedPrecision`` gathers in 16 bits
        (``TrainingConfig.autocast_over_16bit_weights``). The matmuls find their operands in
        the compute dtype already (``cached_cast`` casts only another dtype: no weight
        copies, a 16-bit residual stream), but ops on CUDA autocast's fp32 list do not:
        ``layer_norm`` casts its 16-bit input to fp32 and saves that cast (4 B a value, and
        one per norm where two norms read one input, GPT-NeoX's parallel block) and returns
        fp32, so every linear that reads the norm's output casts and saves its own 16-bit
        copy (q, k and v, the MLP's input, the LM head's), as under autocast over fp32
        weights (:func:`autocast_casts_layer_inputs`); ``pow`` in a written-out tanh GELU
        (``NewGELUActivation``) turns the formula's chain fp32 as there too
        (:func:`~trainmem.analytic.mlp.activation_fn_saved_bytes`). transformers' RMSNorm
        computes in fp32 itself and returns ``weight * hidden_states.to(input_dtype)``: 16
        bits, nothing changes. Source: aten/src/ATen/autocast_mode.cpp (CUDA's fp32 list:
        ``layer_norm``, ``pow``, ``softmax``; ``cached_cast``). Seen in the trace, which runs
        accelerate's autocast over FSDP1 (trainmem/trace/fsdp.py ``accelerate_native_amp``):
        the saved bytes per module of tiny phi, GPT-NeoX and Falcon, bf16-mixed against
        bf16-true (session notes, helper fp32out). The same holds for a model the user loaded
        in 16 bits under torch's autocast (``load_dtype``: ``from_pretrained(torch_dtype=
        torch.bfloat16)`` with ``TrainingArguments(bf16=True)``; ``TrainingConfig.
        autocast_over_loaded_16bit``), whose trace loads the model in that dtype.
    """
    return training.autocast_over_16bit_weights and model.norm_kind == "layernorm"


def autocast_casts_layer_inputs(training: TrainingConfig, model: ModelSpec | None = None) -> bool:
    """Autocast casts a layer's input to 16 bits at every linear that reads it (q, k and v;
    gate and up): under autocast, unless the input already is in the compute dtype, as the
    norms' output of a quantized base kept in 16 bits is (:attr:`~trainmem.specs.training.
    TrainingConfig.kbit_16bit_dense`; transformers' RMSNorm returns ``weight *
    hidden_states.to(input_dtype)``), which ``cached_cast`` leaves as it is (aten/src/ATen/
    autocast_mode.cpp: it casts only another dtype), so every linear saves that one tensor.
    Traced on the generic path (a 1024-wide Qwen2, int8 base without peft's upcast). Over
    16-bit weights, where a LayerNorm returns fp32 (``model`` given:
    :func:`autocast_fp32_layer_norms`), and over a quantized base whose norms stay in the
    other 16-bit dtype (``TrainingConfig.kbit_dense_cast``: fp16 under bf16 autocast; Note [A
    quantized base's other weights in another 16-bit dtype])."""
    if model is not None and autocast_fp32_layer_norms(model, training):
        return True
    if training.kbit_dense_cast:  # fp16 norms' output under bf16 autocast: cast per linear
        return training.uses_autocast
    return training.uses_autocast and not _dense_16bit(training)


def _dense_16bit(training: TrainingConfig) -> bool:
    """Autocast runs over 16-bit embeddings, norms and linears: a quantized base kept in 16
    bits (``kbit_16bit_dense``) or a model loaded in 16 bits (``autocast_over_loaded_16bit``)."""
    return training.kbit_16bit_dense or training.autocast_over_loaded_16bit


def cast_copies(n: int, training: TrainingConfig) -> int:
    """How many tensors ``n`` casts of one tensor to one dtype make: ``n`` eager (autocast
    casts a non-leaf tensor at every op that reads it, peft casts each targeted linear's input
    itself), one under torch.compile (Note [Compiled casts are computed once]).

    Note [Compiled casts are computed once]
        AOTAutograd runs common-subexpression elimination on the joint graph before the
        min-cut partition (torch/_functorch/partitioners.py
        ``min_cut_rematerialization_partition``: ``if config.cse: fx_graph_cse(fx_g)``;
        ``cse = True`` in torch/_functorch/config.py), so the ``_to_copy`` nodes that autocast
        (q, k and v, gate and up, each casting the norm's output) or peft (``x.to(
        lora_A.weight.dtype)`` in every targeted linear) put on the same input become one node
        and one saved tensor. Traced (the generic path's AOTAutograd, trainmem.trace.compile) on
        a 6-layer 1024-wide Qwen2 at 4 x 1,024 tokens: one bf16 copy of each norm's output
        under bf16-mixed, one fp32 copy of the attention norm's output for peft's q and v
        adapters under bf16-true.
    """
    return min(n, 1) if training.compile else n


def tokens_per_sequence(model: ModelSpec, training: TrainingConfig) -> int:
    """Sequence length the layers see: ``seq_len``; patches (+ 1 for [CLS], none in SigLIP) for a
    vision encoder, of its config's ``image_size`` or of ``--resolution`` (H // p) x (W // p)
    (the patch convolution's stride-p output, ``ViTPatchEmbeddings`` / ``Dinov2PatchEmbeddings``
    ``Conv2d(kernel=p, stride=p)``; the position table stays the config's and is interpolated
    to the grid: Note [Vision encoders at another resolution]); the target length for a T5
    decoder block (``cross_attention``) and for the LM head of an encoder-decoder
    (:attr:`TrainingConfig.decoder_seq_len`).

    Note [Vision encoders at another resolution]
        ``--resolution`` on a vision encoder is the size of the images it trains at, the
        config (a checkpoint's) unchanged: the patch grid is (H // p) x (W // p) (transformers
        5.24 ``ViTPatchEmbeddings`` / ``Dinov2PatchEmbeddings``: ``Conv2d(kernel_size=p,
        stride=p)``), and the position table keeps the config's size and is interpolated to
        the grid in every forward (``ViTEmbeddings.interpolate_pos_encoding``, CLIP's and
        SigLIP's, with ``interpolate_pos_encoding=True``, which the generic path passes when
        the forward takes it; DINOv2's ``Dinov2Embeddings`` always interpolates). The
        interpolated [1, n, h] table is not counted (n h 4 B: 3 MB for ViT-L at 384 px).
        Checked: the generic path's trace of tiny ViT / DINOv2 configs at 48x64 / 32x48 px
        within 1 % of these formulas (tests/trace/test_vision_resolution.py); ViT-L/16,
        DINOv2-L, CLIP-L and SigLIP so400m at 224 and 384x512 px within 0.6 %.
    """
    if model.architecture == "vision-encoder":
        size = training.image_size
        if size is None or not model.patch_size:
            return model.num_patches + int(model.class_token)
        p = model.patch_size
        return (size[0] // p) * (size[1] // p) + int(model.class_token)
    if model.cross_attention:
        return training.decoder_seq_len
    # p-tuning / prompt tuning: peft prepends its p prompts to the input embeddings (Note
    # [Prompt learning in the formulas] in trainmem/analytic/prompt_encoder.py)
    return training.seq_len + training.prepended_tokens


def output_tokens(model: ModelSpec, training: TrainingConfig) -> int:
    """Tokens per sequence the head and the loss see: the decoder's for an encoder-decoder."""
    if model.architecture == "encoder-decoder":
        return training.decoder_seq_len
    return tokens_per_sequence(model, training)


def mean_terms(
    model: ModelSpec, fn: Callable[[ModelSpec], dict[str, int]]
) -> dict[str, int] | None:
    """``fn`` of a mean block when the model has blocks of several kinds
    (:meth:`ModelSpec.layer_kinds`): every term weighted by the share of blocks of each kind,
    so the sum over all blocks is exact to a byte per term and block; None for a
    homogeneous model. The schedule holds identical layers, so DeepSeek-V3's dense and MoE
    blocks and T5's encoder and decoder blocks are each held as that mean."""
    kinds = model.layer_kinds()
    if len(kinds) == 1:
        return None
    total = model.num_blocks
    out: dict[str, int] = {}
    for count, block in kinds:
        for key, value in fn(block).items():
            out[key] = out.get(key, 0) + value * count
    return {k: -(-v // total) for k, v in out.items()}


def frozen_embeddings(training: TrainingConfig) -> bool:
    """Whether the embeddings' outputs need no gradient: LoRA freezes every embedding, and
    without the input-grad hook (``TrainingConfig.input_embeddings_require_grad``) nothing
    after them does until the first adapter, so an embedding dropout saves no mask and a
    lookup no indices (torch records an op only for inputs that need a gradient: torch 2.13
    torchgen/packaged/autograd/gen_variable_type.py, Note [LoRA's first layer] in
    :mod:`trainmem.analytic.lora`; traced on T5: no dropout mask after either stack's
    embeddings, no relative-position buckets). Not with a trained copy of the token embedding
    (``lora_modules_to_save``, Note [peft modules_to_save]): its output requires grad."""
    return not training.trains_embedding and not training.input_embeddings_require_grad
