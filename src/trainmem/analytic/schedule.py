"""The analytic engine's step schedule: every tensor the cited formulas count, in the order a
PyTorch training step allocates and frees it, for one rank.

Note [Analytic step schedule]
    One :class:`~trainmem.schedule.StepSchedule` per distinct rank (Note [One description of
    the step]); its ``peak()`` is the analytic estimate and its expansion is what the allocator
    simulator replays. Identical layers are one ``Repeat``; identical micro-batches another.

    * setup: every parameter tensor (:mod:`~trainmem.analytic.tensor_states`), then warm-up
      steps (the first step allocates the optimizer states lazily after its backward, torch's
      ``_init_group``, and the cuBLAS workspaces at the first matmul of each thread; the caching
      allocator's cache reaches its fixed point by the third step: BERT-large b=4 fp32 reserves
      9.29, 12.81, 12.96, 12.96 GB after 1, 2, 3, 5 steps);
    * per micro-batch, ``forward``: ZeRO-3 / FSDP gathered parameters (the current and the
      prefetched layer, Rajbhandari et al. 2020 sec. 5.3; FSDP ``forward_prefetch``; the root
      module's stay gathered, ``reshard_after_forward=False`` on the root), the activations of
      the other micro-batches a pipeline stage holds (Korthikanti et al. 2022 sec. 4.2.3), the
      embedding terms, per layer the saved terms of
      :func:`~trainmem.analytic.activations.layer_activation_terms` (under checkpointing the
      layer input is saved and the rest allocated and freed), autocast's cached 16-bit weight
      copies (held until the autocast region exits), the dequantized weight of a quantized base
      (bitsandbytes ``MatMul4Bit``, one at a time), the logits while the loss runs, the head
      terms; with activation offloading the layer before the current one leaves for the CPU
      (torchtune ``OffloadActivations``: the current and the prefetched layer stay);
    * ``backward``: the two fp32 (tokens x vocab) log-softmax gradients, the residual-stream
      gradient, then layer by layer in reverse: recomputed terms, the MLP's backward
      transients, the MLP's saved tensors freed, eager attention's backward transients, the
      layer's gradients (first micro-batch of the step; later ones accumulate into them), the
      unsharded gradient bucket before its reduce-scatter (ZeRO-2/3, gradient offload), the rest
      of the layer's saved tensors freed; with ``optimizer_in_backward`` each layer's gradients
      are stepped and freed at once;
    * ``optimizer``: the step's temporaries (``foreach``: one per-parameter list alive together,
      ``torch._foreach_*``; ``for-loop``: one parameter at a time; ``fused``: none);
    * ``zero_grad``: gradients freed (``set_to_none=True``, the default since PyTorch 2.0) or
      kept for the next step.

    Each term is split into the single tensors it is made of (the largest natural tensor size
    that divides it), so the allocator sees realistic block sizes.

Note [FSDP under pipeline parallelism]
    With pipeline parallelism, ``torch.distributed.pipelining`` runs every micro-batch's
    backward of an FSDP2 stage with ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)`` (torch/distributed/pipelining/stage.py
    ``backward_maybe_with_nosync``), and reduces only after the last micro-batch
    (``perform_reduce_grad``); torchtitan also sets ``reshard_after_forward=False`` under PP
    (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``). So the stage's parameters stay
    gathered for the whole step, and its gradients accumulate unsharded, upcast to the reduce
    dtype (FSDP2 ``FSDPParam.to_accumulated_grad_if_needed``: fp32 under torchtitan's
    ``MixedPrecisionPolicy(reduce_dtype=float32)``), until the reduce-scatter leaves the shards.

Note [New gradients under pipeline parallelism]
    Under pipeline parallelism FSDP2 skips the reduce-scatter and accumulates (Note [FSDP under
    pipeline parallelism]); each micro-batch's backward still gives every unsharded parameter a
    new gradient in the parameter's dtype (the compute dtype under ``MixedPrecisionPolicy(
    param_dtype=bf16)``), which lives until the layer's post-backward adds it into the fp32
    accumulated gradient (``FSDPParam.accumulate_unsharded_grad_if_needed``) or, on the first
    micro-batch, becomes it (``to_accumulated_grad_if_needed``: ``grad.to(reduce_dtype)``,
    then the 16-bit gradient dropped), parameter by parameter
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``post_backward``). The MLP's
    weight gradients are made in the MLP's backward, so its three [i / t, h] gradients are alive
    at the MLP's backward transients; the attention's come after. Seen in the trace of
    llama-3.1-405b shapes (4 layers, FSDP 8 x TP 8 + SP x PP 2): three bf16 [i / 8, h]
    gradients alive at gate_proj's input-gradient allocation.

Note [FSDP2 post-backward]
    FSDP2 (``FrameworkConventions.fsdp2_post_backward``) reduces a layer's gradients in its
    post-backward, after the whole layer's backward: it reshards the layer's parameters, releases
    the previous group's reduce-scatter input, then ``foreach_reduce`` allocates this layer's
    (the unsharded gradients copied in the reduce dtype) on the default stream and keeps it
    until the next group's post-backward (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py ``post_backward``: ``reduce_scatter_max_input_buffers`` = 1;
    _fsdp_collectives.py ``foreach_reduce``). So layer ``i + 1``'s input lives through layer
    ``i``'s whole backward, the recomputation of a checkpointed layer included, and the first
    layer's lives through the token embedding's backward until the root's final callback
    (_fsdp_state.py ``_root_post_backward_final_callback``), while that layer's gathered
    parameters are already resharded. Seen in the trace of llama-3.2-1b FSDP 2 x TP 2 + SP.

Note [FSDP2 root group]
    Under FSDP2's post-backward order the root group (token embedding, final norm, LM head:
    torchtitan's root ``fully_shard(model)``, the trace's root module) is reduced only in the
    root's final callback, after the whole backward. Until then its gradients are the unsharded
    parameters' ``.grad``: this rank's tensor-parallel slice in the unsharded parameters'
    dtype, bf16 under torchtitan's policy, fp32 under autocast (the head's
    [V / t, h] from the head's backward on; the embedding's from its backward, the whole-
    vocabulary DTensor gradient redistributed to the weight's vocabulary shard and that freed).
    The final callback then reshards the root, releases the first layer's reduce-scatter input,
    copies the unsharded gradients into one reduce-scatter input in the reduce dtype, frees
    them and leaves the shards (torch/distributed/fsdp/_fully_shard/_fsdp_state.py
    ``_root_post_backward_final_callback`` -> ``FSDPParamGroup.post_backward`` ->
    _fsdp_collectives.py ``foreach_reduce``). A tied lookup's gradient without DTensor is added
    in place into the head's (a plain tensor holding its last reference: torch/csrc/autograd/
    input_buffer.cpp ``accumulate``), so only while the add runs does it exist. Seen in the
    trace of llama-3.1-70b FSDP 8 x TP 4 + SP x CP 2, full AC, whose peak is the embedding's
    backward (-2.3% before the rule: the head's sharded fp32 gradient stood for its 4x larger
    unsharded bf16 one).

Note [Tied embedding gradient under DTensor]
    With the token embedding vocabulary-sharded by DTensor and tied to the LM head
    (``dtensor_vocab_parallel_embedding``; torchtitan's ``RowwiseParallel`` on the embedding,
    ``ColwiseParallel`` on the head), the lookup's weight gradient is computed for the whole
    vocabulary ([V, h] in the dtype of the weight it reads, as untied: bf16 gathered under
    torchtitan's policy, the fp32 weight under autocast, which does not cast embeddings); to add
    it to the head's gradient, sharded ``Shard(0)`` over the vocabulary, DTensor redistributes
    it to that placement, a local chunk cloned (torch/distributed/tensor/placement_types.py
    ``Shard._replicate_to_shard``: ``clone=True``), and autograd adds the two out of place,
    since a tensor subclass is never accumulated in place (torch/csrc/autograd/input_buffer.cpp
    ``accumulate``: ``can_accumulate_inplace`` is false for ``isTensorSubclassLike``). At that
    moment the whole-vocabulary gradient, the clone and the sum, each [V / t, h], and the
    head's gradient are alive; the sum then replaces the head's gradient (Note [FSDP2 root
    group]). Seen in the trace of llama-3.2-1b (tied) FSDP 2 x TP 2 + SP with full activation
    checkpointing, whose peak it is.

Note [FSDP gradient accumulation under no_sync]
    A framework that accumulates under FSDP1's ``no_sync()`` (``fsdp_no_sync_accumulation``:
    lit-gpt's ``fabric.no_backward_sync`` -> Lightning ``module.no_sync()``) with FULL_SHARD
    keeps each unit's gradient *unsharded* from the first micro-batch's backward to the last
    one's: torch distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` returns before the
    reduce-scatter while ``not state._sync_gradients`` (``flat_param.grad`` keeps the padded
    unsharded size, ``FlatParamHandle.prepare_gradient_for_backward``), and frees the gathered
    parameters all the same (``_should_free_in_backward``: FULL_SHARD reshards after forward).
    The last micro-batch runs with sync on: each unit's reduce-scatter leaves this rank's shard
    and frees the unsharded gradient, layer by layer in its backward. With flat-parameter
    gradients (:func:`~trainmem.analytic.tensor_states.flat_parameter_grads`) that unsharded
    gradient covers every weight of a LoRA layer, not only the adapters: about one unsharded
    copy of the layers per rank, alive from the first micro-batch's backward to the last one's.
    Run on the CPU under the fake process group in ``tests/analytic/test_fsdp_flat_parameter.py``.

Note [Flat-parameter gradients in backward]
    FSDP1 with ``use_orig_params=True`` runs a unit's forward on views of its unsharded flat
    parameter, made by one ``torch.split`` (torch distributed/fsdp/flat_param.py
    ``_get_unflat_views_aligned``); in backward autograd buffers the gradient of every view (the
    frozen base weights' too) until the split's backward concatenates them into the flat
    gradient (``split_with_sizes_backward``: ``at::cat``), so at the end of a layer's backward
    its per-parameter gradients and their concatenation are alive together (two unsharded
    copies of the layer in the gradient dtype). Under ``no_sync`` accumulation the micro-batches
    after the first add that concatenation into the kept gradient and free it (autograd
    ``AccumulateGrad``: ``variable_grad += new_grad``). Measured on the real FSDP1 on the CPU
    (torch.profiler allocation events, a 3-layer LoRA model, 2 fake ranks): per layer +1 unit
    of view gradients, +1 unit concatenated, the views freed; the accumulated unit kept in the
    first micro-batch, freed after the add in the later ones.

Source: torch/optim/optimizer.py, adam.py ``_init_group`` / ``_multi_tensor_adam``; autograd's
reverse-order backward; ATen/cuda/CublasHandlePool.cpp (one workspace per handle); the papers
cited per term in :mod:`trainmem.analytic.activations` and :mod:`trainmem.analytic.engine`.
"""

from __future__ import annotations

from trainmem.analytic.activation_shapes import compute_and_residual_bytes, tokens_per_sequence
from trainmem.analytic.activations import ActivationProfile
from trainmem.analytic.attention import (
    eager_scores_forward_bytes,
    forward_kv_cache_bytes,
    written_out_scores_forward_tensors,
)
from trainmem.analytic.autocast import autocast_cached_weight_bytes
from trainmem.analytic.backward_transients import (
    WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS,
    backward_layer_transients,
)
from trainmem.analytic.buffers import (
    deepspeed_zero3_gather_bytes,
    dequantized_weight_bytes,
    gathered_layer_bytes,
    gradient_buffer_from_init,
    kept_gathered_layer_bytes,
    reduce_scatter_layer_bytes,
    root_gathered_bytes,
)
from trainmem.analytic.checkpointing import (
    input_grad_hook_bytes,
    layer_is_checkpointed,
    op_selective_saved_terms,
)
from trainmem.analytic.head import final_hidden_transient_bytes, lm_head_dequant_bytes
from trainmem.analytic.loss import (
    chunked_head_weight_grad_bytes,
    chunked_loss_gradient_bytes,
    loss_backward_tensors,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
)
from trainmem.analytic.params import MLP_LINEARS
from trainmem.analytic.pipeline import logits_bytes, stage_buffers
from trainmem.analytic.temporaries import (
    CS336_ADAMW_TEMPORARIES,
    optimizer_step_temporary_bytes,
)
from trainmem.analytic.tensor_states import StateLayout, TensorState, flat_parameter_grads
from trainmem.analytic.transforms import active
from trainmem.analytic.transforms.base import (
    ALL_GATHER_STREAM,
    REDUCE_SCATTER_STREAM,
    Emitter,
    PipelineRank,
    RankContext,
    Where,
    all_gradients,
    alloc,
    free,
    free_gradients,
)
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

WEIGHT_COPIES = "autocast_weight_copies"

RELEASED_BEFORE_SOFTMAX_BACKWARD = frozenset(
    {
        "attention/out_proj_input",
        "scores/probs_for_values",
        "scores/dropout_mask",
        "attention/v",
        "attention/output_norm",
    }
)
"""Eager attention terms whose saving op runs its backward before the softmax's.

Note [Eager attention's backward order]
    Eager attention is ``o_proj(matmul(dropout(softmax(q k^T).to(c)), v))`` (transformers
    modeling_llama.py ``eager_attention_forward``). Backward runs o_proj's, the value matmul's,
    dropout's and the cast's nodes before the softmax's, and autograd releases a node's saved
    tensors as soon as it has run (torch/csrc/autograd/engine.cpp ``call_function``:
    ``fn.release_variables()`` when the graph is not retained). So the o_proj input, the
    probabilities fed to the value matmul, the dropout mask and v are gone when the softmax
    backward's two score-sized transients are live; q and k (the score matmul's) and the
    softmax output stay. A norm on the attention's output (Gemma-2/3
    ``post_attention_layernorm``) runs its backward before all of them. Checked against the
    trace engine (tiny-llama-test, bf16-mixed, eager, b=2, s=2048: the backward peak fell from
    10.6 % over the trace to 0.0 %) and a real GPU's snapshot (S003 of
    ../shared/validation/snapshots, benchmarks/snapshot_analytic_step.py)."""

WARMUP_STEPS = 1
"""Steps replayed before the measured one (Note [Analytic step schedule])."""


__all__ = ["ALL_GATHER_STREAM", "REDUCE_SCATTER_STREAM", "PipelineRank", "rank_schedule"]


class _Builder:
    """The terms of one rank, computed once, and the pieces of its step."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingConfig,
        rank: PipelineRank,
        layout: StateLayout,
        prof: ActivationProfile,
        workspace_per_handle: int,
    ) -> None:
        self.model, self.training, self.rank, self.prof = model, training, rank, prof
        self.ctx = ctx = RankContext.build(model, training, rank, layout, prof)
        self.transforms = active(ctx)
        # DeepSpeed ZeRO-1 frees the gradients into its partition at the step
        self.frees_grads = any(tr.frees_gradients_at_step for tr in self.transforms)
        self.workspace_per_handle = workspace_per_handle
        emb = layout.embedding if rank.has_embedding else []
        if rank.has_embedding and rank.stage > 0:  # the last stage's copy of the tied embedding
            emb = [s for s in layout.embedding if s.name == "embedding/tokens"]
        self.emb_states = emb
        self.head_states = layout.head if rank.has_head else []
        self.layer_states = layout.layer
        self.L = rank.num_layers
        tied = model.tie_word_embeddings and rank.has_head
        self.head_grad_states = self.head_states + [
            s for s in emb if tied and s.name == "embedding/tokens"
        ]
        self.emb_grad_states = [s for s in emb if s not in self.head_grad_states]
        # FrameworkConventions.dtensor_vocab_parallel_embedding: the token embedding's weight
        # gradient is a [V, h] partial one on each tensor-parallel rank
        tp = training.tensor_parallel_size
        vocab_parallel = tp > 1 and training.conventions.dtensor_vocab_parallel_embedding
        tokens = [s for s in self.emb_grad_states if s.name == "embedding/tokens" and s.trainable]
        self.vocab_grad_factor = tp if vocab_parallel else 1
        c_bytes, _ = compute_and_residual_bytes(training)
        # Note [Tied embedding gradient under DTensor]: the lookup's gradient is whole-vocabulary
        # on the rank that runs the lookup, tied to the head or not
        looked_up = [
            s
            for s in (self.emb_states if rank.stage == 0 else [])
            if s.name == "embedding/tokens" and s.trainable
        ]
        tied_here = bool(looked_up) and looked_up[0] in self.head_grad_states
        # the lookup reads the weight as gathered (bf16 under FSDP2's policy, the fp32 weight
        # under autocast, whose embedding is not cast), and its gradient has that dtype
        w_bytes = dtype_bytes(training.gathered_weight_dtype)
        self.tied_lookup = w_bytes * looked_up[0].numel if tied_here else 0
        self.vocab_grad = w_bytes * looked_up[0].numel if vocab_parallel and looked_up else 0
        self.tied_vocab_sum = self.vocab_grad // tp if tied_here else 0
        if tokens and tp == 1 and training.pipeline_parallel_size > 1 and training.zero_stage == 3:
            # FSDP2 under PP: the embedding's compute-dtype gradient exists before it is added
            # into the fp32 one accumulated over the micro-batches (to_accumulated_grad_if_needed)
            self.vocab_grad = c_bytes * tokens[0].numel
        dp = training.sharding_degree
        self.stage = training.zero_stage if dp > 1 else 0
        c, _ = compute_and_residual_bytes(training)
        self.c = c
        self.gather_a, self.gather_b, self.gather_root = self._gathers()
        # FSDP SHARD_GRAD_OP / NO_SHARD under a mixed-precision policy: each layer's gathered
        # weights stay from its forward to its backward (they replace the per-layer gathers)
        self.kept = kept_gathered_layer_bytes(self.layer_states, training)
        if self.kept and self.stage == 3:
            self.gather_a = self.gather_b = 0
        offloads_grads = training.offload in ("optimizer+gradients", "optimizer+params")
        self.reduce = (
            reduce_scatter_layer_bytes(self.layer_states, training)
            if self.stage >= 2 or offloads_grads
            else 0
        )
        streams = training.conventions.fsdp_collective_streams and self.stage == 3
        self.ag_stream = ALL_GATHER_STREAM if streams else 0
        self.rs_stream = REDUCE_SCATTER_STREAM if streams else 0
        self.flat_gather = self.gather_a if streams else 0  # one layer's flat all-gather output
        # Note [FSDP under pipeline parallelism]
        self.pp_fsdp = training.pipeline_parallel_size > 1 and self.stage == 3
        # Note [FSDP gradient accumulation under no_sync]; FULL_SHARD only (lit-gpt's): under
        # SHARD_GRAD_OP no_sync also keeps the gathered parameters, not modelled here
        self.no_sync = (
            not self.pp_fsdp
            and self.stage == 3
            and training.conventions.fsdp_no_sync_accumulation
            and training.gradient_accumulation_steps > 1
            and training.zero_grad_set_to_none
            and not gradient_buffer_from_init(training)
        )
        if self.no_sync:  # the accumulated unsharded gradient is the reduce-scatter's input
            self.reduce = 0
        self.unsharded_grads = self.pp_fsdp or self.no_sync
        # Note [Flat-parameter gradients in backward]
        self.flat_views = (
            sum(s.full_grad_bytes for s in self.layer_states)
            if flat_parameter_grads(training)
            else 0
        )
        self.stage_gather = self.stage_gather_root = 0
        if self.pp_fsdp:  # the layers' and the root's (embedding, norm, head) FSDP2 groups
            self.stage_gather = self.L * (self.gather_a + self.kept)
            self.stage_gather_root = self.gather_root
            self.gather_a = self.gather_b = self.gather_root = self.kept = self.reduce = 0
        # Note [FSDP2 post-backward]: each layer's reduce-scatter input is kept until the next
        # group's post-backward (the loop split by activation offloading keeps the old order)
        self.post_backward = (
            training.conventions.fsdp2_post_backward
            and self.stage == 3
            and not self.pp_fsdp
            and not self.flat_views
            and not self.no_sync
            and not (training.activation_offloading and self.L >= 2)
            and not training.optimizer_in_backward
        )
        if self.post_backward and not self.vocab_grad:
            # Note [FSDP2 root group]: a tied lookup's gradient, added in place into the head's
            self.vocab_grad = self.tied_lookup
        self.dequant = dequantized_weight_bytes(self.layer_states, training)
        self.mlp_tmp, self.attention_tmp, self.residual_tmp = backward_layer_transients(
            model, training
        )
        self.loss_tmp = loss_backward_transient_bytes(model, training) if rank.has_head else 0
        self.chunk_grads = chunked_loss_gradient_bytes(model, training) if rank.has_head else 0
        self.chunk_wgrad = chunked_head_weight_grad_bytes(model, training) if rank.has_head else 0
        self.loss_fwd = loss_forward_transient_bytes(model, training) if rank.has_head else 0
        self.kv_cache = forward_kv_cache_bytes(model, training, self.L)
        self.final_hidden = final_hidden_transient_bytes(model, training) if rank.has_head else 0
        self.input_grad_hook = input_grad_hook_bytes(model, training)
        self.scores_tmp, self.mask_tmp = eager_scores_forward_bytes(model, training)
        self.head_dequant = lm_head_dequant_bytes(model, training) if rank.has_head else 0
        self.weight_copy = (
            autocast_cached_weight_bytes(model, training) if layer_is_checkpointed(training) else 0
        )
        self.saved, self.dropped = self._layer_blocks()
        self._cache: dict[str, Repeat] = {}
        # pieces that depend only on the model states and this rank's share of them
        self._shared: dict[str, Repeat] = layout.cache.setdefault(
            ("schedule", self.L, rank.has_embedding, rank.has_head, rank.stage > 0, self.pp_fsdp),
            {},
        )
        self.emb_acts = prof.embedding if rank.stage == 0 else 0
        self.head_acts = prof.head if rank.has_head else 0
        on_gpu = min(self.L, 2) if training.activation_offloading else self.L
        self.in_flight_bytes = round(
            (rank.in_flight - 1) * (self.emb_acts + on_gpu * prof.per_layer)
        )
        # Note [Pipeline stage buffers]
        self.pp_buffers = stage_buffers(
            model,
            training,
            in_flight=rank.in_flight,
            first=rank.stage == 0,
            last=rank.has_head,
        )
        # GPipe runs every forward (and, on the last stage, every loss), then the backwards in
        # micro-batch order (torch/distributed/pipelining/schedules.py ``ScheduleGPipe.
        # _step_microbatches``): the other micro-batches in flight hold their loss's saved
        # tensors too, and micro-batch k's backward finds only k + 1 .. m - 1 still held, so
        # after the first at most m - 2 others
        gpipe = training.pipeline_schedule == "gpipe" and training.pipeline_parallel_size > 1
        per_micro_batch = self.emb_acts + on_gpu * prof.per_layer
        if gpipe:
            per_micro_batch += self.head_acts
            self.in_flight_bytes = round((rank.in_flight - 1) * per_micro_batch)
        # 1F1B: the warmup runs min(m, p - stage) forwards, then each backward is followed by
        # the next forward while one is left (schedules.py ``Schedule1F1B._step_microbatches``:
        # ``if fwd_mb_index == self._n_microbatches: break``, then the cooldown's backwards);
        # when the warmup already ran every micro-batch (m <= p - stage, as with torchtitan's
        # m = p on the first stage) the second backward finds one micro-batch fewer, as under
        # GPipe
        one_fewer = gpipe or (
            training.pipeline_schedule == "1f1b"
            and training.gradient_accumulation_steps <= rank.in_flight
        )
        later = max(rank.in_flight - 1, 1) if one_fewer else rank.in_flight
        self.in_flight_later_bytes = round((later - 1) * per_micro_batch)
        self.in_flight_outputs_later = stage_buffers(
            model, training, in_flight=later, first=rank.stage == 0, last=rank.has_head
        ).in_flight_outputs
        # the last stage's logits stay in ``output_chunks``: they are the kept part of the loss's
        # forward transients
        self.loss_fwd = max(self.loss_fwd - self.pp_buffers.output_chunk, 0)
        # the 16-bit logits and their fp32 copy are two tensors (the copy freed first)
        self.logits16 = 0
        # ``TrainingConfig.keep_logits``: the loop holds the logits until the step ends
        self.logits_kept = 0
        if not self.pp_buffers.output_chunk and rank.has_head:
            part = logits_bytes(model, training)
            if training.keep_logits and 0 < part <= self.loss_fwd:
                self.logits_kept = part
                self.loss_fwd -= part
            elif 0 < part < self.loss_fwd:
                self.logits16 = part
                self.loss_fwd -= part

    # -- terms ------------------------------------------------------------------------------

    def _gathers(self) -> tuple[int, int, int]:
        """(the current layer's gathered parameters, the prefetched layer's, the root module's)
        under ZeRO-3 / FULL_SHARD. DeepSpeed gathers the layer plus a prefetch bucket
        (:func:`~trainmem.analytic.buffers.deepspeed_zero3_gather_bytes`, counted once); FSDP
        the current and the next layer in the gathered dtype
        (:func:`~trainmem.analytic.buffers.gathered_layer_bytes`); torchao float8 all-gathers
        linear weights in float8 (1 byte each)."""
        if self.stage != 3:
            return 0, 0, 0
        t, c = self.training, self.c
        layer = self.layer_states
        root = root_gathered_bytes(self.emb_states + self.head_states, t)
        if t.is_fp8:
            per = (
                sum(
                    (1 if s.name != "vector" and not s.name.startswith("lora_") else c) * s.numel
                    for s in layer
                )
                // t.tensor_parallel_size
            )
            return per, per, root
        if t.conventions.zero_ipg_buckets:
            return deepspeed_zero3_gather_bytes(layer, self.model, t), 0, root
        per = gathered_layer_bytes(layer, t)
        return per, per, root

    def _layer_blocks(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(saved, dropped-and-recomputed) blocks of one layer as (term, bytes), non-MLP terms
        first (the forward order: attention, then MLP)."""
        prof, t = self.prof, self.training
        mode = t.activation_checkpointing
        if mode == "none":
            saved = dict(prof.terms)
        elif mode == "selective" and t.attention == "eager":
            saved = {k: v for k, v in prof.terms.items() if not k.startswith("scores/")}
        elif mode == "selective":  # op-level: matmul / SDPA outputs kept, the rest recomputed
            saved = {"op_selective_saved": prof.per_layer}
            parts = op_selective_saved_terms(self.model, t)
            if sum(parts.values()) == prof.per_layer:  # as the tensors they are
                saved = {f"op_selective/{k}": v for k, v in parts.items()}
        else:
            saved = {"layer_input": prof.per_layer}
        if mode == "selective" and t.attention != "eager":
            dropped = {"recomputed": prof.recompute}
        else:
            dropped = {k: v for k, v in prof.terms.items() if k not in saved}
        if (
            mode == "full"
            and "attention/norm" in dropped
            and self.model.pre_norms
            and self.model.architecture == "decoder"
        ):
            # the layer input the checkpoint keeps is not made again by the recomputation: the
            # first norm saves that very tensor (Note [Backward of a pre-norm block]; seen in
            # the generic path for the output-norm blocks of Gemma-2 and Gemma-3 too)
            dropped["attention/norm"] -= min(prof.per_layer, dropped["attention/norm"])
        elif mode == "full" and "attention/norm" in dropped:
            # a recompute smaller than the layer's terms (vision encoders: the first norm's
            # input is the held block input, :func:`activation_profile`): that norm's share
            excess = sum(prof.terms.values()) - prof.recompute
            if excess > 0:
                dropped["attention/norm"] = max(dropped["attention/norm"] - excess, 0)
        if (
            mode == "full"
            and self.model.architecture == "encoder-decoder"
            and sum(prof.terms.values()) < prof.recompute
        ):
            # T5's blocks are held as their mean (encoder blocks at the source length, decoder
            # blocks at the target length); the largest kind is recomputed whole (traced on
            # 2-layer T5 / Flan-T5). DeepSeek's MoE block peaks mid-recompute, where its mean
            # block already agrees with the trace.
            dropped["recompute/largest_block"] = prof.recompute - sum(prof.terms.values())
        if self.weight_copy:  # autocast's cache holds them (Note [Analytic step schedule])
            dropped.pop(WEIGHT_COPIES, None)
        pieces = _tensor_sizes(self.model, t)

        def blocks(terms: dict[str, int]) -> list[tuple[str, int]]:
            ordered = sorted(terms.items(), key=lambda kv: kv[0].startswith("mlp/"))
            return [
                (k, size)
                for k, v in ordered
                for size in (self._weight_blocks(v) if k == WEIGHT_COPIES else _split(v, pieces))
                if v > 0
            ]

        return blocks(saved), blocks(dropped)

    def _weight_blocks(self, total: int) -> list[int]:
        """16-bit weight copies of one layer as the tensors they are (q, k, v, o, the MLP's
        linears per expert, the router), or one block if their sum is not ``total``."""
        m, c = self.model, self.c
        h, i = m.hidden_size, m.intermediate_size
        q, kv = h * m.num_heads * m.head_dim, h * m.num_kv_heads * m.head_dim
        n_mlp = (3 if m.mlp_kind == "gated" else 2) * m.num_experts
        router = [h * m.num_experts] if m.num_experts > 1 else []
        sizes = [q, kv, kv, q] + [h * i] * n_mlp + router
        for div in (1, self.training.tensor_parallel_size):
            out = [c * n // div for n in sizes]
            if sum(out) == total:
                return out
        return [total]

    # -- pieces of the step -----------------------------------------------------------------

    def parameters(self) -> list[Item]:
        cached = self._shared.get("parameters")
        if cached is None:
            cached = self._shared["parameters"] = Repeat(tuple(self._parameters()), 1)
        return [cached]

    def _parameters(self) -> list[Item]:
        items: list[Item] = [
            alloc(s.param_bytes, Cat.PARAMETER, "init", f"param/{s.owner}/{n}", s.owner)
            for n, s in enumerate(self.emb_states + self.head_states)
        ]
        if self.emb_states and self.model.module_buffer_bytes:
            # the model's buffers, with the embeddings (counted with the parameters, as
            # ``torch.cuda.memory_allocated`` does)
            items.append(
                alloc(
                    self.model.module_buffer_bytes,
                    Cat.PARAMETER,
                    "init",
                    "buffers",
                    "(model)",
                    "the model's buffers",
                )
            )
        layer = tuple(
            alloc(s.param_bytes, Cat.PARAMETER, "init", f"param/{{i}}/{n}", "layers.{i}")
            for n, s in enumerate(self.layer_states)
        )
        items.append(Repeat(layer, self.L))
        return items

    def _grad_ops(
        self,
        states: list[TensorState],
        phase: Phase,
        key: str,
        module: str,
        *,
        unsharded: bool = False,
    ) -> list[Op]:
        if unsharded:  # Note [FSDP under pipeline parallelism]
            return [
                alloc(
                    s.full_grad_bytes * self._partial_factor(s),
                    Cat.GRADIENT,
                    phase,
                    f"ugrad/{key}/{n}",
                    module,
                    "unsharded gradients accumulated until the last micro-batch",
                )
                for n, s in enumerate(states)
            ]
        return [
            alloc(
                s.grad_bytes,
                Cat.GRADIENT,
                phase,
                f"grad/{key}/{n}",
                module,
                "gradients",
                self.rs_stream,
            )
            for n, s in enumerate(states)
        ]

    def _partial_factor(self, state: TensorState) -> int:
        """How many times its tensor-parallel slice a state's accumulated gradient is: the
        token embedding's partial gradient covers the whole vocabulary (FrameworkConventions.
        dtensor_vocab_parallel_embedding)."""
        if state.name == "embedding/tokens" and state in self.emb_grad_states:
            return self.vocab_grad_factor
        return 1

    def reduce_after_pipeline(self, gathered_root: Op, gathered: Op) -> list[Item]:
        """Pipelining's ``perform_reduce_grad`` after the last micro-batch: FSDP2's
        post-backward of each parameter group in turn, the root's (embedding, head) first,
        then the layers', each resharding its parameters (``FSDPParamGroup.post_backward``:
        ``reshard`` before ``foreach_reduce``), then leaving its gradient shard and freeing the
        unsharded gradient accumulated over the micro-batches (torch/distributed/pipelining/
        stage.py ``perform_reduce_grad``; Note [FSDP under pipeline parallelism])."""
        b: Phase = "backward"
        return [
            free(gathered_root, b),
            *self._pipeline_reduce_ops(self.head_grad_states, "head", "head"),
            *self._pipeline_reduce_ops(self.emb_grad_states, "embedding", "embedding"),
            free(gathered, b),
            Repeat(
                tuple(self._pipeline_reduce_ops(self.layer_states, "{i}", "layers.{i}")), self.L
            ),
        ]

    def _pipeline_reduce_ops(self, states: list[TensorState], key: str, module: str) -> list[Op]:
        """One FSDP2 group's post-backward after pipelining's micro-batches: a partial
        (whole-vocabulary) embedding gradient is first redistributed to its tensor-parallel
        shard, which frees the accumulated one (DTensor ``redistribute``); ``foreach_reduce``
        copies the unsharded gradients into one reduce-scatter input, allocates the output (the
        shard), and frees its input (torch/distributed/fsdp/_fully_shard/
        _fsdp_collectives.py ``foreach_reduce``). Order as traced on llama-3.2-1b."""
        b: Phase = "backward"
        unsharded = self._grad_ops(states, b, key, module, unsharded=True)
        items: list[Op] = []
        partial = [
            (op, s) for op, s in zip(unsharded, states, strict=True) if self._partial_factor(s) > 1
        ]
        for op, s in partial:
            local = alloc(
                s.full_grad_bytes,
                Cat.TEMPORARY,
                b,
                f"redistributed/{key}",
                module,
                "the partial gradient reduce-scattered to this rank's vocabulary shard",
            )
            items += [local, free(op, b)]
        rs_input = alloc(
            sum(s.full_grad_bytes for s in states),
            Cat.TEMPORARY,
            b,
            f"rs_input/{key}",
            module,
            "FSDP2's reduce-scatter input (a copy of the unsharded gradients)",
            self.rs_stream,
        )
        items.append(rs_input)
        items += self._grad_ops(states, b, key, module)
        items += [free(op, b) for op in unsharded if all(op is not p for p, _ in partial)]
        items += [free(op, b) for op in items[: 2 * len(partial) : 2]]
        items.append(free(rs_input, b))
        return items

    def micro_batch(
        self, *, new_grads: bool, reduce: bool = False, zero_grad: bool = False
    ) -> Repeat:
        """One micro-batch (built once per kind, shared by the warm-up and measured steps).
        ``reduce``: the last micro-batch under ``no_sync`` accumulation, which reduce-scatters
        each unit's accumulated unsharded gradient (Note [FSDP gradient accumulation under
        no_sync]). ``zero_grad``: the previous step's gradients are freed between the forward
        and the backward (``TrainingConfig.zero_grad_before_backward``)."""
        key = f"micro/{new_grads}/{reduce}/{zero_grad}"
        cached = self._cache.get(key)
        if cached is None:
            body = self._micro_batch(new_grads=new_grads, reduce=reduce, zero_grad=zero_grad)
            cached = self._cache[key] = Repeat(tuple(body), 1)
        return cached

    def _reduce_ops(self, states: list[TensorState], key: str, module: str) -> list[Op]:
        """A unit's reduce-scatter after ``no_sync`` accumulation: this rank's gradient shard
        allocated, then the accumulated unsharded gradient freed (torch
        distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` -> ``_reduce_grad``)."""
        b: Phase = "backward"
        sharded = self._grad_ops(states, b, key, module)
        unsharded = self._grad_ops(states, b, key, module, unsharded=True)
        return [*sharded, *(free(op, b) for op in unsharded)]

    def _micro_batch(
        self, *, new_grads: bool, reduce: bool = False, zero_grad: bool = False
    ) -> list[Item]:
        """One micro-batch: forward then backward (Note [Analytic step schedule])."""
        t = self.training
        f: Phase = "forward"
        b: Phase = "backward"
        em = Emitter(self.transforms)
        where = Where(new_grads=new_grads, reduce=reduce, zero_grad=zero_grad)
        items: list[Item] = []
        spans = [
            alloc(
                self.gather_root,
                Cat.TEMPORARY,
                f,
                "gather/root",
                "(model)",
                "the root module's gathered parameters",
            ),
            alloc(
                self.gather_a,
                Cat.TEMPORARY,
                f,
                "gather/a",
                "layers",
                "gathered parameters of the current layer",
            ),
            alloc(
                self.in_flight_bytes if new_grads else self.in_flight_later_bytes,
                Cat.ACTIVATION,
                f,
                "in_flight",
                "pipeline",
                "activations of the other micro-batches in flight on this stage",
            ),
            alloc(
                self.pp_buffers.in_flight_outputs if new_grads else self.in_flight_outputs_later,
                Cat.ACTIVATION,
                f,
                "pp/outputs",
                "pipeline",
                "stage outputs kept for backward (pipelining fwd_cache)",
            ),
        ]
        items += spans
        emb_act = alloc(
            self.emb_acts, Cat.ACTIVATION, f, "act/embedding", "embedding", "embedding activations"
        )
        items.append(emb_act)
        # the next layer is prefetched while one runs, in the forward and in the backward
        # through the layers; around the head and the loss only the current one is gathered
        # (FSDP ``forward_prefetch`` / ``BACKWARD_PRE``; seen in the trace of FSDP2)
        prefetch_f = alloc(
            self.gather_b,
            Cat.TEMPORARY,
            f,
            "gather/b",
            "layers",
            "gathered parameters of the prefetched layer",
            self.ag_stream,
        )
        mask = alloc(
            self.mask_tmp if t.activation_checkpointing == "none" else 0,
            Cat.TEMPORARY,
            f,
            "attention_mask",
            "(model)",
            "the additive causal mask of the eager attention",
        )
        items += [mask, prefetch_f, *self._forward_layers(), free(prefetch_f, f), free(mask, f)]
        head_dequant = alloc(
            self.head_dequant,
            Cat.TEMPORARY,
            f,
            "dequant/head",
            "head",
            "the LM head's dequantized weight",
        )
        logits = alloc(
            self.loss_fwd,
            Cat.TEMPORARY,
            f,
            "logits",
            "head",
            "logits (and their fp32 copy) while the loss runs",
        )
        logits16 = alloc(self.logits16, Cat.TEMPORARY, f, "logits16", "head", "logits")
        head_act = alloc(self.head_acts, Cat.ACTIVATION, f, "act/head", "head", "head activations")
        cache = alloc(
            self.kv_cache,
            Cat.TEMPORARY,
            f,
            "kv_cache",
            "layers",
            "the KV cache transformers builds in training, until the loss",
        )
        hidden = alloc(
            self.final_hidden,
            Cat.TEMPORARY,
            f,
            "final_hidden",
            "head",
            "the final hidden states, held by the model output until the loss",
        )
        chunk = [self._output_chunk()] if self.pp_buffers.output_chunk else [logits16]
        if self.logits_kept:
            chunk.append(self._kept_logits_op())
        items += [cache, hidden, head_dequant, *chunk, logits, free(head_dequant, f), head_act]
        items.append(free(logits, f))
        if not self.pp_buffers.output_chunk:
            items.append(free(logits16, f))
        items += [free(hidden, f), free(cache, f)]
        if self.weight_copy:
            copies = self._weight_copy_ops(f, "wcopy/{i}", "")
            items.append(Repeat(tuple(free(op, f) for op in copies), self.L))
        # backward
        if zero_grad:  # optimizer.zero_grad() between the loss and loss.backward()
            items += free_gradients(self.ctx, "zero_grad")
        items += em.at("backward.begin", where)
        # the loss's (tokens x vocab) gradients, two for a cross-entropy, three under DTensor's
        # loss parallel (:func:`~trainmem.analytic.activations.loss_backward_tensors`); all but
        # the last are freed before the head's backward
        n = loss_backward_tensors(self.model, t)
        label = "the (tokens x vocab) loss gradients"
        g1 = alloc(self.loss_tmp * (n - 1) // n, Cat.TEMPORARY, b, "loss/1", "loss", label)
        g2 = alloc(self.loss_tmp - g1.size_bytes, Cat.TEMPORARY, b, "loss/2", "loss", label)
        firsts = [
            alloc(g1.size_bytes // (n - 1), Cat.TEMPORARY, b, f"loss/1/{k}", "loss", label)
            for k in range(n - 2)
        ]
        if firsts:  # g1 as the n - 1 tensors it is
            g1 = alloc(
                g1.size_bytes - sum(x.size_bytes for x in firsts),
                Cat.TEMPORARY,
                b,
                "loss/1",
                "loss",
                label,
            )
        head_dequant_b = alloc(
            self.head_dequant,
            Cat.TEMPORARY,
            b,
            "dequant/head",
            "head",
            "the LM head's dequantized weight",
        )
        items += [*firsts, g1, g2, *(free(x, b) for x in firsts), free(g1, b)]
        items += [head_dequant_b, free(head_dequant_b, b), free(head_act, b)]
        # a chunked loss: the other chunks' logits gradients, alive through the head's
        # backward (Note [Compiled chunked cross-entropy])
        chunk_grads = alloc(
            self.chunk_grads,
            Cat.TEMPORARY,
            b,
            "loss/chunks",
            "loss",
            "the other chunks' logits gradients",
        )
        items.append(chunk_grads)
        head_grads = self._grad_ops(
            self.head_grad_states, b, "head", "head", unsharded=self.unsharded_grads
        )
        root_grads = self._root_unsharded_grads("head", self.head_grad_states)
        if self.post_backward:  # Note [FSDP2 root group]
            items += root_grads
        elif new_grads:
            items += head_grads
        if self.chunk_wgrad:
            # the next chunk's head weight gradient and the out-of-place sum, beside the sum so
            # far, after the first chunk's logits gradient is freed
            # (:func:`~trainmem.analytic.activations.chunked_head_weight_grad_bytes`)
            wgrad = alloc(
                self.chunk_wgrad,
                Cat.TEMPORARY,
                b,
                "loss/chunk_wgrad",
                "head",
                "the next chunk's head weight gradient and its sum with the others",
            )
            items += [free(g2, b), wgrad, free(wgrad, b)]
        if reduce:
            items += self._reduce_ops(self.head_grad_states, "head", "head")
        items.append(free(chunk_grads, b))
        if not self.chunk_wgrad:
            items.append(free(g2, b))
        residual = alloc(
            self.residual_tmp,
            Cat.TEMPORARY,
            b,
            "residual_grad",
            "layers",
            "the residual-stream gradient",
        )
        items.append(residual)
        if t.optimizer_in_backward and new_grads:
            items += [free(op, b) for op in head_grads]
        prefetch_b = alloc(
            self.gather_b,
            Cat.TEMPORARY,
            b,
            "gather/b",
            "layers",
            "gathered parameters of the prefetched layer",
            self.ag_stream,
        )
        items += em.at("stack.pre_backward", where)
        layers = self._backward_layers(new_grads=new_grads, reduce=reduce)
        items += [prefetch_b, *layers, free(prefetch_b, b)]
        items.append(free(residual, b))
        gathered_layer = spans[1]
        if self.post_backward:  # Note [FSDP2 post-backward]: the first layer resharded
            items.append(free(gathered_layer, b))
        vocab_grad = alloc(
            self.vocab_grad,
            Cat.TEMPORARY,
            b,
            "grad/embedding/vocab",
            "embedding",
            "the token embedding's full-vocabulary partial gradient (DTensor)",
        )
        items.append(vocab_grad)
        # Note [Tied embedding gradient under DTensor]
        tied_shard = alloc(
            self.tied_vocab_sum,
            Cat.TEMPORARY,
            b,
            "grad/embedding/tied_shard",
            "embedding",
            "the lookup's gradient redistributed to the head gradient's vocabulary shard",
        )
        tied_sum = alloc(
            self.tied_vocab_sum,
            Cat.TEMPORARY,
            b,
            "grad/embedding/tied_sum",
            "embedding",
            "the tied weight's gradient: the head's plus the lookup's, added out of place",
        )
        items += [tied_shard, tied_sum, free(tied_shard, b)]
        if self.post_backward:  # Note [FSDP2 root group]: the sum replaces the head's gradient
            tied_head = [op for op, st in zip(root_grads, self.head_grad_states, strict=True)
                         if self.tied_vocab_sum and st.name == "embedding/tokens"]  # fmt: skip
            items += [free(op, b) for op in tied_head]
            root_grads = [op for op in root_grads if op not in tied_head]
            root_grads.append(tied_sum)
            emb_root = self._root_unsharded_grads("embedding", self.emb_grad_states)
            items += emb_root
            root_grads += emb_root
        hook = alloc(
            self.input_grad_hook if self.rank.stage == 0 else 0,
            Cat.ACTIVATION,
            b,
            "input_grad_hook",
            "embedding",
            "the embedding output (a leaf that requires grad) and its .grad",
        )
        if hook.size_bytes:
            items.append(hook)
        if new_grads and not self.post_backward:
            emb_grads = self._grad_ops(
                self.emb_grad_states, b, "embedding", "embedding", unsharded=self.unsharded_grads
            )
            items += emb_grads
            if t.optimizer_in_backward:
                items += [free(op, b) for op in emb_grads]
        items.append(free(vocab_grad, b))
        if self.post_backward:
            items += self._root_post_backward(root_grads, spans[0], new_grads=new_grads)
        else:
            items.append(free(tied_sum, b))
        if reduce:
            items += self._reduce_ops(self.emb_grad_states, "embedding", "embedding")
        items.append(free(emb_act, b))
        if hook.size_bytes:
            items.append(free(hook, b))
        items += em.at("micro_batch.end", where)
        done = (gathered_layer, spans[0]) if self.post_backward else ()
        items += [free(op, b) for op in reversed(spans) if op not in done]
        em.check()
        return items

    def _root_unsharded_grads(self, key: str, states: list[TensorState]) -> list[Op]:
        """The root group's unsharded gradients (this rank's tensor-parallel slice in the
        unsharded parameters' dtype), kept until the root's post-backward (Note [FSDP2 root
        group]); none without FSDP2's post-backward order."""
        if not self.post_backward:
            return []
        g = dtype_bytes(self.training.grad_dtype)
        w = dtype_bytes(self.training.gathered_weight_dtype)  # the unsharded parameters'
        return [
            alloc(
                w * (s.full_grad_bytes // g),
                Cat.TEMPORARY,
                "backward",
                f"root_grad/{key}/{n}",
                key,
                "the root group's unsharded gradients, kept until its post-backward (FSDP2)",
            )
            for n, s in enumerate(states)
        ]

    def _root_post_backward(
        self, unsharded: list[Op], gathered: Op, *, new_grads: bool
    ) -> list[Item]:
        """The root group's post-backward in the final callback (Note [FSDP2 root group]):
        reshard, release the first layer's reduce-scatter input, copy the unsharded gradients
        into the group's reduce-scatter input and free them, leave the shards."""
        b: Phase = "backward"
        states = self.head_grad_states + self.emb_grad_states
        rs_input = alloc(
            reduce_scatter_layer_bytes(states, self.training),
            Cat.TEMPORARY,
            b,
            "rs_input/root",
            "(model)",
            "FSDP2's reduce-scatter input of the root group (embedding, final norm, head)",
        )
        items: list[Item] = [free(gathered, b)]
        if self.L:
            items.append(free(self._reduce_scatter_input("0"), b))
        items += [rs_input, *(free(op, b) for op in unsharded)]
        if new_grads:
            items += self._grad_ops(self.head_grad_states, b, "head", "head")
            items += self._grad_ops(self.emb_grad_states, b, "embedding", "embedding")
        items.append(free(rs_input, b))
        return items

    def _reduce_scatter_input(self, index: str) -> Op:
        """Layer ``index``'s reduce-scatter input under FSDP2's post-backward order, allocated on
        the default stream before ``foreach_reduce`` enters the reduce-scatter stream
        (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``;
        Note [FSDP2 post-backward])."""
        return alloc(
            self.reduce,
            Cat.TEMPORARY,
            "backward",
            f"reduce/{index}",
            f"layers.{index}",
            "the layer's reduce-scatter input, kept until the next group's post-backward",
        )

    def _kept_logits_op(self) -> Op:
        """The logits the loop holds from the forward to the end of the step
        (``TrainingConfig.keep_logits``; 0 bytes otherwise)."""
        return alloc(
            self.logits_kept,
            Cat.TEMPORARY,
            "forward",
            "logits_kept",
            "head",
            "the logits, held by the training loop until the step ends",
        )

    def _output_chunk(self) -> Op:
        """The last stage's logits of micro-batch ``{i}``, kept in ``output_chunks`` until the
        next step (Note [Pipeline stage buffers])."""
        return alloc(
            self.pp_buffers.output_chunk,
            Cat.ACTIVATION,
            "forward",
            "pp/chunk/{i}",
            "pipeline",
            "the micro-batch's logits, kept until the next step (pipelining output_chunks)",
        )

    def _weight_copy_ops(self, phase: Phase, key: str, label: str) -> list[Op]:
        if not self.weight_copy:
            return []
        return [
            alloc(size, Cat.ACTIVATION, phase, f"{key}/{n}", "layers.{i}", label)
            for n, size in enumerate(self._weight_blocks(self.weight_copy))
        ]

    def _saved_ops(self, phase: Phase, key: str) -> list[Op]:
        return [
            alloc(size, Cat.ACTIVATION, phase, f"act/{key}/{n}", "layers.{i}", "saved activations")
            for n, (_, size) in enumerate(self.saved)
        ]

    def _forward_layers(self) -> list[Item]:
        f: Phase = "forward"
        body: list[Op] = [self._kept_op(f)]
        body += self._weight_copy_ops(f, "wcopy/{i}", "autocast's cached 16-bit weight copies")
        if self.dequant:
            d = alloc(
                self.dequant, Cat.TEMPORARY, f, "dequant", "layers.{i}", "a dequantized base weight"
            )
            body += [d, free(d, f)]
        saved = self._saved_ops(f, "{i}")
        dropped = [
            alloc(
                size,
                Cat.TEMPORARY,
                f,
                f"drop/{n}",
                "layers.{i}",
                "activations dropped by checkpointing",
            )
            for n, (_, size) in enumerate(self.dropped)
        ]
        # what the attention holds at its end beyond what it saves, before the MLP's terms
        scores = [
            alloc(
                size,
                Cat.TEMPORARY,
                f,
                f"scores_tmp/{k}",
                "layers.{i}",
                "the eager attention's scores and locals",
            )
            for k, size in enumerate(self._scores_tmp_tensors())
        ]
        n_saved = sum(not term.startswith("mlp/") for term, _ in self.saved)
        n_dropped = sum(not term.startswith("mlp/") for term, _ in self.dropped)
        body += saved[:n_saved] + dropped[:n_dropped] + scores
        body += [free(op, f) for op in scores]
        body += saved[n_saved:] + dropped[n_dropped:] + [free(op, f) for op in dropped]
        if not self.training.activation_offloading or self.L < 2:
            return [Repeat(tuple(body), self.L)]
        # the previous layer's saved tensors leave for the CPU once this layer has run
        offload = [free(op, f) for op in self._saved_ops(f, "{i_prev}")]
        return [Repeat(tuple(body), 1), Repeat(tuple(body + offload), self.L - 1, start=1)]

    def _kept_op(self, phase: Phase) -> Op:
        """One layer's gathered weights kept from its forward to its backward
        (:func:`~trainmem.analytic.buffers.kept_gathered_layer_bytes`)."""
        return alloc(
            self.kept,
            Cat.TEMPORARY,
            phase,
            "kept/{i}",
            "layers.{i}",
            "the layer's gathered weights, kept from its forward to its backward",
        )

    def _pp_new_grad_ops(self, phase: Phase) -> list[Op]:
        """The layer's new unsharded gradients of one micro-batch under pipeline parallelism,
        one per parameter in the compute dtype (Note [New gradients under pipeline
        parallelism])."""
        c, tp = dtype_bytes(self.training.compute_dtype), self.training.tensor_parallel_size
        return [
            alloc(
                c * s.numel // tp if s.trainable else 0,
                Cat.TEMPORARY,
                phase,
                f"pp_new_grad/{n}",
                "layers.{i}",
                "the layer's new unsharded gradients, until FSDP2's post-backward",
            )
            for n, s in enumerate(self.layer_states)
        ]

    def _backward_layers(self, *, new_grads: bool, reduce: bool = False) -> list[Item]:
        b: Phase = "backward"
        t = self.training
        body: list[Op] = []
        offloading = t.activation_offloading and self.L >= 2
        if offloading:  # prefetch the next layer backward will need
            body += [
                Op(
                    "alloc",
                    op.size_bytes,
                    op.category,
                    b,
                    op.key,
                    op.module,
                    "saved activations prefetched from the CPU",
                )
                for op in self._saved_ops(b, "{i_prev}")
            ]
        recomputed = [
            alloc(size, Cat.ACTIVATION, b, f"re/{n}", "layers.{i}", "recomputed activations")
            for n, (_, size) in enumerate(self.dropped)
        ]
        body += recomputed
        if self.weight_copy:
            copy = alloc(
                self.weight_copy,
                Cat.ACTIVATION,
                b,
                "wcopy/re",
                "layers.{i}",
                "recomputed 16-bit weight copies",
            )
            recomputed.append(copy)
            body.append(copy)
        if self.dequant:
            d = alloc(
                self.dequant, Cat.TEMPORARY, b, "dequant", "layers.{i}", "a dequantized base weight"
            )
            body += [d, free(d, b)]
        grads = self._grad_ops(
            self.layer_states, b, "{i}", "layers.{i}", unsharded=self.unsharded_grads
        )
        reduce_accumulated = reduce
        reduce_op = alloc(
            self.reduce,
            Cat.TEMPORARY,
            b,
            "reduce",
            "layers.{i}",
            "the layer's unsharded gradients before their reduce-scatter",
        )
        mlp_tmp = alloc(
            self.mlp_tmp, Cat.TEMPORARY, b, "mlp_tmp", "layers.{i}", "the MLP's backward transients"
        )
        # Note [New gradients under pipeline parallelism]
        pp_new = self._pp_new_grad_ops(b) if self.pp_fsdp and not self.flat_views else []
        new_mlp = [op for op, st in zip(pp_new, self.layer_states, strict=False) if _is_mlp(st)]
        new_rest = [op for op in pp_new if op not in new_mlp]
        saved = self._saved_ops(b, "{i}")
        is_mlp = [term.startswith("mlp/") for term, _ in self.saved]
        re_mlp = [term.startswith("mlp/") for term, _ in self.dropped]
        down = [term == "mlp/down_input" for term, _ in self.saved]
        re_down = [term == "mlp/down_input" for term, _ in self.dropped]
        body += [free(op, b) for op, m in zip(saved, down, strict=True) if m]
        body += [free(op, b) for op, m in zip(recomputed, re_down, strict=False) if m]
        body += [*new_mlp, mlp_tmp]
        if self.flat_views:  # Note [Flat-parameter gradients in backward]
            views = alloc(
                self.flat_views,
                Cat.TEMPORARY,
                b,
                "flat_views",
                "layers.{i}",
                "the layer's per-parameter gradients before autograd concatenates them",
            )
            fresh = alloc(
                0 if new_grads or not self.unsharded_grads else self.flat_views,
                Cat.TEMPORARY,
                b,
                "flat_fresh",
                "layers.{i}",
                "the layer's new flat gradient before it is added to the accumulated one",
            )
            body += [views]
            if new_grads and self.unsharded_grads:
                body += grads  # the concatenated gradient becomes the accumulated one
            body += [fresh, reduce_op, free(views, b)]
            if new_grads and not self.unsharded_grads:
                body += grads
            if reduce_accumulated:
                body += self._reduce_ops(self.layer_states, "{i}", "layers.{i}")
            body += [free(fresh, b), free(mlp_tmp, b)]
        else:
            if new_grads and not pp_new:
                body += grads
            if reduce_accumulated:
                body += self._reduce_ops(self.layer_states, "{i}", "layers.{i}")
            if not self.post_backward:
                body.append(reduce_op)
            body.append(free(mlp_tmp, b))
        body += [free(op, b) for op, m, d in zip(saved, is_mlp, down, strict=True) if m and not d]
        body += [
            free(op, b)
            for op, m, d in zip(recomputed, re_mlp, re_down, strict=False)
            if m and not d
        ]
        attention = [
            alloc(
                size,
                Cat.TEMPORARY,
                b,
                f"attention_tmp/{k}",
                "layers.{i}",
                "eager attention's backward transients",
            )
            for k, size in enumerate(self._attention_tmp_tensors())
        ]
        # Note [Eager attention's backward order]
        early = self._released_before_softmax_backward(self.saved)
        re_early = self._released_before_softmax_backward(self.dropped)
        body += [free(op, b) for op, e in zip(saved, early, strict=True) if e]
        body += [free(op, b) for op, e in zip(recomputed, re_early, strict=False) if e]
        body += [*new_rest, *attention, *(free(op, b) for op in attention)]
        if not self.post_backward:
            body.append(free(reduce_op, b))
        body += [free(op, b) for op, m, e in zip(saved, is_mlp, early, strict=True) if not (m or e)]
        body += [
            free(op, b)
            for n, op in enumerate(recomputed)
            if (n >= len(re_mlp) or not re_mlp[n]) and not (n < len(re_early) and re_early[n])
        ]
        for new_op, acc in zip(pp_new, grads, strict=False):  # FSDP2's post-backward, per param
            body += [acc, free(new_op, b)] if new_grads else [free(new_op, b)]
        if t.optimizer_in_backward and new_grads:
            body += [free(op, b) for op in grads]
        body.append(free(self._kept_op("forward"), b))
        if self.post_backward:  # Note [FSDP2 post-backward]: the previous layer's input goes
            first = (*body, self._reduce_scatter_input("{i}"))
            later = (*body, free(self._reduce_scatter_input("{i_next}"), b), first[-1])
            loop: list[Item] = [Repeat(first, 1, start=self.L - 1)] if self.L else []
            if self.L > 1:
                loop.append(Repeat(later, self.L - 1, reverse=True))
            return loop
        if not offloading:
            return [Repeat(tuple(body), self.L, reverse=True)]
        last = [op for op in body if op.label != "saved activations prefetched from the CPU"]
        return [
            Repeat(tuple(body), self.L - 1, reverse=True, start=1),
            Repeat(tuple(last), 1),
        ]

    def _scores_tmp_tensors(self) -> list[int]:
        """What the eager attention holds in the forward beyond what it saves, as the tensors
        it is made of where they are known (a written-out softmax:
        :func:`~trainmem.analytic.activations.written_out_scores_forward_tensors`)."""
        if self.model.attention_written_out and self.training.attention == "eager":
            return written_out_scores_forward_tensors(self.model, self.training)
        return [self.scores_tmp]

    def _attention_tmp_tensors(self) -> list[int]:
        """Eager attention's backward transients as the tensors they are: the five fp32
        score-sized tensors of a written-out softmax (Note [Backward of a written-out
        softmax]); one block otherwise."""
        n = WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS
        if self.model.attention_written_out and self.attention_tmp % n == 0:
            return [self.attention_tmp // n] * n
        return [self.attention_tmp]

    def _released_before_softmax_backward(self, blocks: list[tuple[str, int]]) -> list[bool]:
        """Per block of ``blocks``: saved by an op whose backward runs before eager
        attention's softmax backward (Note [Eager attention's backward order])."""
        if self.training.attention != "eager":
            return [False] * len(blocks)
        return [term in RELEASED_BEFORE_SOFTMAX_BACKWARD for term, _ in blocks]

    def optimizer(self, *, first: bool) -> list[Item]:
        """States (first step only), then the step's temporaries (a zero-byte marker opens the
        phase, so its peak exists even when the step allocates nothing)."""
        marker = alloc(
            0, Cat.TEMPORARY, "optimizer", "optimizer/step", "(optimizer)", "optimizer step"
        )
        items: list[Item] = [marker, free(marker, "optimizer")]
        if first:
            items.append(self._optimizer_states())
        if self.training.optimizer_in_backward:
            return items
        cached = self._shared.get("optimizer")
        if cached is None:
            em, where = Emitter(self.transforms), Where(first_step=first)
            before = em.at("optimizer.begin", where)
            body = (*before, *self._optimizer_temporaries(), *em.at("optimizer.end", where))
            em.check()
            cached = self._shared["optimizer"] = Repeat(body, 1)
        return [*items, cached]

    def _optimizer_states(self) -> Repeat:
        """Every optimizer state, allocated lazily by the first step (torch ``_init_group``)."""
        cached = self._shared.get("states")
        if cached is not None:
            return cached
        o: Phase = "optimizer"
        outer = [
            alloc(s.state_bytes, Cat.OPTIMIZER_STATE, o, f"state/{s.owner}/{n}", s.owner)
            for n, s in enumerate(self.emb_states + self.head_states)
        ]
        layer = tuple(
            alloc(s.state_bytes, Cat.OPTIMIZER_STATE, o, f"state/{{i}}/{n}", "layers.{i}")
            for n, s in enumerate(self.layer_states)
        )
        states = Repeat((*outer, Repeat(layer, self.L)), 1)
        self._shared["states"] = states
        return states

    def _optimizer_temporaries(self) -> list[Item]:
        t = self.training
        o: Phase = "optimizer"
        trainable = [
            s for s in self.emb_states + self.head_states + self.layer_states if s.trainable
        ]
        if t.offload != "none" or not trainable:
            return []
        gb = max(dtype_bytes(t.grad_dtype), 1)
        dp = t.sharding_degree

        def local(s: TensorState) -> int:
            n = s.full_grad_bytes // gb
            return -(-n // dp) if t.optimizer_states_partitioned else n

        outer = [s for s in self.emb_states + self.head_states if s.trainable]
        layer = [s for s in self.layer_states if s.trainable]
        n_local = sum(local(s) for s in outer) + self.L * sum(local(s) for s in layer)
        largest = max(s.full_grad_bytes for s in trainable) // gb
        total = optimizer_step_temporary_bytes(
            t, num_trainable_parameters=n_local, largest_parameter=largest
        )
        if total <= 0 or n_local == 0:
            return []
        label = f"the {t.step_implementation} {t.optimizer} step's temporaries"
        if t.step_implementation == "foreach":
            per = total / n_local
            outer_ops = [
                alloc(round(per * local(s)), Cat.TEMPORARY, o, f"opt/{s.owner}/{n}", s.owner, label)
                for n, s in enumerate(outer)
            ]
            layer_ops = [
                alloc(
                    round(per * local(s)), Cat.TEMPORARY, o, f"opt/{{i}}/{n}", "layers.{i}", label
                )
                for n, s in enumerate(layer)
            ]
            return [
                *outer_ops,
                Repeat(tuple(layer_ops), self.L),
                *(free(op, o) for op in outer_ops),
                Repeat(tuple(free(op, o) for op in layer_ops), self.L),
            ]
        largest_local = max(local(s) for s in trainable)

        # the course's AdamW makes its temporaries as separate parameter-sized tensors
        pieces = CS336_ADAMW_TEMPORARIES if t.step_implementation == "cs336" else 1

        def one(s: TensorState, module: str) -> list[Op]:
            size = round(total * local(s) / max(largest_local, 1))
            ops = [
                alloc(size // pieces, Cat.TEMPORARY, o, f"opt/tmp/{k}", module, label)
                for k in range(pieces)
            ]
            return [*ops, *(free(op, o) for op in ops)]

        items: list[Item] = [op for s in outer for op in one(s, s.owner)]
        items.append(Repeat(tuple(op for s in layer for op in one(s, "layers.{i}")), self.L))
        return items

    def step(self, *, first: bool) -> list[Item]:
        """One optimizer step: the micro-batches, the optimizer, zero_grad."""
        t = self.training
        m = t.gradient_accumulation_steps
        # gradients that are never freed: zero_grad(set_to_none=False), or a gradient buffer
        # the framework allocates at wrap time (Megatron's grad_data, DeepSpeed ZeRO-3's
        # partition)
        keep = not t.zero_grad_set_to_none or gradient_buffer_from_init(t)
        # zero_grad() between the forward and the backward: the previous step's gradients are
        # alive through the forward (the warm-up step is given them too, as after an earlier
        # step) and freed before the backward rebuilds them
        before = (
            t.zero_grad_before_backward
            and not keep
            and not t.optimizer_in_backward
            and not self.frees_grads  # DeepSpeed ZeRO-1 frees them into its partition
        )
        em = Emitter(self.transforms)
        where = Where(first_step=first)
        items: list[Item] = []
        if first:  # the forward thread's and autograd's cuBLAS handles, created at first use
            ws = self.workspace_per_handle
            items += [
                alloc(ws, Cat.TEMPORARY, "forward", "cublas/0", "cublas", "cuBLAS workspace"),
                alloc(ws, Cat.TEMPORARY, "forward", "cublas/1", "cublas", "cuBLAS workspace"),
            ]
        items += em.at("step.begin", where)
        if first and (keep or before):
            items += all_gradients(self.ctx, "forward")
        gathered = alloc(
            self.stage_gather,
            Cat.TEMPORARY,
            "forward",
            "gather/stage",
            "(stage)",
            "the stage's gathered parameters, kept across micro-batches",
        )
        gathered_root = alloc(
            self.stage_gather_root,
            Cat.TEMPORARY,
            "forward",
            "gather/stage/root",
            "(stage)",
            "the stage's gathered embedding / head, kept across micro-batches",
        )
        items.append(gathered_root)
        if self.pp_fsdp and self.flat_gather:  # each layer's flat all-gather output, two in flight
            flats = [
                alloc(
                    self.flat_gather,
                    Cat.TEMPORARY,
                    "forward",
                    f"gather/flat/{k}",
                    "(stage)",
                    "a layer's flat all-gather output",
                    self.ag_stream,
                )
                for k in range(2)
            ]
            items += [*flats, *(free(op, "forward") for op in flats)]
        items.append(gathered)
        if first:  # Note [Pipeline stage buffers]: one receive buffer per micro-batch
            items.append(
                alloc(
                    self.pp_buffers.recv_buffers,
                    Cat.TEMPORARY,
                    "forward",
                    "pp/recv",
                    "pipeline",
                    "per-micro-batch receive buffers of the pipeline stage",
                )
            )
        items.append(self.micro_batch(new_grads=not keep, zero_grad=before))
        kept_chunks = self.pp_buffers.output_chunk > 0  # not balanced: each keeps its logits
        if self.no_sync:  # Note [FSDP gradient accumulation under no_sync]
            if m > 2:
                again = self.micro_batch(new_grads=False)
                items.append(Repeat(again.body, m - 2, independent=True))
            items.append(self.micro_batch(new_grads=False, reduce=True))
        elif m > 1:
            again = self.micro_batch(new_grads=False)
            items.append(Repeat(again.body, m - 1, start=1, independent=not kept_chunks))
        merged = alloc(
            m * self.pp_buffers.output_chunk,
            Cat.TEMPORARY,
            "backward",
            "pp/merged",
            "pipeline",
            "the merged logits step() returns (torch.cat of output_chunks)",
        )
        # step() merges the outputs after the schedule's perform_reduce_grad (torch/distributed/
        # pipelining/schedules.py: ``_step_microbatches`` then ``_merge_outputs``)
        if self.pp_fsdp and not keep:  # the reduce-scatter after the last micro-batch
            items += self.reduce_after_pipeline(gathered_root, gathered)
            items += [merged, free(merged, "backward")]
        else:
            items += [merged, free(merged, "backward")]
            items += [free(gathered_root, "backward"), free(gathered, "backward")]
        items += self.optimizer(first=first)
        if self.logits_kept:  # the step function returns: its logits go
            items.append(free(self._kept_logits_op(), "optimizer"))
        if not keep and not before and not t.optimizer_in_backward and not self.frees_grads:
            cached = self._shared.get("zero_grad")
            if cached is None:
                cached = self._shared["zero_grad"] = Repeat(
                    tuple(free_gradients(self.ctx, "zero_grad")), 1
                )
            items.append(cached)
        # cleared when the next step() starts (``clear_runtime_states``)
        if kept_chunks:
            items.append(Repeat((free(self._output_chunk(), "zero_grad"),), m))
        em.check()
        return items


def rank_schedule(
    model: ModelSpec,
    training: TrainingConfig,
    rank: PipelineRank,
    *,
    layout: StateLayout,
    prof: ActivationProfile,
    workspace_per_handle: int,
) -> StepSchedule:
    """The step schedule of one rank (Note [Analytic step schedule]).

    Args:
        model / training: what is trained and how.
        rank: the pipeline stage the rank holds (the whole model without pipelining).
        layout: per-tensor model states (:func:`~trainmem.analytic.tensor_states.state_layout`).
        prof: activation terms (:func:`~trainmem.analytic.activations.activation_profile`).
        workspace_per_handle: cuBLAS workspace of one handle, bytes.

    Returns:
        The schedule: setup (weights, warm-up steps) and the steady-state step.
    """
    b = _Builder(model, training, rank, layout, prof, workspace_per_handle)
    setup: list[Item] = b.parameters()
    setup += b.step(first=True)
    for _ in range(WARMUP_STEPS - 1):
        setup += b.step(first=False)
    suffix = f" stage {rank.stage}" if training.pipeline_parallel_size > 1 else ""
    return StepSchedule(
        setup=tuple(setup),
        step=tuple(b.step(first=False)),
        name=f"{model.name} (analytic{suffix})",
    )


def _is_mlp(state: TensorState) -> bool:
    """A parameter of the layer's MLP (its LoRA adapters and fused experts included)."""
    name = state.name.split(".")[-1]
    return name in MLP_LINEARS or name.startswith("experts_")


def _tensor_sizes(model: ModelSpec, training: TrainingConfig) -> list[int]:
    """Sizes of the single tensors a layer's terms are made of, largest first: (t, i) and
    (t, h) activations in the compute, residual and fp32 dtypes, (b, a, s, s) scores, masks,
    for the tokens one rank holds: context parallelism splits every term by sequence
    (:func:`~trainmem.analytic.activations.parallel_divisor`), so a rank's tensors have
    ``b * s / cp`` tokens, and a tensor-parallel term's ``1 / t`` of the features or heads
    (Note [Per-rank tensor sizes])."""
    s, b = tokens_per_sequence(model, training), training.micro_batch_size
    cp, tp = training.context_parallel_size, training.tensor_parallel_size
    t = b * s // cp if (b * s) % cp == 0 else b * s
    c, r = compute_and_residual_bytes(training)
    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    i, h = model.intermediate_size * k_top, model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    sizes = {n * t for n in (4 * i, c * i, i, 4 * h, r * h, c * h, h, c * kv)}
    sizes |= {n * model.num_heads * s * s * b // cp for n in (4, c, 1)}
    if tp > 1:
        sizes |= {n * t // tp for n in (4 * i, c * i, i, 4 * h, c * h, h, c * kv)}
    return sorted((x for x in sizes if x > 0), reverse=True)


MAX_BLOCKS_PER_TERM = 64
"""A term is split into at most this many tensors (tiny sequence lengths would otherwise split a
term into millions of blocks); beyond it the term is one block."""


def _split(term_bytes: int, sizes: list[int]) -> list[int]:
    """A term as the tensors it is made of: the largest single-tensor size that divides it,
    repeated; the term as one block if none does (e.g. LayerNorm input + statistics)."""
    for size in sizes:
        if term_bytes >= size and term_bytes % size == 0:
            if term_bytes // size > MAX_BLOCKS_PER_TERM:
                break
            return [size] * (term_bytes // size)
    return [term_bytes]
