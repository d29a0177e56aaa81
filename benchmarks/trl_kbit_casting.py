"""TRL's ``SFTTrainer`` preparation of a 4-bit base, run for real, against trainmem's rule.

``--trl-version`` / ``--framework trl`` (``TrainingConfig.trl_release``): TRL 0.9.3 .. 0.25,
given a ``peft_config`` and an unsharded 4-bit base under ``bf16=True``, leaves the embeddings
and the LM head in bf16 and the norms and LoRA adapters in fp32 after peft's fp32 upcast
(``prepare_model_for_kbit_training`` then ``peft_module_casting_to_bf16``;
``TrainingConfig.trl_bf16_embeddings``); from 0.26 it runs no preparation and casts every
trainable parameter to bf16 (``TrainingConfig.trl_bf16_adapters``), so the AdamW states made
at the first step are bf16 too, and from 0.27 it checkpoints non-reentrantly. This script runs
that very code on the CPU in a throwaway virtual environment (no GPU, no download: a tiny
random Llama and a word-level tokenizer built here), one optimizer step, and prints each
parameter group's dtype, the LoRA AdamW states' dtype and the checkpointing settings beside
what trainmem builds for the same configuration (the trace engine's model,
``trainmem.trace.hf_model.build_hf_training_model``; the analytic states' bytes per element,
``trainmem.analytic.tensor_states``; ``TrainingConfig.activation_checkpointing`` /
``hf_checkpoint_reentrant``).

The base stands for an unsharded 4-bit one as TRL sees it on one GPU: ``is_loaded_in_4bit`` is
set and no parameter is a ``Params4bit`` on the CPU or the meta device (TRL's
``is_sharded_qlora`` stays False); bitsandbytes' CUDA-only 4-bit layers are not needed for the
casts, which touch only the non-quantized parameters.

Usage::

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0 trl==0.13.0 transformers==4.48.1 \\
        peft==0.13.2 accelerate==1.0.1 datasets bitsandbytes
    python benchmarks/trl_kbit_casting.py --python /tmp/trl-venv/bin/python

Output at trl 0.13.0 / transformers 4.48.1 / peft 0.13.2 / accelerate 1.0.1 (session 23,
helper rows24; the states and checkpointing rows added in session 24, helper trl26)::

    trl 0.13.0, transformers 4.48.1
                          TRL (real)      trainmem
    params embed_tokens   bfloat16        bfloat16
    params lm_head        bfloat16        bfloat16
    params norm           float32         float32
    params lora_          float32         float32
    states lora_          float32         float32
    checkpointing         False           False
    use_reentrant         None            None

At trl 0.26.2 / transformers 4.57.6 and trl 1.16.0 / transformers 5.24.0 (peft 0.21.2,
accelerate 1.15.0, bitsandbytes 0.50.2 for the Trainer's parameter count; session 24, helper
trl26; ``pip install torch==2.13.0 trl==0.26.2 transformers==4.57.6 peft accelerate datasets
bitsandbytes``, and ``trl`` unpinned for 1.16.0)::

    trl 0.26.2, transformers 4.57.6
                          TRL (real)      trainmem
    params embed_tokens   bfloat16        bfloat16
    params lm_head        bfloat16        bfloat16
    params norm           bfloat16        bfloat16
    params lora_          bfloat16        bfloat16
    states lora_          bfloat16        bfloat16
    checkpointing         True            True
    use_reentrant         True            True

    trl 1.16.0, transformers 5.24.0
    (the same, but)
    use_reentrant         False           False
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GROUPS = ("embed_tokens", "lm_head", "norm", "lora_")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
}

REAL_RUN = r"""
import json, sys, tempfile
import torch, transformers
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

config = json.loads(sys.argv[1])
config.pop("architectures")
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
model.is_loaded_in_4bit = True  # an unsharded 4-bit base as TRL tells it
vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, "hello": 3, "world": 4}
words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
)
length = "max_length" if "max_length" in SFTConfig.__dataclass_fields__ else "max_seq_length"
args = SFTConfig(output_dir=tempfile.mkdtemp(), bf16=True, use_cpu=True, report_to=[],
                 per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                 **{length: 32})
trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                     train_dataset=Dataset.from_dict({"text": ["hello world"] * 4}),
                     peft_config=LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
def dtypes(named):
    groups = {}
    for name, tensor in named:
        for group in sys.argv[2].split(","):
            if group in name:
                groups.setdefault(group, set()).add(str(tensor.dtype).removeprefix("torch."))
    return {g: sorted(d) for g, d in groups.items()}
groups = dtypes(trainer.model.named_parameters())
trainer.train()  # one AdamW step: its states are made like the parameters
# what the layers checkpoint with: transformers' functools.partial(checkpoint, **kwargs)
funcs = [m._gradient_checkpointing_func for m in trainer.model.modules()
         if getattr(m, "gradient_checkpointing", False)
         and hasattr(m, "_gradient_checkpointing_func")]
checkpointing = bool(funcs)
kwargs = getattr(funcs[0], "keywords", {}) if funcs else {}
names = {id(p): n for n, p in trainer.model.named_parameters()}
states = [(names[id(p)], t) for p, st in trainer.optimizer.state.items() for t in st.values()
          if getattr(t, "dim", lambda: 0)() > 0]
print(json.dumps({"trl": __import__("trl").__version__, "groups": groups,
                  "transformers": transformers.__version__,
                  "states": dtypes(states).get("lora_", []), "checkpointing": checkpointing,
                  "use_reentrant": kwargs.get("use_reentrant")}))
"""


def real_run(python: str) -> dict[str, object]:
    """The real SFTTrainer's dtypes and checkpointing settings after one step (REAL_RUN)."""
    out = (
        subprocess.run(
            [python, "-c", REAL_RUN, json.dumps(TINY_LLAMA), ",".join(GROUPS)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    answer: dict[str, object] = json.loads(out)
    return answer


def trainmem_run(trl_version: str, transformers_version: str) -> dict[str, object]:
    """What trainmem builds for the same configuration: the trace engine's parameter dtypes,
    the analytic LoRA states' dtype (bytes per element), the checkpointing defaults."""
    from trainmem.analytic.tensor_states import tensor_states
    from trainmem.specs.hf import model_spec_from_hf
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(
        framework="trl",
        micro_batch_size=2,
        seq_len=32,
        lora_rank=16,
        lora_targets=("q", "v"),
        quantize_base="nf4",
        precision="bf16-mixed",
        trl_version=trl_version,
        transformers_version=transformers_version,
    )
    model = build_hf_training_model(TINY_LLAMA, training)
    groups: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        for group in GROUPS:
            if group in name:
                groups.setdefault(group, set()).add(str(param.dtype).removeprefix("torch."))
    spec = model_spec_from_hf(TINY_LLAMA, "tiny-llama")
    lora = [s for s in tensor_states(spec, training) if s.name.startswith("lora_")]
    per_element = {s.state_bytes // (2 * s.numel) for s in lora}  # AdamW: two states
    checkpointing = training.activation_checkpointing == "full"
    return {
        "trl": trl_version,
        "groups": {g: sorted(d) for g, d in groups.items()},
        "states": sorted({4: "float32", 2: "bfloat16"}[b] for b in per_element),
        "checkpointing": checkpointing,
        "use_reentrant": training.hf_checkpoint_reentrant if checkpointing else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="a venv's python with trl installed")
    args = parser.parse_args()
    real = real_run(args.python)
    ours = trainmem_run(str(real["trl"]), str(real["transformers"]))
    print(f"trl {real['trl']}, transformers {real['transformers']}")
    print(f"{'':22}{'TRL (real)':16}trainmem")
    rows = [f"params {g}" for g in GROUPS] + ["states lora_", "checkpointing", "use_reentrant"]
    same = True
    for row in rows:
        if row.startswith("params "):
            theirs = ",".join(real["groups"].get(row[7:], []))  # type: ignore[attr-defined]
            mine = ",".join(ours["groups"].get(row[7:], []))  # type: ignore[attr-defined]
        else:
            key = row.split()[0]
            theirs, mine = str(real[key]), str(ours[key])
            if key == "states":
                theirs, mine = ",".join(real[key]), ",".join(ours[key])  # type: ignore[arg-type]
        same = same and theirs == mine
        print(f"{row:22}{theirs:16}{mine}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
