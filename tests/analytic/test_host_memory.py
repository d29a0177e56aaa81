"""Host (CPU) RAM of offloaded runs, derived by hand from the code of each implementation.

Every expected value below is written from the source file it mirrors (see Note [Host memory of
offloaded states] in trainmem/analytic/host_memory.py), never from trainmem's output.
"""

from __future__ import annotations

import json

import pytest

from conftest import Invoke
from trainmem.analytic.host_memory import host_memory
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

PSI = 6_738_415_616
"""llama-2-7b parameters; every tensor (4096, 11008, 32000 wide) divides by 16, so ZeRO / FSDP
partitions over 8 or 16 ranks have no rounding."""
EMBEDDING = 32_000 * 4_096
"""llama-2-7b's largest tensors: embed_tokens and lm_head (untied), 131,072,000 elements."""


@pytest.fixture(scope="module")
def llama2() -> object:
    return load_model_spec("llama-2-7b")


def _ds(dp: int, offload: str, stage: int, **kw: object) -> TrainingConfig:
    return TrainingConfig(
        framework="deepspeed",
        precision="bf16-mixed",
        data_parallel_size=dp,
        zero_stage=stage,
        offload=offload,
        **kw,  # type: ignore[arg-type]
    )


def test_deepspeed_zero3_offload_params_against_its_estimator(llama2: object) -> None:
    # stage3.py, offload_optimizer + offload_param, one node of 8 GPUs, part = PSI / 8:
    #   fp32 master partition (.to(cpu).clone(), pageable)            4 * part
    #   DeepSpeedCPUAdam exp_avg + exp_avg_sq (fp32 zeros_like)        8 * part
    #   fp32 gradient partition (subgroup_gradient_buffer)             4 * part
    #   grad_partitions_flat_buffer, accumulation dtype = bf16        2 * part
    #   param_groups_fp16_flat_cpu_memory, bf16, always pinned         2 * part
    # pin_memory defaults to False (offload_config.py), so only the last one is pinned.
    part = PSI // 8
    host = host_memory(llama2, _ds(8, "optimizer+params", 3))  # type: ignore[arg-type]
    assert host.pinned_bytes == 2 * part
    assert host.pageable_bytes == (4 + 8 + 4 + 2) * part
    assert host.processes_per_node == 8  # min(data-parallel world 8, 8)
    assert host.per_node_bytes == 8 * 20 * part == 20 * PSI
    # estimate_zero3_model_states_mem_needs(PSI, ..., num_gpus_per_node=8, num_nodes=1,
    # cpu_offload=True, cpu_offload_params=True, zero_init=True): PSI * 18 * (1/1) * 1.5.
    # Its 18 B are master + moments + fp32 grads (16) + the 16-bit partition (2):
    estimator = int(PSI * 18 * 1.0 * 1.5)
    estimator_terms = ("fp32 master weights partition", "optimizer states (fp32)")
    counted = sum(host.pageable_terms[k] for k in estimator_terms)
    counted += host.pageable_terms["fp32 gradient partition"]
    counted += host.pinned_terms["16-bit parameter partition"]
    assert 8 * counted == 18 * PSI == estimator / 1.5
    # the flat bf16 gradient buffer is what the 1.5 buffer factor has to cover: 20 <= 27
    assert host.per_node_bytes <= estimator
    # two nodes of 8 (dp 16): each process holds half as much, the node too, as the
    # estimator's gpus_factor = 1 / num_nodes says: PSI * 18 / 2 * 1.5
    two = host_memory(llama2, _ds(16, "optimizer+params", 3))  # type: ignore[arg-type]
    assert two.processes_per_node == 8
    assert two.per_node_bytes == 8 * 20 * (PSI // 16) == 10 * PSI <= int(PSI * 18 / 2 * 1.5)


def test_deepspeed_zero3_optimizer_offload_only(llama2: object) -> None:
    # without offload_param the bf16 partition stays on the GPU: 16 + 2 (gradient buffer) B
    part = PSI // 8
    host = host_memory(llama2, _ds(8, "optimizer", 3))  # type: ignore[arg-type]
    assert (host.pinned_bytes, host.pageable_bytes) == (0, 18 * part)
    # estimator, cpu_offload_params=False: PSI * 16 * 1.5 per node; its 16 B are ours minus
    # the gradient buffer
    assert host.per_node_bytes - 8 * 2 * part == 16 * PSI
    assert host.per_node_bytes <= int(PSI * 16 * 1.5)
    # pin_memory=True pins the fp32 gradient partition and the gradient buffer; the master
    # partition (.to(cpu).clone()) and the CPU Adam states stay pageable
    pinned = host_memory(llama2, _ds(8, "optimizer", 3), deepspeed_pin_memory=True)  # type: ignore[arg-type]
    assert (pinned.pinned_bytes, pinned.pageable_bytes) == ((4 + 2) * part, (4 + 8) * part)


def test_deepspeed_zero2_offload_against_its_estimator(llama2: object) -> None:
    # stage_1_and_2.py, cpu_offload, dp 8, part = PSI / 8:
    #   single_partition_of_fp32_groups (fp32 master)                  4 * part
    #   DeepSpeedCPUAdam states                                        8 * part
    #   single_partition_of_fp32_groups[i].grad (fp32)                 4 * part
    #   param_buffer_of_bit16_for_cpu_offload_groups (bf16)            2 * part
    #   temp_grad_buffer_for_cpu_offload: largest_param_numel, bf16   2 * EMBEDDING
    part = PSI // 8
    host = host_memory(llama2, _ds(8, "optimizer", 2))  # type: ignore[arg-type]
    assert host.pinned_bytes == 0
    assert host.pageable_bytes == 18 * part + 2 * EMBEDDING
    assert host.per_node_bytes == 18 * PSI + 8 * 2 * EMBEDDING
    # estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=8, num_nodes=1,
    # cpu_offload=True): PSI * max(4 * 8, 16) * 1.5 = 48 PSI (the max is the fp32 model each
    # process loads before ZeRO partitions it; its steady state is the 16 B/param term)
    steady = 8 * sum(
        host.pageable_terms[k]
        for k in (
            "fp32 master weights partition",
            "optimizer states (fp32)",
            "fp32 gradient partition",
        )
    )
    assert steady == 16 * PSI
    assert host.per_node_bytes <= int(PSI * max(4 * 8, 16) * 1.5)
    # gradient accumulation: accumulated_grads_in_cpu, param.numel() in bf16 per partition
    # parameter (2 * part); pin_memory=True pins everything but the CPU Adam states
    acc = host_memory(
        llama2, _ds(8, "optimizer", 2, gradient_accumulation_steps=4), deepspeed_pin_memory=True
    )  # type: ignore[arg-type]
    assert acc.pinned_bytes == (4 + 4 + 2 + 2) * part + 2 * EMBEDDING
    assert acc.pageable_bytes == 8 * part


def test_fsdp_cpu_offload_pins_sharded_params_and_grads(llama2: object) -> None:
    # FSDP2 fully_shard(offload_policy=CPUOffloadPolicy()), bf16-mixed: fp32 sharded
    # parameters pinned (_fsdp_param.py padded_sharded_param.pin_memory()), fp32 sharded
    # gradients copied with non_blocking=True into pinned memory (_fsdp_collectives.py), AdamW's
    # two fp32 states created on the CPU parameters (pageable): 4 + 4 pinned, 8 pageable, / 8
    t = TrainingConfig(
        framework="fsdp2", data_parallel_size=8, zero_stage=3, offload="optimizer+params"
    )
    host = host_memory(llama2, t)  # type: ignore[arg-type]
    assert host.pinned_bytes == (4 + 4) * PSI // 8
    assert host.pageable_bytes == 8 * PSI // 8
    assert host.per_node_bytes == 16 * PSI  # 8 processes x 16 PSI / 8
    # FSDP1 (accelerate) keeps the same bytes: _flat_param.py _local_shard.pin_memory(),
    # _cpu_grad = zeros_like(_local_shard).pin_memory()
    fsdp1 = host_memory(llama2, TrainingConfig(**{**_fields(t), "framework": "accelerate-fsdp"}))  # type: ignore[arg-type]
    assert (fsdp1.pinned_bytes, fsdp1.pageable_bytes) == (host.pinned_bytes, host.pageable_bytes)


def _fields(t: TrainingConfig) -> dict[str, object]:
    return {k: getattr(t, k) for k in ("data_parallel_size", "zero_stage", "offload")}


def test_torchao_cpu_offload_optimizer() -> None:
    # torchao optim/cpu_offload.py: every trainable parameter of >= 4096 elements gets
    # p_host = empty_like(p, device="cpu", pin_memory=True) and p_host.grad =
    # empty_like(p_host, pin_memory=True); the fused CPU AdamW keeps exp_avg and exp_avg_sq
    # like p_host (bf16 under bf16-true). GPT-2 small: 124,439,808 parameters, of which 121,344
    # (norms and biases, see test_torchao_cpu_offload_keeps_small_tensors_on_the_gpu) are small.
    big = 124_439_808 - 121_344
    t = TrainingConfig(framework="torchtune", precision="bf16-true", offload="optimizer")
    host = host_memory(load_model_spec("gpt2"), t)
    assert host.pinned_terms == {"parameter copies": 2 * big, "gradients": 2 * big}
    assert host.pageable_terms == {"optimizer states": 2 * 2 * big}
    assert host.processes_per_node == 1 and host.per_node_bytes == 8 * big
    # offload_gradients=True frees the GPU gradient, not the host copy: same host bytes
    g = host_memory(
        load_model_spec("gpt2"),
        TrainingConfig(framework="torchtune", precision="bf16-true", offload="optimizer+gradients"),
    )
    assert g.per_process_bytes == host.per_process_bytes


def test_other_offloads_count_the_states_taken_off_the_gpu(llama2: object) -> None:
    # Megatron, bf16-mixed, no sharding: fp32 master + two fp32 moments = 12 B/param leave the
    # GPU (Note [Model states per precision]); no pinning rule: pageable
    host = host_memory(llama2, TrainingConfig(framework="megatron", offload="optimizer"))  # type: ignore[arg-type]
    assert (host.pinned_bytes, host.pageable_bytes) == (0, 12 * PSI)


def test_processes_per_node() -> None:
    gpt2 = load_model_spec("gpt2")
    t = TrainingConfig(
        framework="deepspeed", zero_stage=2, data_parallel_size=4, offload="optimizer"
    )
    host = host_memory(gpt2, t)
    assert host.processes_per_node == 4  # min(4, 8)
    assert host.on_node(2).per_node_bytes == 2 * host.per_process_bytes
    assert host_memory(gpt2, t, processes_per_node=3).per_node_bytes == 3 * host.per_process_bytes
    with pytest.raises(SpecError, match="gpus_per_node"):
        host.on_node(0)
    assert host_memory(gpt2, TrainingConfig()).per_node_bytes == 0


def test_estimate_details_table_and_cli(invoke: Invoke) -> None:
    t = TrainingConfig(
        framework="deepspeed", zero_stage=2, data_parallel_size=4, offload="optimizer", seq_len=128
    )
    est = estimate("gpt2", t, engine="analytic", simulate_allocator=False)
    d = est.details["host_memory"]
    assert set(d) >= {
        "pinned_bytes",
        "pageable_bytes",
        "per_process_bytes",
        "processes_per_node",
        "per_node_bytes",
        "source",
    }
    assert (
        d["per_node_bytes"]
        == 4 * d["per_process_bytes"]
        == 4 * (d["pinned_bytes"] + d["pageable_bytes"])
    )
    assert (
        "host_memory"
        not in estimate("gpt2", TrainingConfig(seq_len=128), engine="analytic").details
    )
    args = [
        "estimate",
        "gpt2",
        "--framework",
        "deepspeed",
        "--zero-stage",
        "2",
        "--data-parallel-size",
        "4",
        "--offload",
        "optimizer",
        "--seq-len",
        "128",
    ]
    r = invoke(*args)
    assert "host RAM (pinned / pageable), per node" in r.output
    r = invoke(*args, "--gpus-per-node", "2", "--json")
    host = json.loads(r.stdout)["details"]["host_memory"]
    assert host["processes_per_node"] == 2 and host["per_node_bytes"] == 2 * d["per_process_bytes"]
    r = invoke("estimate", "gpt2", "--seq-len", "128")
    assert "host RAM" not in r.output
