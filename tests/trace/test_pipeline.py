"""Pipeline parallelism traced with torch.distributed.pipelining (trainmem.trace.pipeline).

Expected bytes are derived by hand from torch's pipelining source (torch 2.13,
torch/distributed/pipelining/stage.py and schedules.py) on tiny-llama-test (h=64, vocab 512,
2 layers), fp32 weights and activations ("32-true"):

- every stage but the first allocates one input receive buffer [b, s, h] per micro-batch at its
  first step (``_setup_forward_recv_info``), every stage but the last one gradient receive
  buffer of the same shape per micro-batch (``_setup_backward_recv_info``); they live as long
  as the schedule;
- the last stage keeps each micro-batch's output (the logits [b, s, V]) in ``output_chunks``
  until the next ``step()`` clears them (``clear_runtime_states``), so the previous step's m
  logits are alive when the recorded step starts;
- ``Schedule1F1B`` runs ``min(m, num_stages - stage_index)`` forwards before the first
  backward, so stage 0 of a 2-stage pipeline holds 2 micro-batches' activations at once,
  ``ScheduleGPipe`` all m.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainmem.breakdown import MemoryCategory
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig, pipeline_stage_ids, pipeline_stage_layers

B, S, H, V = 2, 32, 64, 512
FP32 = 4


def _pp(**kw: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "micro_batch_size": B,
        "seq_len": S,
        "precision": "32-true",
        "pipeline_parallel_size": 2,
        "gradient_accumulation_steps": 4,
        "dropout": False,
    }
    settings.update(kw)
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def _init_bytes(schedule: object, category: MemoryCategory, module: str) -> int:
    """Bytes alive when the recorded step starts, of ``category`` owned by ``module``."""
    return sum(
        e.size_bytes
        for e in schedule.events()  # type: ignore[attr-defined]
        if e.phase == "init" and e.action == "alloc" and e.category is category
        and e.module == module
    )  # fmt: skip


def _max_live(schedule: object, category: MemoryCategory) -> int:
    live, cur, best = {}, 0, 0
    for e in schedule.events():  # type: ignore[attr-defined]
        if e.category is not category:
            continue
        if e.action == "alloc":
            live[e.block_id] = e.size_bytes
            cur += e.size_bytes
        elif e.block_id in live:
            cur -= live.pop(e.block_id)
        best = max(best, cur)
    return best


@pytest.fixture(scope="module")
def one_f_one_b() -> object:
    """The default 2-stage 1F1B trace of 4 micro-batches (``_pp()``), traced once for the tests
    that only read it."""
    return estimate("tiny-llama-test", _pp(), engine="trace", simulate_allocator=False)


def test_stage_split_and_rank_stages_follow_torchtitan() -> None:
    # generate_split_points (torchtitan, Dec 2024): L // stages on the first stage, one more
    # on the next L % stages middle stages, the rest on the last: 126 = 15 + 6 * 16 + 15
    t = TrainingConfig(pipeline_parallel_size=8, framework="fsdp2")
    sizes = [len(r) for r in pipeline_stage_layers(126, t)]
    assert sizes == [15] + [16] * 6 + [15]
    # interleaved: p * v stages, rank r runs stages r, r + p (loop style)
    t = TrainingConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved-1f1b",
                       virtual_pipeline_stages=2, framework="fsdp2")  # fmt: skip
    assert [list(r) for r in pipeline_stage_layers(16, t)] == [
        list(range(0, 4)), list(range(4, 8)), list(range(8, 12)), list(range(12, 16)),
    ]  # fmt: skip
    assert pipeline_stage_ids(0, t) == [0, 2] and pipeline_stage_ids(1, t) == [1, 3]
    # Megatron's split (no torchtitan convention): ceil(L / p) per stage, the last the rest
    assert [
        len(r) for r in pipeline_stage_layers(126, TrainingConfig(pipeline_parallel_size=8))
    ] == [16] * 7 + [14]


def test_receive_buffers_and_output_chunks_are_the_runtime_s(one_f_one_b: Any) -> None:
    est = one_f_one_b
    first, last = est.schedules
    m = 4
    boundary = B * S * H * FP32  # one micro-batch's residual stream [b, s, h]
    # stage 0: a gradient receive buffer per micro-batch; no input buffers, no output chunks
    assert _init_bytes(first, MemoryCategory.TEMPORARY, "pipeline") == m * boundary
    assert _init_bytes(first, MemoryCategory.ACTIVATION, "pipeline") == 0
    # last stage: an input receive buffer per micro-batch, the previous step's m logits
    assert _init_bytes(last, MemoryCategory.TEMPORARY, "pipeline") == m * boundary
    assert _init_bytes(last, MemoryCategory.ACTIVATION, "pipeline") == m * B * S * V * FP32
    labels = est.details["per_rank"]
    assert [r["pipeline_stage"] for r in labels] == [0, 1]
    assert [r["rank"] for r in labels] == [0, 1]
    assert [r["layers"] for r in labels] == [[[0, 0]], [[1, 1]]]
    assert est.details["traced_mesh"] == {"pp": 2}


def test_micro_batches_in_flight_on_stage_0_follow_the_schedule(one_f_one_b: Any) -> None:
    # one micro-batch's saved activations on stage 0, from a GPipe step of one micro-batch
    one = estimate("tiny-llama-test", _pp(pipeline_schedule="gpipe", gradient_accumulation_steps=1),
                   engine="trace", simulate_allocator=False)  # fmt: skip
    unit = _max_live(one.schedules[0], MemoryCategory.ACTIVATION)
    assert unit > 0
    m, p = 4, 2
    f1b = one_f_one_b
    gpipe = estimate("tiny-llama-test", _pp(pipeline_schedule="gpipe"), engine="trace",
                     simulate_allocator=False)  # fmt: skip
    # Schedule1F1B: min(m, p - 0) = 2 forwards in flight on stage 0; GPipe: all m
    assert _max_live(f1b.schedules[0], MemoryCategory.ACTIVATION) == min(m, p) * unit
    assert _max_live(gpipe.schedules[0], MemoryCategory.ACTIVATION) == m * unit


@pytest.mark.parametrize(
    "micro_batches", [2, pytest.param(4, marks=pytest.mark.slow)]
)  # 10 layers traced whole and composed; 4 micro-batches take about twice 2 (stage 1 still
# runs a forward between two backwards; the 1F1B steady state needs 4)
def test_composed_stages_equal_the_whole_stages(tmp_path: Path, micro_batches: int) -> None:
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.hf_model import build_hf_training_model
    from trainmem.trace.pipeline import estimate_pipeline

    # 5 layers per stage, 4 kept (trainmem.trace.blocks.truncate's copies): layer 1 repeated
    raw = dict(load_hf_config("tiny-llama-test"), num_hidden_layers=10)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    # FSDP2 as torchtitan runs it: the last stage's input gradient (layer 0's) is freed after
    # the next micro-batch's forward went past the repeated layers (composed before as if it
    # were a repeated layer's block)
    t = _pp(precision="bf16-mixed", framework="fsdp2", data_parallel_size=2, zero_stage=3,
            gradient_accumulation_steps=micro_batches)  # fmt: skip

    def build() -> object:
        return build_hf_training_model(raw, t)

    whole = estimate_pipeline(str(path), build, t, compose=False)
    composed = estimate_pipeline(str(path), build, t, compose=True, copies=4)
    assert "could not stand" not in " ".join(composed.notes)
    for a, b in zip(whole.schedules, composed.schedules, strict=True):
        assert [(e.action, e.size_bytes) for e in a.events()] == [
            (e.action, e.size_bytes) for e in b.events()
        ]


def test_1f1b_needs_as_many_micro_batches_as_stages() -> None:
    with pytest.raises(SpecError, match="gradient_accumulation_steps"):
        estimate("tiny-llama-test", _pp(gradient_accumulation_steps=1), engine="trace")


@pytest.mark.parametrize("tp", [1, 2])
def test_embedding_gradient_under_tensor_parallelism_covers_the_whole_vocabulary(tp: int) -> None:
    # DTensor's embedding_dense_backward has no vocabulary-sharded output strategy
    # (torch/distributed/tensor/_ops/_embedding_ops.py): the token embedding's gradient is a
    # [V, h] partial tensor on each TP rank, not its [V / t, h] shard; bf16 from the backward,
    # FSDP2 accumulates it upcast to fp32 across the micro-batches (to_accumulated_grad_if_needed);
    # without TP the gradient is whole anyway, the bf16 one alive while it is added
    t = _pp(precision="bf16-mixed", framework="fsdp2", data_parallel_size=4, zero_stage=3,
            tensor_parallel_size=tp, sequence_parallel=tp > 1)  # fmt: skip
    traced = estimate("tiny-llama-test", t, engine="trace", simulate_allocator=False)
    sizes = {
        (e.module, e.size_bytes)
        for e in traced.schedules[0].events()
        if e.action == "alloc" and e.phase == "backward"
    }
    assert ("stage0.model.embed_tokens", V * H * 2) in sizes  # the bf16 partial gradient
    assert ("stage0", V * H * 4) in sizes  # accumulated in fp32, whole vocabulary
    analytic = estimate("tiny-llama-test", t, engine="analytic", simulate_allocator=False)
    kept = [
        e.size_bytes
        for e in analytic.schedules[0].events()
        if e.action == "alloc" and e.module == "embedding" and e.phase == "backward"
    ]
    # the formulas: the fp32 accumulated gradient, and the bf16 one in each of the 4
    # micro-batches' backward, whole vocabulary (the shards are V * h * 4 / (t * 4) bytes)
    assert V * H * 4 in kept
    assert kept.count(V * H * 2) >= 4


def test_a_custom_module_is_not_split_into_stages() -> None:
    import torch

    from trainmem.errors import UnsupportedError
    from trainmem.trace import trace

    with pytest.raises(UnsupportedError, match="pipeline_parallel_size"):
        trace(lambda: torch.nn.Linear(4, 4), lambda: torch.randn(2, 4), training=_pp())


def test_context_parallel_shards_every_pipeline_buffer_by_the_sequence() -> None:
    # torchtitan runs CP under PP inside context_parallel: the step's input ids and labels
    # are sharded along the sequence in place, so each rank's boundary tensors, receive buffers
    # and logits cover s / cp tokens: [b, s/2, h] per micro-batch, [b, s/2, V] output chunks
    t = _pp(context_parallel_size=2, zero_stage=3)  # FSDP2 over the CP ranks, as CP runs
    est = estimate("tiny-llama-test", t, engine="trace", simulate_allocator=False)
    first, last = est.schedules
    m = 4
    boundary = B * (S // 2) * H * FP32
    assert _init_bytes(first, MemoryCategory.TEMPORARY, "pipeline") == m * boundary
    assert _init_bytes(last, MemoryCategory.TEMPORARY, "pipeline") == m * boundary
    assert _init_bytes(last, MemoryCategory.ACTIVATION, "pipeline") == m * B * (S // 2) * V * FP32
    assert est.details["traced_mesh"] == {"pp": 2, "cp": 2}


@pytest.mark.parametrize(
    "micro_batches", [2, pytest.param(4, marks=pytest.mark.slow)]
)  # 20 layers traced whole and composed: 4 micro-batches take about twice 2
def test_interleaved_composed_stages_equal_the_whole_stages(
    tmp_path: Path, micro_batches: int
) -> None:
    # interleaved 1F1B under FSDP2 all-gathers each stage's layers from the schedule's UNSHARD
    # actions, outside any forward (torch/distributed/pipelining/schedules.py
    # _PipelineScheduleRuntime): their gathered weights belong to their layer, or the few-layer
    # composition repeats the kept layers' only (llama-3.1-8b PP 2 was 2.4 GiB short)
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.hf_model import build_hf_training_model
    from trainmem.trace.pipeline import estimate_pipeline

    # 4 stages of 5 layers, 4 kept per stage (copies): each stage's layer 1 repeated
    raw = dict(load_hf_config("tiny-llama-test"), num_hidden_layers=20)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    t = _pp(precision="bf16-mixed", framework="fsdp2", data_parallel_size=2, zero_stage=3,
            pipeline_schedule="interleaved-1f1b",
            gradient_accumulation_steps=micro_batches)  # fmt: skip

    def build() -> object:
        return build_hf_training_model(raw, t)

    whole = estimate_pipeline(str(path), build, t, compose=False)
    composed = estimate_pipeline(str(path), build, t, compose=True, copies=4)
    assert "could not stand" not in " ".join(composed.notes)
    assert "repeated to full depth" in " ".join(composed.notes)
    for a, b in zip(whole.schedules, composed.schedules, strict=True):
        assert a.peak().peak_bytes == b.peak().peak_bytes


def _max_alive(schedule: object, size: int) -> int:
    """Most blocks of exactly ``size`` bytes alive at once in the backward."""
    live: set[int] = set()
    best = 0
    for e in schedule.events():  # type: ignore[attr-defined]
        if e.action == "alloc" and e.size_bytes == size and e.phase == "backward":
            live.add(e.block_id)
        elif e.action == "free":
            live.discard(e.block_id)
        best = max(best, len(live))
    return best


def test_each_micro_batch_gives_a_layer_new_16_bit_gradients_until_its_post_backward() -> None:
    # Under pipeline parallelism FSDP2 accumulates the unsharded gradients in fp32 across the
    # micro-batches; each micro-batch's backward still makes every parameter a new bf16
    # gradient (the unsharded parameter's dtype under MixedPrecisionPolicy(param_dtype=bf16)),
    # added into the fp32 one at the layer's post-backward (_fsdp_param.py
    # accumulate_unsharded_grad_if_needed / to_accumulated_grad_if_needed). Hand count on
    # stage 0 (one layer of tiny-llama-test's two), 4 micro-batches: the MLP's gate, up and
    # down weights are [i, h] (i = 176), so the three new bf16 gradients of i * h * 2 bytes
    # are alive together in every micro-batch's backward; the layer's fp32 accumulated ones,
    # i * h * 4, are made on the first. b * s = 96 tokens, so no activation gradient has
    # those sizes. In the trace each weight gradient is made twice (the mm gives the
    # transposed layout, AccumulateGrad copies it into the parameter's: the gradient layout
    # contract of torch/csrc/autograd/functions/accumulate_grad.h), so a fourth is alive
    # for a moment there; the formulas keep one per weight. (The formulas' schedule lists a
    # repeated micro-batch once, so allocations are not counted.)
    i = 176
    t = _pp(precision="bf16-mixed", framework="fsdp2", data_parallel_size=4, zero_stage=3,
            seq_len=48)  # fmt: skip
    alive = {
        engine: _max_alive(
            estimate("tiny-llama-test", t, engine=engine, simulate_allocator=False).schedules[0],
            i * H * 2,
        )
        for engine in ("trace", "analytic")
    }
    assert alive["analytic"] == 3
    assert 3 <= alive["trace"] <= 4


def test_lora_stages_agree_with_the_formulas_and_keep_no_first_layer_copies() -> None:
    # peft injects its adapters into the base model's linears, so the stages are cut from the
    # base model (trace/pipeline.py split_stages). The first stage's input is the token ids,
    # as without pipelining: in every micro-batch in flight its first layer keeps no copies of
    # the frozen q, k, v (their input needs no gradient) while o, gate, up and down keep
    # theirs (Note [LoRA's first layer]); a frozen down projection's copy is made at its
    # forward beside what the forward still holds there (Note [Forward tensors held at the
    # down projection]). The agreement model (2 layers of 2048, kv 512, i 5632), one layer a
    # stage, 4 micro-batches of 2 x 256 tokens, bf16 autocast: copies of 2048 x 2048 x 2 B
    # (o) and 2048 x 5632 x 2 B (gate, up, down) per micro-batch, none of q's or of k / v's
    # 2048 x 512 x 2 B
    agreement = str(Path(__file__).parents[1] / "models" / "agreement" / "llama_h2048.json")
    training = TrainingConfig(
        micro_batch_size=2, seq_len=256, lora_rank=16, pipeline_parallel_size=2,
        gradient_accumulation_steps=4,
    )  # fmt: skip
    generic = estimate(agreement, training, engine="generic", simulate_allocator=False)
    analytic = estimate(agreement, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g / a - 1) < 0.01, (g, a)
    first = generic.schedules[0]  # stage 0
    made: dict[str, set[int]] = {}  # linear -> sizes of what its forward saves
    for e in first.events():
        linear = e.module.rpartition(".")[2]
        saved = e.category is MemoryCategory.ACTIVATION and ".layers.0." in e.module
        if e.action == "alloc" and e.phase == "forward" and saved:
            made.setdefault(linear, set()).add(e.size_bytes)
    assert 2048 * 2048 * 2 in made["o_proj"]
    assert all(2048 * 5632 * 2 in made[n] for n in ("gate_proj", "up_proj", "down_proj"))
    # q's copy would be o's size (cast for its matmul, a temporary, not saved); k's and v's,
    # 2 MiB, share their size with [t, h] tensors
    assert not any(2048 * 2048 * 2 in made.get(n, set()) for n in ("q_proj", "base_layer"))


def test_megatron_stages_keep_no_receive_buffers_between_steps() -> None:
    # megatron-core p2p_communication.py _communicate receives every tensor into a new
    # torch.empty per message (Note [Megatron's stage buffers in the trace]): nothing of the
    # pipeline runtime is alive when the recorded step starts, where torch's pipelining keeps
    # m = 4 receive buffers per stage (test_receive_buffers_and_output_chunks_are_the_runtime_s)
    est = estimate("tiny-llama-test", _pp(framework="megatron"), engine="trace",
                   simulate_allocator=False)  # fmt: skip
    for schedule in est.schedules:
        for category in (MemoryCategory.TEMPORARY, MemoryCategory.ACTIVATION):
            assert _init_bytes(schedule, category, "pipeline") == 0


def test_megatron_freed_output_still_runs_its_backward() -> None:
    # megatron-core deallocate_output_tensor then custom_backward, run on the CPU: y = x * w
    # (x [2, 3], w [3]), its data replaced by one element once "sent"; the C++ engine's
    # backward with the received gradient g gives x.grad = g * w, as torch.autograd.grad of the
    # kept y would, and the stage hands back x's gradient (clearing x.grad, as torch's
    # stage_backward)
    import torch

    from trainmem.trace.megatron_pipeline import deallocate_output, megatron_stage_backward

    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    w = torch.tensor([1.0, -2.0, 0.5])
    y = x * w
    deallocate_output(y)
    assert y.shape == (1,) and y.grad_fn is not None
    g = torch.full((2, 3), 3.0)
    (grad,) = megatron_stage_backward((y,), (g,), [x])
    assert torch.equal(grad, torch.tensor([[3.0, -6.0, 1.5]] * 2))
    assert x.grad is None
    # a view's base is freed with it (DTensor.to_local under sequence parallelism)
    base = torch.ones(4, 4).requires_grad_() * 2
    view = base.view(16)
    deallocate_output(view)
    assert base.numel() == 1 and view.numel() == 1
