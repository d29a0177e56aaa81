"""The loss on the logits: which loss runs (HF's upcast cross-entropy, the model's own on 16-bit
logits, torchtune's compiled chunks, Megatron's vocabulary-parallel one, the course's written-out
one, a plain sum or mean), what it saves, and the tensors alive only while it runs forward and
at the start of backward. Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.analytic.activation_parallelism import parallel_divisor
from trainmem.analytic.activation_shapes import (
    compute_and_residual_bytes,
    output_tokens,
    tokens_per_sequence,
)
from trainmem.memo import cached_on, per_configuration
from trainmem.specs.frameworks import (
    UNSLOTH_CUT_CROSS_ENTROPY_SINCE,
    UNSLOTH_FUSED_LOSS_SINCE,
    UNSLOTH_SMART_CHECKPOINT_SINCE,
)
from trainmem.specs.model import REMOTE_CODE_OWN_LOSS, ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


def loss_kind(model: ModelSpec, training: TrainingConfig) -> str:
    """The loss the step runs on the logits: ``TrainingConfig.loss`` when given (an explicit
    value always wins), torchtune's transposed cross-entropy for its recipes before 0.3
    (``TrainingConfig.recipe_loss``), else the model's own: the course's written-out
    cross-entropy for a family with ``ModelSpec.loss_written_out``, ``cross-entropy``
    otherwise (and for every head but a causal LM's, where ``loss`` is refused)."""
    if model.head != "causal-lm":
        return "cross-entropy"
    recipe = training.recipe_loss  # the given loss, or torchtune < 0.3's
    if recipe is not None:
        return recipe
    return "cs336-cross-entropy" if model.loss_written_out else "cross-entropy"


TRANSPOSED_CROSS_ENTROPY = "transposed-cross-entropy"
"""``TrainingConfig.loss`` of torchtune's 2024 recipes (Note [torchtune's transposed
cross-entropy])."""


def transposed_cross_entropy(model: ModelSpec, training: TrainingConfig) -> bool:
    """The loss is torchtune's 2024 recipes' cross-entropy on the transposed shifted logits.

    Note [torchtune's transposed cross-entropy]
        torchtune's four recipes from 01891fc4 (Mar 2024) to 4fba6cd4 (Aug 2024, "chunked cross
        entropy") compute the loss in their ``train()`` as (recipes/lora_finetune_single_device
        .py, lora_finetune_distributed.py, full_finetune_single_device.py and
        full_finetune_distributed.py @fef3ed1, @20747cd and @0217d44c)::

            logits = self._model(input_ids)        # TransformerDecoder: self.output(h).float()
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
            logits = logits.transpose(1, 2)
            loss = self._loss_fn(logits, labels)   # torch.nn.CrossEntropyLoss

        With t' = b(s - 1) shifted positions and V the vocabulary: the model returns fp32
        logits (modules/transformer.py ``output = self.output(h).float()``; the 16-bit output
        is freed once cast), the shift makes a contiguous fp32 copy (4Vt'; the whole fp32
        logits go when ``logits`` is rebound), and ``cross_entropy`` runs ``log_softmax(input,
        1)`` on the (b, V, s - 1) transposed view (aten/src/ATen/native/LossNLL.cpp
        ``cross_entropy_loss``). The CUDA kernel takes ``input_.contiguous()`` first
        (aten/src/ATen/native/cuda/SoftMax.cu ``host_softmax``), a second fp32 copy of the
        shifted logits alive beside the contiguous output it writes (4Vt' each). So while the
        loss runs forward, 12Vt' bytes are alive: the shifted logits and the kernel's copy
        (the forward transient, :func:`loss_forward_transient_bytes`) and the saved
        log-softmax (:func:`loss_saved_terms`), against (c + 4)V t + 4Vt for a cross-entropy
        that upcasts untransposed logits. ``nll_loss_nd`` views the contiguous output as
        (b, V, 1, s - 1) without a copy; in backward ``nll_loss2d_backward`` and the
        log-softmax's backward hold two fp32 (b, V, s - 1) gradients beside the saved output,
        as a plain cross-entropy (:func:`loss_backward_tensors`). The loop binds the shifted
        fp32 logits (``logits``), which the ``previous`` loop holds
        (:func:`~trainmem.analytic.held_outputs.previous_output_bytes`).
    """
    return loss_kind(model, training) == TRANSPOSED_CROSS_ENTROPY


def shifted_positions(model: ModelSpec, training: TrainingConfig) -> int:
    """t' = b(s - 1): the positions the shifted logits of a causal LM keep."""
    return training.micro_batch_size * (output_tokens(model, training) - 1)


def loss_in_logits_dtype(model: ModelSpec, training: TrainingConfig) -> bool:
    """The model's own loss takes its 16-bit logits as they are
    (:func:`model_loss_in_logits_dtype`), under autocast.

    Note [Cross-entropy on 16-bit logits]
        ``cross_entropy`` calls ``log_softmax(input, dim, input.scalar_type())``
        (aten/src/ATen/native/LossNLL.cpp ``cross_entropy``); autocast's
        ``AT_FORALL_FP32_SET_OPT_DTYPE`` policy leaves an op with an explicit dtype alone, so
        the log-softmax runs and saves its output in 16 bits (c*V per token); ``nll_loss``, on
        the fp32 list, casts it to fp32 and saves that copy too (4V). In backward only
        ``nll_loss``'s fp32 gradient (4V) is alive on top of them: by the log-softmax's
        backward the fp32 copy and that gradient are freed and two 16-bit tensors (2cV) take
        their place. Checked with ``saved_tensors_hooks`` under trainmem's CUDA autocast
        policy and against the trace engine (tests/models/formula/bert.json)."""
    return model_loss_in_logits_dtype(model, training) and training.uses_autocast


@cached_on(
    "chunked_cross_entropy", "framework", "loss", "transformers_version", "torchtune_version"
)
def model_loss_in_logits_dtype(model: ModelSpec, training: TrainingConfig) -> bool:
    """The model code's own loss calls ``cross_entropy`` on the 16-bit logits, without
    ``.float()``: BERT's masked-LM head (``ModelSpec.mlm_loss_in_logits_dtype``), the causal-LM
    heads of GPT-2, GPTBigCode, Falcon, BLOOM, ... before transformers 4.49
    (``ModelSpec.causal_lm_loss_in_logits_dtype`` at ``TrainingConfig.transformers_release``);
    with HF model code, no chunked loss (which replaces the model's) and no explicit
    ``TrainingConfig.loss``. Under autocast see Note
    [Cross-entropy on 16-bit logits]; without it the log-softmax saves its 16-bit output and
    its backward holds two 16-bit gradients (:func:`loss_upcast` False)."""
    if (
        training.chunked_cross_entropy
        or not training.conventions.hf_model_code
        or loss_kind(model, training) != "cross-entropy"
    ):
        return False
    return model.mlm_loss_in_logits_dtype or model.causal_lm_loss_in_logits_dtype(
        training.transformers_release
    )


def loss_upcast(model: ModelSpec, training: TrainingConfig) -> bool:
    """The cross-entropy works on fp32 logits: transformers' ``ForCausalLMLoss`` /
    ``ForMaskedLMLoss`` (``logits.float()``, transformers/loss/loss_utils.py since 4.46; the
    model code's own ``.float()`` before), torchtune's and lit-gpt's losses
    (``TrainingConfig.loss_upcast``), unless the model's own loss takes its 16-bit logits
    (:func:`model_loss_in_logits_dtype`)."""
    return training.loss_upcast and not model_loss_in_logits_dtype(model, training)


def compiled_chunked_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """The chunked cross-entropy's per-chunk upcast and loss run compiled: torchtune's recipes
    compile ``CEWithChunkedOutputLoss.compute_cross_entropy`` when ``compile`` is on
    (``training.compile_loss``); lit-gpt's chunked loss is never compiled.

    Note [Compiled chunked cross-entropy]
        torchtune 0.4.0: the model returns the list of N chunks of logits in the compute dtype
        (``TransformerDecoder.chunked_output``: ``[self.output(chunk) for chunk in
        last_hidden_state.chunk(N, dim=1)]``, modules/transformer.py); ``CEWithChunkedOutputLoss
        .forward`` runs ``compute_cross_entropy`` = ``F.cross_entropy(logits.float(), labels,
        reduction="sum")`` on each (modules/loss/ce_chunked_output_loss.py) and the recipe
        drops the list after the loss (``del logits``, recipes/full_finetune_single_device.py
        ``_loss_step``); with ``compile`` on, ``training.compile_loss`` replaces
        ``compute_cross_entropy`` by ``torch.compile`` of it (training/_compile.py).

        Eager, each chunk's ``log_softmax`` saves its fp32 output (4V per token, the tensor
        ``nll_loss`` saves too), so the loss keeps 4V per token of every chunk, and one chunk's
        fp32 copy is alive while it runs. Compiled, AOTAutograd traces the chunk's loss on
        inductor's decompositions (``log_softmax`` -> ``amax``, ``sub``, ``exp``, ``sum``,
        ``log``, ``sub``) and the min-cut partition saves the 16-bit input chunk itself, the
        row max and the log-sum-exp (4 B per token each): c*V + 8 per token, and inductor's
        kernels never write the fp32 upcast (it is read inside the reductions). In backward
        the compiled graph recomputes ``exp(x - max - lse)`` and writes the chunk's gradient in
        the logits' dtype (c*V per token of one chunk; ``full`` + ``scatter`` is a pointwise
        ``where`` in inductor, ``scatter_upon_const_tensor``). Autograd runs the N chunks'
        loss backwards before any chunk's output projection (the projections were recorded
        first, in the model's forward, and autograd's ready queue takes the highest sequence
        number first), so when the head's backward starts every chunk's logits gradient is
        alive: c*V per token, N - 1 chunks beside the one
        :func:`loss_backward_transient_bytes` counts (:func:`chunked_loss_gradient_bytes`).
        Checked against the trace engine, which compiles the chunks' loss the same way
        (trainmem.trace.compile ``compile_loss``; tests/trace/test_chunked_loss_compiled.py;
        the bytes by hand in tests/analytic/test_chunked_loss.py).
    """
    return (
        training.compile
        and training.chunked_cross_entropy > 0
        and not training.conventions.own_model_code
        and not training.conventions.unsloth_fused_cross_entropy
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
    )


def torchtitan_compiled_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """torchtitan's cross-entropy runs compiled (``TrainingConfig.torchtitan_compiles_loss``:
    its train loop with ``compile`` on, from torchtitan 0.1, unchunked, one pipeline stage, no
    loss parallelism) on a causal LM.

    Note [torchtitan's compiled cross-entropy]
        torchtitan/components/loss.py (e7c0cae, June 2025; since bbb1b616e, PR #1033)
        ``cross_entropy_loss(pred, labels)`` is ``F.cross_entropy(pred.flatten(0, 1).float(),
        labels.flatten(0, 1))`` and ``build_cross_entropy_loss`` returns
        ``torch.compile(loss_fn)`` when ``job_config.training.compile``: the whole logits are
        one chunk of Note [Compiled chunked cross-entropy] (the 16-bit logits, the row max and
        the log-sum-exp saved, c*V + 8 per token; no fp32 copy written; in backward one c*V
        gradient per token). torchtitan 0.0.2 (9dec370) ran it eager ("TODO: compiling loss
        function causes CUDA errors, turning off for now", train.py). Under loss parallelism
        (DTensor logits) and pipeline parallelism (the loss inside the last stage's schedule)
        the eager rules stay: not modelled for the compiled loss. The trace engine compiles
        the same loss (trainmem.trace.engine ``default_forward_loss``)."""
    return (
        training.torchtitan_compiles_loss
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
    )


def compiled_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """The cross-entropy runs compiled, its logits in chunks (torchtune,
    :func:`compiled_chunked_loss`) or whole (torchtitan, :func:`torchtitan_compiled_loss`)."""
    return compiled_chunked_loss(model, training) or torchtitan_compiled_loss(model, training)


def megatron_cross_entropy(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's cross-entropy is Megatron's vocabulary-parallel one
    (``FrameworkConventions.vocab_parallel_cross_entropy``), unchunked and not replaced by
    ``TrainingConfig.loss``.

    Note [Megatron's vocabulary-parallel cross-entropy]
        megatron-core 0.9.0, megatron/core/tensor_parallel/cross_entropy.py
        ``_VocabParallelCrossEntropy`` (``GPTModel.forward`` -> ``LanguageModule.
        compute_language_model_loss`` -> ``vocab_parallel_cross_entropy(logits, labels)``; the
        fused variant, ``cross_entropy_loss_fusion``, off by default, runs the same steps).
        Per (token, vocabulary-shard) value, c the logits' bytes, T = b*s tokens, V/t the
        shard:

        * forward: ``calculate_logits_max`` makes the one fp32 copy (``.float()``) while the
          output layer's 16-bit logits are alive (c + 4); ``calculate_predicted_logits``
          subtracts the row max in place ("In-place subtraction reduces memory pressure"),
          then ``torch.exp(vocab_parallel_logits, out=exp_logits)``;
          ``calculate_cross_entropy_loss`` divides by the row sums in place
          (``exp_logits.div_``), and ``ctx.save_for_backward(exp_logits, target_mask,
          masked_target_1d)`` keeps that fp32 softmax (4). The function runs inside an
          ``autograd.Function``, so none of its ops saves anything of its own; the 16-bit
          logits go when ``GPTModel.forward`` returns the loss (the output layer's backward
          needs its input, not its output). With fp32 logits ``.float()`` returns the logits
          themselves: one tensor (4).
        * backward: ``prepare_gradient_calculation_operands`` takes the saved softmax as the
          gradient (``grad_input = softmax``), ``calculate_gradients`` subtracts at the targets
          and multiplies by the incoming gradient in place, and returns it: still the one fp32
          tensor. Autograd casts a gradient to its input's dtype (torch/csrc/autograd/
          engine.cpp ``validate_outputs``) before the node's saved tensors are released
          (``evaluate_function``: ``call_function``, then ``release_variables``), so the 16-bit
          logits gradient (c) is made beside it; the fp32 one goes, and the 16-bit one lives
          through the output layer's backward. fp32 logits need no cast: the saved buffer is
          the gradient (# NB: the schedule frees it with the head's activations, before the
          output layer's backward; Megatron runs 16-bit).

        Against the generic rule (``F.cross_entropy(logits.float())``: the fp32 copy, a
        separate fp32 log-softmax output, two fp32 gradients in backward), the forward peak is
        (c + 4) V/t per token instead of c + 4 + 4 and the backward peak 4 + c instead of
        4 + 4 + 4. # NB: the per-token tensors (the row max and sums, fp32; ``target_mask``,
        bool, and ``masked_target_1d``, int64, saved: 9 B per token) are left out.
    """
    return (
        training.conventions.vocab_parallel_cross_entropy
        and model.head == "causal-lm"
        and training.chunked_cross_entropy == 0
        and loss_kind(model, training) == "cross-entropy"
    )


def unsloth_fused_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's cross-entropy is Unsloth's fused linear + cross-entropy
    (``FrameworkConventions.unsloth_fused_cross_entropy``), not replaced by
    ``TrainingConfig.loss``; ``chunked_cross_entropy`` N > 0 is its number of pieces
    (Unsloth's ``UNSLOTH_CE_LOSS_N_CHUNKS``).

    Note [Unsloth's fused cross-entropy]
        unsloth 2026.3.5 models/llama.py ``CausalLM_fast_forward``: with labels and without
        ``UNSLOTH_RETURN_LOGITS=1`` the model calls unsloth_zoo 2026.3.4
        fused_losses/cross_entropy_loss.py ``unsloth_fused_ce_loss`` on the final norm's
        output and the LM head's weight, and returns ``logits = EMPTY_LOGITS``. Its
        ``UnslothFusedLoss.forward`` (an ``autograd.Function``, so nothing inside it is saved
        by autograd):

        * allocates ``grad_inputs = torch.empty_like(hidden_states)`` (r h per token) and, for
          a trained head, ``grad_lm_head = torch.zeros_like(lm_head_weight)`` (V h in the
          head weight's dtype), and saves them (``ctx.save_for_backward(grad_inputs,
          grad_lm_head, ...)``); its ``backward`` returns them as they are: the loss's
          backward makes nothing, and the hidden states (the final norm's output) are not
          kept;
        * splits the tokens into ``n_chunks = get_chunk_size(b, s, V)`` pieces, ``max(4 *
          round(2 V b s / free), 1)`` with ``free`` the GPU's free memory in bytes at the
          first call (``torch.cuda.mem_get_info``, cached; ``_get_chunk_multiplier``): one
          piece unless the fp32 logits (4 V b s) exceed about the free memory, or the
          ``UNSLOTH_CE_LOSS_N_CHUNKS`` environment variable's count. trainmem takes
          ``chunked_cross_entropy`` pieces when given, else, on a given GPU, Unsloth's count
          from the capacity less what the schedule holds at the first loss
          (trainmem.estimate ``unsloth_loss_pieces``), else one piece;
        * per piece runs ``torch.compile`` of ``torch.func.grad_and_value`` of
          ``compute_fused_ce_loss`` (``F.linear`` in the head weight's dtype, then
          ``F.cross_entropy(logits.float())``): one graph with its own backward, whose
          inductor kernels read the 16-bit logits into the row reductions (no fp32 copy
          written, as in Note [Compiled chunked cross-entropy]) and write the logits'
          gradient in their dtype for the input-gradient matmul: the piece's c V logits and
          c V gradient per token alive at once, then the piece's r h input gradient, copied
          into ``grad_inputs`` (``grad_inputs_j[:] = chunk_grad_input``), and for a trained
          head the piece's V h weight gradient, added into ``grad_lm_head``
          (``grad_lm_head.add_(chunk_grad_lm_head)``).

        So per token of a piece: forward transients 2 c V + r h (+ V h for a trained head,
        once per piece); saved r h per token (+ the head's V h, trained); backward
        transients none; against transformers' ``ForCausalLMLoss`` on
        the upcast logits (the LM head's saved input c h, the saved fp32 log-softmax 4 V, the
        logits and their fp32 copy c V + 4 V in the forward, two fp32 gradients 8 V in the
        backward). The backward of the head's matmul is the precomputed gradient: no
        dequantized head weight (the head is 16-bit under Unsloth) and no head input kept.
        Not traced (Triton / CUDA); the bytes by hand in
        tests/analytic/test_unsloth_framework.py.

        Not modelled, read for the record: with ``UNSLOTH_RETURN_LOGITS=1`` (or no labels)
        the model returns the 16-bit logits (``logits.to(model dtype)``) and, given labels,
        takes ``fast_cross_entropy_loss`` (unsloth 2026.3.5 kernels/cross_entropy_loss.py
        ``Fast_CrossEntropyLoss``): its forward saves the 16-bit logits themselves, the fp32
        log-sum-exp per row (per row and 65,536-wide vocabulary chunk, then reduced, above
        that width) and the labels, writes fp32 losses per row, never an fp32 copy of the
        logits; its backward writes the gradient into the saved logits in place and returns
        them (``return logits, ...``): c V t alive from the head to its backward, no new
        (t, V) tensor in the backward.
    """
    return (
        training.conventions.unsloth_fused_cross_entropy
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
        and training.unsloth_release >= UNSLOTH_FUSED_LOSS_SINCE
    )


def unsloth_cut_cross_entropy(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's cross-entropy is Apple's Cut Cross Entropy as Unsloth called it before
    2025.8.5 (:data:`~trainmem.specs.frameworks.UNSLOTH_FUSED_LOSS_SINCE`).

    Note [Unsloth's Cut Cross Entropy]
        From 2024.11.8 to 2025.8.4 (tags ``December-2024`` to ``July-2025``) unsloth/models/
        llama.py ``CausalLM_fast_forward``, with labels and without ``UNSLOTH_RETURN_LOGITS``,
        calls unsloth_zoo loss_utils.py ``fused_linear_cross_entropy`` (2025.1.3, 2025.4.4),
        that is cut_cross_entropy's ``linear_cross_entropy(hidden_states, lm_head.weight,
        targets, shift = True, filter_eps = "auto")``; unsloth_zoo requires
        ``cut_cross_entropy``, unpinned. Read at apple/ml-cross-entropy 1f3ebdb (2024-12-09,
        the release of the README table's time), cce.py ``LinearCrossEntropyFunction``:

        * ``forward``: the log-sum-exp per token (fp32) and the mean logit per vocabulary
          entry (fp32, for ``filter_eps``) from Triton kernels that never write a logit;
          ``ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)``: the hidden states
          ``e`` (the final norm's output, c h per token, as an LM head's saved input), lse
          4 B per token, logit_avg 4 V;
        * ``backward``: cce_backward.py ``cce_backward_kernel``: ``de = torch.zeros_like(e)``
          and ``dc = torch.zeros_like(c)`` (the classifier's gradient, V h in its dtype, made
          whether or not it requires grad; skipped for a frozen classifier from ``Bag of
          updates``, 24fbe4b, 2025-03-06), both written by one kernel; ``de`` goes on as the
          hidden states' gradient, ``dc`` is dropped for a frozen head.

        So no (tokens x V) tensor at all; saved c h + 4 per token and 4 V; the backward's
        transients c h per token and, for a frozen head with the Cut Cross Entropy of before
        2025.3 (taken with Unsloth before 2025.3.1, installed alongside), c V h. Not
        modelled: the int64 targets / valid-position indices (8 B per token); with at most
        1,024 tokens (``bsz*q_len <= 1024``, May-2025) Unsloth returns the logits instead.
    """
    return (
        training.conventions.unsloth_fused_cross_entropy
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
        and UNSLOTH_CUT_CROSS_ENTROPY_SINCE <= training.unsloth_release < UNSLOTH_FUSED_LOSS_SINCE
    )


def cut_cross_entropy(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's head and cross-entropy are Apple's Cut Cross Entropy: Unsloth's
    (:func:`unsloth_cut_cross_entropy`) or asked for (``TrainingConfig.cut_cross_entropy``,
    axolotl's plugin).

    Note [axolotl's Cut Cross Entropy]
        axolotl's ``CutCrossEntropyPlugin`` (v0.18.0 src/axolotl/integrations/
        cut_cross_entropy/__init__.py ``pre_model_load``) calls ``cce_patch(model_type)`` of
        its fork axolotl-ai-cloud/ml-cross-entropy (pinned 5f0c7a7) with the defaults: impl
        ``cce``, ``filter_eps="auto"``, ``accum_e_fp32`` / ``accum_c_fp32`` False. The patched
        ``ForCausalLM.forward`` (transformers/llama.py ``cce_forward``, with labels) passes
        ``hidden_states[:, slice_indices]`` (all of them, a view) and ``lm_head.weight`` to
        transformers/utils.py ``apply_lce`` -> cce.py ``LinearCrossEntropyFunction``, and
        returns no logits. As Note [Unsloth's Cut Cross Entropy] has it, with one difference:
        cce_backward.py ``cce_backward_kernel`` makes ``dc = torch.zeros_like(c) if
        c.requires_grad else None``, so a frozen head never gets ``dc`` (``de`` likewise only
        for hidden states that require grad, which they do under training). So: saved c h +
        4 per token (the hidden states, the fp32 log-sum-exp) and 4 V (``logit_avg``); the
        backward's transient c h per token (``de``). Not modelled, as for Unsloth: the int32
        valid positions and the targets (up to 8 B per token).
    """
    if unsloth_cut_cross_entropy(model, training):
        return True
    return (
        training.cut_cross_entropy
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
    )


def unsloth_logits_loss(model: ModelSpec, training: TrainingConfig) -> bool:
    """A causal LM's cross-entropy is Unsloth's own kernel on the whole returned logits, as
    before 2024.11.8 (:data:`~trainmem.specs.frameworks.UNSLOTH_CUT_CROSS_ENTROPY_SINCE`).

    Note [Unsloth's cross-entropy on the logits]
        From 2024.7 to 2024.11.7 (tags ``July-2024`` to ``October-2024``) unsloth/models/
        llama.py ``CausalLM_fast_forward`` makes the logits (``self.lm_head(hidden_states)``,
        then ``.to(torch_dtype)``, the same 16-bit dtype: no copy), returns them, and with
        labels calls kernels/cross_entropy_loss.py ``fast_cross_entropy_loss``:
        ``Fast_CrossEntropyLoss.forward`` writes fp32 losses and the log-sum-exp per row
        (per row and 65,536-wide vocabulary chunk above that width, then reduced) and saves
        the logits themselves (``ctx.save_for_backward(logits, logsumexp, labels)``); its
        ``backward`` writes the logits' gradient into them in place and returns them. So: c V
        per token saved from the head to the loss's backward, 4 more (the log-sum-exp), no
        fp32 copy of the logits, no (tokens x V) tensor made in the backward; a frozen LM head
        saves no input. The trainer drops the returned logits after the loss (the HF Trainer
        loop).
    """
    return (
        training.conventions.unsloth_fused_cross_entropy
        and model.head == "causal-lm"
        and loss_kind(model, training) == "cross-entropy"
        and training.unsloth_release < UNSLOTH_CUT_CROSS_ENTROPY_SINCE
    )


def cut_cross_entropy_backward_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """The backward transients of Unsloth's Cut Cross Entropy (Note [Unsloth's Cut Cross
    Entropy]): ``de`` (c h per token) and, for a frozen head before 2025.3.1, ``dc`` (V h in
    the head weight's dtype)."""
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * output_tokens(model, training)
    frozen = not training.trains_lm_head and "lm_head" not in training.lora_targets
    # Note [axolotl's Cut Cross Entropy]: its fork never makes dc for a frozen head
    old = (
        unsloth_cut_cross_entropy(model, training)
        and training.unsloth_release < UNSLOTH_SMART_CHECKPOINT_SINCE
    )
    dc = dtype_bytes(training.weight_dtype) * model.vocab_size * model.hidden_size
    return c * model.hidden_size * t + (dc if frozen and old else 0)


def unsloth_fused_saved_terms(
    model: ModelSpec, training: TrainingConfig, *, t: int
) -> dict[str, int]:
    """What Unsloth's fused cross-entropy saves (Note [Unsloth's fused cross-entropy]): the
    input gradient (r h per token) and a trained head's weight gradient (V h in its dtype)."""
    _, r = compute_and_residual_bytes(training)
    out = {"fused_grad_input": r * model.hidden_size * t}
    if training.trains_lm_head or "lm_head" in training.lora_targets:
        w = dtype_bytes(training.weight_dtype)
        out["fused_grad_lm_head"] = w * model.vocab_size * model.hidden_size
    return out


def unsloth_fused_forward_bytes(model: ModelSpec, training: TrainingConfig, *, t: int) -> int:
    """Unsloth's fused cross-entropy's forward transients over t tokens in
    ``max(chunked_cross_entropy, 1)`` pieces (Note [Unsloth's fused cross-entropy]): one
    piece's logits and their gradient (2 c V), its input gradient (r h) per token, and a
    trained head's V h weight gradient of the piece."""
    c, r = compute_and_residual_bytes(training)
    piece = -(-t // max(training.chunked_cross_entropy, 1))
    head = unsloth_fused_saved_terms(model, training, t=t).get("fused_grad_lm_head", 0)
    return (2 * c * model.vocab_size + r * model.hidden_size) * piece + head


def loss_saved_terms(model: ModelSpec, training: TrainingConfig, *, t: int) -> dict[str, int]:
    """What the loss on t tokens of logits saves for its backward, by term: the log-softmax
    output ``cross_entropy`` saves, fp32 after HF's / torchtune's upcast (:func:`loss_upcast`),
    the logits' dtype otherwise; nothing for a sum or a mean (derivatives.yaml ``sum``,
    ``mean``); the course's, the 16-bit, the compiled chunked and Megatron's cross-entropy as
    their Notes say."""
    c, _ = compute_and_residual_bytes(training)
    v = model.vocab_size
    kind = loss_kind(model, training)
    if kind in ("logits-sum", "logits-mean"):
        return {}
    if kind == "cs336-cross-entropy":
        # Note [The course's cross-entropy]: exp's output, the negated log-softmax gather
        # saves, max's int64 indices and log's input
        e = written_out_exp_bytes(training)
        return {"log_softmax": 2 * e * v * t + (8 + e) * t}
    if unsloth_fused_loss(model, training):
        return unsloth_fused_saved_terms(model, training, t=t)
    if cut_cross_entropy(model, training):  # Note [Unsloth's Cut Cross Entropy]
        return {"cut_ce_lse": 4 * t, "cut_ce_logit_avg": 4 * v}
    if unsloth_logits_loss(model, training):  # Note [Unsloth's cross-entropy on the logits]
        return {"unsloth_ce_logits": c * v * t, "unsloth_ce_lse": 4 * t}
    if loss_in_logits_dtype(model, training):
        # the 16-bit log-softmax output and nll_loss's fp32 copy of it
        # (Note [Cross-entropy on 16-bit logits])
        return {"log_softmax": (c + 4) * v * t, **_log_softmax_input(training, c * v * t)}
    if compiled_loss(model, training):
        # Note [Compiled chunked cross-entropy]: every chunk's logits in their own dtype and
        # two fp32 values per token (row max, log-sum-exp), no fp32 log-softmax
        return {"chunk_logits": c * v * t, "chunk_row_stats": 8 * t}
    if megatron_cross_entropy(model, training):
        # Note [Megatron's vocabulary-parallel cross-entropy]: the fp32 copy of the logits,
        # turned into the softmax in place and saved (``exp_logits``)
        return {"vocab_parallel_softmax": 4 * v * t}
    if transposed_cross_entropy(model, training):
        # Note [torchtune's transposed cross-entropy]: the fp32 log-softmax of the shifted
        # positions
        return {"log_softmax": 4 * v * shifted_positions(model, training)}
    saved = (4 if loss_upcast(model, training) else c) * v * t
    return {"log_softmax": saved, **_log_softmax_input(training, saved)}


def _log_softmax_input(training: TrainingConfig, output_bytes: int) -> dict[str, int]:
    """The log-softmax's input, kept beside its output on a torch before 1.11
    (``TrainingConfig.softmax_saves_input``; Note [Softmax saving its input before torch
    1.11] in trainmem/trace/older_softmax.py: ``_log_softmax_backward_data(grad, result, dim,
    self)``): the logits the kernel saw, in the output's dtype (the fp32 copy of an upcast),
    as many bytes as the output; nothing on a later release."""
    return {"log_softmax_input": output_bytes} if training.softmax_saves_input else {}


def written_out_exp_bytes(training: TrainingConfig) -> int:
    """Bytes per value of ``torch.exp``'s output in written-out (log-)softmax code: fp32 under
    autocast (``exp`` is on CUDA autocast's fp32 list, aten/src/ATen/autocast_mode.cpp) and in
    fp32 training, the compute dtype otherwise."""
    c, _ = compute_and_residual_bytes(training)
    return 4 if training.uses_autocast else c


def written_out_loss_forward_bytes(training: TrainingConfig, *, t: int, v: int) -> int:
    """Bytes the course's cross-entropy holds at its peak besides the two tensors it saves.

    Note [The course's cross-entropy]
        cs336_basics/nn_utils.py: ``log_softmax(x) = x - x_max - torch.log(torch.sum(
        torch.exp(x - x_max)))`` (spring 2024; the 2025 copy binds ``x = x - x_max`` first and
        holds the same) and ``cross_entropy = torch.mean(torch.gather(-log_softmax(inputs),
        ...))``. With e the bytes of exp's output (:func:`written_out_exp_bytes`), c the
        logits', per (token, vocabulary) value: at the exp the logits, ``x - x_max`` twice (c
        each), exp's fp32 input cast under autocast (4) and its output (e) are alive; at the
        negation the logits, the exp output, the difference (promoted to e) and its negation:
        max(3c + cast + e, c + 3e), i.e. 16 bytes in fp32 and 14 under bf16 autocast. Saved
        for backward: the exp output and the negated log-softmax, which ``gather`` saves whole
        (derivatives.yaml ``gather``: ``gather_backward(grad, self, dim, index, ...)``), e
        bytes per value each, max's int64 indices and log's input (the row sums, e) per token.
        The backward starts with gather's gradient, ``grad.new_zeros(...).scatter_add_(...)``
        in place (FunctionsManual.cpp ``gather_backward``), one e-byte (t, V) tensor beside
        the saved ones, after which gather's saved input goes; the negation's gradient
        replaces it; at ``x - log(S)`` the passed-through gradient, its negation for log's
        side (summed to (t, 1)) and, under autocast, its cast to the 16-bit ``x`` (autograd
        casts a gradient to its input's dtype) are alive: e + e + c with the exp output, the
        same e + 2e as at gather's in fp32 (no cast). So beside what the loss saved: e per
        value, e + c under autocast. Read off S001's recorded stacks (nn_utils.py lines 12-17,
        fp32: never two (t, V) gradients with gather's saved input) and the trace of the
        course model (bf16 autocast: the peak at that ``sum``). Under fake tensors
        ``gather_backward`` takes its out-of-place branch (``areAnyTensorSubclassLike``); the
        trace engine makes it in place as on a GPU (trainmem.trace.cuda_scatter)."""
    c, _ = compute_and_residual_bytes(training)
    e = written_out_exp_bytes(training)
    cast = 4 if training.uses_autocast and c != 4 else 0
    peak = max(3 * c + cast + e, c + 3 * e)
    return (peak - 2 * e) * v * t


SHIFTED_LABELS_SINCE = (4, 49)
"""transformers release from which ``ForCausalLMLoss`` shifts the labels (``nn.functional.pad(
labels, (0, 1), value=ignore_index)``, then ``labels[..., 1:]``) instead of the logits
(loss/loss_utils.py, 4.49.0); see :func:`shifted_logits_bytes`."""


def shifted_logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the shifted copy of the logits a transformers causal LM makes for its loss before
    transformers 4.49 (:data:`SHIFTED_LABELS_SINCE`): ``shift_logits = logits[..., :-1, :].
    contiguous()``, b*(s - 1) positions in the loss's dtype (fp32 after the upcast, the logits'
    own under :func:`model_loss_in_logits_dtype`), alive beside the logits (and their fp32
    copy, which ``ForCausalLMLoss``'s ``logits`` local holds until it returns) while
    ``cross_entropy`` runs; freed with the forward (``clone`` saves nothing). Its backward,
    ``slice_backward`` (a zero-padded (b, s, V) gradient beside the shifted one), holds no more
    than the log-softmax's backward before it.
    Source: transformers 4.46.0 / 4.48.0 loss/loss_utils.py ``ForCausalLMLoss`` (``logits =
    logits.float()``, then the shift); 4.45.2 modeling_mistral.py / modeling_llama.py
    ``*ForCausalLM.forward`` (the same, in the model); 4.48.0 modeling_gpt_bigcode.py (the
    shift of the 16-bit logits). 0 from 4.49 (not for the remote-code families of
    :data:`~trainmem.specs.model.REMOTE_CODE_OWN_LOSS`, whose own file shifts the logits in
    every release: Qwen-1's 16-bit ones, ChatGLM's fp32 copy), for other model code, other
    losses and a chunked loss."""
    if (
        model.head != "causal-lm"
        or not training.conventions.hf_model_code
        or training.chunked_cross_entropy
        or loss_kind(model, training) != "cross-entropy"
        or (
            training.transformers_release >= SHIFTED_LABELS_SINCE
            and model.model_type not in REMOTE_CODE_OWN_LOSS
        )
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    b, s = training.micro_batch_size, output_tokens(model, training)
    return (4 if loss_upcast(model, training) else c) * model.vocab_size * b * (s - 1)


def accelerate_output_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the fp32 copy of the logits accelerate's wrapped forward returns: b*s*V values
    of 4 bytes (vocabulary-parallel under TP) when accelerate converts the outputs
    (``TrainingConfig.accelerate_fp32_outputs``) of a causal or masked LM whose logits leave
    the model in 16 bits; 0 otherwise (fp32 logits are returned as they are).

    Note [accelerate's fp32 outputs]
        accelerate's ``Accelerator.prepare_model`` (accelerator.py, v0.20.0 to v1.14.0 read),
        when ``native_amp`` (``mixed_precision`` fp16 / bf16 on a GPU, and never under
        ``DistributedType.DEEPSPEED`` or ``MEGATRON_LM``: the ``__init__``'s mixed-precision
        branches), sets ``model._original_forward = model.forward`` and replaces the forward by
        ``convert_outputs_to_fp32(autocast_context(forward))``: utils/operations.py
        ``ConvertOutputsToFp32.__call__`` returns ``convert_to_fp32(self.model_forward(...))``,
        which ``recursively_apply``-s ``tensor.float()`` to every fp16 / bf16 tensor of the
        output (lists, tuples, mappings such as a ``ModelOutput``; a ``Cache`` object passes
        through). So a transformers LM's 16-bit ``logits`` get an fp32 copy, 4 bytes a value,
        made after the model's own loss returned, while the 16-bit logits are still referenced
        by the unconverted output (freed when the wrapper returns); the loss is fp32 already
        and not copied. FSDP1 is wrapped around that forward (v1.x wraps before
        ``FSDP(model)``, v0.20 after it: the same conversion), and the HF Trainer reaches it
        through ``self.accelerator.prepare(self.model)``
        (:data:`~trainmem.specs.frameworks.TRAINER_ON_ACCELERATE_SINCE`).

        How long the copy lives is the loop's: the HF Trainer's ``compute_loss`` binds
        ``outputs = model(**inputs)`` and returns only the loss, so it is gone before
        ``accelerator.backward(loss)``: beside the loss's saved fp32 log-softmax it takes the
        place of the loss's own fp32 upcast (``ForCausalLMLoss``: ``logits.float()``, freed
        when the loss returns), so the forward's end holds max(upcast + shifted copy, fp32
        output) beside the 16-bit logits (:func:`loss_forward_transient_bytes`); with a
        loss that upcasts, the same bytes. A loop that keeps ``outputs`` (``step``,
        ``previous``) keeps the fp32 copy, not the 16-bit logits
        (:func:`~trainmem.analytic.transforms.loop.kept_logits_bytes`,
        :func:`~trainmem.analytic.held_outputs.previous_output_bytes`).

        Not converted: DeepSpeed (no ``native_amp``); ``*-true`` precisions (accelerate's
        ``mixed_precision="no"``); logits already fp32 (transformers' Llama-style models
        before 4.46 return ``logits.float()``); Unsloth (its fused loss returns no logits by
        default, Note [Unsloth's fused cross-entropy]); loops accelerate does not prepare
        (Answer.AI's train.py runs its own autocast).
    """
    c, _ = compute_and_residual_bytes(training)
    if (
        not training.accelerate_fp32_outputs
        or model.head not in ("causal-lm", "masked-lm")
        or c == 4
        or not training.conventions.hf_model_code
    ):
        return 0
    t = training.micro_batch_size * output_tokens(model, training)
    return -(-4 * model.vocab_size * t // parallel_divisor("logits", training))


def loss_forward_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes live only at the end of forward, when the loss runs: the logits (c per value) and,
    when the loss upcasts 16-bit logits, their fp32 copy (one chunk of it with a chunked loss).
    Source: transformers/loss/loss_utils.py ``ForCausalLMLoss`` (``logits.float()``).

    Note [litgpt's cast output]
        litgpt's ``GPT.forward`` returns the head's whole output, with ``lm_head_chunk_size``
        a list of every chunk's 16-bit logits (``[self.lm_head(x_i) for x_i in
        x.split(lm_head_chunk_size, dim=1)]``, litgpt/model.py v0.5.13, lit-gpt @8641822),
        and Fabric's wrapper casts that output to fp32 before it returns
        (lightning/fabric/wrappers.py ``_FabricModule.forward`` -> ``precision.
        convert_output``), so c V t of 16-bit logits live beside their fp32 copy (4 V t, a
        head term) while the loop's ``logits = model(...)`` still holds the previous
        micro-batch's fp32 logits (loop ``previous``): the schedule allocates the fp32 copy,
        and what the final norm and the head saved before it, before ``head.post_forward``
        (where the loop releases the previous output) and frees the 16-bit logits there.
        Found by the generic path on litgpt's own GPT (trace/litgpt_model.py): an 8-chunk head
        on a 1024-wide Qwen2, LoRA +5.45 % -> -0.01 %, full fine-tuning +1.21 % -> -0.01 %.

    SigLIP's attention-pooling head: the fp32 ``last_hidden_state`` the model output holds and
    the packed key/value projection before its ``.contiguous()`` copy (torch/nn/functional.py
    ``_in_projection_packed``) are both alive while the head runs. Under autocast, the 16-bit
    copy of the (transposed) keys that autocast makes for ``linear`` is held until the call
    returns, while ``at::linear`` on that non-contiguous 3-D input runs ``matmul`` (which saves
    its own contiguous copy: ``pooler/kv_input``) and adds the bias out of place, so at that add
    the matmul output (counted as ``pooler/kv``, which takes its size once it is freed) and the
    sum are both alive (aten/src/ATen/native/Linear.cpp ``linear``; the trace engine's peak op,
    ``aten.add.Tensor`` in ``head.attention``)."""
    if model.architecture == "vision-encoder" and model.vision_pooler == "attention-probe":
        c, r = compute_and_residual_bytes(training)
        t = training.micro_batch_size * tokens_per_sequence(model, training)
        autocast_copy = c if training.uses_autocast else 0
        return (r + 2 * c + autocast_copy) * model.hidden_size * t
    if model.head not in ("causal-lm", "masked-lm", "seq2seq-lm"):
        return 0
    total = _special_loss_forward_bytes(model, training)
    if total is None:
        t = training.micro_batch_size * output_tokens(model, training)
        c, _ = compute_and_residual_bytes(training)
        upcast, shifted, converted = _plain_loss_forward_parts(model, training)
        total = c * model.vocab_size * t + max(upcast + shifted, converted)
    return -(-total // parallel_divisor("logits", training))


def _plain_loss_forward_parts(model: ModelSpec, training: TrainingConfig) -> tuple[int, int, int]:
    """The fp32 tensors beside the 16-bit logits at the end of the forward under transformers'
    own loss, bytes on all ranks: the loss's upcast (one chunk of it with a chunked loss), the
    shifted copy (:func:`shifted_logits_bytes`), and accelerate's fp32 copy of the output made
    after the loss returned (Note [accelerate's fp32 outputs]); 0 for what does not apply."""
    c, _ = compute_and_residual_bytes(training)
    v = model.vocab_size
    t = training.micro_batch_size * output_tokens(model, training)
    chunk = -(-t // max(training.chunked_cross_entropy, 1))
    upcast = 4 * v * chunk if loss_upcast(model, training) and c != 4 else 0
    converted = 4 * v * t if accelerate_output_bytes(model, training) else 0
    return upcast, shifted_logits_bytes(model, training), converted


def shifted_copy_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the shifted copy of the upcast logits when it is a tensor of its own among the
    loss's forward transients (:func:`loss_forward_transient_bytes`, per rank): transformers'
    loss before 4.49 makes ``logits.float()`` (or takes the model's fp32 logits) and then
    ``shift_logits = logits[..., :-1, :].contiguous()``, two fp32 tensors alive together until
    the loss returns, each its own allocation; 0 when the loss is another (a special rule of
    :func:`loss_forward_transient_bytes`), makes no shifted copy or does not upcast, or when
    accelerate's fp32 copy is the larger.

    Source: transformers 4.39.3 models/llama/modeling_llama.py ``LlamaForCausalLM.forward``;
    4.48.0 loss/loss_utils.py ``ForCausalLMLoss``."""
    if model.head not in ("causal-lm", "masked-lm", "seq2seq-lm"):
        return 0
    if (
        model.architecture == "vision-encoder"
        or _special_loss_forward_bytes(model, training) is not None
    ):
        return 0
    upcast, shifted, converted = _plain_loss_forward_parts(model, training)
    if not upcast or not shifted or upcast + shifted < converted:
        return 0
    return -(-shifted // parallel_divisor("logits", training))


def upcast_logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the 16-bit logits transformers' model code frees at its own upcast, per rank:
    the LM head's output, c V t, where the model returns ``logits.float()``
    (``ModelSpec.returns_fp32_logits``) under a loop that holds those fp32 logits (``step`` /
    ``previous``), without pipelining or accelerate's own fp32 copy; 0 otherwise.

    Note [The upcast 16-bit logits]
        Llama before transformers 4.46 (Mistral before 4.48) ends its forward with ``logits =
        self.lm_head(hidden_states); logits = logits.float()`` (4.40.0 models/llama/
        modeling_llama.py ``LlamaForCausalLM.forward``, the same in 4.39.3): the name is
        rebound, and no node saves the 16-bit output (the upcast's backward keeps only the
        dtype; a linear's backward reads its input and weight), so the 16-bit logits are freed
        at the upcast, before the loss's shifted copy and log-softmax. Where the loop holds the
        fp32 logits (fsdp_qlora's ``output``, the ``step`` loop) the schedule makes the 16-bit
        ones just before them and frees them just after; they were held with the loss's
        other forward transients until the loss returned. Checked on torch's autograd on the
        CPU: the lm_head output's storage is freed at the rebinding
        (tests/analytic/test_upcast_logits.py). The plain loop (the output dropped after the
        loss) meets the same rebinding: its 16-bit logits go at the upcast too, before the
        shifted copy (:func:`model_upcast_logits_bytes`; 4.45.0's ``self.lm_head(...).float()``
        binds no name to them at all). Checked on a real CPU trace of transformers 4.40.0
        (benchmarks/transformers_release_trace.py).
    """
    t = training
    if t.training_loop not in ("step", "previous"):
        return 0
    return model_upcast_logits_bytes(model, t)


def model_upcast_logits_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the 16-bit logits transformers' model code frees at its own upcast, per rank,
    whatever the loop (Note [The upcast 16-bit logits]): c V t where the model returns
    ``logits.float()`` (``ModelSpec.returns_fp32_logits``), without pipelining or accelerate's
    own fp32 copy; 0 otherwise."""
    t = training
    if not (
        t.conventions.hf_model_code
        and model.returns_fp32_logits(t.transformers_release)
        and t.pipeline_parallel_size == 1
        and not accelerate_output_bytes(model, t)
        and model.head == "causal-lm"
    ):
        return 0
    c, _ = compute_and_residual_bytes(t)
    if c == 4:  # fp32 logits already: ``float()`` returns them
        return 0
    tokens = t.micro_batch_size * output_tokens(model, t)
    return -(-c * model.vocab_size * tokens // parallel_divisor("logits", t))


def _special_loss_forward_bytes(model: ModelSpec, training: TrainingConfig) -> int | None:
    """:func:`loss_forward_transient_bytes` on all ranks for the losses with rules of their
    own; None for transformers' plain loss (:func:`_plain_loss_forward_parts`)."""
    t = training.micro_batch_size * output_tokens(model, training)
    c, _ = compute_and_residual_bytes(training)
    v = model.vocab_size
    chunk = -(-t // max(training.chunked_cross_entropy, 1))
    kind = loss_kind(model, training)
    total: int | None = None
    if kind in ("logits-sum", "logits-mean"):
        total = c * v * t  # the logits; the sum / mean is one value
    elif kind == "cs336-cross-entropy":
        total = written_out_loss_forward_bytes(training, t=t, v=v)
    elif training.conventions.own_model_code:
        # Note [litgpt's cast output]: every chunk of the 16-bit logits is alive while
        # Fabric casts them (the fp32 logits themselves are a head term)
        total = c * v * t
    elif model.head == "seq2seq-lm" and c != 4:
        total = 4 * v * chunk  # the logits are a head term (``logits_for_loss``)
    elif unsloth_fused_loss(model, training):
        # Note [Unsloth's fused cross-entropy]: the logits and their gradient in the logits'
        # dtype, then the input gradient before its copy into the saved one
        total = unsloth_fused_forward_bytes(model, training, t=t)
    elif cut_cross_entropy(model, training):
        total = 0  # Note [Unsloth's Cut Cross Entropy]: no logit is written
    elif unsloth_logits_loss(model, training):
        total = 0  # Note [Unsloth's cross-entropy on the logits]: they are what it saves
    elif compiled_loss(model, training):
        # Note [Compiled chunked cross-entropy]: the logits are the saved ``chunk_logits``
        # themselves and the compiled upcast never writes an fp32 copy
        total = 0
    elif megatron_cross_entropy(model, training):
        # Note [Megatron's vocabulary-parallel cross-entropy]: the 16-bit logits beside their
        # fp32 copy, which is the saved softmax (a head term); fp32 logits are that copy
        total = c * v * t if c != 4 else 0
    elif transposed_cross_entropy(model, training):
        # Note [torchtune's transposed cross-entropy]: the shifted fp32 logits and the
        # log-softmax kernel's contiguous copy of their transposed view
        total = 2 * 4 * v * shifted_positions(model, training)
    return total


def loss_backward_tensors(model: ModelSpec, training: TrainingConfig) -> int:
    """(tokens x vocabulary) tensors the loss's backward holds at once besides what the loss
    saved: one for ``logits-sum`` / ``logits-mean`` (the expanded gradient, materialised for
    the LM head's matmul), for Megatron's vocabulary-parallel cross-entropy (Note [Megatron's
    vocabulary-parallel cross-entropy]) and for the course's cross-entropy, two under autocast
    (Note [The course's cross-entropy]), three under DTensor's loss parallel, two otherwise
    (:func:`loss_backward_transient_bytes`)."""
    kind = loss_kind(model, training)
    if kind == "cs336-cross-entropy":  # Note [The course's cross-entropy]
        c, _ = compute_and_residual_bytes(training)
        return 1 if written_out_exp_bytes(training) == c else 2
    if cut_cross_entropy(model, training):
        return 1  # Note [Unsloth's Cut Cross Entropy]: de and dc, one kernel's, as one block
    if kind not in ("cross-entropy", TRANSPOSED_CROSS_ENTROPY) or megatron_cross_entropy(
        model, training
    ):
        return 1  # Megatron's: the gradient's 16-bit cast (Note [Megatron's ...])
    return 3 if training.loss_parallel else 2


@per_configuration  # the builder's head and the estimate's details ask
def loss_backward_transient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes live only at the start of backward: the gradient of the log-softmax output and the
    gradient it produces, two fp32 (T, V) tensors (``_log_softmax_backward_data``; measured as the
    step's peak in shared/notes/tracing-without-a-gpu.md sec. 2). With a chunked loss
    (``chunked_cross_entropy`` = N; torchtune ``CEWithChunkedOutputLoss``, lit-gpt
    ``chunked_cross_entropy``) only one chunk's pair is alive at a time: 1/N of it, in the logits'
    dtype when the loss does not upcast. DTensor's loss parallel (torchtitan, vocabulary-sharded
    logits) holds three: its ``_log_softmax_backward`` and the masked ``nll_loss`` gradient
    (torch/distributed/tensor/parallel/loss.py; seen in the trace of llama-3.2-1b, TP 2)."""
    if model.head not in ("causal-lm", "masked-lm", "seq2seq-lm"):
        return 0
    if unsloth_fused_loss(model, training):
        return 0  # Note [Unsloth's fused cross-entropy]: the gradients were made in forward
    if cut_cross_entropy(model, training):
        return cut_cross_entropy_backward_bytes(model, training)
    if unsloth_logits_loss(model, training):
        return 0  # Note [Unsloth's cross-entropy on the logits]: in place
    t = training.micro_batch_size * output_tokens(model, training)
    c, _ = compute_and_residual_bytes(training)
    per_value = 4 if loss_upcast(model, training) else c
    chunks = max(training.chunked_cross_entropy, 1)
    n = loss_backward_tensors(model, training)
    kind = loss_kind(model, training)
    if kind in ("logits-sum", "logits-mean"):
        # ``sum`` backward expands the incoming scalar (a view), ``mean``'s divides it (one
        # tensor): the LM head's matmul backward makes it one contiguous (t, V) tensor of the
        # logits' dtype (derivatives.yaml ``sum``, ``mean``)
        per_value = c
    elif kind == "cs336-cross-entropy":
        # Note [The course's cross-entropy]: e, and under autocast c more at a subtraction
        e = written_out_exp_bytes(training)
        total = (e + (c if c != e else 0)) * model.vocab_size * t
        return -(-total // parallel_divisor("logits", training))
    if loss_in_logits_dtype(model, training):
        # nll_loss's fp32 gradient (Note [Cross-entropy on 16-bit logits])
        n, per_value = 1, 4
    if compiled_loss(model, training):
        # Note [Compiled chunked cross-entropy]: one chunk's gradient, in the logits' dtype
        n, per_value = 1, c
    if megatron_cross_entropy(model, training):
        # Note [Megatron's vocabulary-parallel cross-entropy]: the saved softmax is the fp32
        # gradient; autograd's cast of it to the logits' dtype is the one new tensor
        n, per_value = 1, (c if c != 4 else 0)
    if transposed_cross_entropy(model, training):
        # Note [torchtune's transposed cross-entropy]: the fp32 model output's shifted positions
        per_value, t = 4, shifted_positions(model, training)
    if model.head == "seq2seq-lm":
        # T5's CrossEntropyLoss: the step's peak is at ``nll_loss_backward``, with its one
        # fp32 (tokens x V) gradient (traced on 2-layer T5 / Flan-T5)
        n = 1
    total = n * per_value * model.vocab_size * -(-t // chunks)
    return -(-total // parallel_divisor("logits", training))


def chunked_loss_gradient_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the logits gradients of the other N - 1 chunks of a chunked cross-entropy,
    alive beside the last one (:func:`loss_backward_transient_bytes`) through the head's
    backward: every chunk's loss backward runs before the chunks' output projections (Note
    [Compiled chunked cross-entropy]); c*V per token. 0 without a chunked loss."""
    n = training.chunked_cross_entropy
    if n <= 1 or model.head != "causal-lm" or training.conventions.own_model_code:
        return 0
    if unsloth_fused_loss(model, training):  # its gradients are made piece by piece in forward
        return 0
    c, _ = compute_and_residual_bytes(training)
    t = training.micro_batch_size * output_tokens(model, training)
    chunk = -(-t // n)
    total = c * model.vocab_size * (t - chunk)
    return -(-total // parallel_divisor("logits", training))


def chunked_head_weight_grad_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes alive beside the sum so far of the head weight's gradient while the next chunk's
    is added, under a chunked loss with a trained head: the N output projections share one
    weight, and autograd sums the gradients flowing into its ``AccumulateGrad`` node in that
    node's input buffer (torch/csrc/autograd/input_buffer.cpp ``InputBuffer::add`` /
    ``accumulate``: ``old_var + var``, out of place for two dense gradients), so at each sum
    from the second chunk on the new (V, h) gradient and the sum are alive beside the old
    one: 2*c*V*h (the head's tensor-parallel shard); 0 for a frozen head or an unchunked loss.
    Seen in the trace (the peak at ``aten.add.Tensor`` in ``lm_head``).
    """
    if (
        training.chunked_cross_entropy <= 1
        or model.head != "causal-lm"
        or training.conventions.own_model_code
        or not training.trains_lm_head
        or unsloth_fused_loss(model, training)  # added in place: ``grad_lm_head.add_``
    ):
        return 0
    c, _ = compute_and_residual_bytes(training)
    return 2 * c * model.vocab_size * model.hidden_size // training.tensor_parallel_size
