"""``engine.accumulate`` over micro-batches on the ranks, and the one large batch it equals."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def accumulated_training(steps: int, strategy: str = "ddp") -> list[float]:
    """``strategy`` with accumulate(steps) over micro-batches of 2 per rank."""
    with tp.Engine(strategy, timeout=60.0) as engine:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)
        loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=2))
        skipped = []
        for xb, yb in loader:
            with engine.accumulate(model, steps=steps):
                engine.backward(torch.nn.functional.mse_loss(model(xb), yb))
                optimizer.step()
                skipped.append(optimizer.step_was_skipped)
                optimizer.zero_grad()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return [*params.tolist(), skipped]


def large_batch_reference() -> list[float]:
    """Plain PyTorch, two steps on the global batches of 8 (4 micro-batches of 2 over 2 ranks;
    DistributedSampler interleaves, so each step sees 8 consecutive items)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)
    for start in (0, 8):
        torch.nn.functional.mse_loss(model(x[start : start + 8]), y[start : start + 8]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
