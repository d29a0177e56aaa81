"""litgpt's output head of its own (``FrameworkConventions.untied_output_head``): litgpt's
``GPT`` builds ``lm_head = nn.Linear(n_embd, padded_vocab_size)`` beside ``transformer.wte``
and never ties them (litgpt/model.py @43c44323), where the Hugging Face config ties them.

Expected by hand: GPT-2 ties its head (``tie_word_embeddings`` true), V = 50,257, h = 768, so
litgpt's model has V x h = 38,597,376 parameters more, 2 bytes each in bf16-true
(77,194,752 bytes of weights); Llama-2-7B has its own head in both, so nothing changes.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

GPT2_HEAD = 50_257 * 768


def _counts(model: str, framework: str) -> tuple[int, int]:
    training = TrainingConfig(
        micro_batch_size=1, seq_len=64, precision="bf16-true", framework=framework
    )
    est = estimate(model, training, engine="analytic", simulate_allocator=False)
    return est.num_parameters, est.model_states_bytes["parameters"]


@pytest.mark.parametrize(("model", "extra"), [("gpt2", GPT2_HEAD), ("llama-2-7b", 0)])
def test_litgpt_builds_its_own_output_head(model: str, extra: int) -> None:
    hf_params, hf_bytes = _counts(model, "pytorch-amp")
    lit_params, lit_bytes = _counts(model, "litgpt")
    assert lit_params - hf_params == extra
    assert lit_bytes - hf_bytes == 2 * extra
