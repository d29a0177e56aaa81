"""Unsloth (``--framework unsloth``) applied to a traced step as the formulas' rules (issue 26).

Note [Unsloth on a traced step]
    Unsloth's step cannot run on fake tensors: its LoRA kernels (``LoRA_MLP``, ``LoRA_QKV``,
    ``LoRA_W``), ``Fast_RMS_Layernorm``, fast RoPE and cross-entropy are Triton, its
    ``fast_dequantize`` calls bitsandbytes' CUDA functions, its offloaded checkpoint copies to
    pinned host memory on a side stream (unsloth 2026.3.5 unsloth/kernels/, unsloth_zoo
    2026.3.4 gradient_checkpointing.py). And for the families ``FastLanguageModel`` dispatches
    to its own classes (unsloth 2026.3.5 models/loader.py: ``llama``, ``mistral``, ``gemma``,
    ``gemma2``, ``qwen2``, ``qwen3``) it replaces every module's forward, not a few:
    ``LlamaModel_fast_forward``, ``LlamaDecoderLayer_fast_forward``,
    ``LlamaAttention_fast_forward``, ``CausalLM_fast_forward`` (models/llama.py), each the
    whole forward and backward of its module. So what transformers + peft would do in a
    micro-batch is not what runs, and the traced micro-batch is replaced whole:

    * the state the step starts from (the 16-bit weights, a quantized base's codes as the
      trace's stand-in stores them, the LoRA adapters in fp32 as ``prepare_model_for_training``
      upcasts them, ``adapter_dtype``), the optimizer's states and its step (traced, or the
      stand-in rewritten by :func:`~trainmem.traced_transforms.apply_optimizer`) and the cuBLAS
      workspaces are the trace's: transformers + peft build the same parameters Unsloth trains
      (``FastLanguageModel.get_peft_model`` calls peft's ``get_peft_model``);
    * every micro-batch's forward and backward (the layers' saved tensors under Unsloth's
      kernels, the fused cross-entropy that never makes the fp32 logits, the offloaded
      checkpoint's layer inputs on the host and its reused GPU buffer, the dequantization
      buffers, the gradients where the kernels make them) and the gradients' release at
      ``zero_grad`` are the analytic engine's schedule of the same run, built by the same
      transforms (:class:`~trainmem.analytic.transforms.unsloth.UnslothOffloadedCheckpointing`,
      :mod:`~trainmem.analytic.transforms.quantized`'s buffers) and rules
      (:func:`~trainmem.analytic.lora.unsloth_fast_lora`,
      :func:`~trainmem.analytic.loss.unsloth_fused_loss`, ...): the first step's in the warm-up
      step, the steady one's in the measured step; the checkpoint's 2 MiB GPU buffer, made
      when the checkpoint is patched at load, joins the state.

    These rules are sized from the model's shape, so a model without a ModelSpec (a diffusers,
    timm or traced-only family) is refused. A family Unsloth runs through ``FastModel``
    (unsloth_zoo's compiled transformers code, no LoRA kernels) gets the formulas' rules as
    the analytic engine applies them there (peft's LoRA rules: :func:`~trainmem.analytic.
    lora.unsloth_fast_lora` is off outside its kernel families). The trace runs the ``drop``
    loop without optimizer in backward (:func:`unsloth_traced_as`): the formulas' micro-batches
    hold what the run's loop holds (the previous micro-batch's output; the ``step`` loop's last
    output, freed after the traced optimizer step) and, under optimizer in backward, step and
    free each gradient themselves, the trace then giving only the optimizer's states.

Source: unsloth 2026.3.5 unsloth/models/loader.py ``FastLanguageModel.from_pretrained``,
unsloth/models/llama.py; the analytic rules cited in trainmem/analytic/transforms/unsloth.py,
trainmem/analytic/lora.py, trainmem/analytic/loss.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from trainmem.analytic.engine import estimate_analytic
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import UnsupportedError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.traced_transforms import _ops, _phases, micro_batches

__all__ = [
    "apply_unsloth",
    "check_unsloth_run",
    "traced_unsloth",
    "unsloth_refusals",
    "unsloth_traced_as",
]


def traced_unsloth(training: TrainingConfig) -> bool:
    """The run is Unsloth's (Note [Unsloth on a traced step])."""
    return training.framework == "unsloth"


def unsloth_refusals(model: ModelSpec | None, training: TrainingConfig) -> list[str]:
    """What of an Unsloth run the traced paths do not model, with why (empty: they do, or the
    run is not Unsloth's): a model without a ModelSpec."""
    if not traced_unsloth(training) or model is not None:
        return []
    return [
        "framework=unsloth on a model without a ModelSpec (Unsloth's kernels replace the "
        "forward and backward of every module, and the traced paths apply them as the "
        "formulas' rules, sized from the model's shape: a formula family or a remote-code "
        "config has one; Note [Unsloth on a traced step] in trainmem/traced_unsloth.py)"
    ]


def unsloth_traced_as(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs for an Unsloth run: its own, with the loop's hold and
    optimizer in backward taken out (the formulas' micro-batches have them, Note [Unsloth on
    a traced step])."""
    return replace(training, loop="drop", keep_logits=False, optimizer_in_backward=False)


def check_unsloth_run(model: ModelSpec | None, training: TrainingConfig) -> None:
    """Refuse, before the trace runs, an Unsloth run :func:`apply_unsloth` cannot rewrite.

    Raises:
        UnsupportedError: the settings :func:`unsloth_refusals` names.
    """
    refused = unsloth_refusals(model, training)
    if refused:
        raise UnsupportedError(
            "the generic path (a trace) does not model " + "; ".join(refused) + "; no engine "
            "estimates it yet"
        )


def apply_unsloth(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced step (transformers + peft in Unsloth's dtypes) as Unsloth runs it: its state
    and optimizer step kept, its micro-batches and gradient release the formulas' (Note
    [Unsloth on a traced step]).

    Args:
        schedule: a traced step of the same run (:func:`unsloth_traced_as`'s settings).
        model: the model's shape.
        training: the Unsloth run.

    Returns:
        The schedule with Unsloth's micro-batches.

    Raises:
        UnsupportedError: what :func:`unsloth_refusals` names.
        ScheduleError: a rewritten free that pairs with no allocation.
    """
    check_unsloth_run(model, training)
    assert model is not None  # checked
    formulas = estimate_analytic(model, training).schedules[0]
    formulas_state, warm_up = _leading_state(formulas.setup)
    first = _steps(warm_up)[0]
    kept = [op for op in _ops(formulas_state) if op.key.startswith("unsloth")]  # 2 MiB buffer
    if schedule.setup:
        traced_state, traced_warm_up = _leading_state(schedule.setup)
        state = _without(traced_state, _traced_gradient)  # kept ones: the formulas make them
        setup = (*state, *kept, *_step(traced_warm_up, first, training))
        step = tuple(_step(list(schedule.step), list(formulas.step), training))
    else:  # one flat step: the state, then a first step
        traced_state, traced_step = _leading_state(schedule.step)
        state = _without(traced_state, _traced_gradient)
        setup, step = (), (*state, *kept, *_step(traced_step, first, training))
    out = StepSchedule(setup=setup, step=step, name=schedule.name)
    list(out.events())  # every free pairs with its allocation
    return out


def _leading_state(items: Sequence[Item]) -> tuple[list[Item], list[Item]]:
    """(the leading run of ``init`` items: the state; the rest)."""
    n = 0
    while n < len(items) and _phases(items[n]) == {"init"}:
        n += 1
    return list(items[:n]), list(items[n:])


def _steps(items: list[Item]) -> list[list[Item]]:
    """``items`` (the warm-up steps) cut into steps: a step ends where a forward follows its
    optimizer step or ``zero_grad``."""
    steps: list[list[Item]] = [[]]
    ended = False
    for item in items:
        phases = _phases(item)
        if ended and "forward" in phases:
            steps.append([])
            ended = False
        steps[-1].append(item)
        ended = ended or bool(phases & {"optimizer", "zero_grad"})
    return steps


def _parts(items: list[Item]) -> tuple[list[Item], list[Item], list[Item]]:
    """(the micro-batches, the optimizer step, ``zero_grad``) of one step.

    Raises:
        ScheduleError: no backward.
    """
    segments, rest = micro_batches(items)
    batches = [x for seg in segments for x in seg]
    release = [x for x in rest if "zero_grad" in _phases(x)]
    step = [x for x in rest if "zero_grad" not in _phases(x)]
    return batches, step, release


def _step(traced: list[Item], formulas: list[Item], training: TrainingConfig) -> list[Item]:
    """One traced step with the formulas' micro-batches, what they hold through the optimizer
    step (the ``step`` loop's last output) and their gradient release; the traced optimizer
    step without the traced gradients (the formulas' replace them), and under optimizer in
    backward only its states (the formulas step each gradient in the backward)."""
    _, step, _ = _parts(traced)
    batches, formulas_step, release = _parts(formulas)
    made = {op.key for op in _ops(batches) if op.action == "alloc"}
    held = [
        x
        for x in formulas_step
        if isinstance(x, Op)
        and x.action == "free"
        and x.key in made
        and x.category is not Cat.GRADIENT
    ]
    drop = _traced_gradient if not training.optimizer_in_backward else _step_temporary
    kept = [x for x in _without(step, drop) if _phases(x)]
    return [*_without(batches, _workspace), *kept, *held, *release]


def _step_temporary(op: Op) -> bool:
    """Not an optimizer state (the traced step's temporaries and gradients)."""
    return op.category is not Cat.OPTIMIZER_STATE


def _traced_gradient(op: Op) -> bool:
    return op.category is Cat.GRADIENT


def _workspace(op: Op) -> bool:
    """The formulas' cuBLAS workspaces, made at the first matmul (the trace has its own in the
    state)."""
    return op.module == "cublas"


def _without(items: Sequence[Item], drop: Callable[[Op], bool]) -> list[Item]:
    """``items`` without the ops ``drop`` selects, inside repeated blocks too."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, Repeat):
            body = tuple(_without(item.body, drop))
            if body:
                out.append(Repeat(body, item.count, item.reverse, item.start, item.independent))
        elif not drop(item):
            out.append(item)
    return out
