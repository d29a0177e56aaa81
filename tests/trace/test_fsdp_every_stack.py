"""FSDP wraps the layers of every stack of a transformers model (both of an encoder-decoder's,
a vision-language model's vision blocks and decoder layers), the classes accelerate's FSDP
auto-wrap takes from ``_no_split_modules``; before, only the longest ``nn.ModuleList`` was a
unit and the other stack stayed in the root's, its gradients unsharded to the end of the
backward (a Mistral-3 of 23 B parameters over 8 ranks: 133 GiB allocated, 86 GiB with both)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from trainmem.specs.hf import load_hf_config  # noqa: E402
from trainmem.trace.hf_model import build_hf_model  # noqa: E402
from trainmem.trace.lora import layer_stack, wrapped_blocks  # noqa: E402

MODELS = Path(__file__).parents[1] / "models"


@pytest.mark.parametrize(
    ("config", "stacks"),
    [
        # WhisperEncoderLayer x 2 in model.encoder.layers, WhisperDecoderLayer x 2 in .decoder
        ("whisper.json", {"model.encoder.layers": 2, "model.decoder.layers": 2}),
        # CLIPEncoderLayer in the vision tower, LlamaDecoderLayer in the language model
        ("vlm/llava.json", None),
    ],
)
def test_every_stack_is_a_unit(config: str, stacks: dict[str, int] | None) -> None:
    model = build_hf_model(load_hf_config(str(MODELS / config)))
    names = {id(m): n for n, m in model.named_modules()}
    units = wrapped_blocks(model, "fsdp")
    parents: dict[str, int] = {}
    for unit in units:
        parent = names[id(unit)].rsplit(".", 1)[0]
        parents[parent] = parents.get(parent, 0) + 1
    if stacks is not None:
        assert parents == stacks
    else:
        assert len(parents) == 2, parents  # the vision tower's and the language model's
    # the one stack the longest-list rule found is among them
    longest, layers = layer_stack(model)
    assert parents[longest] == len(layers)


def test_a_model_that_declares_no_layer_keeps_the_longest_list() -> None:
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.short = torch.nn.ModuleList([Block()])
            self.long = torch.nn.ModuleList([Block(), Block(), Block()])

    net = Net()
    assert wrapped_blocks(net, "fsdp") == list(net.long)
