"""The dtype ``from_pretrained`` / TRL's ``SFTTrainer(model=<path>)`` load a model in when no
dtype is given, run for real, against trainmem's default ``load_dtype``
(trainmem/specs/load_dtype.py ``framework_load_dtype``).

A tiny random Llama is saved in bf16 in a temporary folder (its config.json then says
``"dtype": "bfloat16"``, or ``"torch_dtype"`` before transformers 5) and loaded back on the CPU
in another Python (a throwaway virtual environment with the release to check): plain
``AutoModelForCausalLM.from_pretrained(path)`` (``--framework hf-trainer``: a Trainer script
loads so) and, where TRL is installed, ``SFTTrainer(model=path)`` (``--framework trl``). No GPU,
no download. Each parameter dtype found is printed beside trainmem's default for that release.

Usage::

    python3 -m venv /tmp/v && /tmp/v/bin/pip install torch==2.13.0 transformers==4.57.6
    PYTHONPATH=src python benchmarks/load_dtype_by_release.py --python /tmp/v/bin/python

Output, session 25 (helper loaddtype; the TRL venvs are helper trl26's of session 24, peft
0.21.2; the 4.48.1 one peft 0.13.2)::

    transformers 4.57.6, trl -         from_pretrained float32  (trainmem float32)
    transformers 4.48.1, trl 0.13.0    from_pretrained float32  (trainmem float32)
    transformers 4.48.1, trl 0.13.0    SFTTrainer      float32  (trainmem float32)
    transformers 4.57.6, trl 0.26.2    from_pretrained float32  (trainmem float32)
    transformers 4.57.6, trl 0.26.2    SFTTrainer      float32  (trainmem float32)
    transformers 5.24.0, trl 1.16.0    from_pretrained bfloat16 (trainmem bfloat16)
    transformers 5.24.0, trl 1.16.0    SFTTrainer      float32  (trainmem float32)

The ``chatglm-like`` cell (session 26, helper probecn): a model that builds its Linear with
``dtype=config.torch_dtype`` (modeling_chatglm.py ``_config_to_kwargs``), saved with
``torch_dtype`` float16, loaded with no dtype; the dtype the config holds at ``__init__``
(4.49.0: the string "float32"); venvs with only transformers (and torch 2.13.0)::

    transformers 4.30.2, trl -         chatglm-like    float16  (trainmem float16)
    transformers 4.37.1, trl -         chatglm-like    float16  (trainmem float16)
    transformers 4.48.1, trl -         chatglm-like    float16  (trainmem float16)
    transformers 4.49.0, trl -         chatglm-like    float32  (trainmem float32)
    transformers 4.57.6, trl -         chatglm-like    float32  (trainmem float32)
    transformers 5.24.0, trl -         chatglm-like    float16  (trainmem float16)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

REAL_RUN = r"""
import json, sys, tempfile
import torch, transformers
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
path = tempfile.mkdtemp()
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
def dtypes(model):
    return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
out = {"transformers": transformers.__version__, "trl": None,
       "from_pretrained": dtypes(transformers.AutoModelForCausalLM.from_pretrained(path))}
try:
    import trl
except ImportError:
    trl = None
if trl is not None:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, "hello": 3, "world": 4}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), bf16=True, use_cpu=True,
                         report_to=[], max_steps=1, save_strategy="no")
    trainer = trl.SFTTrainer(model=path, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": ["hello world"] * 4}))
    out["trl"] = trl.__version__
    out["sft_trainer"] = dtypes(trainer.model)

class GlmLikeConfig(transformers.PretrainedConfig):
    model_type = "glm_like"


class GlmLike(transformers.PreTrainedModel):
    # modeling_chatglm.py _config_to_kwargs: every module built with dtype=config.torch_dtype
    config_class = GlmLikeConfig

    def __init__(self, config):
        super().__init__(config)
        dtype = getattr(config, "torch_dtype", None)
        self.built_in = str(dtype).removeprefix("torch.")
        dtype = dtype if isinstance(dtype, torch.dtype) else None  # 4.49.0: a string
        self.dense = torch.nn.Linear(8, 8, dtype=dtype)
        self.post_init()


glm = tempfile.mkdtemp()
GlmLike(GlmLikeConfig(torch_dtype="float16")).save_pretrained(glm)
loaded = GlmLike.from_pretrained(glm)
out["remote_code"] = [loaded.built_in]
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", nargs="+", default=[sys.executable])
    args = parser.parse_args()
    from trainmem.specs.load_dtype import framework_load_dtype
    from trainmem.specs.training import TrainingConfig

    for python in args.python:
        run = subprocess.run(
            [python, "-c", REAL_RUN], capture_output=True, text=True, check=True
        ).stdout.strip()
        real = json.loads(run.splitlines()[-1])
        version = str(real["transformers"]).split(".dev")[0]
        cells: list[tuple[str, str, list[str], str, str | None]] = [
            ("from_pretrained", "hf-trainer", real["from_pretrained"], "bfloat16", None)
        ]
        if real["trl"]:
            cells.append(("SFTTrainer", "trl", real["sft_trainer"], "bfloat16", None))
        # a model built in config.torch_dtype, saved float16 (ChatGLM's remote code)
        cells.append(("chatglm-like", "hf-trainer", real["remote_code"], "float16", "chatglm"))
        for what, framework, found, saved, model_type in cells:
            t = TrainingConfig(
                framework=framework,
                transformers_version=version,
                trl_version=real["trl"] if framework == "trl" else None,
            )
            rule = framework_load_dtype(t, saved, model_type)
            ours = rule.dtype if rule else "-"
            print(
                f"transformers {version}, trl {real['trl'] or '-':<9} {what:<15} "
                f"{','.join(found):<8} (trainmem {ours})"
            )


if __name__ == "__main__":
    main()
