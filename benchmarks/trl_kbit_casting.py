"""TRL's ``SFTTrainer`` preparation of a 4-bit base, run for real, against trainmem's rule.

``TrainingConfig.trl_bf16_embeddings`` (``--trl-version``) says that TRL 0.9.3 .. 0.25, given a
``peft_config`` and an unsharded 4-bit base under ``bf16=True``, leaves the embeddings and the
LM head in bf16 and the norms and LoRA adapters in fp32 after peft's fp32 upcast
(``prepare_model_for_kbit_training`` then ``peft_module_casting_to_bf16``). This script runs
that very code on the CPU in a throwaway virtual environment (no GPU, no download: a tiny
random Llama and a word-level tokenizer built here) and prints each parameter group's dtype
beside the dtypes trainmem's trace engine builds for the same configuration
(``trainmem.trace.hf_model.build_hf_training_model``).

The base stands for an unsharded 4-bit one as TRL sees it on one GPU: ``is_loaded_in_4bit`` is
set and no parameter is a ``Params4bit`` on the CPU or the meta device (TRL's
``is_sharded_qlora`` stays False); bitsandbytes' CUDA-only 4-bit layers are not needed for the
casts, which touch only the non-quantized parameters.

Usage::

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0 trl==0.13.0 transformers==4.48.1 \\
        peft==0.13.2 accelerate==1.0.1 datasets
    python benchmarks/trl_kbit_casting.py --python /tmp/trl-venv/bin/python

Output at trl 0.13.0 / transformers 4.48.1 / peft 0.13.2 (session 23, helper rows24)::

    trl 0.13.0
    group         TRL (real)      trainmem (trace)
    embed_tokens  bfloat16        bfloat16
    lm_head       bfloat16        bfloat16
    norm          float32         float32
    lora_         float32         float32
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
args = SFTConfig(output_dir=tempfile.mkdtemp(), bf16=True, use_cpu=True, report_to=[],
                 max_seq_length=32, per_device_train_batch_size=2)
trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                     train_dataset=Dataset.from_dict({"text": ["hello world"] * 4}),
                     peft_config=LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
groups = {}
for name, param in trainer.model.named_parameters():
    for group in sys.argv[2].split(","):
        if group in name:
            groups.setdefault(group, set()).add(str(param.dtype).removeprefix("torch."))
print(json.dumps({"trl": __import__("trl").__version__,
                  "groups": {g: sorted(d) for g, d in groups.items()}}))
"""


def real_groups(python: str) -> tuple[str, dict[str, list[str]]]:
    """The dtypes of each parameter group after the real SFTTrainer's preparation."""
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
    answer = json.loads(out)
    return answer["trl"], answer["groups"]


def trainmem_groups(trl_version: str) -> dict[str, list[str]]:
    """The dtypes trainmem's trace engine builds for the same configuration."""
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(
        framework="hf-trainer",
        micro_batch_size=2,
        seq_len=32,
        lora_rank=16,
        lora_targets=("q", "v"),
        quantize_base="nf4",
        precision="bf16-mixed",
        trl_version=trl_version,
    )
    model = build_hf_training_model(TINY_LLAMA, training)
    groups: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        for group in GROUPS:
            if group in name:
                groups.setdefault(group, set()).add(str(param.dtype).removeprefix("torch."))
    return {g: sorted(d) for g, d in groups.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="a venv's python with trl installed")
    args = parser.parse_args()
    version, real = real_groups(args.python)
    ours = trainmem_groups(version)
    print(f"trl {version}")
    print(f"{'group':14}{'TRL (real)':16}trainmem (trace)")
    for group in GROUPS:
        print(f"{group:14}{','.join(real.get(group, [])):16}{','.join(ours.get(group, []))}")
    return 0 if real == ours else 1


if __name__ == "__main__":
    sys.exit(main())
