"""A transformers release other than the installed one on a traced step (issue 26): the
installed model code is traced and the differences the formulas know between the two releases
are applied to its step as transforms, each with the formula's own rule.

Note [An older transformers release on a traced step]
    The traced paths run the installed transformers' model code; ``--transformers-version``
    asks for another release. What changes between releases for the families whose model code
    was read release by release (:data:`KNOWN_FAMILIES`: Llama and Mistral from 4.38 on, Qwen2
    and Gemma from 4.40, Phi-3 from 4.41, its first) is what the analytic engine's rules say,
    each keyed by its own release table (Phi-3 before 4.45 has no SDPA: eager attention by
    default, ``ModelSpec.has_sdpa``):

    * each decoder layer's own rotary cos / sin tables, buffers kept for the run
      (``ModelSpec.layer_rope_cache_values``, :data:`~trainmem.specs.model.
      LAYER_ROPE_CACHE_UNTIL`; sized by :func:`~trainmem.analytic.buffers.
      layer_rope_cache_bytes`): allocated with the state the step starts from, one per layer;
    * the loss's shifted copy of the fp32 logits before 4.49 (:func:`~trainmem.analytic.loss.
      shifted_logits_bytes`): allocated after the loss's fp32 upcast of each micro-batch's
      logits (the last forward allocation of that size outside the layers), freed when the
      forward ends (``clone`` saves nothing);
    * the 16-bit logits freed at the model's own ``logits = logits.float()`` (Llama before
      4.46, Mistral before 4.48: :func:`~trainmem.analytic.loss.model_upcast_logits_bytes`,
      Note [The upcast 16-bit logits]) in the plain loop: the free of the traced release's
      lm_head output (held by the output until the loss returns) moved to just after the
      loss's fp32 upcast;
    * the training KV cache's fp32 copies of the rotated keys, which the installed release
      holds from each layer's attention until the forward ends and a release that rotates in
      the values' 16-bit dtype does not (Llama before 4.43, Mistral before 4.48:
      :func:`~trainmem.analytic.attention.forward_kv_cache_bytes`, Note [The rotated keys'
      dtype by release]): each layer's forward allocation of that size freed after the last
      layer is dropped;
    * transformers' gradient-checkpointing default, reentrant from 4.37 until 5.0
      (``TrainingConfig.hf_checkpoint_reentrant``): the installed code is traced with the
      requested release's ``use_reentrant`` set explicitly, so the trace runs it for real;
    * ``repeat_kv``'s copies of grouped keys and values, which SDPA saves before 4.54
      (Note [repeat_kv under SDPA on a traced step]), with the training KV cache or without it
      (full checkpointing, ``use_cache`` off).

    The rules the transforms do not reproduce are refused (:func:`release_refusals`) where they
    differ between the two releases for the run: a 4.x release's training KV cache under eager
    attention (4.42.0 cache_utils.py ``DynamicCache.update`` appends the tensors themselves,
    which keeps each layer's rotated 16-bit keys and, through the values' view, the projection
    output they were sliced from, Phi-3's whole fused ``qkv_proj`` output; eager attention
    saves copies of neither: a real 4.42.0 trace of tests/models/phi3.json, 4 x 128 bf16-mixed,
    is 1.75 % above the transformed step; under SDPA the cache's tensors are the ones SDPA
    saves), ``repeat_kv``'s copies under op-level
    selective checkpointing without the cache (the Note), the fp32 logits a loop holds before
    4.46 / 4.48 (``ModelSpec.returns_fp32_logits`` under ``--loop step`` / ``previous``), the
    weights' load dtype, the FSDP1 checkpoint placement before 4.52; so is a
    family whose releases were not read, a release before 4.38 or after the installed one.

    Checked against a real trace of transformers 4.40.0 (torch 2.13.0 CPU, peft 0.10.0, a
    throwaway venv, the generic path of this package on its installed 4.40.0:
    benchmarks/transformers_release_trace.py) on the agreement Llama (tests/models/agreement/
    llama_h1024.json, bf16-mixed, AdamW): 1 x 128 tokens and 4 x 512 under full checkpointing,
    the transformed step's peak equals the real one to the byte (702,913,024 and 702,943,744
    B: the rotary buffers, 4 MiB). Where the peak is at the loss, 4 x 512 tokens without
    checkpointing: 855,609,944 B against the real 855,527,960 (+0.01 %; +3.9 % before the
    logits and keys rules), LoRA r8: 474,927,704 against 474,845,720 (+0.02 %; +7.1 %
    before); the formulas 855,576,576 and 474,861,568.

Note [repeat_kv under SDPA on a traced step]
    Before 4.54 transformers' SDPA path repeats grouped keys and values to every query head
    (4.40.0 modeling_llama.py ``LlamaSdpaAttention.forward``: ``key_states = repeat_kv(
    key_states, self.num_key_value_groups)``, the same for the values, an ``expand`` then a
    ``reshape``: a copy) and SDPA saves the copies, c x heads x head_dim per token each, until
    the layer's backward; the installed release hands the kernel the cache's own tensors (the
    16-bit cast of its fp32 keys, its values' copy: c x kv_heads x head_dim each, saved the same
    way). The originals 4.40's cache keeps (16-bit keys and values, 4.x's ``DynamicCache.update``
    appends them) until the forward ends weigh what the installed release's cache keeps (fp32
    keys) under autocast, so :func:`~trainmem.analytic.attention.forward_kv_cache_bytes` differs
    by nothing there. Without the cache (full checkpointing, ``use_cache`` off) the installed
    release hands SDPA ``v_proj``'s output viewed into heads (allocated in the layer's
    ``self_attn.v_proj``) and the keys' 16-bit cast (the rotated keys themselves without
    autocast), which it saves; in the recompute under full checkpointing (the reentrant
    forward saves nothing). The transform resizes each layer's two saved tensors (the attention
    module's and its ``v_proj``'s activations of the keys' size) to the repeated size.

    One kv head (multi-query: Gemma 2B, the formula Gemma) is repeated without a copy:
    ``repeat_kv``'s ``hidden_states[:, :, None, :, :].expand(...).reshape(batch, heads, ...)``
    merges a size-1 dim with the stride-0 one, a view (torch ``reshape`` copies only where no
    view exists), so SDPA saves views of the kv-size tensors: no transform (a real 4.40.0 trace
    of the formula Gemma, 1 of 4 kv heads, saves ``v_proj``'s output and the rotated keys at kv
    size and no copy; the formulas read the same rule: Note [repeat_kv of one kv head is a
    view] in trainmem/analytic/attention.py).

    Not modelled: the backward's gradients of the repeated tensors before ``repeat_kv``'s
    backward sums them (c x heads x head_dim each, transients of the layer's backward);
    without the cache, 4.40's transients of kv size before the copies (the rotated keys,
    ``v_proj``'s output, freed at the ``repeat_kv``). Refused: op-level selective checkpointing
    without the cache, whose policy caches ``v_proj``'s output from the forward at kv size
    (4.40 repeats it in the recompute): resized there, it held c x (heads - kv_heads) x
    head_dim per token and layer too many until each layer's recompute (real 4.40.0 trace, 4 x
    512: 643,424,792 B; resized 650,060,376, +1.0 %; the formulas +0.05 %); a transform would
    add the copy at the recompute instead.

    Checked against real 4.40.0 traces of the agreement Llama with 2 of 8 kv heads, bf16-mixed
    AdamW: 4 x 256 equal to the byte (640,012,800 B), 4 x 512 815,764,056 against 815,682,072
    (+0.01 %; -1.5 % without the transform), LoRA r8 463,221,336 against 463,139,352 (+0.02 %);
    full checkpointing 4 x 512 640,610,848 against 640,348,704 (+0.04 %; -0.05 % without it:
    the peak is outside the layers' recompute), the formulas 640,606,208.

Note [A transformers release on a model it does not build]
    ``--transformers-version`` names the release whose model code runs. A timm model's step
    runs timm's modules (``trainmem.trace.timm_model``), a diffusers denoiser's runs diffusers'
    (``trainmem.trace.diffusers_model``: the prompt embeddings and latents inputs), and the
    optimizer, loss and loop around them are torch's; no rule the formulas key by the
    transformers release (the tables of trainmem/specs/model.py, the loss's shift before 4.49,
    the checkpointing default, which only ``PreTrainedModel.gradient_checkpointing_enable``
    reads) reaches them, so the installed release is traced and the note says the version does
    not apply (:func:`release_not_applied`), where it was refused before. A diffusers run whose
    step runs transformers' CLIP / T5 text encoders (``train_text_encoder``, ``frozen_on_gpu``
    text-encoders / all: Note [The frozen text encoders encode inside the step]) is refused:
    those families' releases were not read. Remote-code models (Qwen-1, ChatGLM, Baichuan) run
    the Hub's modeling file, whose loss and cache are its own in every release
    (:data:`~trainmem.specs.model.REMOTE_CODE_OWN_LOSS`), but whose checkpointing goes through
    transformers' ``gradient_checkpointing_enable`` or its own ``torch.utils.checkpoint`` calls
    by file: refused (not read release by release).

Note [An older litgpt release on a traced step]
    ``--framework litgpt`` traces the installed litgpt's own GPT. The formulas know one rule
    keyed by the litgpt release on the paths the trace runs (one GPU, DDP): RMSNorm's fp32
    weight multiply from 0.4.6 (:func:`~trainmem.analytic.norms.litgpt_norm_weight_in_fp32`;
    the per-Linear FSDP units of 0.5.8 need Fabric's FSDP, which the traced paths refuse). A
    requested release on the same side of every rule as the installed one is traced as the
    installed release (the note says so). One across it (0.4.0 against 0.5.13) is traced with
    that release's RMSNorm: every ``RMSNorm`` of the built GPT runs litgpt 0.4.0's forward
    (litgpt/model.py v0.4.0: ``x_normed.to(dtype=dtype)``, then ``x_normed * self.weight``;
    ``trace/litgpt_model._rms_norm_cast_first``), so a trained norm saves its 16-bit copy
    where 0.4.6 on saves the fp32 normalised tensor and ``weight.float()``. The rest of the
    model code is the installed release's. A release newer than the installed is refused.

Source: transformers 4.40.0 models/llama/modeling_llama.py (``LlamaRotaryEmbedding``,
``LlamaSdpaAttention.forward``, ``LlamaForCausalLM.forward``), 4.40.0 cache_utils.py
``DynamicCache.update``, 5.24 loss/loss_utils.py ``ForCausalLMLoss``; the release tables cited
where they are defined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.attention import (
    builds_training_kv_cache,
    forward_kv_cache_bytes,
    kv_saved_repeated,
)
from trainmem.analytic.buffers import layer_rope_cache_bytes
from trainmem.analytic.checkpointing import fsdp1_kept_input_bytes
from trainmem.analytic.loss import model_upcast_logits_bytes, shifted_logits_bytes
from trainmem.analytic.norms import litgpt_norm_weight_in_fp32
from trainmem.analytic.transforms.base import alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.frameworks import (
    installed_transformers_version,
    installed_version,
)
from trainmem.specs.model import (
    FP32_LOGITS_IN_MODEL_UNTIL,
    LAYER_ROPE_CACHE_UNTIL,
    ROTARY_IN_MODEL_SINCE,
    ModelSpec,
)
from trainmem.specs.training import TrainingConfig
from trainmem.traced_transforms import (
    after_state,
    forward_allocs_outside_layers,
    layer_of,
    state_and_micro_batches,
)

__all__ = [
    "KNOWN_FAMILIES",
    "OLDEST_READ",
    "apply_release",
    "litgpt_release_note",
    "litgpt_release_refusals",
    "litgpt_release_traced_as",
    "traced_litgpt_release",
    "release_not_applied",
    "release_note",
    "release_refusals",
    "release_traced_as",
    "traced_release",
]

KNOWN_FAMILIES = (
    frozenset(LAYER_ROPE_CACHE_UNTIL)
    | frozenset(FP32_LOGITS_IN_MODEL_UNTIL)
    | frozenset(ROTARY_IN_MODEL_SINCE)
)
"""Families whose transformers model code was read release by release (the release tables'
rows): the differences between two releases are known for these only."""

OLDEST_READ: dict[str, tuple[int, ...]] = {
    "llama": (4, 38),
    "mistral": (4, 38),
    "qwen2": (4, 40),
    "gemma": (4, 40),
    "phi3": (4, 41),
}
"""The oldest transformers release whose model code the tables were read from, by family
(:data:`~trainmem.specs.model.FP32_LOGITS_IN_MODEL_UNTIL`: "Releases before 4.38 not read
(Qwen2's and Gemma's before 4.40)"; Phi-3's first release is 4.41)."""


def _installed() -> tuple[int, ...] | None:
    return installed_transformers_version()


def traced_release(training: TrainingConfig) -> bool:
    """A ``transformers_version`` given for transformers' model code whose (major, minor)
    differs from the installed one's (or none is installed): the traced paths run the
    installed code, so the release's differences are transforms (or a refusal)."""
    if training.transformers_version is None or not training.conventions.hf_model_code:
        return False
    installed = _installed()
    return installed is None or training.transformers_release[:2] != installed[:2]


def release_traced_as(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs: the installed release, with the requested release's
    gradient-checkpointing default (``use_reentrant``) set explicitly."""
    reentrant = training.checkpoint_reentrant
    if reentrant is None and training.activation_checkpointing != "none":
        reentrant = training.hf_checkpoint_reentrant
    return replace(training, transformers_version=None, checkpoint_reentrant=reentrant)


def release_refusals(model: ModelSpec | None, training: TrainingConfig) -> list[str]:
    """What of the requested release the transforms do not model, as ``field=value (why;
    what works)`` (empty: they do; Note [An older transformers release on a traced step])."""
    if not traced_release(training):
        return []
    asked = training.transformers_version
    installed = _installed()
    here = ".".join(map(str, installed or ()))
    works = (
        f"traced: the installed transformers {here} (no --transformers-version), or --engine "
        "analytic"
    )
    if installed is None:
        return [f"transformers_version={asked} (transformers is not installed)"]
    why = _unmodelled(model, training, installed)
    return [f"transformers_version={asked} ({why}; {works})"] if why else []


def release_not_applied(training: TrainingConfig, *, diffusers: bool, timm: bool) -> str:
    """The estimate's note where the requested transformers release reaches none of the step's
    code, so the installed release is traced as it is: a timm model (timm's own modules) or a
    diffusers denoiser whose prompt embeddings and latents are inputs (diffusers' own
    modules); ``""`` otherwise (a language model, or a diffusers run whose step runs
    transformers' CLIP / T5 text encoders: ``train_text_encoder``, ``frozen_on_gpu``
    text-encoders / all, refused by :func:`release_refusals`). Note [A transformers release on
    a model it does not build]."""
    if not traced_release(training) or not (timm or diffusers) or _text_encoders_run(training):
        return ""
    kind = "a timm model (timm's own modules)" if timm else "a diffusers model (its own modules)"
    return (
        f"transformers_version={training.transformers_version} does not apply: the step of "
        f"{kind} runs no transformers model code, so the installed release was traced (Note "
        "[A transformers release on a model it does not build] in trainmem/traced_releases.py)"
    )


def _text_encoders_run(training: TrainingConfig) -> bool:
    """A diffusers run whose step runs transformers' text encoders (trained, or kept on the GPU
    to encode each batch's prompts: Note [The frozen text encoders encode inside the step])."""
    return training.train_text_encoder or training.frozen_on_gpu in ("text-encoders", "all")


def _unmodelled(
    model: ModelSpec | None, training: TrainingConfig, installed: tuple[int, ...]
) -> str:
    """Why the requested release's differences are not modelled, or ``""``."""
    release = training.transformers_release
    known = ", ".join(sorted(KNOWN_FAMILIES))
    if model is None and _text_encoders_run(training):
        return (
            "the step runs transformers' CLIP / T5 text encoders (train_text_encoder, "
            "frozen_on_gpu), whose releases were not read"
        )
    if model is None or model.model_type not in KNOWN_FAMILIES:
        kind = model.model_type if model is not None else "this model"
        return f"the differences between transformers releases are known for {known}, not {kind}"
    if release[:2] < OLDEST_READ[model.model_type] or release[:2] > installed[:2]:
        oldest = ".".join(map(str, OLDEST_READ[model.model_type]))
        return f"releases from {oldest} up to the installed one are modelled"
    traced = release_traced_as(training)
    differs = [
        what
        for what, requested, as_traced in (
            (
                "repeat_kv's expanded keys and values under SDPA before 4.54 with op-level "
                "selective checkpointing (v_proj's output the policy caches is held at kv size "
                "until the recompute's repeat_kv)",
                _repeats_kv(model, training)
                and not _cached(model, traced)
                and training.activation_checkpointing == "selective",
                _repeats_kv(model, traced) and training.activation_checkpointing == "selective",
            ),
            (
                "the training KV cache of a 4.x release under eager attention (DynamicCache."
                "update keeps each layer's rotated 16-bit keys and, through the values' view, "
                "the projection output they are sliced from: Phi-3's whole fused qkv_proj "
                "output; eager attention saves copies of neither)",
                training.attention == "eager"
                and builds_training_kv_cache(model, training)
                and training.transformers_release < (5,),
                training.attention == "eager"
                and builds_training_kv_cache(model, traced)
                and traced.transformers_release < (5,),
            ),
            (
                "the fp32 logits the loop holds",
                training.training_loop in ("step", "previous")
                and model.returns_fp32_logits(release),
                training.training_loop in ("step", "previous")
                and model.returns_fp32_logits(traced.transformers_release),
            ),
            ("the weights' load dtype", training.weight_dtype, traced.weight_dtype),
            (
                "FSDP1's checkpoint outside its units before 4.52",
                fsdp1_kept_input_bytes(model, training),
                fsdp1_kept_input_bytes(model, traced),
            ),
        )
        if requested != as_traced
    ]
    return "not modelled on a traced step: " + "; ".join(differs) if differs else ""


def _repeats_kv(model: ModelSpec, training: TrainingConfig) -> bool:
    """SDPA takes grouped keys and values repeated to every query head (``repeat_kv``), copies
    of two or more kv heads (Note [repeat_kv under SDPA on a traced step]: one is a view;
    the formulas' predicate, :func:`~trainmem.analytic.attention.kv_saved_repeated`)."""
    return kv_saved_repeated(model, training)


def _cached(model: ModelSpec, training: TrainingConfig) -> bool:
    """The step builds transformers' training KV cache (Note [The training KV cache's
    copies])."""
    return forward_kv_cache_bytes(model, training, model.num_layers) > 0


def repeated_kv_sizes(model: ModelSpec, training: TrainingConfig) -> tuple[int, int]:
    """(bytes of one layer's keys, of their ``repeat_kv`` copy): c x kv_heads x head_dim x t
    and c x heads x head_dim x t."""
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * training.seq_len
    return c * model.num_kv_heads * model.head_dim * t, c * model.num_heads * model.head_dim * t


def release_note(training: TrainingConfig) -> str:
    """The estimate's note: what was traced and which differences were applied."""
    here = ".".join(map(str, _installed() or ()))
    return (
        f"transformers_version={training.transformers_version}: the installed transformers "
        f"{here}'s model code was traced and the differences the formulas know applied to its "
        "step (each layer's rotary buffers, the loss's shifted logits, the 16-bit logits freed "
        "at the model's upcast, the cache's 16-bit keys, the checkpointing default, where the "
        "release has them; Note [An older transformers release on a traced step] in "
        "trainmem/traced_releases.py)"
    )


def apply_release(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The step traced on the installed release as the requested release has it (Note [An
    older transformers release on a traced step]).

    Args:
        schedule: a traced step of :func:`release_traced_as`'s settings.
        model: the model's shape (a family of :data:`KNOWN_FAMILIES`).
        training: the run with the requested ``transformers_version``.

    Returns:
        The schedule with each layer's rotary buffers and the loss's shifted copy added, the
        16-bit logits freed at their upcast and the cache's fp32 keys dropped, where the
        requested release has them.

    Raises:
        ScheduleError: no ModelSpec, or a rewritten free that pairs with no allocation.
    """
    if model is None:
        raise ScheduleError("an older transformers release needs the model's ModelSpec")
    traced = release_traced_as(training)
    rope = layer_rope_cache_bytes(model, training) - layer_rope_cache_bytes(model, traced)
    shifted = shifted_logits_bytes(model, training) - shifted_logits_bytes(model, traced)
    rebound = model_upcast_logits_bytes(model, training) - model_upcast_logits_bytes(model, traced)
    n = model.num_layers
    keys = forward_kv_cache_bytes(model, traced, n) - forward_kv_cache_bytes(model, training, n)
    if rebound < 0 or keys < 0 or keys % n:
        raise ScheduleError("the requested release holds logits or keys the traced one does not")
    logits = 4 * model.vocab_size * training.micro_batch_size * training.seq_len
    setup, step = schedule.setup, schedule.step
    if rope > 0:
        label = "a layer's rotary cos / sin buffers"
        for i in reversed(range(model.num_layers)):
            op = alloc(rope, Cat.BUFFER, "init", f"rope/{i}", f"model.layers.{i}", label)
            if setup:
                setup = after_state(setup, op)
            else:
                step = after_state(step, op)
    # each micro-batch's rewrites, in this order (the 16-bit logits' free lands before the
    # shifted copy, both just after the fp32 upcast)
    rewrites: list[Callable[[list[Item], str], list[Item]]] = []
    if shifted > 0:
        rewrites.append(lambda seg, tag: _shifted(seg, tag, shifted, logits))
    if rebound > 0:
        rewrites.append(lambda seg, _: _rebound(seg, rebound, logits))
    if keys > 0:
        rewrites.append(lambda seg, _: _uncached(seg, keys // n, n))
    for rewrite in rewrites:
        setup = tuple(_each_micro_batch(setup, rewrite))
        step = tuple(_each_micro_batch(step, rewrite))
    if _repeats_kv(model, training) and not _repeats_kv(model, traced):
        small, big = repeated_kv_sizes(model, training)
        setup = _repeated(setup, small, big, n)
        step = _repeated(step, small, big, n)
    out = StepSchedule(setup=setup, step=step, name=schedule.name)
    list(out.events())  # every free pairs with its allocation
    return out


def _shifted(seg: list[Item], tag: str, shifted: int, logits: int) -> list[Item]:
    """A micro-batch with the shifted copy of its fp32 logits (``shifted`` bytes), allocated
    after their upcast (``logits`` bytes) and freed when its forward ends."""
    op = alloc(shifted, Cat.TEMPORARY, "forward", f"shifted/{tag}", "", "shifted logits")
    upcast = forward_allocs_outside_layers(seg, logits)
    backward = [j for j, x in enumerate(seg) if isinstance(x, Op) and x.phase == "backward"]
    if not upcast or not backward:
        raise ScheduleError("no fp32 logits before the backward to shift for the loss")
    at, end = upcast[0] + 1, backward[0]
    return [*seg[:at], op, *seg[at:end], free(op, "forward"), *seg[end:]]


def _each_micro_batch(
    items: Sequence[Item], rewrite: Callable[[list[Item], str], list[Item]]
) -> list[Item]:
    """``items`` (a state, then a step, either may be empty) with each micro-batch rewritten;
    ``rewrite`` gets the micro-batch and a tag for the keys of what it adds (the state's length
    and the micro-batch's index: unique in the schedule)."""
    split = state_and_micro_batches(items)
    if split is None:  # a state without a warm-up step
        return list(items)
    out, segments, tail = split
    n = len(out)
    for k, seg in enumerate(segments):
        out += rewrite(seg, f"{n}/{k}")
    return out + tail


def _rebound(seg: list[Item], size: int, logits: int) -> list[Item]:
    """A micro-batch whose 16-bit logits (``size`` bytes) are freed at their fp32 upcast
    (``logits`` bytes), where the model code rebinds ``logits = logits.float()`` (Note [The
    upcast 16-bit logits])."""
    upcast = forward_allocs_outside_layers(seg, logits)
    made = [k for k in forward_allocs_outside_layers(seg, size) if upcast and k < upcast[0]]
    if not made:
        raise ScheduleError("no 16-bit logits before their fp32 upcast in the traced step")
    op = _op_at(seg, made[-1])
    gone = [k for k, x in enumerate(seg) if isinstance(x, Op) and x == free(op, x.phase)]
    if not gone or gone[0] < upcast[0]:
        raise ScheduleError("the traced step's 16-bit logits are freed before their upcast")
    rest = [x for k, x in enumerate(seg) if k != gone[0]]
    at = upcast[0] + 1  # the free's index was after the upcast: the upcast's is unchanged
    return [*rest[:at], free(op, "forward"), *rest[at:]]


def _uncached(seg: list[Item], size: int, num_layers: int) -> list[Item]:
    """A micro-batch without the traced release's per-layer copies of the keys (``size``
    bytes each) that its training KV cache holds from each layer's attention until the
    forward ends (Note [The rotated keys' dtype by release]): the forward allocations in a
    layer, of that size, freed after the last layer's forward."""
    last = max(
        (k for k, x in enumerate(seg) if any(_layer_forward_alloc(op) for op in _flat(x))),
        default=-1,
    )
    late = {
        op.key
        for x in seg[last + 1 :]
        for op in _flat(x)
        if op.action == "free" and op.phase == "forward"
    }
    held: dict[str, int] = {}
    for x in seg[: last + 1]:
        count = x.count if isinstance(x, Repeat) else 1
        for op in _flat(x):
            if _layer_forward_alloc(op) and op.size_bytes == size and op.key in late:
                held[op.key] = held.get(op.key, 0) + count
    if sum(held.values()) != num_layers:
        raise ScheduleError(
            f"{sum(held.values())} of the {num_layers} layers' cached keys found in the traced step"
        )
    return [y for x in seg if (y := _without(x, held)) is not None]


def _repeated(items: tuple[Item, ...], small: int, big: int, num_layers: int) -> tuple[Item, ...]:
    """``items`` with the keys and values SDPA saves in each layer (``small`` bytes each, the
    activations of that size of the attention module (the cache's copies it is handed; without
    the cache, the keys' cast) and of its ``v_proj`` (``v_proj``'s output, without it)) at the
    size of their ``repeat_kv`` copies (``big``), which a release before 4.54 saves instead
    (Note [repeat_kv under SDPA on a traced step]).

    Raises:
        ScheduleError: not two such activations per layer and micro-batch.
    """
    found: dict[str, int] = {}
    for x in items:
        count = x.count if isinstance(x, Repeat) else 1
        for op in _flat(x):
            if (
                op.action == "alloc"
                and op.category == Cat.ACTIVATION
                and op.size_bytes == small
                and layer_of(op.module) is not None
                and op.module.endswith((".self_attn", ".self_attn.v_proj"))
            ):
                found[op.key] = found.get(op.key, 0) + count
    total = sum(found.values())
    if not total or total % (2 * num_layers):
        raise ScheduleError(
            f"{total} saved keys / values found in the traced step for {num_layers} layers"
        )
    return tuple(_resized(x, found, big) for x in items)


def _resized(item: Item, keys: Mapping[str, int], size: int) -> Item:
    if isinstance(item, Repeat):
        body = tuple(_resized(x, keys, size) for x in item.body)
        return replace(item, body=body, memo={})
    return item._replace(size_bytes=size) if item.key in keys else item


def _layer_forward_alloc(op: Op) -> bool:
    return op.action == "alloc" and op.phase == "forward" and layer_of(op.module) is not None


def _flat(item: Item) -> list[Op]:
    """The ops of ``item`` (a Repeat's body's, nested ones too)."""
    if isinstance(item, Repeat):
        return [op for x in item.body for op in _flat(x)]
    return [item]


def _without(item: Item, keys: Mapping[str, int]) -> Item | None:
    """``item`` without the ops of ``keys`` of :func:`_uncached`'s size (None: nothing left)."""
    if isinstance(item, Repeat):
        body = tuple(y for x in item.body if (y := _without(x, keys)) is not None)
        return replace(item, body=body, memo={}) if body else None
    return None if item.key in keys else item


def _op_at(seg: Sequence[Item], k: int) -> Op:
    op = seg[k]
    assert isinstance(op, Op)
    return op


# -- litgpt ------------------------------------------------------------------------------------


def _installed_litgpt() -> str | None:
    found = installed_version("litgpt")
    return ".".join(map(str, (*found, 0, 0)[:3])) if found is not None else None


def traced_litgpt_release(training: TrainingConfig) -> bool:
    """``--framework litgpt`` with a ``litgpt_version`` other than the installed litgpt's
    (Note [An older litgpt release on a traced step])."""
    installed = _installed_litgpt()
    if training.framework != "litgpt" or training.litgpt_version is None or installed is None:
        return False
    return ".".join(map(str, training.litgpt_release)) != installed


def litgpt_release_traced_as(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs: the installed litgpt release, or the requested one when
    it crosses the RMSNorm rule (its norms run as that release's,
    ``trace/litgpt_model._rms_norm_cast_first``)."""
    installed = replace(training, litgpt_version=_installed_litgpt())
    if litgpt_norm_weight_in_fp32(training) != litgpt_norm_weight_in_fp32(installed):
        return training
    return installed


def litgpt_release_refusals(training: TrainingConfig) -> list[str]:
    """A requested litgpt release the trace does not run, as ``field=value (why; what
    works)``: one newer than the installed (empty: an older one is traced, Note [An older
    litgpt release on a traced step])."""
    if not traced_litgpt_release(training):
        return []
    installed = _installed_litgpt()
    if not _newer(training):
        return []  # older: traced as the installed release, or with its norms (traced_as)
    return [
        f"litgpt_version={training.litgpt_version} (newer than the installed "
        f"{installed}, whose model code the trace runs; traced: up to the "
        "installed release, or --engine analytic)"
    ]


def _newer(training: TrainingConfig) -> bool:
    """The requested litgpt release is newer than the installed one."""
    found = installed_version("litgpt")
    return found is not None and training.litgpt_release > (*found, 0, 0)[:3]


def litgpt_release_note(training: TrainingConfig) -> str:
    """The estimate's note for a litgpt release other than the installed one."""
    if litgpt_release_traced_as(training) is training:
        return (
            f"litgpt_version={training.litgpt_version}: the installed litgpt "
            f"{_installed_litgpt()}'s model code was traced with this release's RMSNorm (cast "
            "to the input's dtype before the weight multiply; Note [An older litgpt release on "
            "a traced step] in trainmem/traced_releases.py)"
        )
    return (
        f"litgpt_version={training.litgpt_version}: the installed litgpt "
        f"{_installed_litgpt()}'s model code was traced; the rules the formulas know by litgpt "
        "release are the same for both (Note [An older litgpt release on a traced step] in "
        "trainmem/traced_releases.py)"
    )
