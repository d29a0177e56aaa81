"""Trace the GPU memory of one training step of a hand-written nn.Module, without a GPU.

Run:  python examples/trace_custom_module.py

``build_model`` runs under ``torch.device("meta")`` and the step runs on fake tensors, so this
works for models far larger than the machine's RAM.
"""

from __future__ import annotations

import torch
from torch import nn

import trainmem.trace
from trainmem.specs.training import TrainingConfig

VOCAB, WIDTH, LAYERS, SEQ = 1000, 256, 4, 128


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # [b, s, vocab] logits


def make_batch(training: TrainingConfig) -> dict[str, torch.Tensor]:
    """One micro-batch: keyword arguments of ``TinyLM.forward`` (fake tensors at trace time)."""
    return {"ids": torch.randint(0, VOCAB, (training.micro_batch_size, SEQ))}


def loss_fn(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss; the ids double as labels."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["ids"][:, 1:].flatten())


def main() -> None:
    training = TrainingConfig(micro_batch_size=8, seq_len=SEQ, precision="bf16-mixed")
    est = trainmem.trace.trace(
        TinyLM,
        make_batch,
        training=training,
        loss_fn=loss_fn,
    )
    print(f"peak allocated: {est.breakdown.allocated_bytes:,} B in {est.peak_phase}")
    for key, value in est.breakdown.as_dict().items():
        print(f"  {key:18s} {value:>14,} B")
    print("activations by module (end of forward):")
    for module, n in list(est.details["activation_bytes_by_module"].items())[:5]:
        print(f"  {module:28s} {n:>12,} B")


if __name__ == "__main__":
    main()
