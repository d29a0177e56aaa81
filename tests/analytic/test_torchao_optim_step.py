"""torchao's low-bit AdamW step against bytes derived by hand from Inductor's wrapper.

Note [torchao low-bit AdamW step] (specs/optimizers.py): torchao 0.18.0 optim/adam.py
``single_param_adam`` compiled per parameter; the GPU (SIMD) scheduler's wrapper allocates, per
parameter of n elements, two uint8 code buffers (n B each) and two fp32 scale vectors (n/256
x 4 B each) for the 8-bit step; bitsandbytes' AdamW8bit updates in place.
"""

from __future__ import annotations

from trainmem.analytic.temporaries import optimizer_step_temporary_bytes, steps_per_parameter
from trainmem.analytic.transforms.base import alloc
from trainmem.analytic.transforms.optimizer import per_parameter_step_ops
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.trainer_configs import AXOLOTL_OPTIMIZERS, HF_OPTIMIZERS, TORCHTUNE_OPTIMIZERS
from trainmem.specs.training import TrainingConfig

# gpt2: the tied token embedding, 50257 x 768, is the largest trainable tensor
WTE = 50257 * 768  # 38,597,376 elements = 150,771 blocks of 256
ONE_LAYER = {"micro_batch_size": 1, "seq_len": 128, "precision": "bf16-mixed"}


def _peaks(optimizer: str) -> dict[str, int]:
    t = TrainingConfig(optimizer=optimizer, **ONE_LAYER)  # type: ignore[arg-type]
    return estimate("gpt2", t, engine="analytic").schedules[0].phase_peaks()


def test_8bit_step_holds_new_codes_and_scales_of_the_largest_tensor() -> None:
    t = TrainingConfig(optimizer="ao-adamw-8bit", **ONE_LAYER)  # type: ignore[arg-type]
    # torch's default implementation (foreach) does not apply: one compiled step per parameter
    assert t.step_implementation == "foreach" and steps_per_parameter(t)
    codes, scales = 2 * WTE, 2 * 4 * (WTE // 256)
    assert (codes, scales) == (77_194_752, 1_206_168)
    assert (
        optimizer_step_temporary_bytes(t, num_trainable_parameters=10**9, largest_parameter=WTE)
        == codes + scales
    )
    # bf16-mixed: both keep fp32 states of gpt2's vectors (all < 4096 elements) and the same
    # codes and absmax of every matrix; the optimizer phase differs by the step's buffers
    ao, bnb = _peaks("ao-adamw-8bit"), _peaks("adamw-8bit")
    assert ao["optimizer"] - bnb["optimizer"] == codes + scales
    assert ao["forward"] == bnb["forward"]


def test_4bit_and_fp8_steps() -> None:
    n = 256 * 1000
    four = TrainingConfig(optimizer="adamw-4bit")
    # unpacked uint8 codes (n), fp32 scaled states (4n) and int64 codes (8n) of both states,
    # two fp32 scales per 128 values
    assert optimizer_step_temporary_bytes(
        four, num_trainable_parameters=n, largest_parameter=n
    ) == 2 * (1 + 4 + 8) * n + 2 * 4 * (n // 128)
    fp8 = TrainingConfig(optimizer="adamw-fp8")
    assert optimizer_step_temporary_bytes(
        fp8, num_trainable_parameters=n, largest_parameter=n
    ) == 2 * 4 * (n // 256)


def test_framework_names_pick_the_library() -> None:
    # transformers training_args.py OptimizerNames: adamw_bnb_8bit / adamw_8bit are
    # bitsandbytes', adamw_torch_8bit torchao's; axolotl's ao_adamw_8bit torchao's
    assert HF_OPTIMIZERS["adamw_bnb_8bit"][0] == HF_OPTIMIZERS["adamw_8bit"][0] == "adamw-8bit"
    assert HF_OPTIMIZERS["adamw_torch_8bit"][0] == "ao-adamw-8bit"
    assert AXOLOTL_OPTIMIZERS["ao_adamw_8bit"][0] == "ao-adamw-8bit"
    assert TORCHTUNE_OPTIMIZERS["bitsandbytes.optim.AdamW8bit"] == "adamw-8bit"
    for path in ("torchao.optim.AdamW8bit", "torchao.prototype.low_bit_optim.AdamW8bit"):
        assert TORCHTUNE_OPTIMIZERS[path] == "ao-adamw-8bit"


def test_optimizer_in_backward_steps_each_gradient_with_its_own_buffers() -> None:
    # torchtune's optimizer_in_bwd: one optimizer per parameter, stepped in the gradient's hook;
    # a bf16 gradient of 3072 x 8192 (24 Mi elements) holds 2n + 8n/256 B while it steps
    n = 3072 * 8192
    t = TrainingConfig(optimizer="ao-adamw-8bit", precision="bf16-true", optimizer_in_backward=True)
    grad = alloc(2 * n, MemoryCategory.GRADIENT, "backward", "g", "layers.0.mlp", "grad")
    made, freed = per_parameter_step_ops(t, grad)
    assert made.size_bytes == 2 * n + 2 * 4 * (n // 256) == 51_118_080
    assert freed.size_bytes == made.size_bytes
