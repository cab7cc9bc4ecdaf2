"""An in-house plugin in your own code: a NaN guard that wraps any backend, registered in one line.

    torchplug launch -n 2 --strategy ddp examples/inhouse_plugin.py
    torchplug launch -n 2 --strategy fsdp examples/inhouse_plugin.py

``NaNGuard`` wraps two hooks (``wrapper=True``): ``torchplug_backward`` checks the loss on every
rank, and ``torchplug_optimizer_step`` skips the backend's update everywhere when any rank's
loss was inf or NaN (whatever the backend: the gradients may live in DDP buckets, FSDP shards or
DeepSpeed partitions, but the loss is the same thing everywhere). The script injects one bad
batch to show it working. The same class in a package, listed under
``[project.entry-points.torchplug]``, would be installable with ``pip``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
from torchplug.plugin import hookimpl


class NaNGuard:
    """Skip an optimizer step (on every rank) after a backward of a non-finite loss."""

    def __init__(self) -> None:
        self.skipped = 0
        self._bad = False

    @hookimpl(wrapper=True)
    def torchplug_backward(self, engine, loss, model):
        bad = not bool(torch.isfinite(loss.detach()).all())
        # A collective: every rank learns whether any rank's loss was bad, and skips with it.
        self._bad = engine.reduce(torch.tensor(float(bad)), "max").item() > 0
        return (yield)  # the backend's own backward runs here

    @hookimpl(wrapper=True)
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        with engine.skipping_updates(optimizer, self._bad):
            stepped = yield  # the backend's own step runs here, updating nothing if bad
        if self._bad:
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
