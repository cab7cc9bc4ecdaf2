"""An in-house plugin in your own code: a NaN guard that wraps any backend, registered in one line.

    torchplug launch -n 2 --strategy ddp examples/inhouse_plugin.py
    torchplug launch -n 2 --strategy fsdp examples/inhouse_plugin.py

``NaNGuard`` wraps the ``torchplug_optimizer_step`` hook (``wrapper=True``): before the
backend's step runs it checks the gradients on every rank, and skips the step everywhere when
any rank has a non-finite gradient. The script injects one bad batch to show it working. The
same class in a package, listed under ``[project.entry-points.torchplug]``, would be
installable with ``pip``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


class NaNGuard:
    """Skip an optimizer step (on every rank) when any gradient is inf or NaN."""

    def __init__(self) -> None:
        self.skipped = 0

    @tp.hookimpl(wrapper=True)
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        finite = all(
            torch.isfinite(p.grad).all()
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        )
        bad = engine.reduce(torch.tensor(0.0 if finite else 1.0), "max").item() > 0
        with engine.skipping_updates(optimizer, bad):
            stepped = yield  # the backend's own step runs here
        if bad:
            self.skipped += 1
            return False
        return stepped


def main() -> None:
    tp.seed_everything(0)
    guard = NaNGuard()
    engine = tp.Engine(plugins=[guard])  # or tp.register(guard) for every Engine
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.setup(model, optimizer)
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True)
    loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=16))
    for i, (xb, yb) in enumerate(loader):
        if i == 3 and engine.rank == engine.world_size - 1:
            xb = xb * float("nan")  # one poisoned batch on one rank
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = engine.full_state(model)["model"]
    finite = all(torch.isfinite(t).all() for t in weights.values())
    engine.print(f"steps skipped by the guard: {guard.skipped}; weights finite: {finite}")
    engine.close()
    if guard.skipped != 1 or not finite:
        raise SystemExit("the NaN guard did not skip exactly the poisoned step")


if __name__ == "__main__":
    main()
