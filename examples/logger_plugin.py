"""A logger plugin: a tracker added by name exactly as a backend is.

    torchplug launch -n 2 --strategy ddp examples/logger_plugin.py
    cd examples && torchplug launch -n 2 --plugin markdown_logger --logger markdown digits.py

``markdown_logger.py`` announces a ``markdown`` logger through ``torchplug_register_loggers``;
this script registers it in one line and selects it by name with ``Engine(loggers=[...])``.
The second command shows the launcher route: ``--plugin`` imports the module in every process
and ``--logger`` selects it for a script that names no logger itself.
"""

from __future__ import annotations

import markdown_logger
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def main() -> None:
    tp.register(markdown_logger)  # one line: its loggers are now selectable by name
    tp.seed_everything(0)
    engine = tp.Engine(loggers=["markdown", "csv"], log_dir="logs/logger_plugin")
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.setup(model, optimizer)
    x = torch.randn(128, 3)
    loader = engine.setup_dataloader(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), 16))
    for epoch in range(5):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        engine.log({"loss": engine.reduce(loss.detach(), "mean")}, step=epoch)
    engine.print(f"loggers {engine.loggers.names}; wrote to {engine.loggers.log_dir}")
    engine.close()


if __name__ == "__main__":
    main()
