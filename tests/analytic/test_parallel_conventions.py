"""torchtitan-style parallelism conventions, derived by hand from the source they mirror."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig


def test_dtensor_sequence_parallel_saves_the_gathered_inputs() -> None:
    # torchtitan apply_tp: PrepareModuleInput(Shard(1) -> Replicate()) before wq/wk/wv and
    # w1/w3, whose matmuls save that full-sequence input; Megatron saves the shard
    # (Korthikanti Eq. 3 divides it by t). Per layer the difference is the two normed inputs,
    # (1 - 1/t) of c*h*t each: llama-3.2-1b, bf16 (c = 2), h = 2048, t = b*s = 2*1024, tp = 2.
    # Besides, Megatron's two norms per layer are its fused kernel (Note [Megatron's fused
    # RMSNorm]: input + fp32 rstd), without the fp32 copy of the input transformers' RMSNorm
    # saves (4 h t / tp each under SP; both residual streams are bf16 here).
    base = dict(
        micro_batch_size=2,
        seq_len=1024,
        tensor_parallel_size=2,
        sequence_parallel=True,
        precision="bf16-mixed",
    )
    titan = estimate(
        "llama-3.2-1b", TrainingConfig(framework="fsdp2", **base), simulate_allocator=False
    )
    megatron = estimate(
        "llama-3.2-1b", TrainingConfig(framework="megatron", **base), simulate_allocator=False
    )
    c, h, t, tp = 2, 2048, 2 * 1024, 2
    expected = 2 * c * h * t * (tp - 1) // tp + 2 * 4 * h * t // tp
    got = (
        titan.details["activations_per_layer_bytes"]
        - megatron.details["activations_per_layer_bytes"]
    )
    assert got == expected


def test_fsdp_under_pipeline_parallel_keeps_unsharded_fp32_gradients() -> None:
    # torch.distributed.pipelining runs each micro-batch's backward without gradient sync and
    # reduces after the last one; FSDP2 upcasts the accumulated unsharded gradient to the
    # reduce dtype (fp32). Stage 0 of llama-3.2-1b over 2 stages holds 8 layers and the
    # embedding: 8 * 60,821,504 + 262,668,288 = 749,240,320 parameters, so 4 B each of
    # unsharded gradients; perform_reduce_grad then runs FSDP2's post-backward group by group,
    # the root (the embedding) first, each writing its shard (1/4 with 4 data-parallel ranks)
    # before its unsharded gradient is freed (torch/distributed/pipelining/stage.py
    # perform_reduce_grad; the order the pipeline trace records): at most the embedding's
    # shard on top.
    training = TrainingConfig(
        seq_len=1024,
        pipeline_parallel_size=2,
        data_parallel_size=4,
        zero_stage=3,
        framework="fsdp2",
        gradient_accumulation_steps=4,
    )
    est = estimate("llama-3.2-1b", training, simulate_allocator=False)
    stage0 = est.schedules[0].model_states()
    n = 8 * 60_821_504 + 262_668_288
    assert stage0["gradients"] == pytest.approx(4 * n + 4 * 262_668_288 / 4, rel=1e-6)
    # and the stage's parameters stay gathered in bf16 for the whole step
    flat = TrainingConfig(seq_len=1024, data_parallel_size=4, zero_stage=3, framework="fsdp2")
    assert (
        est.schedules[0].peak().peak_bytes
        > estimate("llama-3.2-1b", flat, simulate_allocator=False).breakdown.parameters + 2 * n
    )


def test_torchtitan_fsdp_shards_over_data_and_context_parallel_ranks() -> None:
    # torchtitan apply_fsdp shards over the flattened dp_shard_cp mesh: with 2 data-parallel
    # and 4 context-parallel ranks every fp32 weight, gradient and Adam moment is split 8 ways
    # (4 + 4 + 8 bytes per parameter / 8); llama-3.2-1b has 1,235,814,400 parameters.
    training = TrainingConfig(
        seq_len=8192, data_parallel_size=2, context_parallel_size=4, zero_stage=3, framework="fsdp2"
    )
    states = estimate("llama-3.2-1b", training, simulate_allocator=False).model_states_bytes
    n = 1_235_814_400
    assert states["parameters"] == pytest.approx(4 * n / 8, rel=1e-4)
    assert states["optimizer_states"] == pytest.approx(8 * n / 8, rel=1e-4)
    # Megatron's distributed optimizer shards over the data-parallel ranks only
    megatron = TrainingConfig(
        seq_len=8192,
        data_parallel_size=2,
        context_parallel_size=4,
        zero_stage=1,
        framework="megatron",
    )
    m_states = estimate("llama-3.2-1b", megatron, simulate_allocator=False).model_states_bytes
    assert m_states["optimizer_states"] == pytest.approx(12 * n / 2, rel=1e-4)


def test_op_level_sac_saves_row_parallel_outputs_whole_under_tp() -> None:
    # torchtitan's op-level SAC saves every other aten.mm output (q, v, gate, down for Llama:
    # q k v o gate up down in order). A row-parallel linear (o, down) multiplies its input slice
    # by its weight slice: the local output is the partial sum of the whole [t, h], reduce-
    # scattered over the sequence only after the matmul, so down's saved output is c*h*t on
    # each TP rank, not /t (RowwiseParallel: Partial output). llama-3.1-8b, b=1, s=8192,
    # TP 2 + SP, bf16 (c = 2): h = 4096, 32 heads, 8 KV heads of 128, MLP 14336.
    from trainmem.analytic.op_selective import op_selective_saved_terms
    from trainmem.specs.hf import load_model_spec

    training = TrainingConfig(
        seq_len=8192,
        framework="fsdp2",
        data_parallel_size=4,
        zero_stage=3,
        tensor_parallel_size=2,
        sequence_parallel=True,
        activation_checkpointing="selective",
    )
    terms = op_selective_saved_terms(load_model_spec("llama-3.1-8b"), training)
    c, t, tp = 2, 8192, 2
    assert terms["mm/down"] == c * 4096 * t
    assert sum(terms.values()) == (
        c * 4096 * t // tp  # the layer input, sequence-sharded
        + c * 4096 * t // tp  # SDPA output, heads sharded
        + 4 * 32 * t // tp  # logsumexp
        + c * 4096 * t // tp  # q
        + c * 1024 * t // tp  # v
        + c * 14336 * t // tp  # gate
        + c * 4096 * t  # down: whole
    )  # 294,125,568 B: the generic path's traced layer on the same setting


def test_autocast_caches_fsdp2_unsharded_weights_but_not_dtensor_ones() -> None:
    # FSDP2's unsharded parameters are nn.Parameter leaves over the all-gather output
    # (FSDPParam.init_unsharded_param), so autocast's cached_cast keeps one bf16 copy of each
    # linear weight until the forward ends; llama-3.2-1b: q, o 2048 x 2048, k, v 512 x 2048,
    # gate, up, down 8192 x 2048 -> 2 * 60,817,408 B per layer. Under TP the parameter is a
    # DTensor, cast on its local tensor (no leaf): nothing cached (traced: equal both ways).
    from trainmem.analytic.autocast import autocast_cached_weight_bytes
    from trainmem.specs.hf import load_model_spec

    model = load_model_spec("llama-3.2-1b")
    fsdp = dict(framework="pytorch-amp", data_parallel_size=2, zero_stage=3,
                activation_checkpointing="full")  # fmt: skip
    per_layer = 2 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048)
    assert autocast_cached_weight_bytes(model, TrainingConfig(**fsdp)) == per_layer
    tp = TrainingConfig(**fsdp, tensor_parallel_size=2, sequence_parallel=True)
    assert autocast_cached_weight_bytes(model, tp) == 0
    # FSDP1's gathered weights are views of the flat parameter (accelerate-fsdp's policy
    # gathers bf16 anyway): no cache
    hf = TrainingConfig(**{**fsdp, "framework": "hf-trainer"})
    assert autocast_cached_weight_bytes(model, hf) == 0


def test_plain_loop_fsdp2_shards_over_the_context_parallel_ranks_too() -> None:
    # pytorch-amp's ZeRO-3 is FSDP2's fully_shard; every release that runs FSDP2 beside context
    # parallelism shards over data x context ranks (torchtitan parallel_dims.py: the "fsdp"
    # mesh of dp_shard * cp ranks; accelerate 1.14 parallelism_config.py fsdp_dim_names:
    # "dp_shard_cp"), as the trace engine does (trace/parallel.py parallelize). FSDP 2 x CP 4:
    # every fp32 weight and Adam moment split 8 ways, 4 and 8 bytes per parameter / 8;
    # llama-3.2-1b has 1,235,814,400 parameters, every dim 0 divisible by 8 (no padding).
    training = TrainingConfig(
        seq_len=8192, data_parallel_size=2, context_parallel_size=4, zero_stage=3
    )
    assert training.framework == "pytorch-amp"
    assert training.sharding_degree == 8
    states = estimate("llama-3.2-1b", training, simulate_allocator=False).model_states_bytes
    n = 1_235_814_400
    assert states["parameters"] == 4 * n // 8
    assert states["optimizer_states"] == 8 * n // 8


@pytest.mark.parametrize("tp", [1, 2])
def test_context_parallel_keeps_autocast_weight_copies_whole(tp: int) -> None:
    # context_parallel shards the inputs along the sequence and reroutes SDPA; the weights are
    # untouched, so the 16-bit casts autocast makes of them (and the matmuls save) are whole on
    # every CP rank: only tensor parallelism splits them. llama-3.2-1b under bf16-mixed (c = 2):
    # h = 2048, q and o 2048 x 2048, k and v 512 x 2048, gate / up / down 8192 x 2048, so one
    # layer's copies are 2 * 2048 * (2 * 2048 + 2 * 512 + 3 * 8192) = 121,634,816 B; the tied
    # head's 2 * 128256 * 2048 = 525,336,576 B. Before, both were divided by cp (the trace of a
    # 2048-wide Llama, FSDP 4 x CP 2, held each layer's whole copies: generic 13.3 % above).
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.analytic.head import head_activation_bytes
    from trainmem.specs.hf import load_model_spec

    model = load_model_spec("llama-3.2-1b")
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=1024,
        precision="bf16-mixed",
        context_parallel_size=2,
        zero_stage=3,  # FSDP2 over the CP ranks, the only way CP runs
        tensor_parallel_size=tp,
        sequence_parallel=tp > 1,
    )
    layer = layer_activation_terms(model, training)["autocast_weight_copies"]
    head = head_activation_bytes(model, training)["autocast_weight_copies"]
    assert layer == 2 * 2048 * (2 * 2048 + 2 * 512 + 3 * 8192) // tp
    assert head == 2 * 128256 * 2048 // tp
    # the token terms are still split by the sequence: the MLP input is c * h * b * s / cp
    whole = TrainingConfig(micro_batch_size=2, seq_len=1024, precision="bf16-mixed")
    gated = layer_activation_terms(model, training)["mlp/gated"]
    assert gated * 2 * tp == layer_activation_terms(model, whole)["mlp/gated"]
