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
    **options: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps of AdamW on the global batch split over the ranks."""
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
            loss = torch.nn.functional.mse_loss(model(x), y)
            if inf_at_step == step and engine.rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
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
