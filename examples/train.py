"""Train a small classifier on two interleaved spirals, on any torchplug strategy.

    torchplug launch -n 2 --strategy ddp examples/train.py
    python examples/train.py                      # one process, strategy "auto" -> single
    torchplug launch -n 2 --strategy ddp --precision bf16 examples/train.py --epochs 3

torchplug's flags go before the script; what follows the script is the script's own. The script
asks for ``Engine()`` ("auto") and leaves the choice to the launcher (or ``TORCHPLUG_STRATEGY``,
or a config file), so the same file runs everywhere.

The data set is made by the script (no downloads): 4,096 points on two spirals with noise; the
task is telling the spirals apart. The loop is plain PyTorch; only the lines marked ``engine``
are torchplug.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def spirals(n: int = 4096, noise: float = 0.08, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    t = torch.rand(n, generator=g) * 2 * math.pi + 0.5
    sign = labels.float() * 2 - 1
    points = torch.stack([sign * t * torch.cos(t), sign * t * torch.sin(t)], dim=1) / (2 * math.pi)
    points += noise * torch.randn(n, 2, generator=g)
    return TensorDataset(points, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", default=None, help="checkpoint directory to write at the end")
    args = parser.parse_args()

    engine = tp.Engine()  # engine: strategy and precision from the launcher, env or config
    engine.print(f"{engine}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 128),
        torch.nn.SiLU(),
        torch.nn.Linear(128, 128),
        torch.nn.SiLU(),
        torch.nn.Linear(128, 2),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = engine.setup(model, optimizer)  # engine
    loader = DataLoader(spirals(), batch_size=args.batch_size, shuffle=True)
    loader = engine.setup_dataloader(loader)  # engine

    for epoch in range(args.epochs):
        start, total, correct, seen = time.perf_counter(), 0.0, 0, 0
        for points, labels in loader:
            logits = model(points)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            engine.backward(loss)  # engine
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            seen += len(labels)
        stats = engine.reduce(torch.tensor([total, correct, seen], dtype=torch.float64), "sum")
        elapsed = engine.reduce(time.perf_counter() - start, "max").item()
        engine.print(
            f"epoch {epoch + 1:2d}  loss {stats[0] / stats[2]:.4f}  "
            f"accuracy {stats[1] / stats[2]:.3f}  {stats[2] / elapsed:,.0f} samples/s"
        )

    if args.save:
        engine.save(args.save, {"model": model, "optimizer": optimizer, "epoch": args.epochs})
        engine.print(f"saved {args.save}")
    engine.close()


if __name__ == "__main__":
    main()
