"""CI guard on accuracy (issue 17): the analytic side of the dev benchmark against the published
measurements in ../shared/validation/dev_measurements.csv, with thresholds written next to the
figures they guard. A change that makes the memory model worse on these rows fails here.

Current figures (benchmarks/RESULTS.md): 33 of 35 rows scored, median |error| 1.8%,
p90 10.7%, worst under-estimate GT004 -13.6%. The lit-gpt FSDP + LoRA rows GT092-GT095 moved from
-60.4 / -53.7 / -73.5 / -27.0% to +1.7 / +5.2 / +1.4 / +14.1% when FSDP1's flat-parameter
gradients under ``no_sync`` accumulation were modelled (Notes [FSDP gradient accumulation under
no_sync] and [Flat-parameter gradients in backward] in analytic/schedule.py); no other row
changed. Re-recorded at main c21fc20 (session 8): GT077 +3.3 -> +0.6% and GT092-GT094 under
1 point better, moved by earlier sessions' rules (not re-recorded then); median |error|
2.2 -> 1.8%; the training KV cache rule of that session moves no dev row. Thresholds allow
rounding noise only;
they tighten when the model is fixed, never loosen to let a row pass.
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO_DIR

BENCH = REPO_DIR / "benchmarks"
sys.path.insert(0, str(BENCH))

import validate  # noqa: E402

#: signed error per scored row at the commit that wrote this table (benchmarks/validate.py); a row
#: may improve freely but not get worse by more than ROW_SLACK (absolute error, percentage points)
RECORDED = {
    "GT001": +0.0177,
    "GT002": -0.0033,
    "GT003": +0.0174,
    "GT004": -0.0265,
    "GT005": -0.0126,
    "GT006": +0.0379,
    "GT007": +0.0376,
    "GT008": +0.0305,
    "GT009": +0.0186,
    "GT071": +0.0465,
    "GT072": +0.0223,
    "GT073": -0.0161,
    "GT074": +0.0133,
    "GT075": +0.1447,
    "GT076": -0.0018,
    "GT077": +0.0061,
    "GT078": -0.0000,
    "GT079": -0.0022,
    "GT080": +0.0010,
    "GT081": +0.0020,
    "GT082": -0.0003,
    "GT083": -0.0019,
    "GT084": -0.0020,
    "GT085": -0.0031,
    "GT086": -0.0037,
    "GT087": -0.0026,
    "GT088": -0.0033,
    "GT089": -0.0026,
    "GT092": +0.0239,
    "GT093": +0.0783,
    "GT094": +0.0186,
    "GT095": +0.1411,
    "GT096": +0.0007,
}
ROW_SLACK = 0.01
# Re-recorded for litgpt's own attention (issue 26; found by tracing litgpt 0.5.13's GPT on the
# generic path, trace/litgpt_model.py; the same code in lit-gpt @8641822 and litgpt 0.4.0):
# q built by ``torch.cat`` makes the flash kernel's output (b, a, s, d)-contiguous, so
# ``y.reshape(B, T, C)`` copies it for ``proj``, which saves the copy where it needs its input
# (analytic/attention.py ``sdpa_output_copied``): the QLoRA rows, whose bitsandbytes < 0.43.2
# base saves its input, GT081 -1.9 -> +0.3 %, GT085 / GT086 / GT089 -2.4 / -2.5 / -2.4 -> -0.0 /
# -0.0 / -0.1 %, GT098-GT106 1.5-2.0 points better, GT109 -2.7 -> -2.0 %; grew by the same copy:
# GT077 -0.6 -> +2.1 % (phi-1.5 QLoRA) and GT111 +0.4 -> +1.7 % (TinyLlama full fine-tuning).
# The fused qkv's one autocast copy (not three) moves no dev row (GT096's adapters read
# lora_dropout's output).
# Then Note [litgpt's cast output] (analytic/loss.py: Fabric's fp32 copy of the output made
# while the loop still holds the previous logits, the loop previous of the 2024 config-hub
# rows): GT098 -1.4 -> -0.1 %, GT100 -2.8 -> +1.4 %, GT102 -1.2 -> +0.0 %, GT104 -3.1 ->
# -1.2 %, GT106 -3.2 -> -0.5 %; GT109 -2.0 -> +2.2 % (0.1 point further, the same rule); with
# the final norm's and the head input's saved tensors also before the rebinding (saved before
# the head runs): GT098 +0.1, GT100 +1.5, GT102 +0.2, GT104 -1.1, GT106 -0.3, GT109 +2.2 %.
# Then Note [litgpt's bound logits] (analytic/transforms/loop.py: lit-gpt @8641822 / litgpt
# 0.5.13 ``fit`` binds ``logits = model(...)``, so Fabric's fp32 copy lives through the whole
# backward and the optimizer step, not only to the head's backward): the single-GPU rows do not
# move (their peak is the backward's start); grew, by the same binding, the FSDP LoRA rows,
# which were over already: GT092 +1.5 -> +2.4 %, GT093 +4.3 -> +7.8 %, GT094 +1.3 -> +1.9 %
# (FSDP1's gradient timing in the formulas is 3-4 % above the real FSDP1 trace, session 13).
# Re-recorded for lit-gpt's QLoRA under Lightning's BitsandbytesPrecision (session 15, issue
# 24): the LM head is quantized with the base (the state layout kept it in bf16; lightning
# fabric/plugins/precision/bitsandbytes.py ``_convert_layers``) and every 4-bit weight is
# quantized from fp16 (``_Linear4bit.quantize``: ``.to(dtype=torch.half)``), so bitsandbytes'
# ``MatMul4Bit`` dequantizes to fp16 and casts to bf16, both copies alive at the cast
# (analytic/buffers.py ``dequantize_cast_bytes``). The head alone moved the rows down 1.3-4.7
# points; with the fp16 copy: GT077 +2.1 -> +3.7 %, GT081 +0.3 -> +2.1 %, GT085 -0.0 -> +0.5 %,
# GT086 -0.0 -> +0.5 %, GT089 -0.1 -> +0.3 % (median 1.3 -> 1.5 %, their peak now the head's
# backward dequantization); then with the head's backward after the loss's (Note [Quantized
# head after the loss's backward], analytic/transforms/quantized.py: autograd runs every
# chunk's cross-entropy and cast backward first, so the log-softmax is freed and the logits
# gradient is in bf16 when the head dequantizes): GT077 +0.6 %, GT081 +0.2 %, GT085 -0.3 %,
# GT086 -0.4 %, GT089 -0.3 %; median 1.3 %.
# Re-recorded for each weight's gradient made where its linear's backward runs (Note [Gradients
# where their linear's backward runs], analytic/schedule.py; session 15, issue 26): GT007
# +1.5 -> +1.0 %, GT005 -1.3 -> -1.4 %; no other row moves.
# Then a later micro-batch's new gradient made there too before AccumulateGrad adds it into
# the kept one (``_accumulated``): the accumulating BERT rows 0.1-0.2 points less under, GT001
# -8.7 -> -8.5 %, GT002 -5.0 -> -4.8 %, GT004 -13.6 -> -13.5 %, GT008 -9.0 -> -8.8 %.
# Re-recorded for torch < 1.11's softmax saving its input (specs/frameworks.py
# SOFTMAX_BACKWARD_INPUT_DTYPE_SINCE: derivatives.yaml ``_softmax_backward_data(grad, result,
# dim, self)``; transformers 4.21.0 pytorch_utils.py ``softmax_backward_data``), the BERT rows'
# torch 1.10 (dev_rows.py): eager attention keeps its fp32 pre-softmax scores too, 4 a s^2 b B
# a layer (the "13 MB per layer per sequence" found missing in session 8): GT001 -8.5 -> +1.8 %,
# GT002 -5.0 -> -0.3 %, GT004 -13.7 -> -2.7 %, GT006 -8.7 -> +3.8 %, GT008 -8.8 -> +3.1 %; the
# checkpointed rows within 0.4 point. Median 1.0 -> 0.6 %, p90 8.7 -> 4.7 %, none under by > 10 %.
MIN_ROWS_SCORED = 33
# Re-recorded for the head's and the embedding's new gradients (Note [New gradients of the head
# and the embedding], analytic/schedule.py; session 18, helper gaccum): under torch 1.10's
# zero_grad(set_to_none=False) every BERT micro-batch's word-embedding lookup makes a new fp32
# V x h gradient (125 MB) before AccumulateGrad adds it in place; at the embedding's backward it
# sets the accumulating, checkpointed rows' peak: GT007 +1.3 -> +3.8 %, GT009 -0.5 -> +1.9 %
# (its crossing moves the median 0.61 -> 1.20 %: loosened for it and reported, the rule
# checked against the generic path's trace, not bent); GT073 -1.5 -> -1.6 % (gpt2-medium's tied
# lookup gradient); GT001-GT008 others under 0.1 point.
MAX_MEDIAN_ABS = 0.0121  # 1.20 % at 2026-11-28 14:00 UTC (GT009's new embedding gradient)
# Re-recorded for LoRA's first layer (Note [LoRA's first layer], analytic/lora.py: without
# activation checkpointing nothing before layer 0's adapters requires grad, so its input norm,
# its frozen q / k / v weight copies and, over a bitsandbytes base that saves its input, the
# q / k / v matmuls' inputs are not saved; torchgen gen_variable_type.py ``guard_for``, checked
# against the generic path to 0.0 %) and the adapters' own autocast input copy over such a base:
# the lit-gpt LoRA / QLoRA rows: GT076 +0.3 -> -0.2 %, GT077 +0.6 -> -0.6 %, GT078 +0.7 -> -0.0 %,
# GT079 +0.7 -> -0.2 %, GT080 +0.6 -> +0.1 %, GT082 +0.7 -> -0.0 %, GT083 +0.9 -> -0.2 %, GT084 /
# GT087 / GT088 0.1-0.2 points lower; grew, by the same true rule (the rows were already under):
# GT081 -0.3 -> -1.9 % (stablelm-3b QLoRA: a parallel block, whose frozen MLP in layer 0 records
# nothing), GT085 / GT086 / GT089 -2.2 -> -2.4 / -2.5 / -2.4 %, GT096 -10.7 -> -12.3 % (stablelm-3b
# bf16-mixed LoRA; an under-count unexplained before, 1.6 points more now): p90 0.107 -> 0.123
# (GT096's own move; loosened for it and reported, the rule not bent).
# Re-recorded for lit-gpt's chunked head under autocast (session 15, analytic/head.py
# ``autocast_head_casts``): each of the head's 9 pieces casts the frozen fp32 head weight to
# bf16 again (autocast caches only leaves that require grad, autocast_mode.cpp
# ``cached_cast``) and its matmul saves the cast: 9 x 415 MB, not one. GT096 -12.3 -> +0.1 %;
# no other row moves. p90 12.3 -> 9.0 %, median 1.3 %, under by > 10 %: GT004 alone.
MAX_P90_ABS = 0.047  # 4.66 % at 2026-11-28 07:25 UTC (torch < 1.11's softmax input)
MIN_WORST_SIGNED = -0.03  # GT004 -2.65 % at 2026-11-28 07:25 UTC


@pytest.mark.skipif(not validate.DEFAULT_CSV.exists(), reason="../shared is not beside the repo")
def test_analytic_accuracy_does_not_regress() -> None:
    rows = validate.load_rows()
    measured = {r["id"]: float(r["measured_gb"]) * 1e9 for r in rows if r.get("measured_gb")}
    tool = validate.run_trainmem(rows, "analytic", validate.DEFAULT_CSV)
    errors = validate.signed_errors(tool, measured)
    summary = validate.summarize(errors)
    assert summary["n"] >= MIN_ROWS_SCORED, tool.not_run
    assert summary["median_abs"] <= MAX_MEDIAN_ABS, summary
    assert summary["p90_abs"] <= MAX_P90_ABS, summary
    assert min(errors.values()) >= MIN_WORST_SIGNED, summary
    worse = {
        rid: (round(RECORDED[rid], 4), round(e, 4))
        for rid, e in errors.items()
        if rid in RECORDED and abs(e) > abs(RECORDED[rid]) + ROW_SLACK
    }
    assert not worse, f"rows whose error grew (recorded, now): {worse}"


#: Dev set 2 (issue 24; ../shared/validation/dev_measurements_2*), as benchmarks/validate.py --dev2
#: runs it: each row's jsonl arguments through ``trainmem estimate --json`` with the amendments of
#: benchmarks/dev2_causes.py (the fsdp_qlora rows take ``--framework fsdp-qlora``; the torchao
#: DINOv2 rows their 224 px config and fused AdamW; the Mistral-7B-v0.2 rows no sliding window),
#: compared on the row's metric. Recorded when the set was first scored: 139 of 154 rows, median
#: |error| 6.7%, p90 25.0%, 24 under-estimated by >10%, no completed run predicted OOM (as read,
#: without the amendments: 9.0%, 50.7%, 21, 8).
#: Far from issue 24's bars (4%, 12%, 0, 0); the guard keeps what is there from getting worse
#: while the causes named in dev2_causes.py are fixed. About 20 s on two busy CPU cores.
#: Re-recorded for torchtune's chunked loss (Note [Compiled chunked cross-entropy]: compiled,
#: the chunks keep their 16-bit logits, not an fp32 log-softmax; every chunk's logits gradient
#: reaches the head's backward, whose weight gradients are summed out of place): GT013-GT026
#: (GT015 +11.6 -> +0.4%, GT019 +98 -> +7.7%; GT013 +2.0 -> -4.1%, GT017 +5.9 -> -8.8% and
#: GT020 +6.7 -> +10.6%, GT025 +28.4 -> +29.6% grew, by the same mechanism); median 6.6%, p90
#: 20.7%, 24 under.
#: Re-recorded for the loss upcast as a property of the model code and the transformers release
#: (GPTBigCode's loss on 16-bit logits before transformers 4.49; the fms-acceleration rows
#: GT132-GT160 amended with their source's transformers 4.48.1): GT132 +11.0 -> +0.0%, GT133
#: +14.7 -> -1.2%, GT134 +20.0 -> -11.8%, GT135 +20.5 -> -10.4% (every |error| smaller; the
#: last two now under by > 10%: the over-count of the fp32 upcast hid about one bf16 logits
#: tensor the measured peak holds, unexplained, dev2_causes.py); median 6.5%, p90 20.7%,
#: 26 under.
#: Re-recorded for the shifted copy of the logits before transformers 4.49 (``ForCausalLMLoss``
#: 4.46-4.48 and the models' own losses before: ``logits[..., :-1, :].contiguous()`` beside the
#: logits and their fp32 upcast; loss.py ``shifted_logits_bytes``) on the fms rows'
#: transformers 4.48.1: GT140 -4.2 -> -0.3%, GT141 -9.1 -> -5.6%, GT142 -5.8 -> -0.4%, GT143
#: -12.4 -> -7.7%, GT147 -7.7 -> -2.2%, GT149 -11.3 -> -4.8%, GT156 -9.5 -> -4.0%, GT158
#: -12.4 -> -5.9%; grew, by the same copy: GT146 -0.1 -> +6.4%, GT148 -3.1 -> +4.1%, and the
#: 1-GPU GPTQ / bnb rows already over, GT155 +24.0 -> +32.2%, GT157 +25.0 -> +34.4%; median
#: 5.6%, p90 20.7%, 23 under.
#: Re-recorded for torch's foreach Adam before 2.1 (two group-sized intermediates,
#: ``exp_avg_sq_sqrt`` and ``denom = _foreach_add(exp_avg_sq_sqrt, eps)``, torch 2.0.1
#: optim/adam.py; one from 2.1.0, pytorch PRs #104780 / #104898) with the rasbt ViT rows'
#: source amendments (their torch 2.1.0.dev20230623 nightly predates that change: read as
#: ``--torch-version 2.0``; 01..04 call zero_grad() between the loss and backward()):
#: GT179 -9.0 -> -5.1%, GT180 -4.0 -> +2.0%, GT181 -10.4 -> -6.5%, GT182 -19.7 -> -10.4%,
#: GT183 -18.8 -> -3.8%, GT184 unchanged (SGD); median 5.3%, p90 20.7%, 21 under.
#: Re-recorded for peft's GPTQ exception (prepare_model_for_kbit_training casts no parameter
#: of a GPTQ base to fp32, peft utils/other.py) and a quantized base kept in the 16 bits
#: transformers loads it in under autocast (embedding, norms, LM head and the residual stream,
#: TrainingConfig.kbit_16bit_dense): the fms-acceleration accelerated-peft-autogptq rows on
#: one GPU GT155 +32.2 -> +1.2%, GT157 +34.4 -> +0.5%, GT159 +35.1 -> +1.5%; median 4.8%, p90
#: 19.9%, 21 under.
#: Re-recorded for the load phase (Note [The load phase], Note [torchao 0.1 NF4 at load]):
#: torchtune's single-device QLoRA on torchao 0.1 (pinned 2024-04-09 .. 2024-06-26; the
#: torchtune rows of that time amended with ``--torchao-version 0.1``) builds each bf16 linear
#: on the GPU and quantizes it there, then again from the checkpoint, with (numel, 16)
#: temporaries the caching allocator keeps; the replay runs the load before the step, so
#: max_memory_reserved includes its cache. GT028 -41.1 -> -11.7%; GT037 +0.2 -> -6.7% (the
#: load's cached blocks change where the step's tensors land: 12.32 -> 11.48 GB reserved);
#: allocated rows (GT173) unchanged (torchtune resets the peak after loading). Median 4.8%,
#: p90 19.9 -> 19.7%, 21 under.
#: Re-recorded for the fms-acceleration rows read as their benchmark configuration says
#: (scripts/benchmarks/scenarios.yaml and the accelerated-peft plugin @24bdadb): every peft
#: scenario has lora_dropout 0.1 (GT140-GT160), and both bnb configurations load the base
#: with bnb_4bit_use_double_quant=True (nf4-dq, GT146-GT154). Smaller: GT146 +6.4 -> +4.8%,
#: GT148 +4.1 -> +3.2%, GT150 +16.8 -> +12.4%, GT151 +11.4 -> +7.5%, GT152 +19.9 -> +17.2%,
#: GT153 +10.9 -> +9.5%, GT160 -19.1 -> -17.3%; grew (dropout's kept inputs in the recomputed
#: layer, the smaller double-quantized base under a gap the model does not explain):
#: GT144 +2.8 -> +3.5%, GT145 +0.5 -> +1.7%, GT147 -2.2 -> -4.0%, GT149 -4.8 -> -5.9%,
#: GT154 -19.2 -> -21.0%, GT159 +1.5 -> +3.9%; median 4.8%, p90 19.7% (with the load phase), 21
#: under.
#: Re-recorded for fsdp_qlora's FSDP1 initialisation as a load phase (Note [FSDP1
#: sync_module_states init]: every unit moved to the GPU at full size, broadcast in 250 MiB
#: buckets, two in flight, flattened and sharded; the flat parameters and buckets stay in the
#: cache the step starts from). GT117 / GT118, LoRA at 512 / 2048 tokens, measured 10.99 /
#: 10.97 GB reserved (the load, not the step, sets it): predicted 9.36 / 10.60 -> 10.24 /
#: 10.24 GB. GT115 -22.0 -> -14.2%, GT116 +6.7 -> -2.3%, GT117 -14.9 -> -6.9%, GT120 -0.8 ->
#: -0.2%, GT121 +1.3 -> -0.5%, GT125 -5.5 -> -4.3%, GT126 -1.5 -> -0.5%, GT130 / GT131 -1.4
#: -> -0.6%; grew (the load's cached blocks change where the step's tensors land; the QLoRA
#: rows' load_and_quantize before FSDP is not modelled): GT118 -3.4 -> -6.7%, GT119 +3.8 ->
#: +5.1%, GT127 -1.6 -> -4.5%, GT128 -4.8 -> -8.9%, GT129 -20.7 -> -26.0% (FSDP1 CPU
#: offload). Median 4.8 -> 5.1% (bound loosened for this deliberate mechanism), p90 19.7 ->
#: 17.3%, 21 -> 20 under.
#: Re-recorded for torchao's NF4 storage before 0.3 (tensor_states.torchao_factor_view_bytes:
#: the quantization factor a view of its (n / 64 / 256, 256) bf16 base, 2 n / 64 bytes per
#: weight; torchao PR #298 made it contiguous in 0.3) and the load phase allocating each
#: weight's kept pieces where torchao makes them (the factor and int8 scalers in the double
#: quantization, before the (numel, 16) temporaries): GT028 -11.7 -> -9.9%, GT037 -6.7 ->
#: -5.3%, GT173 -13.9 -> -11.5% (allocated); median 5.1%, p90 17.3%, 20 -> 19 under.
#: Re-recorded for the FSDP1 load under NO_SHARD (fsdp_qlora's ``ddp`` strategy: each unit
#: moved, broadcast and flattened, the flat parameter kept as the weight): GT123 +1.2 ->
#: +1.4%, GT124 -1.9 -> +1.6%; median 5.1%, p90 17.3%, 19 under.
#: Re-recorded for the training loop as an input (``--loop``; litgpt's is ``previous``: Note
#: [The previous micro-batch's graph], analytic/held_outputs.py): litgpt's ``fit`` keeps
#: ``logits`` from one iteration to the next, and with it the graph whose bitsandbytes 0.42
#: ``MatMul4Bit`` nodes hold their 16-bit inputs as ``ctx`` attributes, through the next forward;
#: with the litgpt config-hub rows amended from their yamls (gradient accumulation, PagedAdamW
#: under bitsandbytes, LoRA on the head; dev2_causes.py ``_LITGPT_HUB``): GT098 -12.1 -> -2.8%,
#: GT100 -8.3 -> -3.0%, GT102 -13.1 -> -2.6%, GT104 -16.8 -> -9.9%, GT106 -7.9 -> -2.8%, GT109
#: -12.2 -> -10.8%, GT111 -15.2 -> +0.4% (its 8 accumulation steps keep the bf16 gradients
#: through the later forwards); the bf16 LoRA rows move by the amendments only (the previous
#: fp32 logits are freed before the loss's peak): GT097 +0.8 -> +1.0%, GT099 +1.7 -> +1.9%,
#: GT101 +0.9 -> +1.0%, GT103 -3.1 -> -3.0%, GT105 +1.8 -> +2.0%, GT107 +6.6 -> +6.9%, GT108
#: +3.6 -> +3.8%, GT110 +5.8 -> +6.0%, GT112 -3.6 -> -3.4%, GT113 -4.7 -> -4.5%; no other row
#: moved; median 5.1 -> 4.3%, p90 17.3%, 19 -> 15 under.
#: Re-recorded for litgpt's own output head (litgpt/model.py: ``lm_head`` beside ``wte``, never
#: tied; FrameworkConventions.untied_output_head) and the LoRA script's head and loss in chunks
#: of 128 tokens (finetune/lora.py ``lm_head_chunk_size=128``, ``chunked_cross_entropy``;
#: amended ``--chunked-cross-entropy 4`` at 512 tokens): GT097 +1.0 -> -0.0%, GT098 -2.8 ->
#: -3.2%, GT099 +1.9 -> -0.1%, GT100 -3.0 -> -4.2%, GT101 +1.0 -> +0.0%, GT102 -2.6 -> -2.9%,
#: GT103 -3.0 -> -0.6%, GT104 -9.9 -> -4.2%, GT105 +2.0 -> +0.2%, GT106 -2.8 -> -3.6%, GT107
#: +6.9 -> +2.4%, GT108 +3.8 -> -0.3%, GT109 -10.8 -> -2.7%, GT110 +6.0 -> +0.2%, GT112 -3.4
#: -> -0.5%, GT113 -4.5 -> -0.4% (the tied families, Falcon, Gemma and Llama 3.2, gain their
#: head; every litgpt row within 4.2%); median 4.3 -> 4.0%, p90 17.3%, 15 -> 14 under.
#: Re-recorded for torchtune's Apr-May 2024 recipes read as their source says (dev2_causes.py
#: ``_TORCHTUNE_HELD_LOGITS``, ``_TORCHTUNE_LORA_DROPOUT``): before cb3ed29d / 8a98fbaa (June /
#: July 2024) the recipes keep ``logits`` bound at loop scope, so the previous micro-batch's
#: logits live through the next forward (``--loop previous``, Note [The previous micro-batch's
#: graph]); the llama2 / llama3 LoRA builders of that time pass lora_dropout=0.05. Smaller:
#: GT029 -36.4 -> -33.8%, GT030 -15.4 -> -15.0%, GT031 -1.0 -> -0.5%, GT033 -6.7 -> -6.2%, GT034
#: -7.1 -> -6.7%, GT035 -6.5 -> -6.1%, GT036 -7.5 -> -6.4%, GT037 -5.3 -> -0.9%, GT040 -9.2 ->
#: -7.0%, GT043 -13.3 -> -11.8%; grew, by the same held logits and dropout masks (the rows'
#: stated lengths, the README's 'Seq Length', over-count GT039 / GT042: dev2_causes.py):
#: GT038 +0.5 -> +3.6%, GT039 +201.6 -> +231.4%, GT041 -0.8 -> +1.4%, GT042 +133.4 -> +140.9%.
#: With them, the Sep / Nov 2024 LoRA, 70B and 405B rows' configs' AdamW ``fused: True``
#: (``_TORCHTUNE_FUSED``): GT022 +9.8%, GT024 +13.0 -> +12.4%, GT026 +12.2 -> +12.1%, GT027
#: +38.0 -> +37.7%.
#: Re-recorded for torchtitan 0.1's compiled loss (``--torchtitan-version``; Note [torchtitan's
#: compiled cross-entropy]: torchtitan/components/loss.py compiles the cross-entropy with
#: ``--training.compile`` since PR #1033), the Trainy H200 rows amended with their source's
#: torchtitan e7c0cae (0.1.0): GT062 +27.9 -> -8.8%, GT063 +28.3 -> -9.2%; no other row moved.
#: Re-recorded for bitsandbytes' 4-bit statistics under ZeRO-3 / FSDP (Note [bitsandbytes
#: statistics under sharding]: the QuantState is not a parameter, so it stays whole on every
#: rank and is never offloaded; only the codes are sharded) and the QLoRA rows' double
#: quantization read from their sources (fsdp_qlora's Linear4bit default
#: compress_statistics=True; peft's sft scripts --use_nested_quant and --lora_dropout 0.1;
#: philschmid's bnb_4bit_use_double_quant; dev2_causes.py): better GT114 -9.9 -> -5.3%, GT128
#: -8.9 -> -7.0%, GT129 -26.0 -> -19.9%, GT154 -21.0 -> -19.9%, GT177 -26.8 -> -15.7%, GT119
#: +5.1 -> +3.0%, GT147 -4.0 -> -3.4%, GT149 -5.9 -> -5.5%; grew, the nf4 reading having
#: overstated the sharded weights (4 B of absmax per 64 values, not 1): GT115 -14.2 -> -18.5%,
#: GT116 -2.3 -> -6.3%, GT127 -4.5 -> -7.2%, GT130 / GT131 -0.6 -> -3.2%, GT120 -0.2 -> -1.2%,
#: GT176 -5.7 -> -7.8%; the Mixtral FSDP rows (over) by the statistics, GT151 +7.5 -> +9.1%,
#: GT153 +9.5 -> +10.6%; no other row moved (median, p90 and the count under unchanged).
#: Re-recorded for transformers 4's MoE expert loop (Note [transformers 4 expert loop],
#: analytic/mlp.py: 4.48.0 modeling_mixtral.py runs one frozen expert at a time; per routed
#: pair only w1's, SiLU's and w3's outputs and w2's output are saved, in bitsandbytes'
#: Linear4bit output dtype, and the backward holds one expert's gradients at a time; the fms
#: rows' transformers 4.48.1): GT150 +12.4 -> +1.7%, GT151 +9.1 -> +3.7%, GT152 +17.2 ->
#: -0.4%, GT153 +10.6 -> -4.2%, GT144 +3.5 -> +1.6%, GT145 +1.7 -> -1.6% (the bf16 LoRA
#: Mixtral rows); no other row moved.
#: Re-recorded for FSDP1's side streams (FrameworkConventions.fsdp_collective_streams, now for
#: torchtune and litgpt too: torch/distributed/fsdp/_runtime_utils.py ``_unshard`` allocates
#: the unsharded flat parameter on the unshard stream, ``_post_backward_hook`` the sharded
#: gradient on the post-backward stream; the caching allocator pools blocks per stream, so the
#: gradients cannot take the forward's freed activation blocks; not for fsdp-qlora, whose
#: QLoRA rows it makes worse while their load_and_quantize is not modelled: dev2_causes.py
#: ``_FSDP1_STREAMS``): reserved smaller for GT029 -33.8 -> -32.1%, GT032 -20.2 -> -11.6%;
#: grew, by the same pools: GT025 +29.6 -> +38.0% and GT026 +12.1 -> +13.8% (torchtune FSDP2,
#: over for reasons the model does not have: allocated already +10 / +8%), GT043 -11.8 ->
#: +14.4% (its 'Seq Length 4096' is the README's, like GT042's, which cannot be the batch
#: length), GT041 +1.4 -> -2.3%; (median, p90 and the count under as the
#: day's run gives them).
#: Re-recorded for torchvision's VisionTransformer (``model_type: torchvision_vit``; the rasbt
#: rows' source builds torchvision.models.vit_l_16 with a Linear(1024, 10) head, amended in
#: dev2_causes.py ``_TORCHVISION_VIT``): nn.MultiheadAttention's output projection saves the
#: ``permute(2, 0, 1, 3).contiguous()`` copy of the SDPA output (Family.mha_out_proj_copy), and
#: its one packed in-projection (fused_qkv: in_proj_weight [3h, h]) saves one autocast copy of
#: the normed input, not three: GT179 -5.1 -> +2.0%, GT180 +2.0 -> +1.7%, GT181 -6.5 -> +0.8%,
#: GT182 -10.4 -> -3.0%, GT183 -3.8 -> +1.6%, GT184 -3.7 -> -0.9%.
#: Re-recorded for GT170 read as its source (torchao benchmark_low_bit_adam.py @1b1e94c5b,
#: PR #584: ZeRO stage 2 with overlap_comm, dev2_causes.py ``_TORCHAO_DS_OFFLOAD``): -8.9 ->
#: +5.7% (the second ipg bucket; ZeRO-2's gradient release to the CPU under offload is not
#: modelled, dev2_causes.py).
#: Re-recorded for GT027 read at its config's batch_size 1 (405B_qlora.yaml @30b8519e; the
#: README's batch 2 is below the step's floor at the measured 48.1 GB: dev2_causes.py
#: ``_TORCHTUNE_405B_BATCH``): +37.7 -> +10.9%.
#: Re-recorded for the peft sft LoRA rows read as their scripts say (run_peft_fsdp.sh,
#: run_peft_deepspeed.sh: --lora_dropout 0.1; dev2_causes.py ``_PEFT_SFT_LORA``), grown by the
#: dropout outputs the recomputed layer keeps: GT174 +1.0 -> +4.5%, GT175 +8.8 -> +14.7%.
#: Re-recorded for the Nov 2024 Optimization flags rows' AdamW read as fused (every AdamW
#: config of torchtune 1814feb sets fused: True; GT014's 26.74 GB is below foreach's floor at
#: the step, 32.1 GB: dev2_causes.py ``_TORCHTUNE_BASELINE_ADAMW``): GT014 +20.2 -> +0.2%;
#: GT011-GT013, GT015, GT016 unchanged.
#: Re-recorded for FSDP1's side streams in fsdp_qlora too (FrameworkConventions.
#: fsdp_collective_streams, the same torch 2.2 _runtime_utils.py ``_unshard`` /
#: ``_post_backward_hook``): GT115 -18.5 -> -16.4%, GT116 -6.3 -> -5.9%, GT118 -6.7 -> -4.0%,
#: GT119 +2.9 -> +1.5%, GT127 -7.2 -> -6.3%, GT130 / GT131 -3.2 -> -0.2%; grew, by the same
#: pools, the CPU-offload rows GT128 -7.0 -> -7.2% and GT129 -19.9 -> -22.9% (their H2D copies
#: on the pre-unshard stream are not modelled).
#: Re-recorded for torchtune's 2024 recipes' loss read as their train() computes it (the shifted
#: fp32 logits' transposed view into CrossEntropyLoss, whose CUDA log-softmax copies it
#: contiguous first; dev2_causes.py ``_TORCHTUNE_TRANSPOSED_CE``, Note [torchtune's transposed
#: cross-entropy]): the forward's loss holds 12 V t' as the backward's start does, so the
#: allocated peaks stay; reserved moved by where the step's tensors land: GT041 -2.3 -> +2.8%,
#: GT042 +140.9 -> +130.2%, GT032 -11.6 -> -11.3%, GT036 / GT037 within 0.1 point.
#: Re-recorded for DeepSpeed ZeRO-3's gathers (Note [DeepSpeed ZeRO-3 parameter gathers]:
#: stage 3 on one GPU too, the prefetch pool up to stage3_max_live_parameters, the output
#: layer's weight fetched as the last layers run, the offloaded partition's copy beside each
#: gather) and zero.Init's F.linear that saves every frozen linear's input
#: (TrainingConfig.zero3_linear_saves_input), with GT070's script's lora_dropout 0.1 amended
#: (dev2_causes.py ``_PEFT_DS_ZERO3_OFFLOAD``): GT070 -65.7 -> +3.3%; GT176 -7.8 -> -6.2% (the
#: pool counts the packed 4-bit storage's elements); GT174 +4.5 -> +5.7% (its pool of 1e9
#: elements against one 70B layer and a 5e7 bucket before).
#: Re-recorded for torchtune < 0.3's build (Note [torchtune's cloned layer at load]: one
#: decoder layer built on the GPU and deep-copied per layer, freed when the builder returns,
#: its blocks left in the cache; the load peak 13.89 GB for GT030's config, the tutorial's init
#: log 13.96 GB with the per-layer RoPE caches): the single-device rows' step lands otherwise in
#: the cache: GT030 -15.0 -> -15.9%, GT031 -0.5 -> -1.4%, GT033 / GT034 / GT035 -6.2 / -6.7 /
#: -6.1 -> -7.2 / -7.2 / -7.0%, GT036 -6.3 -> -6.0%, GT038 +3.6 -> +3.8%, GT040 -7.0 -> -6.4%
#: (a verified mechanism, not loosened to pass: these rows' remaining cause is unchanged).
#: Re-recorded for transformers 4.48 GPT-BigCode's returned presents under checkpointing (each
#: layer's fused c_attn output kept by its ``present`` view until the loss;
#: attention.py ``returned_presents_bytes``): GT134 -11.8 -> +0.1%, GT135 -10.4 -> +1.1%, GT133
#: -1.2 -> +1.5%, GT132 unchanged.
#: Re-recorded for the peft docs' H100 rows read on their GPU (the CSV's gpu column; the reading
#: had no --gpu, so the replay ran without a capacity): GT175 +14.1 -> +5.5% (the allocator
#: frees its cache and retries near the card's capacity), GT174 +4.8 -> +5.4% (the H100's CUDA
#: context in its device total).
#: Re-recorded for FSDP1 frozen units under transformers 4's reentrant checkpointing (Note
#: [FSDP1 frozen units under reentrant checkpointing], analytic/transforms/fsdp1_reentrant.py:
#: FSDP1's reshard-only multi-grad hook on the recomputation's detached input keeps it and its
#: gradient until the final callback, 2 b s h per layer; run on the real FSDP1 on the CPU) and
#: for accelerate's MixedPrecision gathering the fp32 adapters in the compute dtype (peft's
#: input cast a no-op: analytic/lora.py ``adapter_matmul_bytes``), with the peft sft QLoRA FSDP
#: rows and philschmid's QLoRA amended with their scripts' use_reentrant=True: better GT154
#: -19.9 -> +0.8%, GT160 -17.3 -> +3.9%, GT177 -15.7 -> +5.3%, GT141 -5.6 -> +4.0%, GT143
#: -7.7 -> +3.5%, GT147 -3.4 -> +2.9%, GT149 -5.5 -> +1.1%, GT158 -5.9 -> +5.4%, GT175 +14.7
#: -> +6.0%; grew (the peak now the end of the layers' backward, its last layer's
#: recomputation as modelled: dev2_causes.py): GT156 -4.0 -> +6.3%, GT151 +3.7 -> +11.1%,
#: GT153 -4.2 -> +6.9%, GT144 +1.6 -> +5.3%, GT145 -1.6 -> +4.9%, GT178 -0.4 -> +11.2%, GT114
#: -5.3 -> -10.0% (approximate source value); median 3.6%, p90 13.8 -> 11.6%, 12 -> 9 under
#: (10.9% and 6 with the session's other rules).
#: Re-recorded for torchtune's custom_sharded_layers (Note [FSDP embedding and head units]:
#: 70B_full.yaml @30b8519e wraps tok_embeddings and output as FSDP2 units of their own,
#: resharded after forward; dev2_causes.py ``_TORCHTUNE_OWN_UNITS``): GT025 +36.7 -> +22.6%;
#: no other row moved. Then the output unit's unsharded gradient until its post-backward (the
#: same Note; the chunked head's weight-gradient peak holds it beside the next chunk's and
#: their sum): GT025 +22.6 -> +36.6% (16.42 GB allocated: above the README's 14.93 GB at the
#: stated settings, dev2_causes.py); no other row moved.
#: Re-recorded for a quantized MoE base's dequantized weight one expert linear at a time
#: (Note [Dequantized expert weights]: transformers 4.48 Mixtral experts are separate
#: Linear4bit modules, 2 x 14,336 x 4,096 B each, not the 3-D parameter of all 8): GT150 +1.7 ->
#: -0.1%, GT151 +11.1 -> +3.5%, GT153 +6.9 -> +2.2%; no other row moved.
#: Re-recorded for FSDP1's unshard stream pool (Note [FSDP1 unshard stream pool],
#: analytic/transforms/sharding.py ``fsdp1_unshard_pool_units``: torch 2.2.2 FSDP1 allocates every
#: unit's unsharded flat parameter on its unshard stream; with its defaults (BACKWARD_PRE,
#: limit_all_gathers) that pool holds the root's and two layer units' (adapters as units:
#: torchtune's LoRA recipe) or three (trainable layer units: torchtune's full recipe, one freed
#: block pending on the compute stream); the order checked on torch's FSDP1 on the CPU;
#: torchtune before 0.3): GT032 -11.5 -> -9.7%; over, by the third block, GT041 +3.0 -> +8.9%
#: (24.1 GB on a 24 GB RTX 4090; the reading has no --gpu: on the card's capacity -2.0%), GT043
#: +12.9 -> +15.3% (its README sequence length, dev2_causes.py); GT029 unchanged. Under by
#: > 10% 7 -> 6.
#: Re-recorded for FSDP1's unshard stream pool in fsdp_qlora too (Note [FSDP1 unshard stream
#: pool]: train.py 50efa1e runs torch 2.2's FSDP1 with limit_all_gathers, BACKWARD_PRE and each
#: LoRA leaf a unit: the root's and two layer units' gathers on the unshard stream, none on the
#: default stream): better GT115 -16.4 -> -4.4%, GT117 -6.9 -> -2.1%, GT118 -4.3 -> -1.9%, GT126
#: -0.7 -> -0.6%; grew, by the same pool (the gathers no longer sit in the default stream's
#: cache, whose blocks are the modelled load's; dev2_causes.py ``_FSDP1_STREAMS``): GT116 -1.9 ->
#: -4.0%, GT119 +0.4 -> -4.9%, GT120 -2.6 -> -2.7%, GT121 -1.3 -> -3.1%, GT122 -5.2 -> -7.5%,
#: GT125 -4.6 -> -6.4%, GT127 -6.8 -> -8.4%, GT128 -4.4 -> -12.2%, GT129 -20.5 -> -22.5%, GT130 /
#: GT131 -0.8 -> -3.5%. Under by > 10%: 6 (GT115 out, GT128 in).
#: Re-recorded for NCCL on boards without peer access (Note [NCCL without peer access],
#: analytic/buffers.py; GPUSpec.peer_access: GeForce boards over PCIe cannot map each other's
#: memory, so NCCL v2.19.3's shm transport keeps the buffers in host shared memory), with the
#: fsdp_qlora QLoRA rows read with their bitsandbytes 0.43.0 (README 47c1722 "pip install
#: bitsandbytes>=0.43.0", benchmarks "done in February and March 2024"; MatMul4Bit keeps its
#: 16-bit input before 9e753741, PR #1270, 2024-07-16; dev2_causes.py ``_FSDP_QLORA_BNB``): the
#: 2 x RTX 3090 / 4090 rows' replay capacity is total_memory less the 500 MiB context, no
#: longer also the A100's 544 MiB pair communicator (GT128 measured 22.98 GiB reserved, above
#: the old 22.67 GiB capacity). GT119 -4.1 -> -2.1%, GT120 -2.0 -> +1.5%, GT123 -0.6 -> +2.2%,
#: GT127 -7.7 -> -6.3%, GT128 -10.9 -> -8.2%, GT129 -20.0 -> -17.4%, GT130 / GT131 -2.7 ->
#: +1.9%; grew, GT126 -2.0 -> -8.9% (batch 12 on a 4090: its replay meets the card's capacity
#: at the fp32 loss gradient, 2.93 GiB, with 20.39 GiB reserved, frees its cache and never
#: rises again; the bitsandbytes input changes the order of the allocations before it, not the
#: allocated peak, 15.87 GiB either way; dev2_causes.py). Alone, the capacity moved only GT120
#: (-2.0 -> +10.6%: the replay filled the card under bitsandbytes >= 0.43.2's order), and
#: bitsandbytes 0.43.0 alone put GT130 / GT131 at -11.1%. Under by > 10%: 6 -> 5 (GT128 out).
#: Re-recorded for the LM head's autocast copy (analytic/head.py): none for a head already in
#: 16 bits (a quantized base loaded in fp16 under AMP, TrainingConfig.kbit_16bit_dense;
#: aten autocast_mode.cpp ``cached_cast`` casts only another dtype) or a quantized head; found
#: by the generic path (QLoRA without peft's upcast on a 1024-wide Qwen2: -2.2 -> 0.000 %
#: generic vs formulas): GT155 +1.2 -> -0.4%, GT157 +0.5 -> -0.5% (Mistral-7B GPTQ, fp16).
#: Re-recorded for autocast's input copies (activation_shapes.autocast_casts_layer_inputs):
#: none where the norms' output already is 16-bit (kbit_16bit_dense), so q / k / v and gate /
#: up save one tensor; found by the generic path (GPTQ + LoRA on a 1024-wide Qwen2: -5.4 ->
#: 0.000 % generic vs formulas): GT159 +4.3 -> +3.1%.
#: Re-recorded for Note [Chunked head's first weight-gradient sum] (analytic/schedule.py,
#: traced: tests/trace/test_chunked_loss_compiled.py -0.004 %): at the head weight gradients'
#: first sum N - 2 chunks' logits gradients are alive, not N - 1, beside the head's input and
#: the final norm's bf16 normalised tensor (eager beside torchtune's compiled loss): the
#: torchtune compiled chunked-loss rows GT013 -4.1 -> -4.5 %, GT015 +0.4 -> -0.4 %, GT016
#: +0.6 -> -0.3 %, GT017 -8.8 -> -10.0 % (its own under-count, the 8-bit optimizer's, larger).
#: Re-recorded for Note [torchao gradient offload] (analytic/transforms/offload.py, and the
#: traced rewrite, traced_options.py: torchao's CPUOffloadOptimizer(offload_gradients=True)
#: frees each gradient in its post-accumulate-grad hook, as soon as it is made, not once the
#: layer's are all made): GT169, the row that runs it (DINOv2-giant, timm, bf16-true), +0.2 ->
#: -0.9 %, now beside its siblings without gradient offload, GT167 -0.9 % (none) and GT168
#: -0.8 % (optimizer offload): the +0.2 % was the layer's held gradients. No other row moves.
#: Re-recorded for Note [DeepSpeed's flat buffers at init] (analytic/transforms/
#: deepspeed_init.py: the trainable partitions, their fp32 partitions and optimizer states and
#: ZeRO-3's gradient partitions in DeepSpeed's flat blocks, made at init, where one block per
#: tensor was made at the first step): allocated peaks unchanged; GT176 (ZeRO-3 QLoRA over 2
#: ranks; 0.14.0 at its 2024-03 date answers as the default release) -5.7 -> -7.4%: the same
#: allocated peak, 0.56 GB less reserved, the per-tensor blocks of its 1,120 LoRA tensors
#: (partition, gradient, states: 3,360 blocks of 64 KB to 1.4 MB) now five flat blocks;
#: GT174 +5.8 -> +5.7%. The under-estimate it widens is not explained here.
#: Re-recorded for ZeRO-3's gathers on the all-gather stream (Note [DeepSpeed ZeRO-3 parameter
#: gathers]: with overlap_comm, DeepSpeed's default at stage 3, parameter_offload.py makes the
#: coordinator's all-gather stream its own CUDA stream, and the gathered buffers come from that
#: stream's pool, which the default stream never reuses): allocated peaks unchanged, reserved
#: up by the gathers' own segments; GT176 (ZeRO-3 QLoRA x2) -7.4 -> -2.9%, GT174 (ZeRO-3
#: LoRA x8, '64 GB (80%)' read off a screenshot, low confidence) +5.8 -> +7.3%.
RECORDED_DEV2 = {
    "GT011": -0.0346,
    "GT012": -0.0367,
    "GT013": -0.0452,
    "GT014": -0.0021,
    "GT015": -0.0043,
    "GT016": -0.0030,
    "GT017": -0.0997,
    "GT018": +0.0410,
    "GT019": +0.0768,
    "GT020": +0.1026,
    "GT022": +0.0888,
    "GT024": +0.1357,
    "GT025": +0.3711,
    "GT026": +0.1117,
    # session 17: the replay's reserved -0.36 GB (allocated unchanged) with the forward's
    # dequantized weight also at the down projection (Note [Forward tensors held at the down
    # projection]: torchao's NF4 decode made there too)
    "GT027": +0.0988,
    "GT028": -0.0990,
    "GT029": -0.3236,
    # session 18 (helper rows030): the README's 17.18 GB is of 2024-03-21 (a95c6b93), when
    # torchtune's alpaca had no max_seq_len; amended to alpaca-cleaned's longest sample, 1585
    # tokens, and no gradient accumulation (dev2_causes.py ``_TT_MARCH_UNTRUNCATED``)
    "GT030": -0.0159,
    "GT031": -0.0104,
    "GT032": -0.0684,
    "GT033": -0.0673,
    "GT034": -0.0689,
    "GT035": -0.0658,
    "GT036": -0.0589,
    "GT037": +0.0242,
    "GT038": +0.0354,
    "GT039": +2.3576,
    "GT040": -0.0721,
    "GT041": +0.0856,
    "GT042": +1.4385,
    "GT043": +0.1992,
    "GT044": -0.0288,
    "GT045": -0.0311,
    "GT046": -0.0361,
    "GT047": -0.0856,
    "GT048": -0.0889,
    "GT049": -0.0867,
    "GT050": -0.0921,
    "GT051": -0.0253,
    "GT052": -0.0342,
    "GT053": -0.0403,
    "GT054": -0.0406,
    "GT055": +0.0205,
    "GT056": -0.0680,
    "GT057": +0.0851,
    "GT058": +0.0203,
    "GT059": +0.0123,
    "GT060": -0.0035,
    "GT061": -0.0951,
    "GT062": -0.0550,
    "GT063": -0.0587,
    "GT069": +0.0347,  # +1.7 -> +3.5 %: the script's own loop (--loop previous), dropout 0.1
    "GT070": +0.0613,  # +3.3 -> +6.1 %: the same loop holds the fp32 logits (514 MB)
    "GT097": -0.0011,
    "GT098": -0.0102,
    "GT099": -0.0016,
    "GT100": -0.0148,
    "GT101": -0.0007,
    "GT102": -0.0083,
    "GT103": -0.0078,
    "GT104": -0.0154,
    "GT105": -0.0007,
    "GT106": -0.0123,
    "GT107": +0.0235,
    "GT108": -0.0035,
    "GT109": +0.0015,
    "GT110": -0.0013,
    "GT111": +0.0167,
    "GT112": -0.0061,
    "GT113": -0.0050,
    "GT114": -0.0535,  # the notebook's pinned versions (dev2_causes.py _PHILSCHMID_DQ)
    "GT115": -0.0932,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT116": -0.0395,
    "GT117": -0.0448,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT118": -0.0191,
    "GT119": -0.0070,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT120": +0.0152,
    "GT121": -0.0277,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT122": -0.0354,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT123": +0.0219,
    "GT124": +0.0205,
    "GT125": -0.0383,
    "GT126": -0.0891,
    "GT127": -0.0174,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT128": -0.0644,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT129": -0.1443,  # one-tensor broadcast buckets are views (load.py _fsdp1_unit)
    "GT130": +0.0189,
    "GT131": +0.0189,
    "GT132": +0.0002,
    "GT133": +0.0146,
    "GT134": +0.0008,
    "GT135": +0.0114,
    "GT136": -0.0000,
    "GT137": -0.0000,
    "GT138": -0.0000,
    "GT139": -0.0000,
    "GT140": -0.0051,
    "GT141": +0.0223,
    "GT142": -0.0070,
    "GT143": +0.0307,
    "GT144": +0.0200,
    "GT145": +0.0082,
    "GT146": +0.0066,
    "GT147": +0.0072,
    "GT148": +0.0072,
    "GT149": +0.0085,
    "GT150": -0.0070,
    "GT151": -0.0055,
    "GT152": -0.0037,
    "GT153": -0.0038,
    "GT154": +0.0029,
    "GT155": -0.0082,
    "GT156": +0.0073,
    "GT157": -0.0095,
    "GT158": +0.0085,
    "GT159": +0.0267,
    "GT160": +0.0291,
    "GT161": +0.0356,
    "GT162": -0.0136,
    "GT163": -0.0163,
    "GT167": -0.0086,
    "GT168": -0.0076,
    "GT169": -0.0087,
    "GT170": +0.0570,
    "GT172": -0.0007,
    "GT173": -0.0570,
    "GT174": +0.0731,
    "GT175": +0.0367,
    "GT176": -0.0289,
    "GT177": +0.0942,
    "GT178": +0.1343,
    "GT179": +0.0205,
    "GT180": +0.0175,
    "GT181": +0.0078,
    "GT182": -0.0491,
    "GT183": +0.0024,
    "GT184": -0.0023,
    "GT188": +0.0056,
    "GT189": -0.0005,
}
# Re-recorded for LoRA's first layer (as above, the same rule): the litgpt rows GT097-GT113
# (LoRA / QLoRA; bnb 0.42's MatMul4Bit saves its input) move down 0.1-0.9 points (GT104 -4.2 ->
# -4.7 %, GT106 -3.6 -> -4.5 %, the largest), GT029 / GT070 by < 0.2, GT039 +231.4 -> +230.1 %;
# median 3.6 %, p90 14.4 %, 12 under: unchanged.
# Re-recorded for DTensor sequence parallelism's collective copies (Note [Sequence-parallel
# collectives' copies], analytic/activation_parallelism.py: funcol's all-gather along the
# sequence cats its dimension-0 output into a second tensor, its reduce-scatter copies the
# row-parallel partial sum before the collective); the torchtitan rows' replay now carves the
# checkpointed layer outputs from the copies' freed blocks as the trace does (GT054: 71.2 GiB
# reserved, the trace 72.1, measured 71.9): GT054 +12.6 -> -0.9 %, GT055 +19.7 -> +5.4 %,
# GT057 +10.2 -> +7.2 %, GT058 +3.9 -> +2.9 %, GT059 +3.1 -> +2.1 %, GT060 +1.5 -> +0.5 %;
# lower by the same copies, GT056 -5.3 -> -7.9 %, GT061 -7.9 -> -8.7 % (the pipeline and
# context-parallel rows); median 3.6 -> 3.5 %, p90 13.8 -> 12.4 %, 12 under: unchanged.
# Re-recorded for the head's saved tensors as the tensors they are (analytic/schedule.py Note
# [Analytic step schedule]: the final norm's, the LM head's input, the loss's log-softmax and
# autocast's head-weight copy, one block each instead of their sum, whose single (tokens x
# vocab)-sized block took a segment no later tensor fitted) and the LM head's sequence-parallel
# gather (Note [Sequence-parallel collectives' copies]): reserved falls where that block
# fragmented the cache, GT024 +12.4 -> +11.6 %, GT026 +13.8 -> +13.3 %, GT043 +14.4 -> +12.9 %,
# GT055 +5.4 -> +1.7 %, GT062 -8.8 -> -5.5 %, GT063 -9.2 -> -5.9 %, GT116 -5.9 -> -1.9 %, the
# torchtune rows GT020-GT027 by 0.3-1.3 points; lower by the same, GT054 -0.9 -> -4.4 %, GT037
# -0.7 -> -1.8 %, GT040 -6.4 -> -7.5 %, GT047-GT050 by 0.9, the FSDP QLoRA rows GT120-GT131 by
# 0.3-1.7, GT129 -22.9 -> -23.8 %, GT177 -15.7 -> -16.4 %, GT039 +230.1 -> +235.8 %; dev set 1's
# GPT-2 rows GT072 +7.2 -> +2.2 %, GT074 +2.8 -> +1.3 % (median 1.8 -> 1.5 %); dev set 2 p90
# down by 0.6 points (12.4 -> 11.8 % at the time), the count under unchanged.
# Re-recorded for FSDP1 CPU offload's shard copy on the pre-unshard stream (Note [FSDP1
# offloaded shard copy], analytic/transforms/sharding.py; fsdp_qlora train.py 50efa1e with
# CPUOffload(offload_params=True), torch 2.2 _flat_param.py ``pre_unshard``): the fsdp_qlora
# CPU-offload rows, GT129 -23.8 -> -20.5 %, GT128 -8.1 -> -4.4 %, GT125 -5.7 -> -4.6 %, GT126
# -1.8 -> -0.7 %, GT130 / GT131 -1.9 -> -0.8 %; no other row moves.
# Re-recorded for compiled casts (Note [Compiled casts are computed once], analytic/
# activation_shapes.py; torch/_functorch/partitioners.py runs fx_graph_cse before the min-cut
# partition): under --compile autocast's copies of one norm output for q, k and v are one saved
# tensor, GT162 +3.5 -> -0.6 %, GT163 +3.6 -> -0.8 % (timm ViT-H/14 compiled); no other row moves.
# Re-recorded for two rules checked against the generic path's trace of the real code (issue
# 26): Note [Frozen down projection's input] (analytic/lora.py: with down frozen its input, the
# product, is what goes; gate's, act's and up's outputs stay through the MLP's backward
# transients) and ``first_norm_saves_its_input`` (analytic/transforms/checkpointing.py: under
# full checkpointing on a 16-bit residual stream the first RMSNorm's x.to(float32) is a copy
# the recomputation makes again). Better: GT026 +13.3 -> +11.2 %, GT122 -7.5 -> -4.7 %, GT125
# -6.4 -> -3.8 %, GT128 -12.2 -> -10.9 %, GT129 -22.5 -> -19.9 %, GT114 -10.4 -> -9.9 %, GT177
# +10.6 -> +8.6 %, GT178 +14.1 -> +13.0 %, GT056 -7.9 -> -6.8 %, GT058-GT060 0.8-0.9 points and
# about twenty rows by 0.1-1 point; grew, by the same rules: the fms-hf-tuning FSDP1 LoRA rows
# GT141 / GT143 / GT147 / GT149 / GT154 +4.0 / +3.5 / +2.9 / +1.1 / +0.8 -> +6.0 / +6.3 / +6.1
# / +4.9 / +2.1 % (already over: another over-count there, not found), GT024 +11.6 -> +13.6 %,
# GT057 +7.2 -> +8.5 %, GT061 -8.7 -> -9.5 %, GT124 +1.0 -> +2.1 %, GT126 -0.6 -> -2.0 %,
# GT042 +128 -> +133 %, and GT037 -1.8 -> -10.4 % (reserved only: its allocated peak, at the
# forward's head, is unchanged; see its cause). Median 3.2 -> 3.3 %, p90 10.4 -> 10.3 %, under
# by >10 % 6 (GT037 in, GT114 out).
# Re-recorded for accelerate's FSDP1 (accelerate-fsdp, the HF Trainer's --fsdp), two rules
# checked on torch's FSDP1 on the CPU: Note [FSDP1 backward prefetch under adapter units]
# (analytic/transforms/fsdp.py: with each LoRA leaf a unit, layer i is prefetched from layer
# i + 1's attention backward, so the MLP's backward runs with one layer gathered), the
# fms-hf-tuning FSDP1 LoRA rows GT141 / GT143 / GT144 / GT145 / GT147 / GT149 / GT151 / GT153
# / GT154 / GT156 / GT158 / GT160 +6.0 / +6.3 / +5.4 / +5.1 / +6.1 / +4.9 / +3.8 / +2.7 / +2.1
# / +7.0 / +6.2 / +4.2 -> +3.1 / +4.3 / +1.9 / +0.6 / +4.9 / +4.2 / +0.4 / +0.1 / +1.1 / +5.8
# / +5.5 / +3.2 %; and Note [FSDP1 unshard stream pool] applied to accelerate-fsdp (accelerate's
# plugin: limit_all_gathers=True, the rows' configs BACKWARD_PRE): GT175 +6.1 -> +3.7 %
# (reserved). GT114 / GT177 / GT178 unchanged (reserved to the byte; GT114's allocated peak
# 15.20 -> 14.80 GiB). Median 3.2 -> 3.0 %, p90 9.9 % and 5 under unchanged.
# Re-recorded for lit-gpt's quantized LM head and Lightning's fp16 quantization (above, dev set
# 1): the litgpt config-hub QLoRA rows, the head alone -1.3 / -2.8 / -1.1 / -5.6 / -6.0 / -4.4 %,
# with the fp16 copy GT098 +0.1 -> -1.0 %, GT100 +1.5 -> -1.5 %, GT102 +0.2 -> -0.8 %, GT104
# -1.1 -> -1.5 %, GT106 -0.3 -> -1.2 %, GT109 +2.2 -> +0.2 %; median 3.0 %, p90 10.0 %, 5 under.
# Re-recorded for each weight's gradient made where its linear's backward runs, each autocast
# weight copy freed with its linear, the recomputed copies too, LoRA's frozen weights' copies
# made again by the recompute (Note [Gradients where their linear's backward runs],
# analytic/schedule.py; session 15, issue 26; the formulas were 13-16 % over the generic path's
# trace on a 2048-wide Llama whose peak is a layer's backward, now within 0.5 %): the vision
# rows, whose peak is the last block's backward, move down toward the trace (GT162's formulas
# +1.1 -> +0.3 % over its trace, GT168's +1.3 -> +0.4 %): GT162 -0.6 -> -1.4 %, GT163 -0.8 ->
# -1.6 %, GT167 -0.4 -> -0.9 %, GT168 +0.1 -> -0.8 %; GT014 +0.4 -> -0.2 %; reserved only
# (allocated to the byte), the torchvision ViT-L rows, whose backward now reuses the blocks its
# freed activations leave for the gradients as autograd's order has it: GT182 -3.0 -> -4.9 %
# (111 MB fewer reserved), GT183 +1.6 -> +0.2 %, GT184 -0.9 -> -1.3 %. Median 3.0 -> 3.1 %,
# p90 10.0 % and 5 under unchanged. Then a later micro-batch's new gradient before it is added
# into the kept one (``_accumulated``): GT184 -1.3 -> -0.2 %.
# Re-recorded for FSDP1's flat blocks (Note [FSDP1 flat blocks of a layer unit], analytic/
# transforms/base.py: with use_orig_params=False a layer unit's sharded parameters, gradient and
# each Adam state are one flat tensor each, as torch's FSDP1 traced on fake tensors keeps them;
# the formulas held one block per tensor): the torchtune 2024 FSDP1 full fine-tunes reserve
# less, their per-tensor shards (Llama-2-7B's q / k / v / o, 8.4 MB on 4 ranks) no longer
# leaving 20 MiB segments part empty: GT032 -9.7 -> -11.2 % (333 MB; under by > 10 %: 5 -> 6,
# p90 10.0 -> 10.3 %, GT032 alone; its own gap is the unexplained rest its cause names),
# GT041 +8.8 -> +8.6 %, GT043 +15.7 -> +15.9 %; no other row moves (LoRA units, the HF
# Trainer's use_orig_params=True and FSDP2 keep per-tensor blocks).
# Re-recorded for Note [The current micro-batch's bound output] (analytic/transforms/loop.py,
# traced: tests/analytic/test_bound_output.py): the ``previous`` loop binds each micro-batch's
# output through its own backward and the last one's through the optimizer step, the returned
# KV cache with it (the torchtune rows amended to ``--loop previous``: their Apr-May 2024
# recipes bind ``logits`` at loop scope, the transposed fp32 copy, until cb3ed29d / 8a98fbaa
# deleted it): reserved GT030 -15.9 -> -15.5 %, GT031 -1.5 -> -1.0 %, GT032 -11.2 -> -10.6 %,
# GT033 / GT034 / GT035 / GT036 -7.2 / -7.3 / -7.0 / -6.3 -> -6.7 / -6.9 / -6.6 / -5.9 %,
# GT037 -10.4 -> +2.4 % (its step's blocks land in the load's cache segments again, the one
# 1 GB segment its cause names); allocated GT172 -2.9 -> -0.1 %, GT173 -11.5 -> -5.7 % (the
# peak is the head's: the held logits beside the backward's first transients); grew, by the
# same held logits, the rows whose stated 'Seq Length 4096' over-counts them already
# (dev2_causes.py ``_SEQ_70B``): GT042 +133.2 -> +143.8 %, GT043 +15.9 -> +19.9 %. Under by
# > 10 %: 6 -> 4 (GT037, GT173 out); median 3.1 -> 2.9 %, p90 10.3 -> 9.9 %.
# Re-recorded for op-level selective checkpointing's recompute as the tensors it is, each freed
# where its consumer's backward runs, autocast's weight copies no longer counted twice (Note
# [Op-level selective recompute per tensor], analytic/transforms/checkpointing.py; session 15,
# issue 26): the eager SAC torchtitan rows, reserved only, GT044 -2.9 -> -3.4 %, GT051 -2.5 ->
# -3.1 % (within ROW_SLACK, their records kept); compiled rows unchanged (the compiled region
# keeps its one block). Both sat just under the median, where the sorted errors jump from
# 2.4 to 3.1 %: median 2.9 -> 3.11 % from these two rows alone (p90 9.9 %, 4 under unchanged).
# Re-recorded for fsdp_qlora's loop (FrameworkConventions.loop ``step``: train.py e4968fd /
# 50efa1e binds ``output = model(...)`` until after ``optimizer.step()``, so the bf16 logits
# live through the backward; tests/analytic/test_fsdp_qlora_framework.py): GT129 -17.4 ->
# -15.6 % (its peak is in the layers' backward); no other row moves (GT115-GT128, GT130 /
# GT131 peak at the loss or meet the card's capacity first).
# Re-recorded for FSDP1's root unit as one flat parameter (Note [FSDP1 flat gradient of the
# root], analytic/transforms/fsdp.py; torch's FSDP1 traced on fake tensors, session 16, issue
# 26): with use_orig_params=False the head's and the embedding's gradients are unsharded views'
# gradients until the root's post-backward concatenates and reduce-scatters them, so the head's
# 262 MB bf16 gradient (Llama-2-7B) is alive through the whole layer stack's backward where the
# formulas held its 66 MB fp32 shard; and the unshard pool's third block starts after the first
# backward layer's reduce-scatter (the block it ran on becomes the pending one), not before it.
# GT032 -10.6 -> -6.8 % (the torchtune Apr 2024 full fine-tune); no other row moves (GT041 /
# GT043 peak elsewhere). Under by > 10 %: 4 -> 3 (GT032 out).
# Re-recorded for each layer's rotary tables under transformers before 4.41 (Llama) / 4.42
# (Mistral) (analytic/buffers.py ``layer_rope_cache_bytes``: a cos and a sin buffer of
# (max_position_embeddings, head_dim) per attention layer, tests/analytic/test_layer_rope_cache.py)
# with GT114's base amended to Meta-Llama-3-70B's 8192 positions (dev2_causes.py
# ``_LLAMA3_70B``): GT114 -6.9 -> -5.4 % (transformers 4.40.0, bf16 tables: 335 MB); no other
# row runs such a release.
# Re-recorded for the fms-acceleration FSDP1 QLoRA / GPTQ rows loaded in the 16-bit dtype
# (session 17, issue 26; TrainingConfig.kbit_16bit_dense under accelerate's native_amp: the
# plugins' model_loader loads the base in torch_dtype, bf16 for --bf16, fp16 for GPTQ, and
# accelerate-fsdp runs no prepare_model_for_kbit_training, so embeddings, norms and head are
# 16-bit shards, not fp32), with GPTQ's scales and g_idx whole on every rank (fms-acceleration
# autogptq_utils.py views only qweight / qzeros as FSDP Parameters:
# specs/quantization.py ``unflattened_quantized_bytes``): GT147 +4.9 -> +2.1 %, GT149 +4.2 ->
# +2.5 %, GT151 +0.4 -> -0.9 %, GT153 +0.1 -> -0.9 %, GT154 +1.1 -> +0.0 %, GT156 +5.8 ->
# +3.6 %, GT158 +5.5 -> +4.2 %, GT160 +3.2 -> +3.2 % (Llama-2-70B: 1.07 GB of scales whole,
# not halved, against the fp16 embedding and head); no other row moves.
# Re-recorded for torch's reentrant checkpoint holding the recomputed layer's output through
# the layer's backward (Note [Reentrant checkpoint's recomputed output],
# analytic/transforms/reentrant.py: CheckpointFunction.backward binds ``outputs`` until its
# ``torch.autograd.backward`` returns; measured on torch 2.13's own checkpoint on the CPU, a
# 4-layer Llama, each layer's backward peak r b s h above non-reentrant's; the fms rows run
# transformers 4.48.1's default use_reentrant=True, fms-acceleration scripts/benchmarks set no
# gradient_checkpointing_kwargs): the fms-hf-tuning rows only, GT141 +3.1 -> +3.6 %, GT143
# +4.3 -> +4.9 %, GT144 +1.9 -> +2.0 %, GT145 +0.6 -> +0.8 %, GT147 +2.1 -> +2.9 %, GT149 +2.5
# -> +3.4 %, GT150 -0.1 -> +0.5 %, GT151 -0.9 -> -0.6 %, GT152 -0.4 -> +0.5 %, GT153 -0.9 ->
# -0.4 %, GT154 +0.0 -> +0.3 %, GT156 +2.2 -> +2.9 %, GT158 +2.5 -> +3.4 %, GT159 +2.3 -> +2.7
# %, GT160 +2.6 -> +2.9 % (one b s h tensor each at the layers' backward peak); GT129's
# reserved peak unmoved. Median 2.52 -> 2.86 % (these rows sit at it), p90 and under unchanged.
# Re-recorded for flash-attn 2 getting no sliding-window mask (analytic/attention.py
# ``sliding_mask_applies``; transformers 4.48 modeling_mistral.py
# ``MistralModel._update_causal_mask`` returns None under flash_attention_2 without padding,
# the window goes to the kernel): the fms-hf-tuning Mistral-7B-v0.1 rows at s = 4096 = the
# window lose a recomputed layer's 168 MB bias and expanded k / v and the checkpoint's 34 MB
# boolean mask: GT141 +3.6 -> +2.2 %, GT143 +4.9 -> +3.1 %, GT146 +4.8 -> +4.5 %, GT147 +2.9 ->
# +0.7 %, GT148 +3.2 -> +2.8 %, GT149 +3.4 -> +0.8 %, GT156 +2.9 -> +0.7 %, GT158 +3.4 -> +0.8 %;
# the 1-GPU rows 0.3-0.5 point lower (GT140 -0.5, GT142 -0.7, GT155 -0.8, GT157 -0.9 %); no other
# row moves (dev set 1 neither). Median 2.86 -> 2.35 %.
# Re-recorded for the FSDP1 kept inputs gated on transformers < 4.52 (Note [FSDP1 frozen units
# under reentrant checkpointing]: from 4.52 GradientCheckpointingLayer checkpoints inside the
# unit) and GT177 / GT178 amended with --transformers-version 4.39 (peft examples/sft installs
# transformers' main, 4.39.0.dev0 on PR #1550's date), which keeps the kept inputs and adds
# 4.39's fp32 logits and per-layer rotary tables: GT177 +8.6 -> +9.4 %, GT178 +13.0 -> +13.4 %
# (without the amendment the gate alone would give -23.8 / -4.9 %). No other row moves.
# Re-recorded for TRL's SFTTrainer casting the embeddings and LM head back to bf16 after peft's
# fp32 upcast (TrainingConfig.trl_bf16_embeddings; trl v0.13.0 peft_module_casting_to_bf16,
# the fms rows' trl==0.13.0, amended --trl-version 0.13.0; session 23, helper rows24): the
# one-GPU baseline-peft-bnb rows only, GT146 +4.5 -> +0.7 %, GT148 +2.8 -> +0.7 %, GT150 +0.5 ->
# -0.7 %, GT152 +0.5 -> -0.4 % (6 V h B each: two 2 V h parameters and the head's autocast
# copy); the FSDP rows' base is sharded (TRL's is_sharded_qlora), unmoved. Median 2.2 -> 2.1 %.
MIN_DEV2_ROWS_SCORED = 139
# GPTQ rows GT156 / GT158 / GT159 / GT160 re-recorded (session 17, issue 26): GPTQ's triton v2
# kernel saves no input (TrainingConfig.quantized_matmul_saves_input), -0.8 to -1.7 points each;
# the median 3.07 -> 2.52 % (they sat at it), the bound tightened to 2.6 %.
MAX_DEV2_MEDIAN_ABS = 0.023  # 2.23 % at 2026-11-28 14:50 UTC (GT030 dated to its untruncated
# March 2024 data crosses the median); 2.35 % at 12:05 UTC (flash-attn 2's sliding window,
# above); 2.86 % at 11:10 UTC (the reentrant checkpoint's held output, above); 2.52 % at
# 10:55 UTC; 3.07 % at 10:20 (the fms FSDP1 rows' 16-bit dense weights, above; 3.12 % at
# 05:40 UTC: GT044 / GT051, op-level SAC; GT069 / GT070 amended with their script's loop,
# --loop previous, cross the median)
MAX_DEV2_P90_ABS = 0.095  # 9.42 % at 2026-11-28 17:15 UTC (GT177, the p90 row, dated to
# transformers 4.39: +8.6 -> +9.4 %, above); 9.32 % at 14:50 UTC (GT030 out of the top
# decile); 9.9 % at 05:25 UTC (the previous loop's bound output)
MAX_DEV2_UNDER = 2  # 2 at 2026-11-28 12:50 UTC: GT030 out (its March 2024 untruncated data);
# 3 at 07:00 UTC: GT032 out (FSDP1's root flat gradient)
MAX_DEV2_OOM = 0


@pytest.mark.skipif(not validate.DEV2_ARGS.exists(), reason="../shared is not beside the repo")
def test_dev2_accuracy_does_not_regress() -> None:
    rows = validate.load_dev2()
    results = validate.run_dev2(rows, with_as_read=False)
    errors = validate.dev2_errors(rows, results)
    summary = validate.summarize(errors)
    refused = {rid: r.refused for rid, r in results.items() if r.predicted is None}
    assert summary["n"] >= MIN_DEV2_ROWS_SCORED, refused
    assert summary["median_abs"] <= MAX_DEV2_MEDIAN_ABS, summary
    assert summary["p90_abs"] <= MAX_DEV2_P90_ABS, summary
    assert summary["under"] <= MAX_DEV2_UNDER, summary
    oom = sorted(rid for rid, r in results.items() if r.oom)
    assert len(oom) <= MAX_DEV2_OOM, f"completed runs predicted to run out of memory: {oom}"
    worse = {
        rid: (round(RECORDED_DEV2[rid], 4), round(e, 4))
        for rid, e in errors.items()
        if rid in RECORDED_DEV2 and abs(e) > abs(RECORDED_DEV2[rid]) + ROW_SLACK
    }
    assert not worse, f"dev-2 rows whose error grew (recorded, now): {worse}"
