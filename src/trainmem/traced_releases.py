"""A transformers release other than the installed one on a traced step (issue 26): the
installed model code is traced and the differences the formulas know between the two releases
are applied to its step as transforms, each with the formula's own rule.

Note [An older transformers release on a traced step]
    The traced paths run the installed transformers' model code; ``--transformers-version``
    asks for another release. What changes between releases for the families whose model code
    was read release by release (:data:`KNOWN_FAMILIES`: Llama and Mistral, from 4.38 on) is
    what the analytic engine's rules say, each keyed by its own release table:

    * each decoder layer's own rotary cos / sin tables, buffers kept for the run
      (``ModelSpec.layer_rope_cache_values``, :data:`~trainmem.specs.model.
      LAYER_ROPE_CACHE_UNTIL`; sized by :func:`~trainmem.analytic.buffers.
      layer_rope_cache_bytes`): allocated with the state the step starts from, one per layer;
    * the loss's shifted copy of the fp32 logits before 4.49 (:func:`~trainmem.analytic.loss.
      shifted_logits_bytes`): allocated after the loss's fp32 upcast of each micro-batch's
      logits (the last forward allocation of that size outside the layers), freed when the
      forward ends (``clone`` saves nothing);
    * transformers' gradient-checkpointing default, reentrant from 4.37 until 5.0
      (``TrainingConfig.hf_checkpoint_reentrant``): the installed code is traced with the
      requested release's ``use_reentrant`` set explicitly, so the trace runs it for real.

    The rules the transforms do not reproduce are refused (:func:`release_refusals`) where they
    differ between the two releases for the run: ``repeat_kv``'s expanded keys and values under
    SDPA before 4.54 on a grouped-query model (``sdpa_expands_kv``), the fp32 logits a loop
    holds before 4.46 / 4.48 (``ModelSpec.returns_fp32_logits`` under ``--loop step`` /
    ``previous``), the weights' load dtype, the FSDP1 checkpoint placement before 4.52; so is a
    family whose releases were not read, a release before 4.38 or after the installed one.

    Checked against a real trace of transformers 4.40.0 (torch 2.13.0 CPU, a throwaway venv,
    the generic path of this package on its installed 4.40.0) on the agreement Llama
    (tests/models/agreement/llama_h1024.json, bf16-mixed, AdamW): 1 x 128 tokens and 4 x 512
    under full checkpointing, the transformed step's peak equals the real one to the byte
    (702,913,024 and 702,943,744 B: the rotary buffers, 4 MiB). Where the peak is at the loss
    (4 x 512 tokens, no checkpointing: 889,164,376 B against the real 855,527,960, +3.9 %;
    LoRA r8: 508,482,136 against 474,845,720, +7.1 %; the formulas within 0.02 % of the
    transformed step in both) the weights, states and activations agree within 0.02 % and
    the whole gap is temporaries, 33.6 MB: 16.8 MB are the 16-bit logits, which 4.40 frees at
    ``logits = logits.float()`` in the plain loop too (Note [The upcast 16-bit logits] has it
    for the loops that hold the output only) where the formulas and the installed release keep
    them beside the upcast; the other 16.8 MB are each layer's rotated keys in fp32 (4 x 8 x
    512 x 128 x 4 B), which the installed release's ``DynamicCache`` (``use_cache``) holds
    until the forward returns: 5.24 rotates with cos / sin of the model-level
    ``self.rotary_emb(hidden_states, ...)``, in the fp32 residual stream's dtype under
    autocast, where 4.40's ``LlamaSdpaAttention.forward`` takes ``self.rotary_emb(
    value_states, ...)``, whose ``cos.to(dtype=x.dtype)`` is 16-bit, so its cached keys are
    the 16-bit ones SDPA saves anyway. Both are release differences no rule has yet, so
    neither engine has them.

Note [An older litgpt release on a traced step]
    ``--framework litgpt`` traces the installed litgpt's own GPT. The formulas know one rule
    keyed by the litgpt release on the paths the trace runs (one GPU, DDP): RMSNorm's fp32
    weight multiply from 0.4.6 (:func:`~trainmem.analytic.norms.litgpt_norm_weight_in_fp32`;
    the per-Linear FSDP units of 0.5.8 need Fabric's FSDP, which the traced paths refuse). A
    requested release on the same side of every rule as the installed one is traced as the
    installed release (the note says so); one across a rule (0.4.0 against 0.5.13: the norm's
    16-bit saved copy, not a transform yet) is refused, naming the rule and what works.

Source: transformers 4.40.0 models/llama/modeling_llama.py (``LlamaRotaryEmbedding``,
``LlamaForCausalLM.forward``), 5.24 loss/loss_utils.py ``ForCausalLMLoss``; the release tables
cited where they are defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainmem.analytic.attention import sdpa_expands_kv
from trainmem.analytic.buffers import layer_rope_cache_bytes
from trainmem.analytic.checkpointing import fsdp1_kept_input_bytes
from trainmem.analytic.loss import shifted_logits_bytes
from trainmem.analytic.norms import litgpt_norm_weight_in_fp32
from trainmem.analytic.transforms.base import alloc, free
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.frameworks import (
    LITGPT_RMSNORM_FP32_WEIGHT_SINCE,
    installed_transformers_version,
    installed_version,
)
from trainmem.specs.model import FP32_LOGITS_IN_MODEL_UNTIL, LAYER_ROPE_CACHE_UNTIL, ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.traced_transforms import (
    after_state,
    forward_allocs_outside_layers,
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
    "release_note",
    "release_refusals",
    "release_traced_as",
    "traced_release",
]

KNOWN_FAMILIES = frozenset(LAYER_ROPE_CACHE_UNTIL) | frozenset(FP32_LOGITS_IN_MODEL_UNTIL)
"""Families whose transformers model code was read release by release (the release tables'
rows): the differences between two releases are known for these only."""

OLDEST_READ = (4, 38)
"""The oldest transformers release whose model code the tables were read from
(:data:`~trainmem.specs.model.FP32_LOGITS_IN_MODEL_UNTIL`: "Releases before 4.38 not read")."""


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


def _unmodelled(
    model: ModelSpec | None, training: TrainingConfig, installed: tuple[int, ...]
) -> str:
    """Why the requested release's differences are not modelled, or ``""``."""
    release = training.transformers_release
    known = ", ".join(sorted(KNOWN_FAMILIES))
    if model is None or model.model_type not in KNOWN_FAMILIES:
        kind = model.model_type if model is not None else "this model"
        return f"the differences between transformers releases are known for {known}, not {kind}"
    if release[:2] < OLDEST_READ or release[:2] > installed[:2]:
        oldest = ".".join(map(str, OLDEST_READ))
        return f"releases from {oldest} up to the installed one are modelled"
    traced = release_traced_as(training)
    differs = [
        what
        for what, requested, as_traced in (
            (
                "repeat_kv's expanded keys and values under SDPA before 4.54",
                model.num_kv_heads < model.num_heads and sdpa_expands_kv(training),
                model.num_kv_heads < model.num_heads and sdpa_expands_kv(traced),
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


def release_note(training: TrainingConfig) -> str:
    """The estimate's note: what was traced and which differences were applied."""
    here = ".".join(map(str, _installed() or ()))
    return (
        f"transformers_version={training.transformers_version}: the installed transformers "
        f"{here}'s model code was traced and the differences the formulas know applied to its "
        "step (each layer's rotary buffers, the loss's shifted logits, the checkpointing "
        "default, where the release has them; Note [An older transformers release on a traced "
        "step] in trainmem/traced_releases.py)"
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
        The schedule with each layer's rotary buffers and the loss's shifted copy added.

    Raises:
        ScheduleError: no ModelSpec, or a rewritten free that pairs with no allocation.
    """
    if model is None:
        raise ScheduleError("an older transformers release needs the model's ModelSpec")
    traced = release_traced_as(training)
    rope = layer_rope_cache_bytes(model, training) - layer_rope_cache_bytes(model, traced)
    shifted = shifted_logits_bytes(model, training) - shifted_logits_bytes(model, traced)
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
    if shifted > 0:
        setup = tuple(_with_shifted(setup, shifted, logits))
        step = tuple(_with_shifted(step, shifted, logits))
    out = StepSchedule(setup=setup, step=step, name=schedule.name)
    list(out.events())  # every free pairs with its allocation
    return out


def _with_shifted(items: Sequence[Item], shifted: int, logits: int) -> list[Item]:
    """``items`` (a state, then a step, either may be empty) with each micro-batch's shifted
    copy of its fp32 logits, allocated after their upcast and freed when its forward ends."""
    split = state_and_micro_batches(items)
    if split is None:  # a state without a warm-up step
        return list(items)
    out, segments, tail = split
    n = len(out)
    for k, seg in enumerate(segments):
        op = alloc(shifted, Cat.TEMPORARY, "forward", f"shifted/{n}/{k}", "", "shifted logits")
        upcast = forward_allocs_outside_layers(seg, logits)
        backward = [j for j, x in enumerate(seg) if isinstance(x, Op) and x.phase == "backward"]
        if not upcast or not backward:
            raise ScheduleError("no fp32 logits before the backward to shift for the loss")
        at, end = upcast[0] + 1, backward[0]
        out += [*seg[:at], op, *seg[at:end], free(op, "forward"), *seg[end:]]
    return out + tail


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
    """The settings the trace runs: the installed litgpt release."""
    return replace(training, litgpt_version=_installed_litgpt())


def litgpt_release_refusals(training: TrainingConfig) -> list[str]:
    """The requested litgpt release where a rule the formulas know differs from the installed
    release's, as ``field=value (why; what works)`` (empty: traced as the installed one)."""
    if not traced_litgpt_release(training):
        return []
    traced = litgpt_release_traced_as(training)
    newer = training.litgpt_release > traced.litgpt_release
    if not newer and litgpt_norm_weight_in_fp32(training) == litgpt_norm_weight_in_fp32(traced):
        return []
    if newer:
        return [
            f"litgpt_version={training.litgpt_version} (newer than the installed "
            f"{traced.litgpt_version}, whose model code the trace runs; traced: up to the "
            "installed release, or --engine analytic)"
        ]
    since = ".".join(map(str, LITGPT_RMSNORM_FP32_WEIGHT_SINCE))
    return [
        f"litgpt_version={training.litgpt_version} (RMSNorm multiplies its weight in fp32 "
        f"from litgpt {since}, the installed {traced.litgpt_version} does, this release does "
        f"not: not a transform of the traced step yet; traced: --litgpt-version {since} or "
        f"newer, up to the installed {traced.litgpt_version}, or --engine analytic)"
    ]


def litgpt_release_note(training: TrainingConfig) -> str:
    """The estimate's note for a litgpt release traced as the installed one."""
    return (
        f"litgpt_version={training.litgpt_version}: the installed litgpt "
        f"{_installed_litgpt()}'s model code was traced; the rules the formulas know by litgpt "
        "release are the same for both (Note [An older litgpt release on a traced step] in "
        "trainmem/traced_releases.py)"
    )
