"""What the conformance kit runs on every rank: a tiny training run and collective checks.

Module-level functions, so that :class:`~torchplug.testing.RankPool` workers can import them.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
from torchplug.core import manager

FEATURES = 8
MAX_STEPS = 20
GLOBAL_BATCH = 16


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def make_dataset(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.linspace(-1, 1, FEATURES).unsqueeze(1)
    y = x @ w + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def register(plugins: Sequence[str]) -> None:
    """Import and register in-house plugin modules by name (in every rank, before the Engine)."""
    registry = manager.get_registry()
    for name in plugins:
        if not registry.pm.has_plugin(name):
            tp.register(importlib.import_module(name), name=name)


def full_state(engine: tp.Engine, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Gathered parameters and optimizer tensors by name."""
    state = engine.full_state(model, optimizer)
    optim = {
        f"{name}.{k}": v
        for name, values in state["optimizer"]["state"].items()
        for k, v in values.items()
        if isinstance(v, torch.Tensor)
    }
    return {"params": state["model"], "optimizer": optim}


def train(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    steps: int = 10,
    first_step: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    lr: float = 3e-2,
) -> dict[str, Any]:
    """``steps`` steps of AdamW on the global batch split over the ranks; optional save/resume."""
    register(plugins)
    with tp.Engine(strategy, **(options or {})) as engine:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model, optimizer = engine.setup(model, optimizer)
        if load_from is not None:
            state = {"model": model, "optimizer": optimizer, "step": 0}
            engine.load(load_from, state)
        loader = DataLoader(
            make_dataset(MAX_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // engine.world_size
        )
        losses = []
        for step, (x, y) in enumerate(engine.setup_dataloader(loader)):
            if step < first_step:
                continue
            if step >= first_step + steps:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        if save_to is not None:
            engine.save(
                save_to, {"model": model, "optimizer": optimizer, "step": first_step + steps}
            )
        return {
            "losses": losses,
            "world_size": engine.world_size,
            **full_state(engine, model, optimizer),
        }


def load(
    strategy: str, path: str, plugins: Sequence[str] = (), options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load a checkpoint into a freshly initialised (differently seeded) model and optimizer."""
    register(plugins)
    with tp.Engine(strategy, **(options or {})) as engine:
        model = make_model(seed=123)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        engine.load(path, state)
        return {"step": state["step"], **full_state(engine, model, optimizer)}


def collectives(
    strategy: str, plugins: Sequence[str] = (), options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """reduce (every op) and gather of rank-dependent values."""
    register(plugins)
    with tp.Engine(strategy, **(options or {})) as engine:
        value = torch.tensor([engine.rank + 1.0, -2.0 * (engine.rank + 1)])
        out: dict[str, Any] = {
            op: engine.reduce(value, op).cpu().tolist() for op in ("sum", "mean", "max", "min")
        }
        out["gather"] = engine.gather(value).cpu().tolist()
        out["rank"], out["world_size"] = engine.rank, engine.world_size
        engine.barrier()
        return out
