"""Three training scripts written by others, ported to torchplug as a user would port them.

Equivalents of the pytorch/examples DDP tutorial (``ddp_tutorial.py``), Lightning Fabric's image
classifier (``image_classifier/train_fabric.py``) and Accelerate's
``by_feature/checkpointing.py``: the same models, optimizers, schedulers (made where the original
makes them), data handling and checkpointing, on data made here. Each function runs unchanged
under any strategy and returns what the test compares with the ``ddp`` run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def _result(engine: tp.Engine, model: nn.Module, losses: list[float], **extra: Any) -> dict:
    params = engine.full_state(model)["model"]
    return {"losses": losses, "params": {k: v.float() for k, v in params.items()}, **extra}


# -- pytorch/examples: distributed/ddp-tutorial-series style ToyModel -----------------------------


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def ddp_tutorial(strategy: str, precision: str | None = None, steps: int = 8) -> dict:
    """demo_basic: SGD(lr=0.001) on MSELoss of random inputs, each rank its own batch."""
    with tp.Engine(strategy, precision=precision) as engine:
        torch.manual_seed(0)
        model = ToyModel()
        loss_fn = nn.MSELoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        model, optimizer = engine.setup(model, optimizer)
        g = torch.Generator().manual_seed(100 + engine.rank)  # each rank's own data
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            outputs = model(torch.randn(20, 10, generator=g).to(engine.device))
            labels = torch.randn(20, 5, generator=g).to(engine.device)
            loss = loss_fn(outputs, labels)
            engine.backward(loss)
            optimizer.step()
            losses.append(engine.reduce(loss.detach().float(), "mean").item())
        return _result(engine, model, losses)


# -- Lightning Fabric: examples/fabric/image_classifier/train_fabric.py ---------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(torch.relu(self.fc1(x)))
        return torch.log_softmax(self.fc2(x), dim=1)


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 12, 12, generator=g) * 0.5
    images[torch.arange(n), 0, labels, labels] += 3.0  # a learnable signal
    return TensorDataset(images, labels)


def fabric_classifier(strategy: str, precision: str | None = None, epochs: int = 2) -> dict:
    """Adadelta(lr=1.0), StepLR(gamma=0.7) made after setup, a shuffled train loader, dropout,
    an accuracy reduced over ranks; seeded once on every rank (seed_everything)."""
    with tp.Engine(strategy, precision=precision) as engine:
        torch.manual_seed(1)
        train_loader = engine.setup_dataloader(
            DataLoader(_images(256, 2), batch_size=16, shuffle=True)
        )
        test_loader = engine.setup_dataloader(DataLoader(_images(64, 3), batch_size=32))
        model = Net()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        model, optimizer = engine.setup(model, optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        losses, accuracies = [], []
        for _epoch in range(epochs):
            model.train()
            for data, target in train_loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.nll_loss(model(data), target)
                engine.backward(loss)
                optimizer.step()
                losses.append(engine.reduce(loss.detach().float(), "mean").item())
            scheduler.step()
            model.eval()
            correct = torch.zeros((), device=engine.device)
            with torch.no_grad():
                for data, target in test_loader:
                    correct += (model(data).argmax(dim=1) == target).sum()
            accuracies.append(engine.reduce(correct, "sum").item() / 64)
        return _result(engine, model, losses, accuracies=accuracies)


# -- Accelerate: examples/by_feature/checkpointing.py ---------------------------------------------


def _linear_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> Any:
    """transformers' get_linear_schedule_with_warmup."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def accelerate_checkpointing(
    strategy: str,
    checkpoint_dir: str,
    precision: str | None = None,
    epochs: int = 3,
    stop_after_epoch: int | None = None,
    resume_from: str | None = None,
) -> dict:
    """AdamW + linear warmup scheduler made *before* setup (accelerator.prepare), state saved at
    every epoch end (model, optimizer, scheduler, epoch), and a run resumed from a saved epoch."""
    with tp.Engine(strategy, precision=precision) as engine:
        torch.manual_seed(42)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(192, 16, generator=g)
        y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
        model = Classifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        steps_per_epoch = math.ceil(len(loader) / engine.world_size)
        scheduler = _linear_warmup(optimizer, 5, epochs * steps_per_epoch)
        model, optimizer = engine.setup(model, optimizer)
        loader = engine.setup_dataloader(loader)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}
        first_epoch = 0
        if resume_from is not None:
            engine.load(resume_from, state)
            first_epoch = state["epoch"] + 1
        losses = []
        for epoch in range(first_epoch, epochs):
            loader.set_epoch(epoch)
            for data, target in loader:
                loss = torch.nn.functional.cross_entropy(model(data), target)
                engine.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                losses.append(engine.reduce(loss.detach().float(), "mean").item())
            state["epoch"] = epoch
            engine.save(f"{checkpoint_dir}/epoch_{epoch}", state)
            if stop_after_epoch == epoch:
                break
        return _result(engine, model, losses, lr=optimizer.param_groups[0]["lr"])
