"""torchao float8 linears: what they save in eager tensor parallelism and under torch.compile in
place of the 16-bit inputs (torchao/float8). Symbols as in :mod:`trainmem.analytic.activations`."""

from __future__ import annotations

from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig


def float8_tensor_parallel(training: TrainingConfig) -> bool:
    """The layer linears take torchao's float8 tensor-parallel styles: float8 training with
    tensor parallelism under a framework whose TP plan has them
    (``FrameworkConventions.float8_tensor_parallel``); see Note [Float8 tensor-parallel
    inputs]."""
    return (
        training.is_fp8
        and training.tensor_parallel_size > 1
        and training.conventions.float8_tensor_parallel
    )


def apply_float8(
    terms: dict[str, int], model: ModelSpec, training: TrainingConfig, *, t: int, k_top: int
) -> None:
    """What torchao float8 linears save instead of the 16-bit inputs, in place (float8 values
    are 1 byte). Without tensor parallelism and without compile nothing changes:
    ``Float8Linear`` saves its high-precision input (torchao/float8/float8_linear.py
    ``matmul_with_hp_or_float8_args.forward``: ``ctx.save_for_backward(input_hp,
    weight_hp_t)``) and casts it again in backward.

    Note [Float8 tensor-parallel inputs]
        torchtitan parallelizes float8 linears with torchao's float8 styles
        (torchtitan/models/llama3/infra/parallelize.py ``apply_tp`` with
        ``enable_float8_tensorwise_tp``: ``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
        ``PrepareFloat8ModuleInput``; torchao/float8/float8_tensor_parallel.py). Each style's
        ``_prepare_input_fn`` casts the linear's input to float8
        (``hp_tensor_to_float8_dynamic``, a ``DTensor`` of a ``Float8TrainingTensor``) before
        the matmul, which uses it as is (``tensor_already_casted_to_fp8``) and saves it, so
        the saved input is float8, 1 byte a value:

        - q, k, v and gate, up: with sequence parallelism ``PrepareFloat8ModuleInput`` on the
          attention and the MLP casts the sequence shard once, before the all-gather (its
          docstring: "if there are multiple float8 users of the input activation, we perform
          fp8 allgather only once"): one full-sequence float8 [t, h] per module, h t B (not
          c h t). Without it every ``Float8ColwiseParallel`` casts the replicated input on its
          own: one h t B copy per linear (3 for q, k, v; 2 for gate, up).
        - o and down (``Float8RowwiseParallel``): their local input slice is cast, [t, a d / tp]
          and [t, i / tp]; the o projection's float8 copy is saved beside the attention
          output the kernel saves (a d t / tp B more), and the gated product act(gate) * up is
          read only by that cast, so the down projection keeps i t / tp B instead of c i t / tp.

        Traced (trainmem.trace.tensor_parallel applies the same styles): llama-3.2-1b FSDP 2 x
        TP 2 + SP float8, per layer 4 + 2 + 4 + 8 MiB for these four inputs where bf16 kept
        8 + 0 + 8 + 16 MiB.

    Note [Compiled float8 linears]
        Under torch.compile the min-cut partition chooses what a float8 linear keeps (Note
        [Tracing torch.compile], Note [Static-lifetime parameters under compile] in
        trainmem/trace/compile.py). The float8 weights are static-lifetime inputs, so the
        partition saves the weight (free) and recasts it in backward: nothing per layer.
        Without tensor parallelism an input's cast is pointwise (x * scale, clamp, to float8)
        on a tensor the partition keeps or recomputes anyway (the normed input from the norm's
        saved input and rstd; act(gate) * up from the saved gate and up outputs), with the
        scale a saved fp32 scalar: the q/k/v, gate/up and down inputs are recomputed and
        nothing is saved for them (the bf16 input eager keeps is gone too). The o projection's
        float8 input is saved (a d t B): its source is the attention kernel's output, which
        the partition sees apart from the detached output the kernel's backward saves, so
        keeping the 1-byte copy is cheaper than the 2-byte source. With tensor parallelism
        (Note [Float8 tensor-parallel inputs]) a cast that follows a collective is saved: the
        partitioner never recomputes a collective (``force_save_collectives``), so the
        sequence-parallel all-gather's float8 output is kept (q/k/v and gate/up, one h t B
        each module), and a row-parallel input's cast follows the all-reduce of its amax over
        the TP ranks, after which ``ban_if_used_far_apart`` bans recomputing it
        (torch/_functorch/partitioners.py ``solve_min_cut``): down keeps i t / tp B. Without
        sequence parallelism the column-parallel casts have a local amax and are recomputed
        as without TP. Traced on llama-3.2-1b FSDP 2, compile + float8, per layer beyond the
        bf16 compile rule's terms: 8 MiB (o) and no q/k/v, gate/up, down inputs; x TP 2 + SP
        4 + 2 + 4 + 8 MiB (q/k/v, o, gate/up, down); x TP 2 without SP 2 + 8 MiB (o, down).
    """
    if not (training.compile or float8_tensor_parallel(training)):
        return
    h, i = model.hidden_size, model.intermediate_size
    a_d = model.num_heads * model.head_dim
    f8 = 1  # bytes of float8_e4m3fn
    tp = float8_tensor_parallel(training)
    sp = tp and training.sequence_parallel
    # colwise inputs: kept in float8 in eager TP; under compile only an all-gathered one
    if sp or (tp and not training.compile):
        n_qkv = 1 if sp or model.fused_qkv else 3
        n_up = 1 if sp or model.fused_gate_up or model.mlp_kind != "gated" else 2
        terms["attention/qkv_input"] = f8 * h * t * n_qkv
        terms["mlp/input"] = f8 * h * t * k_top * n_up
    else:  # compiled: recast in backward from the norm's saved input
        terms["attention/qkv_input"] = terms["mlp/input"] = 0
    # rowwise inputs: o's float8 copy always; down's under TP (amax all-reduced), else recast
    terms["attention/out_proj_input_float8"] = f8 * a_d * t
    if "mlp/down_input" in terms:
        terms["mlp/down_input"] = f8 * i * t * k_top if tp else 0


def float8_eager_casts(model: ModelSpec, training: TrainingConfig) -> bool:
    """The layers' MLP linears cast their operands to float8 eagerly in each matmul, as
    modelled by Note [Float8 casts of a base weight]: float8 training without torch.compile
    (whose fused casts make only the float8 output) or tensor parallelism (torchao's float8
    styles), over an unquantized base (a GPTQ base's ``QuantLinear`` is not converted: Note
    [Tracing float8]), for a dense gated pre-norm decoder's MLP whose linears torchtitan's
    filter converts (both sizes multiples of 16). The weight's own cast only without sharded
    parameters (:func:`float8_weight_cast_bytes`).

    Note [Float8 casts of a base weight]
        torchao 0.18's ``Float8Linear`` casts its high-precision weight to float8 in every
        matmul, dynamically and tensorwise, in eager code (torchao/float8/float8_linear.py
        ``matmul_with_hp_or_float8_args``: ``hp_tensor_to_float8_dynamic(weight_hp_t, ...)``
        in the forward and again, ``cast_config_weight_for_grad_input``, in the backward
        before the input gradient's matmul). The cast of a tensor of n values
        (float8_scaling_utils.py ``hp_tensor_to_float8_dynamic``):

        1. ``tensor_to_scale`` -> float8_utils.py ``tensor_to_amax``:
           ``torch.max(torch.abs(x))``, one copy in the tensor's dtype, freed once the max
           is taken (alone: w n, less than what follows);
        2. float8_training_tensor.py ``_ToFloat8ConstrFunc.forward``: ``tensor_scaled =
           tensor.to(torch.float32) * scale`` (4 n; for an fp32 tensor ``.to`` returns
           itself, else its 4 n copy dies after the product, 8 n at most);
        3. float8_utils.py ``to_fp8_saturated``: ``x = x.clamp(...)`` (4 n more, the scaled
           tensor still bound in the caller) and ``x.to(float8_dtype)`` (n): 2 x 4 n + n
           alive; the clamp dies when ``to_fp8_saturated`` returns, the scaled copy when
           ``_ToFloat8ConstrFunc.forward`` returns, and the float8 weight (n) lives until
           the matmul has run.

        The linear's input (its gradient of the output in the backward) is cast first the
        same way (2 x 4 m + m for m values), and its float8 copy (1 byte a value) is alive
        during the weight's cast. So at the down projection (the layer's last MLP linear,
        its saved tensors all alive; n = i h for gate, up and down alike) the forward holds
        t i (down's float8 input) + 2 x 4 i h + i h beside what Note [Forward tensors held
        at the down projection] lists, without down's output, which the matmul makes after
        the fp32 copies are freed; the backward's first linear holds t h (the float8 output
        gradient) + the same 9 i h before down's input gradient is made. Under FSDP2 the
        weight is all-gathered in float8 (``enable_fsdp_float8_all_gather``, cast on the
        shard in fsdp_utils.py ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``)
        and the matmul skips its cast (``tensor_already_casted_to_fp8``): the operand's
        casts remain. A frozen weight
        (LoRA's base) is cast as a trained one: the function never reads
        ``ctx.needs_input_grad``, and also computes the frozen weight's gradient (c i h,
        discarded by autograd; :func:`float8_frozen_weight_gradient`), made after the input
        gradient as a trained one's is under autocast (Note [An MLP's backward, linear by
        linear]): below the cast's moment, but the backward's largest transient under FSDP2,
        whose float8 all-gather leaves no cast in the matmul. Full fine-tuning has the same
        casts, but its peak is the optimizer step's (fp32 weights, gradients and states);
        under LoRA the model states are small and the casts set the forward's peak. The
        trace runs torchao's code on fake tensors (trainmem/trace/float8.py); on the
        agreement model (2-layer 2048-wide Llama, 2 x 256 tokens, LoRA r16 fp8-mixed) it
        holds exactly these tensors at layer 1's down projection: 2,883,584 B + 2 x
        46,137,344 B + 11,534,336 B in the forward, 1,048,576 B + the same in the backward.
    """
    if not training.is_fp8 or training.compile or training.quantize_base != "none":
        return False
    if training.tensor_parallel_size > 1:
        return False
    dense = model.num_experts <= 1 and model.mlp_kind == "gated"
    aligned = model.hidden_size % 16 == 0 and model.intermediate_size % 16 == 0
    return dense and aligned and model.architecture == "decoder"


def float8_linears_save_input(model: ModelSpec, training: TrainingConfig) -> bool:
    """The layers' linears are float8 linears run eagerly, which save their input whether or
    not their weight needs a gradient, until their backward has made both gradients (Note
    [Frozen float8 linears save their input]).

    Note [Frozen float8 linears save their input]
        torchao 0.18's ``Float8Linear`` runs its matmul as the autograd Function
        ``matmul_with_hp_or_float8_args`` (torchao/float8/float8_linear.py), whose forward
        calls ``ctx.save_for_backward(input_hp, weight_hp_t)`` unconditionally: it never
        reads ``ctx.needs_input_grad``. So a frozen base linear keeps its 16-bit input as a
        trained one does, where ``torch.nn.functional.linear`` over a frozen weight would
        save none (Note [LoRA activations]): under LoRA with ``fp8-mixed`` the base's saved
        inputs are full fine-tuning's (q/k/v's normed input once, the MLP norm's output for
        gate and up, down's input ``act(gate) * up``, c i t), plus the adapters' own terms.
        Not under torch.compile (the partition chooses: Note [Compiled float8 linears]) nor
        over a quantized base (GPTQ's ``QuantLinear`` is not converted: Note [Tracing
        float8]); torchtitan's filter converts a linear only if both sizes are multiples of
        16 (trainmem/trace/float8.py ``_keep``), so only a model whose layer linears all
        pass it. Traced on the agreement model (2-layer 2048-wide Llama, 2 x 256 tokens,
        LoRA r16 on q and v, fp8-mixed, FSDP2 over 4): each layer saves 5,767,168 B for
        down's input and 2,097,152 B for the MLP norm's output beyond the formulas' LoRA
        terms, 40,964,120 B a layer against 33,099,776 B before.

        The saved input is released when the Function's backward returns, after the weight
        gradient (``grad_weight`` reads ``input_hp``): the down projection's input is alive
        beside its weight gradient (the frozen one's too, Note [Float8 casts of a base
        weight]) and freed before the product's backward, not before down's backward as an
        autograd ``mm``'s is in Note [An MLP's backward, linear by linear] (the trace of the
        agreement model above peaks there, layer 1's down projection: 366,326,524 B).
    """
    if not training.is_fp8 or training.compile or training.quantize_base != "none":
        return False
    kv = model.num_kv_heads * model.head_dim
    sizes = (model.hidden_size, model.intermediate_size, model.num_heads * model.head_dim, kv)
    return all(n % 16 == 0 for n in sizes)


def float8_frozen_weight_gradient(training: TrainingConfig) -> bool:
    """A frozen base's down projection is a float8 linear run eagerly, whose backward computes
    the weight's gradient (c i h) that autograd then drops (Note [Float8 casts of a base
    weight]): LoRA with ``fp8-mixed`` over an unquantized base, without torch.compile (whose
    joint graph drops the unused gradient)."""
    return (
        training.is_fp8
        and training.is_lora
        and not training.compile
        and training.quantize_base == "none"
    )


def float8_weight_cast_bytes(model: ModelSpec, training: TrainingConfig) -> tuple[int, ...]:
    """The scaled fp32 copy, its clamp and the float8 weight of one MLP linear's cast (4 n,
    4 n, n bytes for n = i h); none where FSDP shards the parameters and all-gathers them in
    float8 (Note [Float8 casts of a base weight])."""
    if training.zero_stage == 3:
        return ()
    n = model.intermediate_size * model.hidden_size
    return 4 * n, 4 * n, n
