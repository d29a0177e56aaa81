"""Framework conventions as data: one row per training framework, one field per convention.

The analytic formulas read these fields (``training.conventions.<field>``) instead of testing
the framework's name, so each convention is stated once, next to the source file it mirrors.
Library versions a default depends on (torch, bitsandbytes) are ``TrainingConfig`` fields; the
functions here turn them into the convention that applies.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from trainmem.errors import SpecError

DEFAULT_TORCH_VERSION = (2, 8)
"""The torch release assumed when none is given: a current one (>= 2.8)."""
DEFAULT_TRANSFORMERS_VERSION = (5, 24)
"""The transformers release assumed when none is given and none is installed: the newest the
``trace`` extra allows (pyproject.toml ``transformers>=4.45,<5.25``), whose model code the trace
engine runs."""
GRADIENT_CHECKPOINTING_LAYER_SINCE = (4, 52)
"""transformers modeling_layers.py ``GradientCheckpointingLayer`` (first in 4.52.0; 4.51.3 has
no modeling_layers.py): the decoder layer's own ``__call__`` runs
``self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)``, so the
checkpoint sits inside whatever wraps the layer (an FSDP1 unit). Before, the model's loop
checkpointed the wrapper (4.39.3 modeling_llama.py ``LlamaModel.forward``:
``self._gradient_checkpointing_func(decoder_layer.__call__, hidden_states, ...)``)."""
DEFAULT_BITSANDBYTES_VERSION = (0, 45, 0)
"""The bitsandbytes release assumed when none is given: a current one (>= 0.43.2)."""
BNB_MATMUL4BIT_SAVES_NO_INPUT_SINCE = (0, 43, 2)
"""bitsandbytes autograd/_functions.py ``MatMul4Bit.forward``: since 0.43.2 it keeps
``ctx.tensors = (None, B)`` (the quantized weight only; the input gradient needs only B);
before, ``(A, B)``: the 16-bit input of every 4-bit linear stayed saved until its backward."""
BNB_INT8_KEEPS_ONLY_GRADED_INPUT_SINCE = (0, 45, 0)
"""bitsandbytes autograd/_functions.py ``MatMul8bitLt.forward``: from 0.45.0 (its LLM.int8
rewrite) a frozen weight takes the fast path (``int8_vectorwise_quant``: ``CAt = SCAt = None``
unless ``ctx.needs_input_grad[1]``) and ``ctx.tensors = [None, None, None]`` when neither input
needs a gradient; before (0.40.0 .. 0.44.1) ``F.double_quant`` always made ``CAt``, the int8
transposed copy of the input, kept with it (``ctx.tensors = (CAt, subA, A)``) when either needs
a gradient, and the input alone (``[None, None, A]``) otherwise. Read at 0.40.0, 0.41.0,
0.42.0, 0.43.0, 0.43.2, 0.43.3, 0.44.1, 0.45.0, 0.45.5, 0.46.0, 0.47.0, 0.48.2, 0.49.2."""
BNB_4BIT_QUANTIZED_IN_ITS_DTYPE_SINCE = (0, 43, 0)
"""bitsandbytes nn/modules.py ``Params4bit``: from 0.43.0 ``_quantize`` quantizes the weight in
the dtype it has (``w = self.data.contiguous().cuda(device)``), so ``QuantState.dtype`` is the
load dtype; before (0.39.0 .. 0.42.0 ``Params4bit.cuda``: ``w =
self.data.contiguous().half().cuda(device)``) every 4-bit weight was quantized from an fp16
copy, and ``MatMul4Bit`` dequantizes it to fp16 before its cast to the compute dtype
(``TrainingConfig.dequantizes_through_fp16``)."""
TRL_SFT_BF16_EMBEDDINGS_SINCE = (0, 7, 5)
"""TRL's ``SFTTrainer``, given a ``peft_config`` and an unsharded 4-bit base under
``TrainingArguments(bf16=True)``, runs peft's ``prepare_model_for_kbit_training`` (every
non-quantized parameter to fp32) and then ``peft_module_casting_to_bf16`` (trl/trainer/utils.py,
first in 0.7.5, PR #1110, 2023-12-19): modules named ``*norm*`` stay fp32, ``lm_head`` /
``embed_tokens`` / ``wte`` / ``wpe`` go back to bf16 (trl v0.13.0 trl/trainer/sft_trainer.py
``__init__`` and utils.py; v0.24.0 trl/models/utils.py ``prepare_peft_model``). Before 0.7.5
the preparation alone."""
TRL_SFT_ADAPTERS_FP32_SINCE = (0, 9, 3)
"""Before it (TRL 0.7.5 .. 0.8.6) ``peft_module_casting_to_bf16`` also cast every
``BaseTunerLayer`` to bf16 (the adapters); TRL PR #1644 (99f2c94b2, 2024-05-15, "don't cast
the trainable lora layers to half precision"), first in the 0.9 releases (0.9.3, the first
tagged), keeps them fp32. The bf16 adapters of the releases before are not modelled."""
TRL_SFT_PREPARES_KBIT_UNTIL = (0, 26, 0)
"""From TRL 0.26.0 (2025-12-09) ``SFTTrainer`` no longer prepares a quantized base (no
``prepare_peft_model``: trl v0.26.0 trl/trainer/sft_trainer.py:703 calls ``get_peft_model``
alone, so peft's ``autocast_adapter_dtype=True`` makes the adapters fp32 first) and then casts
every trainable parameter of a bitsandbytes model (``is_loaded_in_4bit`` or
``is_loaded_in_8bit``) to bf16, whatever ``bf16`` / ``fp16`` say (sft_trainer.py:715-718
``param.data = param.data.to(torch.bfloat16)``; v1.9.0 sft_trainer.py:1127-1130 and 1.16.0
as ``if _is_quantized_model:``): the embeddings, norms and LM head stay in the dtype the model
was loaded in, the adapters (and their gradients and AdamW states) are bf16
(:attr:`~trainmem.specs.training.TrainingConfig.trl_bf16_adapters`)."""
TRL_SFT_CHECKPOINTING_SINCE = (0, 22, 0)
"""From TRL 0.22.0 ``SFTConfig.gradient_checkpointing`` defaults to True (trl v0.22.0
trl/trainer/sft_config.py:111-112 ``gradient_checkpointing: bool = field(default=True``;
v0.21.0 has no such field: the Trainer's False): ``--framework trl``'s default
``activation_checkpointing`` is ``full`` from it, ``none`` before."""
TRL_SFT_NON_REENTRANT_SINCE = (0, 27, 0)
"""From TRL 0.27.0 ``SFTConfig.__post_init__`` (trl v0.27.0 trl/trainer/sft_config.py:281-287;
from 1.0.0 in ``SFTTrainer.__init__``, v1.9.0 sft_trainer.py:1328-1334) sets
``gradient_checkpointing_kwargs.setdefault("use_reentrant", False)`` under transformers < 5.0,
so SFTTrainer checkpoints non-reentrantly with any transformers (5.0's own default is
non-reentrant, :data:`HF_NON_REENTRANT_CHECKPOINT_SINCE`)."""
TRL_SFT_ZERO3_REENTRANT_SINCE = (0, 28, 0)
"""From TRL 0.28.0 ``SFTTrainer.__init__`` sets ``gradient_checkpointing_kwargs["use_reentrant"]
= True`` for a PEFT model under DeepSpeed ZeRO-3 with checkpointing (trl v0.28.0
trl/trainer/sft_trainer.py:728-742, TRL issue 2514; 0.27.2 has no such block): reentrant there,
over :data:`TRL_SFT_NON_REENTRANT_SINCE`'s default."""
DEFAULT_TRL_VERSION = (1, 16, 0)
"""The TRL release assumed under ``--framework trl`` when none is given and none is installed:
the newest modelled (PyPI's newest on 2026-11-29), whose SFTTrainer, like 0.26's, casts a
bitsandbytes base's trainable parameters to bf16 without peft's k-bit preparation (checked on
a CPU run, benchmarks/trl_kbit_casting.py)."""
TRL_CASTS_BITSANDBYTES: tuple[str, ...] = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
"""The quantized bases TRL's casts see as quantized: transformers sets ``is_loaded_in_4bit`` /
``is_loaded_in_8bit`` only on a bitsandbytes model (quantizers/quantizer_bnb_4bit.py,
quantizer_bnb_8bit.py), not on a GPTQ one."""
TRL_BF16_NAMES_MATCHED = ("lm_head", "embed_tokens", "wte", "wpe")
"""The module-name fragments TRL's ``peft_module_casting_to_bf16`` casts back to bf16 (a name
that also holds ``norm`` stays fp32)."""
_TRL_NAMES_BY_FAMILY: dict[str, tuple[str, ...]] = {
    # transformers' module names for the token embedding, the LM head and a learned position
    # table (read on meta-device models of each family): GPT-2 and GPTBigCode name them
    # transformer.wte / wpe / lm_head; GPT-NeoX gpt_neox.embed_in / embed_out (transformers 4,
    # the releases TRL before 0.26 ran); BERT bert.embeddings.word_embeddings /
    # cls.predictions.decoder; BLOOM and Falcon transformer.word_embeddings (tied to lm_head)
    "gpt2": ("embedding/tokens", "embedding/positions", "lm_head"),
    "gpt_bigcode": ("embedding/tokens", "embedding/positions", "lm_head"),
    "gpt_neox": (),
    "bert": (),
    "bloom": ("lm_head",),
    "falcon": ("lm_head",),
}


def trl_bf16_tensors(model_type: str, tied: bool) -> tuple[str, ...]:
    """trainmem's names of the tensors TRL's ``peft_module_casting_to_bf16`` casts to bf16
    (:data:`TRL_BF16_NAMES_MATCHED` in the module's name): the token embedding
    (``model.embed_tokens``) and the LM head (``lm_head``) of most families, the table's for the
    others; a tied embedding is the head's weight, cast with it."""
    names = _TRL_NAMES_BY_FAMILY.get(model_type, ("embedding/tokens", "lm_head"))
    if tied and "lm_head" in names and "embedding/tokens" not in names:
        names = ("embedding/tokens", *names)
    return names


DEFAULT_TORCHAO_VERSION = (0, 18, 0)
"""The torchao release assumed when none is given: a current one (>= 0.2, NF4 quantized in
chunks)."""
TORCHAO_NF4_CHUNKED_SINCE = (0, 2, 0)
"""torchao dtypes/nf4tensor.py ``convert_to_norm_float_weight``: from 0.2 the nearest-NF4
search runs over ``CHUNK_SIZE = 1024**2`` elements at a time (Note: Quantize in Chunks); in 0.1
(torchtune's pyproject.toml pinned ``torchao==0.1`` from f97bcdaa, 2024-04-09, to c1c9f308,
2024-06-26) over the whole weight: a (numel, 16) 16-bit difference tensor and its absolute value
at once."""
TORCHAO_NF4_FACTOR_CONTIGUOUS_SINCE = (0, 3, 0)
"""torchao dtypes/nf4tensor.py ``double_quantize_scalers``: the per-256-scaler quantization
factor is computed over the expanded (n_scaler_blocks, 256) view and returned as
``quantization_factor[:, 0].view(n_scaler_blocks)``, a view that keeps the whole bf16 base
alive, in 0.1 and 0.2; torchao PR #298 (9dbc5542, 2024-05-31, in 0.3.0) returns it
``.contiguous()``."""
DEFAULT_TORCHTUNE_VERSION = (0, 6, 1)
"""The torchtune release assumed when none is given: 0.6.1, the release whose recipes and
configs the torchtune conventions follow (:mod:`trainmem.specs.trainer_configs`)."""
DEFAULT_PRECISION = "bf16-mixed"
"""The precision when neither the user nor the framework says otherwise: torch.autocast to
bf16 on fp32 weights, what current GPUs train in (``FrameworkConventions.default_precision``)."""
TORCHTUNE_PRECISIONS = ("bf16-true", "32-true")
"""What torchtune's recipes train in, at every release (0.1.0 to 0.6.1): the config's
``dtype: bf16`` / ``fp32`` (``training.get_dtype``, ``PRECISION_STR_TO_DTYPE``) for the whole
model, no autocast, fp16 refused by every training recipe (``FrameworkConventions.precisions``)."""
DEFAULT_LITGPT_VERSION = (0, 5, 13)
"""The litgpt release assumed when none is given: 0.5.13, whose model code the traced paths run
(trainmem.trace.litgpt_model; :data:`LITGPT_INSTALL`)."""
LITGPT_INSTALL = "pip install 'trainmem[litgpt]' && pip install --no-deps litgpt==0.5.13"
"""How to install litgpt's model code beside transformers 5: litgpt 0.5.13 (the newest on PyPI
on 2026-11-29) pins ``huggingface-hub<1.4``, ``jsonargparse<=4.41`` and ``psutil==7.2.2``;
transformers 5.24.0 needs ``huggingface-hub>=1.31.0,<3.0`` (from 5.4.0 ``>=1.5.0``; only 5.0 to
5.3's ``>=1.3.0,<2.0`` meet litgpt's pin), diffusers 0.42.1 ``>=1.32.0`` and gradio 6.31
``>=1.16.0``, so no resolver installs litgpt beside the test install's transformers 5.24. The
modules the trace imports (``litgpt.config``, ``litgpt.model``, ``litgpt.lora`` and, through
``litgpt/__init__.py``, ``api`` / ``utils`` / ``tokenizer``) import lightning, psutil, PyYAML,
safetensors, numpy and torch at module level, never huggingface_hub or jsonargparse: the
``litgpt`` extra is those that resolve (``trainmem[trace]`` and ``lightning>=2.6.1``, litgpt
0.5.13's own bound), and litgpt itself installs without its pins (``--no-deps``, which also
skips pip's conflict warning). Checked in a fresh venv built as README's test command builds
``.venv`` (session 27: torch 2.13.0+cpu, transformers 5.24.0, huggingface-hub 2.4.0, lightning
2.6.6, neither torch nor transformers replaced; tests/trace/test_litgpt_model.py passes, the
slow agreement tests too; session 26 first with ``pip install lightning`` after litgpt)."""
LITGPT_LORA_LINEAR_UNITS_SINCE = (0, 5, 8)
"""litgpt 0.5.8 (281510ab, "Do not wrap LoRA layers with FSDP", Mar 2025): multi-GPU
finetune/lora.py wraps each ``torch.nn.Linear`` as an FSDP1 unit (``auto_wrap_policy=
{torch.nn.Linear}``), so a frozen base linear is a flat parameter of its own, with no gradient;
from 0.5.11 (5ac69b06) FSDP2's ``fully_shard`` per parameter (``ModelParallelStrategy``). Before
(lit-gpt @8641822 to 0.5.7) each ``Block`` is one unit whose flat parameter mixes the frozen
weights with the adapters (``FrameworkConventions.fsdp_flat_parameter_grads``)."""
LITGPT_RMSNORM_FP32_WEIGHT_SINCE = (0, 4, 6)
"""litgpt 0.4.6 (916a84ca, "Gemma 2: 9b and 27b versions", Jul 2024): ``RMSNorm.forward``
returns ``(x_normed * weight.float()).to(dtype=dtype)``, the weight multiplied in fp32, so a
trained norm saves the fp32 normalised tensor; through 0.4.5 (and lit-gpt's rmsnorm.py) it
casts ``x_normed.to(dtype=dtype)`` first and saves that 16-bit copy (litgpt/model.py)."""
TORCHTUNE_RESHAPED_LOSS_SINCE = (0, 3, 0)
"""torchtune 0.3.0 (4fba6cd4, "chunked cross entropy", Aug 2024): the recipes pass the loss
the logits reshaped to (b s, V); through 0.2.1 (v0.1.0 .. v0.2.1 recipes/*_finetune_*.py
``train()``) ``logits[..., :-1, :].contiguous()`` transposed to (b, V, s - 1) (Note
[torchtune's transposed cross-entropy] in :mod:`trainmem.analytic.loss`)."""
TORCHTUNE_LAYERS_BUILT_EACH_SINCE = (0, 3, 0)
"""Through torchtune 0.2.1 every model builder builds one decoder layer and passes it with
``num_layers`` to ``TransformerDecoder``, which deep-copies it (modules/transformer.py
``_get_clones``: ``nn.ModuleList([copy.deepcopy(module) for i in range(n)])``; v0.1.0 ..
v0.2.1), so the built layer is alive beside its copies until the builder returns. From 0.3.0
(b74f4b49, "TransformerDecoderLayer Refactor") it depends on the family (llama2 and llama3
still pass one layer through 0.5.0, llama3_1 builds each layer from 0.4.0, every family from
0.6.0); the load rule is applied before 0.3.0 only (:mod:`trainmem.analytic.load`)."""
DEFAULT_TORCHTITAN_VERSION = (0, 0, 2)
"""The torchtitan release assumed when none is given: 0.0.2, the ``version.txt`` of the
December 2024 tree (9dec370) the ``fsdp2`` conventions and torchtitan's published benchmarks
(benchmarks/llama3_h100_202412_torchtitan.md) were read from."""
TORCHTITAN_COMPILED_LOSS_SINCE = (0, 1, 0)
"""torchtitan compiles its cross-entropy with ``--training.compile``
(torchtitan/components/loss.py ``build_cross_entropy_loss``: ``loss_fn =
torch.compile(loss_fn)``) since bbb1b616e (PR #1033, 2025-04-02, "Enable compiling the loss
function ... reduction of memory"); 0.1.0 (tag v0.1.0, 2025-06-17; e7c0cae's ``version.txt``)
is the first release with it. Before, train.py left it eager ("TODO: compiling loss function
causes CUDA errors, turning off for now", 9dec370, version 0.0.2)."""
SOFTMAX_BACKWARD_INPUT_DTYPE_SINCE = (1, 11)
"""The torch release from which ``_softmax_backward_data`` takes the input's dtype, not the
input: before it, ``_softmax_backward_data(Tensor grad_output, Tensor output, int dim, Tensor
self)`` (tools/autograd/derivatives.yaml, as pytorch PR #11719 shows it) needed the
softmax's input, which autograd therefore saved beside the output, so eager attention kept
its (b, a, s, s) pre-softmax scores too. transformers 4.21.0 pytorch_utils.py
``softmax_backward_data`` calls ``_softmax_backward_data(grad_output, output, parent.dim,
self)`` when ``is_torch_less_than_1_11``, else with ``self.dtype``."""
HF_NON_REENTRANT_CHECKPOINT_SINCE = (5, 0)
"""transformers modeling_utils.py: with no ``gradient_checkpointing_kwargs`` the layers are
checkpointed with ``{"use_reentrant": True}`` from PR #28538 (Jan 2024, 4.37; torch's own
reentrant default before it) and with ``{"use_reentrant": False}`` from PR #43203 (merged
2026-01-09, "Switch gradient checkpointing default to use_reentrant=False"), which 5.0 ships
(5.24's ``_activation_checkpointing_enable``)."""


def softmax_saves_input(torch_version: tuple[int, ...] | None) -> bool:
    """Autograd keeps a softmax's / log-softmax's input beside its output: torch before
    :data:`SOFTMAX_BACKWARD_INPUT_DTYPE_SINCE` (Note [Softmax saving its input before torch
    1.11] in trainmem/trace/older_softmax.py). One rule for an eager attention's scores
    (``trainmem.analytic.attention``), a cross-entropy's logits (``trainmem.analytic.loss``)
    and the traced paths' patched ops (``trainmem.trace.engine``).

    Args:
        torch_version: (major, minor, ...) of torch; None: a current release.
    """
    version = DEFAULT_TORCH_VERSION if torch_version is None else torch_version
    return version < SOFTMAX_BACKWARD_INPUT_DTYPE_SINCE


ZERO_GRAD_SET_TO_NONE_SINCE = (2, 0)
"""The torch release from which ``zero_grad()`` without an argument frees the gradients.

Note [zero_grad's default by release]
    ``torch.optim.Optimizer.zero_grad`` and ``torch.nn.Module.zero_grad`` default to
    ``set_to_none=True`` from torch 2.0 (pytorch PR #92731, "[nn] zero_grad() set_to_none
    default True", issue #92656; its BC-breaking note shows 1.13's ``module.zero_grad()``
    leaving zero tensors); before, ``set_to_none=False`` (the argument exists from 1.7, PR
    #42754; before 1.7 ``zero_grad()`` always zeroed in place), so the gradients stay
    allocated through the next forward. The loops that call it without an argument follow
    the release: a plain PyTorch loop's ``optimizer.zero_grad()``, the transformers Trainer's
    ``model.zero_grad()`` (trainer.py ``_inner_training_loop`` at 4.21.0, 4.30.2, 4.40.0 and
    5.24.0 alike), Lightning's ``LightningModule.optimizer_zero_grad`` (``optimizer.zero_grad()``
    at 1.0.0 to 2.4.0), mmcv 1.x's ``OptimizerHook``. Not DeepSpeed (its ZeRO optimizers'
    own ``zero_grad``, called by ``DeepSpeedEngine._take_model_step``) nor Megatron (its
    gradient buffer, zeroed in place: ``grad_buffer_from_init``). accelerate's
    ``AcceleratedOptimizer.zero_grad(set_to_none=None)`` passes ``set_to_none=False`` before
    0.28.0 whatever the torch release (accelerate src/accelerate/optimizer.py at v0.27.0:
    ``if set_to_none is None: set_to_none = False``; ``True`` from v0.28.0, PR #2472), which a
    loop calling ``optimizer.zero_grad()`` on accelerate's prepared optimizer meets
    (``FrameworkConventions.accelerate_optimizer_zero_grad``: accelerate-fsdp's own loop, not
    the HF Trainer's ``--fsdp``, whose ``model.zero_grad()`` is torch's):
    :data:`ACCELERATE_ZERO_GRAD_SET_TO_NONE_SINCE`, ``TrainingConfig.accelerate_version``.
    ``TrainingConfig.zero_grad_set_to_none`` given always wins."""
ACCELERATE_ZERO_GRAD_SET_TO_NONE_SINCE = (0, 28, 0)
"""The accelerate release from which ``AcceleratedOptimizer.zero_grad()`` without an argument
frees the gradients (src/accelerate/optimizer.py: v0.27.0 ``set_to_none = False``, v0.28.0
``set_to_none = True``; Note [zero_grad's default by release])."""
TORCHAO_OFFLOAD_MINIMAL_SIZE = 4096
"""torchao ``CPUOffloadOptimizer(minimal_size=4096)``: parameters with fewer elements are kept
in an optimizer on the GPU ("to avoid excessively many small transfers",
optim/cpu_offload.py)."""
TRAINER_ON_ACCELERATE_SINCE = (4, 30)
"""The transformers release from which the HF Trainer creates an ``Accelerator`` and prepares
the model through it (``Trainer._inner_training_loop``: ``model =
self.accelerator.prepare(self.model)``; its mixed precision from the ``TrainingArguments``'
``fp16`` / ``bf16``), so accelerate's ``native_amp`` wraps the forward (Note [accelerate's fp32
outputs], trainmem/analytic/loss.py). 4.30 (June 2023) is the release of the move, as its
notes and the follow-up huggingface/transformers PR #23914 ("remove the extra
``accelerator.prepare``", 2023-06-01) date it; earlier Trainers ran their own
``torch.cuda.amp.autocast`` and returned the model output as it was."""
LOOPS: tuple[str, ...] = ("drop", "step", "previous")
"""What the training loop holds of a micro-batch's outputs (``TrainingConfig.loop``):

* ``drop``: nothing past the loss (the HF Trainer: ``compute_loss`` returns only the loss and
  ``training_step`` returns ``loss.detach()``, transformers trainer.py; torchtune's recipes
  ``del logits`` before the backward);
* ``step``: the logits until the step ends (``logits = model(x)`` in a step function that also
  runs ``optimizer.step()``; ``TrainingConfig.keep_logits``);
* ``previous``: the loop binds ``logits = model(...)`` in its own scope, so the previous
  micro-batch's output, and through its ``grad_fn`` the previous autograd graph, live until
  the next forward returns (litgpt finetune/lora.py and full.py, Apr-Sep 2024: ``logits =
  model(input_ids, ...)``; ``loss = chunked_cross_entropy(...)``; ``fabric.backward(loss /
  ...)`` in the ``while`` loop of ``fit``). A graph whose backward has run keeps no saved tensors
  (``release_variables``), only what custom autograd functions store as ``ctx`` attributes
  (Note [The previous micro-batch's graph])."""

DEFAULT_UNSLOTH_VERSION = (2026, 3, 5)
"""The Unsloth release whose conventions ``--framework unsloth`` follows: 2026.3.5 (git tag
``March-2026``, 880b59a301, 2026-03-17; unsloth/models/_utils.py ``__version__``), which
requires ``unsloth_zoo>=2026.3.4`` (pyproject.toml): :data:`DEFAULT_UNSLOTH_ZOO_VERSION`."""
DEFAULT_UNSLOTH_ZOO_VERSION = (2026, 3, 4)
"""The unsloth_zoo release read with :data:`DEFAULT_UNSLOTH_VERSION`: 2026.3.4 (38f4871f,
2026-03-17, unsloth_zoo/__init__.py ``__version__``)."""
UNSLOTH_OLDEST_MODELLED = (2024, 7, 0)
"""The oldest Unsloth release ``unsloth_version`` takes: 2024.7 (tag ``July-2024``,
dae0870f), the oldest tag read; its offloaded checkpoint, LoRA kernels and attention are those
of :data:`UNSLOTH_SMART_CHECKPOINT_SINCE`'s "before" (Note [Unsloth before 2025.3])."""
UNSLOTH_CUT_CROSS_ENTROPY_SINCE = (2024, 11, 8)
"""From 2024.11.8 the loss is Apple's Cut Cross Entropy (unsloth/models/llama.py
``CausalLM_fast_forward``: ``if HAS_CUT_CROSS_ENTROPY and labels is not None: loss =
fused_linear_cross_entropy(...)``, fa8e59eb, 2024-11-17; 2024.11.8 the first release number
after it, 925a6312); before, the model returns its 16-bit logits and ``fast_cross_entropy_loss``
takes them (Note [Unsloth's cross-entropy on the logits] in trainmem/analytic/loss.py)."""
UNSLOTH_SMART_CHECKPOINT_SINCE = (2025, 3, 1)
"""From 2025.3.1 (main 8c064a37, 2025-03-03) Unsloth's Llama forward checkpoints through the
patched ``torch.utils.checkpoint`` (unsloth_zoo ``UnslothCheckpointFunction``: the reused GPU
buffer, the last layer's input kept; Note [Unsloth's offloaded gradient checkpointing]) and its
LoRA kernels add the adapters' product in place (unsloth/kernels/utils.py ``matmul_lora``:
``out.addmm_(XA, B.to(dtype), alpha = s)``, 4f166026, 2025-03-01). Before, through 2025.2.x
(tags ``December-2024``, ``2025-01``, ``2025-02``): ``Unsloth_Offloaded_Gradient_Checkpointer``
and ``out += (X @ A.to(dtype)) @ (s * B.to(dtype))`` (Note [Unsloth before 2025.3] in
trainmem/analytic/transforms/unsloth.py)."""
UNSLOTH_DEQUANT_BUFFER_SINCE = (2025, 2, 1)
"""From 2025.2.1 (144190bd, 2025-02-06) ``matmul_lora`` dequantizes a 4-bit weight into the
kept ``WEIGHT_BUFFERS`` (``fast_dequantize(..., use_global_buffer = True)``); before, into a
new tensor per matmul, freed after it, as bitsandbytes does."""
UNSLOTH_FUSED_LOSS_SINCE = (2025, 8, 5)
"""From 2025.8.5 (806bee24, 2025-08-13) the loss is unsloth_zoo's ``unsloth_fused_ce_loss``
(Note [Unsloth's fused cross-entropy]); from :data:`UNSLOTH_CUT_CROSS_ENTROPY_SINCE` until then
Apple's Cut Cross Entropy (Note [Unsloth's Cut Cross Entropy] in trainmem/analytic/loss.py)."""
UNSLOTH_SDPA_GQA_SINCE = (2025, 12, 2)
"""From 2025.12.2 (b5869307, 2025-12-10; unsloth/utils/attention_dispatch.py ``run_attention``)
Unsloth's attention without flash-attn and without xformers hands grouped keys and values to
SDPA (``enable_gqa = True``); before, every path but flash-attn's expanded them to all query
heads and copied them (Note [Unsloth's attention] in trainmem/analytic/attention.py)."""
TRANSFORMERS_SDPA_GQA_SINCE = (4, 54)
"""The transformers release from which its SDPA path can hand grouped keys and values to the
kernel (``enable_gqa``; 4.54.0 integrations/sdpa_attention.py ``use_gqa_in_sdpa``: torch >= 2.5
and no attention mask). Before it every SDPA path expands them to all query heads first:
``repeat_kv`` unconditionally in ``sdpa_attention_forward`` (4.48.1 .. 4.53.x
integrations/sdpa_attention.py) and in each model's own ``*SdpaAttention.forward`` before that
(4.40.0 models/llama/modeling_llama.py ``LlamaSdpaAttention.forward``: ``key_states =
repeat_kv(key_states, self.num_key_value_groups)``), whatever the torch release."""
UNSLOTH_ALLOC_CONF = "expandable_segments:True"
"""unsloth_zoo/__init__.py (2026.3.4), imported by ``import unsloth``: with torch >= 2.9, when
``PYTORCH_ALLOC_CONF`` is not set, ``os.environ["PYTORCH_ALLOC_CONF"] =
"expandable_segments:True"`` ("Reduce VRAM usage by reducing fragmentation")."""
UNSLOTH_ALLOC_CONF_BEFORE_TORCH_2_9 = (
    "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]"
)
"""The same before torch 2.9, when ``PYTORCH_CUDA_ALLOC_CONF`` is not set."""
UNSLOTH_OFFLOAD_MIN_SEQ_LEN = 512
"""unsloth/models/_utils.py ``apply_unsloth_gradient_checkpointing`` (2026.3.5):
``use_gradient_checkpointing="unsloth"`` with ``max_seq_length < 512`` unpatches the offloaded
checkpoint and runs plain (reentrant) checkpointing ("For seq < 512, standard gc is faster")."""
UNSLOTH_GPU_BUFFER_ELEMENTS = 2 * 256 * 2048
"""unsloth_zoo gradient_checkpointing.py ``initialize_unsloth_gradient_checkpointing``
(2026.3.4): ``GPU_BUFFERS = tuple([torch.empty(2*256*2048, dtype = dtype, device = ...)])``,
one buffer per GPU in the model's 16-bit dtype, allocated when the checkpoint is patched
(``FastLanguageModel.from_pretrained``) and kept; ``UnslothCheckpointFunction.forward`` grows
it with ``GPU_BUFFER.resize_(new_size)`` to the largest offloaded layer input."""
UNSLOTH_OFFLOAD_MIN_BYTES = 2 * 1024 * 1024
"""unsloth_zoo gradient_checkpointing.py (2026.3.4): ``MINIMUM_SIZE = 2 * 1024 * 1024 //
n_bytes`` elements ("Minimum size to enable Unsloth GC is 2MB"); a layer input of no more
elements stays saved on the GPU as under plain checkpointing."""
PEFT_DEFAULT_LORA_TARGETS: tuple[str, ...] = ("q", "v")
"""The LoRA targets when neither the user nor the framework says otherwise: peft's default
``target_modules`` for Llama-style models (peft utils/constants.py
``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"] = ["q_proj", "v_proj"]``)."""
UNSLOTH_LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""The LoRA targets under ``--framework unsloth`` when none are given: every attention and MLP
linear, at the tag ``March-2026`` (unsloth 2026.3.5) read three ways alike: unsloth/models/
llama.py ``FastLlamaModel.get_peft_model(target_modules = ["q_proj", "k_proj", "v_proj",
"o_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout = 0.0, ...)`` (what
``FastLanguageModel.get_peft_model`` runs, and what its notebooks pass), cli/config.py
``LoraConfig.target_modules = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"`` and
studio/backend/assets/configs/model_defaults/default.yaml ``target_modules`` (the same seven,
``lora_dropout: 0.0``). Unsloth's LoRA kernels apply only with all seven and no dropout
(Note [Unsloth's fast LoRA]). Its ``lora_dropout = 0.0`` is trainmem's default already."""
DEEPSPEED_TORCH_OPTIM_OPTIMIZERS = ("sgd", "sgd-momentum", "adafactor")
"""Optimizers DeepSpeed builds as the ``torch.optim`` class of that name with its defaults
(DeepSpeed v0.16.4 runtime/engine.py ``_configure_basic_optimizer``: ``torch_optimizer =
getattr(torch.optim, self.optimizer_name())``), so torch's own default implementation runs
(foreach on CUDA), not the ``FusedAdam`` / ``FusedLion`` it picks for Adam, AdamW and Lion."""
DEFAULT_DEEPSPEED_VERSION = (0, 19, 8)
"""The DeepSpeed release assumed when none is given: a current one (>= 0.17.6)."""
DEEPSPEED_ACCUMULATES_IN_MODEL_DTYPE_SINCE = (0, 17, 6)
"""deepspeed/runtime/engine.py ``get_data_types``: without ``data_types.grad_accum_dtype``,
DeepSpeed before 0.17.6 accumulated bf16 gradients in fp32 when ZeRO is off (so
``_do_optimizer_sanity_check`` chose ``BF16_Optimizer``; bf16 accumulation without ZeRO raised
``NotImplementedError``); since 0.17.6 the default is the model dtype and bf16 without ZeRO runs
``FP16_Optimizer`` (``DDP_BFLOAT16``). Checked on the 0.17.5 and 0.17.6 sdists."""
DEEPSPEED_REFUSES_BF16_FP32_WITHOUT_ZERO_SINCE = (0, 18, 5)
"""deepspeed/runtime/engine.py ``_do_optimizer_sanity_check``: up to 0.18.4 bf16 weights with
fp32 gradient accumulation and ZeRO off ran ``BF16_Optimizer`` (``elif model_dtype ==
torch.bfloat16 and grad_accum_dtype == torch.float32: return BFLOAT16``); from 0.18.5 that
branch is gone and the mix falls through to ``raise NotImplementedError(f"unsupported mix of
{model_dtype=} and {grad_accum_dtype=}")``. Checked on the 0.18.4 and 0.18.5 sdists (and
0.19.8)."""
GRAD_ACCUM_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""``data_types.grad_accum_dtype`` values, torch spellings (DeepSpeed runtime/config.py
``DtypeEnum`` also takes fp32 / bf16 / fp16 / float / half ..., read in
:mod:`trainmem.specs.framework_configs`)."""
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = ("zero", "bf16", "fp16", "none")
"""What :func:`deepspeed_optimizer_wrapper` returns: the ZeRO optimizer, ``BF16_Optimizer``,
``FP16_Optimizer`` (also for bf16 as ``DDP_BFLOAT16``), the bare optimizer (fp32)."""


DEEPSPEED_ZERO3_REUSES_FP32_PARTITION_SINCE = (0, 18, 2)
"""deepspeed/runtime/zero/stage3.py ``_create_fp32_partitions``: since 0.18.2 a partition that
already holds the master dtype on the device is itself the optimizer's fp32 partition ("we don't
need another copy of the weights"); before, ``.clone().float().detach()`` always copied it.
Checked on the 0.18.1 and 0.18.2 sdists."""


DEEPSPEED_ZERO3_ONE_RANK_VIEWS_SINCE = (0, 9, 0)
"""deepspeed/runtime/zero/partition_parameters.py ``all_gather_coalesced``: since 0.9.0 (PR
#2953, commit 4d27225f, "Simplify world_size=1") a parameter partitioned over one rank is not
gathered (0.9.0 ``if self.world_size == 1: return _no_gather_coalesced(params)``; 0.12.3
``self.num_partitions == 1``; 0.19.5 ``_partition_world_size(param) == 1``): its
``NoGatherCoalescedHandle`` sets ``param.data = param.ds_tensor.data.to(device).view(
param.ds_shape)``, the partition itself when it is on the GPU (``.to`` returns it, no copy)
and one host-to-device copy when it is offloaded. 0.8.0 had no such path (a gathered buffer
and, offloaded, the partition's copy beside it). Checked on the 0.8.0, 0.9.0, 0.12.3 and 0.19.5
tags."""


def deepspeed_zero3_gathers_on_one_rank(version: tuple[int, ...] | None) -> bool:
    """Whether DeepSpeed ZeRO-3 over one rank still gathers its parameters into buffers of their
    own: only before :data:`DEEPSPEED_ZERO3_ONE_RANK_VIEWS_SINCE` (None: a current release)."""
    return (version or DEFAULT_DEEPSPEED_VERSION) < DEEPSPEED_ZERO3_ONE_RANK_VIEWS_SINCE


DEEPSPEED_LAZY_OPTIMIZER_STATES_SINCE = (0, 13, 2)
"""deepspeed/runtime/zero/stage_1_and_2.py and stage3.py ``initialize_optimizer_states``: up to
0.13.1 the ZeRO optimizer stepped its client optimizer once when it was built (ZeRO-1/2
``self.optimizer.step()``, ZeRO-3 ``self._optimizer_step(i)`` per sub-group), so the optimizer
states existed from ``deepspeed.initialize``; PR #5104 (commit 18179807, "Remove optimizer step
on initialization"), first in 0.13.2, dropped that step: the states are made by the first
``step()``. Checked on the 0.13.1 and 0.13.2 tags."""


DEEPSPEED_FLATTENS_ON_DEVICE_SINCE = (0, 19, 0)
"""deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``: up to 0.18.9
every trainable parameter of a group is moved to the CPU (``move_to_cpu``, ``empty_cache()``)
and the flat 16-bit group built there and copied to the GPU; from 0.19.0 the group is flattened
on the GPU when it has room for the flat buffer (``flatten_on_accelerator = available_memory >=
flat_buffer_bytes``), the parameters still on it, and their blocks freed when they become
views of the flat buffer (``_update_model_bit16_weights``). Checked on the 0.18.9 and 0.19.0
tags."""


def deepspeed_states_at_init(version: tuple[int, ...] | None) -> bool:
    """Whether the ZeRO optimizer makes its optimizer states when it is built (before
    :data:`DEEPSPEED_LAZY_OPTIMIZER_STATES_SINCE`; None: a current release, lazily)."""
    return (version or DEFAULT_DEEPSPEED_VERSION) < DEEPSPEED_LAZY_OPTIMIZER_STATES_SINCE


def deepspeed_flattens_on_device(version: tuple[int, ...] | None) -> bool:
    """Whether ZeRO-1/2 flatten a parameter group on the GPU beside its parameters (from
    :data:`DEEPSPEED_FLATTENS_ON_DEVICE_SINCE`; None: a current release)."""
    return (version or DEFAULT_DEEPSPEED_VERSION) >= DEEPSPEED_FLATTENS_ON_DEVICE_SINCE


def litgpt_head_chunk_rows(seq_len: int, chunks: int) -> int:
    """Rows of the sequence per output-head chunk when litgpt's ``GPT.forward`` runs its head
    in ``chunks`` pieces (``lm_head_chunk_size``: ``x.split(lm_head_chunk_size, dim=1)``,
    litgpt/model.py v0.5.13): ceil(seq_len / chunks); 0 (one head output) for ``chunks`` 0."""
    return -(-seq_len // chunks) if chunks else 0


def litgpt_last_chunk_rows(seq_len: int, chunks: int) -> int:
    """Rows of the last piece of litgpt's chunked head output (``split`` leaves the remainder
    last): seq_len itself when unchunked."""
    size = litgpt_head_chunk_rows(seq_len, chunks)
    return seq_len - size * (-(-seq_len // size) - 1) if size else seq_len


def deepspeed_copies_fp32_weights(zero_stage: int, version: tuple[int, ...] | None) -> bool:
    """Whether DeepSpeed's ZeRO optimizer keeps its own fp32 copy of this rank's partition of
    *fp32* weights (16-bit weights always get one: the master weights).

    ZeRO-1/2 clone the partition whatever its dtype (deepspeed/runtime/zero/stage_1_and_2.py
    ``DeepSpeedZeroOptimizer.__init__``: ``weights_partition = self.
    parallel_partitioned_bit16_groups[i][partition_id].detach().clone().to(device=self.device,
    dtype=self.master_weights_and_grads_dtype)``, appended to ``single_partition_of_fp32_groups``
    and stepped by the optimizer; ``.to(self.device).clone().float()`` in 0.16.4, the same in
    0.18.9 and 0.19.8). ZeRO-3 does only before
    :data:`DEEPSPEED_ZERO3_REUSES_FP32_PARTITION_SINCE`.

    Args:
        zero_stage: the ZeRO stage (0: no ZeRO optimizer, no copy).
        version: the DeepSpeed release; None: a current one.

    Returns:
        True when the fp32 partition is a second tensor beside the model's weights.
    """
    if zero_stage in (1, 2):
        return True
    old = (version or DEFAULT_DEEPSPEED_VERSION) < DEEPSPEED_ZERO3_REUSES_FP32_PARTITION_SINCE
    return zero_stage == 3 and old


def deepspeed_grad_accum_dtype(
    model_dtype: str,
    zero_stage: int,
    grad_accum_dtype: str | None,
    version: tuple[int, ...] | None,
) -> str:
    """The dtype DeepSpeed accumulates gradients in (deepspeed/runtime/engine.py
    ``get_data_types``).

    Args:
        model_dtype: the 16-bit (or fp32) model dtype, torch spelling.
        zero_stage: the ZeRO stage in the DeepSpeed config (0: ZeRO off).
        grad_accum_dtype: ``data_types.grad_accum_dtype`` when given (it always wins).
        version: the DeepSpeed release; None: a current one.

    Returns:
        A torch dtype spelling.
    """
    if grad_accum_dtype is not None:
        return grad_accum_dtype
    old = (version or DEFAULT_DEEPSPEED_VERSION) < DEEPSPEED_ACCUMULATES_IN_MODEL_DTYPE_SINCE
    if old and model_dtype == "bfloat16" and zero_stage == 0:
        return "float32"
    return model_dtype


DEEPSPEED_BF16_OPTIMIZER_ZERO_GRAD_SINCE = (0, 16, 5)
"""deepspeed/runtime/bf16_optimizer.py: up to 0.16.4 ``BF16_Optimizer.backward`` starts with
``clear_lp_grads()``, which sets every bf16 ``.grad`` to None (``set_to_none = False if
self.graph_harvesting else True``), and the class has no ``zero_grad``; from 0.16.5 (b418cf6c1,
"Training multiple models", #7018) ``clear_lp_grads(set_to_none=False)`` zeroes them in place
and ``zero_grad(set_to_none=True)`` frees them, called by engine.py ``_take_model_step`` after
``optimizer.step()`` under ZeRO (``if self.zero_optimization() and hasattr(self.optimizer,
"zero_grad")``; ``pass`` without ZeRO up to 0.18.5). Checked on the v0.16.4 and v0.16.5 tags."""
DEEPSPEED_BF16_IMMEDIATE_GRAD_UPDATE: tuple[tuple[tuple[int, ...], bool], ...] = (
    ((0, 16, 5), True),
    ((0, 17, 1), False),
)
"""``bf16.immediate_grad_update``'s default, from the release it holds (False before the first):
runtime/constants.py ``BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT`` False up to 0.16.4 and True
from 0.16.5 (b418cf6c1); from 0.17.1 (e440506be, #6976) ``BF16_Optimizer`` reads
``bfloat16_config.immediate_grad_update``, runtime/precision_config.py
``immediate_grad_update: bool = False`` (the same in 0.19.5)."""


def deepspeed_bf16_grads_released(zero_stage: int, version: tuple[int, ...] | None) -> str:
    """When ``BF16_Optimizer`` frees the bf16 ``.grad`` tensors the backward makes (the fp32
    buffer it accumulates them into is never freed).

    Args:
        zero_stage: the ZeRO stage (0, or 1: the stages that run ``BF16_Optimizer``).
        version: the DeepSpeed release; None: a current one.

    Returns:
        ``"backward"``: at the start of the next backward, so they live through the next
        forward (up to 0.16.4, :data:`DEEPSPEED_BF16_OPTIMIZER_ZERO_GRAD_SINCE`);
        ``"step"``: by ``zero_grad`` after the optimizer step (ZeRO-1 from 0.16.5);
        ``"never"``: zeroed in place by every backward and never freed (ZeRO off from 0.16.5,
        whose ``_take_model_step`` does not call the wrapper's ``zero_grad``; DeepSpeed
        refuses that setup from 0.18.5).
    """
    v = version or DEFAULT_DEEPSPEED_VERSION
    if v < DEEPSPEED_BF16_OPTIMIZER_ZERO_GRAD_SINCE:
        return "backward"
    return "step" if zero_stage >= 1 else "never"


def deepspeed_bf16_immediate_grad_update(version: tuple[int, ...] | None) -> bool:
    """``bf16.immediate_grad_update``'s default for ``version``
    (:data:`DEEPSPEED_BF16_IMMEDIATE_GRAD_UPDATE`)."""
    v = version or DEFAULT_DEEPSPEED_VERSION
    out = False
    for since, value in DEEPSPEED_BF16_IMMEDIATE_GRAD_UPDATE:
        if v >= since:
            out = value
    return out


def deepspeed_optimizer_wrapper(
    model_dtype: str,
    grad_accum_dtype: str,
    zero_stage: int,
    *,
    cpu_offload: bool,
    pipeline: bool,
    version: tuple[int, ...] | None,
) -> str:
    """Which optimizer wrapper DeepSpeed builds (deepspeed/runtime/engine.py
    ``_do_optimizer_sanity_check``, the same in 0.14.4 and 0.19.8 but for the bf16 case marked
    below).

    Args:
        model_dtype: the model dtype, torch spelling.
        grad_accum_dtype: :func:`deepspeed_grad_accum_dtype`.
        zero_stage: the ZeRO stage in the DeepSpeed config.
        cpu_offload: ``offload_optimizer`` to the CPU (ZeRO-Offload).
        pipeline: DeepSpeed pipeline parallelism (a ``PipelineModule``).
        version: the DeepSpeed release; None: a current one.

    Returns:
        One of :data:`DEEPSPEED_OPTIMIZERS`: ``zero`` (ZeRO on, except bf16 weights with fp32
        accumulation at stage 1 without offload, which is ``bf16``), ``bf16``
        (``BF16_Optimizer``: bf16 weights with fp32 accumulation, or bf16 accumulation under
        pipeline parallelism), ``fp16`` (``FP16_Optimizer``: fp16 weights, and since 0.17.6 bf16
        weights with bf16 accumulation, ``DDP_BFLOAT16``), ``none`` (fp32).

    Raises:
        SpecError: a mix DeepSpeed refuses (``NotImplementedError``): bf16 accumulation of bf16
            weights without ZeRO before 0.17.6, fp32 accumulation of bf16 weights without ZeRO
            from 0.18.5, or any other mix of model and accumulation dtypes without ZeRO.
    """
    if zero_stage > 0:
        bf16_fp32 = model_dtype == "bfloat16" and grad_accum_dtype == "float32"
        return "bf16" if bf16_fp32 and zero_stage == 1 and not cpu_offload else "zero"
    if model_dtype == grad_accum_dtype:
        if model_dtype == "float32":
            return "none"
        if model_dtype == "bfloat16" and pipeline:
            return "bf16"
        old = (version or DEFAULT_DEEPSPEED_VERSION) < DEEPSPEED_ACCUMULATES_IN_MODEL_DTYPE_SINCE
        if model_dtype == "bfloat16" and old:
            raise SpecError(
                "grad_accum_dtype",
                "DeepSpeed before 0.17.6 refuses bf16 gradient accumulation without ZeRO "
                "(engine.py: 'Bfloat16 wrapper must use a gradient accumulation type of fp32'); "
                "allowed: float32, or a ZeRO stage",
            )
        return "fp16"
    refused = (
        version or DEFAULT_DEEPSPEED_VERSION
    ) >= DEEPSPEED_REFUSES_BF16_FP32_WITHOUT_ZERO_SINCE
    if model_dtype == "bfloat16" and grad_accum_dtype == "float32" and not refused:
        return "bf16"
    if model_dtype == "bfloat16" and grad_accum_dtype == "float32":
        raise SpecError(
            "grad_accum_dtype",
            "DeepSpeed 0.18.5 and later refuse bf16 weights with float32 gradient accumulation "
            "without ZeRO (runtime/engine.py _do_optimizer_sanity_check: NotImplementedError "
            "'unsupported mix of model_dtype=torch.bfloat16 and "
            "grad_accum_dtype=torch.float32'); allowed: bfloat16, a ZeRO stage, or "
            "--deepspeed-version 0.18.4 or older",
        )
    raise SpecError(
        "grad_accum_dtype",
        f"DeepSpeed has no optimizer for {model_dtype} weights with {grad_accum_dtype} gradient "
        f"accumulation without ZeRO (engine.py: 'unsupported mix'); allowed: {model_dtype}"
        + (", float32" if model_dtype == "bfloat16" else ""),
    )


@functools.cache
def installed_transformers_version() -> tuple[int, ...] | None:
    """(major, minor, ...) of the installed transformers, read from its package metadata
    without importing it (``"5.0.0.dev0"`` -> (5, 0, 0)); None when it is not installed."""
    return installed_version("transformers")


def transformers_release_of(version: str | None) -> tuple[int, ...]:
    """(major, minor, ...) of the transformers whose model code runs: ``version`` (a
    ``transformers_version`` setting) when given, else the installed one, else
    :data:`DEFAULT_TRANSFORMERS_VERSION`.

    Raises:
        SpecError: ``version`` is not a version string.
    """
    given = parse_version("transformers_version", version)
    return given or installed_transformers_version() or DEFAULT_TRANSFORMERS_VERSION


def default_trl_release() -> tuple[int, ...]:
    """The TRL release ``--framework trl`` assumes when none is given: the installed one (read
    from its package metadata, not imported), else :data:`DEFAULT_TRL_VERSION`."""
    return installed_version("trl") or DEFAULT_TRL_VERSION


TRL_RELEASES_MODELLED = (
    "a TRL release such as 0.13.0 or 1.16.0: before 0.7.5 (peft's k-bit preparation alone), "
    "0.9.3 .. 0.25 (then the embeddings and LM head back to bf16), from 0.26 (no "
    "preparation, a bitsandbytes base's adapters in bf16); 0.7.5 .. 0.8.6 are refused under "
    "the preparation (bf16 LoRA layers)"
)
"""The TRL release ranges ``trl_version`` models, named in its errors."""


def installed_version(distribution: str) -> tuple[int, ...] | None:
    """(major, minor, ...) of an installed distribution (``"transformers"``, ``"diffusers"``,
    ``"timm"``), read from its package metadata without importing it (``"5.0.0.dev0"`` ->
    (5, 0, 0)); None when it is not installed."""
    text = dist_info_version(distribution)
    if text is None:
        import importlib.metadata  # NB: here, not at the top: 40 ms of every start-up

        try:
            text = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
    parts: list[int] = []
    for part in text.split("+", 1)[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts) or None


def dist_info_version(distribution: str) -> str | None:
    """The ``Version:`` of ``distribution`` as ``importlib.metadata.version`` finds it, read
    without importing ``importlib.metadata`` (about 40 ms of CPU: email, csv, zipfile), when
    that is certain: the first ``<name>-*.dist-info`` of the first ``sys.path`` directory that
    has one, in directory order, as importlib's path finder searches. None when that is not
    certain (an ``.egg-info`` met first, a path entry that is a file such as a zip, no
    ``METADATA``) or nothing is found: then ``importlib.metadata`` decides.

    Source: CPython 3.11 Lib/importlib/metadata/__init__.py (``FastPath`` lists each
    ``sys.path`` entry, ``Lookup.search`` yields the ``.dist-info`` matches before the
    ``.egg-info`` ones, ``Prepared.normalize``: runs of ``-_.`` as ``_``, lower case).
    """
    import os
    import sys

    if any(
        hasattr(finder, "find_distributions") and getattr(finder, "__name__", "") != "PathFinder"
        for finder in sys.meta_path
    ):
        return None  # another finder may know distributions: importlib asks it too
    wanted = re.sub(r"[-_.]+", "_", distribution).lower()
    for entry in sys.path:
        path = entry or "."
        if os.path.isfile(path):
            return None  # a zip or an egg: importlib reads inside it
        try:
            names = os.listdir(path)
        except OSError:
            continue
        found = None
        for name in names:
            low = name.lower()
            stem, dot, suffix = low.rpartition(".")
            if suffix not in ("dist-info", "egg-info") or not dot:
                continue
            if re.sub(r"[-_.]+", "_", stem.split("-", 1)[0]) != wanted:
                continue
            if suffix == "egg-info":
                return None
            found = found or name
        if found is not None:
            return _metadata_version(os.path.join(path, found, "METADATA"))
    return None


def _metadata_version(path: str) -> str | None:
    """The ``Version:`` header of a ``METADATA`` file; None without one."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the headers end at the first empty line
                if line.startswith("Version:"):
                    return line[len("Version:") :].strip()
    except OSError:
        return None
    return None


def parse_version(field: str, text: str | None) -> tuple[int, ...] | None:
    """``"2.5"`` / ``"2.5.1+cu121"`` / ``"0.43.2"`` -> (2, 5) / (2, 5, 1) / (0, 43, 2).

    Raises:
        SpecError: not text, or not dot-separated integers (a local suffix after ``+`` is
            ignored); a number is refused, as ``2.10`` would be read as 2.1.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise SpecError(
            field, f"must be a version string like '2.5' or '0.43.2' (or None), got {text!r:.40}"
        )
    core = text.split("+", 1)[0].strip()
    parts = core.split(".")
    if not core or not all(p.isdigit() for p in parts):
        hint = ""
        if re.search(r"(dev|a|b|rc)\d*$", parts[-1]) and all(p.isdigit() for p in parts[:2]):
            # a nightly / pre-release of X.Y carries part of X.Y's changes, not all of them
            hint = (
                "; a nightly or pre-release: give the last release its code matches (a "
                f"{parts[0]}.{parts[1]} nightly: usually {parts[0]}.{int(parts[1]) - 1})"
                if int(parts[1]) > 0
                else ""
            )
        raise SpecError(field, f"{text!r} is not a version like 2.5 or 0.43.2{hint}")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkConventions:
    """What one framework does with the bytes of a training step.

    Every field names the source file it mirrors; ``tests/analytic/test_frameworks.py`` derives
    each rule's bytes by hand from that source.
    """

    name: str
    """The ``--framework`` value."""
    autocast: bool
    """``*-mixed`` runs the model under ``torch.autocast`` on fp32 weights (fp32 residual stream,
    per-op casts). pytorch-amp, hf-trainer (``Trainer(bf16=True)`` -> accelerate
    ``native_amp``), litgpt (Lightning ``MixedPrecision``)."""
    master_weights: bool
    """``*-mixed`` keeps 16-bit model weights and gradients and an fp32 master copy inside the
    optimizer (DeepSpeed ``bf16_optimizer.py`` / ``stage_1_and_2.py``; Megatron
    ``optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params``)."""
    fp32_grad_buffer: bool
    """Gradients accumulate in fp32 beside 16-bit weights (Megatron
    ``accumulate_allreduce_grads_in_fp32``, ``distributed/param_and_grad_buffer.py``)."""
    grad_buffer_from_init: bool
    """The gradient buffer is one contiguous tensor allocated when the model is wrapped and
    never freed, so it is alive in the forward pass too (Megatron
    ``distributed/param_and_grad_buffer.py``: ``self.grad_data = torch.zeros(...)`` in
    ``_ParamAndGradBuffer.__init__``; ``zero_grad_buffer`` zeroes it in place)."""
    fsdp_param_dtype_follows_precision: bool
    """``*-mixed`` with FSDP gathers (and, unsharded, casts) the weights to the compute dtype
    before each wrapped module runs, so layers compute on 16-bit weights, the residual stream is
    16-bit and autocast has nothing to cast (accelerate ``utils/dataclasses.py``
    ``FullyShardedDataParallelPlugin.set_mixed_precision``: ``MixedPrecision(param_dtype=dtype,
    reduce_dtype=dtype, buffer_dtype=dtype)``; torch FSDP2 ``MixedPrecisionPolicy``)."""
    fsdp_reduce_in_compute_dtype: bool
    """The unsharded gradient FSDP reduce-scatters is in the compute dtype (accelerate's
    ``reduce_dtype=dtype``); False: fp32 (torchtitan / trainmem's FSDP2 policy
    ``reduce_dtype=float32``)."""
    zero_ipg_buckets: bool
    """ZeRO keeps contiguous gradient buckets of ``reduce_bucket_size`` elements (DeepSpeed
    ``contiguous_gradients=True``, the default): stage 1/2 allocate one (two with
    ``overlap_comm``) in ``backward()`` (runtime/zero/stage_1_and_2.py ``self.ipg_buffer``);
    stage 3 one at init, kept for the whole run (runtime/zero/stage3.py
    ``self.__ipg_bucket_flat_buffer``)."""
    zero3_grad_partition_from_init: bool
    """ZeRO-3 keeps this rank's gradient partition in one flat buffer allocated when the
    optimizer is built, so the (sharded) gradients exist in the forward pass too (DeepSpeed
    runtime/zero/stage3.py ``self.grad_partitions_flat_buffer = torch.zeros(sum(p.
    partition_numel() ...), dtype=self.gradient_accumulation_dtype, ...)``)."""
    accelerate_optimizer_zero_grad: bool
    """The loop zeroes the gradients with ``optimizer.zero_grad()`` on the optimizer
    accelerate prepared (``AcceleratedOptimizer``), whose default follows the accelerate
    release (Note [zero_grad's default by release]): accelerate-fsdp, a loop on accelerate's
    FSDP plugin (an HF Trainer run with ``--fsdp`` calls ``model.zero_grad()`` and keeps its
    stack's default, ``trainer_sharding``)."""
    deepspeed_optimizer_wrappers: bool
    """The optimizer is wrapped as DeepSpeed's engine chooses (deepspeed/runtime/engine.py
    ``_do_optimizer_sanity_check``, :func:`deepspeed_optimizer_wrapper`): the ZeRO optimizer
    with ZeRO on, ``BF16_Optimizer`` for bf16 weights with fp32 gradient accumulation (ZeRO off,
    or ZeRO-1 without CPU offload), ``FP16_Optimizer`` for 16-bit weights and gradients without
    ZeRO; the gradient accumulation dtype is DeepSpeed's ``data_types.grad_accum_dtype``
    (:func:`deepspeed_grad_accum_dtype`). ``BF16_Optimizer`` keeps one flat fp32 gradient buffer
    of every trainable parameter from when the optimizer is built (runtime/bf16_optimizer.py
    ``_setup_for_real_optimizer``: ``fp32_groups_gradients_flat = torch.zeros_like(
    bf16_groups_flat[i], dtype=self.grad_acc_dtype)``), into which each bf16 gradient is added
    and then freed as soon as autograd produces it (``immediate_grad_update``, default True,
    runtime/constants.py ``BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT``;
    ``accumulate_hp_grads_and_remove_lp``); its fp32 master weights and optimizer states cover
    only this rank's 1/N partition over the data-parallel ranks (``fp32_groups_flat_partition``),
    as in ZeRO-1."""
    optimizer_offload_torchao: bool
    """Without ZeRO / FSDP, ``offload="optimizer"`` is torchao's ``CPUOffloadOptimizer`` (and
    ``"optimizer+gradients"`` the same with ``offload_gradients=True``), as torchtune's
    low-memory recipes configure it: parameters of fewer than ``minimal_size`` =
    :data:`TORCHAO_OFFLOAD_MINIMAL_SIZE` elements stay in an optimizer on the GPU, with their
    states and gradients; each larger parameter's gradient is copied to pinned CPU memory by a
    post-accumulate-grad hook and, with ``offload_gradients``, freed on the GPU at once
    (torchao optim/cpu_offload.py ``CPUOffloadOptimizer.__init__``, ``backward_hook``; "not
    compatible with gradient accumulation", torchao optim/README.md)."""
    fused_multi_tensor_adam: bool
    """Adam runs as one fused multi-tensor kernel with no parameter-sized temporary (Megatron
    ``optimizer/__init__.py``: TransformerEngine / apex ``FusedAdam``; DeepSpeed
    ``ops/adam/fused_adam.py`` ``FusedAdam``, chosen for ``"type": "Adam"/"AdamW"``)."""
    trainer_default_fused_since_torch: tuple[int, ...] | None
    """The torch release from which the framework's default optimizer is torch's fused AdamW
    (transformers ``training_args.py``: ``default_optim = "adamw_torch"``, ``"adamw_torch_fused"``
    if ``is_torch_greater_or_equal_than_2_8``); None: the framework keeps torch's default."""
    adafactor_from_transformers: bool
    """``adafactor`` is transformers' ``Adafactor`` (the HF Trainer's ``optim="adafactor"``,
    transformers trainer.py ``get_optimizer_cls_and_kwargs``); False: ``torch.optim.Adafactor``
    where torch has it (>= 2.5), transformers' before."""
    adapter_dtype_follows_weights: bool
    """LoRA A and B are kept in the model's weight dtype (lit-gpt ``lora.py``, torchtune
    ``LoRALinear``; DeepSpeed casts every parameter of the wrapped module, peft's fp32 adapters
    included, to the 16-bit dtype: runtime/engine.py ``_configure_distributed_model``,
    ``self.module.bfloat16()`` in 0.16.9, ``_cast_module_mixed_precision`` in 0.19.8); False:
    peft upcasts adapters on a 16-bit base to fp32 (``autocast_adapter_dtype=True``, peft
    ``tuners/tuners_utils.py``)."""
    hf_model_code: bool
    """The model is the transformers class, with its code paths: GPT-2's training-time
    ``DynamicCache`` (``use_cache=True``) whose ``torch.cat`` copies of k and v SDPA saves, and
    ``gelu_new`` written as separate tanh-formula ops (transformers models/gpt2/modeling_gpt2.py,
    activations.py ``NewGELUActivation``). False: the framework's own model code (Megatron's
    fused bias-GELU and attention, lit-gpt, torchtune)."""
    peft_kbit_training: bool
    """A quantized base is prepared with peft's ``prepare_model_for_kbit_training``: every
    parameter that is not quantized (embeddings, norms, LM head) is cast to fp32, so the
    residual stream leaving the fp32 embedding is fp32 too (peft utils/other.py: ``param.data =
    param.data.to(torch.float32)`` for non-``Params4bit`` 16-bit parameters)."""
    own_model_code: bool
    """The framework runs its own model code, not transformers': fused GELU kernel, fused qkv
    viewed into q, k, v, chunked LM head (lit-gpt ``model.py``)."""
    fp32_model_output: bool
    """The model output (the logits) is cast to fp32 and kept until the step ends (Lightning
    Fabric ``_FabricModule.forward`` -> ``precision.convert_output``)."""
    accelerate_fp32_outputs: bool
    """Under ``*-mixed`` the model is prepared by accelerate with ``native_amp``, whose wrapped
    forward returns every 16-bit output tensor cast to fp32 (the logits: one fp32 tokens x
    vocabulary copy; Note [accelerate's fp32 outputs], trainmem/analytic/held_outputs.py):
    the HF Trainer (``Trainer._inner_training_loop``: ``self.accelerator.prepare(self.model)``)
    and accelerate's FSDP1. False: DeepSpeed (accelerate sets no ``native_amp`` under
    ``DistributedType.DEEPSPEED``) and loops accelerate does not prepare."""
    dtensor_sequence_parallel: bool
    """Sequence parallelism as torchtitan applies it with DTensor: ``PrepareModuleInput(
    input_layouts=Shard(1), desired_input_layouts=Replicate())`` on the attention and
    feed-forward modules (and the output layer's ``ColwiseParallel(input_layouts=Shard(1))``)
    all-gathers the normed input before the column-parallel linears, whose matmuls save that
    full-sequence tensor (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``;
    torch/distributed/tensor/parallel/style.py). False: Megatron saves the sequence shard and
    all-gathers it again in backward (Korthikanti et al. 2022 sec. 4.2.2; megatron/core/
    tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``)."""
    dtensor_vocab_parallel_embedding: bool
    """Tensor parallelism shards the token embedding over the vocabulary with DTensor
    (torchtitan's ``RowwiseParallel`` on ``tok_embeddings``), whose weight gradient DTensor
    computes for the whole vocabulary: ``embedding_dense_backward`` has no strategy with a
    vocabulary-sharded (``Shard(0)``) output, only ``Shard(1)`` or ``Partial``
    (torch/distributed/tensor/_ops/_embedding_ops.py ``embedding_dense_backward_strategy``),
    so each tensor-parallel rank holds a [V, h] partial gradient until it is reduce-scattered
    to its [V / t, h] shard; FSDP2 accumulating it across pipeline micro-batches keeps it
    whole, upcast to the reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``). Seen in
    the trace (tests/trace/test_pipeline.py, llama-3.2-1b PP x TP 2 x FSDP 2 stage 0). False:
    Megatron's ``VocabParallelEmbedding`` computes its shard's gradient only."""
    float8_tensor_parallel: bool
    """With float8 training and tensor parallelism the layer linears take torchao's float8 TP
    styles, as torchtitan applies them (``enable_float8_tensorwise_tp``:
    ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``,
    torchao/float8/float8_tensor_parallel.py; torchtitan/models/llama3/infra/parallelize.py
    ``apply_tp``): every linear's input is cast to float8 before its matmul (before the
    sequence all-gather with sequence parallelism), so the matmul saves a float8 input. See
    Note [Float8 tensor-parallel inputs] (trainmem/analytic/activations.py). False: no float8
    TP plan (Megatron's TE float8 is not modelled)."""
    fsdp_shards_over_context_parallel: bool
    """FSDP shards over the data-parallel and the context-parallel ranks together: torchtitan's
    ``fully_shard`` takes the flattened ``dp_shard_cp`` mesh (torchtitan/models/llama3/infra/
    parallelize.py ``apply_fsdp``; torchtitan/distributed/parallel_dims.py; at b5bcd76, Aug
    2026, its "fsdp" mesh of ``dp_shard * cp`` ranks), as accelerate's FSDP2 does (1.10+,
    v1.14.0 parallelism_config.py ``fsdp_dim_names``: ``dp_shard_cp``; state.py refuses CP
    without FSDP2). True for ``fsdp2`` and for ``pytorch-amp``, whose ZeRO-3 is FSDP2's
    ``fully_shard``: no release runs FSDP2 beside CP over the data ranks alone, which would
    leave the CP ranks' gradients unreduced; the trace engine shards over both
    (trainmem/trace/parallel.py ``parallelize``). Before (pytorch-amp over the data ranks
    only) the formulas were 13.3 % above the generic path on a 2048-wide Llama, FSDP 4 x
    CP 2, and 6.2 % on llama-3.2-1b at 1 x 2048 tokens. False: the other frameworks' sharding
    over the data ranks only (accelerate refuses CP under FSDP1; Megatron's distributed
    optimizer)."""
    fsdp_collective_streams: bool
    """FSDP allocates on its own CUDA streams, whose blocks the caching allocator keeps in
    per-stream pools (c10/cuda/CUDACachingAllocator.cpp: a free block is found only among blocks
    of the requesting stream). FSDP2: each layer's flat all-gather output on the all-gather
    copy-in stream (``foreach_all_gather``), the reduce-scatter output, which becomes the
    sharded gradient, on the reduce-scatter stream (``foreach_reduce``; torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py). FSDP1 the same (torch/distributed/fsdp/
    _runtime_utils.py, torch 2.2 .. 2.5): ``_unshard`` allocates the unsharded flat parameter
    (the all-gather output) under ``state._device_handle.stream(unshard_stream)``, and
    ``_post_backward_hook`` makes the reduce-scatter output, kept as the sharded gradient
    (``_accumulate_sharded_grad``: ``flat_param._saved_grad_shard``), under
    ``stream(state._post_backward_stream)`` (``_get_reduce_scatter_tensors``:
    ``new_sharded_grad = torch.empty_like(chunks[0])``); the unsharded gradient it reduces is
    autograd's, on the default stream. True for the FSDP frameworks: ``fsdp2``, torchtune
    (FSDP1 in its early-2024 recipes, FSDP2 from 6deeda92, Sep 2024), litgpt (FSDP1) and
    fsdp-qlora (FSDP1, torch 2.2), accelerate-fsdp (FSDP1: accelerate's plugin and the HF
    Trainer's ``--fsdp``). Under FSDP1 (fsdp-qlora, torchtune before 0.3, accelerate-fsdp) the
    root's and every layer unit's gathers are on the unshard stream (Note [FSDP1 unshard stream
    pool], trainmem/analytic/transforms/sharding.py), and fsdp-qlora's CPU-offloaded shard's
    copy on the pre-unshard stream (Note [FSDP1 offloaded shard copy]). False: everything on
    the default stream."""
    fsdp1_checkpoint_outside_units: bool
    """transformers' gradient checkpointing wraps the decoder layer that FSDP1 wrapped
    (modeling_llama.py ``self._gradient_checkpointing_func(decoder_layer.__call__, ...)`` on the
    ``FullyShardedDataParallel`` unit of accelerate's ``TRANSFORMER_BASED_WRAP``), and under
    LoRA the layer's flat parameter is frozen: transformers' Trainer gives accelerate peft's
    ``fsdp_auto_wrap_policy`` (trainer.py ``_fsdp_qlora_plugin_updates``, 4.39 .. 4.48), which
    puts each LoRA leaf in a unit of its own. With reentrant checkpointing FSDP1 then keeps
    each layer's input and its gradient until the backward ends (Note [FSDP1 frozen units
    under reentrant checkpointing]), with transformers before
    :data:`GRADIENT_CHECKPOINTING_LAYER_SINCE` only (from 4.52 the layer checkpoints itself,
    inside the unit). True for accelerate-fsdp; False where the framework
    checkpoints inside the unit (fsdp_qlora's ``apply_activation_checkpointing`` after
    wrapping) or runs FSDP2."""
    fsdp2_post_backward: bool
    """FSDP2's post-backward order (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
    ``FSDPParamGroup.post_backward``): a group reshards its parameters, then releases the
    previous group's reduce-scatter input (at most ``reduce_scatter_max_input_buffers`` = 1
    kept in flight) before ``foreach_reduce`` allocates its own, which stays until the next
    group's post-backward; the last layer's is released only by the root's final callback
    after the whole backward, the token embedding's included (_fsdp_state.py
    ``_root_post_backward_final_callback``). So each layer's reduce-scatter input lives
    through the next layer's backward, and after the first layer's post-backward its
    parameters are resharded while its reduce-scatter input stays. Seen in the trace
    (llama-3.2-1b FSDP 2 x TP 2 + SP, full AC). True for ``fsdp2`` and for ``pytorch-amp``,
    whose ZeRO-3 is FSDP2's ``fully_shard`` on the fp32 weights (``trainmem.trace.fsdp``).
    False: the layer's reduction within its own backward (FSDP1's ``_post_backward_hook``)."""
    fsdp_unsharded_leaf_parameters: bool
    """ZeRO-3 is FSDP2, whose unsharded parameters are ``nn.Parameter`` leaves (requiring grad,
    not views) over the all-gather output (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    ``FSDPParam.init_unsharded_param``), so autocast caches their 16-bit casts until the
    autocast region exits, as for unsharded weights (aten/src/ATen/autocast_mode.cpp
    ``cached_cast``); a DTensor parameter (tensor parallelism) is cast on its local tensor,
    which is no leaf, so nothing is cached. Seen in the trace of llama-3.2-1b ``pytorch-amp``
    FSDP 2, full AC (TP 2: no cache). False: FSDP1's gathered weights are views of the flat
    parameter, never cached."""
    torchtitan_pipeline_split: bool
    """Pipeline stages as torchtitan splits the layers when no split points are given
    (torchtitan/parallelisms/pipelining_utils.py ``generate_split_points``, Dec 2024): single-
    stage schedules (1F1B, GPipe) one stage per rank, multi-stage ones (interleaved 1F1B) two
    (``virtual_pipeline_stages``); ``L // stages`` layers each, the first stage that many, the
    next ``L % stages`` stages one more, the last stage the rest; rank r holds stages r, r + p,
    ... (``stage_ids_this_rank``, loop style). False: Megatron's even split, the first stages
    ``ceil(L / p)`` layers and the last the rest."""
    torchtitan_train_loop: bool
    """The train loop is torchtitan's (torchtitan/train.py ``forward_backward_step``: ``pred =
    model(inputs)``, ``loss = self.loss_fn(pred, labels)``, ``del pred``, ``loss.backward()``),
    whose cross-entropy ``--compile`` compiles from torchtitan 0.1
    (:data:`TORCHTITAN_COMPILED_LOSS_SINCE`, ``TrainingConfig.torchtitan_version``)."""
    fsdp_flat_parameter_grads: bool
    """FSDP (``FullyShardedDataParallel``, FSDP1) flattens each wrapped module's parameters into
    one ``FlatParameter``; with ``use_orig_params=True`` (Lightning Fabric 2.1's default,
    lightning/fabric/strategies/fsdp.py ``self._fsdp_kwargs.setdefault("use_orig_params",
    True)``) frozen and trainable parameters may share it, and it requires grad if any of them
    does (torch 2.1 distributed/fsdp/flat_param.py ``_validate_tensors_to_flatten``:
    ``flat_param_requires_grad = flat_param_requires_grad or tensor.requires_grad``). Its
    gradient then covers the whole unit, the frozen base weights of a LoRA layer included:
    unsharded before the reduce-scatter, a full shard after it, kept until ``zero_grad``
    (``_use_sharded_grad_views`` gives the frozen views no ``.grad`` but the flat gradient stays;
    ``_reset_flat_param_grad_info_if_needed`` frees it once every view's ``.grad`` is None).
    A unit with no trainable parameter (lit-gpt's root: embedding, final norm, LM head) gets
    no gradient."""
    fsdp_no_sync_accumulation: bool
    """Gradient accumulation runs the micro-batches before the last one under FSDP's
    ``no_sync()`` (lit-gpt finetune/*.py ``fabric.no_backward_sync(model,
    enabled=is_accumulating)`` -> Lightning fabric/strategies/fsdp.py
    ``_FSDPBackwardSyncControl.no_backward_sync``: ``return module.no_sync()``): torch
    distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` returns before the
    reduce-scatter when ``not state._sync_gradients``, so every unit's *unsharded* gradient
    stays in ``flat_param.grad`` (``prepare_gradient_for_backward``: "Expects `.grad` to be the
    unsharded gradient in `no_sync()`") until the last micro-batch reduce-scatters it layer by
    layer. FULL_SHARD still frees the gathered parameters in backward
    (``_should_free_in_backward``)."""
    ddp_reducer_buckets: bool
    """At ZeRO stage 0 with data parallelism the model is wrapped in torch's
    ``DistributedDataParallel``, whose reducer keeps a flat copy of every trainable gradient
    for the run (torch/csrc/distributed/c10d/reducer.cpp ``initialize_buckets``; Note [DDP
    gradient buckets] in trainmem/analytic/transforms/ddp.py)."""
    quantized_base_saves_input: bool
    """A quantized base linear may save its 16-bit input (bitsandbytes ``MatMul4Bit`` before
    0.43.2, ``MatMul8bitLt`` always); False: the quantized linear saves only its weight
    (torchtune's torchao ``NF4Tensor``, torchao ``dtypes/nf4tensor.py`` ``LinearNF4``)."""
    bnb_4bit_quantized_from_fp16: bool
    """bitsandbytes 4-bit weights are quantized from an fp16 copy whatever the training dtype, so
    their ``QuantState.dtype`` is float16: Lightning Fabric's ``BitsandbytesPrecision``
    (lit-gpt's ``--quantize bnb.nf4*`` / ``bnb.fp4*``) quantizes in ``_Linear4bit.quantize``
    with ``w = weight.contiguous().to(device=device, dtype=torch.half)`` before
    ``bnb.functional.quantize_4bit(w, ...)`` (lightning src/lightning/fabric/plugins/precision/
    bitsandbytes.py, 2.1.0 to 2.5.0; lightning 2.2.1 and 2.3.0 read), and bitsandbytes'
    ``quantize_4bit`` records ``dtype=A.dtype`` (functional.py 0.42.0). ``MatMul4Bit`` then
    dequantizes to fp16 and casts to the input's dtype (``F.dequantize_4bit(B, quant_state)
    .to(A.dtype)``, autograd/_functions.py 0.42.0, forward and backward): under a bf16 compute
    dtype both copies of the weight are alive at the cast
    (:func:`~trainmem.analytic.buffers.dequantize_cast_bytes`). False: bitsandbytes quantizes
    the weight, from an fp16 copy before 0.43.0 (``TrainingConfig.dequantizes_through_fp16``),
    from the dtype it was loaded in since (transformers' ``from_pretrained``)."""
    vocab_parallel_cross_entropy: bool
    """A causal LM's loss is Megatron's vocabulary-parallel cross-entropy (megatron-core 0.9.0
    megatron/core/tensor_parallel/cross_entropy.py ``_VocabParallelCrossEntropy``, called by
    ``LanguageModule.compute_language_model_loss``): the forward upcasts the [s, b, V / t]
    logits once (``.float()``), subtracts the row max, exponentiates and normalises that fp32
    copy in place and saves it (``exp_logits``) as the softmax; the backward turns the saved
    softmax into the logits gradient in place (``grad_2d[arange_1d, masked_target_1d] -=
    softmax_update``, ``grad_input.mul_``). See Note [Megatron's vocabulary-parallel
    cross-entropy] (trainmem/analytic/activations.py). False: ``F.cross_entropy`` on the
    upcast logits (a separate fp32 log-softmax output and two fp32 gradients)."""
    untied_output_head: bool
    """The framework's model has an output head of its own where the Hugging Face config ties
    it to the token embedding (Gemma, Falcon, Llama 3.2 ...): litgpt's ``GPT`` always builds
    ``self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, ...)`` beside
    ``transformer.wte`` and never ties them (litgpt/model.py @43c44323 Apr 2024 and @00af8b0d
    Sep 2024), and scripts/convert_hf_checkpoint.py copies ``transformer.wte.weight`` into
    ``lm_head.weight`` when the checkpoint has none; under ``--quantize bnb.*`` Lightning's
    plugin quantizes that head like every linear. False: the config's tying holds."""
    loop: str
    """What the framework's training loop holds of a micro-batch's outputs (:data:`LOOPS`):
    ``previous`` for litgpt (finetune/lora.py, full.py: ``logits`` and ``loss`` bound in
    ``fit``'s loop, rebound by the next micro-batch), ``step`` for Answer.AI's fsdp_qlora
    (train.py e4968fd / 50efa1e, Mar 2024: ``output = model(...)``, ``loss = output.loss``,
    ``loss.backward()``, ``optimizer.step()``, then ``output = None`` and ``loss = None``
    before the next micro-batch: the output lives through the backward and the optimizer
    step), ``drop`` for the others (the HF Trainer's ``training_step`` returns
    ``loss.detach()``; torchtune ``del logits``; the plain loop is taken as one that drops
    them, ``--loop previous`` says otherwise)."""
    pipeline_last_stage_output_is_loss: bool
    """The last pipeline stage hands the schedule the reduced loss of each micro-batch, not its
    logits (megatron-core 0.9.0 megatron/core/pipeline_parallel/schedules.py ``forward_step``:
    on ``is_pipeline_last_stage()`` ``output_tensor = loss_func(output_tensor)``, divided by the
    number of micro-batches, and only ``loss_reduced`` is appended to ``forward_data_store``;
    ``GPTModel.forward`` returns the loss when labels are given, models/gpt/gpt_model.py), so no
    micro-batch's logits outlive its loss. False: torch.distributed.pipelining appends each
    micro-batch's output to ``output_chunks`` (Note [Pipeline stage buffers])."""
    pipeline_sent_outputs_freed: bool
    """A pipeline stage frees each sent output's data and receives every tensor into a buffer
    allocated for that message (Note [Megatron's pipeline stage buffers] in
    :mod:`trainmem.analytic.pipeline`: megatron-core ``deallocate_output_tensor`` under
    Megatron-LM's ``deallocate_pipeline_outputs=True``, p2p_communication.py ``_communicate``'s
    ``torch.empty``). False: torch.distributed.pipelining keeps the outputs in ``fwd_cache`` to
    their backward and one receive buffer per micro-batch for the schedule's life."""

    unsloth_alloc_conf: bool
    """The caching allocator runs with Unsloth's ``PYTORCH_CUDA_ALLOC_CONF`` unless the user
    gives one (:data:`UNSLOTH_ALLOC_CONF`, :meth:`default_alloc_conf`)."""
    unsloth_offloaded_checkpointing: bool
    """Full activation checkpointing is Unsloth's ``use_gradient_checkpointing="unsloth"``
    (unsloth_zoo gradient_checkpointing.py ``UnslothCheckpointFunction``, 2026.3.4): each
    checkpointed layer's input is copied to a pinned CPU buffer instead of being saved on the
    GPU, but the last layer's after the first step; in the backward it comes back into one
    reused GPU buffer (Note [Unsloth's offloaded gradient checkpointing],
    trainmem/analytic/transforms/unsloth.py)."""
    unsloth_fused_cross_entropy: bool
    """A causal LM's loss is Unsloth's fused linear + cross-entropy (unsloth_zoo 2026.3.4
    fused_losses/cross_entropy_loss.py ``unsloth_fused_ce_loss``, called by unsloth 2026.3.5
    models/llama.py ``CausalLM_fast_forward`` whenever labels are given and
    ``UNSLOTH_RETURN_LOGITS`` is unset): the logits are never returned; the input gradient is
    computed in the forward and saved (Note [Unsloth's fused cross-entropy],
    trainmem/analytic/loss.py); before 2025.8.5 (``unsloth_version``) Apple's Cut Cross
    Entropy (Note [Unsloth's Cut Cross Entropy])."""
    unsloth_fast_rms_layernorm: bool
    """Under LoRA the RMSNorms are Unsloth's Triton ``Fast_RMS_Layernorm`` (unsloth 2026.3.5
    kernels/rms_layernorm.py, called by models/llama.py ``LlamaModel_fast_forward`` /
    ``fast_rms_layernorm``): its forward saves the input in its own dtype and the fp32 rstd
    per row (``ctx.save_for_backward(X, W, r)``: r h + 4 per token), its backward writes the
    input gradient into the incoming one in place (``dX = dY``, no weight gradient) and makes
    nothing else. Applied to the final norm (the layers' run inside checkpointing)."""
    fused_rms_norm: bool
    """The RMSNorms are fused kernels that save their input in its own dtype and the fp32
    inverse RMS per row, and hold no transients (r h + 4 per token): megatron-core's ``TENorm``
    is TransformerEngine's ``te.pytorch.RMSNorm`` (core_r0.9.0 extensions/transformer_engine.py),
    Apex's ``FusedRMSNormAffineMixedDtypesFunction`` without TE (apex normalization/
    fused_layer_norm.py ``ctx.save_for_backward(input_, weight_, invvar)``); Note [Megatron's
    fused RMSNorm], trainmem/trace/fused_norm.py."""
    unsloth_attention: bool
    """Attention is Unsloth's ``LlamaAttention_fast_forward`` (flash-attn when installed,
    ``--attention flash``; else xformers, else SDPA), which before 2025.12.2 saves grouped keys
    and values expanded to every query head (Note [Unsloth's attention],
    trainmem/analytic/attention.py)."""
    unsloth_fast_lora: bool
    """LoRA runs through Unsloth's own autograd functions where ``patch_peft_model`` installs
    them (unsloth 2026.3.5 models/llama.py: ``lora_dropout == 0`` and ``bias == "none"``;
    ``LoRA_MLP`` when gate, up and down carry adapters, ``LoRA_QKV`` when q, k and v do,
    ``LoRA_W`` for o; kernels/fast_lora.py): their matmuls cast A and B to the input's dtype
    (``A.to(dtype)``), so no fp32 copy of the input exists, and the 4-bit base is
    dequantized by ``fast_dequantize(..., use_global_buffer = True)`` into one reused
    ``WEIGHT_BUFFER`` in the forward (kernels/utils.py) and into a fresh tensor for the input
    gradient in the backward (Note [Unsloth's fast LoRA], trainmem/analytic/lora.py)."""
    default_optimizer: str
    """The optimizer when none is given: ``adamw``; Unsloth's notebooks ``adamw-8bit``
    (``SFTConfig(optim = "adamw_8bit")``). An explicit ``optimizer`` always wins."""
    default_lora_targets: tuple[str, ...]
    """The LoRA targets when none are given: peft's ``q``, ``v``
    (:data:`PEFT_DEFAULT_LORA_TARGETS`); Unsloth all seven linears
    (:data:`UNSLOTH_LORA_TARGETS`, ``FastLanguageModel.get_peft_model``'s default
    ``target_modules``). An explicit value always wins."""
    default_activation_checkpointing: str
    """The activation checkpointing when none is given: ``none``; Unsloth ``full``
    (``FastLanguageModel.get_peft_model(use_gradient_checkpointing = "unsloth")``, its default,
    unsloth/models/llama.py 2026.3.5). An explicit value always wins."""
    default_checkpoint_reentrant: bool | None
    """Whether the HF model code's gradient checkpointing is torch's reentrant ``checkpoint``
    when ``checkpoint_reentrant`` is not given; None: transformers' own default
    (``TrainingConfig.hf_checkpoint_reentrant``). LLaMA-Factory True: ``use_reentrant_gc``
    defaults to True (v0.9.5 src/llamafactory/hparams/model_args.py:149-150) and
    model_utils/checkpointing.py:174-175 passes ``gradient_checkpointing_kwargs={"use_reentrant":
    model_args.use_reentrant_gc}`` (before the option, 64bac4bc7 Dec 2024, the same True was
    hard-coded); axolotl True: utils/config/__init__.py:377-383 (v0.18.0) sets
    ``gradient_checkpointing_kwargs = {"use_reentrant": True}`` when none are given. An explicit
    value always wins."""
    trl_sft_trainer: bool
    """The training loop is TRL's ``SFTTrainer`` (``--framework trl``): its release
    (:attr:`~trainmem.specs.training.TrainingConfig.trl_release`) defaults to the installed
    one, else :data:`DEFAULT_TRL_VERSION`, and sets how a quantized base is prepared and the
    checkpointing defaults. Elsewhere only a ``trl_version`` given says SFTTrainer runs."""
    strips_trl_peft_casts: bool
    """The stack removes TRL's PEFT set-up and its bf16 cast from the SFTTrainer it runs:
    Unsloth rewrites the trainer's source (unsloth 015bdef0 unsloth/models/rl.py:3683-3711:
    the 0.26 PEFT block and ``if getattr(model, "is_loaded_in_4bit", ...)`` / ``if
    _is_quantized_model:`` become ``if False:``), so a ``trl_version`` changes no dtype."""
    hf_trainer_loop: bool
    """The step is the transformers Trainer's (``Trainer._inner_training_loop``), run by the
    traced engine as its plain loop with its default optimizer (``estimate._traced_hf_trainer``):
    hf-trainer and the stacks built on it, LLaMA-Factory (its ``CustomSeq2SeqTrainer``,
    src/llamafactory/train/sft/trainer.py) and axolotl (``AxolotlTrainer``,
    src/axolotl/core/trainers/base.py)."""
    sharded_activation_checkpointing: str | None
    """The activation checkpointing when none is given and the step runs on more than one
    data-parallel rank; None: :attr:`default_activation_checkpointing` there too. litgpt
    ``full``: every fine-tuning script checkpoints each ``Block`` whenever ``devices *
    num_nodes > 1``, with no setting to turn it off: finetune/full.py and adapter*.py
    ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, ...)``
    (FSDP1; lit-gpt @8641822 to litgpt 0.5.13), finetune/lora.py the same through 0.5.7,
    ``auto_wrap_policy={torch.nn.Linear}`` from 0.5.8 (281510ab, Mar 2025) and from 0.5.11
    (5ac69b06, Aug 2025) ``ModelParallelStrategy(parallelize_fn=...)``, whose
    ``parallelize_fn(..., activation_checkpointing=True)`` wraps every block in
    ``checkpoint_wrapper`` before FSDP2's ``fully_shard``. An explicit value wins: litgpt's
    pretrain.py shards (``FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=
    "HYBRID_SHARD")``) without checkpointing."""
    precisions: tuple[str, ...] | None
    """The precisions the framework trains in (Lightning names); None: every one. torchtune:
    ``bf16-true`` and ``32-true`` only: its recipes build the whole model in the config's
    ``dtype`` (``training.get_dtype``, ``training.set_default_dtype``; recipes/
    full_finetune_single_device.py, lora_finetune_single_device.py, *_distributed.py, v0.1.0
    to v0.6.1), run no ``torch.autocast`` and no GradScaler (torchtune 0.1's
    ``utils.get_autocast`` / ``get_gradient_scaler`` are called by no recipe), and refuse fp16
    ("full fp16 training is not supported with this recipe"), so neither ``*-mixed`` nor
    ``16-true`` runs."""
    default_precision: str
    """The precision when none is given: ``bf16-mixed`` (torch.autocast to bf16, what current
    GPUs train in), torchtune ``bf16-true`` (its configs' ``dtype: bf16``)."""

    def default_alloc_conf(self, torch_version: tuple[int, ...] | None) -> str:
        """``PYTORCH_CUDA_ALLOC_CONF`` the framework sets when the user sets none: Unsloth's
        expandable segments (:data:`UNSLOTH_ALLOC_CONF`; with torch before 2.9
        :data:`UNSLOTH_ALLOC_CONF_BEFORE_TORCH_2_9`); ``""`` (torch's defaults) otherwise.

        Args:
            torch_version: (major, minor, ...) of torch; None: a current release.
        """
        if not self.unsloth_alloc_conf:
            return ""
        version = DEFAULT_TORCH_VERSION if torch_version is None else torch_version
        return UNSLOTH_ALLOC_CONF if version >= (2, 9) else UNSLOTH_ALLOC_CONF_BEFORE_TORCH_2_9

    def zero_grad_set_to_none(
        self,
        torch_version: tuple[int, ...] | None,
        accelerate_version: tuple[int, ...] | None = None,
    ) -> bool:
        """Whether the loop's ``zero_grad()`` frees the gradients when
        ``zero_grad_set_to_none`` is not given: torch's default for ``torch_version`` (Note
        [zero_grad's default by release]); False on accelerate's optimizer before 0.28.0
        (:attr:`accelerate_optimizer_zero_grad`); True under DeepSpeed's ZeRO optimizers and
        Megatron's gradient buffer, which have their own.

        Args:
            torch_version: (major, minor, ...) of torch; None: a current release.
            accelerate_version: (major, minor, ...) of accelerate; None: a current release.
        """
        if self.deepspeed_optimizer_wrappers or self.grad_buffer_from_init:
            return True
        if self.accelerate_optimizer_zero_grad and accelerate_version is not None:
            if accelerate_version < ACCELERATE_ZERO_GRAD_SET_TO_NONE_SINCE:
                return False
        version = DEFAULT_TORCH_VERSION if torch_version is None else torch_version
        return version >= ZERO_GRAD_SET_TO_NONE_SINCE

    def default_optimizer_implementation(
        self, torch_version: tuple[int, ...] | None, optimizer: str = "adamw"
    ) -> str:
        """The implementation that runs when none is asked for.

        Args:
            torch_version: (major, minor, ...) of torch; None: a current release.
            optimizer: ``TrainingConfig.optimizer``: under DeepSpeed one of
                :data:`DEEPSPEED_TORCH_OPTIM_OPTIMIZERS` is torch's class with torch's default.

        Returns:
            ``fused`` (fused multi-tensor Adam, or the framework's fused default from
            ``trainer_default_fused_since_torch``), ``foreach`` (torch >= 2.0 on CUDA:
            torch/optim/optimizer.py ``_default_to_fused_or_foreach``) or ``for-loop``
            (torch < 2.0: ``foreach=None`` meant the per-parameter loop).
        """
        version = DEFAULT_TORCH_VERSION if torch_version is None else torch_version
        torch_class = (
            self.deepspeed_optimizer_wrappers and optimizer in DEEPSPEED_TORCH_OPTIM_OPTIMIZERS
        )
        if self.fused_multi_tensor_adam and not torch_class:
            return "fused"
        since = self.trainer_default_fused_since_torch
        if since is not None and version >= since:
            return "fused"
        return "foreach" if version >= (2, 0) else "for-loop"


def _row(name: str, **fields: object) -> FrameworkConventions:
    defaults: dict[str, object] = {
        "ddp_reducer_buckets": False,
        "autocast": False,
        "master_weights": False,
        "fp32_grad_buffer": False,
        "grad_buffer_from_init": False,
        "fsdp_param_dtype_follows_precision": False,
        "fsdp_reduce_in_compute_dtype": False,
        "fused_multi_tensor_adam": False,
        "optimizer_offload_torchao": False,
        "accelerate_optimizer_zero_grad": False,
        "deepspeed_optimizer_wrappers": False,
        "zero_ipg_buckets": False,
        "zero3_grad_partition_from_init": False,
        "trainer_default_fused_since_torch": None,
        "adapter_dtype_follows_weights": False,
        "adafactor_from_transformers": False,
        "hf_model_code": True,
        "peft_kbit_training": False,
        "own_model_code": False,
        "fp32_model_output": False,
        "accelerate_fp32_outputs": False,
        "quantized_base_saves_input": True,
        "bnb_4bit_quantized_from_fp16": False,
        "fsdp_flat_parameter_grads": False,
        "fsdp_no_sync_accumulation": False,
        "dtensor_sequence_parallel": False,
        "dtensor_vocab_parallel_embedding": False,
        "float8_tensor_parallel": False,
        "fsdp_shards_over_context_parallel": False,
        "torchtitan_pipeline_split": False,
        "torchtitan_train_loop": False,
        "fsdp_collective_streams": False,
        "fsdp1_checkpoint_outside_units": False,
        "fsdp2_post_backward": False,
        "fsdp_unsharded_leaf_parameters": False,
        "vocab_parallel_cross_entropy": False,
        "pipeline_last_stage_output_is_loss": False,
        "pipeline_sent_outputs_freed": False,
        "loop": "drop",
        "untied_output_head": False,
        "precisions": None,
        "default_precision": DEFAULT_PRECISION,
        "unsloth_offloaded_checkpointing": False,
        "unsloth_alloc_conf": False,
        "unsloth_fused_cross_entropy": False,
        "unsloth_fast_rms_layernorm": False,
        "fused_rms_norm": False,
        "unsloth_attention": False,
        "unsloth_fast_lora": False,
        "default_optimizer": "adamw",
        "default_lora_targets": PEFT_DEFAULT_LORA_TARGETS,
        "default_activation_checkpointing": "none",
        "sharded_activation_checkpointing": None,
        "default_checkpoint_reentrant": None,
        "hf_trainer_loop": False,
        "trl_sft_trainer": False,
        "strips_trl_peft_casts": False,
    }
    return FrameworkConventions(name=name, **{**defaults, **fields})  # type: ignore[arg-type]


_HF_TRAINER: dict[str, object] = {
    "ddp_reducer_buckets": True,
    "autocast": True,
    "peft_kbit_training": True,
    "adafactor_from_transformers": True,
    "trainer_default_fused_since_torch": (2, 8),
    "accelerate_fp32_outputs": True,
    "hf_trainer_loop": True,
}
"""The transformers Trainer's conventions, shared by the stacks that run it with its optimizer
defaults (hf-trainer, TRL's SFTTrainer, LLaMA-Factory)."""

FRAMEWORK_CONVENTIONS: dict[str, FrameworkConventions] = {
    row.name: row
    for row in (
        _row(
            "pytorch-amp",
            ddp_reducer_buckets=True,
            autocast=True,
            peft_kbit_training=True,
            optimizer_offload_torchao=True,
            dtensor_sequence_parallel=True,
            dtensor_vocab_parallel_embedding=True,
            float8_tensor_parallel=True,
            fsdp2_post_backward=True,
            fsdp_unsharded_leaf_parameters=True,
            fsdp_shards_over_context_parallel=True,
        ),
        _row(
            "hf-trainer",
            **_HF_TRAINER,
        ),
        # TRL's SFTTrainer on the HF Trainer (trl/trainer/sft_trainer.py ``SFTTrainer(Trainer)``):
        # the HF Trainer's conventions, peft's k-bit preparation before 0.26 (TRL prepares the
        # base itself, TrainingConfig.kbit_fp32_upcast), checkpointing on from 0.22
        # (TRL_SFT_CHECKPOINTING_SINCE, resolved by release in _resolve_precision).
        _row(
            "trl",
            **_HF_TRAINER,
            default_activation_checkpointing="full",
            trl_sft_trainer=True,
        ),
        # LLaMA-Factory v0.9.5 (hiyouga/LLaMA-Factory): the HF Trainer + peft, with its YAML
        # defaults: gradient checkpointing on (``disable_gradient_checkpointing: False``,
        # hparams/model_args.py:145-146; model_utils/checkpointing.py:166-175 enables it),
        # reentrant (``use_reentrant_gc: True``, model_args.py:149-150), LoRA on every linear
        # but the head (``lora_target: "all"``, hparams/finetuning_args.py:81-82; for a Llama
        # the seven), lora_dropout 0 (finetuning_args.py:73-74, trainmem's default too), the
        # Trainer's optimizer (no ``optim`` default of its own). Off by default and so not
        # here: ``upcast_layernorm`` / ``upcast_lmhead_output`` (model_args.py:153-158),
        # ``pure_bf16`` (finetuning_args.py:456-457), unsloth's checkpointing and liger
        # (model_args.py:133-138). Its checkpoint wrapper (checkpointing.py:80-103) checkpoints
        # only layers with a trainable parameter, which under LoRA / full fine-tuning is every
        # layer, and sets requires_grad on the hidden states (what peft's
        # ``enable_input_require_grads`` does for the reentrant checkpoint).
        _row(
            "llama-factory",
            **_HF_TRAINER,
            default_lora_targets=UNSLOTH_LORA_TARGETS,
            default_activation_checkpointing="full",
            default_checkpoint_reentrant=True,
        ),
        # axolotl v0.18.0 (axolotl-ai-cloud/axolotl): the HF Trainer + peft; gradient
        # checkpointing off by default (utils/schemas/config.py:600-601), reentrant when on
        # (utils/config/__init__.py:377-383); ``optimizer`` defaults to ``adamw_torch_fused``
        # whatever the torch (utils/schemas/training.py:122-123; v0.17.0:78
        # ``OptimizerNames.ADAMW_TORCH_FUSED``); LoRA targets only as the user lists them
        # (``lora_target_linear`` None, utils/schemas/peft.py:58-59: peft's default), lora_dropout
        # 0.0 (peft.py:80). Opt-in and so not here: sample packing, its cut-cross-entropy and
        # liger plugins, ``gradient_checkpointing: offload``.
        # Note [axolotl casts a k-bit base's embeddings and norms back]: axolotl calls peft's
        # ``prepare_model_for_kbit_training`` on a quantized LoRA / QLoRA base
        # (loaders/model.py:455 ``_prepare_model_for_quantization``, v0.18.0), which casts every
        # 16-bit parameter that is not quantized to fp32, and right after it, for any
        # ``adapter`` lora / qlora (``needs_fa2_dtype``, :447-449) but QLoRA under FSDP (where
        # the preparation is skipped: :1003-1009), casts every module named ``*norm*`` and the
        # embedding modules (``embed_tokens``, ``lm_head``: loaders/utils.py:231-239) back to
        # ``torch_dtype`` (:458-477 ``should_convert``, ``_convert_embedding_modules_dtype``
        # :1025-1047); the same in v0.8.0 utils/models.py:1264-1277. So no fp32 upcast: the
        # embeddings, norms and head stay 16-bit and so does the residual stream. Not
        # modelled: what stays fp32 (linear biases, a GPT-2 / BLOOM embedding named otherwise,
        # the opt-in ``fp32_norms``).
        _row(
            "axolotl",
            ddp_reducer_buckets=True,
            autocast=True,
            peft_kbit_training=False,
            adafactor_from_transformers=True,
            fused_multi_tensor_adam=True,
            accelerate_fp32_outputs=True,
            hf_trainer_loop=True,
            default_checkpoint_reentrant=True,
        ),
        _row(
            "accelerate-fsdp",
            accelerate_optimizer_zero_grad=True,
            fsdp_collective_streams=True,
            fsdp1_checkpoint_outside_units=True,
            fsdp_param_dtype_follows_precision=True,
            fsdp_reduce_in_compute_dtype=True,
            adafactor_from_transformers=True,
            trainer_default_fused_since_torch=(2, 8),
            accelerate_fp32_outputs=True,
        ),
        _row(
            "deepspeed",
            master_weights=True,
            adapter_dtype_follows_weights=True,
            deepspeed_optimizer_wrappers=True,
            fused_multi_tensor_adam=True,
            zero_ipg_buckets=True,
            zero3_grad_partition_from_init=True,
        ),
        _row(
            "megatron",
            master_weights=True,
            hf_model_code=False,
            fp32_grad_buffer=True,
            grad_buffer_from_init=True,
            fused_multi_tensor_adam=True,
            vocab_parallel_cross_entropy=True,
            pipeline_last_stage_output_is_loss=True,
            pipeline_sent_outputs_freed=True,
            fused_rms_norm=True,
        ),
        _row(
            "fsdp2",
            ddp_reducer_buckets=True,
            fsdp_param_dtype_follows_precision=True,
            dtensor_sequence_parallel=True,
            dtensor_vocab_parallel_embedding=True,
            float8_tensor_parallel=True,
            fsdp_shards_over_context_parallel=True,
            torchtitan_pipeline_split=True,
            torchtitan_train_loop=True,
            fsdp_collective_streams=True,
            fsdp2_post_backward=True,
            fsdp_unsharded_leaf_parameters=True,
        ),
        _row(
            "torchtune",
            fsdp_collective_streams=True,
            optimizer_offload_torchao=True,
            adapter_dtype_follows_weights=True,
            quantized_base_saves_input=False,
            hf_model_code=False,
            precisions=TORCHTUNE_PRECISIONS,
            default_precision="bf16-true",
        ),
        _row(
            "litgpt",
            ddp_reducer_buckets=True,
            autocast=True,
            adapter_dtype_follows_weights=True,
            own_model_code=True,
            hf_model_code=False,
            fp32_model_output=True,
            bnb_4bit_quantized_from_fp16=True,
            fsdp_flat_parameter_grads=True,
            fsdp_no_sync_accumulation=True,
            loop="previous",
            untied_output_head=True,
            fsdp_collective_streams=True,
            sharded_activation_checkpointing="full",
        ),
        # Answer.AI fsdp_qlora train.py (Mar 2024, e4968fd): a transformers model whose linears
        # are replaced by bitsandbytes Linear4bit (quant_storage = the model dtype) and loaded
        # by its own code, then peft's get_peft_model; no prepare_model_for_kbit_training
        # anywhere, so embeddings, norms and LM head stay in the model dtype (peft_kbit_training
        # False). peft 0.10 LoraLayer.update_layer casts the adapters to the base weight's
        # float dtype (tuners/lora/layer.py: ``self.to(weight.device, dtype=weight.dtype)``),
        # the bf16 quant_storage included. FSDP1 (FullyShardedDataParallel,
        # use_orig_params=False; LoRA leaves wrapped as their own units, so no flat gradient
        # covers a frozen weight); ``*_autocast`` precisions run torch.cuda.amp.autocast on fp32
        # weights (MixedPrecision(param_dtype=float32)); gradient accumulation under
        # ``model.no_sync()``; FSDP1's unshard and post-backward streams
        # (``fsdp_collective_streams``); its loop binds each micro-batch's output until after
        # the optimizer step (``loop="step"``, see ``FrameworkConventions.loop``).
        _row(
            "fsdp-qlora",
            autocast=True,
            adapter_dtype_follows_weights=True,
            fsdp_no_sync_accumulation=True,
            fsdp_collective_streams=True,
            loop="step",
        ),
        # Unsloth 2026.3.5 / unsloth_zoo 2026.3.4 on one GPU, the HF Trainer (TRL SFTTrainer)
        # loop underneath: the model in its 16-bit dtype (FastLanguageModel.from_pretrained
        # dtype=None: bf16 where supported), unsloth_zoo training_utils.py
        # prepare_model_for_training (not peft's prepare_model_for_kbit_training): LoRA A / B
        # upcast to fp32 (``upcast = True``), embeddings, norms and LM head left in the model
        # dtype; a bf16 full fine-tune keeps bf16 weights (``float32_mixed_precision = False``
        # for bf16, vision.py post_patch_model); the notebooks' adamw_8bit; checkpointing
        # "unsloth" (offloaded); its fused loss, LoRA and RMSNorm kernels; expandable
        # segments; LoRA on all seven linears (get_peft_model's target_modules). See Note
        # [Framework conventions].
        _row(
            "unsloth",
            autocast=True,
            adafactor_from_transformers=True,
            trainer_default_fused_since_torch=(2, 8),
            unsloth_offloaded_checkpointing=True,
            unsloth_alloc_conf=True,
            unsloth_fused_cross_entropy=True,
            unsloth_fast_rms_layernorm=True,
            unsloth_attention=True,
            unsloth_fast_lora=True,
            default_optimizer="adamw-8bit",
            default_lora_targets=UNSLOTH_LORA_TARGETS,
            default_activation_checkpointing="full",
            default_precision="bf16-true",
            strips_trl_peft_casts=True,
        ),
    )
}
"""Every framework's row; see each field's docstring for the source."""

HF_TRAINER_STACKS: tuple[str, ...] = ("hf-trainer", "trl", "llama-factory", "axolotl")
"""The frameworks that run the HF Trainer, which shards through DeepSpeed or accelerate's FSDP
plugin (:func:`~trainmem.specs.training.trainer_sharding`). Their FSDP: ``--fsdp`` with
transformers' ``TrainingArguments(fsdp=...)`` (hf-trainer), LLaMA-Factory's ``accelerate launch
--config_file examples/accelerate/fsdp_config.yaml`` (v0.9.5: ``distributed_type: FSDP``, no
``fsdp_version``, so accelerate's FSDP1; ``fsdp2_config.yaml`` sets ``fsdp_version: 2``), axolotl's
``fsdp_config`` (v0.18.0 utils/schemas/validation.py:882-887 ``_resolve_fsdp_version``: version 1
when neither ``fsdp_version`` nor ``fsdp_config.fsdp_version`` is given)."""
