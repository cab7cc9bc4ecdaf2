"""A model for the memory estimate tests, and one AdamW step whose live bytes are counted on
each rank (importable by the rank pool; torchplug.features.memory holds the counting, shared with
benchmarks/memory.py)."""

from __future__ import annotations

import torch

import torchplug as tp
from torchplug.features import memory


class EmbeddingMLP(torch.nn.Module):
    """Odd first dimensions (37, 333, 321, 5 rows on 2 ranks: FSDP2 pads them), a LayerNorm,
    an embedding, and parameters on both sides of ZeRO-3's 100,000-element persistence line."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.fc1 = torch.nn.Linear(24, 333)
        self.norm = torch.nn.LayerNorm(333)
        self.fc2 = torch.nn.Linear(333, 321)  # 106,893 weights: partitioned under ZeRO-3
        self.out = torch.nn.Linear(321, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.fc1(self.emb(tokens))))
        return self.out(torch.relu(self.fc2(h))).mean(dim=1)


def build() -> EmbeddingMLP:
    return EmbeddingMLP()


def measure(strategy: str, precision: str | None = None, **options) -> dict:
    """This rank's live bytes at the fullest point of a step under ``strategy``: after one AdamW
    step (its state made) and the next backward (the gradients made; DeepSpeed ZeRO-1/2 free
    their gradient partitions in the step)."""
    torch.manual_seed(0)
    before = memory.live_storages()
    engine = tp.Engine(strategy, precision, timeout=120.0, **options)
    model = build()
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 37, (8, 6), generator=torch.Generator().manual_seed(engine.rank))
    targets = torch.randint(0, 5, (8,))
    for step in range(2):
        with engine.autocast():
            loss = torch.nn.functional.cross_entropy(model(tokens).float(), targets)
        engine.backward(loss)
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
    del loss
    counted = memory.count_live(model, optimizer, before)
    engine.close()
    return counted
