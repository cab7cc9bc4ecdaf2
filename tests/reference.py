"""A tiny training run that any strategy executes unchanged, and the data it trains on.

The same ``train`` runs on every rank of a multi-process strategy and, with ``strategy="single"``
and the combined batch, as the single-process reference the others must match.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp

FEATURES = 8


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def make_dataset(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.linspace(-1, 1, FEATURES).unsqueeze(1)
    y = x @ w + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def snapshot(engine: tp.Engine, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    params = {k: v.detach().cpu().clone() for k, v in engine.unwrap(model).state_dict().items()}
    opt_state = {
        f"{i}.{k}": v.detach().cpu().clone()
        for i, s in optimizer.state_dict()["state"].items()
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    return {"params": params, "optimizer": opt_state}


def train(
    strategy: str = "auto",
    precision: str | None = None,
    steps: int = 10,
    global_batch: int = 16,
    lr: float = 3e-2,
    inf_at_step: int | None = None,
    save_to: str | None = None,
    precision_options: dict[str, Any] | None = None,
    accumulate: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps of AdamW on the global batch split over the ranks.

    With ``accumulate > 1`` each rank's batch is split into micro-batches whose gradients are
    accumulated under ``engine.no_sync`` before one optimizer step.
    """
    with tp.Engine(
        strategy=strategy, precision=precision, precision_options=precision_options, **options
    ) as engine:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model, optimizer = engine.setup(model, optimizer)
        loader = DataLoader(
            make_dataset(steps * global_batch), batch_size=global_batch // engine.world_size
        )
        loader = engine.setup_dataloader(loader)
        losses, skipped, scales, checksums = [], [], [], []
        for step, (x, y) in enumerate(loader):
            micro = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
            parts = []
            for i, (xs, ys) in enumerate(micro):
                with engine.no_sync(model, enabled=i < len(micro) - 1):
                    part = torch.nn.functional.mse_loss(model(xs), ys) / len(micro)
                    if inf_at_step == step and engine.rank == 0:
                        part = part * float("inf")
                    engine.backward(part)
                parts.append(part.detach())
            loss = torch.stack(parts).sum()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
            skipped.append(optimizer.step_was_skipped)
            checksums.append(sum(p.double().sum().item() for p in model.parameters()))
            scaler = next((p.scaler for p in engine.plugins if getattr(p, "scaler", None)), None)
            scales.append(scaler.get_scale() if scaler is not None else None)
        if save_to is not None:
            engine.save(save_to, {"model": model, "optimizer": optimizer, "step": steps})
        return {
            "losses": losses,
            "skipped": skipped,
            "scales": scales,
            "checksums": checksums,
            "strategy": engine.strategy,
            "world_size": engine.world_size,
            **snapshot(engine, model, optimizer),
        }
