"""What torch.distributed.pipelining keeps on a stage (Note [Pipeline stage buffers]), and the
per-rank tensor sizes under context parallelism; expected numbers by hand from the source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.analytic.pipeline import stage_buffers
from trainmem.analytic.schedule import _tensor_sizes
from trainmem.specs.hf import load_model_spec as load_model
from trainmem.specs.training import TrainingConfig

MiB = 2**20


def _405b_3d(**kw: object) -> TrainingConfig:
    """Table 5's 1F1B setting: FSDP 8 x TP 8 + SP x PP 8, 8 micro-batches of 4 x 8192."""
    settings: dict[str, object] = {
        "framework": "fsdp2",
        "zero_stage": 3,
        "data_parallel_size": 8,
        "tensor_parallel_size": 8,
        "sequence_parallel": True,
        "pipeline_parallel_size": 8,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "seq_len": 8192,
        "activation_checkpointing": "full",
        "precision": "fp8-mixed",
        **kw,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def test_first_stage_keeps_outputs_in_flight_and_gradient_receive_buffers() -> None:
    # boundary: bf16 residual stream of 4 x 8192 tokens x 16384, sequence-sharded over TP 8
    # = 2 * 4 * 8192 * 16384 / 8 = 128 MiB; the first 1F1B stage of 8 holds 8 micro-batches:
    # 8 outputs in fwd_cache, 8 gradient receive buffers, no input buffers, no logits
    model = load_model("llama-3.1-405b")
    buf = stage_buffers(model, _405b_3d(), in_flight=8, first=True, last=False)
    assert buf.in_flight_outputs == 8 * 128 * MiB
    assert buf.recv_buffers == 8 * 128 * MiB
    assert buf.output_chunk == 0


def test_last_stage_keeps_every_micro_batch_logits() -> None:
    # output_chunks: bf16 logits of 4 x 8192 tokens x 128256 / 8 (vocabulary-parallel)
    # = 1,050,673,152 bytes per micro-batch; input receive buffers of the 7 micro-batches
    # not in flight (1F1B's last stage holds one): 7 * 128 MiB; no gradient buffers
    model = load_model("llama-3.1-405b")
    buf = stage_buffers(model, _405b_3d(), in_flight=1, first=False, last=True)
    assert buf.output_chunk == 2 * 4 * 8192 * 128256 // 8 == 1_050_673_152
    assert buf.recv_buffers == 7 * 128 * MiB
    assert buf.in_flight_outputs == 0


def test_no_pipeline_no_buffers() -> None:
    model = load_model("llama-3.1-405b")
    buf = stage_buffers(
        model, _405b_3d(pipeline_parallel_size=1), in_flight=1, first=True, last=True
    )
    assert (buf.in_flight_outputs, buf.output_chunk, buf.recv_buffers) == (0, 0, 0)


def test_context_parallel_blocks_are_the_ranks_tensors() -> None:
    # CP 2 over 65536 tokens: a rank holds 32768 tokens, so its (tokens x hidden) bf16 tensor
    # is 2 * 32768 * 4096 = 256 MiB, the same blocks as 32768 tokens without CP
    model = load_model("llama-3.1-8b")
    base = {"framework": "fsdp2", "zero_stage": 3, "data_parallel_size": 4}
    cp2 = TrainingConfig(seq_len=65536, context_parallel_size=2, **base)  # type: ignore[arg-type]
    cp1 = TrainingConfig(seq_len=32768, **base)  # type: ignore[arg-type]
    assert 256 * MiB in _tensor_sizes(model, cp2)
    # below the three (b, a, s, s) score sizes, every block size is the 32768-token one
    assert _tensor_sizes(model, cp2)[3:] == _tensor_sizes(model, cp1)[3:]


def test_torchtitan_split_gives_the_middle_stages_the_extra_layers() -> None:
    # generate_split_points, 126 layers: 1F1B, 8 stages: base 15, extra 6 -> stages
    # [15, 16 x 6, 15]; interleaved, 16 stages: base 7, extra 14 -> [7, 8 x 14, 7], rank r
    # holds stages r and r + 8: 7 + 8 = 15 on the first and the last rank, 16 elsewhere
    from trainmem.specs.ranks import model_rank_map

    model = load_model("llama-3.1-405b")

    def rank_layers(training: TrainingConfig) -> list[int | None]:
        return model_rank_map(model, training).layers_per_pipeline_rank()

    assert rank_layers(_405b_3d()) == [15] + [16] * 6 + [15]
    interleaved = _405b_3d(pipeline_schedule="interleaved-1f1b")
    assert rank_layers(interleaved) == [15] + [16] * 6 + [15]
    # Megatron's even split (no torchtitan convention): ceil(126 / 8) = 16, the last 14
    megatron = _405b_3d(framework="megatron", zero_stage=1)
    assert rank_layers(megatron) == [16] * 7 + [14]


def test_the_middle_rank_with_more_layers_is_evaluated() -> None:
    from trainmem.analytic.engine import pipeline_ranks

    ranks = pipeline_ranks(load_model("llama-3.1-405b"), _405b_3d())
    assert [(r.stage, r.num_layers, r.in_flight) for r in ranks] == [
        (0, 15, 8),
        (1, 16, 7),
        (7, 15, 1),
    ]


def test_last_stage_holds_one_logits_chunk_per_micro_batch() -> None:
    # output_chunks: the last stage allocates one 1,050,673,152-byte logits tensor per
    # micro-batch and frees them all only after the optimizer step; the merged copy
    # (torch.cat) is 8 of them
    from trainmem.estimate import estimate

    est = estimate("llama-3.1-405b", _405b_3d(), simulate_allocator=False)
    last = est.schedules[-1]
    chunk = 2 * 4 * 8192 * 128256 // 8
    live = peak = 0
    merged = 0
    for ev in last.events():
        if ev.module != "pipeline" or ev.size_bytes not in (chunk, 8 * chunk):
            continue
        if ev.size_bytes == 8 * chunk:
            merged += ev.action == "alloc"
            continue
        live += 1 if ev.action == "alloc" else -1
        peak = max(peak, live)
    assert peak == 8
    assert live == 0
    assert merged == 2  # the warm-up step and the measured one


def test_fsdp_over_context_parallel_alone_still_shards() -> None:
    # torchtitan's fully_shard takes the dp_shard x cp mesh: FSDP 1 x CP 8 shards over 8 ranks
    # like FSDP 8 x CP 1, and each rank holds 262144 / 8 = 32768 tokens either way, so the
    # per-rank peaks differ at most by ring attention's gathered K and V of one layer
    # (2 x 262144 tokens x 8 KV heads x 128 x 2 B = 1 GiB); before, FSDP 1 counted as unsharded
    # and kept every layer's gathered weights (+12.8 GiB)
    from trainmem.analytic.buffers import kept_gathered_layer_bytes
    from trainmem.analytic.tensor_states import state_layout
    from trainmem.estimate import estimate

    model = load_model("llama-3.1-8b")
    base = {"framework": "fsdp2", "zero_stage": 3, "activation_checkpointing": "full"}
    cp8 = TrainingConfig(data_parallel_size=1, context_parallel_size=8, seq_len=262144, **base)  # type: ignore[arg-type]
    dp8 = TrainingConfig(data_parallel_size=8, seq_len=32768, **base)  # type: ignore[arg-type]
    assert kept_gathered_layer_bytes(state_layout(model, cp8).layer, cp8) == 0
    a = estimate(model, cp8, simulate_allocator=False).breakdown.allocated_bytes
    b = estimate(model, dp8, simulate_allocator=False).breakdown.allocated_bytes
    assert abs(a - b) <= 2 * 262144 * 8 * 128 * 2


def test_interleaved_in_flight_follows_torchs_warmup() -> None:
    # ScheduleInterleaved1F1B, p = 8, v = 2, m = 16: 2 rounds of 8; rank 0 warms up with
    # (2 - 1) * 8 + 2 * 7 = 22 chunk forwards, then forward-before-backward: 23 chunks of half
    # the rank's layers = 11.5 rank units; rank 1: 21 chunks = 10.5; rank 7: 9 = 4.5
    from trainmem.analytic.engine import _interleaved_in_flight

    assert _interleaved_in_flight(0, 8, 16, 2) == 11.5
    assert _interleaved_in_flight(1, 8, 16, 2) == 10.5
    assert _interleaved_in_flight(7, 8, 16, 2) == 4.5
    # v = 4 (multiply factor stays 2): rank 1 warms up 3 * 8 + 2 * 6 = 36 -> 37 / 4
    assert _interleaved_in_flight(1, 8, 16, 4) == 37 / 4
    # m = 4 < p: one round of 4; warmup min(4 + 14, 8) = 8 = every chunk forward, no steady
    # state: all 4 micro-batches on both chunks = 4 rank units
    assert _interleaved_in_flight(0, 8, 4, 2) == 4


def test_fsdp2_collectives_allocate_on_their_streams() -> None:
    # FSDP2 (torch _fsdp_collectives.py): sharded gradients are reduce-scatter outputs (RS
    # stream), the prefetched layer's flat all-gather output is on the all-gather stream; one
    # step's sharded fp32 gradients of llama-3.2-1b (1,235,814,400 parameters) over 8 ranks:
    # 4 * 1,235,814,400 / 8 = 617,907,200 bytes (+ dim-0 padding, under 1%)
    from trainmem.analytic.schedule import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM
    from trainmem.breakdown import MemoryCategory
    from trainmem.estimate import estimate

    training = TrainingConfig(framework="fsdp2", zero_stage=3, data_parallel_size=8)
    sched = estimate("llama-3.2-1b", training, simulate_allocator=False).schedules[0]
    step = [ev for ev in sched.events() if ev.action == "alloc"]
    rs = [ev for ev in step if ev.stream == REDUCE_SCATTER_STREAM]
    ag = [ev for ev in step if ev.stream == ALL_GATHER_STREAM]
    assert {ev.category for ev in rs} == {MemoryCategory.GRADIENT}
    assert ag and {ev.category for ev in ag} == {MemoryCategory.TEMPORARY}
    per_step = sum(ev.size_bytes for ev in rs) / 2  # the warm-up step and the measured one
    assert 617_907_200 <= per_step < 617_907_200 * 1.01
    # another framework's ZeRO-3 stays on the default stream
    other = TrainingConfig(framework="pytorch-amp", zero_stage=3, data_parallel_size=8)
    events = estimate("llama-3.2-1b", other, simulate_allocator=False).schedules[0].events()
    assert {ev.stream for ev in events} == {0}


def _in_flight_sizes(schedule: object) -> list[int]:
    from trainmem.schedule import Op, Repeat

    out: list[int] = []

    def walk(items: object) -> None:
        for item in items:  # type: ignore[attr-defined]
            if isinstance(item, Repeat):
                walk(item.body)
            elif isinstance(item, Op) and item.action == "alloc" and item.key == "in_flight":
                out.append(item.size_bytes)

    walk(schedule.step)  # type: ignore[attr-defined]
    return out


def test_gpipe_backwards_free_the_micro_batches_in_order() -> None:
    # torch's ScheduleGPipe runs all m forwards, then the backwards in micro-batch order: the
    # first backward finds the m - 1 others in flight, every later one at most m - 2
    # (schedules.py ScheduleGPipe._step_microbatches); 1F1B's stage 0 holds p - 1 others in
    # every micro-batch (min(m, p - stage) forwards in flight)
    from trainmem.estimate import estimate

    m = 4
    base = {"seq_len": 512, "pipeline_parallel_size": 2, "gradient_accumulation_steps": m,
            "data_parallel_size": 2, "zero_stage": 3, "framework": "fsdp2"}  # fmt: skip
    gpipe = estimate("llama-3.2-1b", TrainingConfig(**base, pipeline_schedule="gpipe"),
                     simulate_allocator=False)  # fmt: skip
    first, later = _in_flight_sizes(gpipe.schedules[0])[:2]
    assert first * (m - 2) == later * (m - 1)
    f1b = estimate("llama-3.2-1b", TrainingConfig(**base), simulate_allocator=False)
    one, again = _in_flight_sizes(f1b.schedules[0])[:2]
    assert one == again == first // (m - 1)


def test_torch_pipelining_refuses_fewer_micro_batches_than_stages() -> None:
    """torch's Schedule1F1B raises "Number of microbatches (1) must be greater than or equal to
    the number of stages (4)" (torch/distributed/pipelining/schedules.py), so a torchtitan-style
    run (fsdp2) with one micro-batch over 4 stages does not exist; Megatron's 1F1B takes it
    (its warm-up is min(p - rank - 1, m) micro-batches)."""
    from trainmem.errors import SpecError
    from trainmem.estimate import estimate

    one = dict(pipeline_parallel_size=4, data_parallel_size=2, zero_stage=3, seq_len=512)
    with pytest.raises(SpecError, match="gradient_accumulation_steps"):
        estimate("llama-3.2-1b", TrainingConfig(**one, framework="fsdp2"))
    estimate("llama-3.2-1b", TrainingConfig(**one, framework="megatron"))
    ok = TrainingConfig(**one, framework="fsdp2", gradient_accumulation_steps=4)
    estimate("llama-3.2-1b", ok, simulate_allocator=False)


def test_interleaved_ranks_hold_the_buffers_of_each_of_their_stages() -> None:
    # ScheduleInterleaved1F1B, p = 4, v = 2, m = 8: rank 3 holds stages 3 and 7, each with its
    # own receive buffers (_prepare_forward_infra / _prepare_backward_infra per stage): inputs
    # for both (stage 7 is not the first), gradients for stage 3 only (stage 7 is the last):
    # 8 + 8 + 8 = 24 buffers, as the trace of llama-3.1-70b shows; 2.5 rank-units in flight
    # are 5 chunks, whose first-layer inputs are 5 of the input buffers (counted as saved).
    # The boundary: b * s * h / t bf16 = 8192 * 8192 * 2 / 8 B (SP shards the sequence).
    model = load_model("llama-3.1-70b")
    t = TrainingConfig(seq_len=8192, framework="fsdp2", data_parallel_size=8, zero_stage=3,
                       tensor_parallel_size=8, sequence_parallel=True,
                       pipeline_parallel_size=4, gradient_accumulation_steps=8,
                       pipeline_schedule="interleaved-1f1b")  # fmt: skip
    edge = 8192 * 8192 * 2 // 8
    last = stage_buffers(model, t, in_flight=2.5, first=False, last=True)
    assert last.recv_buffers == (8 + 8 + 8 - 5) * edge
    assert last.in_flight_outputs == round(2.5 * edge)  # stage 3's outputs of its chunks
    # rank 0 (stages 0 and 4): stage 4's inputs, both stages' gradients; 5.5 units = 11 chunks
    # in flight, half of them on stage 4 (their inputs counted as saved), every chunk's output
    first = stage_buffers(model, t, in_flight=5.5, first=True, last=False)
    assert first.recv_buffers == (8 - 6 + 8 + 8) * edge
    assert first.in_flight_outputs == 11 * edge


def test_step_merges_the_logits_after_the_pipeline_reduce_scatter() -> None:
    # PipelineScheduleSingle.step: _step_microbatches (whose end runs perform_reduce_grad, the
    # FSDP2 reduce-scatter of the accumulated unsharded gradients) then _merge_outputs (a
    # torch.cat of the m logits chunks): when the merged logits are allocated only the
    # gradient shards are left. llama-3.2-1b PP 2, m = 4, b = 1, s = 1024: the last stage's
    # merged logits are 4 * 1024 * 128256 * 2 B (bf16).
    from trainmem.breakdown import MemoryCategory
    from trainmem.estimate import estimate

    t = TrainingConfig(seq_len=1024, framework="fsdp2", data_parallel_size=2, zero_stage=3,
                       pipeline_parallel_size=2, gradient_accumulation_steps=4)  # fmt: skip
    last = estimate("llama-3.2-1b", t, simulate_allocator=False).schedules[-1].expand()
    merged = 4 * 1024 * 128256 * 2
    grads, at_merge, at_step = 0, -1, -1
    for k, e in enumerate(last.events):
        if e.category is MemoryCategory.GRADIENT:
            grads += e.size_bytes if e.action == "alloc" else -e.size_bytes
        if k >= last.steady_state_start and e.action == "alloc":
            if e.size_bytes == merged and e.phase == "backward":
                at_merge = grads
            if e.phase == "optimizer" and at_step < 0:
                at_step = grads
    assert at_merge == at_step > 0


def test_megatron_stage_frees_sent_outputs_and_receives_per_message() -> None:
    # megatron-core schedules.py deallocate_output_tensor (Megatron-LM's
    # deallocate_pipeline_outputs=True): a sent output's data becomes one element, so no
    # output waits in a cache for its backward; p2p_communication.py _communicate: every
    # receive is a new torch.empty, the input living as the first layer's saved input, the
    # gradient through its backward (Note [Megatron's pipeline stage buffers]). The probe's
    # PP 4 last rank (published_probe_megatron.py): interleaved, 8 one-layer chunks a rank,
    # 4 micro-batches of 1 x 8192 tokens, bf16 residual stream of h = 4096:
    # 1 * 8192 * 4096 * 2 = 67,108,864 B per boundary tensor
    model = load_model("llama-3.1-8b")  # h = 4096, 32 layers
    megatron = TrainingConfig(framework="megatron", precision="bf16-mixed", seq_len=8192,
                              pipeline_parallel_size=4, gradient_accumulation_steps=4,
                              pipeline_schedule="interleaved-1f1b",
                              virtual_pipeline_stages=8)  # fmt: skip
    edge = 1 * 8192 * 4096 * 2
    assert edge == 67_108_864
    last = stage_buffers(model, megatron, in_flight=3.625, first=False, last=True)
    # 7 of its 8 chunks are not the last stage: one received gradient in a backward
    assert (last.in_flight_outputs, last.output_chunk, last.recv_buffers) == (0, 0, 0)
    assert last.backward_grad == edge
    # torch's pipelining (torchtitan, fsdp2) on the same rank: round(3.625 * 7) = 25 outputs
    # in fwd_cache; inputs of 4 micro-batches x 8 chunks less the round(3.625 * 8) = 29 in
    # flight, gradients of 4 x 7 chunks: 3 + 28 = 31 receive buffers (the probe's 25.4 and 31)
    titan = replace(megatron, framework="fsdp2")
    kept = stage_buffers(model, titan, in_flight=3.625, first=False, last=True)
    assert (kept.in_flight_outputs, kept.recv_buffers) == (round(3.625 * 7 * edge), 31 * edge)
    assert kept.backward_grad == 0
    # a single-stage rank holding the last stage receives no gradient
    one = replace(megatron, pipeline_schedule="1f1b", virtual_pipeline_stages=1)
    assert stage_buffers(model, one, in_flight=1, first=False, last=True).backward_grad == 0
    assert stage_buffers(model, one, in_flight=4, first=True, last=False).backward_grad == edge
